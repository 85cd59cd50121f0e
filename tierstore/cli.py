"""The ``tierstore`` command line.

Commands that act on a store take it as their first argument; commands whose subject is
something else (an import source, a benchmark) name the store with ``--store``.

The core defines the store's own commands here and the daemon's in ``cli_daemon``. The
applications (``tierstore.trainer``: train, generate, import-hf, demo; ``tierstore.bench``:
the bench group) contribute theirs through the ``tierstore.commands`` entry-point group, so
nothing here imports them; another package can add commands the same way.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import click

from .cli_daemon import serve, status
from .cli_options import OUTPUT_FILE, POSITIVE_SIZE, SLAB_SIZE
from .cli_options import run_command as _run
from .errors import StoreError
from .sizes import format_size

PLUGIN_GROUP = "tierstore.commands"


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, dynamic_ncols=True)


def _open(path: str, **kw: Any) -> Any:
    from . import open as open_store

    return open_store(path, **kw)


class _CommandLine(click.Group):
    """The core's commands, then those of the ``tierstore.commands`` entry points (each a
    click command or group, loaded when listed or invoked). A core command's name wins."""

    def _plugins(self) -> dict[str, EntryPoint]:
        # An editable and a regular install of the same distribution may both be visible;
        # they name the same objects, so the last one seen is as good as any.
        return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is not None:
            return cmd
        ep = self._plugins().get(name)
        if ep is None:
            return None
        try:
            cmd = ep.load()
        except Exception as e:  # a broken plugin costs its own command, not the others
            raise click.ClickException(f"command {name!r} ({ep.value}) failed to load: {e}") \
                from None
        if not isinstance(cmd, click.Command):
            raise click.ClickException(f"command {name!r} ({ep.value}) is not a click command")
        return cmd


@click.group(cls=_CommandLine,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tierstore")
def main() -> None:
    """tierstore: keep Mixture-of-Experts parameter states (weights, gradients, optimizer
    states) on NVMe or persistent memory, behind an LMDB catalog with copy-on-write,
    checksum-verified entries.

    Start with `tierstore demo`, or `tierstore init STORE` and the Python API
    (`tierstore.open(STORE)`).
    """


@main.command()
@click.argument("store", type=click.Path(file_okay=False))
@click.option("--backing", type=click.Choice(["nvme", "pmem"]), default="nvme", show_default=True,
              help="Backing tier: slab files under STORE, or a persistent-memory pool file.")
@click.option("--slab-size", type=SLAB_SIZE, default="1GiB", show_default=True,
              help="Size of each preallocated NVMe slab file.")
@click.option("--pmem-path", type=OUTPUT_FILE,
              help="Pool file for --backing pmem (on a DAX mount in production).")
@click.option("--pmem-size", type=POSITIVE_SIZE,
              help="Initial pool size for --backing pmem, e.g. 16GiB.")
def init(store: str, backing: str, slab_size: int, pmem_path: str | None,
         pmem_size: int | None) -> None:
    """Create an empty store at STORE."""
    if backing != "pmem" and (pmem_path is not None or pmem_size is not None):
        raise click.UsageError("--pmem-path and --pmem-size go with --backing pmem")

    def go() -> None:
        if os.path.exists(os.path.join(store, "TIERSTORE")):
            raise StoreError(f"{store} is already a store")
        with _open(store, create=True, backing=backing, slab_size=slab_size,
                   pmem_path=pmem_path, pmem_size=pmem_size) as st:
            click.echo(f"created {st.path} ({st.describe()})")

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(store: str, as_json: bool) -> None:
    """Entries, bytes per tier, snapshots and the backend in use."""

    def go() -> None:
        with _open(store) as st:
            stats = st.stats()
            snaps = [vars(s) for s in st.snapshots()]
            if as_json:
                click.echo(json.dumps({"path": st.path, "backend": st.describe(), **stats,
                                       "snapshot_list": snaps}))
                return
            click.echo(f"store     {st.path}")
            click.echo(f"backend   {st.describe()}")
            click.echo(f"entries   {stats['entries']} ({format_size(stats['bytes_stored'])})")
            click.echo(f"capacity  {format_size(stats['capacity_bytes'])} "
                       f"({format_size(stats['free_bytes'])} free)")
            for s in snaps:
                click.echo(f"snapshot  {s['tag']}: {s['entries']} entries, "
                           f"{format_size(s['nbytes'])}")

    _run(go)


@main.command(name="ls")
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("prefix", default="")
@click.option("-l", "--long", "long_", is_flag=True, help="Kind, dtype, shape, size, version.")
def ls(store: str, prefix: str, long_: bool) -> None:
    """List entries whose name starts with PREFIX."""

    def go() -> None:
        with _open(store) as st:
            for name, kind in st.keys(prefix):
                if not long_:
                    click.echo(name if kind == "param" else f"{name}  [{kind}]")
                    continue
                e = st.info(name, kind)
                dt = str(e.dtype).removeprefix("torch.")
                click.echo(f"{name}\t{kind}\t{dt}\t{list(e.shape)}\t{e.nbytes}\tv{e.version}")

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--repair", is_flag=True,
              help="For a store whose catalog is lost or damaged: move the damaged catalog "
                   "aside, bring the store back to its latest snapshot from the catalog copy "
                   "that snapshot saved, and verify every entry.")
def fsck(store: str, as_json: bool, repair: bool) -> None:
    """Verify every checksum (live and snapshot versions), the reference counts, the free
    map and the slab files. Exits 1 if anything is wrong; a damaged catalog is reported
    too, and `--repair` recovers from it."""
    from .errors import CatalogError
    from .interface import FsckReport

    def go() -> int:
        with _bar(0, "repair" if repair else "fsck") as bar:
            seen = [0]

            def progress(done: int) -> None:
                bar.total = max(bar.total, done)
                bar.update(done - seen[0])
                seen[0] = done

            if repair:
                from .repair import repair_store

                done = repair_store(store, progress)
                report = done.check
                if done.damaged_catalog:
                    report.notes.append(f"damaged catalog kept at {done.damaged_catalog}")
                report.notes += [f"set aside {p} (written after the snapshot)"
                                 for p in done.set_aside]
                report.notes.append(f"restored snapshot {done.snapshot!r}")
            else:
                try:
                    with _open(store, host_cache=0) as st:
                        bar.total = st.stats()["bytes_stored"]
                        report = st.fsck(progress)
                except CatalogError as e:
                    report = FsckReport(problems=[str(e)])
        if as_json:
            click.echo(json.dumps(vars(report)))
        else:
            for p in report.problems:
                click.echo(f"PROBLEM  {p}")
            for n in report.notes:
                click.echo(f"note     {n}")
            verdict = "clean" if report.ok else f"{len(report.problems)} problem(s)"
            click.echo(f"{report.entries} stored versions, {format_size(report.nbytes)} "
                       f"verified: {verdict}")
        return 0 if report.ok else 1

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["zarr", "safetensors"]), required=True,
              help="zarr: a v3 group, one array per tensor family, one chunk per expert. "
                   "safetensors: OUT.safetensors, or a directory of shards with an index.")
@click.option("--shard-size", type=POSITIVE_SIZE, default="4GiB", show_default=True,
              help="safetensors shard size.")
def export(store: str, out: str, fmt: str, shard_size: int) -> None:
    """Export every live entry of STORE to OUT."""
    from .interchange import export_safetensors, export_zarr

    def go() -> None:
        with _open(store) as st, _bar(st.stats()["bytes_stored"], "export") as bar:
            if fmt == "zarr":
                n = export_zarr(st, out, progress=bar)
            else:
                n = export_safetensors(st, out, shard_size=shard_size, progress=bar)
        click.echo(f"exported {format_size(n)} to {out}")

    _run(go)


@main.command(name="import")
@click.argument("source", type=click.Path(exists=True))
@click.option("--store", "store", required=True, type=click.Path(file_okay=False),
              help="Store to import into (created if missing).")
@click.option("--format", "fmt", type=click.Choice(["zarr", "safetensors"]),
              help="Source format (default: detected).")
def import_(source: str, store: str, fmt: str | None) -> None:
    """Import SOURCE: a zarr v3 group, a .safetensors file, or a sharded directory
    (or its *.safetensors.index.json)."""
    from .interchange import import_into, open_source

    def go() -> None:
        # Checked from its headers before the store is opened (or created): a source that
        # cannot be imported leaves no store and no half import behind.
        src = open_source(source, fmt)
        with _open(store, create=True) as st, _bar(src.nbytes, "import") as bar:
            n = import_into(st, src, progress=bar)
        click.echo(f"imported {n} tensors from {source} ({src.fmt})")

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("tag", required=False)
def snapshot(store: str, tag: str | None) -> None:
    """Take snapshot TAG of every entry's current version (no TAG: list snapshots)."""

    def go() -> None:
        with _open(store) as st:
            if tag is None:
                for s in st.snapshots():
                    click.echo(f"{s.tag}\t{s.entries} entries\t{format_size(s.nbytes)}")
                return
            s = st.snapshot(tag)
            click.echo(f"snapshot {s.tag}: {s.entries} entries, {format_size(s.nbytes)}")

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("tag")
def restore(store: str, tag: str) -> None:
    """Make STORE's entries exactly those of snapshot TAG."""

    def go() -> None:
        with _open(store) as st:
            s = st.restore(tag)
            click.echo(f"restored {s.tag}: {s.entries} entries")

    _run(go)


@main.command(name="drop-snapshot")
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("tag")
def drop_snapshot(store: str, tag: str) -> None:
    """Forget snapshot TAG; space only it held is reused."""

    def go() -> None:
        with _open(store) as st:
            st.drop_snapshot(tag)
            click.echo(f"dropped {tag}")

    _run(go)


main.add_command(serve)
main.add_command(status)

if __name__ == "__main__":
    main()
