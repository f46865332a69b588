"""`hf3fsctl ls`: list stored entries, most recently used first; or, with `--pins`, pins.

Keys are shown shortened (`shown_key`: 16 hex digits and "…"), which `pin`/`unpin
--key` accept as a unique prefix; `--json` prints them whole.
One row per (key, rank) entry: namespace, key prefix, rank, page, size, state
(committed/pending), depth, hits, the age of the last access and whether the key is
pinned (and, when some entry was committed with a retention, the time left before it
expires: `expires in`, `expired`). `--pins` lists live pins instead, newest first: namespace, key, when pinned,
when the pin expires and whether the key is stored now. `--writers` lists the engines
that wrote to each namespace (their numerics; a warning where a namespace has more than
one: `cli/writers.py`). `--json` prints the entries (or pins, or writers) in full
(whole keys, checksums, timestamps).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt, JsonOpt, NamespaceOpt
from hf3fsctl.keys import shown_key

if TYPE_CHECKING:
    from hf3fsctl.meta.models import PinInfo


def show_pins(pins: list[PinInfo], limit: int) -> None:
    """The pins table, for people."""
    now = time.time()
    rows = [
        [
            pin.namespace,
            shown_key(pin.key),
            f"{output.format_age(now - pin.created)} ago",
            "never" if pin.expires is None else f"in {output.format_age(pin.expires - now)}",
            "yes" if pin.stored else "no",
        ]
        for pin in pins
    ]
    output.show(output.table(["namespace", "key", "pinned", "expires", "stored"], rows))
    if len(pins) == limit:
        output.info(f"showing the first {limit}; pass --limit for more")


def expiry_cell(expires_at: float | None, now: float) -> str:
    """When an entry expires, for people: `-` never, `expired`, or the time left."""
    if expires_at is None:
        return "-"
    return "expired" if expires_at <= now else output.format_age(expires_at - now)


def ls(
    ctx: typer.Context,
    config: ConfigOpt = None,
    namespace: NamespaceOpt = None,
    limit: Annotated[
        int, typer.Option("--limit", min=1, help="Show at most N entries (or pins).")
    ] = 50,
    pins: Annotated[
        bool, typer.Option("--pins", help="List pins (key, expiry, stored) instead of entries.")
    ] = False,
    writers: Annotated[
        bool,
        typer.Option(
            "--writers", help="List the engines that wrote to each namespace (their numerics)."
        ),
    ] = False,
    json: JsonOpt = False,
) -> None:
    """List entries: key, rank, page, size, state, hits, last access, pinned (or --pins)."""
    from hf3fsctl.config import format_size

    cfg = context.load(ctx, config)
    with context.open_client(cfg, read_only=True) as client:
        ns = context.resolve_namespace(client, namespace)
        if writers:
            from hf3fsctl.cli.writers import read_writers, show_writers, writers_json

            found = read_writers(client, ns)
            if json:
                output.print_json({"writers": writers_json(found)})
            else:
                show_writers(found)
            return
        if pins:
            pin_list = client.list_pins(ns, limit=limit)
        else:
            entries = client.list_entries(ns, limit=limit)
            from hf3fsctl.cli.stats import door

            doors = {info.id: door(info.manifest) for info in client.namespaces()}
    if pins:
        if json:
            output.print_json({"pins": [pin.model_dump() for pin in pin_list]})
        else:
            show_pins(pin_list, limit)
        return
    if json:
        output.print_json({"entries": [entry.model_dump() for entry in entries]})
        return
    now = time.time()
    # A door column only when vLLM's offloading stack (`door: offload-tier`) wrote some.
    two_doors = any(doors.get(entry.namespace, "connector") != "connector" for entry in entries)
    # An expiry column only when some entry was committed with a retention (issue 22).
    expiring = any(entry.expires_at is not None for entry in entries)
    rows = [
        [
            entry.namespace,
            *([doors.get(entry.namespace, "-")] if two_doors else []),
            shown_key(entry.key),
            entry.rank,
            entry.page,
            format_size(entry.size),
            entry.state,
            entry.depth,
            entry.hits,
            output.format_age(now - entry.last_access),
            "yes" if entry.pinned else "-",
            *([expiry_cell(entry.expires_at, now)] if expiring else []),
        ]
        for entry in entries
    ]
    output.show(
        output.table(
            [
                "namespace",
                *(["door"] if two_doors else []),
                "key",
                "rank",
                "page",
                "size",
                "state",
                "depth",
                "hits",
                "last use",
                "pinned",
                *(["expires in"] if expiring else []),
            ],
            rows,
            right=("rank", "page", "size", "depth", "hits", "last use", "expires in"),
        )
    )
    if len(entries) == limit:
        output.info(f"showing the first {limit}; pass --limit for more")
