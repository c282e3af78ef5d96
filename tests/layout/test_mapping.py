"""Rank mapping: every head of every decode rank comes from exactly one prefill rank that holds it."""

from __future__ import annotations

import itertools

import pytest

from kvfsm.layout import MappingError, RankMap, heads_of

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8, 16)


@pytest.mark.parametrize(("heads", "tp"), list(itertools.product(HEADS, TPS)))
def test_a_tp_group_holds_every_head_and_each_rank_an_even_share(heads: int, tp: int) -> None:
    held = [heads_of(heads, tp, r) for r in range(tp)]
    assert {g for r in held for g in r} == set(range(heads))
    assert len({len(r) for r in held}) == 1
    copies = max(1, tp // heads)
    assert all(sum(g in r for r in held) == copies for g in range(heads))


@pytest.mark.parametrize(("heads", "ptp", "dtp", "mla"), list(itertools.product(HEADS, TPS, TPS, (False, True))))
def test_every_decode_head_has_exactly_one_sender_that_holds_it(heads: int, ptp: int, dtp: int, mla: bool) -> None:
    m = RankMap(heads, ptp, dtp, mla)
    h = 1 if mla else heads
    for d in range(dtp):
        got: list[int] = []
        for p in m.sources_of(d):
            moved = m.heads(p, d)
            assert moved, (p, d)
            assert set(moved) <= set(heads_of(h, ptp, p)), "a source sends only heads it holds"
            assert d in m.dests_of(p)
            got += list(moved)
        assert sorted(got) == list(heads_of(h, dtp, d)), "every head of the decode rank, once"
    for p in range(ptp):
        for d in range(dtp):
            assert bool(m.heads(p, d)) == (p in m.sources_of(d))
    if mla:  # one sender per decode rank; prefill ranks beyond the decode group send nothing
        assert all(m.sources_of(d) == (d % ptp,) for d in range(dtp))
        assert all(not m.dests_of(p) for p in range(dtp, ptp))


def test_replicated_heads_are_read_from_different_holders() -> None:
    m = RankMap(2, 8, 2)  # 4 prefill ranks hold each head
    assert m.sources_of(0) == (0,) and m.sources_of(1) == (5,)
    assert [p for p in range(8) if not m.dests_of(p)] == [1, 2, 3, 4, 6, 7]


@pytest.mark.parametrize(("heads", "tp"), [(3, 2), (4, 3), (2, 3), (0, 1)])
def test_groups_that_do_not_divide_are_refused(heads: int, tp: int) -> None:
    with pytest.raises(MappingError):
        heads_of(heads, tp, 0)
