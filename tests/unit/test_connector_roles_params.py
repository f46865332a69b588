"""A request's kv_transfer_params as the connector reads them (no engine), and the
config keys that go with them (`retention.*`, `connector.store_after_hits`)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hf3fsctl_connector.request_params import (
    RequestParams,
    admitted_upto,
    decide,
    parse_request_params,
    save_terms,
)

from hf3fsctl.config import load_config, parse_duration
from hf3fsctl.errors import ConfigError

LOGGER = "hf3fsctl_connector.request_params"


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (None, RequestParams()),
        ({}, RequestParams()),
        ({"save": False, "load": True}, RequestParams(save=False, load=True)),
        ({"retention": 30}, RequestParams(retention_s=30.0)),
        ({"retention": "5m"}, RequestParams(retention_s=300.0)),
        ({"retention": "1h"}, RequestParams(retention_s=3600.0)),
        ({"pin": True}, RequestParams(pin=True)),
        ({"pin": False}, RequestParams()),
        ({"pin": "10m"}, RequestParams(pin=True, pin_ttl_s=600.0)),
        ({"pin": 5}, RequestParams(pin=True, pin_ttl_s=5.0)),
        ({"retention": None, "save": None}, RequestParams()),
    ],
    ids=[
        "none",
        "empty",
        "save-load",
        "seconds",
        "minutes",
        "hours",
        "pin",
        "no-pin",
        "pin-ttl",
        "pin-seconds",
        "nulls",
    ],
)
def test_documented_keys_are_read(params: Any, expected: RequestParams) -> None:
    assert parse_request_params(params) == expected


@pytest.mark.parametrize(
    "params",
    [
        {"save": "no"},
        {"load": 0},
        {"retention": "soon"},
        {"retention": -5},
        {"retention": 0},
        {"retention": True},
        {"pin": [1]},
        {"pin": "forever"},
        ["save", False],
    ],
    ids=[
        "save-str",
        "load-int",
        "retention-word",
        "negative",
        "zero",
        "retention-bool",
        "pin-list",
        "pin-word",
        "not-a-mapping",
    ],
)
def test_a_bad_value_is_ignored_with_a_warning(
    params: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert parse_request_params(params) == RequestParams()


def test_an_unknown_key_is_a_warning_once_per_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for _ in range(3):
        assert parse_request_params({"keep_forever_x1": 1, "save": False}).save is False
    warned = [r for r in caplog.records if "keep_forever_x1" in r.getMessage()]
    assert len(warned) == 1
    parse_request_params({"keep_forever_x2": 1})
    assert any("keep_forever_x2" in r.getMessage() for r in caplog.records)


def test_a_bad_type_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for _ in range(3):
        parse_request_params({"load": 3.5})
    assert len([r for r in caplog.records if "'load'" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("role", "params", "expected"),
    [
        ("both", RequestParams(), (True, True)),
        ("both", RequestParams(save=False), (False, True)),
        ("both", RequestParams(load=False), (True, False)),
        ("producer", RequestParams(), (True, False)),
        ("producer", RequestParams(load=True), (True, False)),
        ("consumer", RequestParams(), (False, True)),
        ("consumer", RequestParams(save=True), (False, True)),
    ],
    ids=["both", "no-save", "no-load", "producer", "producer-no-widen", "consumer", "no-widen"],
)
def test_a_request_narrows_its_role_never_widens_it(
    role: str, params: RequestParams, expected: tuple[bool, bool]
) -> None:
    saves, loads = {"both": (True, True), "producer": (True, False), "consumer": (False, True)}[
        role
    ]
    assert decide(params, saves, loads) == expected


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), (2.5, 2.5), ("90s", 90.0), ("5m", 300.0), ("1h", 3600.0), ("7d", 604800.0)],
    ids=["bare", "float", "s", "m", "h", "d"],
)
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_retention_config_keys_take_durations() -> None:
    config = load_config(
        None,
        overrides={"retention.default": "5m", "connector.store_after_hits": 3},
        environ={"HF3FSCTL_RETENTION_RENEW_ON_READ": "true"},
    )
    assert config.retention.default == 300.0 and config.retention.renew_on_read
    assert config.connector.store_after_hits == 3
    assert load_config(None, environ={}).retention.default is None


@pytest.mark.parametrize(
    ("key", "value"),
    [("retention.default", "soon"), ("retention.default", 0), ("connector.store_after_hits", -1)],
    ids=["word", "zero", "negative"],
)
def test_bad_retention_or_admission_config_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides={key: value}, environ={})


@pytest.mark.parametrize(
    ("hits", "admitted", "expected"),
    [
        (0, [True, True], None),
        (0, [False, True], 0),
        (2, [True, False, True], 3),
        (1, [True, True, False], 3),
    ],
    ids=["all", "first-refused", "run-ends-at-first-refusal", "last-refused"],
)
def test_admission_saves_the_run_after_the_stored_prefix(
    hits: int, admitted: list[bool], expected: int | None
) -> None:
    assert admitted_upto(hits, admitted) == expected


def test_save_terms_take_the_requests_retention_before_the_default() -> None:
    config = load_config(
        None, overrides={"retention.default": 60, "retention.renew_on_read": True}, environ={}
    )
    terms = save_terms(RequestParams(retention_s=5.0, pin=True), config.retention)
    assert terms == {"retention_s": 5.0, "renew_on_read": True, "pin": True, "pin_ttl_s": None}
    assert save_terms(RequestParams(), config.retention)["retention_s"] == 60.0
    never = save_terms(RequestParams(), load_config(None, environ={}).retention)
    assert never["retention_s"] is None and never["renew_on_read"] is False
