"""Page lists: ``PageRun`` (an ascending run held as its first page and length) and
``page_summary`` (lowest, highest, distinct, one run) that the guards read.

Theory of operation
-------------------
A chunk's pages and a decode rank's announcement are sequences of page indices. Most are one
ascending run (an engine allocates KV pages in order while it can). Held as a tuple, every step
of a 4096-page chunk (256 MiB of 64 KiB pages) pays per page: building the tuple, checking it is
a run, slicing the announcement for the destination pages (measured here: ~150 µs of a 230 µs
hand-over, against ~40 µs for a 16-page chunk). ``PageRun`` holds such a run as (first, length):
length, slicing, indexing and the summary cost the same for any length.

A PageRun is a drop-in for the tuple of its pages: it iterates, indexes and slices like one, is
equal to that tuple (and to any PageRun of the same pages) and hashes like it, so records that
hold one compare and hash as before (the model checker, duplicate detection). It is made where a
run is known or checked at no per-page cost in Python: a ``range`` or an integer array the
engine hands over, a list checked as one run in C (``kvfsm.runtime.pages.as_pages``), and
beside a decode rank's announced tuple once per room (``Announcement.span``: a long chunk
slices the span, a short one the tuple). An engine's chunk is a PageRun from two pages on
(``as_pages``: the one form its path carries, so that "is it one run?" is a type test); slices
and decoded messages shorter than ``RUN_MIN`` pages are tuples, which cost less there.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias, overload

# Page lists of at least this many pages are worth checking for a run and holding as a PageRun.
RUN_MIN = 32
# The int64 bytes of the pages 0, 1, 2, ...: a run's expected bytes are a slice of it (grown on
# demand, doubling, up to RUN_BYTES_MAX pages: 8 MiB).
_RUN_BYTES = array("q", range(1 << 12)).tobytes()
RUN_BYTES_MAX = 1 << 20


_new = object.__new__


class PageRun(Sequence[int]):
    """The pages ``first, first + 1, ..., first + len - 1`` (``first`` >= 0), as a tuple of them
    would behave, at a cost independent of the length."""

    __slots__ = ("_r",)

    def __init__(self, first: int, n: int) -> None:
        if first < 0 or n < 0:
            raise ValueError(f"PageRun({first}, {n}): first page and length must be >= 0")
        self._r = range(first, first + n)

    def __len__(self) -> int:
        return len(self._r)

    def __iter__(self) -> Iterator[int]:
        return iter(self._r)

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._r)

    def __contains__(self, x: object) -> bool:
        return x in self._r

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> PageRun | tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | PageRun | tuple[int, ...]:
        if type(i) is slice:
            r = self._r[i]
            if r.step != 1 or len(r) < RUN_MIN:
                return tuple(r)  # short runs stay tuples (see the module docstring)
            run = _new(PageRun)  # (no __init__: the bounds are known good)
            run._r = r
            return run
        return self._r[i]

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        i = self._r.index(value)
        if i < start or (stop is not None and i >= stop):
            raise ValueError(f"{value!r} is not in the pages")
        return i

    def count(self, value: Any) -> int:
        return self._r.count(value)

    def __eq__(self, other: object) -> bool:
        if type(other) is PageRun:
            return self._r == other._r
        if type(other) is tuple:
            r = self._r
            return len(other) == len(r) and (not other or (other[0] == r.start and other == tuple(r)))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._r))  # as the equal tuple hashes (rare: model states, sets)

    def _cmp(self, other: object) -> tuple[int, ...] | None:
        if type(other) is PageRun:
            return tuple(other._r)
        return other if type(other) is tuple else None

    def __lt__(self, other: object) -> bool:
        o = self._cmp(other)
        return NotImplemented if o is None else tuple(self._r) < o

    def __le__(self, other: object) -> bool:
        o = self._cmp(other)
        return NotImplemented if o is None else tuple(self._r) <= o

    def __gt__(self, other: object) -> bool:
        o = self._cmp(other)
        return NotImplemented if o is None else tuple(self._r) > o

    def __ge__(self, other: object) -> bool:
        o = self._cmp(other)
        return NotImplemented if o is None else tuple(self._r) >= o

    def __add__(self, other: object) -> tuple[int, ...]:
        if isinstance(other, PageRun | tuple):
            return (*self._r, *other)
        return NotImplemented

    def __radd__(self, other: object) -> tuple[int, ...]:
        if type(other) is tuple:
            return (*other, *self._r)
        return NotImplemented

    def __repr__(self) -> str:
        r = self._r
        if len(r) <= 8:
            return repr(tuple(r))
        return f"({r.start}, {r.start + 1}, ..., {r.stop - 1})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PageRun, (self._r.start, len(self._r)))


# A page list: a tuple of page indices, or a PageRun standing for one.
Pages: TypeAlias = tuple[int, ...] | PageRun

EMPTY_SUMMARY = (0, -1, True, True)
_SUMMARY: tuple[Any, tuple[int, int, bool, bool]] = ((), EMPTY_SUMMARY)  # the last tuple summarised


def known_run(first: int, n: int) -> PageRun:
    """The PageRun of pages first, ..., first + n - 1 where the caller has checked ``first`` >= 0
    and ``n`` >= 0 (no ``__init__`` and its checks: the engine's per-chunk path builds one)."""
    run = _new(PageRun)
    run._r = range(first, first + n)
    return run


def run_of(first: int, n: int, shortest: int = RUN_MIN) -> Pages:
    """The pages first, first + 1, ..., first + n - 1 (``first`` >= 0): a PageRun from
    ``shortest`` pages on, else a tuple."""
    if n >= shortest:
        return known_run(first, n)
    return tuple(range(first, first + n))


def run_bytes(first: int, n: int) -> bytes | None:
    """The pages first, ..., first + n - 1 (``first`` >= 0) as native int64 bytes, to compare an
    engine's page list with in C (``array("q", pages).tobytes() == run_bytes(...)``: no per-page
    Python object compared, and no call that drops the GIL, as numpy's ufuncs do for long
    arrays); None past RUN_BYTES_MAX pages."""
    global _RUN_BYTES
    hi = first + n
    rb = _RUN_BYTES  # (one read: another thread may replace it meanwhile)
    if hi * 8 > len(rb):
        if hi > RUN_BYTES_MAX:
            return None
        size = len(rb) // 8
        while size < hi:
            size *= 2
        rb = array("q", range(min(size, RUN_BYTES_MAX))).tobytes()
        if len(rb) > len(_RUN_BYTES):
            _RUN_BYTES = rb
    return rb[first * 8 : hi * 8]


def page_summary(pages: Sequence[int]) -> tuple[int, int, bool, bool]:
    """(lowest, highest, all distinct, one ascending run) of a page list. O(1) for a PageRun.
    The guards of one step read it several times and it is O(pages) for a tuple, so the last
    tuple's summary is kept (by identity: a tuple is immutable). One ascending run is recognised
    by a comparison in C."""
    global _SUMMARY
    last = _SUMMARY
    if last[0] is pages:
        return last[1]
    if type(pages) is PageRun:
        r = pages._r
        return (r.start, r.stop - 1, True, True) if r else EMPTY_SUMMARY
    n = len(pages)
    if not n:
        summary = EMPTY_SUMMARY
    elif pages[-1] - pages[0] == n - 1 and tuple(pages) == tuple(range(pages[0], pages[0] + n)):
        summary = (pages[0], pages[-1], True, True)
    else:
        summary = (min(pages), max(pages), len(set(pages)) == n, False)
    if type(pages) is tuple:  # immutable: safe to remember by identity
        _SUMMARY = (pages, summary)
    return summary


def long_run(pages: Pages) -> PageRun | None:
    """``pages`` as a PageRun if they are one ascending run of at least RUN_MIN pages from
    page >= 0, else None."""
    if type(pages) is PageRun:
        return pages
    n = len(pages)
    if n >= RUN_MIN:
        lo, _, _, run = page_summary(pages)
        if run and lo >= 0:
            return PageRun(lo, n)
    return None
