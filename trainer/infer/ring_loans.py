"""The ring's slots as host-cache pins: a layer's borrows (:class:`Loan`), its experts while
the parts of a borrow still land (:class:`Streamed`, on :class:`Landing`, which the ring's
own slots share), and a borrow made in line (:class:`Done`). :mod:`trainer.infer.ring` uses them where the host cache holds the ring."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ..model import ExpertWeights, RoutedExperts


class Loan:
    """A layer's experts as lent: the borrows (futures of :class:`tierstore.Borrowed`) of
    its parts, consecutive experts each (one part when the layer was borrowed whole)."""

    __slots__ = ("parts", "settled")

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.settled = False  # every part had landed (or failed) when it was released

    def release(self) -> None:
        """Give back every part: those landed now, one still being read when it lands."""
        self.settled = True
        for f in self.parts:
            if f.done():
                release_when_done(f)
            else:
                # Released by the reading thread, maybe after a renewal was tried: such a
                # loan is never renewed (see renew).
                self.settled = False
                f.add_done_callback(release_when_done)

    def renewable(self) -> bool:
        """Whether :meth:`renew` may succeed: every part landed before the release and was
        lent from the host cache."""
        return self.settled and all(
            not f.cancelled() and f.exception() is None and f.result().renewable
            for f in self.parts)

    def renew(self) -> bool:
        """Pin every part again (see :meth:`tierstore.Borrowed.renew`), or none."""
        if not self.settled:
            return False
        renewed = []
        for f in self.parts:
            if f.cancelled() or f.exception() is not None or not f.result().renew():
                for b in renewed:
                    b.release()
                return False
            renewed.append(f.result())
        return True


class Landing(RoutedExperts):
    """A layer's routed experts while the parts that hold them still land: looking an
    expert up waits for its own part only, so the model (which applies experts in
    ascending id order) computes on the first part while the rest are read. A subclass
    says where an expert's part is (:meth:`_part`) and what its outcome holds
    (:meth:`_tensors`)."""

    def __init__(self, ring: Any, held: dict[int, ExpertWeights],
                 names: list[tuple[str, ...]], ids: Sequence[int]) -> None:
        self._ring, self._held, self._names = ring, held, names
        super().__init__(ids)

    @abc.abstractmethod
    def _part(self, e: int) -> Any:
        """The future (or :class:`Done`) of the part that holds expert ``e``."""

    def _tensors(self, landed: Any) -> dict[str, Any]:
        return landed

    def __getitem__(self, e: int) -> ExpertWeights:
        if e not in self._wanted:
            raise KeyError(e)
        ring = self._ring
        weights = self._held.get(e)
        if weights is None:
            part = self._part(e)
            ring.hits += part.done()
            tensors = self._tensors(ring._stalled(part))
            weights = self._held[e] = ring._weights(tensors, self._names[e])
        else:
            ring.hits += 1
        ring.accesses += 1
        return weights


class Streamed(Landing):
    """A layer's routed experts from the parts of a :class:`Loan` (host-cache borrows)."""

    def __init__(self, ring: Any, loan: Loan, held: dict[int, ExpertWeights],
                 names: list[tuple[str, ...]], ids: Sequence[int]) -> None:
        self._loan = loan
        super().__init__(ring, held, names, ids)

    def _part(self, e: int) -> Any:
        return self._loan.parts[e // self._ring._per_part]

    def _tensors(self, landed: Any) -> dict[str, Any]:
        return landed.tensors


class Done:
    """The settled outcome of a borrow made in line: the part of a Future the ring uses."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None) -> None:
        self.value: Any = value
        self.error: BaseException | None = None

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self.error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        fn(self)


def release_when_done(future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release()
