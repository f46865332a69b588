"""The worker side on a hybrid CUDA KV cache (vLLM's hybrid manager), no vLLM.

vLLM's hybrid KV cache manager gives every KV cache group its own block ids in one
block pool and lays the groups' layers over the same bytes: here a sliding-window group
(layers `swa.0`, `swa.1`) and a full-attention group (`full.0`, `full.1`) share two
layer slots of one allocation, and a Mamba state group (`mamba.0`) lies over the first
slot as vLLM hands it to connectors — an int8 `[num_blocks, 1, 1, state_bytes]` view
whose block stride is the padded page. One `WorkerSide` per group (each its own
namespace and page file, one shared staging pool) runs under `GroupWorkers`, as the
facade drives it for a hybrid model: a save step of every group's blocks, then an
asynchronous load of the same keys into other blocks. Checked: every group's blocks
come back as saved, no other byte of the allocation changes (another group's blocks
over the same bytes included), a request is reported only when every group is done,
and a corrupt page of one group fails the request's whole load (`failed_recving`, no
block-level errors: vLLM raises on those with several groups).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hf3fsctl_connector.geometry import KVCacheGeometry, TensorPlacement
from hf3fsctl_connector.group_workers import GroupWorkers
from hf3fsctl_connector.metadata import Hf3fsctlConnectorMetadata, LoadJob, SaveJob
from hf3fsctl_connector.stats import StatsRecorder
from hf3fsctl_connector.worker import WorkerSide

from hf3fsctl.config import load_config
from hf3fsctl.keys import NamespaceManifest
from hf3fsctl.staging import _CompiledOps, _ops

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
NUM_BLOCKS = 32
BLOCK_SIZE = 16
KV_HEADS = 2
HEAD_DIM = 64
PAGE = BLOCK_SIZE * KV_HEADS * 2 * HEAD_DIM * 2  # one bf16 block of one layer, K and V
STATE = 5000  # a Mamba layer's state bytes (< PAGE: the rest of its block is padding)
SLOTS = 2  # layer slots of the allocation, each shared by one layer of every group

# group index → (kind, layer names, page bytes stored per layer, saved blocks, load targets)
GROUPS = {
    0: ("sliding", ("swa.0", "swa.1"), PAGE, [3, 7], [25, 5]),
    1: ("full", ("full.0", "full.1"), PAGE, [12, 20, 21], [30, 1, 2]),
    2: ("mamba", ("mamba.0",), STATE, [9], [17]),
}


def keys(group: int) -> list[str]:
    return [f"{group:02x}{i + 1:062x}" for i in range(len(GROUPS[group][3]))]


@dataclass
class HybridCache:
    raw: torch.Tensor  # the one backing allocation, 1-D uint8
    views: dict[str, torch.Tensor]  # what register_kv_caches receives

    def ranges(self, group: int, block: int) -> list[tuple[int, int]]:
        """Byte ranges of one block of a group's page, in layer order."""
        _, layers, size, _, _ = GROUPS[group]
        return [(slot * NUM_BLOCKS * PAGE + block * PAGE, size) for slot in range(len(layers))]

    def page(self, buffer: torch.Tensor, group: int, block: int) -> bytes:
        return b"".join(
            buffer[start : start + size].numpy().tobytes()
            for start, size in self.ranges(group, block)
        )


def make_cache(device: str, seed: int = 0) -> HybridCache:
    raw = torch.empty(SLOTS * NUM_BLOCKS * PAGE, dtype=torch.uint8, device=device)
    raw.random_(0, 256, generator=torch.Generator(device=device).manual_seed(seed))
    typed = raw.view(torch.bfloat16)
    views: dict[str, torch.Tensor] = {}
    elem = 2
    for _, (kind, layers, _, _, _) in GROUPS.items():
        for slot, name in enumerate(layers):
            base = slot * NUM_BLOCKS * PAGE
            if kind == "mamba":
                views[name] = torch.as_strided(
                    raw, (NUM_BLOCKS, 1, 1, STATE), (PAGE, STATE, STATE, 1), base
                )
            else:  # LBNHC: [N, H, 2D] in memory, viewed as [H, N, 2D]
                memory = torch.as_strided(
                    typed,
                    (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM),
                    (PAGE // elem, KV_HEADS * 2 * HEAD_DIM, 2 * HEAD_DIM, 1),
                    base // elem,
                )
                views[name] = memory.permute(0, 2, 1, 3)
    return HybridCache(raw, views)


def make_workers(store: Path) -> GroupWorkers:
    config = load_config(
        None,
        overrides={
            "storage.path": str(store),
            "storage.preallocate": False,
            "metadata.url": f"sqlite:///{store}/metadata.db",
            "connector.staging_bytes": "16MiB",
        },
    )
    sides: dict[int, WorkerSide] = {}
    for index, (kind, layers, size, _, _) in GROUPS.items():
        manifest = NamespaceManifest(
            model="gpu-hybrid-test",
            revision="0",
            kv_dtype="bfloat16" if kind != "mamba" else "float32",
            block_size=BLOCK_SIZE,
            layout="LBNHC",
            backend="cuda:FLASH_ATTN",
            num_layers=len(layers),
            num_kv_heads=KV_HEADS if kind != "mamba" else 0,
            head_dim=HEAD_DIM if kind != "mamba" else 0,
            tp_size=1,
            pp_size=1,
            page_bytes=size * len(layers),
            hash_algorithm="sha256",
            none_hash="0" * 16,
            extra={"group": str(index), "group_kind": kind, "groups": "test"},
        )
        geometry = KVCacheGeometry(
            num_blocks=NUM_BLOCKS,
            page_size_bytes=size,
            layer_names=layers,
            tensors=(TensorPlacement(layers, 0, NUM_BLOCKS * PAGE, PAGE),),
        )
        first = next(iter(sides.values()), None)
        sides[index] = WorkerSide(
            config,
            manifest,
            geometry,
            StatsRecorder(),
            rank=0,
            pool=None if first is None else first.pool,
        )
    return GroupWorkers(sides)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture
def hybrid(store: Path) -> Iterator[tuple[HybridCache, GroupWorkers]]:
    if DEVICE == "cuda":
        assert isinstance(_ops(), _CompiledOps)
    cache = make_cache(DEVICE)
    workers = make_workers(store)
    workers.register_kv_caches(cache.views)
    assert all(side.disabled is None for side in workers.sides.values())
    yield cache, workers
    workers.shutdown()


@pytest.fixture(autouse=True)
def _compiled(request: pytest.FixtureRequest) -> None:
    """On CUDA the worker's staging goes through the compiled ops (`cuda_ops` fixture)."""
    if DEVICE == "cuda":
        request.getfixturevalue("cuda_ops")


def save_step(cache: HybridCache, workers: GroupWorkers) -> dict[int, list[bytes]]:
    """Write every group's saved blocks, save them, overwrite them; returns the pages."""
    cache.raw[:] = torch.randint(
        0, 256, cache.raw.shape, dtype=torch.uint8, device=cache.raw.device
    )  # the forward pass of this step
    expected = {
        group: [cache.page(cache.raw.cpu(), group, b) for b in spec[3]]
        for group, spec in GROUPS.items()
    }
    meta = Hf3fsctlConnectorMetadata(
        saves=[SaveJob("cold", spec[3], keys(g), 0, group=g) for g, spec in GROUPS.items()]
    )
    workers.wait_for_save(meta)
    cache.raw.random_(0, 256)  # the next step reuses the blocks at once
    for side in workers.sides.values():
        assert side.drain(30)
    sent, _, _ = workers.transfer_results({"cold"})
    assert sent == {"cold"}
    return expected


def load(workers: GroupWorkers) -> tuple[set[str], set[str]]:
    """One asynchronous load of every group; returns (received, failed)."""
    meta = Hf3fsctlConnectorMetadata(
        loads=[LoadJob("warm", spec[4], keys(g), False, g) for g, spec in GROUPS.items()]
    )
    workers.start_load_kv(meta)
    deadline = time.monotonic() + 30
    while True:
        _, received, failed = workers.transfer_results(set())
        if received:
            break
        assert time.monotonic() < deadline, "hybrid load never finished"
        time.sleep(0.005)
    if DEVICE == "cuda":
        torch.cuda.current_stream().synchronize()
    assert workers.load_errors() == set()
    return received, failed


def test_every_group_loads_back_what_it_saved_and_nothing_else_changes(
    hybrid: tuple[HybridCache, GroupWorkers],
) -> None:
    cache, workers = hybrid
    expected = save_step(cache, workers)
    before = cache.raw.cpu()
    assert load(workers) == ({"warm"}, set())
    after = cache.raw.cpu()
    want = before.clone()
    for group, spec in GROUPS.items():
        for block, page in zip(spec[4], expected[group], strict=True):
            assert cache.page(after, group, block) == page
            position = 0
            for start, size in cache.ranges(group, block):
                want[start : start + size] = torch.frombuffer(
                    bytearray(page[position : position + size]), dtype=torch.uint8
                )
                position += size
    assert torch.equal(after, want)


def test_a_corrupt_page_of_one_group_fails_the_whole_load(
    hybrid: tuple[HybridCache, GroupWorkers],
) -> None:
    cache, workers = hybrid
    save_step(cache, workers)
    mamba = workers.sides[2]
    location = mamba.guard.call(lambda c: c.locate(mamba.namespace, 0, keys(2)))[0]
    assert location is not None and mamba.page_file is not None
    with open(mamba.page_file.path, "r+b") as handle:
        handle.seek(location.page * mamba.page_file.slot_bytes + location.size // 2)
        old = handle.read(8)
        handle.seek(location.page * mamba.page_file.slot_bytes + location.size // 2)
        handle.write(bytes(b ^ 0x5A for b in old))
    assert load(workers) == ({"warm"}, {"warm"})
