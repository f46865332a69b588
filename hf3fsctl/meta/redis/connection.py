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

import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
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
LIBRARY = "hf3fsctl"  # the function library's name, before its version
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


@functools.cache
def _sources() -> tuple[dict[str, str], str, str]:
    """(each script as EVAL runs it, the function library's name, its code). A script is
    `common.lua` (but for `STANDALONE` ones; and `eviction.lua`, the eviction decision,
    for the scripts that evict), `begin(KEYS)`, then its own file. The library holds the
    same: `common.lua` and `eviction.lua` once, and each script's file as the body of a
    function `LIBRARY_<version>_<name>` that runs `begin` first (a function's library keeps
    its locals between calls: `begin` resets every one a call changes). Its version is a
    hash of its code, so processes of different versions each find their own."""
    folder = resources.files("hf3fsctl.meta.redis") / "lua"
    common = (folder / "common.lua").read_text()
    eviction = (folder / "eviction.lua").read_text()
    bodies = {name: (folder / f"{name}.lua").read_text() for name in SCRIPTS}
    scripts = {
        name: body
        if name in STANDALONE
        else common + "\nbegin(KEYS)\n" + (eviction + "\n" if name in EVICTING else "") + body
        for name, body in bodies.items()
    }
    functions = []
    for name, body in bodies.items():
        start = "" if name in STANDALONE else "begin(KEYS) FREE_HELD = nil\n"
        functions.append(
            f"redis.register_function('{{fn}}{name}', function(KEYS, ARGV)\n{start}{body}\nend)\n"
        )
    code = common + "\n" + eviction + "\n" + "".join(functions)
    version = hashlib.sha1(code.encode()).hexdigest()[:12]
    library = f"{LIBRARY}_{version}"
    return scripts, library, f"#!lua name={library}\n" + code.replace("{fn}", f"{library}_")


class StoreLua:
    """How a store runs its Lua on one client (`run`, or `queue` into a pipeline): as
    Redis functions (`FCALL`, Redis ≥ 7.0) where the server runs them, else as scripts
    (`EVALSHA`, which redis-py loads on first use).

    Why functions: a script runs `common.lua` (the shared prelude, ~80 local functions)
    on every call, ~11 µs of Redis CPU — a fifth of a one-key allocate; a function library
    runs it once, when loaded. Which one is decided by the first call: a server without
    functions (an unknown `FCALL`, or an ACL that refuses it) makes this client use
    scripts from then on; a server that lacks the library (new, flushed, after a failover
    to a replica that never synced it) gets it loaded (`FUNCTION LOAD`; on a cluster, on
    the master of the call's slot) and the call is made again — it did not run. The
    library is never replaced or deleted: another version's processes may call theirs."""

    def __init__(self, client: Any, where: str) -> None:
        self.client = client
        self.where = where
        self.cluster = hasattr(client, "get_node_from_key")
        scripts, self.library, self.code = _sources()
        self.scripts = {name: client.register_script(text) for name, text in scripts.items()}
        self.functions = True  # until the server says it has none

    def run(self, name: str, prefix: str, args: Sequence[Any]) -> Any:
        """Script `name` with KEYS = [prefix]: one round trip (two or three the first time,
        to load it)."""
        if self.functions:
            try:
                return self._fcall(name, prefix, args)
            except rex.ResponseError as exc:
                if not self.missing(exc):
                    raise
            if self.load(prefix):
                return self._fcall(name, prefix, args)
        return self.scripts[name](keys=[prefix], args=list(args))

    def _fcall(self, name: str, prefix: str, args: Sequence[Any]) -> Any:
        command = ("FCALL", f"{self.library}_{name}", 1, prefix, *args)
        if self.cluster:  # routed by the key, as EVALSHA (no COMMAND GETKEYS to find it)
            node = self.client.get_node_from_key(prefix)
            return self.client.execute_command(*command, target_nodes=node)
        return self.client.execute_command(*command)

    def queue(self, pipe: Any, name: str, prefix: str, args: Sequence[Any]) -> None:
        """Script `name` into a pipeline of one server's connection; a reply for which
        `missing` is true did not run (ask again with `run`, which loads it)."""
        if self.functions:
            pipe.execute_command("FCALL", f"{self.library}_{name}", 1, prefix, *args)
        else:
            pipe.evalsha(self.scripts[name].sha, 1, prefix, *args)

    @staticmethod
    def missing(reply: object) -> bool:
        """Whether a reply says the server lacks the function or script (it did not run),
        or has no functions at all."""
        if isinstance(reply, (rex.NoScriptError, rex.NoPermissionError)):
            return True
        if not isinstance(reply, rex.ResponseError):
            return False
        text = str(reply)
        return "Function not found" in text or "unknown command" in text.lower()

    def describe(self, prefix: str) -> str:
        """How calls on `prefix`'s server run, for `doctor`: functions (the library loaded
        there, or loaded by the first call) or scripts."""
        route = {"target_nodes": self.client.get_node_from_key(prefix)} if self.cluster else {}
        if self.functions:
            try:
                listed = self.client.execute_command(
                    "FUNCTION", "LIST", "LIBRARYNAME", self.library, **route
                )
            except rex.ResponseError as exc:
                if not self.missing(exc):
                    raise
            else:
                loaded = "" if listed else ", loaded by the first call"
                return f"functions (library {self.library}{loaded})"
        return "scripts (EVALSHA: the server runs no functions, or refuses them to this user)"

    def load(self, prefix: str) -> bool:
        """Load the library where `prefix`'s keys live (on a cluster, that slot's master);
        False, and scripts from now on, where the server has no functions or refuses them."""
        route = {"target_nodes": self.client.get_node_from_key(prefix)} if self.cluster else {}
        try:
            self.client.execute_command("FUNCTION", "LOAD", self.code, **route)
        except rex.ResponseError as exc:
            if "already exists" in str(exc):
                return True
            if isinstance(exc, rex.NoPermissionError) or "unknown" in str(exc).lower():
                logger.info(
                    "Redis at %s runs no functions (%s): the store's Lua runs as scripts",
                    self.where,
                    exc,
                )
                self.functions = False
                return False
            raise
        return True


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
