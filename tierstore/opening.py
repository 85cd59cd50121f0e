"""Opening a store (:func:`open_store`, which is ``tierstore.open``) and what it proves before
it touches anything: the marker is whole, the catalog is this store's own, the caller may
write there and nobody else has the store open.

A store directory holds ``TIERSTORE`` (the marker: format, backing, store id), ``catalog/``
(LMDB) and the backing tier's files. The marker and the catalog record the same identity, so
a catalog that was lost, emptied or swapped for another store's is refused with a clear
error instead of being taken for an empty store, which would hand the old data's space to
new writes. A store made before identities were recorded gets one on its first open, once
its catalog is shown to match the marker.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from tierstore.nvme import ENGINES

from .catalog import FORMAT_VERSION, Catalog
from .durable import replace_file
from .errors import CatalogError, NotAStoreError, StoreError, StoreLockedError
from .local import LocalStore
from .media import ALIGNMENT, Medium, align_up
from .sizes import format_size, memory_limit, parse_size

MARKER = "TIERSTORE"
CATALOG_DIR = "catalog"
LOCK = "LOCK"


def read_marker(path: str) -> dict[str, Any]:
    """The marker's contents, checked field by field."""
    marker = os.path.join(path, MARKER)
    try:
        with open(marker) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise NotAStoreError(f"{marker}: unreadable store marker: {e}") from e
    backing = meta.get("backing") if isinstance(meta, dict) else None
    need = {"nvme": ("slab_bytes",), "pmem": ("pool", "pool_bytes")}
    if not isinstance(backing, dict) or backing.get("kind") not in need:
        raise NotAStoreError(f"{marker}: the store marker is damaged (no valid 'backing'); "
                             "restore it from a backup of the store directory")
    for field in need[backing["kind"]]:
        if field not in backing:
            raise NotAStoreError(f"{marker}: the store marker is damaged (backing has no "
                                 f"{field!r}); restore it from a backup of the store directory")
    if meta.get("format") != FORMAT_VERSION:
        raise NotAStoreError(f"{path}: store format {meta.get('format')!r} is not supported")
    return meta


def write_marker(path: str, meta: dict[str, Any]) -> None:
    """Replace the marker atomically and durably."""
    write_json(path, MARKER, meta)


def write_json(path: str, name: str, data: Any) -> None:
    """Replace ``name`` in the directory ``path`` with ``data`` as JSON, atomically and
    durably."""
    replace_file(os.path.join(path, name), json.dumps(data).encode())


def check_identity(path: str, marker: dict[str, Any], catalog: Catalog) -> None:
    """Refuse a catalog that is not the one the marker describes (see the module doc)."""
    with catalog.read() as txn:
        fmt = catalog.get_meta(txn, "format")
        backing = catalog.get_meta(txn, "backing")
        sid = catalog.get_meta(txn, "store_id")
    where, hint = catalog.label, catalog.hint
    if fmt is None and backing is None:
        raise CatalogError(f"catalog {where} is empty, so it is not this store's catalog "
                           f"(lost or replaced); {hint}")
    if fmt != marker["format"] or backing != marker["backing"]:
        raise CatalogError(f"catalog {where} belongs to another store (its backing is "
                           f"{backing}, the marker's {marker['backing']}); {hint}")
    mine = marker.get("store_id")
    if mine is None and sid is None:  # made before stores had ids: give it one now
        sid = uuid.uuid4().hex
        catalog.write(lambda txn: catalog.put_meta(txn, "store_id", sid))
        write_marker(path, {**marker, "store_id": sid})
    elif mine != sid:
        raise CatalogError(f"catalog {where} belongs to store {sid}, the marker names store "
                           f"{mine}; {hint}")


def lock(path: str) -> int:
    """Take the store's lock file; one process owns a store at a time."""
    where = os.path.join(path, LOCK)
    try:
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except PermissionError:
        raise StoreError(f"{where}: permission denied; open the store as the user who owns "
                         "it, or make the store directory writable") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreLockedError(
            f"store {path} is open in process {holder}; one process owns a store at a time "
            "(share it through `tierstore serve` instead)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def check_free_space(path: str, nbytes: int, what: str, option: str) -> None:
    """Refuse a file of ``nbytes`` (preallocated whole: a slab, a pool) that the file system
    which is to hold ``path`` has no room for, before a store that names it is made: it
    would fail only at the first write, or later, or the size would not even be a number
    the file system takes."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError:
        return  # nothing to tell: the first write says what is wrong
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise StoreError(f"a {format_size(nbytes)} {what} does not fit the "
                         f"{format_size(free)} free on the file system of {probe}; choose "
                         f"a smaller {option}")


def init_dir(
    path: str, backing: str, slab_size: int | str, pmem_path: Any, pmem_size: Any, map_size: Any
) -> None:
    """Make a new store: the catalog with its identity first, the marker last (a directory
    without the marker is an unfinished init, not a store)."""
    if backing == "nvme":
        conf: dict[str, Any] = {"kind": "nvme", "slab_bytes": align_up(parse_size(slab_size))}
        if conf["slab_bytes"] < ALIGNMENT:
            raise StoreError("slab_size must be at least 4 KiB")
        check_free_space(path, conf["slab_bytes"], "slab file", "--slab-size / slab_size=")
    elif backing == "pmem":
        if pmem_path is None or pmem_size is None:
            raise StoreError("a pmem store needs pmem_path= (the pool file) and pmem_size=")
        pool_bytes = align_up(parse_size(pmem_size))
        conf = {"kind": "pmem", "pool": os.path.abspath(os.fspath(pmem_path)),
                "pool_bytes": pool_bytes, "grow_bytes": max(1 << 20, pool_bytes // 4)}
        # The pool is made when the store is first opened, after the marker is written:
        # what would stop it is refused here, so a failed init never leaves a store
        # directory that names a pool that cannot exist.
        if pool_bytes < 2 * ALIGNMENT:
            raise StoreError("pmem_size must be at least 8 KiB (a 4 KiB header and data)")
        check_free_space(conf["pool"], pool_bytes, "pool file", "--pmem-size / pmem_size=")
        if os.path.exists(conf["pool"]):
            raise StoreError(f"{conf['pool']} exists; a new pmem store needs a new pool file")
        parent = os.path.dirname(conf["pool"])
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise StoreError(f"cannot make the pool file {conf['pool']}: its directory "
                             f"{parent} does not exist or is not writable")
    else:
        raise StoreError(f"unknown backing {backing!r}; choose nvme or pmem")
    sid = uuid.uuid4().hex
    os.makedirs(path, exist_ok=True)
    catalog = Catalog(os.path.join(path, CATALOG_DIR), map_size=parse_size(map_size), create=True)
    try:
        def init(txn: Any) -> None:
            # A catalog left by an init that died before its marker is empty: start it
            # again. One that holds data lost its marker: never overwrite it.
            if catalog.segments(txn) or txn.stat(catalog.db["entries"])["entries"]:
                raise NotAStoreError(
                    f"{path} has a catalog holding data but no {MARKER} marker; restore "
                    "the marker from a backup of the store directory")
            catalog.put_meta(txn, "format", FORMAT_VERSION)
            catalog.put_meta(txn, "backing", conf)
            catalog.put_meta(txn, "store_id", sid)
        catalog.write(init)
    finally:
        catalog.close()
    write_marker(path, {"format": FORMAT_VERSION, "backing": conf, "store_id": sid,
                        "created": time.time()})


def check_host_cache(nbytes: int) -> None:
    """Refuse a host cache of less than its one page (its unit), and one the machine
    cannot hold: it would be swapped or OOM-killed."""
    if 0 < nbytes < ALIGNMENT:
        raise StoreError(f"a host cache of {format_size(nbytes)} is less than one "
                         f"{format_size(ALIGNMENT)} page; give 0 for no host cache or at "
                         f"least {ALIGNMENT // 1024}KiB (--host-cache / host_cache=)")
    limit = memory_limit()
    if nbytes > limit:
        raise StoreError(f"a host cache of {format_size(nbytes)} does not fit this machine's "
                         f"{format_size(limit)} of memory; choose a smaller host cache "
                         "(--host-cache / host_cache=)")


def _make_medium(path: str, backing: dict[str, Any], engine: str, io_threads: int,
                 fresh: bool) -> Medium:
    """The backing tier; ``fresh`` (no segment committed yet) lets a pmem pool be made."""
    kind = backing.get("kind", "nvme")
    if kind == "nvme":
        from tierstore.nvme import SlabMedium

        return SlabMedium(path, slab_bytes=backing["slab_bytes"], engine=engine, threads=io_threads)
    if kind == "pmem":
        from tierstore.pmem import PoolMedium

        exists = os.path.exists(backing["pool"])
        if not exists and not fresh:
            raise StoreError(f"pmem pool {backing['pool']} of store {path} is missing; the "
                             "store's data is there: restore the file (or mount its device)")
        return PoolMedium(backing["pool"], create=not exists, size=backing.get("pool_bytes"),
                          threads=io_threads)
    raise NotAStoreError(f"store {path} names an unknown backing tier {kind!r}")


def open_store(
    path: str | os.PathLike[str],
    *,
    create: bool = False,
    backing: str | None = None,
    slab_size: int | str = "1GiB",
    pmem_path: str | os.PathLike[str] | None = None,
    pmem_size: int | str | None = None,
    engine: str = "auto",
    io_threads: int = 8,
    chunk_size: int | str = "8MiB",
    map_size: int | str = "1GiB",
    host_cache: int | str | None = "1GiB",
    policy: str = "lfu-decay",
    policy_args: dict[str, Any] | None = None,
    device_budget: int | str | Mapping[str, int | str] | None = None,
    cache_arena: torch.Tensor | None = None,
) -> LocalStore:
    """Open the store at ``path`` (``create=True`` makes it if missing).

    ``backing`` is ``"nvme"`` (slab files under the store directory, the default) or
    ``"pmem"`` (a libpmem pool at ``pmem_path`` of ``pmem_size``); it is recorded at
    creation, so reopening needs only the path. ``engine`` picks the NVMe I/O engine
    (``auto``: Linux AIO where the kernel allows it, else POSIX O_DIRECT on a thread pool;
    kvikio only when named, as it is unmeasured). ``host_cache`` is the host-memory
    cache's capacity (0 or None: no cache, every ``put`` is committed before it returns);
    ``policy`` names its eviction policy (``lfu-decay``, ``lru``, ``lfu``, ``arc``,
    ``semoe``) and ``policy_args`` its parameters. ``device_budget`` is the byte budget of
    the prefetch queues (:meth:`Store.prefetch`): one size for every device, or a mapping
    from a device (``"cpu"``, ``"cuda"``, ``"cuda:1"``) to its size; unset, it is 1 GiB on
    the CPU and half of a GPU's memory. Sizes take bytes or strings such as ``"2GiB"``.
    ``cache_arena`` is memory for the host cache's slots instead of a fresh allocation (a
    page-aligned flat uint8 tensor of at least ``host_cache`` bytes): the daemon passes a
    shared-memory mapping that its clients read.
    """
    path = os.path.abspath(os.fspath(path))
    marker = os.path.join(path, MARKER)
    chunk = parse_size(chunk_size)
    if chunk < ALIGNMENT or chunk % ALIGNMENT:
        raise StoreError(f"chunk_size must be a positive multiple of {ALIGNMENT}, got {chunk}")
    if engine not in ENGINES:  # checked for every backing: a typo is never ignored
        raise StoreError(f"unknown I/O engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "kvikio":  # before anything is made: a missing extra is one line
        try:
            import kvikio  # noqa: F401
        except ImportError as e:
            raise StoreError(f"the kvikio engine needs kvikio built for torch's CUDA (pip install "
                             f"'tierstore[gpu]' for CUDA 12, 'tierstore[gpu-cu13]' for CUDA 13): "
                             f"{e}") from None
    if io_threads < 1:
        raise StoreError("io_threads must be >= 1")
    cache_bytes = parse_size(host_cache or 0)
    check_host_cache(cache_bytes)  # before anything is made or opened
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotAStoreError(f"{path} is a file, not a store directory")
    if not os.path.exists(marker):
        if not create:
            what = "does not exist" if not os.path.exists(path) else "is not a tierstore store"
            raise NotAStoreError(f"{path} {what} (create it with `tierstore init {path}`)")
        leftovers = set(os.listdir(path)) if os.path.isdir(path) else set()
        if leftovers - {CATALOG_DIR, LOCK, "slabs", MARKER + ".tmp"}:
            raise NotAStoreError(f"{path} is a non-empty directory that is not a store")
        init_dir(path, backing or "nvme", slab_size, pmem_path, pmem_size, map_size)
    meta = read_marker(path)
    if backing is not None and backing != meta["backing"]["kind"]:
        raise StoreError(f"store {path} is backed by {meta['backing']['kind']}, not {backing}")
    lock_fd = lock(path)
    catalog = None
    try:
        catalog = Catalog(os.path.join(path, CATALOG_DIR), map_size=parse_size(map_size))
        check_identity(path, meta, catalog)
        return assemble(path, meta, catalog, lock_fd, engine=engine, io_threads=io_threads,
                        chunk_bytes=chunk, host_cache=cache_bytes, policy=policy,
                        policy_args=policy_args, device_budget=device_budget,
                        cache_arena=cache_arena)
    except BaseException as e:
        if catalog is not None:
            catalog.close()
        os.close(lock_fd)
        if isinstance(e, PermissionError):
            raise StoreError(f"{e.filename or path}: permission denied; open the store as the "
                             "user who owns it, or make its files writable") from None
        raise


def assemble(path: str, meta: dict[str, Any], catalog: Catalog, lock_fd: int, *,
             engine: str = "auto", io_threads: int = 8, chunk_bytes: int = 8 << 20,
             may_make_pool: bool = True, **options: Any) -> LocalStore:
    """The store at ``path`` (its marker ``meta``) over ``catalog``, already open and shown
    to be this store's, holding the lock ``lock_fd``: the store closes both when it closes;
    if this fails, the caller does. ``may_make_pool``: a pmem store whose catalog names no
    segment may make its pool. ``options`` go to :class:`LocalStore`."""
    with catalog.read() as txn:
        fresh = not catalog.segments(txn)
    medium = _make_medium(path, meta["backing"], engine, io_threads, fresh and may_make_pool)
    try:
        return LocalStore(path, catalog, medium, chunk_bytes=chunk_bytes, lock_fd=lock_fd,
                          io_threads=io_threads, **options)
    except BaseException:
        medium.close()
        raise
