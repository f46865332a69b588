"""`hf3fsctl serve`: run the shared metadata service (FastAPI + uvicorn) over SQLite or Redis.

The service keeps its data in Redis when `metadata.url` is a `redis://`, `rediss://` or
`redis+sentinel://` URL (stateless: several replicas can front one Redis); else in
SQLite: the file of `metadata.url` when that is a `sqlite:///` URL, else
`<storage.path>/metadata.db` (a config whose `metadata.url` points at this very server is
the normal client-side config, so it can be shared).
Flags default to the config's `server.*` keys.

A bad `--log-level` is refused before anything starts, and an address that cannot be
listened on (a port in use) is `AddressInUse` (exit 9), not uvicorn's status 3.

Secure by default (docs/design.md decision 11): it binds loopback unless told otherwise, and it
refuses a non-loopback address without a token file unless `--insecure` is given.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt
from hf3fsctl.errors import AddressInUse, ConfigError, InvalidRequest

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
STARTUP_FAILURE = 3  # uvicorn's exit status when the server could not start


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(path: str) -> str:
    """The bearer token in `path` (surrounding whitespace removed).

    A file that group or others may read is warned about (one line, with the fix).

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"server.token_file: cannot read {path!r}: {exc.strerror}",
            hint="create it with e.g. `openssl rand -hex 32 > FILE && chmod 600 FILE`",
        ) from None
    if not token:
        raise ConfigError(f"server.token_file: {path!r} is empty")
    mode = Path(path).stat().st_mode
    if mode & 0o077:  # one line, never the token itself
        output.warning(
            f"token file {path} is readable by group or others (mode {mode & 0o777:o}): "
            f"fix it with `chmod 600 {path}`"
        )
    return token


def check_log_level(value: str) -> str:
    """A uvicorn log level, lower-cased.

    Raises:
        InvalidRequest: not one of `LOG_LEVELS`, which the message lists.
    """
    level = value.strip().lower()
    if level not in LOG_LEVELS:
        raise InvalidRequest(
            f"--log-level {value!r} is not a log level; use one of {', '.join(LOG_LEVELS)}"
        )
    return level


def check_listen(host: str, port: int) -> None:
    """Bind `host:port` as uvicorn will (SO_REUSEADDR), then let it go.

    Raises:
        AddressInUse: the port is taken, or the address is not this machine's, instead
            of uvicorn's exit status 3.
    """
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InvalidRequest(f"--host {host!r} does not resolve: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(f"port {port} on {host} is already in use") from None
            raise AddressInUse(
                f"cannot listen on {host}:{port}: {exc.strerror}",
                hint="pass --host with an address of this machine (0.0.0.0 for all)",
            ) from None


def serve(
    ctx: typer.Context,
    config: ConfigOpt = None,
    host: Annotated[
        str | None,
        typer.Option("--host", help="Bind address (default: server.host, 127.0.0.1)."),
    ] = None,
    port: Annotated[
        int | None, typer.Option("--port", help="TCP port (default: server.port, 18765).")
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File holding the bearer token clients must send (default: server.token_file).",
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option("--insecure", help="Allow a non-loopback address without a token."),
    ] = False,
    log_level: Annotated[
        str,
        typer.Option(
            "--log-level",
            metavar="LEVEL",
            help=f"uvicorn log level: {', '.join(LOG_LEVELS)}.",
        ),
    ] = "info",
    workers: Annotated[
        int | None,
        typer.Option("--workers", min=1, help="Server processes (default: server.workers, 1)."),
    ] = None,
    log_format: Annotated[
        str | None,
        typer.Option(
            "--log-format",
            metavar="text|json",
            help="text (uvicorn's lines) or json (one JSON object per line, token masked; "
            "default: server.log_format).",
        ),
    ] = None,
) -> None:
    """Run the metadata service that vLLM instances on many nodes share."""
    log_level = check_log_level(log_level)
    cfg = context.load(
        ctx,
        config,
        {
            "server.host": host,
            "server.port": port,
            "server.token_file": str(token_file) if token_file else None,
            "server.workers": workers,
            "server.log_format": log_format,
        },
    )
    server = cfg.server
    if server.log_format == "json":  # every line from here on is a JSON log record
        import logging

        from hf3fsctl.meta.server.logs import configure

        configure("json", log_level)  # run_server adds the token to what is masked
        output.log_instead(logging.getLogger("hf3fsctl.serve"))
    token = read_token(server.token_file) if server.token_file else None
    if token is None and not is_loopback(server.host):
        if not insecure:
            raise InvalidRequest(
                f"refusing to serve on {server.host} without a token: anyone who can reach "
                "it could evict or overwrite the cache",
                hint="pass --token-file FILE (clients set metadata.token_file), "
                "or --insecure on a trusted network",
            )
        output.warning(
            f"serving on {server.host} WITHOUT authentication (--insecure): anyone who can "
            "reach this port can read, evict and overwrite cache metadata"
        )
    check_listen(server.host, server.port)
    from hf3fsctl.meta.client import metadata_token
    from hf3fsctl.meta.policy import StorePolicy
    from hf3fsctl.meta.server.run import run_server

    md = cfg.metadata
    target = cfg.metadata_target
    store_options = None
    if target.redis:  # a front for a shared Redis: replicas keep nothing in-process
        store, shown = cfg.metadata_url, target.url
        store_options = {
            "timeout_s": md.timeout_s,
            "token": metadata_token(cfg),
            "ca_file": md.ca_file,
        }
    else:
        # An http(s) metadata.url names this service; its database lives under storage.path.
        # Its directory is made by the store, and only inside an existing one: a missing
        # mount must not become a store on this node's root disk (the engines here would
        # then find the root and cache on that disk too).
        db = context.sqlite_path(target) or Path(cfg.storage.path) / "metadata.db"
        store, shown = str(db), f"db {db}"
    output.info(
        f"metadata service on http://{server.host}:{server.port} "
        f"({shown}, auth {'on' if token else 'off'})"
    )
    policy = StorePolicy.from_config(cfg)
    if not policy.root_available():
        output.warning(
            f"storage path {cfg.storage.path} is not mounted here: space freed by eviction "
            "stays with each namespace's page files, so eviction for a full store only "
            "takes the allocating model's own entries (run serve on a node with the mount)"
        )
    try:
        run_server(
            store,
            server.host,
            server.port,
            token=token,
            max_body_bytes=server.max_body_bytes,
            max_batch=server.max_batch,
            lease_s=md.lease_s,
            high_watermark=md.high_watermark,
            low_watermark=md.low_watermark,
            log_level=log_level,
            workers=server.workers,
            policy=policy,
            log_format=server.log_format,
            store_options=store_options,
        )
    except SystemExit as exc:
        if exc.code != STARTUP_FAILURE:
            raise
        # the port was free a moment ago: taken since, or the app failed to start
        raise AddressInUse(
            f"the metadata service did not start on {server.host}:{server.port} "
            "(uvicorn's error is above)",
            hint="free the port or pass another --port; HF3FSCTL_DEBUG=1 for details",
        ) from None
