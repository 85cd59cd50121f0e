"""The daemon's Prometheus metrics, read back with prometheus_client's own parsers.

- A real `tierstore serve` with a client that has put and got: ``/metrics`` parses with
  prometheus_client's text parser, every documented metric (docs/daemon.md) is there with its
  type, the histogram's buckets are cumulative and end at its count, and the figures that do
  not move (``tierstore_up``, ``--max-connections``, the tiers) are right.
- A scraper that asks for OpenMetrics gets OpenMetrics (its parser needs the ``# EOF``), and
  ``name[]`` selects families.
- Each daemon's registry is its own: two in one process register the same names and keep
  their own counts (the library's process-wide registry would refuse the second).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from test_daemon import Daemon, make_store, shared_name

import tierstore
from tierstore.daemon.metrics import BUCKETS, DaemonRegistry

MAX_CONNECTIONS = 37

# Every metric docs/daemon.md lists, with its type.
DOCUMENTED = {
    "tierstore_up": "gauge",
    "tierstore_clients": "gauge",
    "tierstore_connections": "gauge",
    "tierstore_open_connections": "gauge",
    "tierstore_max_connections": "gauge",
    "tierstore_leases": "gauge",
    "tierstore_cache_hits_total": "counter",
    "tierstore_cache_misses_total": "counter",
    "tierstore_cache_hit_rate": "gauge",
    "tierstore_cache_evictions_total": "counter",
    "tierstore_cache_dirty_entries": "gauge",
    "tierstore_tier_bytes": "gauge",
    "tierstore_tier_read_bytes_total": "counter",
    "tierstore_tier_written_bytes_total": "counter",
    "tierstore_requests_in_flight": "gauge",
    "tierstore_prefetch_queue_depth": "gauge",
    "tierstore_prefetch_stall_seconds_total": "counter",
    "tierstore_request_duration_seconds": "histogram",
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("metrics")
    make_store(d / "store")
    served = Daemon(d / "store", d / "s.sock", "--max-connections", str(MAX_CONNECTIONS))
    try:
        with tierstore.connect(served.sock) as st:
            st.put("metrics.w", torch.ones(64))
            assert torch.equal(st.get(shared_name(0)), st.get(shared_name(0)))
        yield served
    finally:
        assert served.terminate() == 0, served.log.read_text()


def scrape(daemon: Daemon, query: str = "", accept: str | None = None) -> tuple[str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{daemon.metrics_port}/metrics{query}")
    if accept is not None:
        req.add_header("Accept", accept)
    with urllib.request.urlopen(req, timeout=30) as answer:
        return answer.headers["Content-Type"], answer.read().decode()


def samples_by_name(text: str) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    """Sample name -> [(labels, value, the family's type)], from the text format."""
    out: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value, family.type))
    return out


def test_the_exposition_parses_with_prometheus_client(daemon: Daemon) -> None:
    ctype, text = scrape(daemon)
    assert ctype.startswith("text/plain; version=0.0.4"), ctype
    got = samples_by_name(text)
    for name, kind in DOCUMENTED.items():
        names = [f"{name}_{s}" for s in ("bucket", "sum", "count")] if kind == "histogram" \
            else [name]
        for n in names:
            assert n in got, f"{n} is not exposed"
            assert {t for _, _, t in got[n]} == {kind}, (n, got[n])
    assert got["tierstore_up"] == [({}, 1.0, "gauge")]
    assert got["tierstore_max_connections"][0][1] == MAX_CONNECTIONS
    assert {"host", "device", "nvme"} <= {labels["tier"] for labels, _, _ in
                                          got["tierstore_tier_bytes"]}
    assert {labels["state"] for labels, _, _ in got["tierstore_prefetch_queue_depth"]} == {
        "queued", "in_flight", "resident"}
    for name, kind in DOCUMENTED.items():
        if kind == "counter":
            assert all(v >= 0 for _, v, _ in got[name]), got[name]

    # The latency histogram: per op, cumulative buckets at the documented bounds, +Inf = count.
    counts = {labels["op"]: v for labels, v, _ in got["tierstore_request_duration_seconds_count"]}
    assert counts.get("put", 0) >= 1 and counts.get("get", 0) >= 1, counts
    for op, count in counts.items():
        buckets = [(labels["le"], v) for labels, v, _ in
                   got["tierstore_request_duration_seconds_bucket"] if labels["op"] == op]
        assert [float(le) for le, _ in buckets] == [*BUCKETS, float("inf")]
        values = [v for _, v in buckets]
        assert values == sorted(values) and values[-1] == count, (op, buckets)


def test_openmetrics_on_request_and_selected_families(daemon: Daemon) -> None:
    ctype, text = scrape(daemon, accept="application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text"), ctype
    families = {f.name: f.type for f in openmetrics_families(text)}
    assert families["tierstore_cache_hits"] == "counter"  # OpenMetrics names counters bare
    assert families["tierstore_request_duration_seconds"] == "histogram"

    _, text = scrape(daemon, query="?name[]=tierstore_up&name[]=tierstore_clients")
    assert set(samples_by_name(text)) == {"tierstore_up", "tierstore_clients"}


def test_each_daemon_has_a_registry_of_its_own(daemon: Daemon) -> None:
    status = tierstore.daemon_status(Path(daemon.sock))
    first, second = DaemonRegistry(lambda: status), DaemonRegistry(lambda: status)
    first.observe("put", 0.003)
    first.observe("put", 20.0)
    one = samples_by_name(generate_latest(first).decode())
    two = samples_by_name(generate_latest(second).decode())
    assert [v for labels, v, _ in one["tierstore_request_duration_seconds_count"]
            if labels["op"] == "put"] == [2.0]
    assert "tierstore_request_duration_seconds_count" not in two
    assert two["tierstore_max_connections"][0][1] == MAX_CONNECTIONS
