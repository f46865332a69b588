"""`hf3fsctl pin` / `hf3fsctl unpin`: keep a namespace's keys out of LRU eviction.

Keys come from `--key` (repeatable), `--prompt TEXT` (repeatable) and `--prompts FILE`
(one prompt per line, blank lines skipped). A prompt is tokenized with the namespace's
model tokenizer as vLLM's `LLM.generate` tokenizes a text prompt, and its full blocks'
keys are recomputed offline (`hf3fsctl.prompt_keys`); transformers is imported only
then. A key may be pinned before it is stored (pin, then `warm`). `--ttl` makes pins
expire; pins count their keys' full size against `storage.max_pinned` and a pin past
it is refused. `unpin` drops the given keys' pins, or with `--all` every pin of the
namespace. Admin `evict` leaves pinned keys alone unless `--include-pinned`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt, JsonOpt, parse_duration
from hf3fsctl.errors import InvalidRequest

if TYPE_CHECKING:
    from hf3fsctl.meta.models import PinResult
    from hf3fsctl.meta.protocol import MetadataClient

NamespaceArg = Annotated[
    str,
    typer.Argument(metavar="NAMESPACE", help="Namespace id or unique prefix (`hf3fsctl stats`)."),
]
KeyOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--key",
        "-k",
        metavar="KEY",
        help="A block key: whole (hex, as `ls --json` prints it) or shortened as `ls` shows "
        "it (a unique prefix of a stored key); repeatable.",
    ),
]
PromptOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--prompt",
        "-p",
        metavar="TEXT",
        help="A prompt; its full blocks' keys (model tokenizer); repeatable.",
    ),
]
PromptsOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts",
        metavar="FILE",
        help="A file of prompts, one per line (blank lines skipped).",
        show_default=False,
    ),
]


def resolve(client: MetadataClient, namespace: str) -> str:
    """The namespace id of a NAMESPACE argument (id or unique prefix)."""
    ns = context.resolve_namespace(client, namespace)
    if ns is None:  # only for a missing value, which Typer already refuses
        raise InvalidRequest("a namespace is required", hint="`hf3fsctl stats` lists them")
    return ns


def read_prompts(path: Path) -> list[str]:
    """The prompts of a file, one per line, blank lines skipped.

    Raises:
        InvalidRequest: the file cannot be read.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequest(f"cannot read prompts file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"prompts file {str(path)!r} is not UTF-8: {exc.reason}") from None
    return [line for line in text.splitlines() if line.strip()]


SCAN_ENTRIES = 200_000  # entries searched for the keys a shortened `--key` may mean
SCAN_PINS = 1000  # newest pins searched (a listing's default; a server allows max_batch)
_WINDOW = 500


def resolve_key_prefixes(
    client: MetadataClient, namespace: str, prefixes: list[str]
) -> dict[str, str]:
    """The whole key each shortened key (`hf3fsctl ls` shows 16 digits) stands for: the
    one stored or pinned key of the namespace that starts with it.

    Raises:
        InvalidRequest: a prefix matches no key (a key not stored yet is pinned whole)
            or several.
    """
    found: dict[str, set[str]] = {prefix: set() for prefix in prefixes}

    def match(keys: list[str]) -> None:
        for key in keys:
            for prefix, hits in found.items():
                if key.startswith(prefix):
                    hits.add(key)

    match([pin.key for pin in client.list_pins(namespace, limit=SCAN_PINS)])
    for offset in range(0, SCAN_ENTRIES, _WINDOW):
        batch = client.list_entries(namespace, limit=_WINDOW, offset=offset)
        match([entry.key for entry in batch])
        if len(batch) < _WINDOW:
            break
    resolved = {}
    for prefix, hits in found.items():
        if len(hits) != 1:
            what = "no stored or pinned key" if not hits else f"{len(hits)} keys"
            raise InvalidRequest(
                f"block key {prefix!r} is shortened and {what} of {namespace} starts with it",
                hint="pass the whole key (`hf3fsctl ls --json` prints whole keys); a key not "
                "stored yet can only be pinned whole",
            )
        resolved[prefix] = hits.pop()
    return resolved


def gather_keys(
    client: MetadataClient,
    namespace: str,
    keys: list[str] | None,
    prompts: list[str] | None,
    prompts_file: Path | None,
) -> tuple[list[str], list[dict[str, Any]]]:
    """The keys to (un)pin, in order without repeats, and one summary per prompt.

    A `--key` is the whole key, as long as the namespace's hash makes them (64 hex digits
    for sha256), or a shortened one as `hf3fsctl ls` shows it, which must match exactly
    one stored or pinned key.

    Raises:
        InvalidRequest: a malformed key, a shortened one that matches no key or several,
            an unreadable prompts file, or a tokenizer that cannot be loaded.
    """
    from hf3fsctl.keys import key_digits, parse_key_argument

    manifest = client.get_namespace(namespace).manifest
    digits = key_digits(manifest.get("hash_algorithm"))
    parsed = [parse_key_argument(key, digits) for key in keys or []]
    shortened = [key for key, whole in parsed if not whole]
    whole_of = resolve_key_prefixes(client, namespace, shortened) if shortened else {}
    wanted = [key if whole else whole_of[key] for key, whole in parsed]
    texts = list(prompts or []) + (read_prompts(prompts_file) if prompts_file else [])
    summaries: list[dict[str, Any]] = []
    if texts:
        from hf3fsctl.prompt_keys import load_tokenizer, prompt_block_keys, tokenize

        model = manifest.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest(f"namespace {namespace} records no model to tokenize with")
        revision = manifest.get("revision")
        output.info(f"loading the tokenizer of {model}")
        tokenizer = load_tokenizer(model, revision if isinstance(revision, str) else None)
        for text in texts:
            tokens = tokenize(tokenizer, text)
            prompt_keys = prompt_block_keys(manifest, tokens)
            summaries.append({"tokens": len(tokens), "keys": len(prompt_keys)})
            wanted += prompt_keys
    return list(dict.fromkeys(wanted)), summaries


def show_pinned(namespace: str, result: PinResult, ttl: float | None) -> None:
    """What `pin` did, for people."""
    from hf3fsctl.config import format_size

    cap = "unbounded" if result.max_pinned_bytes is None else format_size(result.max_pinned_bytes)
    output.show(
        output.key_values(
            {
                "namespace": namespace,
                "pinned": f"{result.pinned} keys ({result.stored} stored now)",
                "expires": "never (until unpinned)"
                if ttl is None
                else f"in {output.format_age(ttl)} ({ttl:g}s)",
                "store pins": f"{format_size(result.pinned_bytes)} of {cap}"
                + (
                    f" ({output.format_ratio(result.pinned_bytes, result.max_pinned_bytes)})"
                    if result.max_pinned_bytes
                    else ""
                ),
            },
            title="pinned",
        )
    )


def pin(
    ctx: typer.Context,
    namespace: NamespaceArg,
    config: ConfigOpt = None,
    key: KeyOpt = None,
    prompt: PromptOpt = None,
    prompts: PromptsOpt = None,
    ttl: Annotated[
        float | None,
        typer.Option(
            "--ttl",
            parser=parse_duration,
            metavar="DURATION",
            help="Pins expire after this (90s, 30m, 2h, 7d); default: until unpinned.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Keep keys (or prompts' blocks) out of eviction, within storage.max_pinned."""
    if not key and not prompt and prompts is None:
        raise InvalidRequest(
            "pin needs keys", hint="pass --key KEY, --prompt TEXT or --prompts FILE"
        )
    cfg = context.load(ctx, config)
    with context.open_client(cfg) as client:
        ns = resolve(client, namespace)
        keys, summaries = gather_keys(client, ns, key, prompt, prompts)
        if not keys:
            raise InvalidRequest(
                "nothing to pin: the prompts are shorter than one block",
                hint="only full blocks have keys; see the namespace's block size in "
                "`hf3fsctl stats`",
            )
        result = client.pin(ns, keys, ttl_s=ttl)
    if json:
        output.print_json(
            {
                "namespace": ns,
                "ttl_s": ttl,
                **result.model_dump(),
                "keys": keys,
                "prompts": summaries,
            }
        )
        return
    show_pinned(ns, result, ttl)
    if summaries:
        rows = [[i + 1, s["tokens"], s["keys"]] for i, s in enumerate(summaries)]
        output.show(
            output.table(["prompt", "tokens", "keys"], rows, right=("prompt", "tokens", "keys"))
        )


def unpin(
    ctx: typer.Context,
    namespace: NamespaceArg,
    config: ConfigOpt = None,
    key: KeyOpt = None,
    prompt: PromptOpt = None,
    prompts: PromptsOpt = None,
    everything: Annotated[
        bool, typer.Option("--all", help="Drop every pin of the namespace.")
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Drop pins of keys (or prompts' blocks), or with --all every pin of the namespace."""
    given = bool(key or prompt or prompts is not None)
    if not given and not everything:
        raise InvalidRequest(
            "unpin needs keys, or --all",
            hint="pass --key KEY, --prompt TEXT or --prompts FILE, or --all to drop "
            "every pin of the namespace",
        )
    if given and everything:
        raise InvalidRequest(
            "unpin takes keys or --all, not both",
            hint="drop --all to unpin only the given keys",
        )
    cfg = context.load(ctx, config)
    with context.open_client(cfg) as client:
        ns = resolve(client, namespace)
        keys: list[str] | None = None
        if given:
            keys, _ = gather_keys(client, ns, key, prompt, prompts)
        dropped = client.unpin(ns, keys) if keys is None or keys else 0
    if json:
        output.print_json({"namespace": ns, "unpinned": dropped})
        return
    output.line(f"unpinned {dropped} keys of {ns}", style="bold")
