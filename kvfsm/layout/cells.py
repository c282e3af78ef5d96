"""Plans between vLLM CPU caches of different block sizes: element runs inside (block, head) cells.

Theory of operation
-------------------
vLLM's CPU attention keeps each (block, head) cell of a layer's cache as K transposed, ``[head_dim,
block_size]``, then V, ``[block_size, head_dim]`` (the ``vllm_cpu`` order, declared ``opaque``:
no head-vector run addresses a token's K there). Between two such caches of the same block size
whole cells move (``Planner``, ``whole_pages``). Between block sizes that differ, a token's K is
``head_dim`` elements strided by the block size, so the plan moves, for every stretch of tokens
that stays in one block on both sides ("segment"), every head the pair moves and every layer:

* K: one run per dimension ``j``: the segment's tokens of row ``j`` (contiguous on both sides);
* V: one run: the segment's tokens' rows (contiguous on both sides).

``verify_cells`` proves such a plan element by element, as ``verify_plan`` proves head-vector
plans: every element of every (layer, K/V, token, head, dimension) the pair moves is written once,
from the element of the same identity, and nothing else is written.

Pure: numpy, no torch, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvfsm.layout.kv import IntArray, KVLayout, KVOrder

if TYPE_CHECKING:
    from kvfsm.layout.plan import Plan


def cells_apply(src: KVLayout, dst: KVLayout) -> bool:
    """Plans between ``src`` and ``dst`` move element runs inside cells (see the module)."""
    return src.opaque and src.order == KVOrder.VLLM_CPU and src.page_size != dst.page_size


def _cell_base(lay: KVLayout, pages: IntArray, heads: IntArray) -> IntArray:
    """Byte offset, in a layer's buffer, of cell (page, local head): ``[pages x heads]``."""
    cell = 2 * lay.page_size * lay.head_dim * lay.dtype_bytes
    return (pages[:, None] * len(lay.local_heads) + heads[None, :]) * cell


def segments(first_token: int, num_tokens: int, src_ps: int, dst_ps: int) -> tuple[IntArray, IntArray]:
    """(first token, tokens) of each stretch of ``[first_token, first_token + num_tokens)`` that
    stays in one page on both sides."""
    end = first_token + num_tokens
    cuts = {first_token, end}
    cuts.update(range(-(-first_token // src_ps) * src_ps, end, src_ps))
    cuts.update(range(-(-first_token // dst_ps) * dst_ps, end, dst_ps))
    edges = np.array(sorted(c for c in cuts if first_token <= c <= end), dtype=np.int64)
    return edges[:-1], np.diff(edges)


def cell_runs(
    src: KVLayout,
    dst: KVLayout,
    spages: IntArray,
    dpages: IntArray,
    first_token: int,
    num_tokens: int,
    src_heads: IntArray,
    dst_heads: IntArray,
    src_first_page: int = 0,
    dst_first_page: int = 0,
) -> IntArray:
    """The runs (``Plan.runs`` columns) moving tokens ``[first_token, first_token + num_tokens)``
    of the local heads ``src_heads`` into ``dst_heads`` (pairwise), every layer."""
    e, d = src.dtype_bytes, src.head_dim
    t0, n = segments(first_token, num_tokens, src.page_size, dst.page_size)
    sp = spages[t0 // src.page_size - src_first_page]
    dp = dpages[t0 // dst.page_size - dst_first_page]
    so, do = t0 % src.page_size, t0 % dst.page_size
    sbase = _cell_base(src, sp, src_heads)  # [segments, heads]
    dbase = _cell_base(dst, dp, dst_heads)
    j = np.arange(d, dtype=np.int64)
    # K: row j of the segment's tokens, [segments, heads, d]
    k_src = sbase[:, :, None] + (j[None, None, :] * src.page_size + so[:, None, None]) * e
    k_dst = dbase[:, :, None] + (j[None, None, :] * dst.page_size + do[:, None, None]) * e
    k_len = np.broadcast_to((n * e)[:, None, None], k_src.shape)
    # V: the segment's token rows after the cell's K, [segments, heads]
    v_src = sbase + (src.page_size * d + so[:, None] * d) * e
    v_dst = dbase + (dst.page_size * d + do[:, None] * d) * e
    v_len = np.broadcast_to((n * d * e)[:, None], v_src.shape)
    src_off = np.concatenate((k_src.reshape(-1), v_src.reshape(-1)))
    dst_off = np.concatenate((k_dst.reshape(-1), v_dst.reshape(-1)))
    length = np.concatenate((k_len.reshape(-1), v_len.reshape(-1)))
    base = np.stack((np.zeros_like(src_off), src_off, np.zeros_like(dst_off), dst_off, length), axis=1)
    runs = np.broadcast_to(base, (src.num_layers, *base.shape)).copy()
    layers = np.arange(src.num_layers, dtype=np.int64)[:, None]
    runs[:, :, 0] += layers  # a layer's buffer is its index (one buffer per layer)
    runs[:, :, 2] += layers
    return runs.reshape(-1, 5)


def _identify(lay: KVLayout, buf: IntArray, byte: IntArray, where: dict[int, int]) -> IntArray:
    """(layer, kv, token, global head, dim) of each element at (buffer, byte offset); token -1
    where the page is not the request's."""
    e, d, bs = lay.dtype_bytes, lay.head_dim, lay.page_size
    el = byte // e
    cell, r = np.divmod(el, 2 * bs * d)
    page, head = np.divmod(cell, len(lay.local_heads))
    is_v = r >= bs * d
    kj, kt = np.divmod(r, bs)
    vt, vj = np.divmod(r - bs * d, d)
    t = np.where(is_v, vt, kt)
    j = np.where(is_v, vj, kj)
    pos = np.array([where.get(int(p), -1) for p in page], dtype=np.int64)
    token = np.where(pos >= 0, pos * bs + t, -1)
    return np.stack((buf, is_v.astype(np.int64), token, head + lay.local_heads.start, j), axis=1)


def verify_cells(
    plan: Plan,
    src: KVLayout,
    dst: KVLayout,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    first_token: int,
    num_tokens: int,
    heads: range,
    *,
    src_first_page: int = 0,
    dst_first_page: int = 0,
) -> str | None:
    """None when ``plan`` moves exactly the chunk's elements of ``heads`` (see the module); else
    why not."""
    runs = np.asarray(plan.runs, dtype=np.int64)
    e = src.dtype_bytes
    if runs.size and (runs[:, 4] % e).any():
        return "a run is not a whole number of elements"
    sizes = src.buffers()[0], dst.buffers()[0]
    if runs.size and (
        (runs[:, 1] < 0).any() or (runs[:, 1] + runs[:, 4] > sizes[0]).any()
        or (runs[:, 3] < 0).any() or (runs[:, 3] + runs[:, 4] > sizes[1]).any()
    ):  # fmt: skip
        return "a run leaves its buffer"
    count = runs[:, 4] // e
    idx = np.repeat(np.arange(runs.shape[0]), count)
    step = (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)) * e
    swhere = {int(p): i + src_first_page for i, p in enumerate(np.asarray(src_pages).reshape(-1))}
    dwhere = {int(p): i + dst_first_page for i, p in enumerate(np.asarray(dst_pages).reshape(-1))}
    got_src = _identify(src, runs[idx, 0], runs[idx, 1] + step, swhere)
    got_dst = _identify(dst, runs[idx, 2], runs[idx, 3] + step, dwhere)
    if not np.array_equal(got_src, got_dst):
        bad = int(np.flatnonzero((got_src != got_dst).any(axis=1))[0])
        return f"element {got_dst[bad].tolist()} at decode comes from {got_src[bad].tolist()} at prefill"
    tok = got_dst[:, 2]
    if ((tok < first_token) | (tok >= first_token + num_tokens)).any():
        return "a run writes outside the chunk's tokens"
    if ((got_dst[:, 3] < heads.start) | (got_dst[:, 3] >= heads.stop)).any():
        return "a run writes a head the pair does not move"
    expected = src.num_layers * 2 * num_tokens * len(heads) * src.head_dim
    keys = np.unique(got_dst, axis=0)
    if keys.shape[0] != got_dst.shape[0]:
        return "an element is written twice"
    if keys.shape[0] != expected:
        return f"{keys.shape[0]} elements written, the chunk has {expected}"
    return None
