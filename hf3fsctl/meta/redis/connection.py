"""Reaching Redis: the client a `MetadataUrl` names, its Lua scripts, and error translation.

- `redis_client(target, …)`: a `redis.Redis` for `redis://` / `rediss://`, or the master
  of a Sentinel service for `redis+sentinel://` (`redis.sentinel.Sentinel.master_for`:
  every new connection asks the sentinels where the master is, and a connection that
  finds a replica — the old master after a failover — is dropped, so the next call
  re-discovers); a `redis.cluster.RedisCluster` for `redis+cluster://` (redis-py learns
  the slot map from the startup nodes and follows MOVED/ASK itself). One pool, shared by
  the threads of the process (redis-py's pools are thread-safe and reset themselves in a
  forked child). Every key of a store shares one hash tag (the prefix `{…}:`), so on a
  cluster every script and pipeline runs on the one master that owns that slot.
- Deadlines: `timeout_s` is both the connect and the per-call socket timeout. redis-py's
  own retries are off (`Retry(NoBackoff(), 0)`): whether a call may be repeated is the
  store's decision (`call`), never the library's.
- Auth: the URL's user and password; without a password in the URL, the token
  (`metadata.token_file`) is the password. TLS (`rediss://`) verifies the server's
  certificate and host name against `ca_file`, else the system's trust store.
- Errors (`call`): no connection, a timeout, a server still loading or read-only (a
  failover in progress) → `MetadataUnavailable`; refused credentials → `AuthError`; the
  scripts' own errors (`NOTFOUND`, `INVALID`, `CONFLICT` …) → `NotFound`,
  `InvalidRequest`, `NamespaceConflict`. A pooled connection the server closed while
  idle is replaced before use (redis-py checks it), so only a connection lost during a
  call fails it: a read-only call is then retried once on a fresh one (a reset, a master
  that moved); a mutating call never is, and a timeout is never retried (it would double
  the wait).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.retry import Retry

from hf3fsctl.errors import (
    AuthError,
    Hf3fsctlError,
    InvalidRequest,
    MetadataUnavailable,
    NamespaceConflict,
    NotFound,
)

if TYPE_CHECKING:
    from redis.commands.core import Script

    from hf3fsctl.config.urls import MetadataUrl

logger = logging.getLogger(__name__)

T = TypeVar("T")

SCRIPTS = (
    "admit",
    "allocate",
    "commit",
    "count_lookup",
    "drop_namespace",
    "evict",
    "invalidate",
    "locate",
    "marks",
    "migrate_format3",
    "migrate_format4",
    "migrate_format5",
    "migrate_lru",
    "pin",
    "register_namespace",
    "register_rank",
    "release",
    "settle",
    "unpin",
)
EVICTING = ("allocate", "evict")  # the scripts that decide evictions (`lua/eviction.lua`)
STANDALONE = ("count_lookup",)  # every lookup runs it: no prelude, what it needs is in it
_SCRIPT_ERRORS: dict[str, type[Hf3fsctlError]] = {
    "NOTFOUND": NotFound,
    "INVALID": InvalidRequest,
    "CONFLICT": NamespaceConflict,
}
_UNAVAILABLE_HINT = "is Redis running and reachable at metadata.url? (`hf3fsctl doctor`)"


def redis_client(
    target: MetadataUrl, *, timeout_s: float, token: str | None, ca_file: str | None
) -> Any:
    """The client of a `redis`, `rediss`, `redis+sentinel` or `redis+cluster` URL: a
    `redis.Redis` (or `RedisCluster`, which connects at once to learn the slots) with `decode_responses=True` (typed Any: redis-py's command stubs give
    one union for its sync and async clients)."""
    password = target.password if target.password is not None else token
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 30,
        "decode_responses": True,
        # entries are packed binary: decoded losslessly (`reports.unpack_entry` re-encodes)
        "encoding_errors": "surrogateescape",
        "username": target.username,
        "password": password,
        "db": target.db,
        "client_name": "hf3fsctl",
    }
    if target.scheme == "rediss":
        common.update(
            ssl=True,
            ssl_ca_certs=ca_file,
            ssl_cert_reqs="required",
            ssl_check_hostname=True,
        )
    if target.scheme == "redis+sentinel":
        from redis.sentinel import Sentinel

        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            list(target.hosts),
            sentinel_kwargs={
                "socket_timeout": timeout_s,
                "socket_connect_timeout": timeout_s,
                "retry": Retry(NoBackoff(), 0),
            },
            **common,
        )
        assert target.service is not None
        return sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
            target.service, redis_class=redis.Redis, **common
        )
    if target.scheme == "redis+cluster":
        from redis.cluster import ClusterNode, RedisCluster

        del common["db"], common["retry"]
        return RedisCluster(
            startup_nodes=[
                ClusterNode(host, port)  # type: ignore[no-untyped-call, unused-ignore]
                for host, port in target.hosts
            ],
            # redirections (MOVED/ASK: the script never ran) are followed; a lost
            # connection is not retried here (`call` decides, as for one server)
            retry=Retry(NoBackoff(), 0),
            **common,
        )
    host, port = target.hosts[0]
    return redis.Redis(host=host, port=port, **common)


def load_scripts(client: Any) -> dict[str, Script]:
    """Every store script, `common.lua` prepended (but to `STANDALONE` ones; and
    `eviction.lua`, the eviction decision, to the scripts that evict), registered for EVALSHA (redis-py loads a script
    the server does not know yet, e.g. after a failover, on first use)."""
    folder = resources.files("hf3fsctl.meta.redis") / "lua"
    common = (folder / "common.lua").read_text()
    eviction = (folder / "eviction.lua").read_text()
    return {
        name: client.register_script(
            (common + "\n" if name not in STANDALONE else "")
            + (eviction + "\n" if name in EVICTING else "")
            + (folder / f"{name}.lua").read_text()
        )
        for name in SCRIPTS
    }


def error_reply(exc: rex.ResponseError) -> tuple[str, str]:
    """(kind, message) of an error reply: by the Redis protocol an error reply is
    `KIND message`, and the kind is the data (redis-py already raises its own classes for
    the kinds it knows: `NOAUTH`/`WRONGPASS` → `AuthenticationError`, `NOPERM`,
    `READONLY`, `LOADING`, `NOSCRIPT` …). The store's scripts raise their kinds the same
    way (`fail(kind, message)` in `lua/common.lua`); Redis may follow a script's message
    with where in the script it was raised (` script: SHA, on @user_script:LINE.`),
    which is left off."""
    kind, _, message = str(exc.args[0] if exc.args else "").partition(" ")
    return kind, message.split(" script: ")[0].strip()


def translate(exc: Exception, where: str) -> Hf3fsctlError:
    """The typed error for what redis-py raised while reaching `where` (a redacted URL)."""
    if isinstance(exc, (rex.AuthenticationError, rex.NoPermissionError)):
        return AuthError(
            f"Redis at {where} refused the credentials: {exc}",
            hint="set the password in metadata.url (redis://:PASSWORD@HOST:PORT) or in "
            "metadata.token_file",
        )
    if isinstance(exc, rex.ResponseError):
        kind, message = error_reply(exc)
        if kind in _SCRIPT_ERRORS:
            return _SCRIPT_ERRORS[kind](message)
        text = f"{kind} {message}".strip()
        return MetadataUnavailable(
            f"Redis at {where} could not run the call: {text}",
            hint="check the Redis server's log (memory limit, read-only replica)",
        )
    if isinstance(exc, rex.TimeoutError):
        return MetadataUnavailable(
            f"Redis at {where} did not answer in time", hint=_UNAVAILABLE_HINT
        )
    return MetadataUnavailable(f"Redis at {where} is unavailable: {exc}", hint=_UNAVAILABLE_HINT)


def call(fn: Callable[[], T], where: str, *, idempotent: bool) -> T:
    """`fn()` with redis-py's errors typed; a read-only call that lost its connection
    runs once more on a fresh one."""
    try:
        return fn()
    except rex.TimeoutError as exc:
        raise translate(exc, where) from None
    except rex.ConnectionError as exc:
        if isinstance(exc, rex.AuthenticationError) or not idempotent:
            raise translate(exc, where) from None
        logger.debug("Redis at %s: %s; retrying once on a new connection", where, exc)
    except rex.RedisError as exc:
        raise translate(exc, where) from None
    try:
        return fn()
    except rex.RedisError as exc:
        raise translate(exc, where) from None
