"""`--url`: the workload twice against a running OpenAI-compatible vLLM server on loopback.

Contract: streamed `/v1/completions` through httpx; `server` then `server-repeat`, whose
prompts hit the server's own prefix cache (its floor); the URL must be loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hf3fsctl.bench.e2e.document import build_document
from hf3fsctl.bench.e2e.samples import Samples, percentile
from hf3fsctl.bench.e2e.settings import (
    LABELS,
    TOKEN_ID_LIMIT,
    E2ESettings,
    prefix_repetition_prompts,
)
from hf3fsctl.bench.loopback import check_loopback_url
from hf3fsctl.errors import Hf3fsctlError


async def _stream_one(
    client: Any, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One streamed completion: TTFT (first chunk with a choice), text and usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise Hf3fsctlError(f"{url}/v1/completions answered {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(chunk["choices"][0].get("text") or "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft if ttft is not None else end,
        "text": "".join(text),
        "prompt_tokens": int(usage.get("prompt_tokens") or len(prompt)),
        "output_tokens": int(usage.get("completion_tokens") or len(text)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


async def _url_passes(
    settings: E2ESettings, url: str, prompts: list[list[int]], log: Callable[[str], None]
) -> tuple[str, list[tuple[list[dict[str, Any]], float]]]:
    import httpx

    remaining = max(1.0, settings.timeout_s)
    timeout = httpx.Timeout(remaining, connect=10.0)
    limits = httpx.Limits(max_connections=max(4, len(prompts)))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        try:
            models = (await client.get(f"{url}/v1/models")).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise Hf3fsctlError(f"no OpenAI-compatible server at {url}: {exc}") from None
        model = settings.model or models["data"][0]["id"]
        log(f"server {url}, model {model}")
        out = settings.workload.output_tokens
        if settings.warmup_tokens:
            rng = random.Random(f"{os.getpid()}-{time.time_ns()}")
            warm = [rng.randrange(3, TOKEN_ID_LIMIT) for _ in range(settings.warmup_tokens)]
            await _stream_one(client, url, model, warm, out)
        passes = []
        for name in ("server", "server-repeat"):
            start = time.perf_counter()
            if settings.sequential:
                results = [await _stream_one(client, url, model, p, out) for p in prompts]
            else:
                results = list(
                    await asyncio.gather(
                        *(_stream_one(client, url, model, p, out) for p in prompts)
                    )
                )
            elapsed = time.perf_counter() - start
            p50 = percentile([r["ttft_s"] for r in results], 50)
            log(f"{name:<13} TTFT p50 {p50:7.3f} s  pass {elapsed:6.2f} s")
            passes.append((results, elapsed))
    return model, passes


def run_url(settings: E2ESettings, log: Callable[[str], None]) -> dict[str, Any]:
    started = time.monotonic()
    url = check_loopback_url(settings.url or "")
    settings = replace(settings, url=url)
    prompts = prefix_repetition_prompts(settings.workload, seed=settings.seed)
    import httpx

    try:
        model, passes = asyncio.run(
            asyncio.wait_for(_url_passes(settings, url, prompts, log), settings.timeout_s)
        )
    except (asyncio.TimeoutError, TimeoutError):
        raise Hf3fsctlError(
            f"the server at {url} did not finish the workload within --timeout "
            f"{settings.timeout_s:.0f} s"
        ) from None
    except httpx.HTTPError as exc:
        raise Hf3fsctlError(f"the server at {url} failed: {type(exc).__name__}: {exc}") from None
    configurations: dict[str, dict[str, Any]] = {}
    for name, (results, elapsed) in zip(("server", "server-repeat"), passes, strict=True):
        sample = Samples()
        ttfts = [r["ttft_s"] for r in results]
        sample.ttft = ttfts
        sample.prompt_tokens = sum(r["prompt_tokens"] for r in results)
        sample.output_tokens = sum(r["output_tokens"] for r in results)
        sample.cached_tokens = sum(r["cached_tokens"] for r in results)
        sample.generate_s = elapsed
        sample.prefill_window_s = sum(ttfts) if settings.sequential else max(ttfts)
        sample.outputs = [r["text"] for r in results]
        figures = sample.figures()
        if not sample.cached_tokens:
            figures["hit_rate"] = None  # the server did not report cached tokens
        figures.pop("engine_start_s")
        configurations[name] = {"label": LABELS[name], **figures}
    notes = [
        "the server's own connector and prefix cache are whatever it was started with; "
        "hit rates need vLLM's --enable-prompt-tokens-details"
    ]
    document = build_document(replace(settings, model=model), configurations, notes, {})
    document["engine"] = {"url": url, "model": model}
    document["seconds"] = time.monotonic() - started
    return document
