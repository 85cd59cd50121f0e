"""Bytes in, same bytes out: every storable dtype, awkward shapes and sizes, ``out=``, devices."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import tierstore
from tierstore.tensors import DTYPES, element_size

CHUNK = 64 * 1024  # small chunk_size so chunk boundaries are cheap to hit
DTYPE_NAMES = sorted(DTYPES)

# complex32 is "experimental" in torch and warns on every allocation; the bytes are fine.
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _esize(dtype: torch.dtype) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return element_size(dtype)


def rand_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: every bit pattern (NaN payloads, bools that
    are neither 0 nor 1, subnormals) can show up."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    u8 = torch.randint(0, 256, (numel * _esize(dtype),), dtype=torch.uint8, generator=gen)
    return u8.view(dtype).reshape(shape)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as uint8 (works for 0-d and empty tensors)."""
    assert t.is_contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want_dtype: torch.dtype, want_shape: tuple[int, ...],
                want_bytes: torch.Tensor) -> None:
    assert got.dtype == want_dtype
    assert tuple(got.shape) == tuple(want_shape)
    assert got.device.type == "cpu"
    assert torch.equal(raw(got), want_bytes), "stored bytes came back different"


def shapes_for(dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
    es = _esize(dtype)
    return {
        "scalar": (),
        "empty": (0, 5),
        "one": (1,),
        "odd4097": (-(-4097 // es),),  # at least 4097 bytes, never a multiple of 4 KiB
        "odd2d": (3, 7, 11),
        "page": (4096 // es,),
        "chunk": (CHUNK // es,),
        "chunk_plus_1": (CHUNK // es + 1,),
        "multi_chunk": (3, -(-(CHUNK + 4097) // es)),
    }


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_every_dtype_and_shape_round_trips(make_store, cache_kw, dtype_name: str) -> None:
    """Read back three ways: right after the put (from the host cache, where there is one),
    after a reopen (from the backing tier), and once more (cached again)."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(DTYPE_NAMES.index(dtype_name))
    st = make_store(chunk_size=CHUNK, **cache_kw)
    written = {}
    for label, shape in shapes_for(dtype).items():
        t = rand_tensor(dtype, shape, gen)
        written[label] = (shape, raw(t).clone())
        st.put(f"{dtype_name}.{label}", t)
    for label, (shape, want) in written.items():
        assert_same(st.get(f"{dtype_name}.{label}"), dtype, shape, want)
    # the same bytes through the batched read path
    got = st.get_many([f"{dtype_name}.{label}" for label in written])
    for label, (shape, want) in written.items():
        assert_same(got[f"{dtype_name}.{label}"], dtype, shape, want)
    # and after a reopen, through a fresh medium (close writes cached entries back)
    st.close()
    st = make_store(st.path, reopen=True, **cache_kw)
    for _ in range(2):
        for label, (shape, want) in written.items():
            assert_same(st.get(f"{dtype_name}.{label}"), dtype, shape, want)
            info = st.info(f"{dtype_name}.{label}")
            assert info.dtype == dtype and info.shape == tuple(shape)
    report = st.fsck()
    assert report.ok, report.problems


def test_a_byte_view_keeps_the_contiguous_copy_it_is_over() -> None:
    """``as_bytes`` of a non-contiguous tensor views a contiguous copy of it; the view keeps
    that copy alive after the caller's tensor is gone and its memory handed out again."""
    from tierstore.tensors import as_bytes

    x = torch.arange(64 * 1024, dtype=torch.bfloat16).reshape(256, 256)
    want = x.t().contiguous().view(torch.uint8).reshape(-1).clone()
    view = as_bytes(x.t())
    del x
    reuse = [torch.full((256, 256), 7, dtype=torch.bfloat16) for _ in range(64)]
    assert torch.equal(torch.from_numpy(view.copy()), want) and len(reuse) == 64


def _torch_can_copy(dtype: torch.dtype) -> bool:
    """False for torch's placeholder dtypes (int1..int7, uint1..uint7): no copy kernels."""
    try:
        torch.zeros(2, 2 * _esize(dtype), dtype=torch.uint8).view(dtype).t().contiguous()
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_non_contiguous_input_round_trips(make_store, dtype_name: str) -> None:
    """A transposed and a strided-slice view are stored as their logical (row-major) bytes.

    Placeholder dtypes that torch itself cannot copy are refused with a clear
    UnsupportedTensorError (tensors.as_bytes documents that), never a raw torch error."""
    dtype = DTYPES[dtype_name]
    es = _esize(dtype)
    a, b = 37, 53
    gen = torch.Generator().manual_seed(7)
    u8 = torch.randint(0, 256, (a, b, es), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        # torch's strided copy normalises bool bytes to 0/1 (the value is the same), so only
        # canonical bools have one right answer here; contiguous bools keep every byte above.
        u8 &= 1
    x = u8.reshape(a, b * es).view(dtype)  # (a, b) of dtype over the same bytes
    transposed, sliced = x.t(), x[::2, 1::3]
    assert not transposed.is_contiguous() and not sliced.is_contiguous()
    want_t = u8.permute(1, 0, 2).contiguous().reshape(-1)
    want_s = u8[::2, 1::3].contiguous().reshape(-1)

    st = make_store(chunk_size=CHUNK)
    if not _torch_can_copy(dtype):
        for name, t in (("transposed", transposed), ("sliced", sliced)):
            with pytest.raises(tierstore.UnsupportedTensorError, match=dtype_name):
                st.put(name, t)
        assert st.keys() == []
        return
    st.put("transposed", transposed)
    st.put("sliced", sliced)
    assert_same(st.get("transposed"), dtype, (b, a), want_t)
    assert_same(st.get("sliced"), dtype, tuple(sliced.shape), want_s)
    st.close()
    st = make_store(st.path, reopen=True)
    assert_same(st.get("transposed"), dtype, (b, a), want_t)
    assert_same(st.get("sliced"), dtype, tuple(sliced.shape), want_s)


def test_page_aligned_input_is_stored_intact(make_store, cache_kw) -> None:
    """A page-aligned, page-multiple source takes the zero-copy write path."""
    n = 3 * CHUNK + 4096
    base = torch.empty(n + 4096, dtype=torch.uint8)
    skip = -base.data_ptr() % 4096
    t = base[skip : skip + n]
    assert t.data_ptr() % 4096 == 0
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    want = t.clone()
    st = make_store(chunk_size=CHUNK, **cache_kw)
    st.put("aligned", t)
    assert torch.equal(st.get("aligned"), want)
    t.fill_(0)  # the caller reuses its buffer: the store must hold its own copy
    assert torch.equal(st.get("aligned"), want)
    st.close()
    st = make_store(st.path, reopen=True, **cache_kw)
    assert torch.equal(st.get("aligned"), want)


def test_one_batch_of_aligned_and_staged_chunks_checksums_every_chunk(make_store) -> None:
    """One write-through batch where some chunks go from the caller's memory (their
    crc32c taken after their write lands) and others through staging buffers (taken as
    they are copied), with small neighbours joined into one request: every chunk's
    checksum is the one its bytes have, in order, after a reopen too."""
    gen = torch.Generator().manual_seed(5)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # bit for bit (random bits hold NaNs)
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def aligned(n: int) -> torch.Tensor:
        return tierstore.read_buffer(n).copy_(torch.randint(0, 256, (n,), dtype=torch.uint8,
                                                            generator=gen))

    vals = {
        "direct": aligned(4 * CHUNK),                 # every chunk from the source
        "direct-tail": aligned(2 * CHUNK + 1000),     # last chunk staged (not page-whole)
        "staged": rand_tensor(torch.float32, (3 * CHUNK // 4 + 7,), gen),  # unaligned
        **{f"small.{i}": aligned(4096 * (i + 1)) for i in range(6)},       # joined requests
        "small.staged": rand_tensor(torch.int16, (999,), gen),
        "empty": torch.empty(0),
    }
    st = make_store(chunk_size=CHUNK, host_cache=0)
    st.put_many(vals)
    want = {k: v.clone() for k, v in vals.items()}
    for v in vals.values():
        v.zero_()  # the store holds its own bytes once put_many returns
    assert all(same(st.get(k), w) for k, w in want.items())
    st.close()
    st = make_store(st.path, reopen=True, host_cache=0)
    report = st.fsck()
    assert report.ok, report.problems
    assert all(same(st.get(k), w) for k, w in want.items())


def test_a_batch_past_the_free_space_grows_and_a_failed_growth_gives_its_space_back(
        tmp_path) -> None:
    """A batch takes what fits in one step and grows new slabs for the rest; where growing
    fails part way, the space the batch had already taken is free again."""
    def vals(prefix: str, n: int) -> dict[str, torch.Tensor]:  # 256 KiB each
        return {f"{prefix}{i}": torch.full((64 << 10,), float(i)) for i in range(n)}

    first = vals("a", 6)  # 1.5 MiB over 1 MiB slabs: a slab and a half
    with tierstore.open(tmp_path / "s", create=True, host_cache=0, slab_size="1MiB") as st:
        st.put_many(first)
        assert all(torch.equal(st.get(k), v) for k, v in first.items())
        assert st.stats()["free_bytes"] == 512 << 10
        # The next slab's file is in the way, holding data nobody's catalog names.
        slabs = sorted((tmp_path / "s" / "slabs").iterdir())
        in_the_way = slabs[-1].with_name(f"slab-{len(slabs):06d}.dat")
        in_the_way.write_bytes(b"x" * 4096)
        with pytest.raises(tierstore.StoreError, match="holds data"):
            st.put_many(vals("b", 4))  # two fit the free half slab; the third must grow
        assert st.stats()["free_bytes"] == 512 << 10
        st.put_many(vals("c", 2))  # fits without growing: the space did come back
        in_the_way.unlink()
        st.put_many(vals("d", 4))
        assert not any(f"b{i}" in st for i in range(4))
        report = st.fsck()
        assert report.ok, report.problems
        for prefix, n in (("a", 6), ("c", 2), ("d", 4)):
            assert all(torch.equal(st.get(k), v) for k, v in vals(prefix, n).items())


def test_default_chunk_size_boundaries(make_store) -> None:
    """Exactly one 8 MiB chunk, one byte more, and one element more, at the default chunk."""
    st = make_store(host_cache=0)  # chunk_size defaults to 8 MiB; straight to the medium
    chunk = tierstore.parse_size("8MiB")
    gen = torch.Generator().manual_seed(11)
    cases = {
        "chunk": rand_tensor(torch.uint8, (chunk,), gen),
        "chunk_plus_1": rand_tensor(torch.uint8, (chunk + 1,), gen),
        "chunk_plus_elem": rand_tensor(torch.float32, (chunk // 4 + 1,), gen),
    }
    for name, t in cases.items():
        st.put(name, t)
    for name, t in cases.items():
        assert_same(st.get(name), t.dtype, tuple(t.shape), raw(t))
    st.close()
    st = make_store(st.path, reopen=True)
    for name, t in cases.items():
        assert_same(st.get(name), t.dtype, tuple(t.shape), raw(t))


def test_caller_may_modify_tensor_after_put(make_store, cache_kw) -> None:
    """put copies: changing the tensor afterwards changes nothing stored; and get returns
    the caller's own tensor, so changing it changes nothing stored either."""
    st = make_store(**cache_kw)
    t = torch.arange(1000, dtype=torch.float32)
    st.put("w", t)
    t.add_(1)
    got = st.get("w")
    assert torch.equal(got, torch.arange(1000, dtype=torch.float32))
    got.mul_(0)
    assert torch.equal(st.get("w"), torch.arange(1000, dtype=torch.float32))
    many = st.get_many(["w"])
    many["w"].fill_(7)
    assert torch.equal(st.get("w"), torch.arange(1000, dtype=torch.float32))
    st.flush()
    assert torch.equal(st.get("w"), torch.arange(1000, dtype=torch.float32))


@pytest.mark.slow
def test_entry_of_256_mib(make_store) -> None:
    """One entry larger than a slab (nvme: its own segment) and than the default pmem pool."""
    nbytes = (256 << 20) + 4097
    st = make_store(slab_size="32MiB")  # pmem: the pool grows to fit it
    gen = torch.Generator().manual_seed(256)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    st.put("small.before", torch.arange(10))
    st.put("big", t)
    st.put("small.after", torch.arange(20))
    info = st.info("big")
    assert info.nbytes == nbytes
    got = st.get("big")
    assert got.dtype == torch.uint8 and got.shape == t.shape
    assert torch.equal(got, t)
    del got
    report = st.fsck()  # writes back whatever the host cache holds, then reads it all
    assert report.ok, report.problems
    assert report.nbytes >= nbytes
    st.close()
    st = make_store(st.path, reopen=True)  # empty cache: the bytes come from the medium
    assert st.info("big").nbytes == nbytes
    got = st.get("big")
    assert torch.equal(got, t)
    del got
    assert torch.equal(st.get("small.before"), torch.arange(10))
    assert torch.equal(st.get("small.after"), torch.arange(20))


# -- out= and device= ----------------------------------------------------------------------
def test_get_into_out_fills_in_place(store) -> None:
    t = torch.randn(33, 65)
    store.put("w", t)
    out = torch.full((33, 65), float("nan"))
    ptr = out.data_ptr()
    got = store.get("w", out=out)
    assert got is out
    assert out.data_ptr() == ptr
    assert torch.equal(out, t)


def test_read_buffer_is_page_aligned_and_page_rounded() -> None:
    small = tierstore.read_buffer((3, 1000), torch.float32)
    assert small.shape == (3, 1000) and small.dtype == torch.float32
    assert small.data_ptr() % 4096 == 0 and small.untyped_storage().nbytes() == 12288
    big = tierstore.read_buffer(5 << 20)
    assert big.data_ptr() % (2 << 20) == 0  # where 2 MiB pages can back it
    assert tierstore.read_buffer((), torch.float64).shape == ()
    assert tierstore.read_buffer((0, 5), torch.bfloat16).shape == (0, 5)
    with pytest.raises(tierstore.UnsupportedTensorError):
        tierstore.read_buffer((-1, 2))


def test_small_read_buffers_share_huge_pages_and_keep_their_own_bytes(tmp_path) -> None:
    """Buffers of up to 1 MiB are cut from 2 MiB pages, one after another, each its own
    whole pages: a read into one (O_DIRECT fills whole pages) never touches the next."""
    bufs = [tierstore.read_buffer(100_000) for _ in range(40)]  # 24 pages each, 20 a page
    ptrs = [b.data_ptr() for b in bufs]
    assert all(p % 4096 == 0 for p in ptrs)
    pages = {p // (2 << 20) for p in ptrs}
    assert len(pages) <= 3  # 40 buffers on two or three 2 MiB pages, not forty
    assert sum(b - a == 102_400 for a, b in zip(ptrs, ptrs[1:])) >= 37
    vals = {f"e{i}": torch.full((100_000,), i, dtype=torch.uint8) for i in range(40)}
    with tierstore.open(tmp_path / "s", create=True, host_cache=0) as st:
        st.put_many(vals)
        got = st.get_many(list(vals), out=dict(zip(vals, bufs)))
    assert all(torch.equal(got[k], vals[k]) for k in vals)
    assert tierstore.read_buffer(3 << 20).data_ptr() % (2 << 20) == 0


def test_out_takes_the_read_itself_without_a_host_cache(tmp_path) -> None:
    """With no host cache, ``out=`` tensors that O_DIRECT can read into receive the read
    itself, as with ``cache=False``: the store takes no buffer of its own (none is left
    idle for reuse), where fresh results do take one."""
    vals = {f"e{i}": tierstore.read_buffer((64, 1024), torch.float32).normal_()
            for i in range(4)}  # 256 KiB each, page-aligned: written with no staging copy
    with tierstore.open(tmp_path / "s", create=True, host_cache=0) as st:
        st.put_many(vals)
        assert st._results.idle_bytes == 0
        outs = {k: tierstore.read_buffer((64, 1024), torch.float32) for k in vals}
        got = st.get_many(list(vals), out=outs)
        assert all(got[k] is outs[k] and torch.equal(outs[k], vals[k]) for k in vals)
        assert st._results.idle_bytes == 0
        fresh = st.get_many(list(vals))
        assert all(torch.equal(fresh[k], vals[k]) for k in vals)
        del fresh
        assert st._results.idle_bytes == 4 * 256 * 1024


def test_get_into_non_contiguous_out(store) -> None:
    t = torch.randn(8, 5)
    store.put("w", t)
    backing = torch.zeros(5, 8)
    out = backing.t()  # (8, 5), not contiguous
    store.get("w", out=out)
    assert torch.equal(out, t)
    assert torch.equal(backing, t.t())


def test_get_into_out_for_empty_and_scalar(store) -> None:
    store.put("empty", torch.empty(0, 5, dtype=torch.float16))
    store.put("scalar", torch.tensor(3.5, dtype=torch.float64))
    out_e = torch.empty(0, 5, dtype=torch.float16)
    assert store.get("empty", out=out_e) is out_e
    out_s = torch.tensor(0.0, dtype=torch.float64)
    store.get("scalar", out=out_s)
    assert out_s.item() == 3.5


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda: torch.zeros(33, 65, dtype=torch.float64), id="dtype"),
        pytest.param(lambda: torch.zeros(65, 33), id="shape-transposed"),
        pytest.param(lambda: torch.zeros(33 * 65), id="shape-flat"),
        pytest.param(lambda: torch.zeros(33, 65, 1), id="shape-extra-dim"),
        pytest.param(lambda: torch.zeros(33, 65, dtype=torch.bfloat16), id="dtype-same-size-class"),
    ],
)
def test_get_into_mismatched_out_raises(store, bad) -> None:
    store.put("w", torch.randn(33, 65))
    out = bad()
    before = out.clone()
    with pytest.raises(tierstore.ShapeMismatchError) as ei:
        store.get("w", out=out)
    assert isinstance(ei.value, ValueError)
    assert "'w'" in str(ei.value)
    assert torch.equal(out, before), "a rejected out= must not be written"


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), None])
def test_get_on_cpu_device(store, device) -> None:
    t = torch.arange(1000, dtype=torch.int32).reshape(10, 100)
    store.put("w", t)
    got = store.get("w", device=device)
    assert got.device.type == "cpu"
    assert torch.equal(got, t)
    many = store.get_many(["w"], device=device)
    assert torch.equal(many["w"], t)


@pytest.mark.gpu
def test_get_to_cuda_device(store) -> None:
    t = torch.randn(128, 64, dtype=torch.bfloat16)
    store.put("w", t)
    got = store.get("w", device="cuda")
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), t)
    out = torch.empty(128, 64, dtype=torch.bfloat16, device="cuda")
    assert store.get("w", out=out) is out
    assert torch.equal(out.cpu(), t)
    store.put("from_cuda", t.cuda())
    assert torch.equal(store.get("from_cuda"), t)
