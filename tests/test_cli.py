"""The ``tierstore`` command line, through click's runner (the same entry point)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import tierstore
from tierstore.cli import main


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_every_command_has_help() -> None:
    for cmd in ("init", "info", "ls", "fsck", "export", "import", "snapshot", "restore",
                "drop-snapshot", "demo", "train", "bench"):
        assert "Usage:" in run(cmd, "--help")
    for cmd in ("tiers", "cache", "prefetch"):
        assert "Usage:" in run("bench", cmd, "--help")


def test_store_lifecycle(tmp_path) -> None:
    store = str(tmp_path / "s")
    assert "created" in run("init", store, "--slab-size", "8MiB")
    run("init", store, code=2)  # already a store: one clear line, exit 2
    with tierstore.open(store) as st:
        st.put("layers.0.experts.0.w1", torch.ones(64, 64))
        st.put("layers.0.experts.0.w1", torch.zeros(64, 64), kind="exp_avg")
    assert "layers.0.experts.0.w1  [exp_avg]" in run("ls", store)
    assert "float32\t[64, 64]" in run("ls", store, "layers.", "-l")
    assert "snapshot first" in run("snapshot", store, "first")
    assert "first" in run("snapshot", store)
    info = json.loads(run("info", store, "--json"))
    assert info["entries"] == 2 and info["snapshot_list"][0]["tag"] == "first"
    assert info["backend"].startswith("nvme:")
    with tierstore.open(store) as st:
        st.put("later", torch.ones(3))
    assert "restored first" in run("restore", store, "first")
    assert "later" not in run("ls", store)
    assert "dropped first" in run("drop-snapshot", store, "first")
    assert "clean" in run("fsck", store)


def test_export_import_and_fsck_failure(tmp_path) -> None:
    src = str(tmp_path / "s")
    with tierstore.open(src, create=True, slab_size="8MiB") as st:
        for e in range(3):
            st.put(f"layers.0.experts.{e}.w1", torch.full((32, 32), float(e)))
    for fmt, out in (("zarr", "z"), ("safetensors", "m.safetensors")):
        run("export", src, str(tmp_path / out), "--format", fmt)
        dst = str(tmp_path / f"from-{fmt}")
        assert "imported 3 tensors" in run("import", str(tmp_path / out), "--store", dst)
        with tierstore.open(dst) as st:
            assert torch.equal(st.get("layers.0.experts.2.w1"), torch.full((32, 32), 2.0))
    with tierstore.open(src) as st:
        where = st.info("layers.0.experts.1.w1")
    with open(where.path, "r+b") as f:
        f.seek(where.offset + 100)
        byte = f.read(1)
        f.seek(where.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = run("fsck", src, code=1)
    assert "PROBLEM" in out and "layers.0.experts.1.w1" in out


def test_errors_are_one_line(tmp_path) -> None:
    (tmp_path / "plain").mkdir()
    out = run("info", str(tmp_path / "plain"), code=2)
    assert out.strip().startswith("tierstore:") and "not a tierstore store" in out


def test_init_pmem_names_the_backend(tmp_path) -> None:
    store = str(tmp_path / "p")
    run("init", store, "--backing", "pmem", "--pmem-path", str(tmp_path / "pool"),
        "--pmem-size", "16MiB")
    assert "pmem:" in json.loads(run("info", store, "--json"))["backend"]


def test_demo_runs_small(tmp_path) -> None:
    out = run("demo", "--store", str(tmp_path / "d"), "--layers", "2", "--experts", "2",
              "--hidden", "64", "--ffn", "64", "--model", "tiny", "--train-steps", "4",
              "--new-tokens", "5")
    assert "0 mismatches" in out and "clean" in out
    assert "over 4 steps" in out and "step-2, step-4" in out
    assert "generate (ring" in out and "generate (expert" in out
    assert (tmp_path / "d-model" / "TIERSTORE").exists()
    skipped = run("demo", "--store", str(tmp_path / "e"), "--layers", "2", "--experts", "2",
                  "--hidden", "64", "--ffn", "64", "--train-steps", "0")
    assert "training:" not in skipped


@pytest.mark.parametrize("policies", ["all"])
def test_bench_cache_writes_the_documented_json(tmp_path, policies: str) -> None:
    out = tmp_path / "c.json"
    run("bench", "cache", "--synthetic", "zipf:layers=2,experts=8,steps=20,seed=1",
        "--capacity", "0.25,0.5", "--policies", policies, "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    assert {r["policy"] for r in rows} == set(tierstore.lab.POLICIES)
    for r in rows:
        assert {"policy", "capacity_fraction", "hit_rate", "opt_fraction", "bytes_read",
                "bytes_written"} <= r.keys()
        if r["policy"] != "belady":
            assert r["hit_rate"] <= next(
                b["hit_rate"] for b in rows
                if b["policy"] == "belady" and b["capacity_fraction"] == r["capacity_fraction"])


def test_bench_cache_bad_policy_arguments_are_one_line_errors() -> None:
    common = ("bench", "cache", "--synthetic", "zipf:layers=2,experts=4,steps=5",
              "--capacity", "0.5", "--policies", "lfu-decay", "--policy-arg")
    for arg, says in (("lfu-decay:beta=2", "beta must be in (0, 1)"),
                      ("lfu-decay:turn=0.5", "turn must be 0"),
                      ("lfu-decay:nope=1", "nope"),
                      ("beta=0.5", "unknown policies")):
        out = run(*common, arg, code=2)
        assert says in out and len(out.strip().splitlines()) == 1, out


# Bad values a user could type, each refused while click parses the command line (or before
# the command does anything): exit status 2 and one `Error:` line naming the option, instead
# of a traceback, a silently empty run, or a failure after a long run. In the arguments,
# {new} is a path that must stay absent, {dir} an existing empty directory (the current
# one) and {missing} a directory that does not exist.
SYNTH = ("--synthetic", "zipf:layers=2,experts=4,steps=5")
SERVE = ("serve", "--store", "{new}", "--socket", "{dir}/s.sock")
BAD_VALUES: list[tuple[tuple[str, ...], str]] = [
    # init and serve
    (("init", "{new}", "--backing", "pmem", "--pmem-path", "{dir}/pool", "--pmem-size", "0"),
     "--pmem-size"),
    (("init", "{new}", "--backing", "pmem", "--pmem-path", "{missing}/pool",
      "--pmem-size", "16MiB"), "--pmem-path"),
    (("init", "{new}", "--pmem-size", "16MiB"), "--pmem-size"),
    (("init", "{new}", "--slab-size", "0"), "--slab-size"),
    (("init", "{new}", "--slab-size", "100"), "--slab-size"),
    (("init", "{new}", "--pmem-path", "{dir}/pool"), "--pmem-path"),
    ((*SERVE, "--policy", "nosuch"), "--policy"),
    ((*SERVE, "--max-request", "0"), "--max-request"),
    ((*SERVE, "--max-connections", "0"), "--max-connections"),
    ((*SERVE, "--send-timeout", "0"), "--send-timeout"),
    ((*SERVE, "--send-timeout", "nan"), "--send-timeout"),
    ((*SERVE, "--send-timeout", "inf"), "--send-timeout"),
    ((*SERVE, "--hello-timeout", "-1"), "--hello-timeout"),
    ((*SERVE, "--hello-timeout", "10s"), "--hello-timeout"),
    # train, generate, demo
    (("train", "--store", "{new}", "--steps", "1", "--device", "cuda:99"), "--device"),
    (("train", "--store", "{new}", "--steps", "1", "--device", "tpu"), "--device"),
    (("train", "--store", "{new}", "--steps", "1", "--device", ""), "--device"),
    (("train", "--store", "{new}", "--steps", "1", "--model", "nosuch"), "--model"),
    (("train", "--store", "{new}", "--steps", "1", "--metrics", "{missing}/m.jsonl"),
     "--metrics"),
    (("train", "--store", "{new}", "--steps", "1", "--trace", "{missing}/t.csv"), "--trace"),
    (("train", "--distributed", "--store", "{new}", "--failure-timeout", "0"),
     "--failure-timeout"),
    (("train", "--distributed", "--store", "{new}", "--failure-timeout", "nan"),
     "--failure-timeout"),
    (("train", "--store", "{new}", "--steps", "1", "--backing", "pmem", "--pmem-path",
      "{dir}/pool", "--pmem-size", "0"), "--pmem-size"),
    (("generate", "--store", "{dir}", "--prompt-ids", "1", "--max-new-tokens", "1",
      "--device", "cuda:99"), "--device"),
    (("generate", "--store", "{dir}", "--prompt-ids", "1", "--max-new-tokens", "1",
      "--trace", "{missing}/t.csv"), "--trace"),
    (("demo", "--store", "{new}", "--layers", "0"), "--layers"),
    (("demo", "--store", "{new}", "--experts", "0"), "--experts"),
    (("demo", "--store", "{new}", "--hidden", "0"), "--hidden"),
    (("demo", "--store", "{new}", "--ffn", "0"), "--ffn"),
    (("demo", "--store", "{new}", "--model", "nosuch"), "--model"),
    # bench tiers
    (("bench", "tiers", "--blocks", "3XB"), "--blocks"),
    (("bench", "tiers", "--blocks", "1.5.5GiB"), "--blocks"),
    (("bench", "tiers", "--blocks", "-1"), "--blocks"),
    (("bench", "tiers", "--blocks", "0"), "--blocks"),
    (("bench", "tiers", "--blocks", ""), "--blocks"),
    (("bench", "tiers", "--blocks", "1MiB,,4MiB"), "--blocks"),
    (("bench", "tiers", "--threads", "a,b"), "--threads"),
    (("bench", "tiers", "--threads", "1,-2"), "--threads"),
    (("bench", "tiers", "--threads", "0"), "--threads"),
    (("bench", "tiers", "--tiers", "foo"), "--tiers"),
    (("bench", "tiers", "--engines", "auto,nosuch"), "--engines"),
    (("bench", "tiers", "--repeat", "0"), "--repeat"),
    (("bench", "tiers", "--pmem-dir", "{missing}"), "--pmem-dir"),
    (("bench", "tiers", "--json", "{missing}/t.json"), "--json"),
    (("bench", "tiers", "--plot", "{missing}/t.png"), "--plot"),
    # bench cache
    (("bench", "cache", *SYNTH, "--capacity", "3XB"), "--capacity"),
    (("bench", "cache", *SYNTH, "--capacity", "a,b"), "--capacity"),
    (("bench", "cache", *SYNTH, "--capacity", "0.5,,0.25"), "--capacity"),
    (("bench", "cache", *SYNTH, "--capacity", ""), "--capacity"),
    (("bench", "cache", *SYNTH, "--capacity", "0"), "--capacity"),
    (("bench", "cache", *SYNTH, "--capacity", "1.5"), "--capacity"),
    (("bench", "cache", *SYNTH, "--policies", "nosuch"), "--policies"),
    (("bench", "cache", *SYNTH, "--policies", "lru,,arc"), "--policies"),
    (("bench", "cache", *SYNTH, "--write-fraction", "2"), "--write-fraction"),
    (("bench", "cache", *SYNTH, "--overhead", "-1"), "--overhead"),
    (("bench", "cache", *SYNTH, "--json", "{missing}/c.json"), "--json"),
    (("bench", "cache", *SYNTH, "--plot", "{missing}/c.png"), "--plot"),
    (("bench", "cache", "--synthetic", "nosuch"), "--synthetic"),
    (("bench", "cache", "--synthetic", "zipf:layers=0"), "--synthetic"),
    (("bench", "cache", "--synthetic", "zipf:a=x"), "--synthetic"),
    (("bench", "cache", "--synthetic", "zipf:bogus=1"), "--synthetic"),
    # bench prefetch, infer, train
    (("bench", "prefetch", "--repeat", "0"), "--repeat"),
    (("bench", "prefetch", "--device", "auto"), "--device"),
    (("bench", "prefetch", "--device", "cuda:99"), "--device"),
    (("bench", "prefetch", "--json", "{missing}/p.json"), "--json"),
    (("bench", "infer", "--ring-slots", "a"), "--ring-slots"),
    (("bench", "infer", "--ring-slots", "0"), "--ring-slots"),
    (("bench", "infer", "--ring-slots", "2,,4"), "--ring-slots"),
    (("bench", "infer", "--layers", "0"), "--layers"),
    (("bench", "infer", "--experts", "0"), "--experts"),
    (("bench", "infer", "--experts", "1"), "--experts"),
    (("bench", "infer", "--hidden", "0"), "--hidden"),
    (("bench", "infer", "--shape", "llama"), "--shape"),
    (("bench", "infer", "--prefill-len", "0"), "--prefill-len"),
    (("bench", "infer", "--prefill-batch", "0"), "--prefill-batch"),
    (("bench", "infer", "--decode-tokens", "0"), "--decode-tokens"),
    (("bench", "infer", "--decode-batch", "0"), "--decode-batch"),
    (("bench", "infer", "--expert-budget", "0"), "--expert-budget"),
    (("bench", "infer", "--device", "auto"), "--device"),
    (("bench", "infer", "--peer", "accelerate", "--memory-limit", "0"), "--memory-limit"),
    (("bench", "infer", "--peer", "accelerate", "--memory-limit", "3XB"), "--memory-limit"),
    (("bench", "infer", "--json", "{missing}/i.json"), "--json"),
    (("bench", "train", "--device", "cuda:99"), "--device"),
    (("bench", "train", "--json", "{missing}/t.json"), "--json"),
    # bench daemon, dist
    (("bench", "daemon", "--store", "{missing}"), "--store"),
    (("bench", "daemon", "--entries", "0"), "--entries"),
    (("bench", "daemon", "--gets", "0"), "--gets"),
    (("bench", "daemon", "--repeat", "0"), "--repeat"),
    (("bench", "daemon", "--clients", "x"), "--clients"),
    (("bench", "daemon", "--clients", "0"), "--clients"),
    (("bench", "daemon", "--clients", "1,,2"), "--clients"),
    (("bench", "daemon", "--json", "{missing}/d.json"), "--json"),
    (("bench", "dist", "--batch-sizes", "a"), "--batch-sizes"),
    (("bench", "dist", "--batch-sizes", "0"), "--batch-sizes"),
    (("bench", "dist", "--worlds", ""), "--worlds"),
    (("bench", "dist", "--model", ""), "--model"),
    (("bench", "dist", "--paradigms", "token,,data"), "--paradigms"),
    (("bench", "dist", "--timeout", "0"), "--timeout"),
    (("bench", "dist", "--json", "{missing}/x.json"), "--json"),
    # numbers that are not finite (click's FloatRange lets nan through, and inf without an
    # upper bound), and sizes below the unit of what they size
    *[(("generate", "--store", "{dir}", "--prompt-ids", "1", "--max-new-tokens", "1",
        option, value), option)
      for option, values in (("--temperature", ("nan", "inf", "-inf", "0", "-1")),
                             ("--top-p", ("nan", "inf", "-inf", "0", "1.5")),
                             ("--host-cache", ("1", "1KiB", "4095")))
      for value in values],
    *[(("train", "--store", "{new}", "--steps", "1", option, value), option)
      for option, values in (("--lr", ("nan", "inf", "-inf", "-1")),
                             ("--host-cache", ("1", "1KiB", "4095")))
      for value in values],
    ((*SERVE, "--host-cache", "1KiB"), "--host-cache"),
    (("bench", "prefetch", "--host-cache", "1KiB"), "--host-cache"),
    (("bench", "tiers", "--blocks", "1"), "--blocks"),
    (("bench", "tiers", "--blocks", "4KiB,4095"), "--blocks"),
    (("bench", "cache", *SYNTH, "--capacity", "nan"), "--capacity"),
    (("bench", "cache", *SYNTH, "--capacity", "inf"), "--capacity"),
    (("bench", "cache", *SYNTH, "--write-fraction", "nan"), "--write-fraction"),
    (("bench", "infer", "--expert-budget", "nan"), "--expert-budget"),
    (("bench", "dist", "--timeout", "nan"), "--timeout"),
    (("bench", "dist", "--timeout", "inf"), "--timeout"),
]


def refused(tmp_path, monkeypatch, args: tuple[str, ...], option: str) -> None:
    """Run ``args`` in an empty current directory ``tmp_path``: exit 2, ``Error:`` naming
    ``option``, no traceback, and nothing created (no store, scratch directory or pool)."""
    monkeypatch.chdir(tmp_path)
    where = {"new": str(tmp_path / "new"), "dir": str(tmp_path),
             "missing": str(tmp_path / "missing")}
    result = CliRunner().invoke(main, [a.format(**where) for a in args],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "Error:" in result.output and option in result.output, result.output
    assert "Traceback" not in result.output
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.parametrize(("args", "option"), BAD_VALUES,
                         ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_are_one_line_usage_errors(tmp_path, monkeypatch, args: tuple[str, ...],
                                              option: str) -> None:
    refused(tmp_path, monkeypatch, args, option)


# Values click accepts that the command then refuses before it makes or allocates anything:
# exit status 2 and one `tierstore...:` line saying what to change. {in} holds a FIFO, a
# socket and a text file; {new} must stay absent.
TRAIN = ("train", "--store", "{new}", "--model", "tiny", "--steps", "1", "--device", "cpu")
GENERATE = ("generate", "--store", "{in}", "--prompt-ids", "1", "--max-new-tokens", "1",
            "--device", "cpu")
RUNTIME_ERRORS: list[tuple[tuple[str, ...], str]] = [
    (("init", "{new}", "--slab-size", "1000TiB"), "slab file does not fit"),
    (("init", "{new}", "--slab-size", "99999999999999999999999"), "slab file does not fit"),
    (("init", "{new}", "--backing", "pmem", "--pmem-path", "{in}/pool", "--pmem-size",
      "1000TiB"), "pool file does not fit"),
    ((*TRAIN, "--slab-size", "1000TiB"), "slab file does not fit"),
    ((*TRAIN, "--batch-size", "1000000"), "lower --batch-size to at most"),
    ((*TRAIN, "--batch-size", "1", "--host-cache", "1000TiB"), "lower --host-cache"),
    (("train", "--resident", "--model", "tiny", "--steps", "1", "--device", "cpu",
      "--batch-size", "1000000"), "lower --batch-size to at most"),
    ((*TRAIN, "--device-budget", "1000TiB"), "more than this machine's"),
    ((*GENERATE, "--device-budget", "1000TiB"), "more than this machine's"),
    ((*TRAIN, "--corpus", "{in}/fifo"), "'{in}/fifo' is a FIFO (named pipe), not a text"),
    ((*TRAIN, "--corpus", "{in}/sock"), "'{in}/sock' is a socket"),
    ((*TRAIN, "--corpus", "/dev/zero"), "'/dev/zero' is a character device"),
]


@pytest.mark.parametrize(("args", "says"), RUNTIME_ERRORS,
                         ids=[" ".join(a) for a, _ in RUNTIME_ERRORS])
def test_values_refused_before_any_work_are_one_line(tmp_path, monkeypatch,
                                                     args: tuple[str, ...], says: str) -> None:
    import os
    import socket

    fixtures = tmp_path / "in"
    fixtures.mkdir()
    os.mkfifo(fixtures / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(fixtures / "sock"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    where = {"new": str(work / "new"), "in": str(fixtures)}
    result = CliRunner().invoke(main, [a.format(**where) for a in args],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierstore"), result.output
    assert says.format(**where) in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert not any(work.iterdir()), list(work.iterdir())  # no store, no slab, no pool


def test_the_library_refuses_a_host_cache_below_a_page(tmp_path) -> None:
    for size in (1, 4095, "1KiB"):
        with pytest.raises(tierstore.StoreError, match="less than one 4.0 KiB page"):
            tierstore.open(tmp_path / "s", create=True, host_cache=size)
    assert not (tmp_path / "s").exists()
    tierstore.open(tmp_path / "s", create=True, host_cache=4096, slab_size="8MiB").close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is a valid device here")
@pytest.mark.parametrize("args", [
    ("train", "--resident", "--steps", "1", "--device", "cuda"),
    ("generate", "--store", "{dir}", "--prompt-ids", "1", "--max-new-tokens", "1",
     "--device", "cuda"),
    ("bench", "infer", "--device", "cuda"),
])
def test_cuda_without_a_gpu_is_a_usage_error(tmp_path, monkeypatch,
                                             args: tuple[str, ...]) -> None:
    refused(tmp_path, monkeypatch, args, "--device")


def test_bench_cache_malformed_trace_is_one_line(tmp_path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("not,a,trace\n1,2,3\n")
    result = CliRunner().invoke(main, ["bench", "cache", "--trace", str(trace),
                                       "--capacity", "0.5"], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and str(trace) in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_option_types_accept_what_they_document() -> None:
    from tierstore.cli_options import POSITIVE_SIZE, TIMEOUT, CommaList, DeviceType

    assert CommaList(POSITIVE_SIZE).convert("4KiB, 1MiB,512", None, None) == [4096, 1 << 20, 512]
    assert TIMEOUT.convert("0.5", None, None) == 0.5 and TIMEOUT.convert(30, None, None) == 30.0
    assert CommaList(POSITIVE_SIZE).convert([1, 2], None, None) == [1, 2]
    assert DeviceType().convert("auto", None, None) == "auto"
    assert DeviceType(auto=False).convert("cpu", None, None) == "cpu"


def test_a_reader_that_stops_early_ends_the_listing_quietly(tmp_path) -> None:
    import subprocess
    import sys

    with tierstore.open(tmp_path / "s", create=True) as st:
        # ~1 MB of listing: far more than a pipe holds, so writes go on after the close
        st.put_many({f"layers.{i:06d}.experts.{'x' * 24}": torch.zeros(1) for i in range(20000)})
    proc = subprocess.Popen([sys.executable, "-m", "tierstore.cli", "ls", str(tmp_path / "s")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"layers.000000")
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert err == b"", err  # no "Broken pipe", no traceback
