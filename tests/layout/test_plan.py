"""Plans between heterogeneous layouts, each proven by verify_plan; bytes moved as an engine would hold them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_kit import apply, cuts, logical, page_list, to_memory

from kvfsm.layout import MUTANTS, KVLayout, KVOrder, Mutant, PlanError, Planner, RankMap, plan_chunk, verify_plan
from kvfsm.layout.plan import DST_OFFSET, LENGTH, Plan

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8, 16)
PAGES = (16, 32, 64)
TOKENS = 100
MLA_ORDERS = (KVOrder.SGLANG, KVOrder.VLLM_NHD)
ORDER_PAIRS = [(o, o) for o in KVOrder] + [
    (KVOrder.SGLANG, KVOrder.VLLM_NHD),
    (KVOrder.VLLM_NHD, KVOrder.SGLANG),
    (KVOrder.VLLM_HND, KVOrder.VLLM_CPU),
    (KVOrder.VLLM_CPU, KVOrder.SGLANG),
]


def layouts(
    order: KVOrder, tp: int, heads: int, page: int, mla: bool, layers: int = 2, head_dim: int = 4
) -> list[KVLayout]:
    pages = -(-TOKENS // page) + 3  # a few pages the request does not use
    return [KVLayout(layers, heads, head_dim, 2, tp, r, page, pages, order, mla) for r in range(tp)]


def check_room(
    src_order: KVOrder, dst_order: KVOrder, tp: int, td: int, heads: int, ps: int, pd: int, mla: bool, seed: int
) -> int:
    """Plan and verify every chunk of one request for every (p, d) pair; the number of plans."""
    rng = np.random.default_rng(seed)
    srcs, dsts = layouts(src_order, tp, heads, ps, mla), layouts(dst_order, td, heads, pd, mla)
    mapping = RankMap(heads, tp, td, mla)
    src_pages = [page_list(s, TOKENS, rng) for s in srcs]
    dst_pages = [page_list(d, TOKENS, rng) for d in dsts]
    plans = 0
    for p, d in mapping.pairs():
        planner = Planner(srcs[p], dsts[d], mapping)
        for first, n in cuts(TOKENS):
            plan = planner.plan(src_pages[p], dst_pages[d], first, n)
            verify_plan(plan, srcs[p], dsts[d], src_pages[p], dst_pages[d], first, n, mapping)
            plans += 1
    return plans


def combos(mla: bool) -> list[tuple[int, int, int, int, int]]:
    return list(itertools.product(TPS, TPS, (1,) if mla else HEADS, PAGES, PAGES))


@pytest.mark.parametrize(("src_order", "dst_order"), ORDER_PAIRS, ids=[f"{a}-{b}" for a, b in ORDER_PAIRS])
def test_every_tp_heads_and_page_size_combination_plans_a_proven_chunk(src_order: KVOrder, dst_order: KVOrder) -> None:
    plans = 0
    for i, (tp, td, heads, ps, pd) in enumerate(combos(False)):
        plans += check_room(src_order, dst_order, tp, td, heads, ps, pd, False, seed=i)
    if src_order in MLA_ORDERS and dst_order in MLA_ORDERS:
        for i, (tp, td, heads, ps, pd) in enumerate(combos(True)):
            plans += check_room(src_order, dst_order, tp, td, heads, ps, pd, True, seed=i)
    assert plans >= len(combos(False)) * 3


def run_request(
    src_order: KVOrder, dst_order: KVOrder, tp: int, td: int, heads: int, ps: int, pd: int, mla: bool
) -> int:
    """Move a whole request, chunk by chunk, from every source to every decode rank by copying the
    plans' bytes; each decode rank must then hold exactly what one engine of its layout would."""
    rng = np.random.default_rng(7)
    srcs, dsts = layouts(src_order, tp, heads, ps, mla), layouts(dst_order, td, heads, pd, mla)
    mapping = RankMap(heads, tp, td, mla)
    src_pages = [page_list(s, TOKENS, rng) for s in srcs]
    dst_pages = [page_list(d, TOKENS, rng) for d in dsts]
    src_mem = [to_memory(s, logical(s, pg, range(TOKENS))) for s, pg in zip(srcs, src_pages, strict=True)]
    checked = 0
    for d, dst in enumerate(dsts):
        mem = to_memory(dst, logical(dst, dst_pages[d], range(0)))  # nothing written yet
        for p in mapping.sources_of(d):
            for first, n in cuts(TOKENS):
                plan = plan_chunk(srcs[p], dst, src_pages[p], dst_pages[d], first, n, mapping)
                verify_plan(plan, srcs[p], dst, src_pages[p], dst_pages[d], first, n, mapping)
                apply(plan, src_mem[p], mem)
        want = to_memory(dst, logical(dst, dst_pages[d], range(TOKENS)))
        for b, (got, exp) in enumerate(zip(mem, want, strict=True)):
            assert np.array_equal(got, exp), f"decode rank {d} buffer {b} differs from the engine's cache"
            checked += got.size
    return checked


BYTE_CASES = [
    (KVOrder.SGLANG, KVOrder.SGLANG, 2, 4, 8, 16, 64, False),
    (KVOrder.SGLANG, KVOrder.SGLANG, 4, 2, 8, 64, 16, False),
    (KVOrder.VLLM_NHD, KVOrder.VLLM_HND, 2, 4, 2, 16, 32, False),  # replicated heads at decode
    (KVOrder.VLLM_HND, KVOrder.VLLM_CPU, 8, 2, 4, 32, 16, False),  # replicated heads at prefill
    (KVOrder.VLLM_CPU, KVOrder.SGLANG, 1, 8, 16, 64, 16, False),
    (KVOrder.VLLM_CPU, KVOrder.VLLM_CPU, 2, 2, 4, 16, 16, False),  # direct
    (KVOrder.SGLANG, KVOrder.VLLM_NHD, 4, 2, 1, 16, 64, True),  # MLA: one sender per decode rank
    (KVOrder.VLLM_NHD, KVOrder.SGLANG, 2, 8, 1, 64, 32, True),
]


@pytest.mark.parametrize(("so", "do", "tp", "td", "heads", "ps", "pd", "mla"), BYTE_CASES)
def test_copied_bytes_equal_the_cache_of_an_engine_with_the_decode_layout(
    so: KVOrder, do: KVOrder, tp: int, td: int, heads: int, ps: int, pd: int, mla: bool
) -> None:
    assert run_request(so, do, tp, td, heads, ps, pd, mla) > 0


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(TPS),
    st.sampled_from(TPS),
    st.sampled_from(HEADS),
    st.sampled_from(PAGES),
    st.sampled_from(PAGES),
    st.sampled_from(list(KVOrder)),
    st.sampled_from(list(KVOrder)),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_random_layout_pairs_plan_proven_chunks_and_the_right_bytes(
    tp: int, td: int, heads: int, ps: int, pd: int, so: KVOrder, do: KVOrder, mla: bool, seed: int
) -> None:
    if mla:
        heads = 1  # MLA: one latent, in an order that has an MLA form
        so, do = (o if o in MLA_ORDERS else KVOrder.SGLANG for o in (so, do))
    assert check_room(so, do, tp, td, heads, ps, pd, mla, seed) > 0
    assert run_request(so, do, min(tp, 4), min(td, 4), heads, ps, pd, mla) > 0


def test_direct_plans_move_whole_pages_and_coalesce_adjacent_ones() -> None:
    mapping = RankMap(8, 2, 2)
    for order in KVOrder:
        src = KVLayout(2, 8, 4, 2, 2, 1, 16, 12, order)
        dst = KVLayout(2, 8, 4, 2, 2, 1, 16, 12, order)
        page_bytes = 16 * 4 * src.vector_bytes  # one component of a page: tokens x local heads
        scattered = plan_chunk(src, dst, [3, 7, 1], [5, 0, 9], 0, 48, mapping)
        assert scattered.kind == "direct"
        per_page = 2 if order in (KVOrder.SGLANG, KVOrder.VLLM_NHD, KVOrder.VLLM_HND) else 1  # CPU: K, V adjacent
        assert scattered.descriptors == 2 * 3 * per_page  # layers x pages x components
        assert set(scattered.runs[:, LENGTH].tolist()) == {page_bytes * (2 // per_page)}
        adjacent = plan_chunk(src, dst, [3, 4, 5], [7, 8, 9], 0, 48, mapping)
        assert adjacent.descriptors == 2 * per_page  # one run per buffer component
        verify_plan(adjacent, src, dst, [3, 4, 5], [7, 8, 9], 0, 48, mapping)


def test_a_sliced_plan_is_one_run_per_token_and_component_when_heads_are_a_slice() -> None:
    src = KVLayout(2, 8, 4, 2, 2, 0, 16, 8)  # heads 0-3
    dst = KVLayout(2, 8, 4, 2, 4, 1, 64, 2)  # heads 2-3
    mapping = RankMap(8, 2, 4)
    plan = plan_chunk(src, dst, [4, 2, 6], [1], 5, 40, mapping)
    assert plan.kind == "sliced"
    assert plan.descriptors == 2 * 2 * 40 and set(plan.runs[:, LENGTH].tolist()) == {2 * src.vector_bytes}
    verify_plan(plan, src, dst, [4, 2, 6], [1], 5, 40, mapping)


def test_a_rank_that_sends_nothing_plans_nothing() -> None:
    src = KVLayout(2, 1, 4, 2, 4, 3, 16, 8, mla=True)
    dst = KVLayout(2, 1, 4, 2, 2, 1, 16, 8, mla=True)
    mapping = RankMap(1, 4, 2, mla=True)
    plan = plan_chunk(src, dst, [0, 1], [0, 1], 0, 20, mapping)
    assert plan.descriptors == 0
    verify_plan(plan, src, dst, [0, 1], [0, 1], 0, 20, mapping)


MUTANT_CASES = [
    (KVOrder.SGLANG, 4, 2, 8, 16, 64, False),  # fan-in
    (KVOrder.VLLM_HND, 2, 4, 8, 32, 16, False),  # fan-out
    (KVOrder.VLLM_CPU, 2, 2, 4, 16, 16, False),  # equal TP, direct
    (KVOrder.VLLM_NHD, 2, 8, 2, 16, 32, False),  # replicated heads at decode
    (KVOrder.SGLANG, 2, 4, 1, 64, 16, True),  # MLA
]


@pytest.mark.parametrize("mutant", MUTANTS)
@pytest.mark.parametrize(("order", "tp", "td", "heads", "ps", "pd", "mla"), MUTANT_CASES)
def test_verify_plan_catches_every_mutant_plan_that_differs(
    mutant: Mutant, order: KVOrder, tp: int, td: int, heads: int, ps: int, pd: int, mla: bool
) -> None:
    rng = np.random.default_rng(3)
    srcs, dsts = layouts(order, tp, heads, ps, mla), layouts(order, td, heads, pd, mla)
    mapping = RankMap(heads, tp, td, mla)
    sp = [page_list(s, TOKENS, rng) for s in srcs]
    dp = [page_list(d, TOKENS, rng) for d in dsts]
    caught = 0
    for p, d in mapping.pairs():
        for first, n in cuts(TOKENS):
            good = plan_chunk(srcs[p], dsts[d], sp[p], dp[d], first, n, mapping)
            bad = plan_chunk(srcs[p], dsts[d], sp[p], dp[d], first, n, mapping, mutant=mutant)
            if np.array_equal(good.runs, bad.runs):
                continue  # the slip coincides with the right answer here (rank 0, the first chunk)
            with pytest.raises(PlanError):
                verify_plan(bad, srcs[p], dsts[d], sp[p], dp[d], first, n, mapping)
            caught += 1
    assert caught > 0


def corrupt(plan: Plan, how: str, vb: int) -> Plan:
    runs = plan.runs.copy()
    if how == "drop":
        runs = runs[1:]
    elif how == "twice":
        runs[1] = runs[0]  # the same total, so only the count per vector can tell
    elif how == "half_vector":
        runs[0, DST_OFFSET] += vb // 2
    elif how == "past_end":
        runs[-1, DST_OFFSET] += 10**9
    elif how == "swap":
        runs[[0, 1], DST_OFFSET] = runs[[1, 0], DST_OFFSET]
    return Plan(plan.kind, runs)


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("drop", "writes 798 head vectors; the chunk has 800"),
        ("twice", "written 2 times, not once"),
        ("half_vector", "not a whole 8-byte head vector"),
        ("past_end", "bytes outside its"),
        ("swap", "from prefill vector"),
    ],
)
def test_verify_plan_names_what_a_corrupted_plan_gets_wrong(how: str, words: str) -> None:
    src = KVLayout(2, 8, 4, 2, 2, 0, 16, 8)
    dst = KVLayout(2, 8, 4, 2, 4, 1, 32, 4)
    mapping = RankMap(8, 2, 4)
    sp, dp = [4, 2, 6, 1, 7, 0, 5], [3, 0, 2, 1]
    good = plan_chunk(src, dst, sp, dp, 10, 100, mapping)
    verify_plan(good, src, dst, sp, dp, 10, 100, mapping)
    with pytest.raises(PlanError, match=words):
        verify_plan(corrupt(good, how, src.vector_bytes), src, dst, sp, dp, 10, 100, mapping)


@pytest.mark.parametrize(("ps", "pd"), [(16, 64), (64, 16), (16, 16), (32, 16)])
def test_a_chunk_planned_from_only_the_pages_it_touches_equals_the_plan_from_whole_lists(ps: int, pd: int) -> None:
    """The runtime hands a chunk's own pages and the decode pages that hold its tokens, each list
    starting at the request's page that holds the chunk's first token (``*_first_page``)."""
    rng = np.random.default_rng(7)
    mapping = RankMap(4, 2, 4)
    src = KVLayout(2, 4, 8, 2, 2, 1, ps, 40)
    dst = KVLayout(2, 4, 8, 2, 4, 3, pd, 40)
    tokens = 300
    spages = rng.permutation(40)[: -(-tokens // ps)]
    dpages = rng.permutation(40)[: -(-tokens // pd)]
    planner = Planner(src, dst, mapping)
    first = 0
    for n in (2, 1, 5, 3, 7):
        end = min(first + n * ps, tokens)
        s0, d0 = first // ps, first // pd
        s1, d1 = -(-end // ps), -(-end // pd)
        part = planner.plan(spages[s0:s1], dpages[d0:d1], first, end - first, src_first_page=s0, dst_first_page=d0)
        whole = planner.plan(spages, dpages, first, end - first)
        assert np.array_equal(part.runs, whole.runs)
        verify_plan(part, src, dst, spages[s0:s1], dpages[d0:d1], first, end - first, mapping,
                    src_first_page=s0, dst_first_page=d0)  # fmt: skip
        if s0 or d0:
            with pytest.raises(PlanError):  # the same slices read as if they began the request
                verify_plan(part, src, dst, spages[s0:s1], dpages[d0:d1], first, end - first, mapping)
        first = end
        if first >= tokens:
            break
