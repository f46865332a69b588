"""`HttpMetadataClient` against a tiny loopback HTTP server that misbehaves on purpose.

Each test runs over both transports: `hot` calls (lookup, allocate: `http.client`) and
the other calls (health, evict: httpx). The server (stdlib `http.server` in a thread)
answers each request with the next scripted behaviour, writing raw bytes, and records
what it was asked.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hf3fsctl.errors import (
    AuthError,
    ConfigError,
    Hf3fsctlError,
    InvalidRequest,
    MetadataUnavailable,
    NamespaceConflict,
    NotFound,
)
from hf3fsctl.meta.http.client import HttpMetadataClient
from hf3fsctl.meta.models import EvictRequest

NS = "0123456789abcdef"
KEYS = ["ab" * 32, "cd" * 32]
EVICTED = b'{"keys":0,"pages":0,"bytes":0,"dry_run":false,"by_namespace":{}}'
ALLOCATED = b'{"allocated":[],"existing":[],"no_space":[]}'

Behaviour = Callable[["_Handler"], None]


# --- the server --------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless a behaviour closes
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.requests.append(
            (self.command, self.path, self.headers.get("authorization"), body)
        )
        behaviour = self.server.script.pop(0) if self.server.script else self.server.default
        try:
            behaviour(self)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            self.close_connection = True

    do_GET = do_POST = do_PUT = _handle

    def raw(self, data: bytes, *, close: bool = False) -> None:
        self.wfile.write(data)
        self.close_connection = close


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script: list[Behaviour] = []
        self.default: Behaviour = answer(200, b'{"status":"ok"}')
        self.requests: list[tuple[str, str, str | None, bytes]] = []
        self.stopping = threading.Event()
        self.connections = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections += 1
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that refused our certificate, or hung up on a trickle

    @property
    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.requests]


def answer(status: int, body: bytes, *, close: bool = False) -> Behaviour:
    """A framed answer (content-length); `close`: the server closes after it, unannounced."""

    def behave(handler: _Handler) -> None:
        head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        handler.raw(head % (status, len(body)) + body, close=close)

    return behave


def close_delimited(body: bytes) -> Behaviour:
    """An answer with neither content-length nor chunked: the body ends at the close."""

    def behave(handler: _Handler) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
        handler.raw(head, close=True)
        for start in range(0, len(body), 65536):  # several packets
            handler.wfile.write(body[start : start + 65536])
            time.sleep(0.001)

    return behave


def chunked(body: bytes) -> Behaviour:
    def behave(handler: _Handler) -> None:
        parts = [body[i : i + 50_000] for i in range(0, len(body), 50_000)]
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
        handler.raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks)

    return behave


def trickle(body: bytes, every_s: float) -> Behaviour:
    """The whole answer, status line first, one byte every `every_s`."""

    def behave(handler: _Handler) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
        for byte in head + body:
            if handler.server.stopping.is_set():
                break
            handler.wfile.write(bytes([byte]))
            time.sleep(every_s)
        handler.close_connection = True

    return behave


def silent(handler: _Handler) -> None:
    """Read the request, never answer."""
    handler.server.stopping.wait(10)
    handler.close_connection = True


@pytest.fixture
def server() -> Iterator[_Server]:
    yield from _serve(_Server())


def _serve(srv: _Server) -> Iterator[_Server]:
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02})
    thread.daemon = True
    thread.start()
    try:
        yield srv
    finally:
        srv.stopping.set()
        srv.shutdown()
        srv.server_close()


def url(srv: _Server, scheme: str = "http", host: str = "127.0.0.1") -> str:
    return f"{scheme}://{host}:{srv.server_address[1]}"


# --- the two transports: one call each -----------------------------------------------


@dataclass(frozen=True)
class Call:
    """One client call and the answer body that makes it succeed."""

    name: str
    run: Callable[[HttpMetadataClient], object]
    ok_body: bytes
    idempotent: bool
    padded: Callable[[int], bytes] = field(repr=False, default=lambda n: b"")


LOOKUP = Call(
    "lookup (hot, http.client)",
    lambda c: c.lookup(NS, KEYS),
    b'{"hits":2}',
    True,
    lambda n: b'{"hits":2' + b" " * n + b"}",
)
HEALTH = Call(
    "health (httpx)",
    lambda c: c.health(),
    b'{"status":"ok"}',
    True,
    lambda n: b'{"status":"ok","pad":"' + b"x" * n + b'"}',
)
ALLOCATE = Call("allocate (hot, http.client)", lambda c: c.allocate(NS, 0, KEYS), ALLOCATED, False)
EVICT = Call("evict (httpx)", lambda c: c.evict(EvictRequest(all=True)), EVICTED, False)

READS = pytest.mark.parametrize("call", [LOOKUP, HEALTH], ids=lambda c: c.name)


# --- framing -------------------------------------------------------------------------


@READS
@pytest.mark.parametrize("framing", [close_delimited, chunked], ids=["close-delimited", "chunked"])
def test_answer_is_read_whole_whatever_its_framing(
    server: _Server, call: Call, framing: Callable[[bytes], Behaviour]
) -> None:
    body = call.padded(300_000)
    server.script = [framing(body), framing(body)]
    client = HttpMetadataClient(url(server), timeout_s=5)
    first, second = call.run(client), call.run(client)  # the second reconnects after a close
    assert first == second
    assert first == (2 if call is LOOKUP else {"status": "ok", "pad": "x" * 300_000})
    assert len(server.requests) == 2
    assert server.connections == (2 if framing is close_delimited else 1)  # else kept alive
    client.close()


def test_idle_connection_closed_by_the_server_does_not_fail_an_allocate(server: _Server) -> None:
    server.script = [answer(200, ALLOCATED, close=True), answer(200, ALLOCATED)]
    client = HttpMetadataClient(url(server), timeout_s=5)
    client.allocate(NS, 0, KEYS)
    time.sleep(0.2)  # the server has closed the kept-alive socket, without saying so
    client.allocate(NS, 0, KEYS)  # never retried: it must not be sent on the dead socket
    assert server.paths == ["/v1/allocate"] * 2
    assert server.connections == 2


@READS
def test_malformed_answer_is_unavailable(server: _Server, call: Call) -> None:
    server.default = lambda handler: handler.raw(b"SPDY/9 200 OK\r\n\r\n", close=True)
    with pytest.raises(MetadataUnavailable):
        call.run(HttpMetadataClient(url(server), timeout_s=1))


# --- the deadline ----------------------------------------------------------------------


@READS
@pytest.mark.parametrize("behaviour", ["trickle", "silent"])
def test_call_ends_at_its_deadline(server: _Server, call: Call, behaviour: str) -> None:
    # Every byte arrives 50 ms after the last (far within any per-read timeout), but the
    # whole answer would take ~5 s: the call must end at its 0.5 s deadline.
    server.default = trickle(call.ok_body.ljust(100), 0.05) if behaviour == "trickle" else silent
    client = HttpMetadataClient(url(server), timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(MetadataUnavailable, match="deadline"):
        call.run(client)
    elapsed = time.monotonic() - started
    assert 0.45 <= elapsed < 3.0, elapsed  # the 0.5 s deadline; the whole answer takes 5 s
    assert len(server.requests) == 1  # the deadline had passed: no retry


@READS
def test_retries_stay_within_the_deadline(server: _Server, call: Call) -> None:
    server.default = answer(503, b'{"detail":"busy"}')
    client = HttpMetadataClient(url(server), timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(MetadataUnavailable, match="HTTP 503: busy"):
        call.run(client)
    assert time.monotonic() - started < 3.0  # the 0.3 s deadline, with a loaded-CI margin
    assert 1 <= len(server.requests) <= 3  # back-off 0.05 s, then 0.2 s if time allows


def test_dead_server_is_unavailable_at_once() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = HttpMetadataClient(f"http://127.0.0.1:{port}", timeout_s=0.5)
    for call in (LOOKUP, HEALTH):
        started = time.monotonic()
        with pytest.raises(MetadataUnavailable):
            call.run(client)
        assert time.monotonic() - started < 3.0


# --- retries and errors --------------------------------------------------------------------


@pytest.mark.parametrize("call", [LOOKUP, HEALTH, ALLOCATE, EVICT], ids=lambda c: c.name)
def test_503_is_retried_only_for_idempotent_calls(server: _Server, call: Call) -> None:
    server.script = [answer(503, b'{"detail":"restarting"}'), answer(200, call.ok_body)]
    client = HttpMetadataClient(url(server), timeout_s=2)
    if call.idempotent:
        call.run(client)
        assert len(server.requests) == 2
    else:
        with pytest.raises(MetadataUnavailable, match="HTTP 503: restarting"):
            call.run(client)
        assert len(server.requests) == 1


@pytest.mark.parametrize("call", [LOOKUP, HEALTH, ALLOCATE, EVICT], ids=lambda c: c.name)
@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (401, b'{"detail":"bad token","error":"AuthError"}', AuthError),
        (403, b'{"detail":"forbidden"}', AuthError),
        (404, b'{"detail":"no such namespace"}', NotFound),
        (409, b'{"detail":"differs"}', NamespaceConflict),
        (400, b'{"detail":"differs","error":"NamespaceConflict"}', NamespaceConflict),
        (422, b'{"detail":"string does not match pattern"}', InvalidRequest),
        (413, b"too large", InvalidRequest),
    ],
)
def test_4xx_is_a_typed_error_and_never_retried(
    server: _Server, call: Call, status: int, body: bytes, error: type[Hf3fsctlError]
) -> None:
    server.default = answer(status, body)
    client = HttpMetadataClient(url(server), timeout_s=2, token="t0k")
    with pytest.raises(error) as raised:
        call.run(client)
    assert type(raised.value) is error
    assert len(server.requests) == 1


def test_token_and_path_prefix_reach_the_server(server: _Server) -> None:
    server.script = [answer(200, LOOKUP.ok_body), answer(200, HEALTH.ok_body)]
    client = HttpMetadataClient(url(server) + "/meta/", timeout_s=2, token="t0k")
    assert client.lookup(NS, KEYS) == 2
    assert client.health() == {"status": "ok"}
    assert server.paths == ["/meta/v1/lookup", "/meta/healthz"]
    assert {auth for _, _, auth, _ in server.requests} == {"Bearer t0k"}


# --- TLS -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A self-signed CA and a server certificate it signed, for 127.0.0.1 and localhost."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:  # pragma: no cover - the dev environment has it
        pytest.skip("needs the `cryptography` package to make a CA")
    directory = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hf3fsctl test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pki


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[_Server]:
    srv = _Server()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.cert, pki.key)
    # The handshake happens in the handler thread, not in the accepting one.
    srv.socket = context.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    yield from _serve(srv)


@pytest.mark.parametrize("call", [LOOKUP, HEALTH], ids=lambda c: c.name)
def test_tls_is_verified_against_ca_file(tls_server: _Server, pki: Pki, call: Call) -> None:
    tls_server.default = answer(200, call.ok_body)
    for host in ("127.0.0.1", "localhost"):
        client = HttpMetadataClient(url(tls_server, "https", host), ca_file=str(pki.ca))
        assert call.run(client) == call.run(client)
        client.close()
    assert len(tls_server.requests) == 4
    assert tls_server.connections == 2  # one per client: kept alive


@pytest.mark.parametrize("call", [LOOKUP, HEALTH], ids=lambda c: c.name)
def test_tls_without_the_ca_is_refused_and_not_retried(tls_server: _Server, call: Call) -> None:
    client = HttpMetadataClient(url(tls_server, "https"), timeout_s=2)
    with pytest.raises(MetadataUnavailable, match="certificate is not trusted") as raised:
        call.run(client)
    assert "metadata.ca_file" in raised.value.hint
    time.sleep(0.1)  # let the server thread count what it accepted
    assert (tls_server.connections, tls_server.requests) == (1, [])  # the same answer: no retry


def test_unreadable_ca_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"metadata\.ca_file"):
        HttpMetadataClient("https://127.0.0.1:1", ca_file=str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"metadata\.ca_file"):
        HttpMetadataClient("https://127.0.0.1:1", ca_file=str(tmp_path / "junk.pem"))
