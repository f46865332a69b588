"""Capture mode (`connector.capture`, set by `hf3fsctl verify`): the pages a save would
write, kept in this process's memory instead.

Contract: the worker side of an engine in capture mode loads nothing (its scheduler
side answers every lookup with a miss) and writes nothing to the store (no page file,
no registration, no writer record); each save job's blocks are gathered exactly as a
save gathers them and kept here by namespace and key, the first capture of a key winning
(the bytes a save would have committed). Only an in-process engine
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, TP 1) shares this memory with its caller.
"""

from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_PAGES: dict[str, dict[str, torch.Tensor]] = {}  # namespace → key → uint8 page


def keep(namespace: str, keys: list[str], rows: torch.Tensor) -> None:
    """Keep `rows[i]` as the page of `keys[i]` (a copy on the host)."""
    host = rows.to("cpu", copy=True)
    with _LOCK:
        pages = _PAGES.setdefault(namespace, {})
        for index, key in enumerate(keys):
            pages.setdefault(key, host[index])


def captured() -> dict[str, dict[str, torch.Tensor]]:
    """Every page captured so far, by namespace and key."""
    with _LOCK:
        return {ns: dict(pages) for ns, pages in _PAGES.items()}


def clear() -> None:
    """Forget every captured page."""
    with _LOCK:
        _PAGES.clear()
