"""Trace files, synthetic generators, the recorder, and the replay simulator."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tierstore.cache import (
    POLICIES,
    LfuDecayPolicy,
    Trace,
    TraceRecorder,
    TraceSpec,
    generate_trace,
    parse_spec,
    policy_overhead_ns,
    read_trace,
    simulate,
    sweep,
    write_trace,
)

SMALL = "zipf:a=1.1,layers=4,experts=16,steps=40,topk=2,tokens=4,drift=0.05,burst=0.1,seed=0"


def test_round_trip_with_and_without_nbytes(tmp_path):
    trace = Trace.from_rows([(0, 0, 3, 4096), (0, 1, 7, 8192), (2, 0, 3, 4096)])
    write_trace(tmp_path / "t.csv", trace, comment="spec: by hand\nsecond line")
    text = (tmp_path / "t.csv").read_text()
    assert text.splitlines()[:3] == ["# spec: by hand", "# second line", "step,layer,expert,nbytes"]
    assert read_trace(tmp_path / "t.csv") == trace

    bare = Trace(trace.step, trace.layer, trace.expert, np.full(3, 99), has_nbytes=False)
    write_trace(tmp_path / "b.csv", bare)
    assert (tmp_path / "b.csv").read_text().splitlines()[0] == "step,layer,expert"
    back = read_trace(tmp_path / "b.csv", default_nbytes=99)
    assert back == bare and back.keys() == [(0, 3), (1, 7), (0, 3)]


def test_round_trip_generated_and_empty(tmp_path):
    trace = generate_trace(SMALL)
    write_trace(tmp_path / "g.csv", trace, comment=str(parse_spec(SMALL)))
    assert read_trace(tmp_path / "g.csv") == trace
    empty = Trace.from_rows([])
    write_trace(tmp_path / "e.csv", empty)
    assert len(read_trace(tmp_path / "e.csv")) == 0


@pytest.mark.parametrize(
    "body",
    [
        "step,layer,exp\n0,0,1\n",  # bad header
        "step,layer,expert\n0,0\n",  # short row
        "step,layer,expert\n1,0,1\n0,0,1\n",  # step goes back
        "step,layer,expert\n0,-1,1\n",  # negative
        "step,layer,expert\n0,0,x\n",  # not an integer
        "# only a comment\n",  # no header
    ],
)
def test_reader_rejects_malformed_files(tmp_path, body):
    (tmp_path / "bad.csv").write_text(body)
    with pytest.raises(ValueError):
        read_trace(tmp_path / "bad.csv")


def test_parse_spec():
    spec = parse_spec("zipf:a=1.1,layers=8,experts=64,steps=200,topk=2,drift=0.05,burst=0.1,seed=0")
    assert spec == TraceSpec(a=1.1, layers=8, experts=64, steps=200, topk=2, drift=0.05)
    assert parse_spec("zipf") == TraceSpec()
    odd = TraceSpec(a=0.7, experts=9, tokens=1, seed=5)
    assert parse_spec(str(odd)) == odd
    for bad in ("lognormal:a=1", "zipf:colour=3", "zipf:a", "zipf:topk=9,experts=4",
                "zipf:a=nan", "zipf:a=inf", "zipf:layer_skew=nan", "zipf:drift=nan"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_generator_is_deterministic_by_seed():
    a, b = generate_trace(SMALL), generate_trace(parse_spec(SMALL))
    assert a == b
    c = generate_trace(SMALL.replace("seed=0", "seed=1"))
    assert not (len(a) == len(c) and a == c)


def test_generated_trace_shape():
    spec = parse_spec(SMALL)
    trace = generate_trace(spec)
    assert np.all(np.diff(trace.step) >= 0) and trace.step[-1] == spec.steps - 1
    assert trace.expert.max() < spec.experts and trace.layer.max() < spec.layers
    assert np.all(trace.nbytes == spec.nbytes)
    for step in range(spec.steps):
        at = trace.step == step
        layers = trace.layer[at]
        assert np.all(np.diff(layers) >= 0)  # forward order
        for layer in range(spec.layers):
            used = trace.expert[at][layers == layer]
            assert spec.topk <= len(used) <= min(spec.tokens * spec.topk, spec.experts)
            assert np.all(np.diff(used) > 0)  # distinct, ascending


def test_zipf_skew_drift_and_bursts_change_the_mix():
    base = "zipf:a=1.5,layers=1,experts=32,steps=300,topk=1,tokens=2,seed=3"
    still = generate_trace(base + ",drift=0,burst=0")
    share = np.bincount(still.expert, minlength=32) / len(still)
    assert share.max() > 4 / 32  # far from uniform
    drifting = generate_trace(base + ",drift=0.2,burst=0")
    first = np.bincount(drifting.expert[drifting.step < 50], minlength=32).argmax()
    last = np.bincount(drifting.expert[drifting.step >= 250], minlength=32).argmax()
    assert first != last  # the favourite changes
    uniform = generate_trace("zipf:a=0,layers=1,experts=8,steps=400,topk=1,tokens=1,burst=0")
    counts = np.bincount(uniform.expert, minlength=8)
    assert counts.min() > 25
    bursty = generate_trace(
        "zipf:a=0,layers=1,experts=8,steps=400,topk=1,tokens=1,burst=1,burst_len=1000"
    )
    assert np.bincount(bursty.expert, minlength=8).max() > 0.4 * len(bursty)


def test_recorder_writes_the_format(tmp_path):
    path = tmp_path / "rec.csv"
    with TraceRecorder(path, buffer_rows=2) as rec:
        rec.record(0, 0, torch.tensor([[5, 1], [5, 3]]), nbytes=1024)
        rec.record(0, 1, [2], nbytes=[2048])
        rec.record(1, 0, np.array([9, 4, 9]), nbytes=[1, 2, 3])
        with pytest.raises(ValueError):
            rec.record(0, 0, [1], nbytes=1)  # step went back
        with pytest.raises(ValueError):
            rec.record(1, 0, [1, 2], nbytes=[1, 2, 3])
    trace = read_trace(path)
    rows = list(zip(trace.step, trace.layer, trace.expert, trace.nbytes, strict=True))
    assert [tuple(map(int, r)) for r in rows] == [
        (0, 0, 1, 1024),
        (0, 0, 3, 1024),
        (0, 0, 5, 1024),
        (0, 1, 2, 2048),
        (1, 0, 4, 2),
        (1, 0, 9, 1),
    ]
    with pytest.raises(ValueError):
        rec.record(2, 0, [1], nbytes=1)  # closed

    bare = tmp_path / "bare.csv"
    with TraceRecorder(bare, with_nbytes=False, comment="decode run") as rec:
        rec.record(0, 2, 7)
    assert bare.read_text() == "# decode run\nstep,layer,expert\n0,2,7\n"


def test_simulate_accounting():
    trace = generate_trace(SMALL)
    nbytes = int(trace.nbytes[0])
    for name in POLICIES:
        r = simulate(trace, name, capacity_fraction=0.3, write_fraction=1.0)
        misses = r.accesses - r.hits
        assert r.bytes_read == misses * nbytes
        resident_at_end = (misses - r.admissions_refused) - r.evictions
        # every access writes: evicted, refused (write-through) and finally resident
        # entries are each written once per residency
        assert r.bytes_written == (r.evictions + r.admissions_refused + resident_at_end) * nbytes
        assert r.capacity_bytes == int(0.3 * trace.distinct_bytes())
        clean = simulate(trace, name, capacity_fraction=0.3)
        assert clean.bytes_written == 0 and clean.hit_rate == r.hit_rate
    full = simulate(trace, "lru", capacity_fraction=0.3, write_fraction=1.0)
    half = simulate(trace, "lru", capacity_fraction=0.3, write_fraction=0.5, seed=1)
    assert 0 < half.bytes_written < full.bytes_written
    assert half == simulate(trace, "lru", capacity_fraction=0.3, write_fraction=0.5, seed=1)
    with pytest.raises(ValueError):
        simulate(trace, "lru")
    with pytest.raises(ValueError):
        simulate(trace, "lru", capacity_bytes=10, capacity_fraction=0.1)


def test_sweep_rows_and_belady_ceiling():
    trace = generate_trace(SMALL)
    rows = sweep(trace, list(POLICIES), [0.1, 0.25, 0.5], write_fraction=0.3)
    assert len(rows) == 3 * len(POLICIES)
    for row in rows:
        assert set(row) >= {
            "policy",
            "capacity_fraction",
            "hit_rate",
            "opt_fraction",
            "bytes_read",
            "bytes_written",
        }
        assert 0.0 <= row["hit_rate"] <= 1.0
        # equal entry sizes: Belady (with bypass) is the optimum
        assert math.isnan(row["opt_fraction"]) or row["opt_fraction"] <= 1.0 + 1e-12
        if row["policy"] == "belady":
            assert row["opt_fraction"] == 1.0
    by = {(r["policy"], r["capacity_fraction"]): r["hit_rate"] for r in rows}
    assert by[("lru", 0.5)] >= by[("lru", 0.1)]


def test_step_clock_drives_the_policy():
    # Expert 1 at steps 0 and 1, expert 2 at step 2 (all layer 0), beta 0.5, period 1.
    trace = Trace.from_rows([(0, 0, 1, 1), (1, 0, 1, 1), (2, 0, 2, 1)])

    def count_after(tick_per_step, clock):
        p = LfuDecayPolicy(beta=0.5, period=1, theta=0, clock=clock)
        simulate(trace, p, capacity_bytes=4, tick_per_step=tick_per_step)
        return p.count((0, 1)), p.count((0, 2))

    # ticked where the step changes (the simulator's default): 1 -> 0.5 + 1 -> 0.75
    assert count_after(True, "step") == (0.75, 1.0)
    assert count_after(True, "auto") == (0.75, 1.0)  # the first tick switches it to steps
    assert count_after(False, "step") == (2.0, 1.0)  # never ticked: never decays
    # never ticked, pass clock: expert 1 repeating ends the first pass (0.5 + 1); expert 2
    # is in the second pass, so no tick before it
    assert count_after(False, "auto") == (1.5, 1.0)


def test_step_clock_and_pass_clock_agree_on_routing_traces():
    # Each step touches a key at most once, so passes and steps nearly coincide. The step
    # clock also orders victims by turn (turn=0 compares the decay alone), which helps here.
    trace = generate_trace(SMALL)
    counts_only = {"turn": 0}
    by_step = simulate(trace, "lfu-decay", capacity_fraction=0.25, policy_args=counts_only)
    by_pass = simulate(trace, "lfu-decay", capacity_fraction=0.25, tick_per_step=False)
    assert abs(by_step.hit_rate - by_pass.hit_rate) < 0.05
    by_turn = simulate(trace, "lfu-decay", capacity_fraction=0.25)
    assert by_turn.hit_rate >= by_step.hit_rate


@pytest.mark.parametrize("name", POLICIES)
def test_policy_overhead_measures_something(name):
    ns = policy_overhead_ns(name, 200, accesses=2000)
    assert ns > 0 and math.isfinite(ns)


def test_parameter_sweep_reports_margins_over_the_best_rival(tmp_path):
    from tierstore.bench.cache_lab import ONLINE_RIVALS, sweep_defaults

    out = tmp_path / "sweep.json"
    grid = [("step", 0.7, 1, 2.0), ("access", 0.5, 4, 2.0), ("pass", 0.7, 1, 0.0)]
    report = sweep_defaults([("small", SMALL, 1.0)], [0.25, 0.5], grid, json_out=str(out),
                            echo=lambda _line: None)
    assert json.loads(out.read_text())["settings"] == report["settings"]
    settings = report["settings"]
    assert len(settings) == 3
    assert [s["worst_margin"] for s in settings] == sorted(
        (s["worst_margin"] for s in settings), reverse=True)
    rivals = report["rivals"]["small"]
    for s in settings:
        t = s["traces"]["small"]
        for i, rate in enumerate(t["hit_rate"]):
            assert t["margin"][i] == pytest.approx(rate - max(rivals[n][i] for n in ONLINE_RIVALS))
        assert s["worst_margin"] == min(t["margin"])


def test_policy_args_keep_words_as_strings():
    from tierstore.bench.cache_lab import parse_policy_args

    parsed = parse_policy_args(("lfu-decay:beta=0.5,period=2,clock=step,theta=1e1",))
    assert parsed == {"lfu-decay": {"beta": 0.5, "period": 2, "clock": "step", "theta": 10.0}}
