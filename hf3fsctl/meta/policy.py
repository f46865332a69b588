"""`StorePolicy`: what bounds a store — capacity, pins, quotas — and where its files are.

The store holds one capacity for every namespace and rank (docs/design.md decision 5b,
`docs/design.md#store-capacity`). It is *recorded in the store* (`store_info`), so every
connector and server of a fleet enforces the same figure; `storage.capacity` in the
configuration is only what a new store starts with (`hf3fsctl init` records it, or the
first process that opens an unrecorded store does). A share (`80%`) is of the file
system's free space at that moment plus what the store's files already hold, so a
default store never claims more than the disk can give.

Pins are capped by `storage.max_pinned` (a size or a share of the capacity) and quotas
(`quotas:` in the configuration) by namespace id or model name, both resolved against the
recorded capacity whenever they are used.

Imports only the standard library and `hf3fsctl.config`/`errors`.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hf3fsctl.config.units import Amount, parse_amount

if TYPE_CHECKING:
    from hf3fsctl.config.schema import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorePolicy:
    """The configuration a store enforces beyond its own tables.

    Attributes:
        storage_root: the directory holding the page files, when this process has it
            (needed to resolve a share of the file system and to give freed space back
            to it); None for a server without the mount.
        capacity: the capacity a store without a recorded one starts with.
        max_pinned: the most bytes pins may hold (a size or a share of capacity).
        quotas: namespace id or model name → a size or a share of capacity.
        pending_timeout_s: how long a writer has to commit the pages it was granted
            before they count as a dead writer's (None: the store's own default).
    """

    storage_root: str | None = None
    capacity: str = "80%"
    max_pinned: str = "25%"
    quotas: Mapping[str, str] = field(default_factory=dict)
    pending_timeout_s: float | None = None

    @classmethod
    def from_config(cls, config: Config) -> StorePolicy:
        """The policy a configuration describes."""
        return cls(
            storage_root=config.storage.path,
            capacity=config.storage.capacity,
            max_pinned=config.storage.max_pinned,
            quotas=dict(config.quotas),
            pending_timeout_s=config.metadata.pending_timeout_s,
        )

    def root_available(self) -> bool:
        """Whether the storage root exists in this process."""
        return self.storage_root is not None and os.path.isdir(self.storage_root)

    def max_pinned_bytes(self, capacity: int | None) -> int | None:
        """The pin cap in bytes (None: a share of an unbounded store is unbounded)."""
        amount = parse_amount(self.max_pinned, "storage.max_pinned")
        if amount.share is not None and capacity is None:
            return None
        return amount.of(capacity or 0)

    def quota_bytes(self, capacity: int | None) -> dict[str, int]:
        """Each quota in bytes (shares of an unbounded store are dropped)."""
        out: dict[str, int] = {}
        for name, text in self.quotas.items():
            amount = parse_amount(text, f"quotas.{name}")
            if amount.share is not None and capacity is None:
                continue
            out[name] = amount.of(capacity or 0)
        return out


def file_system_room(root: str | os.PathLike[str]) -> int:
    """Bytes free on the file system holding `root` (for an unprivileged writer)."""
    return shutil.disk_usage(root).free


def resolve_capacity(amount: Amount | str, root: str | os.PathLike[str], held: int) -> int:
    """Bytes of a capacity spec for a store whose files already hold `held` bytes.

    A share is of what the store could ever hold here: the file system's free space plus
    what it already holds. A size is taken as given (the caller warns when it is more
    than the file system has).
    """
    if isinstance(amount, str):
        amount = parse_amount(amount, "storage.capacity")
    return amount.of(file_system_room(root) + held)
