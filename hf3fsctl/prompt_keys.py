"""Block keys of a text prompt, computed offline: tokenizer → token ids → vLLM's hash chain.

What `hf3fsctl pin --prompt` (and later `lookup` / `warm`) need to name a prompt's
blocks without an engine:

- `load_tokenizer(model)` loads the model's tokenizer with transformers (imported here,
  lazily: nothing else in the core needs it). The model is the namespace manifest's
  `model`, a local directory or a hub id; with `HF_HUB_OFFLINE` only local directories
  (or hub ids already in the local cache) load.
- `tokenize(tokenizer, text)` tokenizes a plain text prompt the way vLLM's offline
  `LLM.generate` does: the renderer calls `tokenizer(text, add_special_tokens=True)`
  and takes `input_ids` (vllm/entrypoints/common/offline.py uses the renderer's
  `default_cmpl_tok_params`, `add_special_tokens=True`; vllm/renderers/base.py
  `_tokenize_prompt` encodes). Chat templates are
  not applied: a chat prompt's keys are those of its rendered text.
- `prompt_block_keys(manifest, token_ids)` recomputes the keys of the prompt's full
  blocks with the namespace's block size and hash algorithm, after checking that this
  process's NONE_HASH (PYTHONHASHSEED) is the one the engine recorded.

No vLLM and no CLI here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.keys import block_hashes, block_keys, none_hash

_NO_TOKENIZER_HINT = "pin by --key, or run where the namespace's model is available"


def _looks_like_a_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def load_tokenizer(model: str, revision: str | None = None) -> Any:
    """The tokenizer of `model` (a local directory or a hub id), via transformers.

    Args:
        model: the manifest's `model`, as vLLM was given it.
        revision: a hub revision (ignored for a local directory, and for local
            fingerprints `local-…` recorded as the manifest's revision).

    Raises:
        InvalidRequest: transformers is missing, the model is a path that is not a
            directory here, or the tokenizer cannot be loaded (offline, not on the hub,
            no tokenizer files), with a hint.
    """
    import os
    from pathlib import Path

    local = Path(model).expanduser().is_dir()
    if not local and _looks_like_a_path(model):
        raise InvalidRequest(
            f"model directory {model!r} is not found here: cannot load its tokenizer",
            hint=_NO_TOKENIZER_HINT,
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InvalidRequest(
            "tokenizing a prompt needs the transformers package",
            hint="install transformers (it comes with vLLM), or pin by --key",
        ) from None
    kwargs: dict[str, Any] = {}
    if revision and not local and "local-" not in revision:
        kwargs["revision"] = revision
    try:
        return AutoTokenizer.from_pretrained(
            str(Path(model).expanduser()) if local else model, **kwargs
        )
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes")
        if local:
            hint = "the directory needs tokenizer files (tokenizer.json, tokenizer_config.json)"
        elif offline:
            hint = (
                "HF_HUB_OFFLINE is set: only a local model directory or a hub model already "
                f"in the Hugging Face cache loads; {_NO_TOKENIZER_HINT}"
            )
        else:
            hint = (
                "the hub could not be reached or has no such model (with HF_HUB_OFFLINE=1 "
                f"only the local cache is tried, without retries); {_NO_TOKENIZER_HINT}"
            )
        raise InvalidRequest(
            f"cannot load the tokenizer of {'local directory' if local else 'model'} "
            f"{model!r}: {first}",
            hint=hint,
        ) from None


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain text prompt, as vLLM's `LLM.generate` tokenizes it.

    Special tokens are added (a BOS where the tokenizer adds one), exactly as vLLM does
    for a completion prompt; nothing is truncated (vLLM refuses over-long prompts).
    """
    encoding = tokenizer(text, add_special_tokens=True)
    return [int(token) for token in encoding["input_ids"]]


def _manifest_field(manifest: Mapping[str, Any], name: str) -> Any:
    if name not in manifest:
        raise InvalidRequest(f"namespace manifest has no {name!r}; cannot compute block keys")
    return manifest[name]


def check_none_hash(manifest: Mapping[str, Any]) -> None:
    """Refuse when this process's NONE_HASH differs from the one the engine recorded.

    The connector records `none_hash(algorithm).hex()[:16]` (seeded by PYTHONHASHSEED);
    if it differs here, every recomputed key differs from the engine's.

    Raises:
        InvalidRequest: the fingerprints differ (with the PYTHONHASHSEED hint).
    """
    recorded = manifest.get("none_hash")
    if not isinstance(recorded, str) or not recorded:
        return
    algorithm = str(_manifest_field(manifest, "hash_algorithm"))
    here = none_hash(algorithm).hex()[: len(recorded)]
    if here != recorded:
        raise InvalidRequest(
            f"this process's NONE_HASH ({here}) differs from the one the engine recorded "
            f"for the namespace ({recorded}): keys computed here would never match",
            hint="set PYTHONHASHSEED to the value the vLLM engine ran with "
            "(or unset it if the engine had none)",
        )


def prompt_block_keys(manifest: Mapping[str, Any], token_ids: Sequence[int]) -> list[str]:
    """Store keys of the full blocks of `token_ids` in a namespace (by its manifest).

    Uses the manifest's `block_size` and `hash_algorithm`; a trailing partial block has
    no key (vLLM hashes only full blocks). Plain text prompts have no extra keys (no
    LoRA, multimodal inputs or cache salt).

    Raises:
        InvalidRequest: the manifest lacks what is needed, its NONE_HASH differs from
            this process's, or its hash algorithm cannot be recomputed offline.
    """
    block_size = _manifest_field(manifest, "block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise InvalidRequest(f"namespace manifest block_size {block_size!r} is not positive")
    algorithm = str(_manifest_field(manifest, "hash_algorithm"))
    check_none_hash(manifest)
    return block_keys(block_hashes(list(token_ids), block_size, algorithm=algorithm))
