"""`HttpMetadataClient`: the `MetadataClient` for `http(s)://HOST:PORT` (`hf3fsctl serve`).

- One pooled `httpx.Client` (keep-alive), thread-safe; a deadline of `timeout_s` on
  every call, retries included.
- Idempotent calls (lookup, locate, register_*, get/list, stats, health) are retried
  twice with a short backoff on connection errors, timeouts and 5xx, while the deadline
  allows. allocate/commit/release/evict are sent once: a lost answer is a
  `MetadataUnavailable`, never a silent second allocation.
- Errors: connection failures, timeouts and 5xx → `MetadataUnavailable`; 401/403 →
  `AuthError`; other 4xx → the server's typed error (`ErrorResponse.error`) with its
  reason.
- Hot path: request bodies are serialised with the stdlib `json`; responses are parsed
  with pydantic's Rust JSON validator in one pass (`model_validate_json`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, TypeAdapter

from hf3fsctl.errors import (
    AuthError,
    Hf3fsctlError,
    InvalidRequest,
    MetadataUnavailable,
    NamespaceConflict,
    NotFound,
)
from hf3fsctl.meta.models import (
    AllocateResult,
    Allocation,
    CommitItem,
    CountResponse,
    EntryInfo,
    EvictRequest,
    EvictResult,
    LocateResponse,
    Location,
    LookupResponse,
    NamespaceInfo,
    RankFile,
    StoreStats,
)

if TYPE_CHECKING:
    import httpx

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


class HttpMetadataClient:
    """Talks to `hf3fsctl serve`.

    Args:
        url: `http://HOST:PORT` (a path prefix is kept).
        timeout_s: deadline of every call, retries included.
        token: bearer token, when the server requires one.
    """

    def __init__(self, url: str, *, timeout_s: float = 2.0, token: str | None = None) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"content-type": "application/json", "accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    # --- transport ---------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        idempotent: bool,
        params: dict[str, Any] | None = None,
    ) -> bytes:
        import httpx

        content = None if body is None else json.dumps(body, separators=(",", ":"))
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise httpx.TimeoutException("deadline passed before the request")
                response = self._http.request(
                    method, path, content=content, params=params, timeout=remaining
                )
            except httpx.HTTPError as exc:
                failure: str = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 400:
                    return response.content
                if response.status_code < 500:
                    raise self._client_error(response)
                failure = f"HTTP {response.status_code}: {self._reason(response)}"
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
    def _reason(response: httpx.Response) -> str:
        try:
            data = response.json()
            return str(data.get("detail", data))
        except ValueError:
            return response.text[:200]

    def _client_error(self, response: httpx.Response) -> Hf3fsctlError:
        reason = self._reason(response)
        if response.status_code in (401, 403):
            return AuthError(f"metadata service {self.url} refused the token: {reason}")
        try:
            name = response.json().get("error", "")
        except (ValueError, AttributeError):
            name = ""
        error = _ERRORS.get(name, NotFound if response.status_code == 404 else InvalidRequest)
        return error(reason)

    def _post(self, path: str, body: dict[str, Any], model: type[M], idempotent: bool) -> M:
        return model.model_validate_json(self._call("POST", path, body, idempotent=idempotent))

    # --- protocol ----------------------------------------------------------------------

    def register_namespace(self, namespace: str, manifest: dict[str, Any]) -> NamespaceInfo:
        """Create a namespace, or return it if identical; `NamespaceConflict` if not."""
        body = {"namespace": namespace, "manifest": manifest}
        return self._post("/v1/namespaces", body, NamespaceInfo, True)

    def register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        """Record one rank's page file; `NamespaceConflict` if it differs from before."""
        body = {"namespace": namespace, "rank_file": rank_file.model_dump()}
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
        body = {"namespace": namespace, "keys": list(keys)}
        return self._post("/v1/lookup", body, LookupResponse, True).hits

    def locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        """Where each key's page is on `rank` (None if absent), with a read lease."""
        body = {"namespace": namespace, "rank": rank, "keys": list(keys)}
        return self._post("/v1/locate", body, LocateResponse, True).locations

    def allocate(
        self, namespace: str, rank: int, keys: Sequence[str], first_depth: int = 0
    ) -> AllocateResult:
        """Pages for keys not yet stored on `rank` (not retried)."""
        body = {"namespace": namespace, "rank": rank, "keys": list(keys)}
        if first_depth:
            body["first_depth"] = first_depth
        return self._post("/v1/allocate", body, AllocateResult, False)

    def commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        """Commit written pages; returns how many were committed (not retried)."""
        body = {
            "namespace": namespace,
            "rank": rank,
            "items": [
                {"key": i.key, "page": i.page, "checksum": i.checksum, "size": i.size}
                for i in items
            ],
        }
        return self._post("/v1/commit", body, CountResponse, False).count

    def release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        """Give back pending allocations; returns how many were released (not retried)."""
        body = {
            "namespace": namespace,
            "rank": rank,
            "allocations": [{"key": a.key, "page": a.page} for a in allocations],
        }
        return self._post("/v1/release", body, CountResponse, False).count

    def evict(self, request: EvictRequest) -> EvictResult:
        """Evict entries by the request's criteria (not retried)."""
        return self._post("/v1/evict", request.model_dump(), EvictResult, False)

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

    def health(self) -> dict[str, Any]:
        """`/healthz` of the service; `MetadataUnavailable` when it does not answer."""
        data = json.loads(self._call("GET", "/healthz", idempotent=True))
        return dict(data) if isinstance(data, dict) else {"status": data}

    def close(self) -> None:
        """Close pooled connections."""
        self._http.close()
