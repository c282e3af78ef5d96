"""The engine's page lists and the segments they become: normalising and coalescing.

``as_pages`` turns the page indices an engine hands over (a list, tuple or range of ints, a 1-D
integer numpy array or tensor) into exact Python ints, one ascending run as a ``PageRun``;
``as_index`` does the same for an aux slot, rank or count. ``coalesce`` turns a write's page pairs
into as few contiguous segments as possible, the form the data plane takes.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfsm.protocol import LocalProtocolError
from kvfsm.protocol.pages import PageRun, Pages, known_run, page_summary, run_bytes, run_of
from kvfsm.transport.base import Segment, SegmentArray

# Pages in a chunk from which one that is not a single run is coalesced with numpy, into a
# SegmentArray (no Segment object per run; the NIXL data plane reads its arrays whole). Below it
# numpy's fixed costs outweigh the per-run ones (measured with bench/core.py's stub agent:
# scattered 32-page chunks 80 µs each with numpy, 69 without; 64 pages 88 against 97).
COALESCE_ARRAY_MIN = 64
_SHORTEST = 2  # an engine's run of this many pages or more becomes a PageRun (as_pages)


def _is_run(pages: Sequence[int]) -> bool:
    """Are ``pages`` (at least one) one ascending run? O(1) for a PageRun, and for pages whose
    ends rule it out (a scattered destination's, as often as not); ``page_summary`` otherwise
    (256 pages in reverse order: 8.5 µs here for its minimum, maximum and distinctness)."""
    if type(pages) is PageRun:
        return True
    return pages[-1] - pages[0] == len(pages) - 1 and page_summary(pages)[3]


def _page_array(pages: Sequence[int]) -> np.ndarray:
    """Pages as an int64 array (read-only). A PageRun's is a view of its bytes (``run_bytes``:
    256 pages 0.6 µs here, against 6.9 through the sequence protocol). ``np.arange`` would cost
    less, but it drops the GIL: in the stub harness the engine then waited for the poller, 16
    µs per scattered chunk of 256 pages more than before rather than 6 less."""
    if type(pages) is PageRun and len(pages):
        raw = run_bytes(pages[0], len(pages))
        if raw is not None:
            return np.frombuffer(raw, dtype=np.int64)
    return np.asarray(pages, dtype=np.int64)


def coalesce(
    src_pages: Sequence[int], dst_pages: Sequence[int], page_bytes: int, *, one_run: bool = False
) -> Sequence[Segment]:
    """Turn page pairs into as few contiguous segments as possible (one per run): a list, or a
    ``SegmentArray`` for ``COALESCE_ARRAY_MIN`` pages or more that are not one run on both
    sides. ``one_run``: the caller already knows both lists are one ascending run each
    (``PostWrite.contiguous``)."""
    n = len(src_pages)
    if n and n == len(dst_pages):
        s0, d0 = src_pages[0], dst_pages[0]
        if one_run or (_is_run(src_pages) and _is_run(dst_pages)):
            return [Segment(s0 * page_bytes, d0 * page_bytes, n * page_bytes)]  # fast path: one run
        if n >= COALESCE_ARRAY_MIN:
            src = _page_array(src_pages)
            dst = _page_array(dst_pages)
            # a run ends where either side stops ascending by one
            starts = np.flatnonzero(np.concatenate(([True], (np.diff(src) != 1) | (np.diff(dst) != 1))))
            counts = np.diff(np.append(starts, n))
            return SegmentArray(src[starts] * page_bytes, dst[starts] * page_bytes, counts * page_bytes)
    segs: list[Segment] = []
    run_s = run_d = run_n = 0
    for s, d in zip(src_pages, dst_pages, strict=True):
        if run_n and s == run_s + run_n and d == run_d + run_n:
            run_n += 1
            continue
        if run_n:
            segs.append(Segment(run_s * page_bytes, run_d * page_bytes, run_n * page_bytes))
        run_s, run_d, run_n = s, d, 1
    if run_n:
        segs.append(Segment(run_s * page_bytes, run_d * page_bytes, run_n * page_bytes))
    return segs


def as_pages(pages: Any) -> Pages:
    """Page indices as exact Python ints, whatever the engine holds them in: a list, tuple or
    range of ints, or a 1-D integer array (numpy, torch: SGLang passes ``kv_indices`` as numpy).
    This is the one normalisation of a chunk's pages: the rest of the path (the chunk's event,
    the fast rows, the writes, ``coalesce``) carries what it returns and never checks the pages
    again. One ascending run of two pages or more becomes a PageRun, so that "is it one run?"
    costs nothing afterwards (the check is done here, in C: a range by construction, an array
    vectorised, a list packed to int64 in one call); anything else a tuple. Anything that is not integers (floats, bools,
    nested lists, strings) raises LocalProtocolError before the room changes: a numpy scalar
    left in a page list would otherwise fail only when the message is encoded, after the room
    had already moved on."""
    if type(pages) is list or type(pages) is tuple:  # the usual inputs
        if len(pages) >= _SHORTEST and _is_list_run(pages):
            return known_run(pages[0], len(pages))
    else:
        if type(pages) is range and pages.step == 1 and pages.start >= 0:
            return run_of(pages.start, len(pages), _SHORTEST)  # one ascending run by construction: no check
        array_run = _array_run(pages)
        if array_run is not None:
            return array_run
        tolist = getattr(pages, "tolist", None)
        if tolist is not None and not isinstance(pages, list | tuple | range):
            pages = tolist()  # a tensor, or an array that is not one run
            if type(pages) is list and len(pages) >= _SHORTEST:
                run = _list_run(pages)
                if run is not None:
                    return run
        if isinstance(pages, str | bytes) or not hasattr(pages, "__iter__"):
            raise LocalProtocolError(f"page indices must be integers, not {type(pages).__name__}")
    t = pages if type(pages) is tuple else tuple(pages)
    if t and [*map(type, t)].count(int) != len(t):  # not all exact ints (a C loop; a set of types costs more)
        try:
            t = tuple(_as_int(p) for p in t)
        except TypeError as exc:
            raise LocalProtocolError(f"page indices must be integers: {exc}") from None
    return t


def _list_run(pages: list[Any] | tuple[Any, ...]) -> PageRun | None:
    """A list or tuple that is one ascending run of pages >= 0, as a PageRun, else None (the
    general path checks and converts it); see ``_is_list_run``."""
    return known_run(pages[0], len(pages)) if _is_list_run(pages) else None


def _is_list_run(pages: list[Any] | tuple[Any, ...]) -> bool:
    """Is a list or tuple of at least two items one ascending run of pages >= 0? Checked in C:
    a ``struct.Struct`` of that many int64s packs every item as an integer (``__index__``: a
    float, string or None raises ``struct.error``) and its bytes are compared with the run's
    (``run_bytes``); 2.6x cheaper than ``array("q", pages)`` for 1,024 pages (5.8 µs against
    15.3 here), which converts each item through a generic argument parser. The first two items
    must be exact ints: in an ascending run from >= 0 only they can equal 0 or 1, so no bool
    (which packs as 0 or 1) passes for a page."""
    first, second = pages[0], pages[1]
    if type(first) is not int or type(second) is not int or first < 0 or second != first + 1:
        return False
    n = len(pages)
    want = run_bytes(first, n)
    if want is None:
        return False
    try:
        return _int64s(n).pack(*pages) == want
    except struct.error:
        return False


@functools.lru_cache(maxsize=256)
def _int64s(n: int) -> struct.Struct:
    """The packer of ``n`` native int64s (``_is_list_run``), by chunk length (an engine's chunks
    come in a few lengths)."""
    return struct.Struct(f"{n}q")


def _array_run(pages: Any) -> Pages | None:
    """A 1-D numpy integer array that is one ascending run of pages >= 0, as its pages
    (checked in C against the run's bytes, no int per page built), else None (the general path
    handles it)."""
    dtype = getattr(pages, "dtype", None)
    if getattr(dtype, "kind", None) not in ("i", "u") or getattr(pages, "ndim", None) != 1:
        return None  # not numpy (torch dtypes have no kind), or not integers
    n = len(pages)
    if not n:
        return ()
    lo = int(pages[0])
    if lo < 0 or int(pages[-1]) - lo != n - 1:
        return None
    want = run_bytes(lo, n)
    if want is None:
        if n > 1 and not bool((pages[1:] - pages[:-1] == 1).all()):
            return None
    elif pages.astype(np.int64, copy=False).tobytes() != want:
        return None
    return run_of(lo, n, _SHORTEST)


def as_index(x: Any, what: str) -> int:
    """An aux slot, rank or count as a Python int (numpy and torch integers too);
    LocalProtocolError naming ``what`` if it is not an integer."""
    try:
        return _as_int(x)
    except TypeError as exc:
        raise LocalProtocolError(f"{what} must be an integer: {exc}") from None


def _as_int(x: Any) -> int:
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        raise TypeError(f"{x!r} is a boolean")
    return operator.index(x)
