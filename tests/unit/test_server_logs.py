"""`serve --log-format json`: one JSON object per record, secrets masked (stdlib logging)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from hf3fsctl.meta.server.logs import JsonFormatter, logging_config

TOKEN = "s3cr3t-token-0123456789"


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(redact=[TOKEN]))
    logger = logging.getLogger("hf3fsctl.test_server_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_record_is_one_json_line_with_time_level_logger_and_message(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    logger.info("served %d lookups\nin %s", 3, "1s")
    (record,) = records(stream)
    assert (record["level"], record["logger"], record["message"]) == (
        "INFO",
        "hf3fsctl.test_server_logs",
        "served 3 lookups\nin 1s",
    )
    assert str(record["time"]).endswith("Z") and len(stream.getvalue().splitlines()) == 1


def test_the_token_and_any_bearer_value_are_masked_in_messages_and_tracebacks(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    logger.warning("token %s, header Authorization: Bearer other-value", TOKEN)
    try:
        raise RuntimeError(f"failed with {TOKEN}")
    except RuntimeError:
        logger.exception("call failed")
    text = stream.getvalue()
    assert TOKEN not in text and "other-value" not in text
    first, second = records(stream)
    assert first["message"] == "token ***, header Authorization: Bearer ***"
    assert "RuntimeError: failed with ***" in str(second["exception"])


def test_uvicorns_access_record_keeps_its_fields(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    _, stream = captured
    access = logging.getLogger("uvicorn.access")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    access.addHandler(handler)
    try:
        access.error('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "POST", "/v1/lookup", "1.1", 200)
    finally:
        access.removeHandler(handler)
    (record,) = records(stream)
    assert (record["method"], record["path"], record["status"]) == ("POST", "/v1/lookup", 200)


def test_text_keeps_uvicorns_own_config_and_json_routes_every_logger_to_one_handler() -> None:
    """The dictConfig itself is applied in a real `serve` (test_serve_lifecycle.py); here,
    without touching this process's logging, what it says."""
    config = logging_config("json", "warning", [TOKEN])
    assert logging_config("text") is None and config is not None
    formatter = config["formatters"]["json"]
    assert (formatter["()"], formatter["redact"]) == (JsonFormatter, [TOKEN])
    routed = {
        name: (spec.get("handlers"), spec["level"])
        for name, spec in config["loggers"].items()
        if spec.get("handlers")
    }
    assert routed == {n: (["json"], "WARNING") for n in ("uvicorn", "uvicorn.access", "hf3fsctl")}
    assert config["root"] == {"handlers": ["json"], "level": "WARNING"}
