"""The daemon's commands: ``tierstore serve``, ``tierstore status`` and ``tierstore bench
daemon``. ``tierstore/cli.py`` registers them."""

from __future__ import annotations

import json
from typing import Any

import click

from .cli_options import CACHE_SIZE, POSITIVE_SIZE, SIZE, TIMEOUT, new_store_options
from .cli_options import run_command as _run
from .sizes import format_size


def _known_policy(ctx: click.Context, _param: Any, value: str) -> str:
    # Checked while parsing: the server only finds out once the store is open, and then
    # as a ValueError (a traceback), not a store error.
    from .cache import POLICIES

    if not ctx.resilient_parsing and value not in POLICIES:
        raise click.BadParameter(f"unknown policy {value!r}; choose one of {', '.join(POLICIES)}")
    return value


@click.command()
@click.option("--store", "store", required=True, type=click.Path(file_okay=False),
              help="The store to serve (made with `tierstore init`, or pass --create).")
@click.option("--socket", "socket_path", required=True, type=click.Path(dir_okay=False),
              help="Unix socket to listen on (created 0600, or 0660 with --group).")
@click.option("--host-cache", type=CACHE_SIZE, default="1GiB", show_default=True,
              help="Host cache, in shared memory that clients map read-only.")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve Prometheus /metrics and /healthz on 127.0.0.1:PORT (0: any free port).")
@click.option("--group", help="Let this group's members connect: socket mode 0660, this group.")
@click.option("--max-request", type=POSITIVE_SIZE, default="4GiB", show_default=True,
              help="Largest put (payload bytes per request, so per connection) the daemon "
                   "accepts; a larger one is refused before any of it is read.")
@click.option("--max-inflight", type=SIZE,
              help="Most bytes of requests the daemon holds in memory for all connections "
                   "together; a request that would go over waits (30 s at most), then is "
                   "refused. At least --max-request.  [default: 8GiB, or --max-request if "
                   "larger]")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024,
              show_default=True,
              help="Most connections at once (each costs a thread; a client process opens "
                   "up to nine); one more is answered with an error naming this limit, then "
                   "closed. `tierstore status` still answers, from four spares.")
@click.option("--hello-timeout", type=TIMEOUT, default=10, show_default=True,
              help="Seconds a new connection has to say hello before it is dropped, so idle "
                   "ones cannot hold the connection slots.")
@click.option("--send-timeout", type=TIMEOUT, default=30, show_default=True,
              help="Seconds a client may go without taking a byte of an answer (stopped in a "
                   "debugger, say) before its connection is dropped and the answer's bytes "
                   "given back to --max-inflight.")
@click.option("--policy", default="lfu-decay", show_default=True, callback=_known_policy,
              help="Cache eviction policy.")
@click.option("--create", is_flag=True, help="Create the store if it does not exist.")
@new_store_options
@click.option("--for-run", is_flag=True, hidden=True,
              help="Started for a distributed training run: the run that finishes stops it.")
def serve(store: str, socket_path: str, host_cache: int, metrics_port: int | None,
          group: str | None, max_request: int, max_inflight: int | None,
          max_connections: int, hello_timeout: float, send_timeout: float, policy: str,
          create: bool, backing: str | None, pmem_path: str | None, pmem_size: int | None,
          slab_size: int, for_run: bool) -> None:
    """Own STORE and serve it to the processes on this machine (`tierstore.connect(SOCKET)`):
    one host cache for all of them, so each expert is read from the backing tier once.

    A put is acknowledged once committed. SIGTERM (or Ctrl-C) writes back dirty entries and
    exits 0. A second daemon on the same store, or one that cannot start (a missing socket
    directory, a metrics port in use), exits with status 2.
    """
    from .daemon.server import Server

    def go() -> int:
        server = Server(store, socket_path, host_cache=host_cache, metrics_port=metrics_port,
                        group=group, max_request_bytes=max_request,
                        max_inflight_bytes=max_inflight, max_connections=max_connections,
                        hello_timeout_s=hello_timeout, send_timeout_s=send_timeout,
                        create=create, policy=policy, for_run=for_run,
                        store_options={"backing": backing, "pmem_path": pmem_path,
                                       "pmem_size": pmem_size, "slab_size": slab_size},
                        log=lambda m: click.echo(m, err=True))
        click.echo(f"tierstore serve: {server.describe()}", err=True)
        code = server.serve_forever()
        click.echo("tierstore serve: flushed and stopped", err=True)
        return code

    _run(go)


@click.command()
@click.option("--connect", "socket_path", required=True, type=click.Path(dir_okay=False),
              help="The daemon's socket.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(socket_path: str, as_json: bool) -> None:
    """A running daemon's clients, leases, hit rate, bytes per tier and queue depths."""
    from .daemon.control import status as daemon_status

    def go() -> None:
        s = daemon_status(socket_path)
        if as_json:
            click.echo(json.dumps(s))
            return
        click.echo(f"daemon    pid {s['pid']}, up {s['uptime_s']:.0f} s, {s['socket']}")
        click.echo(f"store     {s['store']} ({s['backend']}), id {s.get('store_id')}")
        if s.get("run"):
            click.echo(f"run       in use by a training run (process {s['run']['pid']})")
        click.echo(f"clients   {s['clients']} ({s['connections']} connections, "
                   f"{s['leases']} leases); {s['open_connections']} connections open, limit "
                   f"{s['max_connections']}")
        for c in s["client_list"]:
            click.echo(f"  pid {c['pid']}: {c['connections']} connections, {c['leases']} leases")
        cache = s["cache"] or {}
        click.echo(f"hit rate  {s['hit_rate']:.1%} ({cache.get('hits', 0)} hits, "
                   f"{cache.get('misses', 0)} misses)")
        tiers = ", ".join(f"{t} {format_size(b)}" for t, b in s["tier_bytes"].items())
        click.echo(f"bytes     {tiers}")
        q = s["queues"]
        held = (f" holding {format_size(q['request_bytes_held'])}"
                if "request_bytes_held" in q else "")
        click.echo(f"queues    {q['requests_in_flight']} requests in flight{held}; prefetch "
                   f"{q['prefetch_queued']} queued, {q['prefetch_in_flight']} in flight, "
                   f"{q['prefetch_resident']} resident; stall {s['stall_s']:.3f} s")
        if s.get("metrics_port"):
            click.echo(f"metrics   http://127.0.0.1:{s['metrics_port']}/metrics")

    _run(go)
