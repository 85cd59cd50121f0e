"""What every ``tierstore`` command module shares: the option types that check a value while
click parses it (so a bad value is one ``Error: Invalid value for '--option': ...`` line,
exit status 2, before any work starts) and the wrapper that turns store errors into one
line. A module of its own, so that command modules need not import ``tierstore.cli`` (which
``python -m tierstore.cli`` runs as ``__main__``)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from .errors import StoreError
from .media import ALIGNMENT as PAGE  # the host cache's page and the backing tier's unit
from .sizes import TIMEOUT_RANGE_S, format_size, parse_size


class SizeType(click.ParamType):
    """Bytes, or a size string such as ``4MiB`` or ``2GiB``; at least ``minimum`` bytes."""

    name = "size"

    def __init__(self, minimum: int = 0) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        try:
            n = parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if n < self.minimum:
            self.fail(f"{value!r} is below the minimum of {format_size(self.minimum)}", param, ctx)
        return n


class CacheSizeType(SizeType):
    """A host cache's size: 0 (no cache) or at least one 4 KiB page, the cache's unit."""

    name = "size"

    def __init__(self) -> None:
        super().__init__(minimum=0)

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        n = super().convert(value, param, ctx)
        if 0 < n < PAGE:
            self.fail(f"{value!r} is less than one {format_size(PAGE)} page; give 0 for no "
                      f"host cache or at least {PAGE // 1024}KiB", param, ctx)
        return n


SIZE = SizeType()
#: A size where zero means nothing useful (a pool, a request limit, an entry).
POSITIVE_SIZE = SizeType(minimum=1)
#: At least a page, the backing tier's unit: a slab file's size, a benchmark's entry.
SLAB_SIZE = SizeType(minimum=PAGE)
#: A host cache: none (0) or at least a page.
CACHE_SIZE = CacheSizeType()


class FiniteFloat(click.FloatRange):
    """A number within optional bounds, as click's ``FloatRange``, that is also finite:
    ``nan`` compares false with every bound, so ``FloatRange`` lets it through (and
    ``inf`` wherever there is no upper bound)."""

    name = "number"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(rv, param, ctx)


#: Any finite number.
FINITE = FiniteFloat()


class SecondsType(click.ParamType):
    """A time in seconds (``30``, ``0.5``), finite and within [``minimum``, ``maximum``].
    click's FloatRange lets ``nan`` and ``inf`` through, which no socket timeout takes."""

    name = "seconds"

    def __init__(self, minimum: float, maximum: float) -> None:
        self.minimum, self.maximum = minimum, maximum

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            s = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not self.minimum <= s <= self.maximum:  # false for nan as well
            self.fail(f"{value!r} is not between {self.minimum:g} and {self.maximum:g} seconds",
                      param, ctx)
        return s


#: A socket timeout (see :data:`~tierstore.sizes.TIMEOUT_RANGE_S`).
TIMEOUT = SecondsType(*TIMEOUT_RANGE_S)


class CommaList(click.ParamType):
    """A comma-separated list (``--blocks 4MiB,64MiB``), each item converted by ``item``
    (a size, an int range, a choice): a bad item fails with the item type's own message.
    An empty list or an empty item (``1,,2``) is an error rather than silently dropped."""

    def __init__(self, item: click.ParamType, name: str | None = None) -> None:
        self.item = item
        self.name = f"{name or item.name},..."

    def convert(self, value: Any, param: Any, ctx: Any) -> list[Any]:
        if isinstance(value, (list, tuple)):  # a default given as a list, or converted before
            return [self.item.convert(v, param, ctx) for v in value]
        items = [p.strip() for p in str(value).split(",")]
        if items == [""]:
            self.fail("give at least one value (a comma-separated list)", param, ctx)
        if "" in items:
            self.fail(f"{value!r} has an empty item: separate values with single commas",
                      param, ctx)
        return [self.item.convert(p, param, ctx) for p in items]


class DeviceType(click.ParamType):
    """``cpu``, ``cuda`` or ``cuda:N`` (and ``auto`` where the command picks one), checked
    against this machine: a GPU that is not there is a usage error now, not a traceback
    from the first tensor moved to it."""

    name = "device"

    def __init__(self, auto: bool = True) -> None:
        self.auto = auto

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        text = str(value).strip()
        if self.auto and text == "auto":
            return text
        import torch  # only once a device is named: `--help` needs none of it

        accepted = "cpu, cuda or cuda:N" + (" (or auto)" if self.auto else "")
        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError):
            self.fail(f"{text!r} is not a device; use {accepted}", param, ctx)
        if dev.type == "cpu":
            return text
        if dev.type != "cuda":
            self.fail(f"{text!r}: only {accepted} are supported", param, ctx)
        if not torch.cuda.is_available():
            self.fail(f"{text!r}: CUDA is not available on this machine "
                      "(torch.cuda.is_available() is false); use cpu", param, ctx)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            self.fail(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA "
                      "device(s)", param, ctx)
        return text


#: A device option that takes ``auto`` (the command's own choice).
DEVICE = DeviceType()


class OutputFile(click.Path):
    """A file the command writes (results, metrics, a trace): its directory must exist and
    be writable now, since the file is often only opened after a long run."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        path = super().convert(value, param, ctx)
        parent = os.path.dirname(os.path.abspath(os.fspath(path)))
        if not os.path.isdir(parent):
            self.fail(f"directory {parent!r} does not exist", param, ctx)
        if not os.access(parent, os.W_OK | os.X_OK):
            self.fail(f"directory {parent!r} is not writable", param, ctx)
        return path


OUTPUT_FILE = OutputFile()


def new_store_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--backing``, ``--pmem-path``, ``--pmem-size`` and ``--slab-size``: what a command
    that may make a store makes it with (``tierstore.open``'s options of those names)."""
    options = [
        click.option("--backing", type=click.Choice(["nvme", "pmem"]),
                     help="Backing tier of a new store (default nvme); checked against an "
                          "existing one."),
        click.option("--pmem-path", type=OUTPUT_FILE, help="Pool file for --backing pmem."),
        click.option("--pmem-size", type=POSITIVE_SIZE,
                     help="Pool size for --backing pmem, e.g. 16GiB."),
        click.option("--slab-size", type=SLAB_SIZE, default="1GiB", show_default=True,
                     help="NVMe slab file size of a new store."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def run_command(fn: Callable[[], int | None]) -> None:
    """Run a command's body: store errors, and OS errors on the files it was given, become
    one line and exit status 2 instead of a traceback; otherwise exit with the body's
    status."""
    try:
        code = fn()
    except StoreError as e:
        click.echo(f"tierstore: {e}", err=True)
        sys.exit(2)
    except BrokenPipeError:
        # The reader of the output went away (`tierstore ls STORE | head`): stop quietly,
        # as other tools do. Later writes (and the interpreter's final flush) go nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)
    except OSError as e:  # a file the user named (or its directory) could not be used
        where = f"{e.filename}: " if e.filename else ""
        click.echo(f"tierstore: {where}{e.strerror or e}", err=True)
        sys.exit(2)
    sys.exit(code or 0)
