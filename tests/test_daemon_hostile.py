"""The daemon against clients that lie about what they send, and inputs that used to end in
"internal error" or a traceback.

- Payloads declared by the gigabyte (before the hello, after it, over the limit, or not
  matching their items) cost the daemon no memory beyond the bytes that really arrive,
  while an honest client's puts and gets go on returning the right bytes.
- The daemon-wide budget of request bytes: a request that would go over it is refused with
  a clear error once its wait is up, its connection serves on, and the same put succeeds
  once the budget is free again.
- A put whose shape overflows, an unknown dtype, a string that is not UTF-8: each gets a
  clear error naming what is wrong, never "internal error".
- `tierstore serve` that cannot start (missing socket directory, metrics port taken, limits
  that contradict each other): one line, exit status 2.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from test_daemon import Daemon, exchange, make_store, raw_conn, read_frame, wait_for

import tierstore
from tierstore.cli import main
from tierstore.daemon import protocol as P
from tierstore.daemon.control import status as daemon_status
from tierstore.daemon.server import Server

MAX_REQUEST = 1 << 30
DECLARED = MAX_REQUEST  # what each hostile connection says it will send
SENT = 4 << 20  # what the ones that have said hello really send before stalling
RSS_GROWTH_LIMIT = 256 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("hostile")
    make_store(d / "store")
    served = Daemon(d / "store", d / "s.sock", "--max-request", str(MAX_REQUEST))
    yield served
    assert served.terminate() == 0, served.log.read_text()
    assert "internal error" not in served.log.read_text()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def hello(sock: Path) -> socket.socket:
    s = raw_conn(sock)
    assert exchange(s, P.Op.HELLO, {"version": P.PROTOCOL_VERSION})[0] == P.Op.REPLY
    return s


def put_header(items: list[dict[str, Any]], payload_bytes: int) -> bytes:
    return P.encode(P.Op.PUT, 9, {"items": items}, payload_bytes)


def item(name: str, nbytes: int, dtype: str = "uint8", shape: list[int] | None = None,
         ) -> dict[str, Any]:
    return {"name": name, "kind": "param", "dtype": dtype,
            "shape": [nbytes] if shape is None else shape, "nbytes": nbytes}


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def round_trip(sock: Path, name: str, seed: int) -> None:
    value = torch.randn(256 * 1024, generator=torch.Generator().manual_seed(seed))  # 1 MiB
    with tierstore.connect(sock) as st:
        st.put(name, value)
        assert torch.equal(st.get(name), value)


def held(sock: Path) -> int:
    return int(daemon_status(sock)["queues"]["request_bytes_held"])


# -- declared payloads ------------------------------------------------------------------------
def test_declared_payloads_cost_only_what_arrives(daemon: Daemon) -> None:
    round_trip(daemon.sock, "hostile.warmup", 0)
    base = rss(daemon.proc.pid)
    conns: list[socket.socket] = []
    try:
        # Before the hello: refused and closed without reading (or allocating) any of it.
        for _ in range(4):
            s = raw_conn(daemon.sock)
            conns.append(s)
            s.sendall(put_header([item("x", DECLARED)], DECLARED))
            op, fields = read_frame(s)
            assert op == P.Op.ERROR and "say hello first" in fields["message"]
            assert closed(s)
        # After it: valid items, a gigabyte declared, a few MiB sent, then silence.
        for i in range(4):
            s = hello(daemon.sock)
            conns.append(s)
            s.sendall(put_header([item(f"hostile.{i}", DECLARED)], DECLARED))
            s.sendall(bytes(SENT))
        # The daemon has read what they sent (and holds no more than that, rounded up to
        # its next piece) before anything is measured.
        wait_for(lambda: held(daemon.sock) >= 4 * SENT)
        assert held(daemon.sock) <= 4 * (SENT + P.PAYLOAD_CHUNK)
        round_trip(daemon.sock, "honest.during", 1)
        assert rss(daemon.proc.pid) - base < RSS_GROWTH_LIMIT
    finally:
        for s in conns:
            s.close()
    wait_for(lambda: held(daemon.sock) == 0)
    round_trip(daemon.sock, "honest.after", 2)


def test_payload_over_the_per_request_limit_is_refused_unread(daemon: Daemon) -> None:
    with hello(daemon.sock) as s:
        s.sendall(put_header([item("big", MAX_REQUEST + 1)], MAX_REQUEST + 1))
        op, fields = read_frame(s)
        assert op == P.Op.ERROR
        assert fields["message"] == (f"request payload of {MAX_REQUEST + 1} bytes exceeds the "
                                     f"daemon's limit of {MAX_REQUEST} bytes per request "
                                     f"(--max-request)")
        assert closed(s)
    round_trip(daemon.sock, "honest.after.cap", 3)


def test_payload_not_matching_its_items_is_refused_before_it_is_read(daemon: Daemon) -> None:
    """The answer comes before the payload is sent; the payload that follows is skipped and
    the connection serves on."""
    with hello(daemon.sock) as s:
        s.sendall(put_header([item("short", 4)], 1 << 16))
        op, fields = read_frame(s)
        assert op == P.Op.ERROR and "does not match its items" in fields["message"]
        s.sendall(bytes(1 << 16))
        s.sendall(put_header([item("matched", 4)], 4) + b"abcd")
        op, fields = read_frame(s)
        assert op == P.Op.REPLY and len(fields["versions"]) == 1
    with tierstore.connect(daemon.sock) as st:
        assert st.get("matched").numpy().tobytes() == b"abcd"


def test_before_the_hello_small_frames_are_answered_and_skipped(daemon: Daemon) -> None:
    with raw_conn(daemon.sock) as s:
        big = {"keys": [["k" * 100, "param"]] * 1000}  # ~100 KiB of fields
        s.sendall(P.encode(P.Op.GET, 1, big))
        op, fields = read_frame(s)
        assert op == P.Op.ERROR and "say hello first" in fields["message"]
        s.sendall(put_header([item("early", 4)], 4) + b"abcd")
        op, fields = read_frame(s)
        assert op == P.Op.ERROR and "say hello first" in fields["message"]
        assert exchange(s, P.Op.HELLO, {"version": P.PROTOCOL_VERSION})[0] == P.Op.REPLY
        op, fields = exchange(s, P.Op.CONTAINS, {"name": "early"})
        assert op == P.Op.REPLY and fields["found"] is False


def test_large_fields_after_the_hello_are_served(daemon: Daemon) -> None:
    """Fields over the read buffer's size (held against the budget while decoded)."""
    names = [f"absent.{i:04d}." + "n" * 80 for i in range(2000)]  # ~200 KiB of fields
    with hello(daemon.sock) as s:
        op, fields = exchange(s, P.Op.GET, {"keys": [[n, "param"] for n in names]})
        assert op == P.Op.ERROR and fields["error"] == "EntryNotFoundError"
        assert exchange(s, P.Op.CONTAINS, {"name": names[0]}) == (P.Op.REPLY, {"found": False})
    assert held(daemon.sock) == 0


# -- the daemon-wide budget --------------------------------------------------------------------
@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[Server]:
    """An in-process daemon whose whole budget is one request of 4 MiB."""
    logs: list[str] = []
    make_store(tmp_path / "store")
    srv = Server(str(tmp_path / "store"), str(tmp_path / "s.sock"), host_cache="16MiB",
                 max_request_bytes="4MiB", max_inflight_bytes="4MiB", budget_wait_s=0.2,
                 log=logs.append)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.stop()
    thread.join(60)
    assert not thread.is_alive()
    assert not [m for m in logs if "internal error" in m]


def test_request_over_the_daemon_wide_budget_is_refused_then_served(small_server: Server,
                                                                     ) -> None:
    sock = Path(small_server.socket_path)
    value = torch.arange(1024, dtype=torch.float32)
    with tierstore.connect(sock) as st:
        hog = hello(sock)
        try:
            hog.sendall(put_header([item("hog", 4 << 20)], 4 << 20))
            hog.sendall(bytes((4 << 20) - 1))  # all but one byte: the budget is all taken
            wait_for(lambda: small_server.status()["queues"]["request_bytes_held"] == 4 << 20)
            with pytest.raises(tierstore.StoreError, match=r"busy.*--max-inflight"):
                st.put("honest", value)
            assert "honest" not in st  # the refused put's connection serves on
        finally:
            hog.close()
        wait_for(lambda: small_server.status()["queues"]["request_bytes_held"] == 0)
        st.put("honest", value)
        assert torch.equal(st.get("honest"), value)
        assert "hog" not in st


def test_budget_never_below_the_request_limit(tmp_path: Path) -> None:
    with pytest.raises(tierstore.StoreError, match="--max-inflight .* must be at least"):
        Server(str(tmp_path / "store"), str(tmp_path / "s.sock"), create=True,
               max_request_bytes="8MiB", max_inflight_bytes="4MiB")
    assert not (tmp_path / "store").exists() and not (tmp_path / "s.sock").exists()


# -- inputs that used to be internal errors -----------------------------------------------------
@pytest.mark.parametrize(("bad", "message"), [
    (item("over", 0, "float32", [1 << 40, 1 << 30]), "'over': shape .* is too large"),
    (item("strides", 0, "float32", [0, 1 << 47, 1 << 47]), "'strides': shape .* is too large"),
    (item("wraps", 0, "float64", [1 << 31, 1 << 31, 1 << 30]), "'wraps': shape .* is too large"),
    (item("dt", 4, "float99"), "'dt': unknown dtype 'float99'"),
    (item("size", 8, "float32", [3]), "'size': 8 bytes is not a float32 tensor of shape \\[3\\]"),
])
def test_put_with_an_impossible_item_is_a_clear_error(daemon: Daemon, bad: dict[str, Any],
                                                      message: str) -> None:
    with hello(daemon.sock) as s:
        s.sendall(put_header([bad], bad["nbytes"]) + bytes(bad["nbytes"]))
        op, fields = read_frame(s)
        assert op == P.Op.ERROR and "internal error" not in fields["message"], fields
        assert fields["error"] in ("StoreError", "UnsupportedTensorError")
        assert re.search(message, fields["message"]), fields["message"]
        op, _ = exchange(s, P.Op.CONTAINS, {"name": bad["name"]})
        assert op == P.Op.REPLY  # the connection serves on


@pytest.mark.parametrize(("op", "fields"), [
    (P.Op.KEYS, {"prefix": "a\ud800"}),
    (P.Op.GET, {"keys": [["a\ud800", "param"]]}),
    (P.Op.CONTAINS, {"name": "x", "kind": "\udfff"}),
    (P.Op.SNAPSHOT, {"tag": "t\ud800"}),
])
def test_strings_that_are_not_utf8_are_a_clear_error(daemon: Daemon, op: int,
                                                     fields: dict[str, Any]) -> None:
    with hello(daemon.sock) as s:
        got, answer = exchange(s, op, fields)  # JSON carries lone surrogates as \u escapes
        assert got == P.Op.ERROR and "valid UTF-8" in answer["message"], answer


# -- serve that cannot start --------------------------------------------------------------------
def serve(*args: str) -> Any:
    return CliRunner().invoke(main, ["serve", *args], catch_exceptions=False)


def one_line_exit_2(res: Any, expected: str) -> None:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], res.output


def test_serve_with_a_missing_socket_directory(tmp_path: Path) -> None:
    res = serve("--store", str(tmp_path / "store"), "--create", "--socket",
                str(tmp_path / "missing" / "s.sock"))
    one_line_exit_2(res, f"directory {tmp_path / 'missing'} does not exist")
    assert not (tmp_path / "store").exists()  # refused before anything was made


def test_serve_with_contradicting_limits(tmp_path: Path) -> None:
    res = serve("--store", str(tmp_path / "store"), "--create", "--socket",
                str(tmp_path / "s.sock"), "--max-request", "2GiB", "--max-inflight", "1GiB")
    one_line_exit_2(res, "--max-inflight (1.0 GiB) must be at least --max-request (2.0 GiB)")


def test_serve_with_the_metrics_port_taken(tmp_path: Path) -> None:
    make_store(tmp_path / "store")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        res = serve("--store", str(tmp_path / "store"), "--socket", str(tmp_path / "s.sock"),
                    "--host-cache", "4MiB", "--metrics-port", str(port))
    one_line_exit_2(res, f"cannot serve metrics on 127.0.0.1:{port}")
    assert not (tmp_path / "s.sock").exists()
