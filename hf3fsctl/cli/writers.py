"""The writers of namespaces, as `stats`, `ls --writers` and `doctor` show them.

A writer is an engine that committed pages to a namespace, recorded with its numerics
(`Registry.record_writer`; docs/design.md decision 15). Two writers of one namespace
with other numerics (compiled vs eager, another attention backend, another GPU or vLLM)
mean its pages mix KV computed differently: a warning, with the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hf3fsctl.cli import output
from hf3fsctl.errors import Hf3fsctlError

if TYPE_CHECKING:
    from hf3fsctl.meta.models import WriterInfo
    from hf3fsctl.meta.protocol import Registry

Writers = dict[str, list["WriterInfo"]]
# The settings a one-line summary of a writer names (the rest: --json, ls --writers).
SUMMARY = ("compilation_mode", "attention_backend", "dtype", "kv_cache_dtype", "device", "vllm")


def read_writers(client: Registry, namespace: str | None = None) -> Writers:
    """Recorded writers by namespace; none from a service too old to record them."""
    try:
        return client.writers(namespace)
    except Hf3fsctlError:  # e.g. a serve without /v1/writers (404)
        return {}


def differing(writers: list[WriterInfo]) -> list[str]:
    """The settings on which these writers differ."""
    names = sorted({name for w in writers for name in w.numerics})
    return [n for n in names if len({w.numerics.get(n) for w in writers}) > 1]


def writer_warnings(writers: Writers) -> list[str]:
    """One line per namespace with more than one writer, with the fix."""
    lines = []
    for ns, found in sorted(writers.items()):
        if len(found) > 1:
            lines.append(
                f"namespace {ns} has {len(found)} writers with other numerics (they differ in "
                f"{', '.join(differing(found)) or 'their hash'}): its pages mix KV computed "
                "differently, which can change greedy tokens; run the serving engines' args "
                "everywhere (config vllm:), check with `hf3fsctl verify`, or set "
                "connector.strict_numerics: true"
            )
    return lines


def summary(writer: WriterInfo) -> str:
    """`id: compilation_mode=…, dtype=…, …` (the settings most likely to differ)."""
    shown = ", ".join(f"{k}={writer.numerics[k]}" for k in SUMMARY if k in writer.numerics)
    return f"{writer.id}: {shown}"


def writers_json(writers: Writers) -> dict[str, list[dict[str, Any]]]:
    return {ns: [w.model_dump() for w in found] for ns, found in writers.items()}


def show_writers(writers: Writers) -> None:
    """The writers table (`ls --writers`): one row per (namespace, writer)."""
    import time

    now = time.time()
    rows = [
        [ns, w.id, f"{output.format_age(now - w.first_seen)} ago", summary(w).split(": ", 1)[1]]
        for ns, found in sorted(writers.items())
        for w in found
    ]
    output.show(output.table(["namespace", "writer", "first seen", "numerics"], rows))
    for line in writer_warnings(writers):
        output.warning(line)
