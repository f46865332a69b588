"""KV cache groups of a hybrid model as plain data, and the hit every group can serve.

vLLM's hybrid KV cache manager gives each kind of layer its own group with its own block
table: full attention (and MLA), sliding-window attention, Mamba / linear-attention
state. Every group is stored in a namespace of its own (its manifest records the group
and a fingerprint of the whole group structure, `connector.namespace`), keyed by the
same block hashes. What a hit of `k` blocks reads differs by kind (`GroupPlan.needed`):

* full attention: blocks `[0, k)`;
* sliding window of `W` tokens: the blocks vLLM keeps for the token after the hit,
  `[(k*block - W + 1) // block, k)` (vLLM pads the ones before with its null block);
* chunked local attention in chunks of `C` tokens (Llama 4): the blocks of the chunk the
  token after the hit attends to, `[(k*block // C) * C // block, k)` — none when the hit
  ends on a chunk boundary;
* Mamba in prefix-caching "align" mode: block `k - 1` only — the state after exactly
  `k` blocks of tokens.

Contract: `longest_hit(groups, keys, limit, lookup)` is the largest `k <= limit` for which
every group holds all the blocks it needs (`lookup(namespace, keys)` is the store's
"leading keys committed on every rank"); 0 when none within `MAX_PROBES` candidate
boundaries. A group's missing page therefore shortens the hit for all groups — never a
mixed prefix. The connector's scheduler and `hf3fsctl lookup` both use this, so they
agree. No vLLM here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

FULL = "full"  # full attention or MLA: every block of the prefix
SLIDING = "sliding"  # sliding-window attention: the window before the hit boundary
CHUNKED = "chunked"  # chunked local attention: the hit boundary's chunk so far
MAMBA = "mamba"  # Mamba / linear-attention state at the hit boundary ("align" mode)
KINDS = (FULL, SLIDING, CHUNKED, MAMBA)

# Candidate hit boundaries tried below the full-attention prefix before giving up (each
# costs one store call per windowed or state group).
MAX_PROBES = 32

Lookup = Callable[[str, Sequence[str]], int]


@dataclass(frozen=True)
class GroupPlan:
    """One stored KV cache group: where it is in vLLM's config and what a hit needs."""

    index: int  # position in vLLM's `kv_cache_groups` (block ids come per group)
    kind: str  # FULL, SLIDING, CHUNKED or MAMBA
    namespace: str  # the group's namespace id
    # SLIDING: the window vLLM attends over; CHUNKED: the attention chunk (tokens)
    window_tokens: int = 0

    def needed(self, hit_blocks: int, block_size: int) -> range:
        """Block positions this group must load for a hit of `hit_blocks` blocks."""
        if hit_blocks <= 0:
            return range(0)
        if self.kind == SLIDING:
            first = max(0, (hit_blocks * block_size - self.window_tokens + 1) // block_size)
            return range(first, hit_blocks)
        if self.kind == CHUNKED and self.window_tokens > 0:  # (no chunk recorded: all)
            chunk_start = hit_blocks * block_size // self.window_tokens * self.window_tokens
            return range(chunk_start // block_size, hit_blocks)
        if self.kind == MAMBA:
            return range(hit_blocks - 1, hit_blocks)
        return range(hit_blocks)

    @classmethod
    def from_manifest(cls, index: int, namespace: str, manifest: Mapping[str, object]) -> GroupPlan:
        """The plan recorded in a group namespace's manifest (`extra`); FULL if none."""
        extra = manifest.get("extra")
        extra = extra if isinstance(extra, Mapping) else {}
        kind = str(extra.get("group_kind", FULL))
        span = extra.get("attention_chunk" if kind == CHUNKED else "sliding_window", "0")
        return cls(index, kind, namespace, int(str(span) or 0))


def _holds(group: GroupPlan, keys: Sequence[str], hit: int, block: int, lookup: Lookup) -> bool:
    wanted = group.needed(hit, block)
    if not wanted:  # a chunk boundary: the group needs nothing for this hit
        return True
    return lookup(group.namespace, keys[wanted.start : wanted.stop]) == len(wanted)


def longest_hit(
    groups: Sequence[GroupPlan],
    keys: Sequence[str],
    limit: int,
    block_size: int,
    lookup: Lookup,
    *,
    probes: int = MAX_PROBES,
) -> int:
    """The longest prefix, in blocks (at most `limit`), that every group can serve.

    Args:
        groups: the stored groups (at least one).
        keys: the prompt's block keys, in prefix order.
        limit: the most blocks a hit may cover (vLLM must compute the last token).
        block_size: tokens per block (the same in every group).
        lookup: the store's `lookup(namespace, keys)`.
        probes: candidate boundaries tried when windowed or state groups are present.
    """
    upper = min(len(keys), limit)
    for group in groups:
        if upper <= 0:
            return 0
        if group.kind == FULL:
            upper = min(upper, lookup(group.namespace, keys[:upper]))
    others = [g for g in groups if g.kind != FULL]
    if not others or upper <= 0:
        return max(upper, 0)
    for hit in range(upper, max(0, upper - probes), -1):
        if all(_holds(g, keys, hit, block_size, lookup) for g in others):
            return hit
    return 0
