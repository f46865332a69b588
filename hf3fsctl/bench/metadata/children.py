"""Functions run in a forked child process, their result (or error) sent back.

Contract: `in_child(fn, *args)` runs `fn(*args)` in a fresh fork (the parent stays
lean: a store's fill never loads its index into the benchmark process) and returns its
result; a child that fails or dies raises `MetadataUnavailable` naming why.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from hf3fsctl.errors import MetadataUnavailable


def fork_context() -> Any:
    """The `fork` start method (clients and set-up children inherit nothing to pickle)."""
    return multiprocessing.get_context("fork")


def _child_entry(fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as exc:
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def in_child(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` in a forked child (keeps this process's memory lean); its result."""
    ctx = fork_context()
    queue = ctx.Queue()
    child = ctx.Process(target=_child_entry, args=(fn, args, queue), daemon=True)
    child.start()
    try:
        while True:
            try:
                status, value = queue.get(timeout=1.0)
                break
            except Exception:  # queue.Empty: still working, unless it died
                if not child.is_alive():
                    try:  # it may have answered just before exiting
                        status, value = queue.get(timeout=1.0)
                    except Exception:
                        status, value = "error", f"the child exited with {child.exitcode}"
                    break
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    if status != "ok":
        raise MetadataUnavailable(f"benchmark set-up failed: {value}")
    return value
