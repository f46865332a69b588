"""Benchmarks stay on this machine: loopback URLs only, and free loopback ports.

Contract: `check_loopback_url` accepts an `http(s)://HOST[:PORT]` whose host is
`localhost` or a loopback address and returns it without a trailing slash; anything else
is an `InvalidRequest` naming `--url`. `free_port` is a TCP port free on 127.0.0.1 now
(a race with another binder is possible; callers that start servers retry or fail loud).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from hf3fsctl.errors import InvalidRequest


def check_loopback_url(url: str) -> str:
    """`url` without a trailing slash, if it is http(s) on a loopback host.

    Raises:
        InvalidRequest: another scheme, no host, or a host that is not loopback.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidRequest(f"--url {url!r} is not http(s)://HOST:PORT")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidRequest(
            f"--url {url!r} is not on loopback: the benchmark only loads servers on this machine",
            hint="run it on the server's host against http://127.0.0.1:PORT or "
            "http://localhost:PORT",
        )
    return url.rstrip("/")


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
