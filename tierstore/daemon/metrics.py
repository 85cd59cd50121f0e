"""Prometheus metrics and a health check on a loopback HTTP port, through prometheus_client.

Each daemon has a registry of its own (``DaemonRegistry``), never the library's process-wide
default one: a process that runs a daemon in a thread (the tests, an embedding application)
keeps its metrics apart. It holds the request-latency histogram, which the server observes
as it serves, and a collector that reads the daemon's status at each scrape: the store and its
cache keep the counts, so they are read, not counted twice.

``GET /metrics`` is prometheus_client's own handler: the text format (version 0.0.4), or
OpenMetrics to a scraper that asks for it, gzip where accepted, ``name[]`` to select. ``GET
/healthz`` answers ``200 ok`` while the daemon serves and ``503`` once it is stopping. The
listener binds 127.0.0.1 only: the daemon has no other network listener.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

#: Request latency histogram buckets, seconds (upper bounds; +Inf is implied).
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0)

Status = dict[str, Any]

# name, help, type, the value in the daemon's status (see ``Server.status``).
_SCALARS: tuple[tuple[str, str, str, Callable[[Status], float]], ...] = (
    ("tierstore_up", "1 while the daemon serves.", "gauge", lambda s: 1),
    ("tierstore_clients", "Connected client processes.", "gauge", lambda s: s["clients"]),
    ("tierstore_connections", "Open client connections.", "gauge",
     lambda s: s["connections"]),
    ("tierstore_open_connections", "Open connections of every kind (clients, status probes, "
     "connections yet to say hello).", "gauge", lambda s: s["open_connections"]),
    ("tierstore_max_connections", "The daemon's --max-connections.", "gauge",
     lambda s: s["max_connections"]),
    ("tierstore_leases", "Cache slots leased to clients (pinned until released).", "gauge",
     lambda s: s["leases"]),
    ("tierstore_cache_hits_total", "Host cache hits.", "counter",
     lambda s: _cache(s).get("hits", 0)),
    ("tierstore_cache_misses_total", "Host cache misses.", "counter",
     lambda s: _cache(s).get("misses", 0)),
    ("tierstore_cache_hit_rate", "Host cache hits / accesses since start.", "gauge",
     lambda s: _cache(s).get("hit_rate", 0.0)),
    ("tierstore_cache_evictions_total", "Host cache evictions.", "counter",
     lambda s: _cache(s).get("evictions", 0)),
    ("tierstore_cache_dirty_entries", "Cache entries not yet written back.", "gauge",
     lambda s: _cache(s).get("dirty_entries", 0)),
    ("tierstore_requests_in_flight", "Requests the daemon is serving now.", "gauge",
     lambda s: s["queues"]["requests_in_flight"]),
    ("tierstore_prefetch_stall_seconds_total", "Time clients' acquire() waited on transfers.",
     "counter", lambda s: s["stall_s"]),
)

# name, help, type, label, the {label value: value} in the daemon's status.
_LABELLED: tuple[tuple[str, str, str, str, Callable[[Status], dict[str, float]]], ...] = (
    ("tierstore_tier_bytes", "Bytes held per tier (host: cache resident, device: clients' "
     "prefetched copies, backing: committed entries).", "gauge", "tier",
     lambda s: s["tier_bytes"]),
    ("tierstore_tier_read_bytes_total", "Bytes read from the backing tier.", "counter", "tier",
     lambda s: {t: v["bytes_read"] for t, v in s["tiers"].items()}),
    ("tierstore_tier_written_bytes_total", "Bytes written to the backing tier.", "counter",
     "tier", lambda s: {t: v["bytes_written"] for t, v in s["tiers"].items()}),
    ("tierstore_prefetch_queue_depth", "Clients' prefetch requests by state.", "gauge", "state",
     lambda s: {st: s["queues"][f"prefetch_{st}"] for st in ("queued", "in_flight",
                                                              "resident")}),
)

_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


def _cache(status: Status) -> dict[str, Any]:
    return status.get("cache") or {}


class _StatusCollector(Collector):
    """The daemon's figures, read from its status once per scrape."""

    def __init__(self, status: Callable[[], Status]) -> None:
        self._status = status

    def describe(self) -> Iterator[Metric]:
        """The families without samples: what the registry checks names against and what
        ``name[]`` selects from."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._status())

    @staticmethod
    def _families(s: Status | None) -> Iterator[Metric]:
        for name, help_text, kind, read in _SCALARS:
            family = _FAMILIES[kind](name, help_text, labels=[])
            if s is not None:
                family.add_metric([], read(s))
            yield family
        for name, help_text, kind, label, read_all in _LABELLED:
            family = _FAMILIES[kind](name, help_text, labels=[label])
            for value, figure in (read_all(s) if s is not None else {}).items():
                family.add_metric([value], figure)
            yield family


class DaemonRegistry(CollectorRegistry):
    """One daemon's metrics: its status at each scrape and its request latencies."""

    def __init__(self, status: Callable[[], Status]) -> None:
        super().__init__()
        self._latency = Histogram("tierstore_request_duration_seconds",
                                  "Time to serve a request, by operation.", ["op"],
                                  buckets=BUCKETS, registry=self)
        self._ops: dict[str, Any] = {}  # op -> its labelled histogram, looked up once
        self.register(_StatusCollector(status))

    def observe(self, op: str, seconds: float) -> None:
        child = self._ops.get(op)
        if child is None:  # labels() returns one child per op, so a race is harmless
            child = self._ops[op] = self._latency.labels(op)
        child.observe(seconds)


class MetricsServer:
    """The loopback HTTP listener; ``port`` 0 picks a free port (see ``.port``)."""

    def __init__(self, port: int, registry: CollectorRegistry,
                 healthy: Callable[[], bool]) -> None:
        class Handler(MetricsHandler):  # the library's /metrics; it logs nothing
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = urlparse(self.path).path
                if path == "/metrics":
                    super().do_GET()
                elif path == "/healthz":
                    ok = healthy()
                    self._send(200 if ok else 503, "ok\n" if ok else "stopping\n")
                else:
                    self._send(404, "not found\n")

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        Handler.registry = registry
        self._http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="tierstore-metrics",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
