"""Which registered namespace a model means — the one vLLM with the connector will use.

A namespace is the hash of a manifest the connector builds from the running engine
(model, revision, KV dtype, block size, layout, backend, geometry, TP/PP, hash
algorithm, …). Offline there is no engine, so `hf3fsctl lookup` and `warm` match the
registered manifests against what the operator says: the model (for a local directory,
by its content fingerprint — the same weights anywhere match; for a hub id, by name),
and optionally the KV dtype, block size and TP size. More than one match is
`AmbiguousNamespace`, which lists the candidates so the operator can pick one with
`--namespace`.

A hybrid model (several KV cache groups: sliding window, Mamba state, …) registers one
namespace per group; their manifests share the group-structure fingerprint
(`extra.groups`) and the engine's identity. Such a set counts as one match, named by its
first group's namespace; `hybrid_set` returns all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.keys import model_revision
from hf3fsctl.meta.models import NamespaceInfo

# vLLM's dtype spellings → the KV dtype names the manifest records.
_DTYPES = {
    "half": "float16",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "float32": "float32",
}


@dataclass(frozen=True)
class NamespaceQuery:
    """What the operator said about the engine whose cache to ask."""

    model: str  # a local directory or a hub id, as given to vLLM
    dtype: str | None = None  # None or "auto": any KV dtype
    block_size: int | None = None
    tp_size: int | None = None

    def describe(self) -> str:
        parts = [f"model {self.model}"]
        if self.dtype and self.dtype != "auto":
            parts.append(f"dtype {self.dtype}")
        if self.block_size:
            parts.append(f"block size {self.block_size}")
        if self.tp_size:
            parts.append(f"TP {self.tp_size}")
        return ", ".join(parts)


class AmbiguousNamespace(InvalidRequest):
    """Several registered namespaces fit the query; `candidates` lists them."""

    def __init__(self, query: NamespaceQuery, candidates: Sequence[NamespaceInfo]) -> None:
        super().__init__(
            f"{len(candidates)} namespaces fit {query.describe()}",
            hint="pick one with --namespace ID (or narrow with --dtype, --block-size, "
            "--tensor-parallel-size)",
        )
        self.candidates = list(candidates)


def kv_dtype_name(dtype: str | None) -> str | None:
    """The manifest's KV dtype for a vLLM `--dtype` (None for auto / unknown)."""
    if dtype is None:
        return None
    return _DTYPES.get(dtype.strip().lower())


def _fingerprint(revision: str) -> str | None:
    marker = "local-"
    return revision[revision.index(marker) :] if marker in revision else None


def matches(info: NamespaceInfo, query: NamespaceQuery, local_revision: str | None) -> bool:
    """Whether a registered namespace was written by an engine like `query`'s."""
    manifest = info.manifest
    if local_revision is not None:
        recorded = _fingerprint(str(manifest.get("revision", "")))
        if recorded != _fingerprint(local_revision):
            return False
    elif manifest.get("model") != query.model:
        return False
    wanted = kv_dtype_name(query.dtype)
    if wanted is not None and manifest.get("kv_dtype") != wanted:
        return False
    if query.block_size and manifest.get("block_size") != query.block_size:
        return False
    return not (query.tp_size and manifest.get("tp_size") != query.tp_size)


# Manifest fields every namespace of one hybrid engine shares (the rest are per group).
_ENGINE_FIELDS = (
    "model",
    "revision",
    "block_size",
    "layout",
    "backend",
    "tp_size",
    "pp_size",
    "hash_algorithm",
    "none_hash",
    "format_version",
)


def _engine_key(info: NamespaceInfo) -> tuple[object, ...] | None:
    """What identifies the hybrid engine that wrote `info` (None: not a group namespace)."""
    extra = info.manifest.get("extra") or {}
    if "groups" not in extra:
        return None
    engine = tuple(info.manifest.get(name) for name in _ENGINE_FIELDS)
    return (extra["groups"], extra.get("cache_dtype"), *engine)


def _group_index(info: NamespaceInfo) -> int:
    return int((info.manifest.get("extra") or {}).get("group", 0))


def hybrid_set(namespaces: Sequence[NamespaceInfo], info: NamespaceInfo) -> list[NamespaceInfo]:
    """Every namespace of the engine that wrote `info`, by group index ([info] if single)."""
    key = _engine_key(info)
    if key is None:
        return [info]
    siblings = {n.id: n for n in namespaces if _engine_key(n) == key}
    siblings[info.id] = info
    return sorted(siblings.values(), key=_group_index)


def find_namespaces(
    namespaces: Sequence[NamespaceInfo], query: NamespaceQuery
) -> list[NamespaceInfo]:
    """Every registered namespace that fits `query`, newest first (a hybrid set once)."""
    local = Path(query.model).expanduser()
    revision = model_revision(local) if local.is_dir() else None
    found = [info for info in namespaces if matches(info, query, revision)]
    seen: set[tuple[object, ...]] = set()
    collapsed = []
    for info in sorted(found, key=_group_index):
        key = _engine_key(info)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        collapsed.append(info)
    return sorted(collapsed, key=lambda info: info.created, reverse=True)


def resolve_namespace(
    namespaces: Sequence[NamespaceInfo], query: NamespaceQuery, chosen: str | None = None
) -> NamespaceInfo | None:
    """The one namespace `query` means (or `chosen`, an id or unique prefix); None if none.

    Raises:
        AmbiguousNamespace: several fit and none was chosen.
        InvalidRequest: `chosen` names no registered namespace or several.
    """
    if chosen:
        picked = [info for info in namespaces if info.id.startswith(chosen.strip().lower())]
        if len(picked) != 1:
            raise InvalidRequest(
                f"--namespace {chosen!r} names {len(picked)} registered namespaces",
                hint="`hf3fsctl stats` lists them",
            )
        return picked[0]
    found = find_namespaces(namespaces, query)
    if len(found) > 1:
        raise AmbiguousNamespace(query, found)
    return found[0] if found else None
