"""What `lookup` and `warm` share: read the prompt set, load the tokenizer, report problems,
and show the candidates when the model fits several namespaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf3fsctl.cli import output
from hf3fsctl.errors import InvalidRequest

if TYPE_CHECKING:
    from hf3fsctl.offline.namespaces import AmbiguousNamespace
    from hf3fsctl.offline.prompts import Problem, Prompt


def read_prompt_set(
    prompts: str | None, texts: list[str] | None, format: str
) -> tuple[list[Prompt], list[Problem]]:
    """Prompts from `--prompt` flags and/or `--prompts`; problems reported on stderr."""
    from hf3fsctl.offline.prompts import Prompt, read_prompts

    items = [Prompt(f"--prompt {i + 1}", text=text) for i, text in enumerate(texts or [])]
    problems: list[Problem] = []
    if prompts is not None:
        read, problems = read_prompts(prompts, format=format)
        items.extend(read)
    if not items and not problems:
        raise InvalidRequest("no prompts", hint="give --prompt TEXT or --prompts FILE")
    for problem in problems:
        output.warning(f"{problem.origin}: {problem.reason} (skipped)")
    return items, problems


def show_candidates(error: AmbiguousNamespace) -> None:
    """The namespaces a model fits, on stderr, so the operator can pick one."""
    rows = [
        [
            info.id,
            str(info.manifest.get("model")),
            str(info.manifest.get("kv_dtype")),
            str(info.manifest.get("block_size")),
            str(info.manifest.get("tp_size")),
            str(info.manifest.get("layout")),
            str(info.manifest.get("backend")),
        ]
        for info in error.candidates
    ]
    columns = ["namespace", "model", "dtype", "block", "TP", "layout", "backend"]
    output.stderr.print(output.table(columns, rows, title="candidate namespaces"))
