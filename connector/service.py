"""The metadata service as the connector sees it: opened lazily, marked down on failure.

Contract (docs/design.md decision 7):
    * `MetadataGuard.call(fn)` runs one metadata call through the client (whose own
      timeout bounds it). A `MetadataUnavailable` marks the service down for
      `metadata.retry_backoff_s`; while it is down `call` raises `ServiceDown` at once,
      without touching the network, so callers serve misses and skip saves.
    * Opening the client is itself a call: a service that cannot be reached at start-up
      is retried after the backoff instead of failing the engine. A typed failure to open
      (`StorageError`: an embedded DB on a read-only or missing mount) marks it down too,
      and is raised as it is, so callers that disable themselves on it still can.
    * An outage is logged once, when it begins, and its end once, at the first call that
      succeeds after it; the retries in between are silent.
    * Non-idempotent calls are never retried here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from hf3fsctl.config import Config
from hf3fsctl.errors import Hf3fsctlError, MetadataUnavailable
from hf3fsctl.meta.client import connect
from hf3fsctl.meta.protocol import MetadataClient

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ServiceDown(MetadataUnavailable):
    """The service failed recently; calls are not attempted until the backoff ends."""


class MetadataGuard:
    """A metadata client with a circuit breaker."""

    def __init__(
        self, config: Config, *, opener: Callable[[Config], MetadataClient] = connect
    ) -> None:
        self._config = config
        self._opener = opener
        self._client: MetadataClient | None = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._outage = False  # a failure was logged and no call has succeeded since
        self.url = config.metadata_target.url  # for messages: a password shows as ***

    @property
    def backoff_s(self) -> float:
        """How long the service is considered down after a failure."""
        return self._config.metadata.retry_backoff_s

    @property
    def is_open(self) -> bool:
        """Whether the client has been opened (a call would not open it first)."""
        return self._client is not None

    def available(self) -> bool:
        """False while the service is marked down."""
        return time.monotonic() >= self._down_until

    def mark_down(self, reason: object) -> None:
        """Serve misses for `retry_backoff_s` (logs once per outage)."""
        with self._lock:
            began = not self._outage
            self._outage = True
            self._down_until = time.monotonic() + self.backoff_s
        if began:
            hint = getattr(reason, "hint", None)  # an Hf3fsctlError's fix, when it has one
            logger.warning(
                "metadata service %s unavailable (%s): serving misses, retrying in %.1f s%s",
                self.url,
                reason,
                self.backoff_s,
                f"; fix: {hint}" if hint else "",
            )

    def client(self) -> MetadataClient:
        """The open client (opened on first use)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    try:
                        self._client = self._opener(self._config)
                    except Hf3fsctlError:
                        raise
                    except Exception as exc:  # e.g. an embedded DB that cannot be opened
                        raise MetadataUnavailable(
                            f"cannot open metadata {self.url}: {type(exc).__name__}: {exc}"
                        ) from exc
        return self._client

    def call(self, fn: Callable[[MetadataClient], T]) -> T:
        """Run `fn(client)`; mark the service down on `MetadataUnavailable`.

        Raises:
            ServiceDown: the service is in its backoff window.
            MetadataUnavailable: the call failed (the service is now marked down).
            Other typed errors of the client (`InvalidRequest`, `NotFound`, ...).
        """
        if not self.available():
            raise ServiceDown(f"metadata service {self.url} is marked down")
        try:
            client = self.client()
        except Hf3fsctlError as exc:  # MetadataUnavailable, or e.g. a read-only DB
            self.mark_down(exc)
            raise
        try:
            result = fn(client)
        except ServiceDown:
            raise
        except MetadataUnavailable as exc:
            self.mark_down(exc)
            raise
        except OSError as exc:  # a client that let a socket/file error through
            self.mark_down(exc)
            raise MetadataUnavailable(f"metadata call failed: {exc}") from exc
        if self._outage:
            self._recovered()
        return result

    def _recovered(self) -> None:
        with self._lock:
            ended, self._outage = self._outage, False
        if ended:
            logger.info("metadata service %s is back", self.url)

    def close(self) -> None:
        """Close the client, if open."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing must never fail a shutdown
                logger.debug("closing metadata client failed", exc_info=True)
