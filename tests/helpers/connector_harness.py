"""Drive vLLM's real `Scheduler` with `Hf3fsctlConnector`, and a real worker side, in one process.

No model runs: a "forward pass" writes, into every block a request fills, a byte
pattern derived from that block's key, so a later load can be checked byte for byte.
Everything else is real: vLLM's scheduler and KV cache manager, the connector's both
sides, the embedded SQLite metadata store, page files and the POSIX engine.

The pattern follows vLLM's own connector unit tests (`tests/v1/kv_connector/unit/
utils.py`): build a config, create requests, `schedule()`, feed a `ModelRunnerOutput`
back with `update_from_output`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 32
NUM_BLOCKS = 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_KV_HEADS = 1
HEAD_SIZE = 32
EOS = 2

init_none_hash(sha256)


def make_vllm_config(
    model_dir: str | Path,
    store: Path,
    *,
    max_num_batched_tokens: int = 1024,
    extra: dict[str, Any] | None = None,
    prefix_caching: bool = False,
    kv_role: str = "kv_both",
) -> VllmConfig:
    """A CPU VllmConfig for the tiny model with the connector pointed at `store`."""
    settings = {
        "storage.path": str(store),
        "storage.file_size": "4MiB",
        "storage.preallocate": False,
        "metadata.url": f"sqlite:///{store}/metadata.db",
        "connector.staging_bytes": "4MiB",
        **(extra or {}),
    }
    model_config = ModelConfig(model=str(model_dir), dtype="float32", seed=0)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    cache_config.kv_cache_layout = "LBHNC"
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="Hf3fsctlConnector",
            kv_connector_module_path="hf3fsctl_connector.connector",
            kv_role=kv_role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=settings,
        ),
        device_config=DeviceConfig("cpu"),
    )


def make_kv_cache_config() -> KVCacheConfig:
    """One full-attention group over one layer-outermost buffer (vLLM's CPU layout)."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * NUM_BLOCKS * len(LAYERS),
                layers=list(LAYERS),
                layer_stride=page * NUM_BLOCKS,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        kv_cache_layout="LBHNC",
    )


def make_kv_caches(config: KVCacheConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A zeroed backing buffer and the per-layer views vLLM's CPU runner would hand over."""
    tensor = config.kv_cache_tensors[0]
    raw = torch.zeros(tensor.size, dtype=torch.uint8)
    floats = raw.view(torch.float32)
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    per_block = NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE
    views = {
        name: torch.as_strided(
            floats,
            shape,
            (per_block, BLOCK_SIZE * 2 * HEAD_SIZE, 2 * HEAD_SIZE, 1),
            i * tensor.layer_stride // 4,
        )
        for i, name in enumerate(tensor.layers)
    }
    return raw, views


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 2,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    """A greedy request whose block hashes vLLM computes as the engine would
    (`kv_transfer_params` as the OpenAI server passes them: in `extra_args`)."""
    extra_args = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def prompt_tokens(num_tokens: int, salt: int = 0) -> list[int]:
    """Deterministic token ids (vocab 4096, avoiding special ids)."""
    return [10 + (i * 7 + salt * 131) % 4000 for i in range(num_tokens)]


def pattern(key: bytes, page_bytes: int) -> torch.Tensor:
    """The bytes a fake forward pass writes for the block whose hash is `key`."""
    seed = hashlib.sha256(key).digest()
    reps = -(-page_bytes // len(seed))
    return torch.frombuffer(bytearray(seed * reps), dtype=torch.uint8)[:page_bytes]


@dataclass
class Harness:
    """A scheduler + worker pair over one fake KV cache."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler: Scheduler
    worker: Any  # Hf3fsctlConnector (worker role)
    raw: torch.Tensor  # the KV cache bytes
    metas: list[Any] = field(default_factory=list)  # every step's connector metadata
    outputs: list[Any] = field(default_factory=list)  # every step's SchedulerOutput
    invalid_reported: set[int] = field(default_factory=set)  # load-error block ids seen

    @property
    def connector(self) -> Any:
        """The scheduler-role connector vLLM built."""
        return self.scheduler.connector

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """One block's page (all layers) as the worker would store it."""
        seg = self.worker.worker_side.segments[0]
        return seg.blocks_view()[block_id].reshape(-1).clone()

    def _fake_forward(self, output: Any) -> None:
        seg = self.worker.worker_side.segments[0]
        view = seg.blocks_view()
        for req_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            # schedule() has already advanced num_computed_tokens past this step.
            end = request.num_computed_tokens // BLOCK_SIZE
            for index in range((request.num_computed_tokens - count) // BLOCK_SIZE, end):
                if index < len(request.block_hashes):
                    key = bytes(request.block_hashes[index])
                    view[block_ids[index]] = pattern(key, seg.page_bytes).view(view.shape[1:])

    def _sampling(self, req_id: str) -> bool:
        request = self.scheduler.requests[req_id]
        return request.num_computed_tokens >= request.num_tokens

    def step(self) -> Any:
        """One engine step: schedule, fake forward, connector worker calls, update."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        self.metas.append(meta)
        self.outputs.append(output)
        self.worker.handle_preemptions(meta)  # as vLLM's model runner, before the forward
        self.worker.bind_connector_metadata(meta)
        # As vLLM's model runner: synchronous loads feed this step's forward.
        if output.has_sync_kv_loads:
            self.worker.start_load_kv(None)
        self._fake_forward(output)
        if not output.has_sync_kv_loads:
            self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(output.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        self.invalid_reported |= invalid
        self.worker.clear_connector_metadata()
        req_ids = list(output.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            # A partial prefill samples nothing; a request past its prompt samples one token.
            sampled_token_ids=[[100] if self._sampling(r) else [] for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid
            ),
        )
        self.scheduler.update_from_output(output, runner_output)
        return output

    def run(self, *requests: Request, timeout_s: float = 30.0) -> None:
        """Add requests and step until the scheduler holds nothing."""
        for request in requests:
            self.scheduler.add_request(request)
        deadline = time.monotonic() + timeout_s
        while self.scheduler.requests or self.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still held: {list(self.scheduler.requests)}")
            if self.step().total_num_scheduled_tokens == 0:
                time.sleep(0.005)

    def saved_keys(self) -> list[str]:
        """Keys of every save job planned so far, in order."""
        return [key for meta in self.metas for job in meta.saves for key in job.keys]

    def close(self) -> None:
        """Shut both connector sides down (drains saves)."""
        self.worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()


def make_harness(model_dir: str | Path, store: Path, **config_kwargs: Any) -> Harness:
    """A fresh scheduler (with its connector) and worker connector over a zeroed KV cache."""
    from hf3fsctl_connector.connector import Hf3fsctlConnector

    vllm_config = make_vllm_config(model_dir, store, **config_kwargs)
    kv_cache_config = make_kv_cache_config()
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    worker = Hf3fsctlConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    raw, views = make_kv_caches(kv_cache_config)
    worker.register_kv_caches(views)
    return Harness(vllm_config, kv_cache_config, scheduler, worker, raw)
