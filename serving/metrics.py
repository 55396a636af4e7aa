"""Prometheus metrics of a serving process (``/metrics``, text format).

One registry per ``Service`` (never the global one, so several servers in
one process, as in tests, keep their own counts):

* ``wuliang_requests_total{transport, endpoint, code}``: requests answered,
  by gRPC status name (``OK``, ``INVALID_ARGUMENT`` …);
* ``wuliang_request_seconds{transport, endpoint}``: latency histogram;
* ``wuliang_shed_total{transport, endpoint}``: requests shed by overload
  (``overload``; also counted as ``RESOURCE_EXHAUSTED`` above), and
  ``wuliang_queue_requests{queue}``: each bounded queue's requests admitted
  and not yet answered (the HTTP loop's: handled in its current pass),
  ``wuliang_queue_overloaded{queue}`` (1 while overloaded),
  ``wuliang_queue_overloads_total{queue}`` (times it became overloaded),
  and ``wuliang_http_loop_lag_seconds``: how late the
  HTTP server's event loop runs (``overload.LoopLag``), read at scrape time;
* ``wuliang_lookup_keys_total{model, table}``: keys looked up;
* ``wuliang_served_version{model}``, ``wuliang_served_step{model}``;
* ``wuliang_table_rows{model, table}``, ``wuliang_table_bytes{model, table}``
  (read at scrape time; with several versions served, the newest's);
* ``wuliang_version_bytes{model, version}``: the tables' memory of each
  version a ``VersionedModel`` serves (``--model-config``);
* ``wuliang_version_applies_total{model}``, ``wuliang_version_refusals_total
  {model}``, ``wuliang_version_apply_seconds{model}``;
* with a device cache (``--gpu-cache-rows``, ``serving/device_cache.py``),
  per model and table: ``wuliang_device_cache_hits_total`` and
  ``wuliang_device_cache_misses_total`` (keys looked up),
  ``wuliang_device_cache_copied_bytes_total`` (miss rows copied in),
  ``wuliang_device_cache_rows``, ``wuliang_device_cache_bytes`` (device
  memory of the rows) and ``wuliang_device_cache_version`` (the version
  its rows are of), read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The counters and histograms of one service."""

    def __init__(self, stores: Callable[[], Iterable[Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "wuliang_requests_total",
            "Requests answered, by transport, endpoint and status code.",
            ["transport", "endpoint", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "wuliang_request_seconds",
            "Time to answer a request.",
            ["transport", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.keys = Counter(
            "wuliang_lookup_keys_total",
            "Keys looked up, by model and table.",
            ["model", "table"],
            registry=self.registry,
        )
        self.applies = Counter(
            "wuliang_version_applies_total",
            "Versions applied while serving.",
            ["model"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "wuliang_version_refusals_total",
            "Versions refused (manifest, checksums or SavedModel failed).",
            ["model"],
            registry=self.registry,
        )
        self.apply_seconds = Histogram(
            "wuliang_version_apply_seconds",
            "Time to apply a version.",
            ["model"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.shed = Counter(
            "wuliang_shed_total",
            "Requests shed by overload (RESOURCE_EXHAUSTED, HTTP 503), by transport and endpoint.",
            ["transport", "endpoint"],
            registry=self.registry,
        )
        self.queues: list[Any] = []  # overload.ApiQueue s, added by the servers
        self.loop_lags: list[Any] = []  # overload.LoopLag s, added by HTTP servers
        self.registry.register(_StoreCollector(stores))
        self.registry.register(_QueueCollector(self.queues, self.loop_lags))
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._keys: dict[tuple[str, str], Any] = {}

    def observe(self, transport: str, endpoint: str, code: str, seconds: float) -> None:
        key = (transport, endpoint, code)
        children = self._children.get(key)
        if children is None:  # labels() costs a lock and a tuple check per call: once
            children = self.requests.labels(*key), self.latency.labels(transport, endpoint)
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def count_keys(self, model: str, table: str, n: int) -> None:
        counter = self._keys.get((model, table))
        if counter is None:
            counter = self._keys[model, table] = self.keys.labels(model, table)
        counter.inc(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _QueueCollector:
    """Each bounded queue's in-flight requests, when scraped."""

    def __init__(self, queues: list[Any], loop_lags: list[Any]) -> None:
        self.queues = queues
        self.loop_lags = loop_lags

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        family = GaugeMetricFamily(
            "wuliang_queue_requests",
            "Requests a bounded queue admitted and has not answered yet.",
            labels=["queue"],
        )
        overloaded = GaugeMetricFamily(
            "wuliang_queue_overloaded",
            "1 while a queue is overloaded (it sheds requests that would wait longer than "
            "max_queue_ms), else 0.",
            labels=["queue"],
        )
        overloads = CounterMetricFamily(
            "wuliang_queue_overloads",
            "Times a queue became overloaded (a request found max_queue requests waiting).",
            labels=["queue"],
        )
        for queue in self.queues:
            family.add_metric([queue.name], queue.in_flight)
            overloaded.add_metric([queue.name], int(queue.detector.overloaded))
            overloads.add_metric([queue.name], queue.detector.overloads)
        yield family
        yield overloaded
        yield overloads
        if self.loop_lags:
            lag = GaugeMetricFamily(
                "wuliang_http_loop_lag_seconds",
                "How late the HTTP server's event loop runs a timer (the smaller of its last two "
                "samples).",
            )
            lag.add_metric([], max(each.seconds for each in self.loop_lags))
            yield lag


class _StoreCollector:
    """Gauges read from the stores when scraped."""

    def __init__(self, stores: Callable[[], Iterable[Any]]) -> None:
        self.stores = stores

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        version = GaugeMetricFamily(
            "wuliang_served_version", "The export version served.", labels=["model"]
        )
        step = GaugeMetricFamily(
            "wuliang_served_step", "The training step of the version served.", labels=["model"]
        )
        rows = GaugeMetricFamily(
            "wuliang_table_rows", "Rows of a served table.", labels=["model", "table"]
        )
        size = GaugeMetricFamily(
            "wuliang_table_bytes", "Memory of a served table.", labels=["model", "table"]
        )
        version_bytes = GaugeMetricFamily(
            "wuliang_version_bytes",
            "Memory of the tables of a served version (several with a version policy).",
            labels=["model", "version"],
        )
        cache = _device_cache_families()
        for store in self.stores():
            listed = getattr(store, "versions_status", None)
            for entry in listed() if listed is not None else ():
                if entry["state"] == "AVAILABLE":
                    version_bytes.add_metric([store.name, str(entry["version"])], entry["bytes"])
            version.add_metric([store.name], store.version)
            try:
                step.add_metric([store.name], store.served().step)
            except Exception:  # nothing served yet
                step.add_metric([store.name], 0)
            for table, stats in store.table_stats().items():
                rows.add_metric([store.name, table], stats["rows"])
                size.add_metric([store.name, table], stats["bytes"])
            device_cache = getattr(store, "device_cache", None)
            if device_cache is not None:
                for table, stats in device_cache.stats().items():
                    for field, family in cache.items():
                        family.add_metric([store.name, table], stats[field])
        yield from (version, step, rows, size)
        if version_bytes.samples:
            yield version_bytes
        if any(family.samples for family in cache.values()):
            yield from cache.values()


def _device_cache_families() -> dict[str, Any]:
    """The device cache's series, by its ``stats()`` field."""
    labels = ["model", "table"]
    return {
        "hits": CounterMetricFamily(
            "wuliang_device_cache_hits", "Keys looked up found in the device cache.", labels=labels
        ),
        "misses": CounterMetricFamily(
            "wuliang_device_cache_misses",
            "Keys looked up not in the device cache (read from host memory).",
            labels=labels,
        ),
        "copied_bytes": CounterMetricFamily(
            "wuliang_device_cache_copied_bytes",
            "Bytes of miss rows copied in to assemble lookups.",
            labels=labels,
        ),
        "rows": GaugeMetricFamily(
            "wuliang_device_cache_rows", "Rows held in the device cache.", labels=labels
        ),
        "bytes": GaugeMetricFamily(
            "wuliang_device_cache_bytes", "Device memory of the cached rows.", labels=labels
        ),
        "version": GaugeMetricFamily(
            "wuliang_device_cache_version", "The version the cached rows are of.", labels=labels
        ),
    }
