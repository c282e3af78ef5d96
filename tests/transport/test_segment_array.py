"""``SegmentArray`` (many segments as numpy arrays) and the vectorised paths that take it: the
runtime's ``coalesce`` of long scattered chunks and the NIXL data plane's block indices. Each is
checked against a plain per-segment reference."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.runtime.pages import COALESCE_ARRAY_MIN, as_pages, coalesce
from kvfsm.transport.base import Parts, Segment, SegmentArray, TransportError, check_parts, check_segments

segments_st = st.lists(st.builds(Segment, st.integers(-3, 200), st.integers(-3, 200), st.integers(-3, 60)), max_size=12)


def test_a_segment_array_is_a_sequence_of_segments() -> None:
    segs = [Segment(0, 64, 8), Segment(8, 0, 0), Segment(40, 16, 24)]
    arr = SegmentArray.of(segs)
    assert len(arr) == 3 and list(arr) == segs and arr[1] == segs[1] and arr[-1] == segs[-1]
    assert list(arr[1:]) == segs[1:] and isinstance(arr[1:], SegmentArray)
    assert all(type(s.src) is int for s in arr)  # Python ints, as a Segment holds them
    nonempty = arr.nonempty()
    assert arr.total() == 32 and list(nonempty) == [segs[0], segs[2]]
    assert nonempty.nonempty() is nonempty  # all of it moves bytes: itself
    with pytest.raises(ValueError, match="one length"):
        SegmentArray([0, 1], [0], [1, 1])
    with pytest.raises(ValueError, match="1-D"):
        SegmentArray([[0]], [[0]], [[1]])


@given(segments_st, st.integers(0, 260), st.integers(0, 260))
def test_check_segments_on_arrays_agrees_with_segments(segs: list[Segment], local: int, remote: int) -> None:
    """The same total, or the same refusal naming the same first bad segment."""
    try:
        want: int | str = check_segments(segs, local, remote, "w")
    except TransportError as exc:
        want = str(exc)
    try:
        got: int | str = check_segments(SegmentArray.of(segs), local, remote, "w")
    except TransportError as exc:
        got = str(exc)
    assert got == want


def _runs(src: list[int], dst: list[int], page: int) -> list[Segment]:
    """The reference: maximal runs where both sides ascend by one page."""
    out: list[Segment] = []
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        out.append(Segment(src[i] * page, dst[i] * page, (j - i) * page))
        i = j
    return out


@st.composite
def _page_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Page lists with runs of random lengths on each side (up to ~3x COALESCE_ARRAY_MIN)."""
    sides = []
    for _ in range(2):
        pages: list[int] = []
        want = draw(st.integers(1, 3 * COALESCE_ARRAY_MIN))
        if draw(st.booleans()):  # one run on this side (the engine's side, as often as not)
            start = draw(st.integers(0, 5000))
            pages = list(range(start, start + want))
        while len(pages) < want:
            start, n = draw(st.integers(0, 5000)), draw(st.integers(1, 9))
            pages += range(start, start + n)
        sides.append(pages)
    n = min(len(sides[0]), len(sides[1]))
    return sides[0][:n], sides[1][:n]


@given(_page_pairs(), st.sampled_from([1, 64, 4096]))
def test_coalesce_gives_the_maximal_runs_whatever_its_form(pairs: tuple[list[int], list[int]], page: int) -> None:
    src, dst = pairs
    for form in (tuple, as_pages):  # tuples, and as the runtime holds them (a PageRun for a long run)
        got = coalesce(form(src), form(dst), page)
        assert list(got) == _runs(src, dst, page)
        one_run = len(got) == 1
        assert isinstance(got, SegmentArray) == (len(src) >= COALESCE_ARRAY_MIN and not one_run)


def test_block_indices_from_arrays_match_the_per_segment_reference() -> None:
    """Random writes and reads of block-aligned runs (one block or several each), as Segments and
    as a SegmentArray: the same indices as a run-by-run expansion; any misaligned segment, or
    too few runs for the prepared lists to pay, gives None."""
    from kvfsm.transport.nixl.plan import _block_indices, use_prepped

    block = 64
    rng = random.Random(11)
    for trial in range(300):
        n = rng.randint(1, 40)
        counts = [rng.choice([1, 1, 1, 2, 3]) for _ in range(n)]
        segs = [Segment(rng.randrange(1000) * block, rng.randrange(1000) * block, c * block) for c in counts]
        if trial % 5 == 0:  # one misaligned segment
            k = rng.randrange(n)
            segs[k] = Segment(segs[k].src + rng.choice([0, 1]), segs[k].dst + 1, segs[k].length)
        op = rng.choice(["WRITE", "READ"])
        expected = None
        aligned = all(not (s.src % block or s.dst % block or s.length % block) for s in segs)
        if aligned and use_prepped(n, sum(counts)):
            pick = (lambda s: (s.src, s.dst)) if op == "WRITE" else (lambda s: (s.dst, s.src))
            lidx = [lo // block + i for s in segs for lo in [pick(s)[0]] for i in range(s.length // block)]
            ridx = [ro // block + i for s in segs for ro in [pick(s)[1]] for i in range(s.length // block)]
            expected = (lidx, ridx)
        for form in (segs, SegmentArray.of(segs)):
            got = _block_indices(op, block, form)
            if expected is None:
                assert got is None
            else:
                assert got is not None and got[0].dtype == np.int32
                assert (got[0].tolist(), got[1].tolist()) == expected


@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=5),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), max_size=12),
)
def test_parts_locate_each_segment_in_its_buffer_as_a_scan_would(sizes: list[int], raw: list[tuple[int, int]]) -> None:
    """``Parts.locate`` (searchsorted) against a scan of the buffers: the buffer a segment starts
    in (the last of those starting at or before it: an empty buffer holds nothing), its offset
    there, and whether it ends within that buffer; ``check_parts`` refuses the first that does not."""
    parts = Parts(sizes)
    total = sum(sizes)
    segs = [Segment(o, o, n) for o, n in raw if o + n <= total]
    offs = np.array([s.src for s in segs], dtype=np.int64)
    lens = np.array([s.length for s in segs], dtype=np.int64)
    part, within, fits = parts.locate(offs, lens)
    bases = [sum(sizes[:i]) for i in range(len(sizes))]
    for k, s in enumerate(segs):
        i = max(j for j in range(len(sizes)) if bases[j] <= s.src)
        assert (int(part[k]), int(within[k])) == (i, s.src - bases[i])
        assert bool(fits[k]) == (s.length == 0 or s.src + s.length <= bases[i] + sizes[i])
    bad = [s for k, s in enumerate(segs) if not fits[k]]
    for form in (segs, SegmentArray.of(segs)):
        if bad and len(sizes) > 1:
            with pytest.raises(TransportError, match=re.escape(f"{bad[0]} crosses a buffer boundary")):
                check_parts(form, parts, None, "w")
            with pytest.raises(TransportError, match="destination"):
                check_parts(form, None, parts, "w")
        else:
            check_parts(form, parts, parts, "w")
