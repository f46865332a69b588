"""Typed errors raised by the core library.

Every error carries a one-line message, a hint (the next step to try) and the exit code
the CLI uses for it. The CLI maps them to output in exactly one place
(`hf3fsctl.cli.errors`); the connector turns them into misses and counters.
"""

from __future__ import annotations

import errno as _errno

# The OS errors that mean "no room": a full file system or an exhausted quota.
NO_SPACE_ERRNOS = frozenset({_errno.ENOSPC, _errno.EDQUOT})
# The OS errors that mean "the file system is gone from under a mount point": a FUSE
# mount whose daemon exited (3FS after hf3fs_fuse died: ENOTCONN on every call), a stale
# network handle, a host or device that went away.
UNREACHABLE_ERRNOS = frozenset({_errno.ENOTCONN, _errno.ESTALE, _errno.EHOSTDOWN, _errno.ENODEV})


class Hf3fsctlError(Exception):
    """Base class of every error the library raises on purpose."""

    exit_code: int = 1
    hint: str = ""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class ConfigError(Hf3fsctlError):
    """A configuration value is missing, malformed or out of range."""

    exit_code = 2
    hint = "fix the key named above in the config file, the HF3FSCTL_* environment or the flag"


class MissingExtra(ConfigError):
    """A command needs an optional part of hf3fsctl that is not installed here: the
    `server` extra (fastapi, uvicorn, prometheus-client) for `hf3fsctl serve`, the `redis`
    extra (redis-py) for a `redis://` store. `extra` names it."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"this command needs {module}, which is not installed here: install hf3fsctl[{extra}]",
            hint=f"pip install 'hf3fsctl[{extra}]'",
        )
        self.module = module
        self.extra = extra


class InvalidRequest(Hf3fsctlError):
    """A request (CLI argument, API body) is malformed or out of bounds."""

    exit_code = 2


class NotFound(Hf3fsctlError):
    """A namespace, rank file or entry does not exist."""

    exit_code = 3


class NamespaceConflict(Hf3fsctlError):
    """A namespace or rank file was registered again with different properties."""

    exit_code = 4
    hint = "pages are only ever read back into the layout that wrote them; check the manifest"


class StorageError(Hf3fsctlError):
    """Page files are missing, too small, unreadable or unwritable.

    `errno` is the OS error behind it when there was one (``ENOSPC`` for a full disk), so
    callers count failures by kind (`no_space`) without reading the message.
    """

    exit_code = 5
    hint = "check storage.path, free space and permissions (`hf3fsctl doctor`)"

    def __init__(self, message: str, *, hint: str | None = None, errno: int | None = None) -> None:
        super().__init__(message, hint=hint)
        self.errno = errno

    @property
    def no_space(self) -> bool:
        """The file system (or a quota) is full: ENOSPC or EDQUOT."""
        return self.errno in NO_SPACE_ERRNOS

    @classmethod
    def from_os_error(cls, exc: OSError) -> StorageError:
        """An OS error on a store's path, as one line that names the path and the fix."""
        where = f"{exc.filename}: " if exc.filename else ""
        reason = exc.strerror or str(exc)
        if exc.errno in UNREACHABLE_ERRNOS:
            return cls(
                f"{where}{reason}: its file system is not reachable (a FUSE mount such as "
                "3FS whose daemon exited, or a stale network mount)",
                hint="remount it (`umount -l MOUNT`, then mount it again)",
                errno=exc.errno,
            )
        if exc.errno in NO_SPACE_ERRNOS:
            hint = "free space on that file system, or lower the store's capacity"
        elif exc.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS):
            hint = "check the path's permissions and that its file system is mounted writable"
        else:
            hint = (
                "check the path and its file system (`hf3fsctl doctor`); HF3FSCTL_DEBUG=1 "
                "shows the traceback"
            )
        return cls(f"{where}{reason}", hint=hint, errno=exc.errno)


class MetadataUnavailable(Hf3fsctlError):
    """The metadata service did not answer in time, or answered with a server error."""

    exit_code = 6
    hint = "is `hf3fsctl serve` running and reachable at metadata.url? (`hf3fsctl doctor`)"


class AuthError(Hf3fsctlError):
    """The metadata service refused the bearer token (or none was given)."""

    exit_code = 7
    hint = "set metadata.token_file to the file `hf3fsctl serve --token-file` reads"


class StoreFormatError(MetadataUnavailable):
    """The metadata store is in a format this hf3fsctl does not open as it is.

    Newer than this code: upgrade hf3fsctl. Older: `hf3fsctl migrate` brings it forward
    (never done implicitly on open, since processes of several versions may share one
    store). Nothing in the store is changed. A `MetadataUnavailable`, so the connector
    serves misses and stays disabled with the hint instead of failing.
    """

    def __init__(self, message: str, *, hint: str, stored: int, supported: int) -> None:
        super().__init__(message, hint=hint)
        self.stored = stored  # the format the store records
        self.supported = supported  # the format this code reads and writes


class AddressInUse(Hf3fsctlError):
    """`serve` cannot listen on its address: the port is taken, or the address is not
    one of this machine's."""

    exit_code = 9
    hint = "stop what holds the port (`ss -ltnp | grep :PORT`) or pass another --port"


class OpsBuildError(Hf3fsctlError):
    """The staging ops could not be built: a tool is missing, or a compiler failed.

    `output` holds the failing tool's command line and output (empty when a tool is
    missing: the message names it).
    """

    exit_code = 8
    hint = "run `hf3fsctl build-ops --cpu` for the CPU op, or install what is named above"
    output: str = ""
