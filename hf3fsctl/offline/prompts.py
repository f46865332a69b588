"""Prompt sets for `hf3fsctl warm` and `lookup`: read them, and tokenize as vLLM does.

Inputs (`read_prompts`):

- a text file: one prompt per line (blank lines skipped);
- a JSONL file (`.jsonl`): one object per line, `{"prompt": "…"}` or
  `{"messages": [{"role": …, "content": …}, …]}` (rendered with the model's chat
  template);
- a directory: every `.txt` / `.md` file in it (sorted by name), one prompt each;
- `-`: a text (or, with `--format jsonl`, JSONL) stream on stdin.

A malformed line (bad JSON, neither `prompt` nor `messages`, a message without a string
`content`) is reported as a `Problem` with its file and line, never raised.

Tokenization (`token_ids`) matches vLLM's front ends so the keys computed offline are the
keys the engine will compute: a plain prompt is tokenized with special tokens (vLLM's
completion path, `hf3fsctl.prompt_keys.tokenize`); a chat is rendered with the
tokenizer's chat template (`add_generation_prompt=True`, as vLLM's chat API does by
default) and the rendered text tokenized *without* adding special tokens (the template
carries them; vLLM's `default_chat_tok_params`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf3fsctl.errors import InvalidRequest

DOCUMENT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a set, and where it came from."""

    origin: str  # "FILE:LINE" or a document's path
    text: str | None = None  # a plain prompt
    messages: tuple[dict[str, Any], ...] | None = None  # a chat (role/content dicts)


@dataclass(frozen=True)
class Problem:
    """An input that could not be read as a prompt."""

    origin: str
    reason: str


def _from_json_line(origin: str, line: str) -> Prompt | Problem:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        return Problem(origin, f"not JSON: {exc.msg}")
    if not isinstance(data, dict):
        return Problem(origin, "a JSONL line must be an object with 'prompt' or 'messages'")
    if isinstance(data.get("prompt"), str):
        return Prompt(origin, text=data["prompt"])
    messages = data.get("messages")
    if isinstance(messages, list) and messages:
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return Problem(origin, "every message needs a string 'role'")
            if not isinstance(message.get("content"), str):
                return Problem(origin, "every message needs a string 'content'")
        return Prompt(origin, messages=tuple(dict(m) for m in messages))
    return Problem(origin, "expected a string 'prompt' or a non-empty list 'messages'")


def _lines(name: str, lines: Iterable[str], jsonl: bool) -> Iterator[Prompt | Problem]:
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        origin = f"{name}:{number}"
        yield _from_json_line(origin, line) if jsonl else Prompt(origin, text=line)


def read_prompts(source: str, *, format: str = "auto") -> tuple[list[Prompt], list[Problem]]:
    """Read a prompt set.

    Args:
        source: a file, a directory, or `-` for stdin.
        format: `auto` (JSONL for `.jsonl` files, documents for directories, else text
            lines), `text`, `jsonl`.

    Raises:
        InvalidRequest: the source does not exist or cannot be read.
    """
    if format not in ("auto", "text", "jsonl"):
        raise InvalidRequest(f"--format {format!r} is not one of auto, text, jsonl")
    items: list[Prompt | Problem]
    if source == "-":
        items = list(_lines("<stdin>", sys.stdin, format == "jsonl"))
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            documents = sorted(
                p for p in path.iterdir() if p.is_file() and p.suffix.lower() in DOCUMENT_SUFFIXES
            )
            items = []
            for document in documents:
                try:
                    text = document.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    items.append(Problem(str(document), f"unreadable: {exc}"))
                    continue
                if text.strip():
                    items.append(Prompt(str(document), text=text))
                else:
                    items.append(Problem(str(document), "empty document"))
        elif path.is_file():
            jsonl = format == "jsonl" or (format == "auto" and path.suffix.lower() == ".jsonl")
            try:
                with path.open(encoding="utf-8") as handle:
                    items = list(_lines(str(path), handle, jsonl))
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidRequest(f"cannot read prompts from {source!r}: {exc}") from None
        else:
            raise InvalidRequest(
                f"prompts {source!r} is neither a file nor a directory",
                hint="give a text file (one prompt per line), a .jsonl file, a directory "
                "of .txt/.md documents, or - for stdin",
            )
    prompts = [item for item in items if isinstance(item, Prompt)]
    problems = [item for item in items if isinstance(item, Problem)]
    return prompts, problems


def token_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The token ids vLLM computes for `prompt` (completion or chat front end).

    Raises:
        InvalidRequest: a chat prompt and a tokenizer without a chat template.
    """
    from hf3fsctl.prompt_keys import tokenize

    if prompt.text is not None:
        return tokenize(tokenizer, prompt.text)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            f"{prompt.origin}: a chat prompt, but the model's tokenizer has no chat template",
            hint="give plain {'prompt': …} lines for this model",
        )
    text = tokenizer.apply_chat_template(
        list(prompt.messages or ()), tokenize=False, add_generation_prompt=True
    )
    encoding = tokenizer(text, add_special_tokens=False)
    return [int(token) for token in encoding["input_ids"]]
