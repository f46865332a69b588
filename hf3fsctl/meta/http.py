"""`HttpMetadataClient`: the `MetadataClient` for `http(s)://HOST:PORT` (`hf3fsctl serve`).

- Transport: `HttpConnection` (`meta/http_transport.py`, a minimal HTTP/1.1 client over
  a socket: ~0.04 ms of CPU per call where `http.client` took ~0.18 ms), one keep-alive
  connection per calling thread (thread-safe without a pool lock). A connection the server closed while idle is
  noticed before it is reused (the socket reads as EOF) and replaced, so even calls
  that are never retried do not fail on a stale connection.
- A deadline of `timeout_s` on every call, retries included: it bounds the connect and
  every socket read and write.
- Idempotent calls (lookup, locate, invalidate, register_*, get/list, stats, health) are retried
  twice with a short backoff on connection errors, timeouts and 5xx, while the deadline
  allows. allocate/commit/release/evict are sent once: a lost answer is a
  `MetadataUnavailable`, never a silent second allocation.
- Errors: connection failures, timeouts and 5xx → `MetadataUnavailable`; 401/403 →
  `AuthError`; other 4xx → the server's typed error (`ErrorResponse.error`) with its
  reason.
- Hot path: the bodies of key lists are written by hand (a join, after a C-speed check
  that no key needs JSON escaping; else the stdlib `json`), ~15× cheaper than
  `json.dumps` for a 1,000-key lookup; responses are parsed with pydantic's Rust JSON
  validator in one pass (`model_validate_json`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

from pydantic import BaseModel, TypeAdapter

from hf3fsctl.errors import (
    AuthError,
    ConfigError,
    Hf3fsctlError,
    InvalidRequest,
    MetadataUnavailable,
    NamespaceConflict,
    NotFound,
)
from hf3fsctl.meta.http_transport import HttpConnection
from hf3fsctl.meta.models import (
    AllocateResult,
    Allocation,
    CapacityInfo,
    CommitItem,
    CountResponse,
    DropNamespacesResult,
    EntryInfo,
    EvictRequest,
    EvictResult,
    InvalidateItem,
    LocateResponse,
    Location,
    LookupResponse,
    NamespaceInfo,
    PinInfo,
    PinResult,
    RankFile,
    StoreStats,
    page_triples,
)

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_ERRORS: dict[str, type[Hf3fsctlError]] = {
    "InvalidRequest": InvalidRequest,
    "NotFound": NotFound,
    "NamespaceConflict": NamespaceConflict,
    "AuthError": AuthError,
    "MetadataUnavailable": MetadataUnavailable,
}
_BACKOFF_S = (0.05, 0.2)
_NAMESPACES = TypeAdapter(list[NamespaceInfo])
_ENTRIES = TypeAdapter(list[EntryInfo])
_PINS = TypeAdapter(list[PinInfo])


def _json_strings(strings: Sequence[str]) -> str:
    """A JSON array of `strings`: joined by hand when all are ASCII letters and digits.

    That check (one C pass over the joined bytes) covers every block key and costs
    ~30 µs for 1,000 keys; `json.dumps` (the fallback, for anything else) ~500 µs.
    """
    if not strings:
        return "[]"
    try:
        plain = "".join(strings)
    except TypeError:
        return json.dumps(list(strings))
    if plain.isascii() and plain.encode().isalnum():
        return '["' + '","'.join(strings) + '"]'
    return json.dumps(list(strings))


class HttpMetadataClient:
    """Talks to `hf3fsctl serve`.

    Args:
        url: `http://HOST:PORT` or `https://…` (a path prefix is kept).
        timeout_s: deadline of every call, retries included.
        token: bearer token, when the server requires one.
    """

    def __init__(self, url: str, *, timeout_s: float = 2.0, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"metadata.url: {url!r} is not http(s)://HOST:PORT")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        self._local = threading.local()
        self._open: set[HttpConnection] = set()
        self._open_lock = threading.Lock()

    # --- transport ---------------------------------------------------------------------

    def _connection(self) -> HttpConnection:
        """This thread's connection (reconnected if the server closed it while idle)."""
        conn: HttpConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = HttpConnection(self._host, self._port, tls=self._https)
            self._local.conn = conn
            with self._open_lock:
                self._open.add(conn)
        elif conn.is_stale():
            conn.close()
        return conn

    def _drop_connection(self) -> None:
        conn: HttpConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._open_lock:
                self._open.discard(conn)

    def _call(
        self,
        method: str,
        path: str,
        body: str | None = None,
        *,
        idempotent: bool,
        params: dict[str, Any] | None = None,
    ) -> bytes:
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        content = None if body is None else body.encode()
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError("deadline passed before the request")
                status, data = self._connection().request(
                    method, target, self._headers, content, remaining
                )
            except OSError as exc:
                self._drop_connection()
                failure = f"{type(exc).__name__}: {exc}"
            else:
                if status < 400:
                    return data
                if status < 500:
                    raise self._client_error(status, data)
                failure = f"HTTP {status}: {self._reason(data)}"
            if not idempotent or attempt >= len(_BACKOFF_S):
                break
            pause = _BACKOFF_S[attempt]
            if time.monotonic() + pause >= deadline:
                break
            attempt += 1
            logger.debug("metadata %s %s failed (%s); retry %d", method, path, failure, attempt)
            time.sleep(pause)
        raise MetadataUnavailable(f"metadata service {self.url} {method} {path}: {failure}")

    @staticmethod
    def _reason(data: bytes) -> str:
        try:
            parsed = json.loads(data)
        except ValueError:
            return data[:200].decode(errors="replace")
        if isinstance(parsed, dict):
            return str(parsed.get("detail", parsed))
        return str(parsed)

    def _client_error(self, status: int, data: bytes) -> Hf3fsctlError:
        reason = self._reason(data)
        if status in (401, 403):
            return AuthError(f"metadata service {self.url} refused the token: {reason}")
        try:
            parsed = json.loads(data)
            name = parsed.get("error", "") if isinstance(parsed, dict) else ""
        except ValueError:
            name = ""
        error = _ERRORS.get(name, NotFound if status == 404 else InvalidRequest)
        return error(reason)

    def _post(self, path: str, body: str, model: type[M], idempotent: bool) -> M:
        return model.model_validate_json(self._call("POST", path, body, idempotent=idempotent))

    @staticmethod
    def _dumps(body: dict[str, Any]) -> str:
        return json.dumps(body, separators=(",", ":"))

    # --- protocol ----------------------------------------------------------------------

    def register_namespace(self, namespace: str, manifest: dict[str, Any]) -> NamespaceInfo:
        """Create a namespace, or return it if identical; `NamespaceConflict` if not."""
        body = self._dumps({"namespace": namespace, "manifest": manifest})
        return self._post("/v1/namespaces", body, NamespaceInfo, True)

    def register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        """Record one rank's page file; `NamespaceConflict` if it differs from before."""
        body = self._dumps({"namespace": namespace, "rank_file": rank_file.model_dump()})
        return self._post("/v1/ranks", body, NamespaceInfo, True)

    def get_namespace(self, namespace: str) -> NamespaceInfo:
        """One namespace; `NotFound` if absent."""
        raw = self._call("GET", f"/v1/namespaces/{namespace}", idempotent=True)
        return NamespaceInfo.model_validate_json(raw)

    def namespaces(self) -> list[NamespaceInfo]:
        """Every registered namespace."""
        return _NAMESPACES.validate_json(self._call("GET", "/v1/namespaces", idempotent=True))

    def lookup(self, namespace: str, keys: Sequence[str]) -> int:
        """Number of leading `keys` committed on every rank of the namespace."""
        body = f'{{"namespace":{json.dumps(namespace)},"keys":{_json_strings(keys)}}}'
        return self._post("/v1/lookup", body, LookupResponse, True).hits

    def locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        """Where each key's page is on `rank` (None if absent), with a read lease."""
        body = (
            f'{{"namespace":{json.dumps(namespace)},"rank":{int(rank)},'
            f'"keys":{_json_strings(keys)}}}'
        )
        return self._post("/v1/locate", body, LocateResponse, True).locations

    def allocate(
        self, namespace: str, rank: int, keys: Sequence[str], first_depth: int = 0
    ) -> AllocateResult:
        """Pages for keys not yet stored on `rank` (not retried)."""
        depth = f',"first_depth":{int(first_depth)}' if first_depth else ""
        body = (
            f'{{"namespace":{json.dumps(namespace)},"rank":{int(rank)},'
            f'"keys":{_json_strings(keys)}{depth}}}'
        )
        return self._post("/v1/allocate", body, AllocateResult, False)

    def commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        """Commit written pages; returns how many were committed (not retried)."""
        body = self._dumps(
            {
                "namespace": namespace,
                "rank": rank,
                "items": [
                    {"key": i.key, "page": i.page, "checksum": i.checksum, "size": i.size}
                    for i in items
                ],
            }
        )
        return self._post("/v1/commit", body, CountResponse, False).count

    def release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        """Give back pending allocations; returns how many were released (not retried)."""
        body = self._dumps(
            {
                "namespace": namespace,
                "rank": rank,
                "allocations": [{"key": a.key, "page": a.page} for a in allocations],
            }
        )
        return self._post("/v1/release", body, CountResponse, False).count

    def invalidate(
        self,
        namespace: str,
        rank: int,
        items: Sequence[Location | InvalidateItem | tuple[str, int, str]],
    ) -> int:
        """Drop keys whose page on `rank` was found corrupt (idempotent: retried)."""
        body = self._dumps(
            {
                "namespace": namespace,
                "rank": rank,
                "items": [
                    {"key": key, "page": page, "checksum": checksum}
                    for key, page, checksum in page_triples(items)
                ],
            }
        )
        return self._post("/v1/invalidate", body, CountResponse, True).count

    def evict(self, request: EvictRequest) -> EvictResult:
        """Evict entries by the request's criteria (not retried)."""
        return self._post("/v1/evict", request.model_dump_json(), EvictResult, False)

    def stats(self) -> StoreStats:
        """Usage and traffic of the store."""
        return StoreStats.model_validate_json(self._call("GET", "/v1/stats", idempotent=True))

    def list_entries(
        self, namespace: str | None = None, limit: int = 100, offset: int = 0
    ) -> list[EntryInfo]:
        """Entries, most recently used first."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if namespace is not None:
            params["namespace"] = namespace
        raw = self._call("GET", "/v1/entries", idempotent=True, params=params)
        return _ENTRIES.validate_json(raw)

    def capacity(self) -> CapacityInfo:
        """The store's recorded capacity and what its page files hold."""
        return CapacityInfo.model_validate_json(self._call("GET", "/v1/capacity", idempotent=True))

    def set_capacity(self, capacity_bytes: int) -> CapacityInfo:
        """Record the store's capacity (idempotent: retried)."""
        body = self._dumps({"capacity_bytes": capacity_bytes})
        return CapacityInfo.model_validate_json(
            self._call("PUT", "/v1/capacity", body, idempotent=True)
        )

    def pin(self, namespace: str, keys: Sequence[str], ttl_s: float | None = None) -> PinResult:
        """Keep keys out of LRU eviction (idempotent: retried)."""
        body = self._dumps({"namespace": namespace, "keys": list(keys), "ttl_s": ttl_s})
        return self._post("/v1/pins", body, PinResult, True)

    def unpin(self, namespace: str, keys: Sequence[str] | None = None) -> int:
        """Drop pins (all of the namespace's when `keys` is None); returns how many."""
        body = self._dumps({"namespace": namespace, "keys": None if keys is None else list(keys)})
        return self._post("/v1/unpin", body, CountResponse, True).count

    def list_pins(self, namespace: str | None = None, limit: int = 1000) -> list[PinInfo]:
        """Live pins, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if namespace is not None:
            params["namespace"] = namespace
        return _PINS.validate_json(self._call("GET", "/v1/pins", idempotent=True, params=params))

    def drop_namespaces(
        self, namespace_ids: Sequence[str], *, dry_run: bool = False
    ) -> DropNamespacesResult:
        """Remove namespaces' metadata (not retried)."""
        body = self._dumps({"namespaces": list(namespace_ids), "dry_run": dry_run})
        return self._post("/v1/namespaces/drop", body, DropNamespacesResult, False)

    def health(self) -> dict[str, Any]:
        """`/healthz` of the service; `MetadataUnavailable` when it does not answer."""
        data = json.loads(self._call("GET", "/healthz", idempotent=True))
        return dict(data) if isinstance(data, dict) else {"status": data}

    def close(self) -> None:
        """Close the connections of every thread."""
        with self._open_lock:
            connections, self._open = self._open, set()
        for conn in connections:
            conn.close()
        self._local = threading.local()
