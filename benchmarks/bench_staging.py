"""Staging benchmark: gather/scatter GB/s between a KV cache and pinned host staging.

Geometry (default): a Llama-8B-like cache, all layers in one flat buffer laid out as vLLM's
CUDA FlashAttention does (layer-outermost): 32 layers, 8 KV heads, head_dim 128, block 16,
bf16, so one (block, layer) page is 64 KiB and one stored page (all layers) is 2 MiB. The
cache holds 2048 blocks (4 GiB) and each batch takes random, non-contiguous block ids.

Other geometries (`--geometries`, default all on a GPU): every byte layout the connector
accepts, as (layers, bytes of one (block, layer) page, layer- or block-outermost). vLLM's
HND/NHD variants (LBHNC, LBNHC) permute axes inside a page, so at this level they are the
same geometry; what changes the copy is the page size and whether a block's layers are one
range. They run the default path (`zero_copy`) only, at 1 block (against a pinned copy of
the same bytes: the ratio of times) and at 64/512 blocks (against PCIe).

Variants, for gather (cache -> pinned host) and scatter (pinned host -> cache):
  loop       the seed connector's style: one `copy_` per (block, layer)
  torch      the pure-torch path: index_select per segment, then one copy to the host
  zero_copy  our kernel, reading/writing pinned host memory in place over PCIe
  bounce     our kernel into/out of a device buffer, plus one cudaMemcpyAsync
  device     our kernel with a device-side table (its speed without PCIe)
and the ceilings measured in the same run for the same byte count: pinned D2H / H2D
`cudaMemcpyAsync` (PCIe) and a device-to-device copy. Also a GPU -> page file -> GPU round
trip through the POSIX engine on local disk (`--roundtrip-blocks 0` skips it).

GB/s is the batch's bytes (one direction) over the median time (CUDA events, warm-up
first). On a CPU-only machine the same variants run on CPU tensors with small sizes.

One block (`one_block` in the JSON; `--only-one-block` runs nothing else): for every
geometry, the public `gather_blocks` / `scatter_blocks` call with a list of ids (what the
connector makes) against a pinned `copy_` of the same bytes, sampled in interleaved rounds
(so drift hits both alike), the ratio of medians; and the host CPU time of one call
(thread time of back-to-back calls, no waiting).

    python benchmarks/bench_staging.py                    # table
    python benchmarks/bench_staging.py --json             # one JSON document on stdout
    python benchmarks/bench_staging.py --out result.json  # table, and the JSON to a file
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hf3fsctl.staging import (  # noqa: E402
    KVSegment,
    _CompiledOps,
    _ops,
    _TorchOps,
    gather_blocks,
    load_compiled_ops,
    scatter_blocks,
)

GB = 1e9


# name -> (layers, bytes of one (block, layer) page, layout, what it is)
GEOMETRIES: dict[str, tuple[int, int, str, str]] = {
    "llama8b-bf16-BLNHC": (
        32,
        2 * 16 * 8 * 128 * 2,
        "block_outer",
        "block-outermost, 64 KiB/layer",
    ),
    "llama8b-tp2-fp8-LBNHC": (32, 2 * 16 * 4 * 128, "layer_outer", "fp8, TP 2: 16 KiB/layer"),
    "llama8b-tp2-fp8-BLNHC": (32, 2 * 16 * 4 * 128, "block_outer", "fp8, TP 2, block-outermost"),
    "mla-bf16-LBNHC": (61, 64 * 576 * 2, "layer_outer", "DeepSeek MLA, block 64: 72 KiB/layer"),
    "mla-fp8-LBNHC": (61, 16 * 576, "layer_outer", "MLA fp8 (uint8), block 16: 9 KiB/layer"),
    "mla-fp8-BLNHC": (61, 16 * 576, "block_outer", "MLA fp8, block-outermost"),
}


def _segment(layers: int, page: int, layout: str, blocks: int, device: str) -> KVSegment:
    """A flat KV buffer of random bytes (never time zeros) in the given byte layout."""
    buffer = torch.empty(layers * blocks * page, dtype=torch.uint8, device=device)
    buffer.random_(0, 256)
    if layout == "layer_outer":
        return KVSegment(buffer, 0, blocks * page, page, layers, blocks, page)
    return KVSegment(buffer, 0, page, layers * page, layers, blocks, page)


def _cache(args: argparse.Namespace, device: str) -> KVSegment:
    page = 2 * args.block_size * args.kv_heads * args.head_dim * 2  # K+V, bf16
    return _segment(args.layers, page, "layer_outer", args.cache_blocks, device)


def _timer(device: str, fn: Callable[[], None], repeat: int, warmup: int = 2) -> float:
    """Median seconds of `fn` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _loop_gather(seg: KVSegment, blocks: list[int], out: torch.Tensor) -> None:
    view = seg.blocks_view()
    for row, block in enumerate(blocks):
        for layer in range(seg.num_layers):
            out[row, layer * seg.page_size : (layer + 1) * seg.page_size].copy_(
                view[block, layer], non_blocking=True
            )


def _loop_scatter(seg: KVSegment, blocks: list[int], src: torch.Tensor) -> None:
    view = seg.blocks_view()
    for row, block in enumerate(blocks):
        for layer in range(seg.num_layers):
            view[block, layer].copy_(
                src[row, layer * seg.page_size : (layer + 1) * seg.page_size], non_blocking=True
            )


def _variants(
    seg: KVSegment, device: str, devices: frozenset[str]
) -> dict[str, tuple[Callable[..., None], Callable[..., None], bool]]:
    """name -> (gather(ids, blocks, table), scatter(ids, blocks, table), device_table)."""
    torch_ops = _TorchOps()
    found: dict[str, tuple[Callable[..., None], Callable[..., None], bool]] = {
        "loop": (
            lambda ids, blocks, t: _loop_gather(seg, blocks, t),
            lambda ids, blocks, t: _loop_scatter(seg, blocks, t),
            False,
        ),
        "torch": (
            lambda ids, blocks, t: torch_ops.gather([seg], ids, t),
            lambda ids, blocks, t: torch_ops.scatter([seg], ids, t),
            False,
        ),
    }
    if device in devices:
        modes = ["zero_copy", "bounce", "device"] if device == "cuda" else ["device"]
        for mode in modes:
            ops = _CompiledOps(devices, "bounce" if mode == "bounce" else "zero_copy")
            found[mode if device == "cuda" else "compiled"] = (
                lambda ids, blocks, t, ops=ops: ops.gather([seg], ids, t),
                lambda ids, blocks, t, ops=ops: ops.scatter([seg], ids, t),
                mode == "device",
            )
    return found


def _ceilings(nbytes: int, device: str, repeat: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    host.random_(0, 256)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dev2 = torch.empty_like(dev)
    result = {"d2d_copy": nbytes / _timer(device, lambda: dev2.copy_(dev), repeat) / GB}
    if device == "cuda":
        result["pcie_d2h"] = (
            nbytes / _timer(device, lambda: host.copy_(dev, non_blocking=True), repeat) / GB
        )
        result["pcie_h2d"] = (
            nbytes / _timer(device, lambda: dev.copy_(host, non_blocking=True), repeat) / GB
        )
    return result


def _roundtrip(seg: KVSegment, n: int, device: str, root: Path) -> dict[str, float]:
    """GPU -> pinned -> page file -> pinned -> GPU, seconds per stage, compiled ops."""
    from hf3fsctl.staging import gather_blocks, scatter_blocks
    from hf3fsctl.storage.engine import open_engine
    from hf3fsctl.storage.layout import PageFile, slot_bytes

    page_bytes = seg.page_bytes
    blocks = torch.randperm(seg.num_blocks)[:n].tolist()
    targets = torch.randperm(seg.num_blocks)[:n].tolist()
    pinned = device == "cuda"
    staged = torch.empty(n, page_bytes, dtype=torch.uint8, pin_memory=pinned)
    back = torch.empty_like(staged, pin_memory=pinned)
    staged.fill_(1), back.fill_(1)  # pre-touch
    engine = open_engine("posix", io_threads=16)
    file = PageFile.create(root, "000000000be4c5a9", 0, page_bytes, n * slot_bytes(page_bytes))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    gather_blocks([seg], blocks, staged)
    sync()
    t1 = time.perf_counter()
    written = engine.write_pages(file, list(range(n)), [staged[i].numpy() for i in range(n)])
    t2 = time.perf_counter()
    read = engine.read_pages(
        file, list(range(n)), [back[i].numpy() for i in range(n)],
        expected=[w.checksum for w in written],
    )  # fmt: skip
    t3 = time.perf_counter()
    scatter_blocks([seg], targets, back)
    sync()
    t4 = time.perf_counter()
    ok = all(r.ok for r in written + read) and torch.equal(staged, back)
    stages = {"gather": t1 - t0, "write": t2 - t1, "read": t3 - t2, "scatter": t4 - t3}
    file.close()
    engine.close()
    nbytes = n * page_bytes
    result = {f"{k}_gbps": nbytes / v / GB for k, v in stages.items()}
    result.update(total_gbps=nbytes / sum(stages.values()) / GB, bytes=nbytes, verified=ok)
    return result


def _event_seconds(fn: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1000


def _host_us(fn: Callable[[], None], calls: int = 200) -> float:
    """Host CPU µs of one call: thread time of back-to-back calls (the GPU drains later)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    spent = time.thread_time() - t0
    torch.cuda.synchronize()
    return spent / calls * 1e6


def _one_block(doc: dict[str, Any], args: argparse.Namespace, generator: torch.Generator) -> None:
    """One block per geometry: the public call vs a pinned copy of its bytes, interleaved."""
    geometries = {"llama8b-bf16-LBNHC": (32, 65536, "layer_outer", "default geometry")}
    geometries.update(GEOMETRIES)
    doc["one_block"] = []
    # The connector copies on its own streams; --side-stream times the copy and the call on
    # one (cudaMemcpyBatchAsync refuses the legacy default stream).
    stream = torch.cuda.Stream() if args.side_stream else None  # type: ignore[no-untyped-call]
    doc["one_block_stream"] = "side" if stream is not None else "default"
    with torch.cuda.stream(stream):
        for name, (layers, page, layout, _) in geometries.items():
            doc["one_block"].append(_one_block_row(name, layers, page, layout, args, generator))
            torch.cuda.empty_cache()


def _one_block_row(
    name: str, layers: int, page: int, layout: str, args: argparse.Namespace,
    generator: torch.Generator,
) -> dict[str, Any]:  # fmt: skip
    block_bytes = layers * page
    cache_blocks = args.one_block_cache_blocks or max(64, (1 << 30) // block_bytes)
    seg = _segment(layers, page, layout, cache_blocks, "cuda")
    block = int(torch.randint(seg.num_blocks, (1,), generator=generator))
    table = torch.empty(1, block_bytes, dtype=torch.uint8, pin_memory=True).random_(0, 256)
    flat = torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True).random_(0, 256)
    dev = torch.empty(block_bytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    segs, ids = [seg], [block]
    fns: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "copy": (lambda: flat.copy_(dev, non_blocking=True),
                 lambda: dev.copy_(flat, non_blocking=True)),
        "call": (lambda: gather_blocks(segs, ids, table),
                 lambda: scatter_blocks(segs, ids, table)),
    }  # fmt: skip
    samples: dict[str, list[float]] = {f"{v}/{op}": [] for v in fns for op in ("g", "s")}
    for round_ in range(args.one_block_rounds + 5):
        for variant, pair in fns.items():
            for op, fn in zip(("g", "s"), pair, strict=True):
                seconds = _event_seconds(fn)
                if round_ >= 5:  # warm-up rounds
                    samples[f"{variant}/{op}"].append(seconds)
    median = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    row: dict[str, Any] = {"geometry": name, "bytes": block_bytes, "layout": layout,
                           "cache_blocks": cache_blocks, "median_us": median}  # fmt: skip
    for variant in fns:
        if variant != "copy":
            row[f"{variant}_over_copy"] = {
                "gather": median[f"{variant}/g"] / median["copy/g"],
                "scatter": median[f"{variant}/s"] / median["copy/s"],
            }

    row["verified"] = _one_block_verified(seg, block, table)
    active = _ops()  # which way the public 1-block call went: past the dispatcher or the op
    plan = active._plan(segs) if isinstance(active, _CompiledOps) else None
    row["path"] = "ctypes" if getattr(plan, "one_block", None) else "op"

    def pinned_query() -> None:
        table.is_pinned()

    row["host_us"] = {
        "copy_gather": _host_us(fns["copy"][0]),
        "call_gather": _host_us(fns["call"][0]),
        "call_scatter": _host_us(fns["call"][1]),
        "is_pinned": _host_us(pinned_query),
    }
    return row


def _one_block_verified(seg: KVSegment, block: int, table: torch.Tensor) -> bool:
    """Whether the public calls moved exactly the block's bytes, both ways (fresh data)."""
    view = seg.blocks_view()
    table.random_(0, 256)
    gather_blocks([seg], [block], table)
    torch.cuda.synchronize()
    gathered = torch.equal(table[0], view[block].reshape(-1).cpu())
    table.random_(0, 256)
    scatter_blocks([seg], [block], table)
    torch.cuda.synchronize()
    return gathered and torch.equal(view[block].reshape(-1).cpu(), table[0])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every variant for every batch size; returns the JSON document."""
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    devices = load_compiled_ops()
    seg = _cache(args, device)
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "compiled_devices": sorted(devices),
        "geometry": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
            "dtype": "bf16",
            "layer_page_bytes": seg.page_size,
            "block_page_bytes": seg.page_bytes,
            "cache_blocks": args.cache_blocks,
            "layout": "layer-outermost (FlashAttention LBNHC)",
        },
        "geometries": {},
        "results": [],
        "ceilings": {},
    }
    variants = _variants(seg, device, devices)
    generator = torch.Generator().manual_seed(0)
    if device == "cuda" and "cuda" in devices and args.one_block_rounds:
        _one_block(doc, args, generator)
    if args.only_one_block:
        return doc
    for n in args.blocks:
        nbytes = n * seg.page_bytes
        blocks = torch.randperm(args.cache_blocks, generator=generator)[:n].tolist()
        ids = torch.tensor(blocks)
        host = torch.empty(n, seg.page_bytes, dtype=torch.uint8, pin_memory=device == "cuda")
        host.random_(0, 256)
        table_dev = torch.empty(n, seg.page_bytes, dtype=torch.uint8, device=device)
        base_repeat = args.repeat * 5 if n == 1 else args.repeat
        doc["ceilings"][str(n)] = _ceilings(nbytes, device, base_repeat)
        for name, (gather, scatter, on_device) in variants.items():
            table = table_dev if on_device else host
            repeat = max(2, base_repeat // 5) if name == "loop" else base_repeat
            for op, fn in (("gather", gather), ("scatter", scatter)):
                seconds = _timer(
                    device,
                    lambda fn=fn, table=table, ids=ids, blocks=blocks: fn(ids, blocks, table),
                    repeat,
                )
                doc["results"].append(
                    {"geometry": "llama8b-bf16-LBNHC", "op": op, "blocks": n, "variant": name,
                     "bytes": nbytes, "median_ms": seconds * 1e3, "gbps": nbytes / seconds / GB,
                     "ceiling": str(n)}
                )  # fmt: skip
    if device == "cuda" and "cuda" in devices:
        for name in args.geometries:
            _run_geometry(doc, name, args, devices, generator)
    if args.roundtrip_blocks and device in devices:
        with tempfile.TemporaryDirectory(prefix="bench-staging-", dir=args.storage_dir) as tmp:
            doc["roundtrip"] = _roundtrip(seg, args.roundtrip_blocks, device, Path(tmp))
    return doc


def _run_geometry(
    doc: dict[str, Any],
    name: str,
    args: argparse.Namespace,
    devices: frozenset[str],
    generator: torch.Generator,
) -> None:
    """The default path (zero_copy) on one of `GEOMETRIES`, with its ceilings."""
    import os

    layers, page, layout, what = GEOMETRIES[name]
    block_bytes = layers * page
    cache_blocks = max(max(args.blocks), (4 << 30) // block_bytes)
    seg = _segment(layers, page, layout, cache_blocks, "cuda")
    doc["geometries"][name] = {
        "layers": layers, "layer_page_bytes": page, "block_page_bytes": block_bytes,
        "layout": layout, "cache_blocks": cache_blocks, "what": what,
    }  # fmt: skip
    chunks = [None, *args.chunk_sweep]
    for n in args.blocks:
        nbytes = n * block_bytes
        blocks = torch.randperm(cache_blocks, generator=generator)[:n].tolist()
        ids = torch.tensor(blocks)
        host = torch.empty(n, block_bytes, dtype=torch.uint8, pin_memory=True).random_(0, 256)
        key = f"{name}/{n}"
        repeat = args.repeat * 5 if n == 1 else args.repeat
        doc["ceilings"][key] = _ceilings(nbytes, "cuda", repeat)
        for chunk in chunks if n > 1 else [None]:
            if chunk is not None:
                os.environ["HF3FSCTL_STAGING_CHUNK_BYTES"] = str(chunk)
            ops = _CompiledOps(devices, "zero_copy")
            for op in ("gather", "scatter"):
                fn = ops.gather if op == "gather" else ops.scatter
                seconds = _timer(
                    "cuda", lambda fn=fn, ids=ids, host=host: fn([seg], ids, host), repeat
                )
                doc["results"].append(
                    {"geometry": name, "op": op, "blocks": n, "bytes": nbytes,
                     "variant": "zero_copy" if chunk is None else f"zero_copy@{chunk >> 10}K",
                     "median_ms": seconds * 1e3, "gbps": nbytes / seconds / GB, "ceiling": key}
                )  # fmt: skip
            os.environ.pop("HF3FSCTL_STAGING_CHUNK_BYTES", None)


def _print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"staging on {doc['device']} (GB/s, one direction)")
    columns = ("geometry", "op", "blocks", "MiB", "variant", "ms", "GB/s", "of PCIe",
               "time / copy", "of D2D")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for r in doc["results"]:
        ceiling = doc["ceilings"][r["ceiling"]]
        pcie = ceiling.get("pcie_d2h" if r["op"] == "gather" else "pcie_h2d")
        table.add_row(
            r["geometry"], r["op"], str(r["blocks"]), f"{r['bytes'] / 2**20:.1f}", r["variant"],
            f"{r['median_ms']:.3f}", f"{r['gbps']:.1f}",
            f"{r['gbps'] / pcie:.0%}" if pcie else "-",
            f"{pcie / r['gbps']:.2f}x" if pcie else "-",
            f"{r['gbps'] / ceiling['d2d_copy']:.0%}",
        )  # fmt: skip
    console = Console(stderr=True, width=170)
    console.print(table)
    if doc.get("one_block"):
        one = Table(title="one block: public call (list of ids) / pinned copy, same run")
        for column in ("geometry", "KiB", "copy µs g/s", "call µs g/s", "call/copy g/s",
                       "host µs copy/call"):  # fmt: skip
            one.add_column(column, justify="right")
        for r in doc["one_block"]:
            m, h = r["median_us"], r["host_us"]
            one.add_row(
                r["geometry"], f"{r['bytes'] / 1024:.0f}",
                f"{m['copy/g']:.1f} / {m['copy/s']:.1f}", f"{m['call/g']:.1f} / {m['call/s']:.1f}",
                f"{r['call_over_copy']['gather']:.2f} / {r['call_over_copy']['scatter']:.2f}",
                f"{h['copy_gather']:.1f} / {h['call_gather']:.1f}",
            )  # fmt: skip
        console.print(one)
    console.print({"ceilings_gbps": doc["ceilings"], "roundtrip": doc.get("roundtrip")})


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the table (and the JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, nargs="+", default=None, help="batch sizes")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--roundtrip-blocks", type=int, default=None)
    parser.add_argument("--storage-dir", default=None, help="where the round trip's file goes")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument(
        "--geometries", nargs="*", choices=sorted(GEOMETRIES), default=None,
        help="other KV byte layouts to time with the default path (GPU; default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-sweep", type=int, nargs="*", default=[],
        help="also time these kernel chunk sizes (bytes per thread block) on --geometries",
    )  # fmt: skip
    parser.add_argument(
        "--one-block-rounds", type=int, default=300,
        help="interleaved samples per variant of the one-block comparison (GPU; 0: skip it)",
    )  # fmt: skip
    parser.add_argument(
        "--only-one-block", action="store_true", help="the one-block comparison alone"
    )
    parser.add_argument(
        "--one-block-cache-blocks", type=int, default=None,
        help="blocks per layer of the one-block caches (default ~1 GiB of them; the layer "
        "stride is this times the page, a power of two by default)",
    )  # fmt: skip
    parser.add_argument(
        "--side-stream", action="store_true",
        help="run the one-block comparison on a side stream (as the connector does)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and args.device != "cpu"
    if args.blocks is None:
        args.blocks = [1, 64, 512] if gpu else [16]
    if args.geometries is None:
        args.geometries = sorted(GEOMETRIES) if gpu else []
    if args.cache_blocks is None:
        args.cache_blocks = 2048 if gpu else 64
    if args.roundtrip_blocks is None:
        args.roundtrip_blocks = 256 if gpu else 8
    if not gpu and args.layers == 32:
        args.layers, args.repeat = 8, min(args.repeat, 5)
    doc = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=2))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_table(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
