"""The connector's worker side on a CUDA KV cache, through its real entry points, no vLLM.

KV caches are laid out the way vLLM's CUDA backends lay them out (one flat buffer, a
`KVCacheTensor`-style placement per group of layers; per-layer views of the logical
shape `[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`, K and V fused):
FlashAttention's default LBNHC, the HND order LBHNC, the block-outermost cross-layer
BLNHC (bf16 and fp8 stored as uint8), and MLA `[num_blocks, 1, block_size, 576]` (bf16
and fp8). The worker side runs as the facade drives it for vLLM — `register_kv_caches`,
`start_load_kv`, `wait_for_save`, `get_finished`, `get_block_ids_with_load_errors` (the
facade's `wait_for_layer_load` and `save_kv_layer` do nothing: whole blocks move in
`start_load_kv` and `wait_for_save`) — with the real embedded SQLite store and page
files on local disk. The step metadata is built directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hf3fsctl_connector.geometry import KVCacheGeometry, TensorPlacement
from hf3fsctl_connector.metadata import Hf3fsctlConnectorMetadata, LoadJob, SaveJob
from hf3fsctl_connector.stats import StatsRecorder
from hf3fsctl_connector.worker import WorkerSide

from hf3fsctl.config import load_config
from hf3fsctl.keys import NamespaceManifest
from hf3fsctl.staging import KVSegment, _CompiledOps, _ops

pytestmark = pytest.mark.gpu

NUM_LAYERS = 4
NUM_BLOCKS = 32
BLOCK_SIZE = 16
KV_HEADS = 2
HEAD_DIM = 64
MLA_WIDTH = 576  # kv_lora_rank 512 + rope 64
SAVED = [3, 7, 12, 20]  # blocks a step saves
TARGETS = [25, 5, 30, 1]  # blocks a later step loads the same keys into
KEYS = [f"{i + 1:064x}" for i in range(len(SAVED))]


@dataclass
class KVCache:
    """A CUDA KV cache: its bytes, vLLM's per-layer views and the placement behind them."""

    layout: str
    raw: torch.Tensor  # the backing allocation, 1-D uint8
    views: dict[str, torch.Tensor]  # what register_kv_caches receives
    geometry: KVCacheGeometry
    dtype: torch.dtype

    @property
    def page_size(self) -> int:
        return self.geometry.page_size_bytes

    def segment(self, buffer: torch.Tensor) -> KVSegment:
        """The byte geometry of this cache over `buffer` (this cache's or a copy's)."""
        t = self.geometry.tensors[0]
        return KVSegment(
            buffer, t.offset, t.layer_stride, t.block_stride, NUM_LAYERS, NUM_BLOCKS, self.page_size
        )

    def pages(self, buffer: torch.Tensor, blocks: list[int]) -> list[bytes]:
        """Each block's stored page (every layer's range, in layer order) from a CPU buffer."""
        seg = self.segment(buffer)
        view = seg.blocks_view()
        return [view[b].reshape(-1).numpy().tobytes() for b in blocks]


LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLNHC-fp8", "MLA", "MLA-fp8"]


def make_cache(layout: str, seed: int = 0) -> KVCache:
    """A KV cache of random bytes in `layout`, as vLLM's CUDA model runner would build it."""
    dtype = torch.uint8 if layout.endswith("fp8") else torch.bfloat16
    size = dtype.itemsize
    mla = layout.startswith("MLA")
    # Memory order of one block of one layer, and the logical view's permutation of it.
    if mla:
        block_shape, to_logical = (1, BLOCK_SIZE, MLA_WIDTH), (0, 1, 2, 3)
    elif layout == "LBHNC":
        block_shape, to_logical = (KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM), (0, 1, 2, 3)
    else:  # LBNHC / BLNHC: [N, H, 2D] in memory, viewed as [H, N, 2D]
        block_shape, to_logical = (BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM), (0, 2, 1, 3)
    elems = 1
    for n in block_shape:
        elems *= n
    page = elems * size
    block_outer = layout.startswith("BL")
    layer_stride, block_stride = (
        (page, NUM_LAYERS * page) if block_outer else (NUM_BLOCKS * page, page)
    )
    raw = torch.empty(NUM_LAYERS * NUM_BLOCKS * page, dtype=torch.uint8, device="cuda")
    raw.random_(0, 256, generator=torch.Generator(device="cuda").manual_seed(seed))
    typed = raw.view(dtype)
    inner = []
    stride = 1
    for n in reversed(block_shape):
        inner.insert(0, stride)
        stride *= n
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    views = {}
    for index, name in enumerate(names):
        memory = torch.as_strided(
            typed,
            (NUM_BLOCKS, *block_shape),
            (block_stride // size, *inner),
            index * layer_stride // size,
        )
        views[name] = memory.permute(*to_logical)
    geometry = KVCacheGeometry(
        num_blocks=NUM_BLOCKS,
        page_size_bytes=page,
        layer_names=tuple(names),
        tensors=(TensorPlacement(tuple(names), 0, layer_stride, block_stride),),
    )
    return KVCache(layout, raw, views, geometry, dtype)


def step_values(cache: KVCache, blocks: list[int], seed: int) -> dict[str, torch.Tensor]:
    """What a forward pass writes into `blocks` of every layer (random, per layer)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, view in cache.views.items():
        shape = view[blocks].shape
        if cache.dtype == torch.uint8:
            out[name] = torch.randint(
                0, 256, shape, dtype=torch.uint8, device="cuda", generator=generator
            )
        else:
            out[name] = torch.randn(shape, dtype=cache.dtype, device="cuda", generator=generator)
    return out


def write_blocks(cache: KVCache, blocks: list[int], values: dict[str, torch.Tensor]) -> None:
    """Write `values` into `blocks` on the current stream (as the forward pass would)."""
    index = torch.tensor(blocks, device="cuda")
    for name, view in cache.views.items():
        view[index] = values[name]


def make_worker(cache: KVCache, store: Path) -> WorkerSide:
    config = load_config(
        None,
        overrides={
            "storage.path": str(store),
            "storage.preallocate": False,
            "metadata.url": f"sqlite:///{store}/metadata.db",
            "connector.staging_bytes": "16MiB",
        },
    )
    page_bytes = cache.page_size * NUM_LAYERS
    manifest = NamespaceManifest(
        model="gpu-test",
        revision="0",
        kv_dtype="fp8_e4m3" if cache.dtype == torch.uint8 else "bfloat16",
        block_size=BLOCK_SIZE,
        layout=cache.layout,
        backend="cuda:FLASH_ATTN" if not cache.layout.startswith("MLA") else "cuda:FLASHMLA",
        num_layers=NUM_LAYERS,
        num_kv_heads=1 if cache.layout.startswith("MLA") else KV_HEADS,
        head_dim=MLA_WIDTH if cache.layout.startswith("MLA") else HEAD_DIM,
        tp_size=1,
        pp_size=1,
        page_bytes=page_bytes,
        hash_algorithm="sha256",
        none_hash="0" * 16,
    )
    worker = WorkerSide(config, manifest, cache.geometry, StatsRecorder(), rank=0)
    worker.register_kv_caches(cache.views)
    assert worker.disabled is None, worker.disabled
    return worker


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def _compiled(cuda_ops: _CompiledOps) -> None:
    """The worker's staging goes through the compiled CUDA ops, not the torch fallback."""
    assert isinstance(_ops(), _CompiledOps)


def save_step(worker: WorkerSide, cache: KVCache, values: dict[str, torch.Tensor]) -> None:
    """One step that fills SAVED and saves it; the next step overwrites SAVED at once.

    The forward's writes are queued behind a ~10 ms sleep on the compute stream, so the
    save is issued while they are still pending; the overwrite is queued right after
    `wait_for_save` returns, while the gather may still be running.
    """
    torch.cuda._sleep(20_000_000)  # type: ignore[attr-defined]
    write_blocks(cache, SAVED, values)  # this step's forward pass
    worker.wait_for_save(Hf3fsctlConnectorMetadata(saves=[SaveJob("cold", SAVED, KEYS, 0)]))
    overwrite = step_values(cache, SAVED, seed=99)
    write_blocks(cache, SAVED, overwrite)  # the next step reuses the blocks immediately
    assert worker.drain(30)
    finished, _ = worker.get_finished({"cold"})
    assert finished == {"cold"}


def expected_pages(cache: KVCache, values: dict[str, torch.Tensor]) -> list[bytes]:
    """The pages of SAVED once `values` are written, computed on a copy of the cache."""
    copy = KVCache(cache.layout, cache.raw.clone(), {}, cache.geometry, cache.dtype)
    copy.views = {
        name: torch.as_strided(copy.raw.view(cache.dtype), v.size(), v.stride(), v.storage_offset())
        for name, v in cache.views.items()
    }
    write_blocks(copy, SAVED, values)
    return copy.pages(copy.raw.cpu(), SAVED)


def stored_pages(worker: WorkerSide, keys: list[str]) -> list[bytes]:
    """The bytes of each key's committed page, read from the page file on disk."""
    locations = worker.guard.call(lambda c: c.locate(worker.namespace, worker.rank, keys))
    assert worker.page_file is not None
    out = []
    with open(worker.page_file.path, "rb") as handle:
        for location in locations:
            assert location is not None
            handle.seek(location.page * worker.page_file.slot_bytes)
            out.append(handle.read(worker.manifest.page_bytes))
    return out


def load(worker: WorkerSide, blocks: list[int], *, sync: bool) -> set[int]:
    """One load step of KEYS into `blocks`; returns the block ids reported failed."""
    worker.start_load_kv(Hf3fsctlConnectorMetadata(loads=[LoadJob("warm", blocks, KEYS, sync)]))
    if not sync:
        deadline = time.monotonic() + 30
        while "warm" not in (worker.get_finished(set())[1] or set()):
            assert time.monotonic() < deadline, "async load never finished"
            time.sleep(0.005)
    torch.cuda.current_stream().synchronize()
    return worker.get_block_ids_with_load_errors()


@pytest.fixture
def cache_and_worker(
    request: pytest.FixtureRequest, store: Path
) -> Iterator[tuple[KVCache, WorkerSide]]:
    cache = make_cache(request.param)
    worker = make_worker(cache, store)
    yield cache, worker
    worker.shutdown()


@pytest.mark.parametrize("cache_and_worker", LAYOUTS, indirect=True)
def test_saved_pages_are_the_blocks_as_the_step_left_them(
    cache_and_worker: tuple[KVCache, WorkerSide],
) -> None:
    cache, worker = cache_and_worker
    values = step_values(cache, SAVED, seed=1)
    expected = expected_pages(cache, values)
    save_step(worker, cache, values)
    assert stored_pages(worker, KEYS) == expected


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("cache_and_worker", LAYOUTS, indirect=True)
def test_loaded_blocks_equal_the_saved_pages_and_nothing_else_changes(
    cache_and_worker: tuple[KVCache, WorkerSide], sync: bool
) -> None:
    cache, worker = cache_and_worker
    values = step_values(cache, SAVED, seed=2)
    expected = expected_pages(cache, values)
    save_step(worker, cache, values)
    torch.cuda.synchronize()
    before = cache.raw.cpu()
    assert load(worker, TARGETS, sync=sync) == set()
    after = cache.raw.cpu()
    assert cache.pages(after, TARGETS) == expected
    # Every byte outside the loaded blocks' pages is as it was before the load.
    want = before.clone()
    view = cache.segment(want).blocks_view()
    for block, page in zip(TARGETS, expected, strict=True):
        view[block] = torch.frombuffer(bytearray(page), dtype=torch.uint8).view(view.shape[1:])
    assert torch.equal(after, want)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("cache_and_worker", ["LBNHC", "MLA-fp8"], indirect=True)
def test_a_corrupt_page_is_a_load_error_and_its_block_is_left_alone(
    cache_and_worker: tuple[KVCache, WorkerSide], sync: bool
) -> None:
    cache, worker = cache_and_worker
    values = step_values(cache, SAVED, seed=3)
    expected = expected_pages(cache, values)
    save_step(worker, cache, values)
    location = worker.guard.call(lambda c: c.locate(worker.namespace, 0, [KEYS[1]]))[0]
    assert location is not None and worker.page_file is not None
    with open(worker.page_file.path, "r+b") as handle:
        handle.seek(location.page * worker.page_file.slot_bytes + location.size // 3)
        old = handle.read(8)
        handle.seek(location.page * worker.page_file.slot_bytes + location.size // 3)
        handle.write(bytes(b ^ 0x5A for b in old))
    torch.cuda.synchronize()
    before = cache.raw.cpu()
    assert load(worker, TARGETS, sync=sync) == {TARGETS[1]}
    after = cache.raw.cpu()
    pages = cache.pages(after, TARGETS)
    assert pages[1] == cache.pages(before, [TARGETS[1]])[0]  # the corrupt one: untouched
    assert [pages[0], pages[2], pages[3]] == [expected[0], expected[2], expected[3]]


@pytest.mark.parametrize("cache_and_worker", ["LBNHC"], indirect=True)
def test_the_staging_pool_holds_nothing_after_saves_and_loads(
    cache_and_worker: tuple[KVCache, WorkerSide],
) -> None:
    cache, worker = cache_and_worker
    save_step(worker, cache, step_values(cache, SAVED, seed=4))
    assert load(worker, TARGETS, sync=True) == set()
    assert load(worker, TARGETS, sync=False) == set()
    missing = LoadJob("gone", [9, 10], [f"{0xDEAD:064x}", f"{0xBEEF:064x}"], True)
    worker.start_load_kv(Hf3fsctlConnectorMetadata(loads=[missing]))
    assert worker.get_block_ids_with_load_errors() == {9, 10}
    assert worker.drain(30)
    counters = worker.pool.counters()
    assert counters["peak_in_use_bytes"] > 0
    assert counters["in_use_bytes"] == 0
