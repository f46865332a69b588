"""The SQLite metadata store: `MetadataStore` (`store.py`) on one database file per store.

Rooms: `store.py` (the primitives of the store core, `meta/base.py`, as SQL transactions,
and the connections, writer lock and WAL around them), `schema.py` (tables, indexes, the
invariant queries), `eviction.py` (the eviction decision: `choose_victims`, and dropping
keys), `capacity.py` (one capacity for the store: room for an allocation, quotas, giving
space back), `pins.py`, `namespaces.py`, `committed_index.py` (lookup from the
committed rank counts of `key_lru`, and the change log), `reports.py` (stats), `writer_lock.py`,
`checkpointer.py` (the WAL), `backup.py` and `migration.py` (`hf3fsctl backup / migrate`).
"""

from hf3fsctl.meta.sqlite.store import MetadataStore

__all__ = ["MetadataStore"]
