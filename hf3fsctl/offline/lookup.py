"""`hf3fsctl lookup`: per prompt, the cached prefix the next vLLM run will load.

The rule is the connector's own (`connector/scheduler.py`): only full blocks have keys;
the store answers how many leading keys are committed on every rank; the last prompt
token is never loaded (vLLM must compute one token to sample from), and fewer than
`connector.min_hit_blocks` hit blocks load nothing. In a fresh engine process nothing is
in vLLM's own prefix cache, so the tokens this reports are the `num_cached_tokens` that
run shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hf3fsctl.meta.client import MetadataClient
from hf3fsctl.meta.models import NamespaceInfo
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
    for origin, ids in prompts:
        if info is None:
            out.append(PromptLookup(origin, len(ids), 0, 0, 0, None))
            continue
        keys = prompt_block_keys(info.manifest, ids)
        stored = client.lookup(info.id, keys) if keys else 0
        blocks = loadable_blocks(stored, len(ids), block_size, min_hit_blocks)
        out.append(PromptLookup(origin, len(ids), len(keys), stored, blocks * block_size, info.id))
    return out
