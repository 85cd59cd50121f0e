"""Prometheus text-format metrics and a health check on a loopback HTTP port.

``GET /metrics`` answers in the Prometheus text exposition format (version 0.0.4);
``GET /healthz`` answers ``200 ok`` while the daemon serves and ``503`` once it is stopping.
The listener binds 127.0.0.1 only: the daemon has no other network listener.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Request latency histogram buckets, seconds (upper bounds; +Inf is implied).
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Cumulative latency histograms, one per label value (the request's op)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[str, list[float]] = {}  # counts per bucket + [+Inf, sum]

    def observe(self, label: str, seconds: float) -> None:
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            s = self._series.get(label)
            if s is None:
                s = self._series[label] = [0.0] * (len(BUCKETS) + 2)
            s[i] += 1
            s[-1] += seconds

    def snapshot(self) -> dict[str, list[float]]:
        with self._lock:
            return {k: list(v) for k, v in self._series.items()}


def render(name: str, help_text: str, histogram: Histogram, label: str) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for value, s in sorted(histogram.snapshot().items()):
        running = 0.0
        for bound, count in zip(BUCKETS, s):
            running += count
            lines.append(f'{name}_bucket{{{label}="{value}",le="{bound}"}} {running:.0f}')
        running += s[len(BUCKETS)]
        lines.append(f'{name}_bucket{{{label}="{value}",le="+Inf"}} {running:.0f}')
        lines.append(f'{name}_sum{{{label}="{value}"}} {s[-1]:.9f}')
        lines.append(f'{name}_count{{{label}="{value}"}} {running:.0f}')
    return lines


def gauge(name: str, help_text: str, samples: list[tuple[dict[str, str], float]],
          kind: str = "gauge") -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{text}}} {_num(value)}" if text else f"{name} {_num(value)}")
    return lines


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def exposition(status: dict[str, Any], latency: Histogram) -> str:
    """The daemon's metrics from its status (see ``Server.status``)."""
    cache = status.get("cache") or {}
    out: list[str] = []
    out += gauge("tierstore_up", "1 while the daemon serves.", [({}, 1)])
    out += gauge("tierstore_clients", "Connected client processes.",
                 [({}, status["clients"])])
    out += gauge("tierstore_connections", "Open client connections.",
                 [({}, status["connections"])])
    out += gauge("tierstore_open_connections", "Open connections of every kind (clients, "
                 "status probes, connections yet to say hello).",
                 [({}, status["open_connections"])])
    out += gauge("tierstore_max_connections", "The daemon's --max-connections.",
                 [({}, status["max_connections"])])
    out += gauge("tierstore_leases", "Cache slots leased to clients (pinned until released).",
                 [({}, status["leases"])])
    out += gauge("tierstore_cache_hits_total", "Host cache hits.",
                 [({}, cache.get("hits", 0))], "counter")
    out += gauge("tierstore_cache_misses_total", "Host cache misses.",
                 [({}, cache.get("misses", 0))], "counter")
    out += gauge("tierstore_cache_hit_rate", "Host cache hits / accesses since start.",
                 [({}, cache.get("hit_rate", 0.0))])
    out += gauge("tierstore_cache_evictions_total", "Host cache evictions.",
                 [({}, cache.get("evictions", 0))], "counter")
    out += gauge("tierstore_cache_dirty_entries", "Cache entries not yet written back.",
                 [({}, cache.get("dirty_entries", 0))])
    out += gauge("tierstore_tier_bytes", "Bytes held per tier (host: cache resident, device: "
                 "clients' prefetched copies, backing: committed entries).",
                 [({"tier": t}, v) for t, v in status["tier_bytes"].items()])
    out += gauge("tierstore_tier_read_bytes_total", "Bytes read from the backing tier.",
                 [({"tier": t}, v["bytes_read"]) for t, v in status["tiers"].items()],
                 "counter")
    out += gauge("tierstore_tier_written_bytes_total", "Bytes written to the backing tier.",
                 [({"tier": t}, v["bytes_written"]) for t, v in status["tiers"].items()],
                 "counter")
    q = status["queues"]
    out += gauge("tierstore_requests_in_flight", "Requests the daemon is serving now.",
                 [({}, q["requests_in_flight"])])
    out += gauge("tierstore_prefetch_queue_depth", "Clients' prefetch requests by state.",
                 [({"state": s}, q[f"prefetch_{s}"]) for s in ("queued", "in_flight",
                                                               "resident")])
    out += gauge("tierstore_prefetch_stall_seconds_total",
                 "Time clients' acquire() waited on transfers.",
                 [({}, status["stall_s"])], "counter")
    out += render("tierstore_request_duration_seconds",
                  "Time to serve a request, by operation.", latency, "op")
    return "\n".join(out) + "\n"


class MetricsServer:
    """The loopback HTTP listener; ``port`` 0 picks a free port (see ``.port``)."""

    def __init__(self, port: int, text: Callable[[], str], healthy: Callable[[], bool]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, text(), "text/plain; version=0.0.4; charset=utf-8")
                elif path == "/healthz":
                    ok = healthy()
                    self._send(200 if ok else 503, "ok\n" if ok else "stopping\n", "text/plain")
                else:
                    self._send(404, "not found\n", "text/plain")

            def _send(self, code: int, body: str, ctype: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # scrapes are not worth a log line
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="tierstore-metrics",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
