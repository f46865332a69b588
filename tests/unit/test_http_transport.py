"""`HttpConnection` against a tiny real socket server: framing, keep-alive and failures."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hf3fsctl.meta.http_transport import HttpConnection, ProtocolError

ANSWERS = {
    "content-length": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
    "chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n",
    "split-packets": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhe",
}


@pytest.fixture
def server() -> Iterator[tuple[int, list[bytes]]]:
    """A loopback server answering each request with the next queued raw answer."""
    listener = socket.create_server(("127.0.0.1", 0))
    answers: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                while answers:
                    if not conn.recv(65536):
                        break
                    answer = answers.pop(0)
                    if not answer:  # stay silent, connection open
                        time.sleep(1)
                    conn.sendall(answer)
                    if answer.endswith(b"he"):
                        conn.sendall(b"llo")
                    if b"connection: close" in answer:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], answers
    listener.close()


@pytest.mark.parametrize("kind", list(ANSWERS), ids=list(ANSWERS))
def test_body_is_read_whole(server: tuple[int, list[bytes]], kind: str) -> None:
    port, answers = server
    answers.append(ANSWERS[kind])
    assert HttpConnection("127.0.0.1", port).request("GET", "/", {}, None, 2) == (200, b"hello")


def test_connection_is_kept_alive_between_requests(server: tuple[int, list[bytes]]) -> None:
    port, answers = server
    answers.extend([ANSWERS["content-length"]] * 2)
    conn = HttpConnection("127.0.0.1", port)
    conn.request("POST", "/", {}, b"{}", 2)
    first = conn.sock
    conn.request("POST", "/", {}, b"{}", 2)
    assert conn.sock is first and first is not None


def test_connection_close_answer_closes_the_socket(server: tuple[int, list[bytes]]) -> None:
    port, answers = server
    answers.append(b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    conn = HttpConnection("127.0.0.1", port)
    assert conn.request("GET", "/", {}, None, 2) == (503, b"") and conn.sock is None


def test_garbage_answer_is_protocol_error(server: tuple[int, list[bytes]]) -> None:
    port, answers = server
    answers.append(b"SSH-2.0-OpenSSH\r\n\r\n")
    with pytest.raises(ProtocolError):
        HttpConnection("127.0.0.1", port).request("GET", "/", {}, None, 2)


def test_silent_server_times_out(server: tuple[int, list[bytes]]) -> None:
    port, answers = server
    answers.append(b"")  # accepted and read, never answered
    with pytest.raises(TimeoutError):
        HttpConnection("127.0.0.1", port).request("GET", "/", {}, None, 0.2)
