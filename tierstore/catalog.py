"""The LMDB catalog: entry records, the free-space map, extent references and snapshots.

One LMDB write transaction is the commit point of every change to the store. Sub-databases:

``entries``   ``name \\0 kind`` -> :class:`Record` (JSON)
``free``      ``(segment, offset)`` -> length of a free extent (neighbours always coalesced)
``refs``      ``(segment, offset)`` -> (length, reference count): the live entry and every
              snapshot that points at the extent each hold one reference
``segments``  ``segment`` -> where the medium keeps it (path, base, size)
``snapshots`` ``tag`` -> snapshot summary; ``snapentries``: ``tag \\0 name \\0 kind`` -> Record
``meta``      format version, backing configuration, version counter, live byte count

The map is grown on ``MDB_MAP_FULL``; growing needs every transaction of this process
closed, so all transactions pass a shared gate that the resize takes exclusively.

Caveats. LMDB maps the file and trusts it: a file that lacks a page its tree references would
kill the process with SIGBUS on the first touch of that page, and an empty or foreign file
would be taken for a new catalog. So an existing catalog is never created on open, and its
meta pages, and where the file is shorter than they say the pages its tree references, are
read and checked before it is mapped (:func:`check_file`). Damage LMDB itself reports
surfaces as :class:`CatalogError`. Copies of the catalog (:meth:`Catalog.copy_to`) go to
the directory that holds it through a descriptor, so a store moved while open keeps them
beside it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import lmdb

from tierstore.nvme import fsync_dir

from . import lmdb_file
from .errors import CatalogError, StoreError, StoreFullError

FORMAT_VERSION = 1
_EXT = struct.Struct(">IQ")  # big-endian so LMDB's byte order is (segment, offset) order
_REF = struct.Struct(">QQ")
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_DECODE = json.JSONDecoder().decode
_RAW_DECODE = json.JSONDecoder().raw_decode
_LEN = struct.Struct(">Q")
# A record as Record.encode spells it, up to its last number: a commit reads the record it
# replaces through this (record_numbers), at two fifths of a JSON decode's cost; any other
# spelling (records of older releases, a dtype name that is not an identifier) is decoded in
# full.
_HEAD = re.compile(rb'\{"dtype":"\w+","shape":\[[\d,]*\],"nbytes":(\d+),"crc":\[[\d,]*\],'
                   rb'"chunk":\d+,"version":(\d+),"seg":(-?\d+),"off":(\d+),"length":(\d+),')
T = TypeVar("T")
# Decoded records kept for readers (Catalog.read_record): a model's experts' entries and
# more, a few MB.
SHARED_RECORDS = 1 << 14
DATA_FILE = "data.mdb"
# Errors in which LMDB says the file is not what it should be (not misuse, not a full map).
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError,
           lmdb.VersionMismatchError, lmdb.PanicError, lmdb.BadRslotError, lmdb.DiskError)
REPAIR_HINT = "run `tierstore fsck --repair STORE` to bring the store back to its latest snapshot"


def check_file(path: str, *, deep: bool = False, label: str | None = None,
               hint: str = REPAIR_HINT) -> None:
    """Refuse a catalog that is missing, not LMDB, or lacks a page its tree references.

    Run before mapping: LMDB would fault (SIGBUS) on a page the file lacks. A file as long
    as its meta page's last page number says holds every page a sound tree references, so
    only a shorter one has its tree walked (:func:`tierstore.lmdb_file.unreachable`): pages
    allocated and freed within one transaction are never written, so a sound file may end
    early. ``deep`` walks the tree of any file, which also finds pages of garbage. Errors
    call the file ``label`` (its path by default) and end with ``hint``.
    """
    data = os.path.join(path, DATA_FILE)
    label = label or data
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CatalogError(f"catalog {label} is missing; {hint}") from None
    except OSError as e:
        raise CatalogError(f"catalog {label} cannot be read ({e.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        metas = lmdb_file.read_metas(fd)
        if not metas:
            what = "empty" if size == 0 else "not an LMDB catalog (damaged or overwritten)"
            raise CatalogError(f"catalog {label} is {what}; {hint}")
        meta = lmdb_file.current(metas)
        problem = None
        if deep or size < (meta.last_pg + 1) * meta.psize:
            problem = lmdb_file.unreachable(fd, size, meta)
    except OSError as e:
        raise CatalogError(f"catalog {label} cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if problem:
        raise CatalogError(f"catalog {label} {problem}; {hint}")


@dataclass
class Record:
    """What the catalog knows about one stored tensor."""

    dtype: str
    shape: list[int]
    nbytes: int
    crc: list[int]  # crc32c of each ``chunk``-sized piece of the bytes
    chunk: int
    version: int
    seg: int  # -1 for an empty tensor, which has no extent
    off: int
    length: int  # bytes allocated: nbytes rounded up to the medium's alignment
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        # Written out rather than through ``asdict`` and the JSON encoder, which were most
        # of the cost of committing a small entry: the same bytes (every field but the
        # dtype name and ``extra`` is an int or a list of ints, which JSON spells as
        # Python does).
        if not self.dtype.isidentifier():
            return self._encode_json()
        extra = _ENCODE(self.extra) if self.extra else "{}"
        return (f'{{"dtype":"{self.dtype}","shape":[{",".join(map(str, self.shape))}],'
                f'"nbytes":{self.nbytes},"crc":[{",".join(map(str, self.crc))}],'
                f'"chunk":{self.chunk},"version":{self.version},"seg":{self.seg},'
                f'"off":{self.off},"length":{self.length},"extra":{extra}}}').encode()

    def _encode_json(self) -> bytes:
        return _ENCODE({
            "dtype": self.dtype, "shape": self.shape, "nbytes": self.nbytes,
            "crc": self.crc, "chunk": self.chunk, "version": self.version,
            "seg": self.seg, "off": self.off, "length": self.length, "extra": self.extra,
        }).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Record:
        # A str to the decoder directly (json.loads would first sniff a bytes object's
        # encoding, a third of the cost), and its raw_decode, which skips the whitespace
        # scans at either end that records never have (a fifth of what is left); any
        # other text goes through the full decoder, which says what is wrong with it.
        text = raw.decode()
        try:
            fields, end = _RAW_DECODE(text)
        except ValueError:
            end = -1
        if end != len(text) or not isinstance(fields, dict):
            fields = _DECODE(text)
        return cls(**fields)

    @property
    def extent(self) -> tuple[int, int, int]:
        return self.seg, self.off, self.length

    def checksum(self) -> str:
        return "crc32c:" + "-".join(f"{c:08x}" for c in self.crc)


def record_numbers(raw: bytes) -> tuple[int, int, int, int, int]:
    """``nbytes, version, seg, off, length`` of an encoded record: what a commit needs of
    the record it replaces, read through :data:`_HEAD` where it can be."""
    m = _HEAD.match(raw)
    if m is None:
        r = Record.decode(raw)
        return r.nbytes, r.version, r.seg, r.off, r.length
    a, b, c, d, e = map(int, m.groups())
    return a, b, c, d, e


def _merged(extents: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``extents`` in (segment, offset) order, each run of neighbours as one extent."""
    out: list[tuple[int, int, int]] = []
    for seg, off, length in sorted(extents):
        if out and out[-1][0] == seg and out[-1][1] + out[-1][2] == off:
            out[-1] = (seg, out[-1][1], out[-1][2] + length)
        else:
            out.append((seg, off, length))
    return out


def entry_key(name: str, kind: str) -> bytes:
    return name.encode() + b"\0" + kind.encode()


def split_key(key: bytes) -> tuple[str, str]:
    name, kind = key.rsplit(b"\0", 1)
    return name.decode(), kind.decode()


def ext_key(seg: int, off: int) -> bytes:
    return _EXT.pack(seg, off)


class CopyFailed(StoreError):
    """A commit that asked for a copy of the catalog committed, but the copy failed;
    ``result`` is what the commit's function returned."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result


class Gate:
    """Many transactions at once, or one map resize alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


def _is_full(e: lmdb.Error) -> bool:
    text = str(e)
    return any(s in text for s in ("No space left", "File too large", "Disk quota")) or (
        getattr(e, "errno", None) in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    )


class Catalog:
    DBS = ("entries", "free", "refs", "segments", "snapshots", "snapentries", "meta")

    def __init__(self, path: str, *, map_size: int = 1 << 30, create: bool = False,
                 deep: bool = False, label: str | None = None, hint: str = REPAIR_HINT) -> None:
        """Open the catalog at ``path``; ``create`` makes a new one, and only then may the
        directory be missing or empty. ``deep``: check every page the file's tree
        references first (:func:`check_file`). Errors that say the catalog is damaged call
        it ``label`` (its data file's path by default) and end with ``hint``."""
        self.path = path
        self.label = label or os.path.join(path, DATA_FILE)
        self.hint = hint
        if create:
            os.makedirs(path, exist_ok=True)
        else:
            check_file(path, deep=deep, label=self.label, hint=hint)
        # The directory that holds the catalog, where copies named by a relative path go:
        # through this descriptor, wherever the directory is moved while it is open.
        self._home = os.open(os.path.dirname(os.path.abspath(path)),
                             os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._open_env(path, map_size, create)
        except BaseException:
            os.close(self._home)
            raise
        self._gate = Gate()
        self._commit = threading.Lock()  # one writer; LMDB would block too, but holding the GIL
        self._copying = threading.Lock()  # one copy at a time (see copy_to)
        self._copied: dict[str, int] = {}  # dest -> the transaction its copy was made from
        self._shared: dict[bytes, Record] = {}  # see read_record

    def _open_env(self, path: str, map_size: int, create: bool) -> None:
        try:
            self.env = lmdb.open(
                path, map_size=map_size, max_dbs=len(self.DBS), max_readers=1024,
                subdir=True, sync=True, metasync=True, readahead=False, lock=True,
                create=create,
            )
        except lmdb.Error as e:
            raise self._damaged(e) from e
        try:
            self.db = {name: self.env.open_db(name.encode())
                       for name in self.DBS}
        except lmdb.Error as e:
            self.env.close()
            raise self._damaged(e) from e

    def close(self) -> None:
        with self._gate.exclusive():
            self.env.close()
            if self._home >= 0:
                os.close(self._home)
                self._home = -1

    # -- transactions ---------------------------------------------------------------
    def _damaged(self, e: lmdb.Error) -> StoreError:
        where = self.label
        if isinstance(e, lmdb.ReadonlyError) or "Permission denied" in str(e):
            return StoreError(f"catalog {where}: permission denied; open the store as the "
                              "user who owns it, or make its files writable")
        if isinstance(e, _DAMAGE) or isinstance(e, lmdb.Error) and "No such file" in str(e):
            return CatalogError(f"catalog {where} is damaged ({e}); {self.hint}")
        return StoreError(f"catalog {where}: {e}")

    @contextlib.contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        with self._gate.shared():
            try:
                with self.env.begin() as txn:
                    yield txn
            except lmdb.Error as e:
                raise self._damaged(e) from e

    def write(self, fn: Callable[[lmdb.Transaction], T], *, copy_to: str | None = None) -> T:
        """Run ``fn`` in one write transaction and commit it; the commit point of a change.

        ``fn`` must only touch the catalog, since it is run again after the map grows.
        ``copy_to`` names a file that receives a copy of the catalog as this commit left
        it (see :meth:`copy_to`) before this call returns; if that copy fails, the commit
        stands and :class:`CopyFailed` carries ``fn``'s result.
        """
        with contextlib.ExitStack() as held:
            with self._commit:
                while True:
                    try:
                        with self._gate.shared(), self.env.begin(write=True) as txn:
                            out = fn(txn)
                        break
                    except lmdb.MapFullError:
                        self._grow()
                    except lmdb.Error as e:
                        if _is_full(e):
                            raise StoreFullError(f"catalog commit failed, disk full: {e}") from e
                        raise self._damaged(e) from e
                if copy_to is None:
                    return out
                # A read transaction begun before the next commit sees exactly this one:
                # the copy is made from it after the commit lock is let go, so the commits
                # of other threads go on while the catalog is copied and synced.
                held.enter_context(self._gate.shared())
                seen = held.enter_context(self.env.begin())
            try:
                self.copy_to(copy_to, seen)
            except StoreError as e:
                raise CopyFailed(str(e), out) from e
            return out

    def copy_to(self, dest: str, txn: lmdb.Transaction | None = None) -> None:
        """Write a compact copy of the catalog as ``txn`` sees it (a fresh read
        transaction if None) to ``dest`` and make it durable; ``dest`` is replaced
        atomically, so a crash leaves the old copy whole. A relative ``dest`` is in the
        directory that holds the catalog, wherever that directory has been moved since
        the catalog was opened. Copies are made one at a time, and one of an older commit
        than the copy already at ``dest`` is skipped. Fails with :class:`StoreError`
        (:class:`StoreFullError` when the disk is full)."""
        with self._copying:
            with contextlib.ExitStack() as held:
                if txn is None:
                    held.enter_context(self._gate.shared())
                    txn = held.enter_context(self.env.begin())
                seen = txn.id()
                if self._copied.get(dest, -1) >= seen:
                    return  # a later commit's copy is there already
                tmp = dest + ".tmp"
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                                 0o644, dir_fd=self._home)
                    try:
                        self.env.copyfd(fd, compact=True, txn=txn)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.replace(tmp, dest, src_dir_fd=self._home, dst_dir_fd=self._home)
                    if os.path.isabs(dest):
                        fsync_dir(os.path.dirname(dest))
                    else:
                        os.fsync(self._home)
                except (OSError, lmdb.Error) as e:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=self._home)
                    where = os.path.join(self.home(), dest)
                    if isinstance(e, lmdb.Error) and not _is_full(e):
                        raise self._damaged(e) from e
                    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                    full = _is_full(e) if isinstance(e, lmdb.Error) else \
                        e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
                    raise (StoreFullError if full else StoreError)(
                        f"cannot save a copy of the catalog at {where}: {text}") from e
            self._copied[dest] = seen

    def has_copy(self, dest: str) -> bool:
        """Whether ``dest`` (as :meth:`copy_to` takes it) exists."""
        try:
            os.stat(dest, dir_fd=self._home)
        except FileNotFoundError:
            return False
        return True

    def home(self) -> str:
        """Where the directory that holds the catalog is now (moved or not)."""
        try:
            return os.readlink(f"/proc/self/fd/{self._home}")
        except OSError:
            return os.path.dirname(os.path.abspath(self.path))

    def _grow(self) -> None:
        with self._gate.exclusive():
            size = self.env.info()["map_size"] * 2
            self.env.set_mapsize(size)

    def map_size(self) -> int:
        return self.env.info()["map_size"]

    # -- meta -----------------------------------------------------------------------
    def get_meta(self, txn: lmdb.Transaction, key: str, default: Any = None) -> Any:
        raw = txn.get(key.encode(), db=self.db["meta"])
        return default if raw is None else json.loads(raw)

    def put_meta(self, txn: lmdb.Transaction, key: str, value: Any) -> None:
        txn.put(key.encode(), json.dumps(value).encode(), db=self.db["meta"])

    # -- entries --------------------------------------------------------------------
    def get_record(self, txn: lmdb.Transaction, name: str, kind: str) -> Record | None:
        raw = txn.get(entry_key(name, kind), db=self.db["entries"])
        return None if raw is None else Record.decode(raw)

    def read_record(self, txn: lmdb.Transaction, name: str, kind: str) -> Record | None:
        """:meth:`get_record` for a reader, which must not change it: one object is handed
        to every reader of the same stored bytes. Decoding was a sixth of the time of the
        thread that reads a batch of 256 KiB entries (on the development machine); the
        bytes are a version's whole record, so equal bytes are an equal record."""
        raw = txn.get(entry_key(name, kind), db=self.db["entries"])
        if raw is None:
            return None
        rec = self._shared.get(raw)
        if rec is None:
            rec = Record.decode(raw)
            if len(self._shared) >= SHARED_RECORDS:
                self._shared.clear()  # the next reads decode again; never unbounded
            self._shared[raw] = rec
        return rec

    def iter_records(
        self, txn: lmdb.Transaction, prefix: str = "", db: str = "entries", tag: str | None = None
    ) -> Iterator[tuple[str, str, Record]]:
        lead = b"" if tag is None else tag.encode() + b"\0"
        start = lead + prefix.encode()
        cur = txn.cursor(db=self.db[db])
        if not cur.set_range(start):
            return
        for key, raw in cur:
            if not key.startswith(start):
                break
            name, kind = split_key(key[len(lead) :])
            yield name, kind, Record.decode(raw)

    # -- free map ---------------------------------------------------------------------
    def free_extents(self, txn: lmdb.Transaction) -> Iterator[tuple[int, int, int]]:
        for key, raw in txn.cursor(db=self.db["free"]):
            seg, off = _EXT.unpack(key)
            yield seg, off, _LEN.unpack(raw)[0]

    def carve(self, txn: lmdb.Transaction, seg: int, off: int, length: int) -> None:
        """Mark ``[off, off+length)`` of ``seg`` used in the durable free map."""
        cur = txn.cursor(db=self.db["free"])
        key = ext_key(seg, off)
        found = cur.set_range(key) and cur.key() == key
        if not found and not (cur.prev() if cur.key() else cur.last()):
            raise StoreError(f"free map has no extent containing segment {seg} offset {off}")
        fseg, foff = _EXT.unpack(cur.key())
        flen = _LEN.unpack(cur.value())[0]
        if fseg != seg or foff > off or foff + flen < off + length:
            raise StoreError(
                f"free map inconsistent: [{off}, +{length}) of segment {seg} is not free"
            )
        cur.delete()
        if foff < off:
            txn.put(ext_key(seg, foff), _LEN.pack(off - foff), db=self.db["free"])
        if off + length < foff + flen:
            txn.put(
                ext_key(seg, off + length), _LEN.pack(foff + flen - off - length),
                db=self.db["free"],
            )

    def add_free(self, txn: lmdb.Transaction, seg: int, off: int, length: int) -> None:
        """Return an extent to the durable free map, merging it with free neighbours."""
        db = self.db["free"]
        cur = txn.cursor(db=db)
        if cur.set_range(ext_key(seg, off + length)) and cur.key() == ext_key(seg, off + length):
            length += _LEN.unpack(cur.value())[0]
            cur.delete()
        if cur.prev() if cur.set_range(ext_key(seg, off)) else cur.last():
            pseg, poff = _EXT.unpack(cur.key())
            plen = _LEN.unpack(cur.value())[0]
            if pseg == seg and poff + plen == off:
                txn.put(cur.key(), _LEN.pack(plen + length), db=db)
                return
        txn.put(ext_key(seg, off), _LEN.pack(length), db=db)

    # -- extent references -----------------------------------------------------------
    def incref(self, txn: lmdb.Transaction, rec: Record,
               carve: list[tuple[int, int, int]] | None = None, *, held: bool = False) -> None:
        """Add one reference. An extent's first is carved from the free map now, or, where
        ``carve`` is given, appended to it for :meth:`carve_many` later in the same
        transaction. ``held``: the extent has a reference already (a snapshot of a live
        entry)."""
        if rec.seg < 0:
            return
        key = ext_key(rec.seg, rec.off)
        # A write's extents are fresh: one insert that fails where a reference exists
        # (a snapshot's restore) does for the usual case what a lookup and a put did.
        if not held and txn.put(key, _REF.pack(rec.length, 1), db=self.db["refs"],
                                overwrite=False):
            if carve is None:
                self.carve(txn, rec.seg, rec.off, rec.length)
            else:
                carve.append(rec.extent)
            return
        raw = txn.get(key, db=self.db["refs"])
        if raw is None:
            raise StoreError(f"reference map has no extent at segment {rec.seg} offset {rec.off}")
        length, n = _REF.unpack(raw)
        txn.put(key, _REF.pack(length, n + 1), db=self.db["refs"])

    def decref(self, txn: lmdb.Transaction, rec: Record,
               free: list[tuple[int, int, int]] | None = None) -> tuple[int, int, int] | None:
        """Drop one reference; returns the extent if that freed it. A freed extent goes
        back to the free map now, or, where ``free`` is given, is appended to it for
        :meth:`add_free_many` later in the same transaction."""
        return self.decref_at(txn, rec.seg, rec.off, free)

    def decref_at(self, txn: lmdb.Transaction, seg: int, off: int,
                  free: list[tuple[int, int, int]] | None = None) -> tuple[int, int, int] | None:
        """:meth:`decref` of the extent at ``seg``, ``off`` (none where ``seg`` < 0)."""
        if seg < 0:
            return None
        key = ext_key(seg, off)
        raw = txn.pop(key, db=self.db["refs"])  # the usual last reference: one operation
        if raw is None:
            raise StoreError(f"reference map has no extent at segment {seg} offset {off}")
        length, n = _REF.unpack(raw)
        if n > 1:
            txn.put(key, _REF.pack(length, n - 1), db=self.db["refs"])
            return None
        if free is None:
            self.add_free(txn, seg, off, length)
        else:
            free.append((seg, off, length))
        return seg, off, length

    def carve_many(self, txn: lmdb.Transaction, extents: list[tuple[int, int, int]]) -> None:
        """:meth:`carve` each extent, neighbours as one: the extents of a batch of small
        entries sit side by side, and one free-map update serves them all."""
        for seg, off, length in _merged(extents):
            self.carve(txn, seg, off, length)

    def add_free_many(self, txn: lmdb.Transaction, extents: list[tuple[int, int, int]]) -> None:
        """:meth:`add_free` each extent, neighbours as one (see :meth:`carve_many`)."""
        for seg, off, length in _merged(extents):
            self.add_free(txn, seg, off, length)

    def refs(self, txn: lmdb.Transaction) -> Iterator[tuple[int, int, int, int]]:
        for key, raw in txn.cursor(db=self.db["refs"]):
            seg, off = _EXT.unpack(key)
            length, n = _REF.unpack(raw)
            yield seg, off, length, n

    # -- segments ---------------------------------------------------------------------
    def segments(self, txn: lmdb.Transaction) -> list[tuple[int, str, int, int]]:
        out = []
        for key, raw in txn.cursor(db=self.db["segments"]):
            d = json.loads(raw)
            out.append((_LEN.unpack(key)[0], d["path"], d["base"], d["size"]))
        return out

    def add_segment(self, txn: lmdb.Transaction, seg: int, path: str, base: int, size: int) -> None:
        txn.put(
            _LEN.pack(seg), json.dumps({"path": path, "base": base, "size": size}).encode(),
            db=self.db["segments"],
        )
        self.add_free(txn, seg, 0, size)
