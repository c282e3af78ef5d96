"""The per-chunk page summary (one scan per page list, cached by identity) and the one-segment
path it enables for chunks that are one run on both sides."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfsm.protocol import KVPoll
from kvfsm.protocol.pages import page_summary
from kvfsm.testing import LoopbackCluster

pages_st = st.one_of(
    st.lists(st.integers(-5, 50), max_size=30),
    st.builds(lambda a, n: list(range(a, a + n)), st.integers(-50, 1000), st.integers(0, 40)),
    # runs that reach past the preset int template (grown on demand) and past its cap
    st.builds(
        lambda a, n: list(range(a, a + n)), st.sampled_from([4090, 5000, (1 << 20) - 3, 1 << 21]), st.integers(1, 9)
    ),
)


@given(pages_st)
def test_page_summary_is_min_max_distinct_and_run(pages: list[int]) -> None:
    t = tuple(pages)
    run = t == tuple(range(t[0], t[0] + len(t))) if t else True
    expected = (min(t), max(t), len(set(t)) == len(t), run) if t else (0, -1, True, True)
    assert page_summary(t) == expected
    assert page_summary(t) == expected  # cached by identity: same answer
    assert page_summary(tuple(list(t))) == expected  # an equal list, another object


@given(st.integers(0, (1 << 20) + 10), st.integers(0, 300))
def test_run_of_is_the_run_with_its_summary_known(lo: int, n: int) -> None:
    from kvfsm.protocol.pages import run_of

    pages = run_of(lo, n)
    assert pages == tuple(range(lo, lo + n)) and all(type(p) is int for p in pages)
    assert page_summary(pages) == ((lo, lo + n - 1, True, True) if n else (0, -1, True, True))


def test_a_list_is_never_cached_by_identity() -> None:
    pages = [3, 4, 5]
    assert page_summary(pages) == (3, 5, True, True)  # type: ignore[arg-type]
    pages[1] = 9  # mutated in place: a cached answer would now be wrong
    assert page_summary(pages) == (3, 9, True, False)  # type: ignore[arg-type]


def test_runs_on_one_side_or_both_land_every_byte() -> None:
    """Chunks whose pages are one run on both sides take the one-segment path; a run on one
    side only goes through coalesce. Both must land exactly."""
    c = LoopbackCluster(pages=64, page_bytes=64)
    try:
        cases = [
            (1, [0, 1, 2, 3], [10, 11, 12, 13]),  # a run on both sides
            (2, [20, 21, 22, 23], [33, 32, 31, 30]),  # a run at prefill only
            (3, [40, 42, 41, 43], [50, 51, 52, 53]),  # a run at decode only
        ]
        for room, src, dst in cases:
            s = c.prefill[0].create_sender(room)
            rc = c.decode[0].create_receiver(room)
            rc.init(dst, room)
            c.settle()
            s.send(src[:2])
            s.send(src[2:], is_last=True, aux_slot=room)
            c.settle()
            assert s.poll() == rc.poll() == KVPoll.Success
            assert c.kv_equal(0, src, 0, dst)
    finally:
        c.close()
