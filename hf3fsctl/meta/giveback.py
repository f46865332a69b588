"""Giving freed pages' disk space back to the file system: the punch between the two
phases of a give-back (`HolePuncher`), for the SQLite and the Redis store alike.

A store *marks* free pages inside a transaction or script (they stay counted as held),
this process punches them, and the store *settles* the marks (holes, no longer held) or
returns them to the free list if the file system refused (`meta/sqlite/capacity.py` says why
two phases).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

# (namespace, rank, relpath, slot_bytes, pages) of one file's pages to give back.
GiveBack = tuple[str, int, str, int, list[int]]

logger = logging.getLogger(__name__)


class HolePuncher:
    """Gives freed pages' disk space back to the file system from this process (the
    punch between the two phases), for the SQLite and the Redis store alike.

    Needs the storage root here and a file system that punches holes, probed once on a
    scratch file (FUSE mounts often refuse). After a refusal it stops relying on it, so
    eviction never takes other namespaces' keys for space that would not come back.
    """

    def __init__(self, storage_root: str | None) -> None:
        self.root = storage_root
        self._probed = False
        self._refused = False

    def available(self) -> bool:
        """Whether freed space can be given back from this process."""
        if self._refused or self.root is None or not os.path.isdir(self.root):
            return False
        if not self._probed:
            from hf3fsctl.storage.layout import punch_pages

            name = f".hf3fsctl-punch-probe-{os.getpid()}-{threading.get_ident()}"
            path = os.path.join(self.root, name)
            try:
                with open(path, "wb") as probe:
                    probe.write(b"\1" * 8192)
                works = punch_pages(self.root, name, 4096, [0])
            except OSError:
                works = False
            finally:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            self._probed = True
            if not works:
                self._refuse(self.root)
        return not self._refused

    def punch(self, marked: Sequence[GiveBack]) -> tuple[list[GiveBack], list[GiveBack]]:
        """Punch the marked pages; returns (punched, refused)."""
        from hf3fsctl.storage.layout import punch_pages

        done: list[GiveBack] = []
        refused: list[GiveBack] = []
        for item in marked:
            ok = self.root is not None and punch_pages(self.root, item[2], item[3], item[4])
            (done if ok else refused).append(item)
        if refused:
            self._refuse(refused[0][2])
        return done, refused

    def _refuse(self, where: str) -> None:
        if not self._refused:
            self._refused = True
            logger.warning(
                "cannot give freed pages back to the file system at %s (no hole punching "
                "there): freed space stays with each page file, and eviction for the "
                "store's capacity takes only the allocating namespace's own keys",
                where,
            )
