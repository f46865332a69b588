"""What most commands need first: the configuration and the metadata client.

`load(ctx, path)` honours a per-command `--config` over the global one, then
`hf3fsctl.config.find_config_file`'s search order (`$HF3FSCTL_CONFIG` first; the option
does not read the variable itself, so errors name where a path came from). `open_client`
opens the client the configuration points at (embedded SQLite or `hf3fsctl serve`),
and `resolve_namespace` accepts a namespace id or an unambiguous prefix of one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from hf3fsctl.errors import InvalidRequest, NotFound, StorageError

if TYPE_CHECKING:
    from hf3fsctl.config import Config, MetadataUrl
    from hf3fsctl.meta.protocol import MetadataClient


def load(
    ctx: typer.Context,
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    missing_ok: bool = False,
) -> Config:
    """Load the configuration for a command.

    Args:
        ctx: the command's context (its parent holds the global `--config`).
        path: the command's own `--config`, which wins over the global one.
        overrides: dotted config keys set by flags (`None` values are ignored).
        missing_ok: a file named by `--config` or `$HF3FSCTL_CONFIG` that does not exist
            is no error: the packaged defaults, environment and `overrides` are used (for
            `init`, which writes that file).

    Raises:
        ConfigError: naming the bad key, value and fix, or the missing file and where it
            was named (`--config` or `HF3FSCTL_CONFIG`).
    """
    from hf3fsctl.config import build_config, env_overrides, find_config_file, load_config

    if path is None:
        root = ctx.find_root()
        if isinstance(root.obj, dict):
            path = root.obj.get("config")
    file = find_config_file(path, origin="--config", missing_ok=missing_ok)
    if file is not None or not missing_ok:
        return load_config(file, overrides)
    # `init` named the file it is about to write (or found none): `load_config`'s layers
    # less the file (it would search on, or fail on the missing name).
    flags = {key: value for key, value in (overrides or {}).items() if value is not None}
    return build_config([("environment", env_overrides(os.environ)), ("overrides", flags)])


def connect(config: Config, *, create: bool = False, read_only: bool = False) -> MetadataClient:
    """The metadata client of a configuration (the caller closes it).

    Args:
        config: the loaded configuration.
        create: for an embedded (`sqlite:///`) URL, create the database if missing;
            otherwise a missing database is `NotFound` (only `init` creates stores).
        read_only: open an embedded store for reading only (no writer lock, nothing
            written), for commands that only read (`stats`, `ls`, `doctor`): they work
            on a read-only mount too.
    """
    from hf3fsctl.meta.client import connect as connect_url

    db = sqlite_path(config.metadata_target)
    if db is not None and not create and not _exists(db):
        raise NotFound(
            f"metadata database {db} does not exist",
            hint=f"create the store with `hf3fsctl init --storage-path {config.storage.path}`"
            + (
                ""
                if Path(config.storage.path).is_dir()
                else " (mount its file system first, or add --create-path)"
            )
            + ", or point metadata.url / --config at an existing one",
        )
    return connect_url(config, read_only=read_only and not create)


def _exists(path: Path) -> bool:
    """`path.exists()`, with a file system gone from under its mount point (ENOTCONN of a
    FUSE mount whose daemon exited) a `StorageError` rather than an `OSError`."""
    try:
        return path.exists()
    except OSError as exc:
        raise StorageError.from_os_error(exc) from None


@contextmanager
def open_client(
    config: Config, *, create: bool = False, read_only: bool = False
) -> Iterator[MetadataClient]:
    """`connect`, closed on exit."""
    client = connect(config, create=create, read_only=read_only)
    try:
        yield client
    finally:
        client.close()


def resolve_namespace(client: MetadataClient, value: str | None) -> str | None:
    """A namespace id from a full id or a unique prefix (as `stats` and `ls` print them).

    Raises:
        NotFound: no registered namespace starts with `value`.
        InvalidRequest: the prefix matches several namespaces.
    """
    if value is None:
        return None
    value = value.strip().lower()
    ids = [info.id for info in client.namespaces()]
    if value in ids:
        return value
    matches = [ns for ns in ids if ns.startswith(value)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFound(
            f"no namespace {value!r}", hint="`hf3fsctl stats` lists the registered namespaces"
        )
    raise InvalidRequest(
        f"namespace prefix {value!r} matches {len(matches)} namespaces: {', '.join(matches)}",
        hint="give more digits of the namespace id",
    )


def sqlite_path(target: MetadataUrl) -> Path | None:
    """The database file of an embedded (`sqlite:///PATH`) metadata URL, else None."""
    return Path(target.path) if target.scheme == "sqlite" and target.path else None
