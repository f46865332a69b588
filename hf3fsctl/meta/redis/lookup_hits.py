"""The hits of this process's Redis lookups, counted with a later call.

A lookup learns how many leading keys hit only once Redis answered it, so its hits ride
along with the next lookup (`take` / `add`), or are counted at stats, close or process
exit (`count`). Kept apart from `RedisMetadataStore` so the exit-time flush holds no
reference to the store.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from hf3fsctl.errors import Hf3fsctlError
from hf3fsctl.meta.redis.connection import call

if TYPE_CHECKING:
    from hf3fsctl.meta.redis.connection import StoreLua

logger = logging.getLogger(__name__)


class LookupHits:
    """Hits of this process's lookups not yet counted in Redis (they are known only once
    a lookup answered, so they ride along with the next one). Apart from the store, so
    the exit-time flush holds no reference to it."""

    def __init__(self, lua: StoreLua, prefix: str, where: str) -> None:
        self.lua = lua
        self.prefix = prefix
        self.where = where
        self.pending: dict[str, int] = {}
        self.lock = threading.Lock()

    def take(self) -> dict[str, int]:
        """The pending hits, now the caller's to count."""
        with self.lock:
            pending, self.pending = self.pending, {}
        return pending

    def add(self, hits: dict[str, int]) -> None:
        """Hits to count later."""
        with self.lock:
            for ns, count in hits.items():
                self.pending[ns] = self.pending.get(ns, 0) + count

    def count(self) -> None:
        """Count the pending hits now; a failure is logged (those hits are lost)."""
        pending = self.take()
        if not pending:
            return
        args: list[Any] = ["", 0]
        for ns, hits in pending.items():
            args += [ns, hits]
        try:
            call(
                lambda: self.lua.run("count_lookup", self.prefix, args),
                self.where,
                idempotent=False,
            )
        except Hf3fsctlError as exc:
            logger.warning("Redis store %s: lookup hits not counted: %s", self.where, exc)
