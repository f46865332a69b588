"""A request's `kv_transfer_params` as the connector reads them, and what they decide.

vLLM hands every request's `kv_transfer_params` (the OpenAI API request body's
`"kv_transfer_params"`, or `SamplingParams.extra_args["kv_transfer_params"]` offline)
to the scheduler side as `request.kv_transfer_params`. The names this connector reads:

| key | type | meaning |
| --- | --- | --- |
| `save` | bool | `false`: nothing of this request is saved (private data) |
| `load` | bool | `false`: nothing is loaded for it (its prefix is computed) |
| `retention` | duration | its saved entries expire this long after commit (seconds, or `"90s"`, `"5m"`, `"1h"`, `"7d"`); wins over `retention.default` |
| `pin` | bool or duration | pin its prompt's stored keys (`true`: until unpinned; a duration: a pin with that TTL) |

Contract:
    * `parse_request_params(params)` never raises: the cache never stops inference.
      An unknown key is a warning once per key name (other connectors' keys, such as
      vLLM's P/D `do_remote_prefill`, are unknown here), a value of the wrong type a
      warning once per (key, value type) and the key is ignored, as is a
      `kv_transfer_params` that is not a mapping.
    * `decide(params, role_saves, role_loads)` combines the engine's `kv_role` with the
      request's `save` / `load`: a request can only narrow what its engine's role
      allows (a consumer never saves, whatever a request asks).
    * `save_terms(params, retention)`: the retention (the request's, else
      `retention.default`; `renew_on_read` only with one) and pin its save jobs carry.
    * `admitted_upto(hits, admitted)`: admission's prefix rule — the stored prefix plus
      the admitted run right after it; the first key not admitted ends it (a block
      whose parent is not stored can never be loaded). None: the whole prompt.
    * `pin_saved(call, namespace, keys, ttl_s)` pins keys after their save (the worker,
      rank 0) or load (the scheduler); a failed pin is a warning, never an error.

Imports no vLLM (the worker side uses `pin_saved`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hf3fsctl.config import RetentionConfig
from hf3fsctl.config.units import parse_duration
from hf3fsctl.errors import ConfigError

logger = logging.getLogger(__name__)

SAVE, LOAD, RETENTION, PIN = "save", "load", "retention", "pin"
KNOWN_KEYS = (SAVE, LOAD, RETENTION, PIN)

_warned: set[tuple[str, ...]] = set()
_warned_lock = threading.Lock()


def _warn_once(what: tuple[str, ...], message: str, *args: object) -> None:
    with _warned_lock:
        if what in _warned:
            return
        _warned.add(what)
    logger.warning(message, *args)


@dataclass(frozen=True)
class RequestParams:
    """What one request's `kv_transfer_params` asked of the connector."""

    save: bool | None = None  # None: as the engine's kv_role says
    load: bool | None = None  # None: as the engine's kv_role says
    retention_s: float | None = None  # None: `retention.default`
    pin: bool = False  # pin the request's stored prompt keys
    pin_ttl_s: float | None = None  # with `pin`: the pin's TTL (None: until unpinned)


DEFAULT_PARAMS = RequestParams()


def _bool(key: str, value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    _warn_once(
        (key, type(value).__name__),
        "kv_transfer_params %r must be true or false, not %r: ignored",
        key,
        value,
    )
    return None


def _duration(key: str, value: Any) -> float | None:
    try:
        return parse_duration(value, f"kv_transfer_params {key!r}")
    except ConfigError as exc:
        _warn_once((key, type(value).__name__), "%s: ignored", exc.message)
        return None


def parse_request_params(params: object) -> RequestParams:
    """Read `request.kv_transfer_params`; unknown keys and bad values are warned about.

    Args:
        params: the request's `kv_transfer_params` (None when it sent none).
    """
    if params is None:
        return DEFAULT_PARAMS
    if not isinstance(params, Mapping):
        _warn_once(
            ("<params>", type(params).__name__),
            "kv_transfer_params must be a JSON object, not %s: ignored",
            type(params).__name__,
        )
        return DEFAULT_PARAMS
    for key in params:
        if key not in KNOWN_KEYS:
            _warn_once(
                (str(key),),
                "kv_transfer_params key %r is not one the hf3fsctl connector reads "
                "(it reads %s): ignored",
                key,
                ", ".join(KNOWN_KEYS),
            )
    save = _bool(SAVE, params[SAVE]) if params.get(SAVE) is not None else None
    load = _bool(LOAD, params[LOAD]) if params.get(LOAD) is not None else None
    retention = params.get(RETENTION)
    retention_s = _duration(RETENTION, retention) if retention is not None else None
    pin, pin_ttl_s = False, None
    raw_pin = params.get(PIN)
    if isinstance(raw_pin, bool):
        pin = raw_pin
    elif raw_pin is not None:
        pin_ttl_s = _duration(PIN, raw_pin)
        pin = pin_ttl_s is not None
    return RequestParams(save, load, retention_s, pin, pin_ttl_s)


def decide(params: RequestParams, role_saves: bool, role_loads: bool) -> tuple[bool, bool]:
    """(saves, loads) for a request: its role's, narrowed by the request's `save`/`load`."""
    saves = role_saves and params.save is not False
    loads = role_loads and params.load is not False
    return saves, loads


def save_terms(params: RequestParams, retention: RetentionConfig) -> dict[str, Any]:
    """A request's retention and pin, as the `SaveJob` fields of its save jobs."""
    retention_s = params.retention_s if params.retention_s is not None else retention.default
    return {
        "retention_s": retention_s,
        "renew_on_read": retention_s is not None and retention.renew_on_read,
        "pin": params.pin,
        "pin_ttl_s": params.pin_ttl_s,
    }


def admitted_upto(hits: int, admitted: Sequence[bool]) -> int | None:
    """Blocks of a prompt that may be saved, given `admit`'s answer for its keys past
    the `hits` stored ones (None: every prompt block, and decode blocks after them)."""
    run = next((i for i, ok in enumerate(admitted) if not ok), len(admitted))
    return None if run >= len(admitted) else hits + run


def pin_saved(
    call: Callable[[Callable[[Any], Any]], Any],
    namespace: str,
    keys: Sequence[str],
    ttl_s: float | None,
) -> bool:
    """Pin `keys` of `namespace` through `call` (a `MetadataGuard.call`); never raises.

    Returns:
        True when the store took the pins.
    """
    if not keys:
        return True
    wanted = list(keys)
    try:
        call(lambda client: client.pin(namespace, wanted, ttl_s))
    except Exception as exc:  # max_pinned reached, service down: the request still runs
        _warn_once(
            ("<pin>", type(exc).__name__),
            "pinning %d keys of %s for a request's kv_transfer_params pin failed: %s",
            len(wanted),
            namespace,
            exc,
        )
        return False
    return True
