"""`hf3fsctl doctor`: check a deployment, each check ok / warn / fail with a reason and a fix.

Checks, in order (a check that cannot run because an earlier one failed is `skip`):

1. config: it loads, and from where.
2. storage: the root exists and is writable (if not, whether the mount is read-only
   or permissions are missing, and the fix), free space, the mount and its file-system
   type (`/proc/mounts`; warn on the root file system, where a missing mount would have
   put the store), the I/O engine that would be used and why, and whether staging is
   one copy from storage (USRBIO: staging buffers inside its iov).
3. metadata: the service answers (`health()`), an authenticated call is accepted,
   (embedded SQLite) the store's invariants hold, and (Redis) its role, replicas and
   `maxmemory-policy` (anything but `noeviction` fails: Redis would drop the store's
   own keys). The store is opened read-only unless `--checksums` (which takes read
   leases), so doctor also diagnoses a store on a read-only mount.
4. capacity: the store's recorded capacity, what its page files hold, and whether the
   file system can still give what the capacity promises; writers: a namespace
   written by engines with other numerics warns (docs/design.md decision 15).
5. namespaces (`doctor_store`): manifests on disk match the registered ones, page files
   exist with the registered size; with `--checksums` (implied by `--sample` and
   `--all-pages`), committed pages read back and match their checksums.
6. connectors on this node (`hf3fsctl.health` status files): running connectors that
   are disabled (fail) or degraded (warn), and why; exited ones that ended in trouble.
7. staging: which gather/scatter path this node's torch gets (compiled ops or pure
   torch; warn on a GPU node without the CUDA op), and `hf3fsctl build-ops` to fix it.

Exit code 1 when any check fails (0 with only warnings).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import context, doctor_store, output
from hf3fsctl.cli.checks import Report
from hf3fsctl.cli.errors import EXIT_CHECK_FAILED
from hf3fsctl.cli.init import check_writable
from hf3fsctl.cli.options import ConfigOpt, JsonOpt
from hf3fsctl.errors import AuthError, ConfigError, Hf3fsctlError, InvalidRequest

DEFAULT_SAMPLE = 256  # pages verified per namespace by --checksums

if TYPE_CHECKING:
    from hf3fsctl.config import Config
    from hf3fsctl.meta.protocol import MetadataClient


def check_config(report: Report, ctx: typer.Context, path: Path | None) -> Config | None:
    """The config loads; say from where."""
    try:
        cfg = context.load(ctx, path)
    except ConfigError as exc:
        report.add("config", "fail", exc.message, exc.hint)
        return None
    report.add("config", "ok", f"loaded from {cfg.source or 'the packaged defaults'}")
    return cfg


def check_storage(report: Report, cfg: Config) -> bool:
    """The storage root exists, is writable, has room; its mount and engine. True if usable."""
    from hf3fsctl.config import format_size
    from hf3fsctl.storage.factory import describe_engine_choice
    from hf3fsctl.storage.layout import root_problem

    root = Path(cfg.storage.path)
    problem = root_problem(root)  # missing, not a directory, its file system gone
    if problem is not None:
        report.add("storage.path", "fail", problem.message, problem.hint)
        return False
    report.add("storage.path", "ok", f"{root} exists")
    try:
        check_writable(root)
    except Hf3fsctlError as exc:
        detail, fix = unwritable(root, exc.message)
        report.add("storage.writable", "fail", detail, fix)
        return False
    report.add("storage.writable", "ok", "a probe file was written, synced and removed")
    usage = shutil.disk_usage(root)
    report.add(
        "storage.free_space", "ok", f"{format_size(usage.free)} free of {format_size(usage.total)}"
    )
    choice = describe_engine_choice(cfg.storage.engine, root)
    where = f"{choice['mount_point'] or '?'} ({choice['fstype']})"
    if choice["mount_point"] == "/":
        report.add(
            "storage.mount",
            "warn",
            f"{where}: the root file system, not 3FS; the store fills the system disk",
            "mount 3FS (or the file system meant for the cache) and run `hf3fsctl init "
            "--storage-path` on a directory under it",
        )
    else:
        report.add("storage.mount", "ok", where + (", a 3FS mount" if choice["on_3fs"] else ""))
    if choice["engine"] is None:
        report.add(
            "storage.engine",
            "fail",
            choice["reason"],
            "set storage.engine to auto or posix, or install the 3FS USRBIO binding",
        )
    elif choice["on_3fs"] and choice["engine"] != "usrbio":
        report.add(
            "storage.engine",
            "warn",
            f"{choice['engine']}: {choice['reason']}",
            "install the 3FS USRBIO Python binding (hf3fs_fuse) for full speed",
        )
    else:
        report.add("storage.engine", "ok", f"{choice['engine']}: {choice['reason']}")
    if choice["engine"] is None:
        report.add("storage.one_copy", "skip", "no I/O engine can be opened")
    else:
        state = "on" if choice["one_copy"] else "off"
        report.add("storage.one_copy", "ok", f"{state}: {choice['staging']}")
    return True


def unwritable(root: Path, reason: str) -> tuple[str, str]:
    """Why a store cannot be written, and the fix: a read-only mount or permissions."""
    from hf3fsctl.storage.engine import find_mount

    mount_point, fstype = find_mount(root)
    try:
        read_only = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return (
            f"the store is read-only: {fstype} at {mount_point or '?'} is mounted read-only "
            "(vLLM cannot save pages; init and evict refuse it)",
            f"remount it read-write (`mount -o remount,rw {mount_point or root}`); stats, "
            "ls and doctor read it as it is",
        )
    return (
        f"the store is not writable by uid {os.getuid()}: {reason}",
        f"give the user that runs vLLM and hf3fsctl write access to {root} and the files "
        "in it (chown/chmod), or run as the owner",
    )


def check_metadata(report: Report, client: MetadataClient) -> bool:
    """The service answers, and accepts an authenticated call. True if both."""
    embedded = client.url.startswith("sqlite:")
    try:
        client.health()
    except Hf3fsctlError as exc:
        report.add("metadata.reachable", "fail", f"{client.url}: {exc.message}", exc.hint)
        report.add("metadata.auth", "skip", "the service did not answer")
        return False
    report.add("metadata.reachable", "ok", f"{client.url} answers")
    if embedded:
        report.add("metadata.auth", "skip", "embedded SQLite store: no authentication")
        return True
    try:
        client.stats()
    except AuthError as exc:
        report.add("metadata.auth", "fail", exc.message, exc.hint)
        return False
    except Hf3fsctlError as exc:
        report.add(
            "metadata.auth", "fail", f"an authenticated call failed: {exc.message}", exc.hint
        )
        return False
    report.add("metadata.auth", "ok", "an authenticated call (stats) was accepted")
    check_redis(report, client)
    return True


def check_redis(report: Report, client: MetadataClient) -> None:
    """For a Redis store: the server's replication role and replicas, and the format."""
    from hf3fsctl.meta.protocol import Replicated

    if not isinstance(client, Replicated):
        return
    try:
        info = client.replication()
    except Hf3fsctlError as exc:
        report.add("metadata.redis", "fail", exc.message, exc.hint)
        return
    detail = (
        f"Redis {info['redis_version']}, role {info['role']}, "
        f"{info['connected_replicas']} replica(s) connected, store format {info['format']}"
        + (f", its Lua as {info['lua']}" if info.get("lua") else "")
    )
    policy = info.get("maxmemory_policy")
    if policy is not None and policy != "noeviction":
        report.add(
            "metadata.redis.eviction",
            "fail",
            f"maxmemory-policy is {policy}: when full, Redis drops keys of the metadata store "
            "itself (pages lost, counts broken)",
            "`redis-cli CONFIG SET maxmemory-policy noeviction` and the same line "
            "(`maxmemory-policy noeviction`) in redis.conf",
        )
    elif policy is None:
        report.add(
            "metadata.redis.eviction",
            "skip",
            "Redis refused CONFIG GET maxmemory-policy (a managed service?)",
            "make sure its maxmemory-policy is noeviction",
        )
    else:
        report.add("metadata.redis.eviction", "ok", "maxmemory-policy noeviction")
    if info["role"] != "master":
        report.add(
            "metadata.redis",
            "fail",
            detail + ": a replica refuses writes",
            "point metadata.url at the master, or use redis+sentinel://… to follow it",
        )
    elif info["connected_replicas"] == 0:
        report.add(
            "metadata.redis",
            "warn",
            detail + ": no replica, so a lost master loses the metadata",
            "add a replica and Sentinel (https://redis.io/docs/latest/operate/oss_and_stack/"
            "management/sentinel/) and use metadata.url redis+sentinel://HOST:PORT,…/SERVICE "
            "(docs/design.md, Redis metadata), or accept a cold cache after a Redis loss",
        )
    else:
        report.add("metadata.redis", "ok", detail)
    if "shards" in info:
        shards, masters, cluster = info["shards"], info["masters"], info["cluster_masters"]
        spread = f"{shards} shards on {masters} of the cluster's {cluster} masters"
        if masters < min(shards, cluster):
            report.add(
                "metadata.redis.shards",
                "warn",
                spread + ": the busiest master carries more than its share",
                "move the shards' slots apart (`redis-cli --cluster reshard`; `CLUSTER KEYSLOT` "
                "of each tag in docs/operations.md, Redis Cluster and shards)",
            )
        else:
            report.add("metadata.redis.shards", "ok", spread)


def check_capacity(report: Report, cfg: Config, client: MetadataClient) -> None:
    """The recorded capacity, what the store holds, and whether the disk can give it."""
    from hf3fsctl.config import format_size

    info = client.capacity()
    if info.capacity_bytes is None:
        report.add(
            "store.capacity",
            "warn",
            "no capacity recorded: the store may grow until the file system is full",
            f"hf3fsctl init --storage-path {cfg.storage.path} --capacity 80%",
        )
        return
    from hf3fsctl.cli.init import MIN_CAPACITY

    if info.capacity_bytes < MIN_CAPACITY:  # recorded by an hf3fsctl that did not check
        report.add(
            "store.capacity",
            "fail",
            f"capacity {format_size(info.capacity_bytes)} is too small to hold a page: "
            "every save is refused",
            f"hf3fsctl init --storage-path {cfg.storage.path} --capacity 80%",
        )
        return
    share = info.bytes_used / info.capacity_bytes
    detail = (
        f"{format_size(info.bytes_used)} of {format_size(info.capacity_bytes)} held "
        f"({share:.0%}), shared by every namespace"
    )
    report.add("store.capacity", "ok", detail)
    root = Path(cfg.storage.path)
    if root.is_dir():
        room = shutil.disk_usage(root).free + info.bytes_used
        if room < info.capacity_bytes:
            report.add(
                "store.room",
                "warn",
                f"the file system can give the store {format_size(room)}, less than its "
                f"capacity: writes will fail with no space before eviction frees any",
                "free space on the file system, or record a smaller capacity with "
                "`hf3fsctl init --capacity`",
            )


def check_writers(report: Report, client: MetadataClient) -> None:
    """Namespaces written by engines with other numerics (docs/design.md decision 15)."""
    from hf3fsctl.cli.writers import differing, read_writers

    writers = read_writers(client)
    mixed = {ns: found for ns, found in writers.items() if len(found) > 1}
    if not writers:
        report.add(
            "store.writers",
            "skip",
            "no writers recorded yet (recorded with a connector's first saved page)",
        )
        return
    report.add(
        "store.writers",
        "ok" if not mixed else "warn",
        f"{len(writers)} namespaces with recorded writers, {len(mixed)} with more than one",
    )
    for ns, found in sorted(mixed.items()):
        report.add(
            f"namespace.{ns}.writers",
            "warn",
            f"{len(found)} writers with other numerics (differ in "
            f"{', '.join(differing(found)) or 'their hash'}): pages mix KV computed "
            "differently, which can change greedy tokens",
            "run every engine with the same args (config vllm:, `hf3fsctl warm` uses them), "
            "check with `hf3fsctl verify`, or set connector.strict_numerics: true",
        )


def check_connectors(report: Report, cfg: Config | None = None) -> None:
    """Connectors of this node that are disabled or degraded (their status files).

    With a config, only this store's connectors are reported (other stores' are counted).
    A connector that exited troubled keeps its file, so its reason outlives it; it is
    reported until a later connector of the same store, namespace, role and rank has
    written one (the engine was restarted: the newer file says how that one is doing).
    """
    import time

    from hf3fsctl.health import read_status, state_dir

    records = read_status()
    if not records:
        report.add("connectors", "skip", f"no connector status files in {state_dir()}")
        return
    others = 0
    if cfg is not None:
        store = os.path.realpath(cfg.storage.path)
        mine = [r for r in records if os.path.realpath(str(r.get("storage_path", ""))) == store]
        others = len(records) - len(mine)
        records = mine

    def identity(record: dict[str, Any]) -> tuple[object, ...]:
        return (record.get("namespace"), record["role"], record["rank"])

    newest: dict[tuple[object, ...], float] = {}
    for record in records:
        key = identity(record)
        newest[key] = max(newest.get(key, 0.0), float(record.get("updated", 0)))
    running = [r for r in records if r["alive"]]
    healthy = sum(1 for r in running if r["state"] == "ok")
    elsewhere = f" ({others} of other stores not shown)" if others else ""
    report.add("connectors", "ok", f"{len(running)} running here, {healthy} healthy{elsewhere}")
    for record in records:
        if record["state"] == "ok":
            continue
        who = f"{record['role']} rank {record['rank']} (pid {record['pid']})"
        now = time.time()
        if record["alive"]:
            status = "fail" if record["state"] == "disabled" else "warn"
            age = now - float(record.get("since", 0))
            detail = f"{who} {record['state']} for {age:.0f}s: {record['reason']}"
        else:
            if newest[identity(record)] > float(record.get("updated", 0)):
                continue  # restarted since: the newer connector's file is the one to read
            status = "warn"
            ago = now - float(record.get("updated", 0))
            detail = (
                f"{who}, exited (last seen {ago:.0f}s ago), was {record['state']}: "
                f"{record['reason']}"
            )
        report.add(f"connector.{record['pid']}.{record['role']}", status, detail, record["fix"])


def check_staging(report: Report) -> None:
    """Which staging path (compiled ops or pure torch) this node's torch gets, and the fix."""
    from hf3fsctl.ops.status import staging_path

    try:
        path = staging_path()
    except ImportError as exc:  # torch absent: fine for a metadata-only node
        report.add("staging", "skip", f"{exc.name} is not installed: no staging on this node")
        return
    status = "warn" if path.cuda_visible and not path.fast else "ok"
    report.add("staging", status, path.describe(), path.fix)


def check_invariants(report: Report, cfg: Config, client: MetadataClient | None = None) -> None:
    """The embedded store's file is sound (`PRAGMA integrity_check`) and its invariants hold
    (pages owned once, counts consistent, …); a backup is checked the same way. A Redis
    store is checked through its client, which is the store itself."""
    db = context.sqlite_path(cfg.metadata_target)
    from hf3fsctl.meta.protocol import SelfChecking

    if db is None and cfg.metadata_target.redis and isinstance(client, SelfChecking):
        _report_invariants(report, list(client.check_invariants()), cfg.metadata_target.url)
        return
    if db is None:
        report.add(
            "metadata.invariants",
            "skip",
            "checked only on the store's host",
            f"on the server host: HF3FSCTL_METADATA_URL=sqlite:///{cfg.storage.path}/metadata.db "
            "hf3fsctl doctor",
        )
        return
    from hf3fsctl.meta.sqlite.store import MetadataStore

    store = MetadataStore(db, read_only=True)
    try:
        problems = store.check_integrity() + store.check_invariants()
    finally:
        store.close()
    _report_invariants(report, problems, str(db))


def _report_invariants(report: Report, problems: list[str], where: str) -> None:
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; … {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        report.add(
            "metadata.invariants",
            "fail",
            f"{len(problems)} violations: {shown}",
            "stop writers, back up the DB, then `hf3fsctl evict --all -y` to reset the index",
        )
    else:
        report.add("metadata.invariants", "ok", f"{where} is consistent")


def doctor(
    ctx: typer.Context,
    config: ConfigOpt = None,
    checksums: Annotated[
        bool, typer.Option("--checksums", help="Read back committed pages and verify checksums.")
    ] = False,
    sample: Annotated[
        int | None,
        typer.Option(
            "--sample",
            min=1,
            metavar="N",
            help="Pages to verify per namespace (implies --checksums; default 256).",
        ),
    ] = None,
    all_pages: Annotated[
        bool,
        typer.Option("--all-pages", help="Verify every committed page (implies --checksums)."),
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Check the deployment: config, storage, engine, metadata, auth, manifests, pages."""
    if sample is not None and all_pages:
        raise InvalidRequest("--sample and --all-pages contradict each other; pass one")
    checksums = checksums or sample is not None or all_pages
    report = Report()
    cfg = check_config(report, ctx, config)
    if cfg is not None:
        storage_ok = check_storage(report, cfg)
        try:
            # only --checksums writes (read leases): the rest works on a read-only store
            client = context.connect(cfg, read_only=not checksums)
        except Hf3fsctlError as exc:
            report.add("metadata.reachable", "fail", exc.message, exc.hint)
        else:
            try:
                if check_metadata(report, client):
                    check_invariants(report, cfg, client)
                    check_capacity(report, cfg, client)
                    check_writers(report, client)
                    if storage_ok:
                        doctor_store.check_namespaces(report, cfg, client)
                        if checksums:
                            doctor_store.check_checksums(
                                report,
                                cfg,
                                client,
                                sample=None if all_pages else sample or DEFAULT_SAMPLE,
                                show_progress=not json,
                            )
            finally:
                client.close()
    check_connectors(report, cfg)
    check_staging(report)
    if json:
        output.print_json(report.to_dict())
    else:
        output.show(output.table(["status", "check", "detail", "fix"], report.rows()))
    if report.failed:
        raise typer.Exit(EXIT_CHECK_FAILED)
