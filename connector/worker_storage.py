"""Storage side of a connector worker: the I/O engine, this rank's page file, registration.

`WorkerStorage` is the base of `connector.worker.WorkerSide`: it owns what one rank
needs to reach the store and nothing about vLLM's jobs, threads or staging transfers.

Contract:
    * `_open_storage` (from `WorkerSide.register_kv_caches`) opens the I/O engine and
      this rank's page file (growing on demand, or preallocated), and writes the
      namespace manifest beside it; `ensure_registered` registers namespace and rank
      with the metadata service (retried later if the service is down at start-up). A
      rank already registered keeps its registration: its file is reopened as it says.
    * The cache never stops inference (docs/design.md decision 14): a storage failure at
      start-up (missing or read-only mount, no space, permissions, an unopenable
      metadata DB, a namespace conflict) logs one error with the fix and leaves the
      connector disabled (`disabled` says why; `health` records it for `doctor` and
      Prometheus), tried again every `connector.storage_retry_s` by `retry_storage`.
    * `tier` is this rank's pages as a `hf3fsctl.tier.Tier` (None until the page file
      and engine are open), rebuilt when either changes.
    * `_prewarm_staging` (a background thread after registration) faults in
      `staging_prewarm_bytes` of staging, so the first save's in-step gather does not
      pay for fresh memory.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from hf3fsctl.config import Config
from hf3fsctl.errors import (
    UNREACHABLE_ERRNOS,
    AuthError,
    ConfigError,
    Hf3fsctlError,
    MetadataUnavailable,
    NamespaceConflict,
    StorageError,
    StoreFormatError,
)
from hf3fsctl.health import ConnectorHealth
from hf3fsctl.keys import NamespaceManifest
from hf3fsctl.meta.models import RankFile
from hf3fsctl.staging import StagingPool
from hf3fsctl.storage.engine import IOEngine, engine_host_memory
from hf3fsctl.storage.factory import open_engine
from hf3fsctl.storage.layout import PageFile, rank_file_name, root_problem, write_manifest
from hf3fsctl.tier import Tier

from .service import MetadataGuard

logger = logging.getLogger(__name__)


class WorkerStorage:
    """One rank's engine, page file, registration state and health."""

    def __init__(
        self,
        config: Config,
        manifest: NamespaceManifest,
        *,
        rank: int,
        guard: MetadataGuard,
        pool: StagingPool,
        staging_prewarm_bytes: int = 0,
    ) -> None:
        self.config = config
        self.staging_prewarm_bytes = staging_prewarm_bytes  # warmed after registration
        self.manifest = manifest
        self.namespace = manifest.namespace_id
        self.rank = rank
        self.guard = guard
        # One pool may serve the worker sides of several KV cache groups (`pool`).
        self.pool = pool
        self.page_file: PageFile | None = None
        self.engine: IOEngine | None = None
        self._tier: Tier | None = None  # over page_file and engine (rebuilt when they change)
        self.disabled: str | None = "KV caches not registered yet"  # why no I/O now
        self.health = ConnectorHealth(
            role="worker",
            rank=self.rank,
            namespace=self.namespace,
            storage_path=config.storage.path,
        )
        self._storage_retry_at = 0.0  # when to try opening failed storage again
        self._registered = False
        self._register_lock = threading.Lock()

    @staticmethod
    def _describe_file(file: PageFile) -> str:
        kind = "growing on demand" if file.growable else f"{file.num_pages} pages preallocated"
        return f"{file.path} ({kind})"

    def _open_storage(self) -> bool:
        """Open the I/O engine, this rank's page file and manifest; disable on failure.

        Returns:
            True when storage is open. Never raises a storage error: the connector is
            disabled instead (logged once with the fix) and tried again later.
        """
        storage = self.config.storage
        root = Path(storage.path)
        try:
            problem = root_problem(root, creatable=True)  # never a missing mount's
            if problem is not None:
                raise problem
            if not root.is_dir():
                root.mkdir(exist_ok=True)
                logger.info("created storage root %s", root)
            if self.engine is None:
                self.engine = open_engine(
                    storage.engine,
                    io_threads=storage.io_threads,
                    o_direct=storage.o_direct,
                    root=storage.path,
                )
                # USRBIO: staging buffers inside its iov, so a page is copied only once.
                self.pool.use_host_memory(engine_host_memory(self.engine))
            if self.page_file is None:
                if storage.preallocate:
                    self.page_file = PageFile.create(
                        root,
                        self.namespace,
                        self.rank,
                        self.manifest.page_bytes,
                        storage.file_size,
                    )
                else:
                    self.page_file = PageFile.create_growable(
                        root, self.namespace, self.rank, self.manifest.page_bytes
                    )
            write_manifest(root, self.manifest)
        except (StorageError, OSError) as exc:
            error = exc if isinstance(exc, StorageError) else StorageError.from_os_error(exc)
            message = error.message
            fix = f"check that {root} is mounted, writable and has free space"
            if message.startswith("storage.engine") or error.errno in UNREACHABLE_ERRNOS:
                fix = error.hint  # an engine that cannot work here, a mount to remount
            self._disable(
                f"storage unusable: {message}",
                f"{fix} (`hf3fsctl doctor`); the connector retries by itself",
            )
            return False
        return True

    def _disable(self, reason: str, fix: str) -> None:
        self.disabled = reason
        self._storage_retry_at = time.monotonic() + self.config.connector.storage_retry_s
        self.health.disable(reason, fix)

    def retry_storage(self) -> bool:
        """Try a failed start-up again once its back-off passed (from save threads)."""
        if self.disabled is None:
            return True
        if time.monotonic() < self._storage_retry_at:
            return False
        with self._register_lock:
            if self.disabled is None:
                return True
            self._storage_retry_at = time.monotonic() + self.config.connector.storage_retry_s
        if self.page_file is None and not self._open_storage():
            return False
        return self.ensure_registered()

    def _prewarm_staging(self) -> None:
        """Fault in one step's worth of staging now, not in the first save's step."""
        nbytes = min(self.staging_prewarm_bytes, self.pool.capacity_bytes)
        started = time.monotonic()
        try:
            warmed = self.pool.prewarm(nbytes)
        except Exception as exc:  # an optimisation only
            logger.warning("staging prewarm of %d MiB failed: %s", nbytes >> 20, exc)
            return
        logger.debug(
            "staging prewarm of %d MiB: %s in %.2f s",
            nbytes >> 20,
            "done" if warmed else "skipped (over capacity)",
            time.monotonic() - started,
        )

    def ensure_registered(self) -> bool:
        """Register namespace and rank file with the service (once); False if it is down.

        A rank already registered (by `hf3fsctl init --preallocate`, or a store from an
        older version) keeps its registration: this rank's file is reopened as it says.
        """
        if self._registered:
            return True
        with self._register_lock:
            if self._registered:
                return True
            if self.page_file is None and (self.disabled is not None or not self._open_storage()):
                return False  # storage is being retried; or its file went with the namespace
            try:
                info = self.guard.call(
                    lambda c: c.register_namespace(self.namespace, self.manifest.to_dict())
                )
                registered = next((f for f in info.rank_files if f.rank == self.rank), None)
                if registered is not None:
                    self._adopt(registered)
                rank_file = self._rank_file()
                self.guard.call(lambda c: c.register_rank(self.namespace, rank_file))
            except NamespaceConflict as exc:
                self._disable(
                    f"namespace conflict: {exc.message}",
                    "the store holds this namespace with another geometry; see `hf3fsctl "
                    "stats`, or remove the stale namespace with `hf3fsctl evict --stale`",
                )
                return False
            except (StorageError, OSError) as exc:
                self._disable(
                    f"page file unusable: {exc}", "check the storage with `hf3fsctl doctor`"
                )
                return False
            except StoreFormatError as exc:  # newer store, or an older one not migrated
                self._disable(exc.message, f"{exc.hint}; the connector retries by itself")
                return False
            except (AuthError, ConfigError) as exc:  # refused credentials, an unreadable
                # token file: configuration errors, found once the client opens
                self._disable(exc.message, f"{exc.hint}; the connector retries by itself")
                return False
            except MetadataUnavailable as exc:  # down: the guard logged the outage once
                logger.debug("registering rank %d deferred: %s", self.rank, exc)
                return False
            except Hf3fsctlError as exc:
                logger.warning("registering rank %d deferred: %s", self.rank, exc)
                return False
            except Exception as exc:  # e.g. an embedded DB on a read-only mount
                self._disable(
                    f"metadata store unusable: {type(exc).__name__}: {exc}",
                    f"check metadata.url ({self.guard.url}) with `hf3fsctl doctor`",
                )
                return False
            self._registered = True
            self.disabled = None
            if self.health.state != "ok":
                self.health.recover()
            self.health.publish()
            return True

    def forget_registration(self) -> None:
        """The store no longer knows this namespace or rank: its metadata was reset (a
        Redis restarted without persistence) or the namespace was removed while this
        engine ran. The next save registers both again, with a new page file if the old
        one went with the namespace (logged once per loss)."""
        with self._register_lock:
            if not self._registered:
                return
            self._registered = False
            if self.page_file is not None and self.page_file.removed:
                self.page_file = None  # re-created; loads still reading it keep their handle
        logger.warning(
            "namespace %s rank %d is no longer registered in the store (its metadata was "
            "reset or the namespace removed): registering it again with the next save",
            self.namespace,
            self.rank,
        )

    def page_file_lost(self) -> bool:
        """After an I/O failure: whether this rank's open page file no longer reaches its
        file (`PageFile.removed`): its file system is gone from under the mount (a FUSE
        daemon that exited: ENOTCONN), or came back as a new mount the old descriptor
        does not reach. If so the file is dropped and the connector disabled (loads
        fail fast, saves are dropped); the background retry opens it again once the
        mount answers, and registers again. Returns True when it was lost."""
        file = self.page_file
        if file is None:
            return self.disabled is not None  # lost already (by another job's failure)
        if not file.removed:
            return False
        with self._register_lock:
            if self.page_file is not file:
                return True  # another failure got here first
            self.page_file = None  # loads still reading it keep their (failing) handle
            self._registered = False
        problem = root_problem(self.config.storage.path)
        reason = problem.message if problem else f"{file.path} is not the file it had open"
        self._disable(
            f"storage unusable: {reason}",
            "remount the file system if it is gone (`umount -l MOUNT`, then mount it "
            "again; `hf3fsctl doctor`); the connector reopens the page file by itself",
        )
        return True

    def _rank_file(self) -> RankFile:
        file = self.page_file
        assert file is not None
        return RankFile(
            rank=self.rank,
            path=file.relpath,
            page_bytes=file.page_bytes,
            slot_bytes=file.slot_bytes,
            num_pages=file.num_pages,
            preallocated=not file.growable,
        )

    def _adopt(self, registered: RankFile) -> None:
        """Reopen this rank's page file as the store registered it (fixed or growing)."""
        current = self._rank_file()
        if registered == current:
            return
        if registered.path != rank_file_name(self.namespace, self.rank):
            return  # a conflict: register_rank reports it
        root = self.config.storage.path
        if registered.preallocated:
            reopened = PageFile.open(
                root, registered.path, registered.page_bytes, registered.num_pages
            )
        else:
            reopened = PageFile.create_growable(
                root, self.namespace, self.rank, registered.page_bytes
            )
        old, self.page_file = self.page_file, reopened
        if old is not None:
            old.close()

    @property
    def tier(self) -> Tier | None:
        """This rank's pages as a `Tier` (None until the page file and engine are open).

        Releases go to the client even while the guard has the service marked down: the
        store reclaims what they miss only after the allocations' deadline.
        """
        file, engine = self.page_file, self.engine
        if file is None or engine is None:
            return None
        tier = self._tier
        if tier is None or tier.page_file is not file or tier.engine is not engine:
            tier = self._tier = Tier(
                self.namespace,
                self.rank,
                file,
                engine,
                self.guard.call,
                self.pool,
                release_call=lambda fn: fn(self.guard.client()),
            )
        return tier
