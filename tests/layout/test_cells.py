"""Plans between vLLM CPU caches of different block sizes (kvfsm.layout.cells), checked against a
model of the CPU cells written independently of the planner: K transposed ``[head_dim,
block_size]`` then V ``[block_size, head_dim]`` per (block, head), every element a known function
of its identity."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvfsm.layout import KVLayout, KVOrder, PlanError, Planner, RankMap, compatible, verify_plan
from kvfsm.layout.cells import segments

D = 4  # head_dim
LAYERS = 2
HEADS = 4


def cpu(tp: int, rank: int, bs: int, pages: int) -> KVLayout:
    return KVLayout(LAYERS, HEADS, D, 4, tp, rank, bs, pages, KVOrder.VLLM_CPU, False, True)


def value(layer: int, kv: int, token: int, head: int, j: int) -> float:
    return float(1 + layer * 10**6 + kv * 10**5 + token * 100 + head * 10 + j)


def fill(lay: KVLayout, pages: list[int], tokens: int) -> list[np.ndarray]:
    """The rank's layer buffers (float32), the request's tokens written as the CPU kernels lay them
    out, everything else -1."""
    local = len(lay.local_heads)
    bufs = [np.full(lay.num_pages * local * 2 * lay.page_size * D, -1.0, np.float32) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        cells = bufs[layer].reshape(lay.num_pages, local, 2 * lay.page_size * D)
        for t in range(tokens):
            page, off = pages[t // lay.page_size], t % lay.page_size
            for h in range(local):
                g = lay.local_heads.start + h
                for j in range(D):
                    cells[page, h, j * lay.page_size + off] = value(layer, 0, t, g, j)  # K[j, off]
                    cells[page, h, lay.page_size * D + off * D + j] = value(layer, 1, t, g, j)  # V[off, j]
    return bufs


def apply(plan, src: KVLayout, dst: KVLayout, sbufs: list[np.ndarray], dbufs: list[np.ndarray]) -> None:
    s = np.concatenate([b.view(np.uint8) for b in sbufs])
    d = np.concatenate([b.view(np.uint8) for b in dbufs])
    for so, do, n in zip(*plan.segments(src, dst), strict=True):
        d[do : do + n] = s[so : so + n]
    size = dbufs[0].nbytes
    for i, b in enumerate(dbufs):
        b.view(np.uint8)[:] = d[i * size : (i + 1) * size]


CASES = [
    # prefill (tp, block), decode (tp, block)
    ((1, 32), (1, 64)),
    ((1, 64), (1, 32)),
    ((1, 16), (1, 48)),
    ((2, 32), (1, 64)),
    ((1, 32), (2, 16)),
]


@pytest.mark.parametrize(("p", "d"), CASES)
def test_every_element_of_the_request_lands_where_the_decode_cells_keep_it(p, d):
    rng = random.Random(5)
    tokens = 150
    src = [cpu(p[0], r, p[1], 24) for r in range(p[0])]
    dst = [cpu(d[0], r, d[1], 24) for r in range(d[0])]
    mapping = RankMap(HEADS, p[0], d[0], False)
    spages = [rng.sample(range(24), -(-tokens // lay.page_size)) for lay in src]
    dpages = [rng.sample(range(24), -(-tokens // lay.page_size)) for lay in dst]
    sbufs = [fill(lay, spages[i], tokens) for i, lay in enumerate(src)]
    for di, dl in enumerate(dst):
        dbufs = [np.full_like(b, -1.0) for b in fill(dl, dpages[di], 0)]
        for pi in mapping.sources_of(dl.tp_rank):
            planner = Planner(src[pi], dl, mapping)
            # in chunks, as push sends them: each plan from the chunk's own first token
            for first in range(0, tokens, 40):
                n = min(40, tokens - first)
                plan = planner.plan(spages[pi], dpages[di], first, n)
                verify_plan(plan, src[pi], dl, spages[pi], dpages[di], first, n, mapping)
                apply(plan, src[pi], dl, sbufs[pi], dbufs)
        np.testing.assert_array_equal(dbufs, fill(dl, dpages[di], tokens))  # and nothing else written


def test_the_plan_is_few_runs_per_segment():
    src, dst = cpu(1, 0, 32, 8), cpu(1, 0, 64, 8)
    plan = Planner(src, dst, RankMap(HEADS, 1, 1, False)).plan([0, 1, 2, 3], [5, 6], 0, 100)
    starts, counts = segments(0, 100, 32, 64)
    assert counts.tolist() == [32, 32, 32, 4]
    assert plan.descriptors == LAYERS * len(starts) * HEADS * (D + 1)  # K: a run per dimension; V: one


def test_verify_catches_a_run_that_lands_elsewhere():
    src, dst = cpu(1, 0, 32, 8), cpu(1, 0, 64, 8)
    mapping = RankMap(HEADS, 1, 1, False)
    plan = Planner(src, dst, mapping).plan([0, 1], [3], 0, 50)
    runs = plan.runs.copy()
    runs[3, 3] += 4  # one K row shifted by a token
    bad = type(plan)(plan.kind, runs)
    with pytest.raises(PlanError):
        verify_plan(bad, src, dst, [0, 1], [3], 0, 50, mapping)
    short = type(plan)(plan.kind, plan.runs[:-1])
    with pytest.raises(PlanError, match="elements written"):
        verify_plan(short, src, dst, [0, 1], [3], 0, 50, mapping)


def test_other_opaque_pairs_still_need_one_page_size():
    a, b = cpu(1, 0, 32, 8), cpu(1, 0, 64, 8)
    assert compatible(a, b) is None
    nhd = KVLayout(LAYERS, HEADS, D, 4, 1, 0, 64, 8, KVOrder.VLLM_NHD, False, True)
    assert "same order" in (compatible(a, nhd) or "")
