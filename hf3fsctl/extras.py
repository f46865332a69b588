"""Which optional extra of hf3fsctl provides a third-party module (pyproject.toml's extras).

A connector-only or CLI-only install has the core dependencies; `hf3fsctl serve` needs
`[server]` (fastapi, uvicorn, prometheus-client) and a `redis://` store `[redis]`
(redis-py with hiredis). Those are imported lazily, where they are needed; when one is
missing, `missing_extra` turns the `ModuleNotFoundError` into a `MissingExtra` naming the
extra to install (the CLI maps it to one line, exit code 2).
"""

from __future__ import annotations

from hf3fsctl.errors import MissingExtra

# Top-level module → the extra that installs it.
EXTRA_OF_MODULE = {
    "fastapi": "server",
    "starlette": "server",
    "uvicorn": "server",
    "prometheus_client": "server",
    "redis": "redis",
    "hiredis": "redis",
}


def missing_extra(error: ModuleNotFoundError) -> MissingExtra | None:
    """The `MissingExtra` behind `error`, or None when the module is no extra's."""
    module = (error.name or "").partition(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    return None if extra is None else MissingExtra(module, extra)
