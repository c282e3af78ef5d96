"""Plans run over a data plane: ``Plan.segments`` addresses each side's KV region registered as
its list of buffers, and a loopback write of those segments leaves decode's buffers byte for byte
as an engine with decode's layout would hold them."""

from __future__ import annotations

import numpy as np
import pytest
from layout_kit import cuts, logical, page_list, to_memory

from kvfsm.layout import KVLayout, KVOrder, LayoutError, Planner, RankMap, verify_plan
from kvfsm.layout.plan import DST_BUFFER, SRC_BUFFER, Plan
from kvfsm.transport.base import Inbound, SegmentArray
from kvfsm.transport.loopback import Fabric

TOKENS = 100
CASES = [
    (KVOrder.SGLANG, KVOrder.SGLANG, 2, 4, 8, 16, 64, False),
    (KVOrder.VLLM_NHD, KVOrder.VLLM_HND, 4, 2, 8, 64, 16, False),
    (KVOrder.VLLM_CPU, KVOrder.VLLM_CPU, 2, 2, 4, 16, 16, False),  # direct
    (KVOrder.SGLANG, KVOrder.VLLM_NHD, 2, 4, 1, 16, 32, True),  # MLA
]


def layouts(order: KVOrder, tp: int, heads: int, page: int, mla: bool) -> list[KVLayout]:
    pages = -(-TOKENS // page) + 3
    return [KVLayout(3, heads, 4, 2, tp, r, page, pages, order, mla) for r in range(tp)]


@pytest.mark.parametrize(("so", "do", "tp", "td", "heads", "ps", "pd", "mla"), CASES)
def test_plan_segments_written_over_loopback_give_the_engines_cache(
    so: KVOrder, do: KVOrder, tp: int, td: int, heads: int, ps: int, pd: int, mla: bool
) -> None:
    rng = np.random.default_rng(11)
    srcs, dsts = layouts(so, tp, heads, ps, mla), layouts(do, td, heads, pd, mla)
    mapping = RankMap(heads, tp, td, mla)
    src_pages = [page_list(s, TOKENS, rng) for s in srcs]
    dst_pages = [page_list(d, TOKENS, rng) for d in dsts]
    fabric = Fabric(0)
    notes: list[Inbound] = []
    src_mem, dst_mem = [], []
    senders = []
    for p, s in enumerate(srcs):
        ep = fabric.endpoint(f"p{p}")
        senders.append(ep)
        ep.set_handler(notes.append)
        src_mem.append(to_memory(s, logical(s, src_pages[p], range(TOKENS))))
        ep.register_memory(src_mem[p], bytearray(8))
    for d, lay in enumerate(dsts):
        ep = fabric.endpoint(f"d{d}")
        ep.set_handler(notes.append)
        dst_mem.append(to_memory(lay, logical(lay, dst_pages[d], range(0))))  # nothing written yet
        ep.register_memory(dst_mem[d], bytearray(8))
    writes = 0
    for p, d in mapping.pairs():
        planner = Planner(srcs[p], dsts[d], mapping)
        for first, n in cuts(TOKENS):
            plan = planner.plan(src_pages[p], dst_pages[d], first, n)
            verify_plan(plan, srcs[p], dsts[d], src_pages[p], dst_pages[d], first, n, mapping)
            segs = SegmentArray(*plan.segments(srcs[p], dsts[d]))
            moved = senders[p].write(f"d{d}", "kv", segs, b"chunk", (p, d, first))
            assert moved == plan.bytes
            writes += 1
    fabric.pump()
    assert sum(1 for i in notes if i.kind == "completion" and i.ok) == writes
    for d, lay in enumerate(dsts):
        want = to_memory(lay, logical(lay, dst_pages[d], range(TOKENS)))
        for b, (got, exp) in enumerate(zip(dst_mem[d], want, strict=True)):
            assert np.array_equal(got, exp), f"decode rank {d} buffer {b} differs from the engine's cache"


def test_plan_segments_are_the_runs_at_each_buffers_virtual_base() -> None:
    src, dst = layouts(KVOrder.SGLANG, 2, 4, 16, False)[0], layouts(KVOrder.SGLANG, 1, 4, 64, False)[0]
    plan = Planner(src, dst, RankMap(4, 2, 1, False)).plan(np.arange(7), np.arange(2), 0, 100)
    s, d, n = plan.segments(src, dst)
    sizes_s, sizes_d = src.buffers(), dst.buffers()
    for row, so, do, ln in zip(plan.runs.tolist(), s.tolist(), d.tolist(), n.tolist(), strict=True):
        sb, soff, db, doff, length = row
        assert (so, do, ln) == (sum(sizes_s[:sb]) + soff, sum(sizes_d[:db]) + doff, length)
    bad = plan.runs.copy()
    bad[0, DST_BUFFER if dst.num_buffers <= src.num_buffers else SRC_BUFFER] = max(src.num_buffers, dst.num_buffers)
    with pytest.raises(LayoutError, match="buffer"):
        Plan(plan.kind, bad).segments(src, dst)
