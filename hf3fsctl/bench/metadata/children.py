"""Functions run in a forked child process, their result (or error) sent back.

Contract: `in_child(fn, *args)` runs `fn(*args)` in a fresh fork (the parent stays
lean: a store's fill never loads its index into the benchmark process) and returns its
result (`start_child` runs it beside the caller's own work, `Child.result` waits);
a child that fails or dies raises `MetadataUnavailable` naming why.
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
    return start_child(fn, *args).result()


class Child:
    """A forked child running one function; `result()` waits for it."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        ctx = fork_context()
        self.queue = ctx.Queue()
        self.process = ctx.Process(target=_child_entry, args=(fn, args, self.queue), daemon=True)
        self.process.start()

    def result(self) -> Any:
        """Its function's result.

        Raises:
            MetadataUnavailable: it failed or died.
        """
        return _wait(self.process, self.queue)


def start_child(fn: Callable[..., Any], *args: Any) -> Child:
    """Start `fn(*args)` in a forked child (run beside this process's own work)."""
    return Child(fn, args)


def _wait(child: Any, queue: Any) -> Any:
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
