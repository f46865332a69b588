"""Host staging memory and the gather/scatter ops between a KV cache buffer and staging.

Contract:
    * A KV cache *segment* is one backing allocation (a uint8 view of its bytes) in which
      block ``b`` of layer ``l`` is the byte range ``[offset + l*layer_stride +
      b*block_stride, ... + page_size)`` (vLLM's `KVCacheTensor` geometry). A stored page
      is that range for every layer of every segment, concatenated in (segment, layer)
      order.
    * `gather_blocks(segments, block_ids, out)` copies the pages of `block_ids` into
      `out` (``[len(block_ids), page_bytes]`` uint8) with one vectorised op per segment
      on a device (no Python loop per block or layer); between a host cache and host
      staging, without the compiled ops, with one memcpy per (block, layer) range
      (torch's index ops run byte by byte there). `scatter_blocks` is the inverse and
      writes nothing but the named blocks' ranges.
    * `page_pieces(segments, block_ids)` names a host KV cache's page byte ranges as
      writable memoryviews (page order), for reading stored pages straight into them;
      `HostBlockPieces` does the same with the geometry's work done once.
    * `gather_blocks_reference` / `scatter_blocks_reference` are the plain-loop oracle
      the tests compare against; never used on the data path.
    * `_ops()` is the only dispatch point: it loads the compiled `csrc/` library
      (`$HF3FSCTL_OPS_LIB`, else `hf3fsctl build-ops`'s per-user cache for this torch,
      else `_ops.so` in the package; see `hf3fsctl.ops.locate`; never built at import) and
      uses it where it supports the tensors' device, else the pure-torch path; it logs
      once which implementation is active.
    * `StagingPool` hands out uint8 host buffers up to a fixed byte budget, reuses freed
      ones (a larger cached one rather than fresh memory), pins them when CUDA is
      available, and counts what it does. It never allocates past its capacity:
      `acquire` waits (with a timeout) or returns None. `prewarm` faults one buffer in
      ahead of use. Given an I/O engine's `SharedHostMemory` (USRBIO's iov), it allocates
      there instead, registering the memory with CUDA when CUDA is available, so the
      engine moves staging rows without a copy of its own.

Imports only torch and the standard library (runs on GPU nodes without the service's
dependencies).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hf3fsctl.ops.locate import LIBRARY_ENV, library_candidates

if TYPE_CHECKING:
    from hf3fsctl.storage.engine import SharedHostMemory

logger = logging.getLogger(__name__)

_ALIGN = 4096


@dataclass(frozen=True)
class KVSegment:
    """One backing allocation of the KV cache and where each layer's blocks sit in it.

    Attributes:
        buffer: a 1-D uint8 tensor over the allocation's bytes (any device).
        offset: byte offset of layer 0, block 0.
        layer_stride: bytes between the same block of consecutive layers.
        block_stride: bytes between consecutive blocks of one layer.
        num_layers: layers held in this segment.
        num_blocks: blocks per layer.
        page_size: bytes of one block of one layer.
    """

    buffer: torch.Tensor
    offset: int
    layer_stride: int
    block_stride: int
    num_layers: int
    num_blocks: int
    page_size: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one block across all layers of this segment."""
        return self.num_layers * self.page_size

    def blocks_view(self) -> torch.Tensor:
        """A `[num_blocks, num_layers, page_size]` uint8 view of the buffer (no copy)."""
        return torch.as_strided(
            self.buffer,
            (self.num_blocks, self.num_layers, self.page_size),
            (self.block_stride, self.layer_stride, 1),
            self.offset,
        )

    def check(self) -> None:
        """Raise ValueError unless the geometry fits the buffer and layers do not overlap."""
        if self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1:
            raise ValueError("segment buffer must be a 1-D uint8 tensor")
        if min(self.num_layers, self.num_blocks, self.page_size) <= 0:
            raise ValueError(f"segment has an empty dimension: {self}")
        last = (
            self.offset
            + (self.num_layers - 1) * self.layer_stride
            + (self.num_blocks - 1) * self.block_stride
            + self.page_size
        )
        if self.offset < 0 or last > self.buffer.numel():
            raise ValueError(f"segment reaches byte {last} of a {self.buffer.numel()}-byte buffer")
        dims = sorted([(self.block_stride, self.num_blocks), (self.layer_stride, self.num_layers)])
        (inner, inner_n), (outer, outer_n) = dims
        inner_ok = inner_n == 1 or inner >= self.page_size
        outer_ok = outer_n == 1 or outer >= inner * (inner_n - 1) + self.page_size
        if not (inner_ok and outer_ok):
            raise ValueError(
                f"segment pages overlap: page {self.page_size} B, block stride "
                f"{self.block_stride}, layer stride {self.layer_stride}"
            )


def total_page_bytes(segments: Sequence[KVSegment]) -> int:
    """Bytes of one stored page: every layer of every segment."""
    return sum(s.page_bytes for s in segments)


BlockIds = Sequence[int] | torch.Tensor


class _StagingOps(Protocol):
    """One gather/scatter implementation. Both calls check the table (`_check_batch`'s
    ValueErrors) and the block ids (IndexError) before they move a byte."""

    name: str

    def gather(
        self, segments: Sequence[KVSegment], block_ids: BlockIds, out: torch.Tensor
    ) -> None: ...

    def scatter(
        self, segments: Sequence[KVSegment], block_ids: BlockIds, src: torch.Tensor
    ) -> None: ...


def _on_host(segments: Sequence[KVSegment], table: torch.Tensor) -> bool:
    return table.device.type == "cpu" and all(s.buffer.device.type == "cpu" for s in segments)


def _as_index(block_ids: BlockIds) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(torch.long)
    return torch.tensor(list(block_ids), dtype=torch.long)


def _id_list(block_ids: BlockIds) -> list[int]:
    """Block ids as the ops' `int[]` argument (a device tensor costs one synchronisation)."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1:
            raise ValueError(f"block_ids must be 1-D, got {block_ids.dim()} dims")
        return block_ids.tolist()
    return [int(b) for b in block_ids]


def _check_batch(segments: Sequence[KVSegment], n: int, tensor: torch.Tensor, what: str) -> None:
    if not segments:
        raise ValueError("no KV cache segments")
    page = total_page_bytes(segments)
    if tensor.dtype != torch.uint8 or tuple(tensor.shape) != (n, page):
        raise ValueError(
            f"{what} must be uint8 [{n}, {page}], got {tensor.dtype} {tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


def _copy_host_pages(
    segments: Sequence[KVSegment], block_ids: torch.Tensor, table: torch.Tensor, *, gather: bool
) -> None:
    """Host cache and host staging: one memcpy per (block, layer) byte range.

    torch's index_select / index_copy_ over a strided uint8 blocks view copy byte by byte
    under OpenMP: 47 µs for 18 pages of 64 KiB on an idle core, 80 ms on a loaded 2-core
    VM (its threads spin at a barrier); these copies take 60 µs of one thread either way.
    """
    rows = table.numpy()
    pieces = page_pieces(segments, block_ids.tolist())
    for row, ranges in zip(rows, pieces, strict=True):
        page, position = memoryview(row), 0
        for piece in ranges:
            end = position + len(piece)
            if gather:
                page[position:end] = piece
            else:
                piece[:] = page[position:end]
            position = end


class _TorchOps:
    """Pure-torch path: one index_select / index_copy_ per segment on a device; on the
    host one memcpy per (block, layer) range (`_copy_host_pages`)."""

    name = "torch"

    def gather(self, segments: Sequence[KVSegment], block_ids: BlockIds, out: torch.Tensor) -> None:
        block_ids = _as_index(block_ids)
        _check_batch(segments, int(block_ids.numel()), out, "out")
        if not block_ids.numel():
            return
        if _on_host(segments, out):
            _copy_host_pages(segments, block_ids, out, gather=True)
            return
        column = 0
        for seg in segments:
            view = seg.blocks_view()
            ids = block_ids.to(device=view.device, dtype=torch.long)
            dst = out[:, column : column + seg.page_bytes]
            if len(segments) == 1 and out.device == view.device:
                torch.index_select(view, 0, ids, out=dst.view(-1, seg.num_layers, seg.page_size))
            else:
                selected = torch.index_select(view, 0, ids)
                dst.view(-1, seg.num_layers, seg.page_size).copy_(selected, non_blocking=True)
            column += seg.page_bytes

    def scatter(
        self, segments: Sequence[KVSegment], block_ids: BlockIds, src: torch.Tensor
    ) -> None:
        block_ids = _as_index(block_ids)
        _check_batch(segments, int(block_ids.numel()), src, "src")
        if not block_ids.numel():
            return
        if _on_host(segments, src):
            _copy_host_pages(segments, block_ids, src, gather=False)
            return
        column = 0
        for seg in segments:
            view = seg.blocks_view()
            ids = block_ids.to(device=view.device, dtype=torch.long)
            part = src[:, column : column + seg.page_bytes].view(-1, seg.num_layers, seg.page_size)
            if part.device != view.device:
                part = part.to(view.device, non_blocking=True)
            view.index_copy_(0, ids, part)
            column += seg.page_bytes


# How the CUDA op reaches pinned host staging: "zero_copy" (the kernel reads/writes the
# pinned pages in place over PCIe) or "bounce" (the kernel fills a device buffer, then one
# cudaMemcpyAsync). Chosen by measurement: see docs/staging-ops.md.
HOST_TRANSFER = "zero_copy"
_OP_NAMES = ("hf3fsctl::gather_pages", "hf3fsctl::scatter_pages")
_PLAN_CACHE_SIZE = 64  # segment lists remembered per _CompiledOps (one per KV cache, usually)

# One segment's `geometry` argument to the ops: offset, layer stride, block stride, layers,
# blocks, page size, column (registration.cpp).
_Geometry = tuple[int, int, int, int, int, int, int]


class _OneBlockEntryPoints:
    """The loaded library's 1-block path past the dispatcher (`csrc/one_block.cpp`), bound
    through ctypes: a segment is registered once (its geometry checked there) and a 1-block
    call is one C call per segment with a handle, a block id and the staging row's address.
    Every non-zero status moved nothing; the caller then runs the op, which raises the op's
    own exception (or serves a layout the copy engine refuses)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, i32, pointer = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        self.register = library.hf3fsctl_one_block_register
        self.register.argtypes = [pointer, i64, i32, i64, i64, i64, i64, i64, i64, i64, i64]
        self.register.restype = i32
        self.copy = library.hf3fsctl_one_block_copy
        self.copy.argtypes = [i32, i64, pointer, i32]
        self.copy.restype = i32
        self.release = library.hf3fsctl_one_block_release
        self.release.argtypes = [i32]
        self.release.restype = None
        self.handles_in_use = library.hf3fsctl_one_block_handles
        self.handles_in_use.argtypes = []
        self.handles_in_use.restype = i32


_ONE_BLOCK: _OneBlockEntryPoints | None = None


def _one_block_entry_points() -> _OneBlockEntryPoints | None:
    """The 1-block entry points of the loaded ops library; None when none loaded has them
    (a library built before them: every call takes the op)."""
    global _ONE_BLOCK
    if _ONE_BLOCK is None:
        for path in sorted(torch.ops.loaded_libraries):
            try:
                library = ctypes.CDLL(path)  # the loaded library's own handle (dlopen)
            except OSError:
                continue
            if hasattr(library, "hf3fsctl_one_block_copy"):
                _ONE_BLOCK = _OneBlockEntryPoints(library)
                break
    return _ONE_BLOCK


def _release_handles(release: Any, handles: tuple[int, ...]) -> None:
    for handle in handles:
        release(handle)


@dataclass(frozen=True)
class _Plan:
    """What a call over one list of segments needs, worked out once per list.

    Attributes:
        segments: weak references to the segments: the plan is theirs while they live
            (its key is their ids), and it keeps no KV cache alive.
        page_bytes: bytes of one staging row (every layer of every segment).
        device: the segments' device.
        cuda: the segments are CUDA tensors.
        fallback: why these segments take the torch path (None: the compiled ops).
        geometries: per segment, the ops' `geometry` argument.
        one_block: per segment, its handle for 1-block calls past the dispatcher (released
            when the plan goes); None where the op serves them (no entry points, a fallback,
            bounce transfer, a geometry the library refuses).
    """

    segments: tuple[weakref.ref[KVSegment], ...]
    page_bytes: int
    device: torch.device
    cuda: bool
    fallback: str | None
    geometries: tuple[_Geometry, ...]
    one_block: tuple[int, ...] | None = None

    def serves(self, segments: Sequence[KVSegment]) -> bool:
        """Whether this plan was made for these very segments (ids can be reused)."""
        refs = self.segments
        if len(refs) != len(segments):
            return False
        # Lengths checked; a loop rather than all(<generator>): this runs on every call.
        for ref, seg in zip(refs, segments):  # noqa: B905, SIM110
            if ref() is not seg:
                return False
        return True


class _CompiledOps:
    """The csrc/ ops: one copy-engine call or kernel launch (CPU: one parallel loop) per
    segment per batch.

    Block ids travel as a host list (`int[]`): the op range-checks them and hands a CUDA
    kernel up to 512 of them by value (no index tensor, no H2D copy, no synchronisation); a
    single block is one cudaMemcpy2DAsync (or cudaMemcpyAsync) straight from the host
    pointer, pinned or pageable. What depends on the segments alone (page bytes, device,
    the op arguments) is worked out once per segment list (`_Plan`); a call checks only its
    table and ids, and asks nothing about the memory (no `is_pinned`). A call of one block
    into or out of host staging skips the dispatcher too: the plan holds each segment's
    handle in the library (`_OneBlockEntryPoints`), and the call is one ctypes call per
    segment issuing the op's own copy; whatever that refuses (an id out of range, a runtime
    error) goes to the op, which raises as before. Tensors on a device
    the library was not built for take the torch path, and so does pageable host staging of
    several blocks next to a CUDA cache (the op raises NotImplementedError before a copy).
    """

    name = "compiled"

    def __init__(self, devices: frozenset[str], host_transfer: str = HOST_TRANSFER) -> None:
        if host_transfer not in ("zero_copy", "bounce"):
            raise ValueError(f"unknown host transfer {host_transfer!r}")
        self.devices = devices
        self.host_transfer = host_transfer
        self._fallback = _TorchOps()
        self._warned: set[str] = set()
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._last_plan: _Plan | None = None  # the plan of the latest call
        self._gather_op: Any = None  # the ops' overloads, looked up on first use
        self._scatter_op: Any = None
        self._one_block_copy: Any = None  # hf3fsctl_one_block_copy, once a plan has handles

    def _resolve_ops(self) -> tuple[Any, Any]:
        # The overloads' C++ callables where torch exposes them (`OpOverload.__call__` is
        # only `self._op(...)`: one Python frame less per call), else the overloads.
        gather = torch.ops.hf3fsctl.gather_pages.default
        scatter = torch.ops.hf3fsctl.scatter_pages.default
        self._gather_op = getattr(gather, "_op", gather)
        self._scatter_op = getattr(scatter, "_op", scatter)
        return self._gather_op, self._scatter_op

    def _plan(self, segments: Sequence[KVSegment]) -> _Plan:
        last = self._last_plan  # one KV cache per worker, usually: no key to build
        if last is not None and last.serves(segments):
            return last
        key = tuple(map(id, segments))
        plan = self._plans.get(key)
        if plan is not None and plan.serves(segments):
            self._last_plan = plan
            return plan
        if not segments:
            raise ValueError("no KV cache segments")
        device = segments[0].buffer.device
        fallback = None
        if device.type not in self.devices or any(s.buffer.device != device for s in segments):
            fallback = f"{device.type} tensors"
        geometries, column = [], 0
        for seg in segments:
            geometries.append((seg.offset, seg.layer_stride, seg.block_stride, seg.num_layers,
                               seg.num_blocks, seg.page_size, column))  # fmt: skip
            column += seg.page_bytes
        refs = tuple(weakref.ref(seg) for seg in segments)
        # One-block calls past the dispatcher where the op's plain one-row copy would serve
        # them (not with bounce transfer, whose device table the op fills).
        entry = None
        if fallback is None and self.host_transfer == "zero_copy":
            entry = _one_block_entry_points()
        handles = (
            None if entry is None else _register_one_block(entry, segments, geometries, column)
        )
        plan = _Plan(refs, column, device, device.type == "cuda", fallback, tuple(geometries),
                     handles)  # fmt: skip
        if entry is not None and handles is not None:
            self._one_block_copy = entry.copy
            weakref.finalize(plan, _release_handles, entry.release, handles).atexit = False
        if len(self._plans) >= _PLAN_CACHE_SIZE:
            self._plans.clear()
        self._plans[key] = plan
        self._last_plan = plan
        return plan

    def _torch_path(self, plan: _Plan, table: torch.Tensor, pageable: bool = False) -> bool:
        """Whether this call takes the torch path (logged once per reason)."""
        if pageable:
            reason = "pageable host staging"
        elif plan.fallback is not None:
            reason = plan.fallback
        elif plan.cuda or table.is_cpu:
            return False
        else:
            reason = f"{table.device.type} staging beside a cpu cache"
        if reason not in self._warned:
            self._warned.add(reason)
            logger.info("staging gather/scatter: torch path for %s", reason)
        return True

    # gather and scatter mirror each other's checks line for line on purpose: a shared
    # helper is one more Python frame on a call whose ~6 us of host time is what a 1-block
    # copy is measured against (docs/staging-ops.md, issue 23).
    def gather(self, segments: Sequence[KVSegment], block_ids: BlockIds, out: torch.Tensor) -> None:
        plan = self._plan(segments)
        ids = block_ids if type(block_ids) is list else _id_list(block_ids)
        if out.dtype != torch.uint8 or out.shape != (len(ids), plan.page_bytes):
            _check_batch(segments, len(ids), out, "out")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        handles = plan.one_block
        if handles is not None and len(ids) == 1 and out.is_cpu:  # past the dispatcher
            copy, row, block = self._one_block_copy, out.data_ptr(), ids[0]
            try:
                for handle in handles:
                    if copy(handle, block, row, 1):
                        break  # moved nothing: the op below raises as it would have
                else:
                    return
            except ctypes.ArgumentError:
                pass  # an id ctypes cannot pass as an int64: the op parses it
        if self._torch_path(plan, out):
            self._fallback.gather(segments, ids, out)
            return
        if not ids:
            return
        bounce = self.host_transfer == "bounce" and plan.cuda and not out.is_cuda
        table = torch.empty(out.shape, dtype=torch.uint8, device=plan.device) if bounce else out
        op = self._gather_op or self._resolve_ops()[0]
        try:
            for seg, geometry in zip(segments, plan.geometries, strict=True):
                op(seg.buffer, table, ids, geometry)
        except NotImplementedError:  # pageable staging, several blocks: raised before a copy
            self._torch_path(plan, out, pageable=True)
            self._fallback.gather(segments, ids, out)
            return
        if bounce:
            out.copy_(table, non_blocking=True)

    def scatter(
        self, segments: Sequence[KVSegment], block_ids: BlockIds, src: torch.Tensor
    ) -> None:
        plan = self._plan(segments)
        ids = block_ids if type(block_ids) is list else _id_list(block_ids)
        if src.dtype != torch.uint8 or src.shape != (len(ids), plan.page_bytes):
            _check_batch(segments, len(ids), src, "src")
        if not src.is_contiguous():
            raise ValueError("src must be contiguous")
        handles = plan.one_block
        if handles is not None and len(ids) == 1 and src.is_cpu:  # past the dispatcher
            copy, row, block = self._one_block_copy, src.data_ptr(), ids[0]
            try:
                for handle in handles:
                    if copy(handle, block, row, 0):
                        break  # moved nothing: the op below raises as it would have
                else:
                    return
            except ctypes.ArgumentError:
                pass  # an id ctypes cannot pass as an int64: the op parses it
        if self._torch_path(plan, src):
            self._fallback.scatter(segments, ids, src)
            return
        if not ids:
            return
        table = src
        if self.host_transfer == "bounce" and plan.cuda and not src.is_cuda:
            table = src.to(plan.device, non_blocking=True)
        op = self._scatter_op or self._resolve_ops()[1]
        try:
            for seg, geometry in zip(segments, plan.geometries, strict=True):
                op(seg.buffer, table, ids, geometry)
        except NotImplementedError:  # pageable staging, several blocks: raised before a copy
            self._torch_path(plan, src, pageable=True)
            self._fallback.scatter(segments, ids, src)


def _register_one_block(
    entry: _OneBlockEntryPoints,
    segments: Sequence[KVSegment],
    geometries: Sequence[_Geometry],
    row_bytes: int,
) -> tuple[int, ...] | None:
    """Each segment's 1-block handle, or None (every one released) where any segment is
    left to the op: a buffer the op would refuse, a geometry the library refuses."""
    handles: list[int] = []
    for seg, geometry in zip(segments, geometries, strict=True):
        buffer = seg.buffer
        fits = buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()
        if fits and all(-(1 << 62) < value < 1 << 62 for value in (*geometry, row_bytes)):
            index = -1 if buffer.device.type == "cpu" else int(buffer.device.index or 0)
            handle = entry.register(buffer.data_ptr(), buffer.numel(), index, *geometry, row_bytes)
        else:
            handle = -1
        if handle < 0:
            _release_handles(entry.release, tuple(handles))
            return None
        handles.append(handle)
    return tuple(handles)


def _compiled_devices() -> frozenset[str]:
    """Devices the loaded library implements both ops for (empty when none is loaded)."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    devices = set()
    for device in ("cpu", "cuda"):
        try:
            if all(has_kernel(op, device.upper()) for op in _OP_NAMES):
                devices.add(device)
        except RuntimeError:  # the op's schema is not registered at all
            return frozenset()
    return frozenset(devices)


def load_compiled_ops(path: str | os.PathLike[str] | None = None) -> frozenset[str]:
    """Load the csrc/ library (once per process) and return the devices it supports.

    Args:
        path: the library; default the first that exists of `hf3fsctl.ops.locate`'s
            search order: `$HF3FSCTL_OPS_LIB` alone when set, else `hf3fsctl build-ops`'s
            per-user cache entry for this torch (CUDA build for this GPU, then CPU build),
            else `_ops.so` in the package directory.

    Returns:
        The devices ("cpu", "cuda") with compiled ops; empty when no library is found or it
        fails to load (logged as a warning, and the torch path is used).
    """
    devices = _compiled_devices()
    if devices:
        return devices  # already loaded (a second load of one namespace would fail)
    candidates = [Path(path)] if path else library_candidates()
    library = next((c for c in candidates if c.exists()), None)
    if library is None:
        if path or os.environ.get(LIBRARY_ENV):
            logger.warning("staging ops library %s does not exist", candidates[0])
        return frozenset()
    try:
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:
        logger.warning("cannot load staging ops library %s: %s", library, exc)
        return frozenset()
    return _compiled_devices()


_ACTIVE_OPS: _StagingOps | None = None
_OPS_LOCK = threading.Lock()


def _ops() -> _StagingOps:
    """The gather/scatter implementation in use (compiled kernels when built, else torch)."""
    global _ACTIVE_OPS
    if _ACTIVE_OPS is None:
        with _OPS_LOCK:
            if _ACTIVE_OPS is None:
                devices = load_compiled_ops()
                if devices:
                    _ACTIVE_OPS = _CompiledOps(devices)
                    logger.info(
                        "staging gather/scatter: compiled hf3fsctl ops for %s (host transfer: "
                        "%s); torch path elsewhere",
                        ", ".join(sorted(devices)),
                        HOST_TRANSFER,
                    )
                else:
                    _ACTIVE_OPS = _TorchOps()
                    logger.info(
                        "staging gather/scatter: %s path (no compiled hf3fsctl ops loaded)",
                        _ACTIVE_OPS.name,
                    )
    return _ACTIVE_OPS


def gather_blocks(segments: Sequence[KVSegment], block_ids: BlockIds, out: torch.Tensor) -> None:
    """Copy the pages of `block_ids` (all layers) from the KV cache into `out`.

    Args:
        segments: the KV cache segments (usually one).
        block_ids: blocks to copy, in the order their pages go into `out` (a list is the
            cheapest form; a device tensor costs a synchronisation).
        out: contiguous uint8 `[len(block_ids), total_page_bytes(segments)]`.

    Raises:
        ValueError: no segments, or `out` has the wrong dtype, shape or layout.
        IndexError: a block id is outside the cache.
    """
    (_ACTIVE_OPS or _ops()).gather(segments, block_ids, out)


def scatter_blocks(segments: Sequence[KVSegment], block_ids: BlockIds, src: torch.Tensor) -> None:
    """Copy pages from `src` into the KV cache blocks `block_ids`; nothing else is written.

    Args:
        segments: the KV cache segments (usually one).
        block_ids: destination blocks, one per row of `src` (no duplicates).
        src: contiguous uint8 `[len(block_ids), total_page_bytes(segments)]`.

    Raises:
        ValueError: no segments, or `src` has the wrong dtype, shape or layout.
        IndexError: a block id is outside the cache.
    """
    (_ACTIVE_OPS or _ops()).scatter(segments, block_ids, src)


class HostBlockPieces:
    """The byte ranges of each block's page in a host KV cache, worked out once.

    Built once per geometry (the worker keeps one per KV cache): the buffers' byte views
    and each layer's start are computed here, so naming a block's pieces is one slice
    per (segment, layer) and nothing else.

    Raises (on construction):
        ValueError: a segment is not in host memory.
    """

    def __init__(self, segments: Sequence[KVSegment]) -> None:
        self.segments = list(segments)  # keeps the buffers the views alias alive
        # Per segment: (its bytes, each layer's block-0 start, block stride, blocks,
        # bytes of one block of one layer).
        self._plans: list[tuple[memoryview, list[int], int, int, int]] = []
        for seg in self.segments:
            if seg.buffer.device.type != "cpu":
                raise ValueError(f"page pieces need a host KV cache, not {seg.buffer.device}")
            starts = [seg.offset + layer * seg.layer_stride for layer in range(seg.num_layers)]
            base = seg.buffer.numpy().data.cast("B")
            self._plans.append((base, starts, seg.block_stride, seg.num_blocks, seg.page_size))

    def pieces(self, block_ids: Sequence[int]) -> list[list[memoryview]]:
        """One list of writable memoryviews per block, in stored-page order.

        Raises:
            ValueError: a block id is out of range.
        """
        out: list[list[memoryview]] = []
        for block in block_ids:
            block = int(block)
            pieces: list[memoryview] = []
            for base, starts, block_stride, num_blocks, size in self._plans:
                if not 0 <= block < num_blocks:
                    raise ValueError(f"block {block} is outside 0..{num_blocks - 1}")
                at = block * block_stride
                pieces += [base[start + at : start + at + size] for start in starts]
            out.append(pieces)
        return out


def page_pieces(segments: Sequence[KVSegment], block_ids: Sequence[int]) -> list[list[memoryview]]:
    """The byte ranges of each block's page in a host KV cache, in stored-page order.

    One writable memoryview per (segment, layer) of each block, aliasing the cache: an
    I/O engine can read a stored page straight into them (`read_pages_scattered`), with
    no staging buffer and no scatter copy. A caller that names blocks of one cache again
    and again keeps a `HostBlockPieces` instead.

    Args:
        segments: the KV cache segments; their buffers must be CPU tensors.
        block_ids: the blocks, in the order of the returned lists.

    Raises:
        ValueError: a segment is not in host memory or a block id is out of range.
    """
    return HostBlockPieces(segments).pieces(block_ids)


def gather_blocks_reference(
    segments: Sequence[KVSegment], block_ids: Sequence[int], out: torch.Tensor
) -> None:
    """Loop oracle for `gather_blocks`: one byte-range copy per (block, layer)."""
    for row, block in enumerate(block_ids):
        column = 0
        for seg in segments:
            for layer in range(seg.num_layers):
                start = seg.offset + layer * seg.layer_stride + int(block) * seg.block_stride
                out[row, column : column + seg.page_size].copy_(
                    seg.buffer[start : start + seg.page_size]
                )
                column += seg.page_size


def scatter_blocks_reference(
    segments: Sequence[KVSegment], block_ids: Sequence[int], src: torch.Tensor
) -> None:
    """Loop oracle for `scatter_blocks`."""
    for row, block in enumerate(block_ids):
        column = 0
        for seg in segments:
            for layer in range(seg.num_layers):
                start = seg.offset + layer * seg.layer_stride + int(block) * seg.block_stride
                seg.buffer[start : start + seg.page_size].copy_(
                    src[row, column : column + seg.page_size]
                )
                column += seg.page_size


class StagingBuffer:
    """A leased staging buffer: `tensor` is a contiguous `[rows, row_bytes]` uint8 view."""

    def __init__(self, pool: StagingPool, block: torch.Tensor, rows: int, row_bytes: int) -> None:
        self._pool = pool
        self._block: torch.Tensor | None = block
        self.tensor = block[: rows * row_bytes].view(rows, row_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes this lease holds from the pool: its buffer's real size (can be a larger class)."""
        return 0 if self._block is None else int(self._block.numel())

    def rows(self) -> list[Any]:
        """One writable buffer-protocol object per row (numpy views, no copies)."""
        array = self.tensor.numpy()
        return [array[i] for i in range(array.shape[0])]

    def release(self) -> None:
        """Give the memory back to the pool (idempotent)."""
        block, self._block = self._block, None
        if block is not None:
            self._pool._give_back(block)

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _size_class(nbytes: int) -> int:
    size = _ALIGN
    while size < nbytes:
        size *= 2
    return size


class StagingPool:
    """A bounded pool of host staging buffers (pinned when CUDA is available).

    Buffers are allocated on demand in power-of-two size classes, kept after release and
    reused; the bytes held (in use + cached) never exceed `capacity_bytes` — cached
    buffers of other sizes are dropped to make room before an acquire has to wait.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        pin: bool | None = None,
        host_memory: SharedHostMemory | None = None,
    ) -> None:
        """Create an empty pool.

        Args:
            capacity_bytes: most bytes the pool ever holds.
            pin: pin buffers in page-locked memory; default: when CUDA is available.
            host_memory: where to allocate buffers (an I/O engine's own memory, see
                `use_host_memory`); default torch's host allocator.
        """
        if capacity_bytes <= 0:
            raise ValueError(f"staging capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.host_memory = host_memory
        self._shared: dict[int, SharedHostMemory] = {}  # data_ptr -> where it came from
        self.shared_allocations = 0
        self._cond = threading.Condition()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._held = 0  # bytes allocated (in use + cached free)
        self._in_use = 0
        self.peak_in_use = 0
        self.acquires = 0
        self.allocations = 0
        self.exhausted = 0

    @property
    def in_use_bytes(self) -> int:
        """Bytes currently leased out (the real sizes of the leased buffers)."""
        return self._in_use

    def counters(self) -> dict[str, int]:
        """Counts for stats and logs."""
        with self._cond:
            return {
                "capacity_bytes": self.capacity_bytes,
                "held_bytes": self._held,
                "in_use_bytes": self._in_use,
                "peak_in_use_bytes": self.peak_in_use,
                "acquires": self.acquires,
                "allocations": self.allocations,
                "shared_allocations": self.shared_allocations,
                "exhausted": self.exhausted,
            }

    def use_host_memory(self, memory: SharedHostMemory | None) -> None:
        """Allocate from `memory` from now on (None: torch's host allocator again).

        Cached buffers are dropped at once and leased ones when they come back, so every
        later lease lies in `memory`.
        """
        with self._cond:
            if memory is self.host_memory:
                return
            self.host_memory = memory
            for blocks in self._free.values():
                while blocks:
                    self._drop_locked(blocks.pop())
            self._cond.notify_all()

    @property
    def one_copy(self) -> bool:
        """Buffers come from an I/O engine's own memory (it moves them without a copy)."""
        return self.host_memory is not None

    def acquire(self, rows: int, row_bytes: int, timeout_s: float = 0.0) -> StagingBuffer | None:
        """Lease a `[rows, row_bytes]` buffer, waiting up to `timeout_s` for room.

        Returns:
            The buffer, or None when the pool cannot hold it within the timeout (counted
            as `exhausted`). A request larger than the whole pool returns None at once.
        """
        size = _size_class(max(1, rows * row_bytes))
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self.acquires += 1
            if size > self.capacity_bytes:
                self.exhausted += 1
                return None
            while True:
                block = self._take_locked(size)
                if block is not None:
                    # The buffer's real size: a larger cached one may serve a smaller
                    # request, and `_give_back` returns exactly this many bytes.
                    self._in_use += int(block.numel())
                    self.peak_in_use = max(self.peak_in_use, self._in_use)
                    return StagingBuffer(self, block, rows, row_bytes)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.exhausted += 1
                    return None
                self._cond.wait(remaining)

    def prewarm(self, nbytes: int) -> bool:
        """Allocate and touch one buffer of `nbytes` (its size class) and cache it.

        Fresh host memory is faulted in page by page on first touch (a fraction of a
        GB/s on some VMs); a buffer warmed at start-up keeps that cost out of the first
        save or load. Safe to call from a background thread.

        Returns:
            True when the buffer was added (False: it does not fit the capacity).
        """
        size = _size_class(max(1, nbytes))
        with self._cond:
            if self._held + size > self.capacity_bytes:
                return False
            self._held += size  # reserved while it is being touched
            self.allocations += 1
        try:
            block = self._new_block(size)
            block.fill_(0)  # fault every page in now
        except Exception:
            with self._cond:
                self._held -= size
            raise
        with self._cond:
            self._free.setdefault(size, []).append(block)
            self._cond.notify_all()
        return True

    def _take_locked(self, size: int) -> torch.Tensor | None:
        cached = self._free.get(size)
        if cached:
            return cached.pop()
        # A larger cached buffer beats fresh memory (whose pages fault in on first use).
        larger = [k for k, v in self._free.items() if v and k > size]
        if larger:
            return self._free[min(larger)].pop()
        # Drop cached buffers of other sizes until the new one fits.
        while self._held + size > self.capacity_bytes:
            victim = next((k for k, v in self._free.items() if v), None)
            if victim is None:
                return None
            self._drop_locked(self._free[victim].pop())
        self._held += size
        self.allocations += 1
        return self._new_block(size)

    def _new_block(self, size: int) -> torch.Tensor:
        """`size` bytes from `host_memory` (CUDA-registered) or torch's allocator."""
        memory = self.host_memory
        view = None if memory is None else memory.allocate(size)
        if memory is None or view is None:
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        block = torch.frombuffer(view, dtype=torch.uint8)
        if self.pinned:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            error = int(cudart.cudaHostRegister(block.data_ptr(), size, 0))
            if error:  # still correct, only slower: the staging ops see pageable memory
                logger.warning("cudaHostRegister of %d staging bytes failed: %d", size, error)
        self._shared[block.data_ptr()] = memory
        self.shared_allocations += 1
        return block

    def _drop_locked(self, block: torch.Tensor) -> None:
        """Forget a cached buffer (its bytes leave `held`); free it where it came from."""
        self._held -= int(block.numel())
        address = block.data_ptr()
        origin = self._shared.pop(address, None)
        if origin is not None:
            if self.pinned:
                torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
            del block  # drop this view, so the memory can be unmapped once unused
            origin.free(address)

    def _give_back(self, block: torch.Tensor) -> None:
        size = int(block.numel())
        with self._cond:
            self._in_use -= size
            if self.host_memory is not None and block.data_ptr() not in self._shared:
                self._drop_locked(block)  # plain memory: make room for iov-backed buffers
            else:
                self._free.setdefault(size, []).append(block)
            self._cond.notify_all()
