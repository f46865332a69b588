"""`hf3fsctl lookup`: per prompt, the cached prefix the next vLLM run will load.

The rule is the connector's own (`connector/scheduler.py`): only full blocks have keys;
the store answers how many leading keys are committed on every rank; the last prompt
token is never loaded (vLLM must compute one token to sample from), and fewer than
`connector.min_hit_blocks` hit blocks load nothing. In a fresh engine process nothing is
in vLLM's own prefix cache, so the tokens this reports are the `num_cached_tokens` that
run shows.

A hybrid model's namespace stands for every group namespace of its engine
(`offline.namespaces.hybrid_set`): the hit is the longest prefix every group can serve
(`hf3fsctl.kv_groups.longest_hit`, the connector's rule), below the last prompt token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hf3fsctl.kv_groups import GroupPlan, longest_hit
from hf3fsctl.meta.models import NamespaceInfo
from hf3fsctl.meta.protocol import MetadataClient
from hf3fsctl.offline.namespaces import hybrid_set
from hf3fsctl.prompt_keys import prompt_block_keys


@dataclass(frozen=True)
class PromptLookup:
    """What the store holds of one prompt."""

    origin: str
    tokens: int
    blocks: int  # full blocks (blocks with a key)
    stored_blocks: int  # leading blocks committed on every rank
    cached_tokens: int  # tokens the next run loads
    namespace: str | None

    @property
    def fraction(self) -> float:
        return self.cached_tokens / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": self.fraction}


def loadable_blocks(stored: int, tokens: int, block_size: int, min_hit_blocks: int) -> int:
    """Blocks the connector loads for a prompt of `tokens` with `stored` leading blocks."""
    blocks = min(stored, max(0, tokens - 1) // block_size)
    return blocks if blocks >= max(1, min_hit_blocks) else 0


class StoredPrefix:
    """How many leading blocks of a prompt the namespace (all its groups) can serve."""

    def __init__(self, client: MetadataClient, info: NamespaceInfo) -> None:
        self.client = client
        self.info = info
        self.block_size = int(info.manifest["block_size"])
        siblings = hybrid_set(client.namespaces(), info) if _is_hybrid(info) else [info]
        self.hybrid = len(siblings) > 1 or _is_hybrid(info)
        self.groups = [
            GroupPlan.from_manifest(int(n.manifest["extra"].get("group", 0)), n.id, n.manifest)
            for n in siblings
        ]

    def target(self, keys: Sequence[str], tokens: int) -> int:
        """The most blocks a load of this prompt can cover (hybrid: below the last token)."""
        if not self.hybrid:
            return len(keys)
        return min(len(keys), max(0, tokens - 1) // self.block_size)

    def blocks(self, keys: Sequence[str], tokens: int) -> int:
        """Leading blocks stored in every group (hybrid: the longest servable hit)."""
        if not keys:
            return 0
        if not self.hybrid:
            return self.client.lookup(self.info.id, keys)
        limit = self.target(keys, tokens)
        return longest_hit(self.groups, keys, limit, self.block_size, self.client.lookup)


def _is_hybrid(info: NamespaceInfo) -> bool:
    return "groups" in (info.manifest.get("extra") or {})


def lookup_prompts(
    client: MetadataClient,
    info: NamespaceInfo | None,
    prompts: Sequence[tuple[str, Sequence[int]]],
    *,
    min_hit_blocks: int = 1,
) -> list[PromptLookup]:
    """Look up `(origin, token_ids)` prompts in a namespace (None: nothing is cached)."""
    out: list[PromptLookup] = []
    block_size = int(info.manifest["block_size"]) if info is not None else 0
    stored_prefix = StoredPrefix(client, info) if info is not None else None
    for origin, ids in prompts:
        if info is None or stored_prefix is None:
            out.append(PromptLookup(origin, len(ids), 0, 0, 0, None))
            continue
        keys = prompt_block_keys(info.manifest, ids)
        stored = stored_prefix.blocks(keys, len(ids))
        blocks = loadable_blocks(stored, len(ids), block_size, min_hit_blocks)
        out.append(PromptLookup(origin, len(ids), len(keys), stored, blocks * block_size, info.id))
    return out
