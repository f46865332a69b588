"""Which I/O engine opens for a storage root, and why (the factory of `IOEngine`s).

Contract:
    * `open_engine("auto")` picks USRBIO only when the root is on a 3FS mount and the
      USRBIO binding (`hf3fs_fuse.io`) imports; otherwise POSIX. The choice, the reason
      and whether staging is one copy from storage are logged. `open_engine("usrbio")`
      where USRBIO cannot work raises `StorageError` naming `storage.engine` and the fix;
      "auto" whose USRBIO engine fails to start logs a warning and opens POSIX. Nothing
      falls back silently to a slower path (docs/design.md decision 10).
    * `describe_engine_choice` says what `open_engine` would do without opening anything
      (for `hf3fsctl doctor`).

The engines import only `hf3fsctl.storage.engine` (the protocol); this module imports
them, so the factory is the one place that knows every engine.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any

from hf3fsctl.errors import InvalidRequest, StorageError
from hf3fsctl.storage.engine import THREEFS_FSTYPES, USRBIO_BINDING, IOEngine, find_mount
from hf3fsctl.storage.posix import PosixEngine

logger = logging.getLogger(__name__)

ENGINE_KINDS = ("auto", "posix", "usrbio")
USRBIO_FIX = (
    "set storage.engine to auto or posix, or run on a 3FS mount with 3FS's USRBIO "
    "Python binding (hf3fs_fuse) installed"
)


def usrbio_import_error(binding: str = USRBIO_BINDING) -> str | None:
    """None when the USRBIO Python binding imports, else why it does not."""
    try:
        importlib.import_module(binding)
    except Exception as exc:
        return f"{binding}: {type(exc).__name__}: {exc}"
    return None


def describe_engine_choice(
    kind: str,
    root: str | os.PathLike[str] | None,
    *,
    binding: str = USRBIO_BINDING,
    mounts_text: str | None = None,
) -> dict[str, Any]:
    """Which engine `open_engine(kind, root=root)` would use, and why (for `doctor`).

    Args:
        kind: "auto", "posix" or "usrbio".
        root: the storage root.
        binding: the USRBIO binding module (tests pass a fake).
        mounts_text: /proc/mounts' contents (read when None).

    Returns:
        A dict with `requested`, `root`, `mount_point`, `fstype`, `on_3fs`,
        `usrbio_importable`, `usrbio_error`, `engine` ("posix", "usrbio" or None when the
        request cannot be met), `reason`, `one_copy` (staging buffers are the engine's
        own I/O memory, so a page is copied once between GPU and storage) and `staging`
        (that in words).
    """
    if kind not in ENGINE_KINDS:
        raise InvalidRequest(f"unknown I/O engine {kind!r}; expected one of {ENGINE_KINDS}")
    mount_point, fstype = find_mount(root, mounts_text) if root is not None else ("", "unknown")
    on_3fs = fstype in THREEFS_FSTYPES
    error = usrbio_import_error(binding) if kind != "posix" else None
    importable = kind != "posix" and error is None
    info: dict[str, Any] = {
        "requested": kind,
        "root": None if root is None else str(root),
        "mount_point": mount_point,
        "fstype": fstype,
        "on_3fs": on_3fs,
        "usrbio_importable": importable,
        "usrbio_error": error,
    }
    where = f"{root} is on {mount_point or '?'} ({fstype})"
    if kind == "posix":
        engine, reason = "posix", "posix requested"
    elif on_3fs and importable:
        engine, reason = "usrbio", f"{where} and the USRBIO binding imports"
    elif kind == "usrbio":
        missing = [] if on_3fs else [f"{where}, not a 3FS mount"]
        if not importable:
            missing.append(f"no USRBIO binding ({error})")
        engine, reason = None, "usrbio requested but unavailable: " + "; ".join(missing)
    elif not on_3fs:
        engine, reason = "posix", f"{where}, not a 3FS mount"
    else:
        engine, reason = "posix", f"{where} but no USRBIO binding imports ({error})"
    info["engine"] = engine
    info["reason"] = reason
    info["one_copy"] = engine == "usrbio"
    info["staging"] = _STAGING_WORDS.get(engine or "", "no engine can be opened")
    return info


_STAGING_WORDS = {
    "usrbio": "staging buffers are allocated inside the USRBIO iov: one copy each way "
    "(KV cache to staging, then 3FS reads or writes the staging memory itself)",
    "posix": "preadv/pwritev go straight between staging buffers and the file system "
    "(the kernel's copy; no USRBIO iov)",
}


def open_engine(
    kind: str,
    *,
    io_threads: int = 16,
    o_direct: bool = False,
    root: str | os.PathLike[str] | None = None,
    binding: str = USRBIO_BINDING,
    mounts_text: str | None = None,
) -> IOEngine:
    """Open an I/O engine.

    Args:
        kind: "auto", "posix" or "usrbio".
        io_threads: parallel I/O threads (1..256).
        o_direct: use O_DIRECT where buffer address, length and offset are 4096-aligned.
        root: the storage root (decides "auto" and is required for "usrbio").
        binding: the USRBIO binding module (tests pass a fake).
        mounts_text: /proc/mounts' contents (read when None).

    Raises:
        StorageError: "usrbio" was requested where it cannot work (the message names
            `storage.engine`, the hint says how to fix it).
        InvalidRequest: an unknown kind or thread count.
    """
    if (
        isinstance(io_threads, bool)
        or not isinstance(io_threads, int)
        or not 1 <= io_threads <= 256
    ):
        raise InvalidRequest(f"io_threads must be in 1..256, got {io_threads!r}")
    choice = describe_engine_choice(kind, root, binding=binding, mounts_text=mounts_text)
    if choice["engine"] is None:
        raise StorageError(f"storage.engine: {choice['reason']}", hint=USRBIO_FIX)
    if choice["engine"] == "usrbio":
        # Lazy: the USRBIO engine loads numpy and shared memory; POSIX hosts never need it.
        from hf3fsctl.storage.usrbio import UsrbioEngine

        try:
            engine: IOEngine = UsrbioEngine(
                root=Path(str(root)), io_threads=io_threads, binding=binding
            )
        except StorageError as exc:
            if kind == "usrbio":
                raise StorageError(
                    f"storage.engine: usrbio requested but it did not start: {exc.message}",
                    hint=USRBIO_FIX,
                ) from None
            logger.warning(
                "I/O engine: posix, not usrbio (%s, but USRBIO did not start: %s); %s",
                choice["reason"],
                exc.message,
                _STAGING_WORDS["posix"],
            )
        else:
            logger.info("I/O engine: usrbio (%s); %s", choice["reason"], choice["staging"])
            return engine
    else:
        logger.info("I/O engine: posix (%s); %s", choice["reason"], choice["staging"])
    return PosixEngine(io_threads=io_threads, o_direct=o_direct)
