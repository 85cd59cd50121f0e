"""The extent allocator against a plain model of first fit: every allocation, release and
coalescing decision the same over long random sequences, across block splits (``_BLOCK``)
and several segments, with the blocks' bookkeeping checked along the way (each block's
bound on its largest hole may be high, never low)."""

from __future__ import annotations

import bisect
import random

import pytest

from tierstore import alloc
from tierstore.alloc import ExtentAllocator

_DEFAULT_BLOCK = alloc._BLOCK


class _Model:
    """First fit over one sorted list of (segment, offset) -> length, scanned hole by hole."""

    def __init__(self) -> None:
        self.holes: dict[tuple[int, int], int] = {}

    def release(self, seg: int, off: int, length: int) -> None:
        keys = sorted(self.holes)
        i = bisect.bisect_left(keys, (seg, off))
        if i < len(keys) and keys[i] == (seg, off + length):
            length += self.holes.pop(keys[i])
        if i and keys[i - 1][0] == seg and keys[i - 1][1] + self.holes[keys[i - 1]] == off:
            self.holes[keys[i - 1]] += length
            return
        self.holes[(seg, off)] = length

    def allocate(self, nbytes: int) -> tuple[int, int] | None:
        for key in sorted(self.holes):
            length = self.holes[key]
            if length >= nbytes:
                del self.holes[key]
                if length > nbytes:
                    self.holes[(key[0], key[1] + nbytes)] = length - nbytes
                return key
        return None


def _check(a: ExtentAllocator, model: _Model) -> None:
    got = {(seg, off): n for seg, h in a._holes.items() for off, n in h.lens.items()}
    assert got == model.holes
    for h in a._holes.values():
        flat = [o for b in h._blocks for o in b]
        assert flat == sorted(h.lens) and all(h._blocks)
        assert h._firsts == [b[0] for b in h._blocks]
        assert all(m >= max(h.lens[o] for o in b) for m, b in zip(h._maxes, h._blocks))
        assert all(len(b) <= 2 * alloc._BLOCK for b in h._blocks)
        assert all(a + h.lens[a] < b for a, b in zip(flat, flat[1:]))  # coalesced, apart


@pytest.mark.parametrize("block", [2, 8, _DEFAULT_BLOCK])
@pytest.mark.parametrize("seed", range(4))
def test_first_fit_matches_the_plain_model(seed: int, block: int, monkeypatch) -> None:
    monkeypatch.setattr(alloc, "_BLOCK", block)
    rng = random.Random(seed)
    page = 4096
    a, model = ExtentAllocator(page), _Model()
    for seg in range(3):
        a.add(seg, 0, 4096 * page)
        model.release(seg, 0, 4096 * page)
    live: list[tuple[int, int, int]] = []
    for step in range(4000):
        # Mostly small allocations with frees in random order: hundreds of holes, so the
        # blocks split and empty; now and then a large one that must pass them all.
        if live and rng.random() < 0.45:
            seg, off, n = live.pop(rng.randrange(len(live)))
            a.release([(seg, off, n)])
            model.release(seg, off, n)
        else:
            n = page * (rng.choice([1, 2, 3, 5, 8]) if rng.random() < 0.95
                        else rng.randrange(50, 400))
            got = a.allocate(n)
            assert got == model.allocate(n)
            if got is not None:
                live.append((*got, n))
        if step % 97 == 0 or step > 3900:
            _check(a, model)
    if block < _DEFAULT_BLOCK:
        assert max(len(h._blocks) for h in a._holes.values()) > 1  # the blocks did split
    for seg, off, n in live:
        a.release([(seg, off, n)])
    assert a.free_bytes() == 3 * 4096 * page
    assert {s: dict(h.lens) for s, h in a._holes.items()} == {s: {0: 4096 * page} for s in range(3)}


def test_a_fit_behind_many_small_holes_is_found_past_them() -> None:
    """Thousands of one-page holes ahead of the only extent that fits: first fit finds it
    (and takes nothing else), and freeing what was taken merges it back."""
    page = 4096
    a = ExtentAllocator(page)
    for i in range(5000):
        a.add(0, 2 * i * page, page)
    a.add(0, 10_000 * page, 64 * page)
    assert a.allocate(2 * page) == (0, 10_000 * page)
    assert a.free_bytes() == (5000 + 62) * page
    a.release([(0, 10_000 * page, 2 * page)])
    assert a._holes[0].lens[10_000 * page] == 64 * page


def test_a_fragmented_store_keeps_its_allocator_equal_to_its_free_map(tmp_path, monkeypatch) -> None:
    """Through the store: puts of mixed sizes over each other and deletes leave hundreds of
    holes (blocks of two, so they split and empty all the time); every entry reads back,
    the allocator's holes equal the durable free map, fsck is clean, and so after a
    reopen, which loads the allocator from that map."""
    import torch

    import tierstore

    monkeypatch.setattr(alloc, "_BLOCK", 2)
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    kw = dict(host_cache=0, slab_size="4MiB", chunk_size="64KiB", io_threads=2)
    want: dict[str, torch.Tensor] = {}

    def holes(st: tierstore.Store) -> tuple[dict, dict]:
        inner = getattr(st, "_store", st)
        mine = {(s, o): n for s, h in inner._alloc._holes.items() for o, n in h.lens.items()}
        with inner._catalog.read() as txn:
            durable = {(s, o): n for s, o, n in inner._catalog.free_extents(txn)}
        return mine, durable

    with tierstore.open(tmp_path / "s", create=True, **kw) as st:
        for _ in range(600):
            name = f"e{rng.randrange(150)}"
            if name in want and rng.random() < 0.3:
                st.delete(name)
                del want[name]
                continue
            batch = {name: torch.randint(0, 255, (rng.choice([1, 3, 9, 16]) * 4096,),
                                         dtype=torch.uint8, generator=gen)}
            st.put_many(batch)
            want.update(batch)
        mine, durable = holes(st)
        assert mine == durable and len(durable) > 20, len(durable)
        assert max(len(h._blocks) for h in getattr(st, "_store", st)._alloc._holes.values()) > 4
        assert all(torch.equal(st.get(k), v) for k, v in want.items())
        assert st.fsck().ok
    with tierstore.open(tmp_path / "s", **kw) as st:
        mine, durable = holes(st)
        assert mine == durable
        assert all(torch.equal(st.get(k), v) for k, v in want.items())
        st.put_many({f"n{i}": torch.ones(i + 1) for i in range(40)})  # into the holes
        assert st.fsck().ok
