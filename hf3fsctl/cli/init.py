"""`hf3fsctl init`: create a store — storage root, metadata DB, capacity, config, page files.

Everything is checked before anything is written, so a refused value changes nothing
(also on a store that exists): the storage root must exist, unless `--create-path` (a
missing directory is most often a file system that is not mounted, and creating it
would put the store on the disk beneath, sized from its space); the file system it is
on is named (`/proc/mounts`), with a warning for the root file system; the capacity
(`--capacity`, else `storage.capacity`: a share of the file system's free space by
default) must hold at least a page; an `http(s)://` service or Redis must answer
(exit 6 with the fix), unless `--config-only`, which writes only the config file.

Then, each step reported: create the root if asked and prove it writable (a file is
written, synced and removed); for `sqlite:///` create the database and its schema;
record the capacity (a store that has one keeps it unless `--capacity` is given); with
`--write-config` write a config file pointing at all this (refusing to overwrite one
without `--force`; `--token-file` with an `http(s)://` URL is recorded as both
`metadata.token_file` and `server.token_file`, so the `serve` of that config checks
it); with `--namespace-manifest FILE` write that namespace's manifest and register it
with its per-rank page files — growing on demand, or with `--preallocate` fallocated at
`--file-size` up front, with a progress bar. The next commands it suggests name this
store (its config file, else the `HF3FSCTL_*` variables that point at it).
"""

from __future__ import annotations

import json as jsonlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt, JsonOpt
from hf3fsctl.errors import InvalidRequest, MetadataUnavailable, NotFound, StorageError

if TYPE_CHECKING:
    from hf3fsctl.config import Config
    from hf3fsctl.keys import NamespaceManifest
    from hf3fsctl.meta.models import CapacityInfo
    from hf3fsctl.meta.protocol import MetadataClient


def check_writable(root: Path) -> None:
    """Write, sync and remove a probe file under `root`.

    Raises:
        StorageError: naming the directory and the OS error.
    """
    probe = root / f".hf3fsctl-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"hf3fsctl")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise StorageError(f"storage path {str(root)!r} is not writable: {exc.strerror}") from None


def read_manifest_file(path: Path) -> NamespaceManifest:
    """A namespace manifest from a JSON file.

    Raises:
        InvalidRequest: the file is missing, not JSON, or not a complete manifest.
    """
    from hf3fsctl.keys import NamespaceManifest

    try:
        data = jsonlib.loads(path.read_text())
    except OSError as exc:
        raise InvalidRequest(f"cannot read manifest {str(path)!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidRequest(f"manifest {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"manifest {str(path)!r} must hold a JSON object")
    return NamespaceManifest.from_dict(data)


def register_namespace_files(
    config: Config,
    client: MetadataClient,
    manifest: NamespaceManifest,
    ranks: int,
    *,
    show_progress: bool,
) -> dict[str, Any]:
    """Write the manifest, register the namespace and its first `ranks` page files.

    The files grow on demand unless `storage.preallocate` is set, in which case each is
    fallocated at `storage.file_size` (resumable, with a progress bar) and registered as
    preallocated: it holds its whole size of the store's capacity from now on.
    """
    from hf3fsctl.meta.models import RankFile
    from hf3fsctl.storage.layout import PageFile, slot_bytes, write_manifest

    root = Path(config.storage.path)
    ns = manifest.namespace_id
    preallocated = config.storage.preallocate
    write_manifest(root, manifest)
    client.register_namespace(ns, manifest.to_dict())
    files = []
    with output.progress(show_progress and preallocated, in_bytes=True) as bar:
        for rank in range(ranks):
            if preallocated:
                task = bar.add_task(f"rank {rank}", total=config.storage.file_size)

                def advance(done: int, total: int, task: Any = task) -> None:
                    bar.update(task, completed=done, total=total)

                page_file = PageFile.create(
                    root,
                    ns,
                    rank,
                    manifest.page_bytes,
                    config.storage.file_size,
                    progress=advance,
                )
            else:
                page_file = PageFile.create_growable(root, ns, rank, manifest.page_bytes)
            with page_file:
                client.register_rank(
                    ns,
                    RankFile(
                        rank=rank,
                        path=page_file.relpath,
                        page_bytes=page_file.page_bytes,
                        slot_bytes=page_file.slot_bytes,
                        num_pages=page_file.num_pages,
                        preallocated=preallocated,
                    ),
                )
                files.append(
                    {
                        "rank": rank,
                        "path": str(page_file.path),
                        "num_pages": page_file.num_pages,
                        "preallocated": preallocated,
                    }
                )
    return {
        "namespace": ns,
        "slot_bytes": slot_bytes(manifest.page_bytes),
        "rank_files": files,
    }


MIN_CAPACITY = 4096  # one page's worth: a smaller store holds nothing


@dataclass(frozen=True)
class FileSystem:
    """Where a path lies: its mount point and file-system type (`/proc/mounts`)."""

    mount_point: str
    fstype: str

    @property
    def is_root(self) -> bool:
        """The root file system (`/`): where a missing mount's directory would land."""
        return self.mount_point == "/"

    @property
    def on_3fs(self) -> bool:
        from hf3fsctl.storage.engine import THREEFS_FSTYPES

        return self.fstype in THREEFS_FSTYPES

    def __str__(self) -> str:
        where = f"{self.fstype} mounted at {self.mount_point or '?'}"
        return where + (" (the root file system)" if self.is_root else "")


def file_system_of(path: Path) -> FileSystem:
    """The file system holding `path`, or the one its nearest existing parent is on."""
    from hf3fsctl.storage.engine import find_mount

    mount_point, fstype = find_mount(path)
    return FileSystem(mount_point, fstype)


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest parent that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_storage_path(root: Path, *, create: bool) -> FileSystem:
    """Refuse a storage root that does not exist (unless `create`) or is not a directory.

    A missing directory is most often a file system that is not mounted: creating it
    would put the store on whatever lies beneath (the root disk), sized from its space.

    Raises:
        NotFound: `root` does not exist and `create` is false.
        InvalidRequest: `root` is not a directory.
    """
    fs = file_system_of(root)
    if not root.exists():
        if not create:
            raise NotFound(
                f"storage path {root} does not exist; {existing_parent(root)} is on {fs}",
                hint="mount the file system (3FS) there, or pass --create-path to create "
                f"the directory on {fs.fstype} at {fs.mount_point or '?'}",
            )
    elif not root.is_dir():
        raise InvalidRequest(f"storage path {root} is not a directory")
    return fs


def plan_capacity(config: Config, held: int) -> int:
    """The capacity `storage.capacity` means on this file system for a store holding
    `held` bytes, refused if it cannot hold a page. Nothing is written.

    Raises:
        ConfigError: the value is neither a size nor a share.
        InvalidRequest: it is smaller than one page (or a share of a full file system).
    """
    from hf3fsctl.config import format_size, parse_amount
    from hf3fsctl.meta.policy import file_system_room, resolve_capacity

    root = existing_parent(Path(config.storage.path))
    amount = parse_amount(config.storage.capacity, "storage.capacity")
    value = resolve_capacity(amount, root, held)
    if value < MIN_CAPACITY:
        room = file_system_room(root) + held
        raise InvalidRequest(
            f"storage.capacity {config.storage.capacity} is {value} bytes here: too small "
            f"to hold a page (at least {format_size(MIN_CAPACITY)}); nothing was changed",
            hint=f"pass a larger --capacity (e.g. 80% or 100GiB; {format_size(room)} "
            f"available on {root})",
        )
    return value


def record_capacity(config: Config, client: MetadataClient, value: int | None) -> dict[str, Any]:
    """Record `value` (planned by `plan_capacity`) as the store's capacity; None keeps
    the capacity the store has (it records the configured default when it has none)."""
    from hf3fsctl.config import format_size
    from hf3fsctl.meta.policy import file_system_room

    current = client.capacity()
    if value is None and current.capacity_bytes is not None:
        return current.model_dump()
    if value is None:
        value = plan_capacity(config, current.bytes_used)
    room = file_system_room(existing_parent(Path(config.storage.path))) + current.bytes_used
    if value > room:
        output.warning(
            f"capacity {format_size(value)} is more than the file system can give the store "
            f"({format_size(room)}): writes will fail with no space before eviction starts"
        )
    return client.set_capacity(value).model_dump()


def _unreachable(config: Config, exc: MetadataUnavailable) -> MetadataUnavailable:
    """The one-line error for a metadata service or Redis that does not answer."""
    target = config.metadata_target
    if target.redis:
        hint = (
            f"start Redis at {target.url} (hf3fsctl does not run it; give it "
            "`maxmemory-policy noeviction`), or pass --config-only to write the config now"
        )
    else:
        hint = (
            "start `hf3fsctl serve` on the metadata host (`hf3fsctl --config FILE serve`), "
            "or pass --config-only to write the config now"
        )
    return MetadataUnavailable(f"metadata {target.url} is not reachable: {exc.message}", hint=hint)


def _existing_capacity(config: Config) -> CapacityInfo | None:
    """The capacity of the store the config points at, read without writing anything;
    None for an embedded store not created yet.

    Raises:
        MetadataUnavailable: a service or Redis that does not answer (`_unreachable`).
    """
    db = context.sqlite_path(config.metadata_target)
    if db is not None and not db.exists():
        return None
    try:
        with context.open_client(config, read_only=True) as client:
            client.health()
            return client.capacity()
    except MetadataUnavailable as exc:
        if db is not None:
            raise
        raise _unreachable(config, exc) from None


def init(
    ctx: typer.Context,
    storage_path: Annotated[
        Path | None,
        typer.Option(
            "--storage-path",
            metavar="PATH",
            help="Storage root, an existing directory (on 3FS: one under the mount); "
            "default storage.path of --config.",
            show_default=False,
        ),
    ] = None,
    config: ConfigOpt = None,
    create_path: Annotated[
        bool,
        typer.Option(
            "--create-path",
            help="Create the storage root if it does not exist (else refused: a missing "
            "directory is usually a file system that is not mounted).",
        ),
    ] = False,
    metadata_url: Annotated[
        str | None,
        typer.Option(
            "--metadata-url",
            metavar="URL",
            help="sqlite:///PATH, http(s)://HOST:PORT (`hf3fsctl serve`), redis://HOST:PORT "
            "(also rediss://, redis+sentinel://); default: <storage-path>/metadata.db.",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            metavar="FILE",
            help="Bearer token file of an http(s):// service (metadata.token_file, and "
            "server.token_file for the `serve` of this config), or a Redis password file.",
        ),
    ] = None,
    capacity: Annotated[
        str | None,
        typer.Option(
            "--capacity",
            metavar="SIZE|SHARE",
            help="Bytes the whole store may hold (2TiB), or a share of the file system's "
            "free space (50%); default storage.capacity (80%).",
        ),
    ] = None,
    preallocate_files: Annotated[
        bool,
        typer.Option(
            "--preallocate",
            help="Fallocate the --namespace-manifest's page files at --file-size now "
            "(default: they grow on demand).",
        ),
    ] = False,
    file_size: Annotated[
        str | None,
        typer.Option(
            "--file-size", metavar="SIZE", help="Bytes of one preallocated page file (64GiB)."
        ),
    ] = None,
    write_config: Annotated[
        Path | None,
        typer.Option("--write-config", metavar="PATH", help="Write a config file for this store."),
    ] = None,
    config_only: Annotated[
        bool,
        typer.Option(
            "--config-only",
            help="Only write --write-config: do not contact the metadata service or Redis "
            "(one not started yet); run init again later to record the capacity.",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite the file given to --write-config.")
    ] = False,
    namespace_manifest: Annotated[
        Path | None,
        typer.Option(
            "--namespace-manifest",
            metavar="FILE",
            help="Register this namespace (a manifest JSON file) and its page files now.",
        ),
    ] = None,
    ranks: Annotated[
        int | None,
        typer.Option("--ranks", min=1, help="How many ranks to register (default: TP x PP)."),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Create the store: storage root, metadata DB, config file, page files.

    Everything is checked before anything is written: a refused value changes nothing.
    """
    from hf3fsctl.config import dump_config, format_size

    if write_config is not None and write_config.exists() and not force:
        raise InvalidRequest(
            f"config file {str(write_config)!r} exists", hint="pass --force to overwrite it"
        )
    if ranks is not None and namespace_manifest is None:
        raise InvalidRequest("--ranks needs --namespace-manifest")
    if preallocate_files and namespace_manifest is None:
        raise InvalidRequest(
            "--preallocate needs --namespace-manifest (the files of which namespace?)"
        )
    if config_only and write_config is None:
        raise InvalidRequest("--config-only needs --write-config (which file to write?)")
    if config_only and namespace_manifest is not None:
        raise InvalidRequest(
            "--config-only registers nothing: drop --namespace-manifest, or run init "
            "again once the metadata service is up"
        )
    manifest = read_manifest_file(namespace_manifest) if namespace_manifest else None
    if manifest is not None and ranks is not None and ranks > manifest.num_ranks:
        raise InvalidRequest(
            f"--ranks {ranks} is more than the manifest's {manifest.num_ranks} ranks (TP x PP)"
        )
    token = str(token_file.expanduser().resolve()) if token_file else None
    if token_file is not None and not token_file.expanduser().is_file():
        raise InvalidRequest(
            f"token file {token} does not exist",
            hint="create it with e.g. `openssl rand -hex 32 > FILE && chmod 600 FILE`",
        )
    overrides: dict[str, Any] = {
        "metadata.url": metadata_url,
        "metadata.token_file": token,
        "storage.file_size": file_size,
        "storage.capacity": capacity,
        "storage.preallocate": True if preallocate_files else None,
    }
    if storage_path is not None:
        overrides["storage.path"] = str(storage_path.expanduser().resolve())
    cfg = context.load(ctx, config, overrides, missing_ok=True)
    if storage_path is None and cfg.source is None and "HF3FSCTL_STORAGE_PATH" not in os.environ:
        raise InvalidRequest(
            "init needs --storage-path (or a --config file that sets storage.path)"
        )
    root = Path(cfg.storage.path).expanduser().resolve()
    if token is not None and cfg.metadata_target.scheme in ("http", "https"):
        # the same file is the token the `serve` of this config expects
        cfg = context.load(ctx, config, {**overrides, "server.token_file": token}, missing_ok=True)
    fs = check_storage_path(root, create=create_path)
    target = cfg.metadata_target
    db = context.sqlite_path(target)
    # --- checks that write nothing: the capacity, the service --------------------------
    if capacity is not None or target.redis or config_only or (db is not None and not db.exists()):
        plan_capacity(cfg, 0)  # what a new store would record; held data only raises a share
    existing = None if config_only else _existing_capacity(cfg)
    planned = None  # a store keeps its capacity unless --capacity; a new one the default
    if capacity is not None:
        planned = plan_capacity(cfg, existing.bytes_used if existing else 0)
    # --- from here on, things are written ------------------------------------------------
    if not root.exists():
        try:
            root.mkdir(parents=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create storage path {str(root)!r}: {exc.strerror}"
            ) from None
    check_writable(root)
    report: dict[str, Any] = {
        "storage_path": str(root),
        "file_system": {"mount_point": fs.mount_point, "fstype": fs.fstype},
    }
    if not json:
        output.line(f"storage root {root} is writable, on {fs}")
    if fs.is_root:
        output.warning(
            f"{root} is on the root file system ({fs.fstype}), not on 3FS: is 3FS mounted? "
            "The store is sized from this disk's free space"
        )
    if config_only:
        report["metadata"] = {"url": target.url, "reachable": None}
    else:
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        with context.open_client(cfg, create=True) as client:
            client.health()
            report["metadata"] = {"url": target.url, "reachable": True}
            report["capacity"] = record_capacity(cfg, client, planned)
        if not json:
            cap = report["capacity"]
            output.line(f"metadata {target.url} ready")
            output.line(
                f"capacity {format_size(cap['capacity_bytes'])} for every model and rank "
                f"({format_size(cap['bytes_used'])} held)"
            )
    if write_config is not None:
        write_config.parent.mkdir(parents=True, exist_ok=True)
        write_config.write_text(dump_config(cfg))
        report["config_file"] = str(write_config.resolve())
        if not json:
            output.line(f"wrote config {write_config}")
            if config_only:
                output.line(
                    f"metadata {target.url} not contacted (--config-only): run "
                    f"`hf3fsctl --config {write_config} init` once it is up to record the "
                    "capacity"
                )
    if manifest is not None:
        with context.open_client(cfg) as client:
            report["namespace"] = register_namespace_files(
                cfg, client, manifest, ranks or manifest.num_ranks, show_progress=not json
            )
        if not json:
            ns = report["namespace"]
            size = (
                f"of {format_size(cfg.storage.file_size)}, preallocated"
                if cfg.storage.preallocate
                else "growing on demand"
            )
            output.line(f"namespace {ns['namespace']}: {len(ns['rank_files'])} page files {size}")
    if json:
        output.print_json(report)
        return
    _next_steps(cfg, write_config or (Path(cfg.source) if cfg.source else None))


def _next_steps(cfg: Config, config_file: Path | None) -> None:
    """What to run next, against this very store: with its config file, else with the
    environment that names it (a bare command would check the packaged defaults)."""
    import shlex

    from hf3fsctl.config import load_config

    found: Config | None = None  # what a config file found (not written now) says alone
    if config_file is not None:
        try:
            found = load_config(config_file)
        except Exception:  # unreadable now: the environment names every setting
            found = None
    default_db = context.sqlite_path(cfg.metadata_target) == Path(cfg.storage.path) / "metadata.db"
    settings = [  # (variable, value here, value the found file gives, given by default)
        ("HF3FSCTL_STORAGE_PATH", cfg.storage.path, found and found.storage.path, False),
        ("HF3FSCTL_METADATA_URL", cfg.metadata_url, found and found.metadata_url, default_db),
        (
            "HF3FSCTL_METADATA_TOKEN_FILE",
            cfg.metadata.token_file,
            found and found.metadata.token_file,
            not cfg.metadata.token_file,
        ),
    ]
    if config_file is None:
        env = [f"{var}={shlex.quote(str(v))}" for var, v, _, default in settings if not default]
    else:
        env = [
            f"{var}={shlex.quote(str(v))}"
            for var, v, in_file, _ in settings
            if (found is None or v != in_file) and v
        ]
    other_store = config_file is not None and bool(env)
    run = " ".join(
        [*env, "hf3fsctl"]
        + ([f"--config {shlex.quote(str(config_file))}"] if config_file is not None else [])
    )
    output.line("next:", style="bold")
    if config_file is None:
        output.line("  (no config file written: pass --write-config PATH to keep these settings)")
    elif other_store:
        output.line(
            f"  ({config_file} names another store: the settings given here are not in it; "
            "pass --write-config PATH to keep them)"
        )
    if cfg.metadata_target.scheme in ("http", "https"):
        from urllib.parse import urlsplit

        url = urlsplit(cfg.metadata_url)
        listen = f"--host {url.hostname} --port {url.port or cfg.server.port}"
        auth = "" if cfg.server.token_file else "   # no --token-file: auth off"
        output.line(f"  {run} serve {listen}   # on the metadata host{auth}")
    output.line(f"  {run} doctor")
    output.line(f"  {run} vllm-config --compact  # for vllm serve --kv-transfer-config")
