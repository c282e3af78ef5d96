"""PageRun: a long ascending run of pages held as (first, length). It must behave exactly as the
tuple of its pages (so records holding one compare and hash as before), and the engine's inputs
that are long runs must become one, while anything that is not integers is still refused."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.protocol import KVPoll, LocalProtocolError
from kvfsm.protocol.pages import RUN_MIN, PageRun, page_summary, run_of
from kvfsm.protocol.wire import RoomPages
from kvfsm.runtime.pages import as_pages
from kvfsm.testing import LoopbackCluster

idx = st.integers(-80, 80)


@given(st.integers(0, 1 << 22), st.integers(0, 70), st.lists(st.tuples(st.none() | idx, st.none() | idx, st.none() | st.integers(-3, 3).filter(bool)), max_size=4), idx)  # fmt: skip
def test_a_page_run_behaves_as_the_tuple_of_its_pages(first: int, n: int, slices: list[Any], i: int) -> None:
    run, t = PageRun(first, n), tuple(range(first, first + n))
    assert len(run) == len(t) and list(run) == list(t) and list(reversed(run)) == list(reversed(t))
    assert run == t and t == run and hash(run) == hash(t) and not (run != t)
    assert run == PageRun(first, n) and {run: 1}[t] == 1
    assert (run != t[:-1]) if t else True
    assert run != list(t)  # as a tuple: not equal to a list
    for s in slices:
        got, want = run[slice(*s)], t[slice(*s)]
        assert got == want and tuple(got) == want
    if -n <= i < n:
        assert run[i] == t[i]
    else:
        with pytest.raises(IndexError):
            run[i]
    assert (first + 3 in run) == (first + 3 in t) and (first - 1 in run) is False
    assert run.count(first) == t.count(first)
    if t:
        assert run.index(t[-1]) == t.index(t[-1])
    assert page_summary(run) == page_summary(t)
    assert pickle.loads(pickle.dumps(run)) == run
    assert (run < t + (0,)) == (t < t + (0,)) and run <= t and run >= t and not run > t
    assert run + (1,) == t + (1,) and (1,) + run == (1,) + t


def test_a_page_run_prints_briefly_and_refuses_negative_bounds() -> None:
    assert repr(PageRun(3, 2)) == "(3, 4)"
    assert repr(PageRun(10, 1000)) == "(10, 11, ..., 1009)"
    with pytest.raises(ValueError):
        PageRun(-1, 4)


@given(st.integers(0, 1 << 22), st.integers(0, 3 * RUN_MIN))
def test_run_of_is_a_page_run_from_run_min_on(first: int, n: int) -> None:
    pages = run_of(first, n)
    assert pages == tuple(range(first, first + n))
    assert (type(pages) is PageRun) == (n >= RUN_MIN)


LONG = list(range(5, 5 + 4 * RUN_MIN))


@pytest.mark.parametrize(
    ("given_pages", "as_run"),
    [
        (LONG, True),
        (tuple(LONG), True),
        (range(5, 5 + len(LONG)), True),
        (np.array(LONG, dtype=np.int32), True),
        (np.array(LONG, dtype=np.uint64), True),
        (torch.tensor(LONG), True),  # as its list (torch dtypes have no numpy kind)
        (LONG[:2] + [np.int64(p) for p in LONG[2:]], True),  # numpy scalars after the first two: converted in C
        ([np.int64(p) for p in LONG], False),  # numpy scalars first: the general path converts them
    ],
    ids=["list", "tuple", "range", "np-int32", "np-uint64", "torch", "np-scalars-later", "np-scalars"],
)
def test_long_runs_from_the_engine_become_page_runs_of_exact_ints(given_pages: Any, as_run: bool) -> None:
    got = as_pages(given_pages)
    assert got == tuple(LONG) and all(type(p) is int for p in got)
    assert (type(got) is PageRun) == as_run


@pytest.mark.parametrize(
    "given_pages",
    [
        list(range(0, RUN_MIN)),  # from page 0
        [*LONG[:10], LONG[11], LONG[10], *LONG[12:]],  # two pages swapped: not a run
        [*LONG[:-1], LONG[-1] + 1],  # a gap before the last page
        [*LONG[:5], *LONG[4:-1]],  # a page twice, the ends still consistent
    ],
    ids=["from-zero", "swapped", "gap", "repeated"],
)
def test_lists_that_are_not_one_run_stay_tuples_with_the_right_summary(given_pages: list[int]) -> None:
    got = as_pages(given_pages)
    assert got == tuple(given_pages) and all(type(p) is int for p in got)
    t = tuple(given_pages)
    run = t == tuple(range(t[0], t[0] + len(t)))
    assert page_summary(got) == (min(t), max(t), len(set(t)) == len(t), run)


@pytest.mark.parametrize(
    "bad",
    [
        [*LONG[:7], float(LONG[7]), *LONG[8:]],
        [*LONG[:7], np.float64(LONG[7]), *LONG[8:]],
        [*LONG[:7], str(LONG[7]), *LONG[8:]],
        [*LONG[:7], None, *LONG[8:]],
        [False, True, *range(2, RUN_MIN + 2)],
        [0, True, *range(2, RUN_MIN + 2)],
        [*LONG[:-1], float(LONG[-1])],
    ],
    ids=["float", "np-float", "str", "none", "bools-first", "bool-second", "float-last"],
)
def test_a_long_run_with_an_item_that_is_not_an_integer_is_refused(bad: list[Any]) -> None:
    with pytest.raises(LocalProtocolError, match="integer"):
        as_pages(bad)


@pytest.mark.parametrize("kind", ["list", "range", "numpy", "torch"])
def test_a_long_chunk_is_one_segment_and_lands_every_byte(kind: str) -> None:
    n = 8 * RUN_MIN
    c = LoopbackCluster(pages=4 * n, page_bytes=64)
    try:
        src, dst = list(range(n, 3 * n)), list(range(2 * n, 4 * n))
        make = {
            "list": lambda xs: xs,
            "range": lambda xs: range(xs[0], xs[-1] + 1),
            "numpy": lambda xs: np.array(xs),
            "torch": lambda xs: torch.tensor(xs),
        }[kind]
        rc = c.decode[0].create_receiver(1)
        rc.init(make(dst), 0)
        s = c.prefill[0].create_sender(1)
        c.settle()
        s.send(make(src[:n]))
        s.send(make(src[n:]), is_last=True, aux_slot=0)
        c.settle()
        assert s.poll() == rc.poll() == KVPoll.Success
        assert c.kv_equal(0, src, 0, dst)
        # each chunk (and its announcement slice) was one run: one descriptor per chunk
        assert c.prefill[0].stats()["counters"]["descriptors"] == 2 + 1  # two chunks and the aux write
    finally:
        c.close()


def test_a_page_run_encodes_as_a_list_and_decodes_as_the_same_pages() -> None:
    from kvfsm.protocol import Protocol

    codec = Protocol().codec
    msg = RoomPages(7, 1, PageRun(100, 5000), 3, 1)
    back = codec.decode(codec.encode(msg))
    assert back == msg and back.pages == tuple(range(100, 5100))  # type: ignore[attr-defined]


def test_long_chunks_slice_a_long_announcement_as_a_run_and_short_ones_as_a_tuple() -> None:
    """The prefill room keeps a long announced run both ways: a long chunk's destination pages
    are a PageRun slice (no per-page cost), a short chunk's a tuple slice (cheapest for few)."""
    from kvfsm.protocol import Protocol
    from kvfsm.protocol.actions import PostWrite
    from kvfsm.protocol.events import ChunkReady, PagesAnnounced
    from kvfsm.protocol.rooms import PrefillRoom

    proto = Protocol()
    n = 4 * RUN_MIN
    room = PrefillRoom(1, 0, 10 * n, 4)
    proto.prefill.create(room, 0.0)
    proto.prefill.step(room, PagesAnnounced(2, tuple(range(n, 3 * n)), 0, 1, 10 * n, 4), 0.0)
    assert room.dests[2].span == tuple(range(n, 3 * n)) and type(room.dests[2].span) is PageRun
    writes = []
    for pages, last in ((as_pages(list(range(8))), False), (as_pages(list(range(8, 2 * n))), True)):
        out = proto.prefill.step(room, ChunkReady(pages, last, 0 if last else None), 1.0)
        writes += [a for a in out if isinstance(a, PostWrite)]
    short, long_ = writes
    assert type(short.dst_pages) is tuple and short.dst_pages == tuple(range(n, n + 8)) and short.contiguous
    assert type(long_.dst_pages) is PageRun and long_.dst_pages == tuple(range(n + 8, 3 * n)) and long_.contiguous
    # an announcement that is not one run has no span, and posts tuple slices
    scattered = tuple(range(3 * n, n, -1))
    other = PrefillRoom(2, 0, 10 * n, 4)
    proto.prefill.create(other, 0.0)
    proto.prefill.step(other, PagesAnnounced(2, scattered, 0, 1, 10 * n, 4), 0.0)
    assert other.dests[2].span is None
    out = proto.prefill.step(other, ChunkReady(as_pages(list(range(2 * n))), True, 0), 1.0)
    (w,) = [a for a in out if isinstance(a, PostWrite)]
    assert w.dst_pages == scattered and not w.contiguous


def test_runs_past_the_run_template_are_still_recognised_or_fall_back_correctly() -> None:
    from kvfsm.protocol.pages import RUN_BYTES_MAX, run_bytes

    far = list(range(RUN_BYTES_MAX - 10, RUN_BYTES_MAX - 10 + 2 * RUN_MIN))
    assert run_bytes(far[0], len(far)) is None  # past the template's cap
    got = as_pages(far)  # a list: the general path (a tuple of the same pages)
    assert got == tuple(far) and type(got) is tuple
    arr = as_pages(np.array(far))  # an array: checked vectorised instead
    assert arr == tuple(far) and type(arr) is PageRun
    grown = list(range(50_000, 50_000 + 3 * RUN_MIN))  # past the preset template: grown on demand
    assert type(as_pages(grown)) is PageRun and as_pages(grown) == tuple(grown)
