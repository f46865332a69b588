"""Namespaces and block keys.

A *namespace* is everything that must match for a stored KV page to be valid in another
process: model and revision, KV dtype, block size, layout, geometry, parallelism, the
block-hash algorithm and its seed, the page format. Its id is a hash of the manifest, so
two models, dtypes or layouts never share a key (docs/design.md decision 1).

A *block key* is vLLM's own block hash (`request.block_hashes[i]`) in hex. The chain is
`h_i = H((h_{i-1}, tuple(block_token_ids), extra_keys))` with `h_{-1} = NONE_HASH`
(docs/design.md decision 2); `block_hashes` recomputes it offline, without an engine, for the
default `sha256` (and `sha256_cbor`) algorithms.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from hf3fsctl.errors import InvalidRequest

FORMAT_VERSION = 1
NAMESPACE_ID_LEN = 16
KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")
NAMESPACE_RE = re.compile(rf"^[0-9a-f]{{{NAMESPACE_ID_LEN}}}$")
# vLLM's NONE_HASH seed when PYTHONHASHSEED is unset and the algorithm is cryptographic.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


@dataclass(frozen=True)
class NamespaceManifest:
    """What must match for a stored page to be loadable. Stored beside the page files."""

    model: str  # model id or local path as vLLM was given it
    revision: str  # hub revision, or a content fingerprint of a local model directory
    kv_dtype: str  # resolved KV cache dtype, e.g. "float16", "fp8_e4m3"
    block_size: int  # tokens per block
    layout: str  # KV layout kind, e.g. "LBHNC" (CPU), "LBNHC" (FlashAttention)
    backend: str  # attention backend name
    num_layers: int  # attention layers held by one rank
    num_kv_heads: int  # KV heads per rank
    head_dim: int  # head size (K; V assumed equal unless recorded in `extra`)
    tp_size: int  # tensor-parallel size
    pp_size: int  # pipeline-parallel size
    page_bytes: int  # bytes of one block's page on one rank (all layers, K and V)
    hash_algorithm: str  # vLLM's prefix_caching_hash_algo
    none_hash: str  # hex fingerprint of vLLM's NONE_HASH (seed-dependent)
    format_version: int = FORMAT_VERSION  # page format of this package
    extra: Mapping[str, str] = field(default_factory=dict)  # anything else that must match

    @property
    def num_ranks(self) -> int:
        """Ranks that each hold one page of every block."""
        return self.tp_size * self.pp_size

    @property
    def namespace_id(self) -> str:
        """Stable id: a hash of the canonical manifest."""
        return namespace_id(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["extra"] = dict(self.extra)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NamespaceManifest:
        """Build from a dict, rejecting unknown or missing fields."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise InvalidRequest(f"manifest has unknown fields: {', '.join(sorted(unknown))}")
        try:
            return cls(**dict(data))
        except TypeError as exc:
            raise InvalidRequest(f"manifest is incomplete: {exc}") from None


def namespace_id(manifest: Mapping[str, Any]) -> str:
    """The namespace id of a manifest dict: sha256 of its canonical JSON, shortened."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:NAMESPACE_ID_LEN]


def check_namespace_id(value: str) -> str:
    """Validate a namespace id, returning it."""
    if not isinstance(value, str) or not NAMESPACE_RE.fullmatch(value):
        raise InvalidRequest(
            f"namespace id {value!r} is malformed; expected {NAMESPACE_ID_LEN} hex digits"
        )
    return value


def check_key(value: str) -> str:
    """Validate a block key (lower-case hex, 16–128 digits), returning it."""
    if not isinstance(value, str) or not KEY_RE.fullmatch(value):
        raise InvalidRequest(f"block key {value!r} is malformed; expected 16-128 hex digits")
    return value


# Hex digits of one block key, by vLLM's `prefix_caching_hash_algo`: sha256 digests are
# 32 bytes, xxhash's (xxh3_128) 16.
KEY_HEX_DIGITS = {"sha256": 64, "sha256_cbor": 64, "xxhash": 32, "xxhash_cbor": 32}
SHOWN_KEY_DIGITS = 16  # what tables show of a key (then "…"); `--json` shows it whole
_HEX_RE = re.compile(r"^[0-9a-f]+$")


def key_digits(hash_algorithm: object) -> int | None:
    """Hex digits of a whole key of a namespace hashing with `hash_algorithm` (None when
    the algorithm is not one vLLM names)."""
    return KEY_HEX_DIGITS.get(str(hash_algorithm))


def shown_key(key: str) -> str:
    """A key as a table shows it: its first digits, then "…" when shortened."""
    return key if len(key) <= SHOWN_KEY_DIGITS else key[:SHOWN_KEY_DIGITS] + "…"


def parse_key_argument(value: str, digits: int | None) -> tuple[str, bool]:
    """A key as typed (`--key`): lower-cased, a table's trailing "…" dropped.

    Returns `(key, whole)`: `whole` is false for a shorter run of hex digits, which the
    caller resolves as a prefix of a stored key (tables show keys shortened).

    Raises:
        InvalidRequest: not hex, or longer than the namespace's keys, naming the form
            expected.
    """
    key = value.strip().lower().removesuffix("…").removesuffix("...")
    expected = f"{digits} hex digits" if digits else "16-128 hex digits"
    if not _HEX_RE.fullmatch(key):
        raise InvalidRequest(
            f"block key {value!r} is malformed; expected {expected} (or a unique prefix "
            "of a stored key, as `hf3fsctl ls` shows it)"
        )
    if digits is None:
        return check_key(key), True
    if len(key) > digits:
        raise InvalidRequest(
            f"block key {value!r} has {len(key)} hex digits; this namespace's keys have {digits}"
        )
    return key, len(key) == digits


_HEX_DIGITS = b"0123456789abcdef"


def check_keys(keys: Sequence[str]) -> None:
    """Validate a batch of block keys at C speed; `InvalidRequest` names the first bad one."""
    if not keys:
        return
    try:
        joined = "".join(keys).encode("ascii")
        lengths = set(map(len, keys))
        if min(lengths) >= 16 and max(lengths) <= 128 and not joined.translate(None, _HEX_DIGITS):
            return
    except (TypeError, UnicodeEncodeError):
        pass
    for key in keys:
        check_key(key)


def block_key(block_hash: bytes) -> str:
    """The storage key of one vLLM block hash."""
    return bytes(block_hash).hex()


def block_keys(block_hashes: Iterable[bytes]) -> list[str]:
    """Storage keys of a chain of vLLM block hashes, in order."""
    return [bytes(h).hex() for h in block_hashes]


def _hash_function(algorithm: str) -> Any:
    if algorithm == "sha256":
        return lambda obj: hashlib.sha256(
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
    if algorithm == "sha256_cbor":
        import cbor2

        return lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    raise InvalidRequest(
        f"block hash algorithm {algorithm!r} cannot be recomputed offline; "
        "use vLLM's default prefix_caching_hash_algo=sha256 (or sha256_cbor)"
    )


def none_hash(algorithm: str = "sha256", seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH: the hash of the seed (PYTHONHASHSEED if set, else the default)."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    return bytes(_hash_function(algorithm)(seed))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algorithm: str = "sha256",
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    seed: str | None = None,
) -> list[bytes]:
    """Recompute vLLM's block-hash chain for the full blocks of `token_ids`.

    Args:
        token_ids: the prompt's token ids.
        block_size: tokens per block (the engine's `block_size`).
        algorithm: vLLM's `prefix_caching_hash_algo` (`sha256` or `sha256_cbor`).
        extra_keys: per-block extra keys (LoRA, multimodal, cache_salt), or None.
        seed: NONE_HASH seed; default PYTHONHASHSEED or vLLM's constant.

    Returns:
        One hash per full block, equal to the engine's `request.block_hashes`.
    """
    if block_size <= 0:
        raise InvalidRequest(f"block_size must be positive, got {block_size}")
    hash_fn = _hash_function(algorithm)
    parent = none_hash(algorithm, seed)
    out: list[bytes] = []
    for index in range(len(token_ids) // block_size):
        block = tuple(token_ids[index * block_size : (index + 1) * block_size])
        extra = extra_keys[index] if extra_keys is not None else None
        parent = bytes(hash_fn((parent, block, extra)))
        out.append(parent)
    return out


_SAMPLE_CHUNK = 1 << 20
_SAMPLES_PER_FILE = 4
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HASHED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


def model_revision(model: str | os.PathLike[str], revision: str | None = None) -> str:
    """A revision string for a model: the given revision, or a local directory's fingerprint.

    The fingerprint hashes config and tokenizer files, weight file names and sizes, and
    sampled 1 MiB chunks of each weight file (start, middle, end): cheap at start-up,
    identical on every node holding the same files, different when weights are replaced
    in place. Modification times are not used (they differ between copies).
    """
    path = Path(model)
    if not path.is_dir():
        return revision or "main"
    digest = hashlib.sha256()
    for name in _HASHED_FILES:
        candidate = path / name
        if candidate.is_file():
            digest.update(name.encode() + b"\0" + candidate.read_bytes() + b"\0")
    weights = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    for weight in weights:
        size = weight.stat().st_size
        digest.update(f"{weight.relative_to(path)}\0{size}\0".encode())
        with weight.open("rb") as handle:
            for i in range(_SAMPLES_PER_FILE):
                offset = max(0, (size - _SAMPLE_CHUNK) * i // max(1, _SAMPLES_PER_FILE - 1))
                handle.seek(offset)
                digest.update(handle.read(_SAMPLE_CHUNK))
    prefix = f"{revision}+" if revision else ""
    return f"{prefix}local-{digest.hexdigest()[:16]}"
