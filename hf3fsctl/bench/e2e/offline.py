"""The offline configurations: each a fresh vLLM engine process, repeat after repeat.

Contract: a configuration that fails is recorded (`failures`) and the rest still run,
except `none`, whose failure ends the benchmark; a peer that is not installed here is
`skipped` with why; the whole run stays within `timeout_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf3fsctl.bench.e2e.admission import run_admission
from hf3fsctl.bench.e2e.engines import drop_page_cache, make_store, short_error
from hf3fsctl.bench.e2e.samples import Samples, percentile
from hf3fsctl.bench.e2e.settings import (
    ASYNC_LOAD,
    ENGINE_ENV,
    MIB,
    E2ESettings,
    prefix_repetition_prompts,
)
from hf3fsctl.bench.peers.lmcache import LMCacheServer, lmcache_available
from hf3fsctl.errors import Hf3fsctlError

if TYPE_CHECKING:
    from hf3fsctl.vllm_tools.runner import EngineResult


class OfflineRuns:
    """Runs the configurations of one benchmark, repeat after repeat."""

    def __init__(self, settings: E2ESettings, log: Callable[[str], None]) -> None:
        self.s = settings
        self.log = log
        self.deadline = time.monotonic() + settings.timeout_s
        self.samples: dict[str, Samples] = {}
        self.failures: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.notes: list[str] = []
        self.engine_info: dict[str, Any] = {}
        # `--admission`: what each admission run's store held after it (`admission.py`).
        self.admission_stores: dict[str, dict[str, int] | None] = {}

    def names(self) -> list[str]:
        names = ["none", "floor", "cold", "warm"]
        if self.s.drop_page_cache:
            names.append("warm-dropped")
        if self.s.warm_async:
            names.append("warm-async")
        if "example" in self.s.peers:
            names += ["example-cold", "example-warm"]
        if "lmcache" in self.s.peers:
            names += ["none-mp", "floor-mp", "lmcache-cold", "lmcache-warm"]
        return names

    def engine(
        self,
        names: list[str],
        model: str,
        prompts: list[list[int]],
        kv: dict[str, Any] | None,
        *,
        multiprocess: bool = False,
    ) -> EngineResult | None:
        """One engine process for `names` (two names: two passes); None when it failed."""
        from hf3fsctl.vllm_tools.runner import EngineRun, EngineRunError, run_engine

        s = self.s
        remaining = self.deadline - time.monotonic()
        if remaining < 15:
            for name in names:
                self.skipped.setdefault(name, "skipped: the --timeout budget was spent")
            self.log(f"{'+'.join(names)}: skipped (the --timeout budget is spent)")
            return None
        if any(name in self.failures for name in names):
            self.log(f"{'+'.join(names)}: skipped (failed in an earlier repeat)")
            return None
        env = dict(ENGINE_ENV)
        if multiprocess:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        run = EngineRun(
            model=model,
            prompts=prompts,
            max_tokens=s.workload.output_tokens,
            block_size=s.block_size,
            kv_transfer_config=kv,
            kv_cache_memory_bytes=s.kv_cache_memory_bytes or 0,
            max_model_len=s.max_model_len or 0,
            batch=not s.sequential,
            max_num_batched_tokens=s.max_num_batched_tokens,
            warmup_tokens=s.warmup_tokens,
            dtype=s.dtype,
            env=env,
            timeout_s=remaining,
            passes=len(names),
        )
        try:
            result = run_engine(run)
        except EngineRunError as exc:
            short = short_error(str(exc))
            for name in names:
                self.failures[name] = short
            self.log(f"{'+'.join(names)}: FAILED\n{short}")
            return None
        self.engine_info = self.engine_info or result.engine_info
        passes = result.pass_results or []
        for name, one in zip(names, passes, strict=False):
            sample = self.samples.setdefault(name, Samples())
            sample.add_pass(one.requests, one.generate_s, sequential=s.sequential)
            sample.engine_start_s += result.engine_start_s
            sample.process_s += result.wall_s
            p50 = percentile([r.ttft_s for r in one.requests], 50)
            cached = sum(r.num_cached_tokens for r in one.requests)
            total = sum(r.prompt_tokens for r in one.requests)
            self.log(
                f"{name:<13} TTFT p50 {p50:7.3f} s  generate {one.generate_s:6.2f} s  "
                f"cached {cached}/{total} tokens  process {result.wall_s:5.1f} s"
            )
        if kv is not None and kv.get("kv_connector") == "Hf3fsctlConnector":
            self.samples[names[-1]].add_connector(result.connector)
        return result

    def run_repeat(self, repeat: int, model: str, vocab: int, scratch: Path) -> None:
        s = self.s
        names = self.names()
        prompts = prefix_repetition_prompts(s.workload, seed=s.seed + repeat, vocab=vocab)
        tag = f"repeat {repeat + 1}/{s.repeats}: " if s.repeats > 1 else ""
        self.log(f"{tag}{len(prompts)} prompts of {s.workload.prompt_tokens} tokens")
        base = self.engine(["none", "floor"], model, prompts, None)
        if base is None and "none" in self.failures:
            raise Hf3fsctlError(
                f"the no-connector run failed, so nothing can be compared:\n{self.failures['none']}"
            )
        store_dir = scratch / f"ours-{repeat}"
        store = make_store(store_dir)
        kv = store["kv_transfer_config"]
        self.engine(["cold"], model, prompts, kv)
        self.engine(["warm"], model, prompts, kv)
        if "warm-dropped" in names:
            dropped = drop_page_cache(Path(store["storage_path"]))
            self.log(f"dropped {dropped / MIB:.0f} MiB of the store from the page cache")
            self.engine(["warm-dropped"], model, prompts, kv)
        if "warm-async" in names:
            extra = {**kv["kv_connector_extra_config"], **ASYNC_LOAD}
            self.engine(["warm-async"], model, prompts, {**kv, "kv_connector_extra_config": extra})
        if "example-cold" in names:
            from hf3fsctl.vllm_tools.runner import example_kv_config

            example = example_kv_config(scratch / f"example-{repeat}")
            self.engine(["example-cold"], model, prompts, example)
            self.engine(["example-warm"], model, prompts, example)
        if "lmcache-cold" in names:
            self._lmcache(repeat, model, prompts, scratch)
        if s.admission:
            run_admission(self, repeat, model, vocab, scratch)

    def _lmcache(self, repeat: int, model: str, prompts: list[list[int]], scratch: Path) -> None:
        group = ["none-mp", "floor-mp", "lmcache-cold", "lmcache-warm"]
        if not lmcache_available():
            for name in group:
                self.skipped[name] = "skipped: the lmcache package is not importable here"
            if repeat == 0:
                self.notes.append(
                    "--peer lmcache skipped: the `lmcache` package is not importable (it is "
                    "never a dependency; install it into a separate --target directory as "
                    "docs/vllm.md says and put that directory on PYTHONPATH)"
                )
            return
        self.engine(["none-mp", "floor-mp"], model, prompts, None, multiprocess=True)
        server = LMCacheServer(
            scratch / f"lmcache-{repeat}",
            chunk_size=max(256, self.s.block_size),
            log_path=scratch / f"lmcache-{repeat}.log",
        )
        try:
            try:
                server.wait_ready(min(90.0, max(1.0, self.deadline - time.monotonic())))
            except RuntimeError as exc:
                for name in ("lmcache-cold", "lmcache-warm"):
                    self.failures[name] = short_error(str(exc))
                self.log(f"lmcache: server did not start\n{exc}")
                return
            kv = server.kv_config()
            self.engine(["lmcache-cold"], model, prompts, kv, multiprocess=True)
            self.engine(["lmcache-warm"], model, prompts, kv, multiprocess=True)
        finally:
            server.stop()
