"""Power-of-two slots carved out of one host allocation: a binary buddy allocator.

Why this shape:
- One allocation, pinned once when CUDA is present: pinning is slow and pinned memory is
  scarce, so the cache never allocates or pins per entry.
- Slots are power-of-two multiples of a 4 KiB page and aligned to their own size, which
  keeps every slot page-aligned (O_DIRECT and GPU DMA want that) and lets a freed slot
  merge with its free "buddy" in O(log n), so memory freed by small entries becomes usable
  by large ones again.
- Internal fragmentation is the price: an entry uses the next power of two, so up to just
  under half of a slot can be idle (none for power-of-two sizes, which most expert tensors
  have; 12.5% for e.g. a 112 MiB tensor in a 128 MiB slot). Finer classes would waste less
  inside slots but could not merge, and a cache whose entry mix shifts (params, then fp32
  optimizer states) would strand memory in the wrong class; merging is worth more here.
- The arena is the capacity rounded down to whole pages, split into one top-level block per
  set bit of the page count (e.g. 48 KiB = 32 KiB + 16 KiB), so none of it is wasted; an
  entry larger than the largest top-level block can never be cached.

External fragmentation is handled by the cache's eviction (see ``anchor``): to free a slot
of order k it evicts the aligned order-k block around a victim, which always succeeds if
that block holds only evictable entries.

Offsets and sizes here are in pages; the allocator owns no memory and is not thread-safe
(the cache calls it under its lock).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PAGE", "BuddyAllocator", "Claim"]

#: Slot granularity and alignment in bytes.
PAGE = 4096


@dataclass
class Claim:
    """An aligned block set aside for an entry while its occupants are written back.

    The block's free fragments are taken off the free lists (nobody else can allocate
    them); its allocated occupants stay allocated until ``commit``.
    """

    start: int
    order: int
    fragments: list[tuple[int, int]] = field(default_factory=list)


class BuddyAllocator:
    """Allocate power-of-two page blocks from an arena of ``total_bytes`` (rounded down)."""

    def __init__(self, total_bytes: int) -> None:
        pages = int(total_bytes) // PAGE
        if pages < 1:
            raise ValueError(f"capacity {total_bytes} is smaller than one {PAGE}-byte page")
        self.pages = pages
        self._free: list[set[int]] = [set() for _ in range(pages.bit_length())]
        self._free_order: dict[int, int] = {}
        self._alloc: dict[int, int] = {}
        self.allocated_pages = 0
        self.tops: list[tuple[int, int]] = []
        start = 0
        for order in range(pages.bit_length() - 1, -1, -1):
            if pages >> order & 1:
                self.tops.append((start, order))
                self._add_free(start, order)
                start += 1 << order
        self.max_order = self.tops[0][1]

    @staticmethod
    def order_for(nbytes: int) -> int:
        """The smallest order whose block holds ``nbytes`` (zero bytes still take a page)."""
        pages = max(1, -(-int(nbytes) // PAGE))
        return (pages - 1).bit_length()

    # free lists
    def _add_free(self, start: int, order: int) -> None:
        self._free[order].add(start)
        self._free_order[start] = order

    def _remove_free(self, start: int, order: int) -> None:
        self._free[order].discard(start)
        del self._free_order[start]

    def _release(self, start: int, order: int) -> None:
        while True:
            buddy = start ^ (1 << order)
            if self._free_order.get(buddy) != order:
                break
            self._remove_free(buddy, order)
            start = min(start, buddy)
            order += 1
        self._add_free(start, order)

    # allocation
    def can_alloc(self, order: int) -> bool:
        return any(self._free[o] for o in range(order, len(self._free)))

    def alloc(self, order: int) -> int | None:
        """Allocate a block of ``order``; its start page, or None when no block is free."""
        for have in range(order, len(self._free)):
            if self._free[have]:
                start = next(iter(self._free[have]))
                self._remove_free(start, have)
                for split in range(have - 1, order - 1, -1):
                    self._add_free(start + (1 << split), split)
                self._alloc[start] = order
                self.allocated_pages += 1 << order
                return start
        return None

    def free(self, start: int) -> None:
        order = self._alloc.pop(start)
        self.allocated_pages -= 1 << order
        self._release(start, order)

    def order_of(self, start: int) -> int:
        return self._alloc[start]

    # eviction support
    def anchor(self, start: int, order: int) -> tuple[int, int] | None:
        """The block that evicting the slot at ``start`` frees toward an ``order`` slot.

        A slot at least that large is itself the block. A smaller slot lies in exactly one
        aligned block of ``order``; freeing that block means evicting everything in it.
        None when that block would cross a top-level block (it cannot exist).
        """
        have = self._alloc[start]
        if have >= order:
            return start, have
        for top_start, top_order in self.tops:
            if top_start <= start < top_start + (1 << top_order):
                if top_order < order:
                    return None
                return start & ~((1 << order) - 1), order
        return None

    def occupants(self, start: int, order: int) -> list[int] | None:
        """Start pages of the allocated slots inside a block; None if any of it is claimed."""
        end = start + (1 << order)
        found = []
        page = start
        while page < end:
            have = self._alloc.get(page)
            if have is not None:
                found.append(page)
                page += 1 << have
                continue
            have = self._free_order.get(page)
            if have is None:
                return None
            page += 1 << have
        return found

    def claim(self, start: int, order: int) -> Claim:
        """Set a block aside: take its free fragments off the free lists."""
        claim = Claim(start, order)
        end = start + (1 << order)
        page = start
        while page < end:
            have = self._alloc.get(page)
            if have is None:
                have = self._free_order[page]
                self._remove_free(page, have)
                claim.fragments.append((page, have))
            page += 1 << have
        return claim

    def commit(self, claim: Claim, order: int) -> int:
        """Drop the claimed block's occupants and allocate an ``order`` slot at its start."""
        end = claim.start + (1 << claim.order)
        page = claim.start
        fragments = dict(claim.fragments)
        while page < end:
            have = fragments.get(page)
            if have is None:
                have = self._alloc.pop(page)
                self.allocated_pages -= 1 << have
            page += 1 << have
        self._alloc[claim.start] = order
        self.allocated_pages += 1 << order
        for split in range(order, claim.order):
            self._release(claim.start + (1 << split), split)
        return claim.start

    def cancel(self, claim: Claim) -> None:
        """Give a claim's free fragments back."""
        for start, order in claim.fragments:
            self._release(start, order)
        claim.fragments.clear()

    @property
    def free_pages(self) -> int:
        return sum(len(starts) << order for order, starts in enumerate(self._free))
