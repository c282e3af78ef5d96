"""verify_plan: prove, head vector by head vector, that a plan writes exactly what it must.

Theory of operation
-------------------
The proof does not reuse the planner: it reads the plan's runs back through each layout's inverse
addressing (``KVLayout.identify``) and the page lists, and nothing else.

1. Every run is whole head vectors (offsets and lengths multiples of ``vector_bytes``; both sides'
   vectors are the same size), non-empty, and inside a buffer each side registered.
2. Each run is cut into head vectors; each destination vector gets its identity (layer, K/V,
   slot, local head) from the destination's inverse, the slot becomes a token through the
   destination's page list and the local head a global head through the destination's heads; the
   same for the source vector it is copied from, through the source's layout and page list.
3. Both identities must be equal (the right source element), and the destination identity must
   lie in the expected set: the chunk's tokens x the heads ``mapping.heads(p, d)`` x every layer
   x K and V (nothing else is written).
4. Every expected identity is written exactly once (a count per identity). Since a layout's
   addressing and a page list without repeats are both one-to-one, one write per identity is also
   one write per destination vector: no two runs overlap.

Pure: stdlib and numpy, no torch, no I/O.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvfsm.layout.cells import cells_apply, verify_cells
from kvfsm.layout.kv import IntArray, KVLayout, compatible
from kvfsm.layout.mapping import RankMap
from kvfsm.layout.plan import DST_BUFFER, DST_OFFSET, LENGTH, SRC_BUFFER, SRC_OFFSET, Plan
from kvfsm.protocol.errors import LocalProtocolError


class PlanError(LocalProtocolError):
    """A plan that does not write exactly the chunk's head vectors from their sources."""


def _page_positions(pages: npt.ArrayLike, layout: KVLayout, side: str, first_page: int) -> IntArray:
    """For each page of the layout, its index in the request's page list (-1: not the request's),
    the list starting at the request's page ``first_page``."""
    arr = np.asarray(pages, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= layout.num_pages):
        raise PlanError(f"{side} page list has pages outside [0, {layout.num_pages})")
    if np.unique(arr).size != arr.size:
        raise PlanError(f"{side} page list repeats a page")
    where = np.full(layout.num_pages, -1, dtype=np.int64)
    where[arr] = np.arange(first_page, first_page + arr.size, dtype=np.int64)
    return where


def _check_bounds(runs: IntArray, layout: KVLayout, buf_col: int, off_col: int, side: str) -> None:
    vb = layout.vector_bytes
    buf, off, length = runs[:, buf_col], runs[:, off_col], runs[:, LENGTH]
    size = layout.buffer_vectors * vb
    for bad, what in (
        ((buf < 0) | (buf >= layout.num_buffers), f"a buffer outside [0, {layout.num_buffers})"),
        (off % vb != 0, f"an offset that is not a whole {vb}-byte head vector"),
        ((off < 0) | (off + length > size), f"bytes outside its {size}-byte buffer"),
    ):
        hit = np.flatnonzero(bad)
        if hit.size:
            i = int(hit[0])
            raise PlanError(f"run {i} {runs[i].tolist()} touches {side} {what}")


def _identity_keys(layout: KVLayout, where: IntArray, buf: IntArray, off: IntArray, tokens: int) -> IntArray:
    """One int per vector naming its (layer, K/V, token, global head), the same numbering on both
    sides (``_unkey`` reads it back); token -1 where the vector's page is not the request's."""
    layer, kv, slot, head = layout.identify(buf, off)
    page, in_page = np.divmod(slot, layout.page_size)
    pos = where[page]
    token = np.where(pos >= 0, pos * layout.page_size + in_page, -1)
    key = layer * layout.num_kv
    key += kv
    key *= tokens + 1
    key += token + 1
    key *= layout.num_kv_heads
    key += head + layout.local_heads.start
    return key


def _unkey(key: int, layout: KVLayout, tokens: int) -> str:
    rest, head = divmod(key, layout.num_kv_heads)
    rest, token = divmod(rest, tokens + 1)
    layer, kv = divmod(rest, layout.num_kv)
    where = f"token {token - 1}" if token else "a page not in the request's page list"
    return f"layer {layer}, {'KV'[kv] if layout.num_kv == 2 else 'latent'}, {where}, head {head}"


def verify_plan(
    plan: Plan,
    src: KVLayout,
    dst: KVLayout,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    first_token: int,
    num_tokens: int,
    mapping: RankMap,
    *,
    src_first_page: int = 0,
    dst_first_page: int = 0,
) -> None:
    """Raise ``PlanError`` unless ``plan`` writes every (layer, token, head, K/V) that
    ``mapping.heads(src.tp_rank, dst.tp_rank)`` assigns in the chunk exactly once, each from the
    source vector of the same identity, inside registered memory, and writes nothing else. The
    page lists start at the request's pages ``src_first_page`` and ``dst_first_page``
    (``Planner.plan``)."""
    reason = compatible(src, dst)
    if reason is not None:
        raise PlanError(f"no plan can join these layouts: {reason}")
    if cells_apply(src, dst):  # element runs inside vLLM CPU cells: proved element by element
        why = verify_cells(
            plan, src, dst, src_pages, dst_pages, first_token, num_tokens, mapping.heads(src.tp_rank, dst.tp_rank),
            src_first_page=src_first_page, dst_first_page=dst_first_page,
        )  # fmt: skip
        if why is not None:
            raise PlanError(why)
        return
    runs = np.asarray(plan.runs)
    if runs.ndim != 2 or runs.shape[1] != 5 or not np.issubdtype(runs.dtype, np.integer):
        raise PlanError(f"runs must be an integer array of shape (n, 5), got {runs.dtype} {runs.shape}")
    runs = runs.astype(np.int64, copy=False)
    heads = mapping.heads(src.tp_rank, dst.tp_rank)
    src_where = _page_positions(src_pages, src, "prefill", src_first_page)
    dst_where = _page_positions(dst_pages, dst, "decode", dst_first_page)
    vb = dst.vector_bytes
    expected = dst.num_layers * dst.num_kv * num_tokens * len(heads)
    if runs.shape[0] == 0:
        if expected:
            raise PlanError(f"an empty plan leaves all {expected} head vectors of the chunk unwritten")
        return
    length = runs[:, LENGTH]
    bad = np.flatnonzero((length <= 0) | (length % vb != 0))
    if bad.size:
        i = int(bad[0])
        raise PlanError(f"run {i} {runs[i].tolist()} has a length that is not a positive number of {vb}-byte vectors")
    _check_bounds(runs, src, SRC_BUFFER, SRC_OFFSET, "prefill")
    _check_bounds(runs, dst, DST_BUFFER, DST_OFFSET, "decode")
    counts = length // vb
    total = int(counts.sum())
    if total != expected:
        raise PlanError(f"the plan writes {total} head vectors; the chunk has {expected} to write")
    # cut the runs into vectors: run index, and the vector's byte offset inside its run
    run = np.repeat(np.arange(runs.shape[0], dtype=np.int64), counts)
    step = (np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * vb
    # tokens numbered alike on both sides: up to the longer page list
    tokens = max(src_where.max() + 1, 0) * src.page_size
    tokens = max(tokens, (max(dst_where.max() + 1, 0)) * dst.page_size, first_token + num_tokens)
    d_key = _identity_keys(dst, dst_where, runs[run, DST_BUFFER], runs[run, DST_OFFSET] + step, tokens)
    s_key = _identity_keys(src, src_where, runs[run, SRC_BUFFER], runs[run, SRC_OFFSET] + step, tokens)
    # the expected set, in the same numbering: key = ((layer*kv + c)*(tokens+1) + token+1)*H + head
    rest, head = np.divmod(d_key, dst.num_kv_heads)
    token = rest % (tokens + 1) - 1
    outside = (token < first_token) | (token >= first_token + num_tokens) | (head < heads.start) | (head >= heads.stop)
    hit = np.flatnonzero(outside)
    if hit.size:
        i = int(hit[0])
        raise PlanError(
            f"run {int(run[i])} {runs[run[i]].tolist()} writes decode vector ({_unkey(int(d_key[i]), dst, tokens)}) "
            f"outside the chunk (tokens [{first_token}, {first_token + num_tokens}), heads [{heads.start}, {heads.stop}))"
        )
    hit = np.flatnonzero(d_key != s_key)
    if hit.size:
        i = int(hit[0])
        raise PlanError(
            f"run {int(run[i])} {runs[run[i]].tolist()} writes decode vector ({_unkey(int(d_key[i]), dst, tokens)}) "
            f"from prefill vector ({_unkey(int(s_key[i]), src, tokens)})"
        )
    layer_kv = rest // (tokens + 1)
    dense = (layer_kv * num_tokens + (token - first_token)) * len(heads) + (head - heads.start)
    seen = np.bincount(dense, minlength=expected)
    if seen.max() > 1 or seen.min() < 1:
        i = int(np.flatnonzero(seen != 1)[0])
        rest_i, h = divmod(i, len(heads))
        lkv, t = divmod(rest_i, num_tokens)
        key = ((lkv * (tokens + 1)) + first_token + t + 1) * dst.num_kv_heads + heads.start + h
        raise PlanError(f"decode vector ({_unkey(key, dst, tokens)}) is written {int(seen[i])} times, not once")
