"""Deadline-bounded sockets and pools under the transports of `meta/http/transport.py`.

No HTTP is parsed here: both are maintained libraries, and this module only makes every
socket operation of a call end by that call's deadline (a monotonic time), so that a
server that trickles bytes, each within any per-operation timeout, cannot stretch a
call past `timeout_s`.

- `DeadlineHTTPConnection`: a stdlib `http.client` keep-alive connection, for the
  connector's hot calls (lookup, locate, allocate, commit, release, invalidate). Its
  socket (`_DeadlineSocket`, or `_DeadlineSSLSocket` for https, put in place through
  `SSLContext.sslsocket_class`) sets its timeout to the time left before `deadline`
  before every receive and send, and raises `TimeoutError` once it has passed. The
  connect and the TLS handshake are bounded by the time left too. `exchange()` sends
  one request and reads the whole answer (any framing `http.client` reads:
  content-length, chunked, or up to the close); `is_stale()` says whether the server
  closed the idle socket, so the caller reconnects before a call that is never retried.
- `DeadlineTransport`: an `httpx` transport, for every other call. It is httpcore's
  connection pool (the engine of `httpx.HTTPTransport`) with a network backend that
  clamps the timeout of every connect, TLS handshake, read and write to the deadline
  the request carries in `extensions["deadline"]`, raising httpx's timeout errors
  once it has passed. httpcore errors are mapped to httpx's, as `httpx.HTTPTransport`
  does.
- `tls_context(ca_file)`: certificate and host-name verification against `ca_file`
  (PEM), else the system's trust store (which honours `SSL_CERT_FILE`).
"""

from __future__ import annotations

import http.client
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import httpcore
import httpx

from hf3fsctl.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer


def tls_context(ca_file: str | None, *, deadline_sockets: bool = False) -> ssl.SSLContext:
    """A client context that verifies the server against `ca_file` (or the system CAs).

    With `deadline_sockets`, the sockets it wraps are `_DeadlineSSLSocket`s (for
    `DeadlineHTTPConnection`).
    """
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(f"metadata.ca_file: cannot load {ca_file!r}: {exc}") from None
    if deadline_sockets:
        context.sslsocket_class = _DeadlineSSLSocket
    return context


def _left(deadline: float) -> float | None:
    """Seconds left before `deadline` (None: no deadline); `TimeoutError` once past."""
    if deadline == math.inf:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left


# --- http.client, for the hot calls ------------------------------------------------------


class _DeadlineSocket(socket.socket):
    """A TCP socket whose every receive and send ends by `deadline`."""

    deadline: float = math.inf

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self.settimeout(_left(self.deadline))
        return super().recv(bufsize, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        # One timeout bounds the whole `sendall` (Python >= 3.5).
        self.settimeout(_left(self.deadline))
        super().sendall(data, flags)


class _DeadlineSSLSocket(ssl.SSLSocket):
    """A TLS socket whose every receive and send ends by `deadline`."""

    deadline: float = math.inf

    def recv_into(self, buffer: WriteableBuffer, nbytes: int | None = None, flags: int = 0) -> int:
        self.settimeout(_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        self.settimeout(_left(self.deadline))
        return super().recv(buflen, flags)

    def send(self, data: ReadableBuffer, flags: int = 0) -> int:
        # `SSLSocket.sendall` sends through `send`, so each piece is bounded.
        self.settimeout(_left(self.deadline))
        return super().send(data, flags)


class DeadlineHTTPConnection(http.client.HTTPConnection):
    """One `http.client` keep-alive connection whose calls end by their deadline.

    Args:
        host, port: the server.
        tls: the context of an https connection (`tls_context(..., deadline_sockets=True)`),
            None for http.
    """

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(host, port)
        self._tls = tls
        self.deadline = math.inf

    def connect(self) -> None:
        """Connect (and handshake) within the time left before `deadline`."""
        raw = socket.create_connection((self.host, self.port), _left(self.deadline))
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is None:
                sock: _DeadlineSocket | _DeadlineSSLSocket = _DeadlineSocket(
                    raw.family, raw.type, raw.proto, fileno=raw.detach()
                )
            else:
                raw.settimeout(_left(self.deadline))  # bounds the handshake
                wrapped = self._tls.wrap_socket(raw, server_hostname=self.host)
                assert isinstance(wrapped, _DeadlineSSLSocket)
                sock = wrapped
        except BaseException:
            raw.close()
            raise
        sock.deadline = self.deadline
        self.sock = sock

    def is_stale(self) -> bool:
        """Whether the idle socket was closed (or written to) by the server."""
        if self.sock is None:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def exchange(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes | None,
        deadline: float,
    ) -> tuple[int, bytes]:
        """Send one request and read its whole answer by `deadline`: `(status, body)`.

        Raises `OSError` (`TimeoutError` past the deadline) or `http.client.HTTPException`;
        the connection is then closed, and the next call reconnects.
        """
        self.deadline = deadline
        if isinstance(self.sock, (_DeadlineSocket, _DeadlineSSLSocket)):
            self.sock.deadline = deadline
        try:
            self.request(method, target, body, headers)
            response = self.getresponse()
            return response.status, response.read()
        except BaseException:
            self.close()
            raise


# --- httpx, for every other call ---------------------------------------------------------

_DEADLINE = threading.local()  # .at: the deadline of the request this thread is sending


def _clamp(timeout: float | None, error: type[Exception]) -> float | None:
    """`timeout` cut to the time left before this thread's deadline; `error` once past."""
    at: float | None = getattr(_DEADLINE, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise error("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _clamp(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _clamp(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _clamp(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _clamp(timeout, httpcore.ConnectTimeout)
        stream = self._inner.connect_tcp(host, port, left, local_address, socket_options)
        return _DeadlineStream(stream)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _clamp(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_unix_socket(path, left, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


# httpcore's errors and the httpx errors they become (most specific first).
_ERROR_MAP: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)


class DeadlineTransport(httpx.BaseTransport):
    """An httpx transport whose requests end by `request.extensions["deadline"]`.

    A request without one is bounded by httpx's per-operation timeouts only. The answer
    is read whole before `handle_request` returns, so the deadline covers it too.
    """

    def __init__(self, *, tls: ssl.SSLContext | None = None, max_connections: int = 16) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=tls,
            max_connections=max_connections,
            keepalive_expiry=30.0,
            network_backend=_DeadlineBackend(),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        _DEADLINE.at = request.extensions.get("deadline")
        try:
            response = self._pool.handle_request(core)
            try:
                content = response.read()
            finally:
                response.close()
        except Exception as exc:
            for core_error, error in _ERROR_MAP:
                if isinstance(exc, core_error):
                    raise error(str(exc) or type(exc).__name__, request=request) from exc
            raise
        finally:
            _DEADLINE.at = None
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            content=content,
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._pool.close()
