"""`run(settings)`: every configuration, then one JSON document with ratios to its ceilings.

Contract: each figure also appears as a ratio to its ceiling from the same run (TTFT to
`floor`, throughput to `none`); the run's stores are removed afterwards unless `keep`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.bench.e2e.admission import admission_document
from hf3fsctl.bench.e2e.document import build_document
from hf3fsctl.bench.e2e.engines import (
    auto_kv_cache_bytes,
    auto_max_model_len,
    model_shape,
    resolve_model,
)
from hf3fsctl.bench.e2e.offline import OfflineRuns
from hf3fsctl.bench.e2e.settings import (
    LABELS,
    TOKEN_ID_LIMIT,
    E2ESettings,
    default_work_dir,
    validate,
)
from hf3fsctl.bench.e2e.url import run_url


def run(settings: E2ESettings, progress: report.Progress | None = None) -> dict[str, Any]:
    """Run the benchmark; return its JSON document (settings, figures, ratios, notes).

    Raises:
        InvalidRequest: a bad setting, or a non-loopback `url`.
        Hf3fsctlError: the no-connector run (or the server's first pass) failed.
    """
    log = progress or (lambda message: None)
    validate(settings)
    if settings.url:
        return run_url(settings, log)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    work = (settings.work_dir or default_work_dir()).expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model(settings, work, log)
    shape = model_shape(model)
    settings = replace(
        settings,
        model=str(model),
        max_model_len=settings.max_model_len or auto_max_model_len(settings),
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes
        or auto_kv_cache_bytes(settings, shape.get("kv_elements_per_token") or 64 * 1024),
    )
    runner = OfflineRuns(settings, log)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    try:
        for repeat in range(settings.repeats):
            runner.run_repeat(repeat, str(model), shape.get("vocab_size", TOKEN_ID_LIMIT), scratch)
    finally:
        if settings.keep:
            log(f"kept the run's stores under {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    configurations: dict[str, dict[str, Any]] = {}
    for name in runner.names():
        entry: dict[str, Any] = {"label": LABELS[name]}
        if name in runner.failures:  # even when an earlier repeat gave samples
            entry.update({"status": "failed", "error": runner.failures[name]})
        elif name in runner.samples:
            entry.update(runner.samples[name].figures())
        else:
            entry.update({"status": "skipped", "note": runner.skipped.get(name, "not run")})
        configurations[name] = entry
    document = build_document(settings, configurations, runner.notes, runner.engine_info)
    document["engine"]["mode"] = "in-process (lmcache runs: multiprocess)"
    if settings.admission:  # its own workload and section (`admission.py`)
        document["admission"] = admission_document(settings, runner)
    document["seconds"] = time.monotonic() - started
    # Other work on the machine skews every figure: say how busy it was.
    document["machine"]["load_average_1min"] = {"start": load_before, "end": os.getloadavg()[0]}
    if settings.keep:
        document["scratch_dir"] = str(scratch)
    return document
