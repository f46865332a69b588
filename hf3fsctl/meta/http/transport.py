"""The one transport seam of `HttpMetadataClient`: `Transport.send` (one request by a
deadline → `(status, body)`), after httpx's `BaseTransport.handle_request`.

Two implementations, both over maintained libraries (no HTTP parsed here):

- `KeepAliveTransport`, the hand-tuned path of the connector's hot calls (lookup, locate,
  allocate, commit, release, invalidate): one stdlib `http.client` keep-alive connection
  per calling thread (thread-safe without a pool lock) on deadline sockets
  (`deadline.DeadlineHTTPConnection`). httpx costs ~0.2 ms more CPU per call (3x) and
  adds ~0.2 ms to a ~0.3 ms lookup round trip, under the GIL of vLLM's scheduler and
  workers, on every request. A connection the server closed while idle is noticed before
  it is reused and replaced, so calls that are never retried do not fail on it.
- `HttpxTransport`, the stock path: one `httpx.Client` (its pool shared by the threads)
  over `deadline.DeadlineTransport`. Every other call uses it, and so does every call
  when the fast path is off (`HttpMetadataClient(fast_path=False)`, or
  `HF3FSCTL_HTTP_FAST_PATH=0`): the fallback if the hand-tuned path ever misbehaves.

A transport raises what its library raises (`OSError`, `http.client.HTTPException`,
`httpx.RequestError`: `TRANSPORT_ERRORS`); `HttpMetadataClient._call` is the one place
that maps those and the statuses to typed errors.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
import time
from typing import Any, Protocol

import httpx

from hf3fsctl.meta.http.deadline import DeadlineHTTPConnection, DeadlineTransport, tls_context

# What a transport raises for a call that got no HTTP answer (an OSError includes
# TimeoutError and ssl.SSLError; http.client.HTTPException a malformed or cut answer).
TRANSPORT_ERRORS = (OSError, http.client.HTTPException, httpx.RequestError)
FAST_PATH_ENV = "HF3FSCTL_HTTP_FAST_PATH"  # "0": every call over stock httpx


def fast_path_default() -> bool:
    """Whether the hand-tuned path is on unless the caller says (`HF3FSCTL_HTTP_FAST_PATH`)."""
    return os.environ.get(FAST_PATH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class Transport(Protocol):
    """Sends one request and reads its whole answer by `deadline` (a monotonic time)."""

    def send(
        self,
        method: str,
        path: str,
        content: bytes | None,
        params: dict[str, Any] | None,
        deadline: float,
    ) -> tuple[int, bytes]:
        """`(status, body)`; raises one of `TRANSPORT_ERRORS` when no answer came."""
        ...

    def reset(self) -> None:
        """Forget this thread's connection after a failed `send` (the next reconnects)."""
        ...

    def close(self) -> None:
        """Close every connection."""
        ...


class KeepAliveTransport:
    """One `http.client` keep-alive connection per thread (the hot calls' fast path).

    Args:
        host, port, prefix: the server, and the path prefix of its routes.
        headers: sent with every request.
        ca_file: for https (`tls` true): the CA of the server's certificate, else the
            system's trust store.
    """

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        headers: dict[str, str],
        *,
        tls: bool,
        ca_file: str | None,
    ) -> None:
        self._host = host
        self._port = port
        self._prefix = prefix
        self._headers = headers
        self._tls = tls_context(ca_file, deadline_sockets=True) if tls else None
        self._local = threading.local()
        self._open: set[DeadlineHTTPConnection] = set()
        self._lock = threading.Lock()

    def _connection(self) -> DeadlineHTTPConnection:
        """This thread's connection (reconnected if the server closed it while idle)."""
        conn: DeadlineHTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = DeadlineHTTPConnection(self._host, self._port, tls=self._tls)
            self._local.conn = conn
            with self._lock:
                self._open.add(conn)
        elif conn.is_stale():
            conn.close()
        return conn

    def send(
        self,
        method: str,
        path: str,
        content: bytes | None,
        params: dict[str, Any] | None,
        deadline: float,
    ) -> tuple[int, bytes]:
        assert params is None, "the hot calls take no query parameters"
        target = self._prefix + path
        return self._connection().exchange(method, target, self._headers, content, deadline)

    def reset(self) -> None:
        conn: DeadlineHTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._lock:
                self._open.discard(conn)

    def close(self) -> None:
        with self._lock:
            connections, self._open = self._open, set()
        for conn in connections:
            conn.close()
        self._local = threading.local()


class HttpxTransport:
    """One `httpx.Client` for every thread (made on first use): the stock path.

    Args:
        url: the server's base URL (`http(s)://HOST:PORT[/PREFIX]`).
        headers: sent with every request.
        tls: https; `ca_file` as for `KeepAliveTransport`.
    """

    def __init__(
        self, url: str, headers: dict[str, str], *, tls: bool, ca_file: str | None
    ) -> None:
        self._url = url
        self._headers = headers
        self._tls: ssl.SSLContext | None = tls_context(ca_file) if tls else None
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None

    def _httpx(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(
                    headers=self._headers,
                    transport=DeadlineTransport(tls=self._tls),
                    trust_env=False,  # no proxy from the environment, as on the hot path
                )
            return self._client

    def send(
        self,
        method: str,
        path: str,
        content: bytes | None,
        params: dict[str, Any] | None,
        deadline: float,
    ) -> tuple[int, bytes]:
        response = self._httpx().request(
            method,
            self._url + path,
            content=content,
            params=params,
            timeout=max(deadline - time.monotonic(), 0.001),
            extensions={"deadline": deadline},
        )
        return response.status_code, response.content

    def reset(self) -> None:
        """Nothing to forget: httpcore's pool drops a failed connection itself."""

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
