"""Prometheus metrics of the metadata service, in a per-app `CollectorRegistry`.

- `hf3fsctl_requests_total{route,status}` and `hf3fsctl_request_seconds{route}`, kept
  by an ASGI middleware (route = the route template, so ids never explode the labels);
- store gauges read from the store at scrape time: the store's capacity, used, free
  and pinned bytes; per namespace pages and bytes in entries, disk held, quota, pins,
  committed keys, hits, lookup traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from hf3fsctl.meta.protocol import Store

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _StoreCollector:
    """Reads the store's stats on every scrape."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            stats = self.store.stats()
        except Exception as exc:  # a scrape must not fail because the store is busy
            logger.warning("metrics: store stats unavailable: %s", exc)
            return
        gauges = {
            "pages_used": GaugeMetricFamily(
                "hf3fsctl_pages_used", "pages held by entries", labels=["namespace"]
            ),
            "bytes_live": GaugeMetricFamily(
                "hf3fsctl_bytes_live", "bytes of the pages held by entries", labels=["namespace"]
            ),
            "bytes_used": GaugeMetricFamily(
                "hf3fsctl_bytes_used",
                "disk held by the namespace's page files",
                labels=["namespace"],
            ),
            "keys": GaugeMetricFamily(
                "hf3fsctl_keys", "block keys committed on every rank", labels=["namespace"]
            ),
            "pinned_bytes": GaugeMetricFamily(
                "hf3fsctl_pinned_bytes", "bytes held by pinned keys", labels=["namespace"]
            ),
            "expiring_keys": GaugeMetricFamily(
                "hf3fsctl_expiring_keys",
                "keys held whose entries expire (committed with a retention)",
                labels=["namespace"],
            ),
            "expired_keys": GaugeMetricFamily(
                "hf3fsctl_expired_keys",
                "keys held past their expiry (never loaded; evicted first)",
                labels=["namespace"],
            ),
        }
        store_gauges = {
            "capacity_bytes": GaugeMetricFamily(
                "hf3fsctl_store_capacity_bytes", "the store's capacity (all namespaces)"
            ),
            "bytes_used": GaugeMetricFamily(
                "hf3fsctl_store_used_bytes", "disk held by every page file of the store"
            ),
            "bytes_free": GaugeMetricFamily(
                "hf3fsctl_store_free_bytes", "capacity minus what the page files hold"
            ),
            "pinned_bytes": GaugeMetricFamily(
                "hf3fsctl_store_pinned_bytes", "bytes held by pinned keys"
            ),
        }
        for name, gauge in store_gauges.items():
            value = getattr(stats, name)
            if value is not None:
                gauge.add_metric([], float(value))
        quota = GaugeMetricFamily(
            "hf3fsctl_quota_bytes", "a namespace's quota (or its model's)", labels=["namespace"]
        )
        evicted_keys = CounterMetricFamily(
            "hf3fsctl_evicted_keys",
            "keys evicted, by reason (capacity, quota, file_full, expired, admin, corrupt)",
            labels=["namespace", "reason"],
        )
        evicted_bytes = CounterMetricFamily(
            "hf3fsctl_evicted_bytes",
            "page bytes freed by evictions, by reason",
            labels=["namespace", "reason"],
        )
        for ns in stats.namespaces:
            if ns.quota_bytes is not None:
                quota.add_metric([ns.id], float(ns.quota_bytes))
            for reason, (keys, nbytes) in ns.evicted.items():
                evicted_keys.add_metric([ns.id, reason], float(keys))
                evicted_bytes.add_metric([ns.id, reason], float(nbytes))
        yield evicted_keys
        yield evicted_bytes
        yield from store_gauges.values()
        yield quota
        counters = {
            "hits": CounterMetricFamily(
                "hf3fsctl_page_hits", "pages located for loading", labels=["namespace"]
            ),
            "lookups": CounterMetricFamily(
                "hf3fsctl_lookups", "lookup calls", labels=["namespace"]
            ),
            "lookup_keys": CounterMetricFamily(
                "hf3fsctl_lookup_keys", "keys asked about in lookups", labels=["namespace"]
            ),
            "hit_keys": CounterMetricFamily(
                "hf3fsctl_lookup_hit_keys", "keys found by lookups", labels=["namespace"]
            ),
            "admission_skipped": CounterMetricFamily(
                "hf3fsctl_admission_skipped_keys",
                "keys admit turned away (seen fewer than store_after_hits times)",
                labels=["namespace"],
            ),
        }
        for ns in stats.namespaces:
            for name, gauge in gauges.items():
                gauge.add_metric([ns.id], float(getattr(ns, name)))
            for name, counter in counters.items():
                counter.add_metric([ns.id], float(getattr(ns, name)))
        yield from gauges.values()
        yield from counters.values()


class ServerMetrics:
    """The registry of one app: request metrics plus the store collector."""

    def __init__(self, store: Store) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "hf3fsctl_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "hf3fsctl_request_seconds",
            "HTTP request latency by route",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(store))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """An ASGI middleware that counts and times every request into this registry."""
        requests, latency = self.requests, self.latency
        # labelled children by (route, status): `labels()` takes a lock and builds the
        # key on every call (~5 µs a request); a route table bounds this dict
        children: dict[tuple[str, int], tuple[Any, Any]] = {}

        async def measured(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            started = time.perf_counter()
            status = 500

            async def send_status(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, send_status)
            finally:
                route = getattr(scope.get("route"), "path", "unmatched")
                child = children.get((route, status))
                if child is None:
                    child = (requests.labels(route, str(status)), latency.labels(route))
                    children[(route, status)] = child
                child[0].inc()
                child[1].observe(time.perf_counter() - started)

        return measured
