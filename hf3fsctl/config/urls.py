"""`MetadataUrl`: the one parser of metadata URLs (sqlite, http(s), redis, rediss, sentinel,
cluster).

Contract: `MetadataUrl.parse` accepts exactly the documented forms or raises `ConfigError`
naming the key; a password never appears in `url`, `repr` or an error message.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hf3fsctl.errors import ConfigError

_HTTP_RE = re.compile(r"(https?)://([^/\s]+)(/\S*)?")


class MetadataUrl(BaseModel):
    """A parsed metadata URL.

    - `sqlite:///PATH`: embedded (`path`).
    - `http(s)://HOST:PORT[/PREFIX]`: `hf3fsctl serve` (`base`, without a trailing slash).
    - `redis://[USER[:PASSWORD]@]HOST:PORT[/DB]`, `rediss://…` (TLS): one Redis server;
      `redis+sentinel://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT…]/SERVICE[/DB]`: the master
      of `SERVICE` as Redis Sentinels report it (`hosts` are the sentinels);
      `redis+cluster://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT…]`: a Redis Cluster (`hosts`
      are startup nodes; no database: a cluster has only 0), with `?shards=N` a store
      split into N one-slot shards (`meta/redis/sharded.py`; 1, the default, is one
      slot). The password
      is `password` only: `url` and `repr` show it as `***`, so logging either is safe.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str
    scheme: Literal["sqlite", "http", "https", "redis", "rediss", "redis+sentinel", "redis+cluster"]
    path: str | None = None
    base: str | None = None
    hosts: tuple[tuple[str, int], ...] = ()  # redis: the server; sentinel: the sentinels;
    # cluster: startup nodes
    db: int = 0
    service: str | None = None  # redis+sentinel: the monitored master's name
    username: str | None = None
    password: str | None = Field(default=None, repr=False)
    shards: int = 1  # redis+cluster: how many one-slot shards the store is split into

    @property
    def embedded(self) -> bool:
        """An embedded (`sqlite`) store, opened in this process."""
        return self.scheme == "sqlite"

    @property
    def redis(self) -> bool:
        """A Redis store (`redis`, `rediss`, `redis+sentinel`, `redis+cluster`), reached
        directly."""
        return self.scheme.startswith("redis")

    @classmethod
    def parse(cls, url: str, key: str = "metadata.url") -> MetadataUrl:
        """Parse `sqlite:////ABS/PATH`, `sqlite:///ABS/PATH`, `http(s)://HOST:PORT[/PREFIX]`,
        `redis://HOST:PORT[/DB]`, `rediss://…`, `redis+sentinel://HOST:PORT[,…]/SERVICE[/DB]`
        or `redis+cluster://HOST:PORT[,…]`.

        Raises:
            ConfigError: naming `key` when the URL is none of these (the message never
                repeats a password).
        """
        text = url.strip() if isinstance(url, str) else ""
        if text.startswith("sqlite:///") and len(text) > len("sqlite:///"):
            path = text[len("sqlite://") :]
            return cls(url=text, scheme="sqlite", path=path[1:] if path.startswith("//") else path)
        match = _HTTP_RE.fullmatch(text)
        if match is not None:
            scheme: Literal["http", "https"] = "https" if match.group(1) == "https" else "http"
            return cls(url=text, scheme=scheme, base=text.rstrip("/"))
        redis = _REDIS_RE.fullmatch(text)
        if redis is not None:
            return cls._parse_redis(redis, key)
        raise ConfigError(
            f"{key}: {_redact(text or url)!r} is not a metadata URL; use "
            "sqlite:///ABSOLUTE/PATH.db, http://HOST:PORT, redis://HOST:PORT/DB or "
            "redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE or redis+cluster://HOST:PORT[,…]"
        )

    @classmethod
    def _parse_redis(cls, match: re.Match[str], key: str) -> MetadataUrl:
        from urllib.parse import unquote

        scheme, userinfo, hosts_text, rest, query = match.groups()
        shards = _shards(query, scheme, _redact(match.group(0)), key)
        username = password = None
        if userinfo is not None:
            user, sep, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if sep else None
            if not sep:  # `redis://PASSWORD@host` is redis-py's form for a password alone
                username, password = None, unquote(user)
        hosts = []
        for item in hosts_text.split(","):
            host, _, port = item.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"{key}: {_redact(match.group(0))!r} is not a metadata URL: {item!r} is "
                    "not HOST:PORT",
                    hint="give every Redis server or sentinel as HOST:PORT",
                )
            hosts.append((host.strip("[]"), int(port)))
        parts = [p for p in (rest or "").split("/") if p]
        service = None
        if scheme == "redis+sentinel":
            if not parts:
                raise ConfigError(
                    f"{key}: {_redact(match.group(0))!r} names no Sentinel service",
                    hint="use redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE_NAME[/DB]",
                )
            service = parts.pop(0)
        elif scheme == "redis+cluster":
            if parts and parts != ["0"]:
                raise ConfigError(
                    f"{key}: {_redact(match.group(0))!r}: a Redis Cluster has only database 0",
                    hint="use redis+cluster://HOST:PORT[,HOST:PORT] without a /DB",
                )
        elif len(hosts) > 1:
            raise ConfigError(
                f"{key}: {scheme}:// takes one HOST:PORT; several are for redis+sentinel:// "
                "or redis+cluster://"
            )
        if len(parts) > 1 or (parts and not parts[0].isdigit()):
            raise ConfigError(f"{key}: the database of {_redact(match.group(0))!r} is not a number")
        return cls(
            url=_redact(match.group(0)),
            scheme=scheme,  # type: ignore[arg-type]  # the pattern allows only these
            hosts=tuple(hosts),
            db=int(parts[0]) if parts else 0,
            service=service,
            username=username,
            password=password,
            shards=shards,
        )


_REDIS_RE = re.compile(
    r"(redis|rediss|redis\+sentinel|redis\+cluster)://(?:([^@/\s]*)@)?([^@/?\s]+)(/[^?\s]*)?(\?\S*)?"
)


MAX_SHARDS = 256  # a shard per master, or a few: far more would only cost round trips


def _shards(query: str | None, scheme: str, shown: str, key: str) -> int:
    """The `?shards=N` of a Redis Cluster URL (1 without one)."""
    if not query or query == "?":
        return 1
    name, sep, value = query[1:].partition("=")
    if name != "shards" or not sep or "&" in value:
        raise ConfigError(
            f"{key}: {shown!r}: unknown option {query[1:]!r}",
            hint="the one option of a Redis URL is ?shards=N (redis+cluster:// only)",
        )
    if scheme != "redis+cluster":
        raise ConfigError(
            f"{key}: {shown!r}: ?shards= needs redis+cluster:// (shards are spread over a "
            "cluster's masters; one server would gain nothing)",
            hint="use redis+cluster://HOST:PORT[,HOST:PORT]?shards=N, or drop ?shards=",
        )
    if not value.isdigit() or not 1 <= int(value) <= MAX_SHARDS:
        raise ConfigError(
            f"{key}: {shown!r}: shards must be a whole number in 1..{MAX_SHARDS}, got {value!r}",
            hint="a few shards per cluster master, e.g. ?shards=16 on 4 masters",
        )
    return int(value)


def _redact(url: str) -> str:
    """`url` with the password of its user information replaced by `***` (all of it
    when it has no `:`: `redis://SECRET@host` is a password alone)."""
    url = re.sub(r"^([a-z+]+://)([^@/\s:]*):[^@/\s]*@", r"\1\2:***@", url)
    return re.sub(r"^([a-z+]+://)[^@/\s:]+@", r"\1***@", url)
