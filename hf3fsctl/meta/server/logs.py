"""The log format of `hf3fsctl serve`: uvicorn's text lines, or one JSON object per line.

`server.log_format: json` (`serve --log-format json`) sends every record — uvicorn's
error and access loggers, ours (`hf3fsctl.*`) and anything else through the root
logger — to stderr as one JSON object per line, for journald, Loki or any collector:
`{"time": "2026-12-01T10:47:28.123Z", "level": "INFO", "logger": "uvicorn.error",
"message": "...", "pid": 123}`, plus `exception` (the traceback) when there is one and,
for access lines, `client`, `method`, `path` and `status`. The stdlib `logging`
machinery only (a `Formatter` and a `dictConfig`), no extra dependency.

Secrets never reach a line: the formatter replaces the server's bearer token (and any
`Bearer <value>`) in every message and traceback with `***`. Nothing logs request
headers in the first place; this is the guard for what someone adds later.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',]+")
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON, with the given secrets masked.

    Args:
        redact: strings never to show (the bearer token); replaced by `***`.
    """

    def __init__(self, redact: Sequence[str] = ()) -> None:
        super().__init__()
        self._redact = [secret for secret in redact if secret]

    def _clean(self, text: str) -> str:
        for secret in self._redact:
            text = text.replace(secret, "***")
        return _BEARER.sub(r"\1***", text)

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON object (no newline inside it)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, Any] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": self._clean(record.getMessage()),
            "pid": record.process,
        }
        args = record.args
        if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
            line.update(zip(_ACCESS_FIELDS, args, strict=True))  # uvicorn's access tuple
            line["path"] = self._clean(str(line["path"]))
        if record.exc_info:
            line["exception"] = self._clean(self.formatException(record.exc_info))
        return json.dumps(line, default=str, ensure_ascii=False)


def logging_config(
    log_format: LogFormat, level: str = "info", redact: Sequence[str] = ()
) -> dict[str, Any] | None:
    """The `logging.config.dictConfig` for `serve` (uvicorn's `log_config`).

    Returns:
        None for `text` (uvicorn's own format, our loggers as the CLI set them up);
        for `json`, one stderr handler with `JsonFormatter` for uvicorn's loggers, ours
        and the root logger.
    """
    if log_format == "text":
        return None
    numeric = logging.getLevelName(level.upper())
    name = level.upper() if isinstance(numeric, int) else "INFO"
    handler = {"handlers": ["json"], "level": name, "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter, "redact": list(redact)}},
        "handlers": {
            "json": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "uvicorn": handler,
            "uvicorn.error": {"level": name, "propagate": True},
            "uvicorn.access": handler,
            "hf3fsctl": handler,
        },
        "root": {"handlers": ["json"], "level": name},
    }


def configure(log_format: LogFormat, level: str = "info", redact: Sequence[str] = ()) -> None:
    """Apply `logging_config` to this process now (before uvicorn starts, so that the
    command's own start-up lines are in the same format); no-op for `text`."""
    import logging.config

    config = logging_config(log_format, level, redact)
    if config is not None:
        logging.config.dictConfig(config)
