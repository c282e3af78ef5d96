"""EngineCache: the cache a single engine would hold, against KVLayout's addressing and against
plans applied byte for byte between two caches."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.layout import MUTANTS, KVLayout, KVOrder, LayoutError, Mutant, Planner, RankMap, verify_plan
from kvfsm.layout.engine import SENTINEL, CacheMismatch, EngineCache, value
from kvfsm.layout.plan import DST_BUFFER, DST_OFFSET, LENGTH, SRC_BUFFER, SRC_OFFSET, Plan

ORDERS = [(o, False) for o in KVOrder] + [(KVOrder.SGLANG, True), (KVOrder.VLLM_NHD, True)]


def ids(case: tuple[KVOrder, bool]) -> str:
    return f"{case[0].value}{'-mla' if case[1] else ''}"


def apply(plan: Plan, src: EngineCache, dst: EngineCache) -> None:
    """Copy the plan's runs byte for byte between the caches' buffers, as a transport would."""
    for row in plan.runs.tolist():
        sb, so, db, do, n = (row[i] for i in (SRC_BUFFER, SRC_OFFSET, DST_BUFFER, DST_OFFSET, LENGTH))
        if do + n > dst.buffers[db].size or so + n > src.buffers[sb].size:
            raise CacheMismatch(f"run {row} reaches past the end of a buffer")
        dst.buffers[db][do : do + n] = src.buffers[sb][so : so + n]


@pytest.mark.parametrize("dtype_bytes", [1, 2, 4])
def test_values_differ_along_every_coordinate(dtype_bytes: int) -> None:
    dims = np.arange(64)
    base = value(1, 5, 3, dims, 0, seed=7, dtype_bytes=dtype_bytes)
    assert base.dtype.itemsize == dtype_bytes
    for other in (
        value(2, 5, 3, dims, 0, seed=7, dtype_bytes=dtype_bytes),
        value(1, 6, 3, dims, 0, seed=7, dtype_bytes=dtype_bytes),
        value(1, 5, 4, dims, 0, seed=7, dtype_bytes=dtype_bytes),
        value(1, 5, 3, dims, 1, seed=7, dtype_bytes=dtype_bytes),
        value(1, 5, 3, dims, 0, seed=8, dtype_bytes=dtype_bytes),
    ):
        assert (other != base).sum() > 32  # a whole head vector tells them apart
    assert np.unique(base).size > 32  # and the dims of one vector differ among themselves


@pytest.mark.parametrize("case", ORDERS, ids=ids)
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 2)])
def test_engine_cache_agrees_with_kvlayout_address(case: tuple[KVOrder, bool], tp: int, rank: int) -> None:
    order, mla = case
    lay = KVLayout(2, 1 if mla else 4, 8, 2, tp, rank, 4, 6, order, mla)
    cache = EngineCache(lay)
    assert [b.size for b in cache.buffers] == list(lay.buffers())
    pages, tokens, seed = [4, 1, 3], 10, 99
    cache.fill(pages, tokens, seed)
    vb = lay.vector_bytes
    seen = 0
    for layer in range(lay.num_layers):
        for kv in range(lay.num_kv):
            for t in range(tokens):
                for lh, g in enumerate(lay.local_heads):
                    buf, off = lay.address(layer, kv, pages[t // 4], t % 4, lh)
                    got = cache.buffers[buf][off : off + vb].view(np.uint16)
                    want = value(layer, t, g, np.arange(lay.head_dim), kv, seed=seed, dtype_bytes=2)
                    assert (got == want).all(), (layer, kv, t, g, buf, off)
                    seen += 1
    assert seen * lay.head_dim == cache.check(pages, tokens, seed) == cache.elements(tokens)
    assert cache.untouched([(pages, tokens)]) == sum(lay.buffers()) - cache.elements(tokens) * 2
    with pytest.raises(CacheMismatch, match="outside every request"):
        cache.untouched()
    with pytest.raises(CacheMismatch, match="layer 0 .* token 0"):
        cache.check(pages, tokens, seed + 1)
    cache.erase(pages, tokens)
    assert cache.untouched() == sum(lay.buffers())


def test_check_names_the_first_wrong_element_and_untouched_the_stray_byte() -> None:
    lay = KVLayout(2, 4, 8, 2, 2, 1, 4, 6, KVOrder.VLLM_HND)
    cache = EngineCache(lay)
    cache.fill([2, 0], 7, 1)
    buf, off = lay.address(1, 1, 0, 2, 1)  # layer 1, V, page 0 (the request's 2nd) offset 2: token 6, head 3
    cache.buffers[buf][off + 2 * 3] ^= 0xFF  # dim 3
    with pytest.raises(CacheMismatch, match=r"layer 1 V token 6 head 3 dim 3 \(page 0 offset 2\)"):
        cache.check([2, 0], 7, 1)
    buf, off = lay.address(0, 0, 0, 3, 0)  # token 7: one past the request's end
    cache.buffers[buf][off] = 0
    with pytest.raises(CacheMismatch, match=f"buffer {buf} byte {off} "):
        cache.untouched([([2, 0], 7)])
    assert cache.buffers[buf][off + 1] == SENTINEL


def test_misuse_is_refused() -> None:
    with pytest.raises(LayoutError, match="1, 2, 4 or 8 bytes"):
        EngineCache(KVLayout(1, 2, 4, 3, 1, 0, 4, 4))
    cache = EngineCache(KVLayout(1, 2, 4, 2, 1, 0, 4, 4))
    with pytest.raises(LayoutError, match="need 3 pages"):
        cache.fill([0, 1], 9, 0)
    with pytest.raises(LayoutError, match="outside"):
        cache.fill([0, 4], 8, 0)


def run_room(
    so: KVOrder, do: KVOrder, tp: int, td: int, ps: int, pd: int, mla: bool, mutant: Mutant | None = None
) -> tuple[list[EngineCache], list[list[int]], int]:
    """A request of several chunks (whole prefill pages but the last) from every prefill rank to
    every decode rank by Planner plans applied with numpy; returns decode's caches and pages."""
    heads, tokens, seed = (1 if mla else 8), 150, 5
    rng = np.random.default_rng(tp * 10 + td)
    src = [EngineCache(KVLayout(2, heads, 8, 2, tp, r, ps, -(-tokens // ps) + 2, so, mla)) for r in range(tp)]
    dst = [EngineCache(KVLayout(2, heads, 8, 2, td, r, pd, -(-tokens // pd) + 2, do, mla)) for r in range(td)]
    spages = [rng.permutation(c.layout.num_pages)[: -(-tokens // ps)].tolist() for c in src]
    dpages = [rng.permutation(c.layout.num_pages)[: -(-tokens // pd)].tolist() for c in dst]
    for p, c in enumerate(src):
        c.fill(spages[p], tokens, seed)
    mapping = RankMap(heads, tp, td, mla)
    # three chunks of whole prefill pages but the last (150 is not a multiple of 16 or 64)
    chunk = -(-tokens // ps // 3) * ps
    for p, d in mapping.pairs():
        planner = Planner(src[p].layout, dst[d].layout, mapping, mutant=mutant)
        for first in range(0, tokens, chunk):
            n = min(chunk, tokens - first)
            plan = planner.plan(spages[p], dpages[d], first, n)
            if mutant is None:
                verify_plan(plan, src[p].layout, dst[d].layout, spages[p], dpages[d], first, n, mapping)
            apply(plan, src[p], dst[d])
    return dst, dpages, tokens


PAIRS = [(2, 4, 16, 64), (2, 4, 64, 16), (4, 2, 16, 64), (4, 2, 64, 16)]


@pytest.mark.parametrize(("tp", "td", "ps", "pd"), PAIRS)
@pytest.mark.parametrize(("so", "do"), [(KVOrder.SGLANG, KVOrder.SGLANG), (KVOrder.VLLM_NHD, KVOrder.VLLM_CPU)])
def test_planner_plans_applied_between_engine_caches_give_the_single_engine_cache(
    tp: int, td: int, ps: int, pd: int, so: KVOrder, do: KVOrder
) -> None:
    dst, dpages, tokens = run_room(so, do, tp, td, ps, pd, False)
    for d, cache in enumerate(dst):
        assert cache.check(dpages[d], tokens, 5) == cache.elements(tokens) == 2 * 2 * tokens * (8 // td) * 8
        cache.untouched([(dpages[d], tokens)])


@pytest.mark.parametrize(("tp", "td"), [(2, 4), (4, 2)])
def test_mla_plans_give_every_decode_rank_the_latent(tp: int, td: int) -> None:
    dst, dpages, tokens = run_room(KVOrder.SGLANG, KVOrder.VLLM_NHD, tp, td, 16, 64, True)
    for d, cache in enumerate(dst):
        assert cache.check(dpages[d], tokens, 5) == 2 * tokens * 8
        cache.untouched([(dpages[d], tokens)])


@pytest.mark.parametrize("mutant", MUTANTS)
@pytest.mark.parametrize(("tp", "td", "ps", "pd"), [(4, 2, 64, 16), (2, 4, 16, 64)])
def test_a_mutant_plan_fails_the_check(mutant: Mutant, tp: int, td: int, ps: int, pd: int) -> None:
    with pytest.raises(CacheMismatch):  # a wrong element, a stray write, or one past a buffer's end
        dst, dpages, tokens = run_room(KVOrder.SGLANG, KVOrder.SGLANG, tp, td, ps, pd, False, mutant)
        for d, cache in enumerate(dst):
            cache.check(dpages[d], tokens, 5)
            cache.untouched([(dpages[d], tokens)])
