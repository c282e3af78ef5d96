"""A model engine for layout tests: what a single engine with a given layout holds, byte for byte,
written from the engines' tensor shapes (numpy reshapes and transposes), not from kvfsm's addressing."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvfsm.layout import KVLayout, KVOrder, Plan
from kvfsm.layout.plan import DST_BUFFER, DST_OFFSET, LENGTH, SRC_BUFFER, SRC_OFFSET

SENTINEL = 0xEEEE
U16 = npt.NDArray[np.uint16]


def value(layer: object, kv: object, token: object, head: object, dim: object) -> U16:
    """The element a prefill engine computed for (layer, K/V, token, global head, dim): a known function."""
    v = (
        np.asarray(layer) * 40009
        + np.asarray(kv) * 20011
        + np.asarray(token) * 131
        + np.asarray(head) * 4099
        + np.asarray(dim) * 7
        + 1
    )
    return (v % 65521).astype(np.uint16)


def logical(layout: KVLayout, pages: npt.ArrayLike, tokens: range, heads: range | None = None) -> U16:
    """The cache as [layer, kv, page, off, local head, dim]: ``tokens`` of the request (in ``pages``)
    for the global ``heads`` (default: every head the rank holds); SENTINEL elsewhere."""
    assert layout.dtype_bytes == 2
    local = layout.local_heads
    e = np.full(
        (layout.num_layers, layout.num_kv, layout.num_pages, layout.page_size, len(local), layout.head_dim),
        SENTINEL,
        dtype=np.uint16,
    )
    want = [g for g in (heads if heads is not None else local) if g in local]
    if not want or not tokens:
        return e
    pg = np.asarray(pages, dtype=np.int64)
    t = np.arange(tokens.start, tokens.stop)
    g = np.asarray(want)
    lay = np.arange(layout.num_layers)[:, None, None, None, None]
    kv = np.arange(layout.num_kv)[None, :, None, None, None]
    tt = t[None, None, :, None, None]
    gg = g[None, None, None, :, None]
    dd = np.arange(layout.head_dim)[None, None, None, None, :]
    e[lay, kv, pg[tt // layout.page_size], tt % layout.page_size, gg - local.start, dd] = value(lay, kv, tt, gg, dd)
    return e


def to_memory(layout: KVLayout, e: U16) -> list[npt.NDArray[np.uint8]]:
    """The engine's buffers (flat bytes, index = buffer id) holding the logical cache ``e``."""
    n_layers = layout.num_layers
    slots = layout.num_pages * layout.page_size
    if layout.order == KVOrder.SGLANG:  # per layer K [slots, h, d] then V [slots, h, d] (MLA: [slots, d])
        bufs = [e[layer, kv].reshape(slots, -1) for kv in range(layout.num_kv) for layer in range(n_layers)]
    elif layout.order == KVOrder.VLLM_NHD:  # [2, blocks, bs, h, d] (MLA: [blocks, bs, d])
        bufs = [e[layer] if not layout.mla else e[layer, 0, :, :, 0] for layer in range(n_layers)]
    elif layout.order == KVOrder.VLLM_HND:  # [2, blocks, h, bs, d]
        bufs = [e[layer].transpose(0, 1, 3, 2, 4) for layer in range(n_layers)]
    else:  # vLLM CPU: [blocks, h, bs, 2*d], K then V side by side per token
        bufs = [e[layer].transpose(1, 3, 2, 0, 4) for layer in range(n_layers)]
    return [np.ascontiguousarray(b).view(np.uint8).reshape(-1) for b in bufs]


def apply(plan: Plan, src: list[npt.NDArray[np.uint8]], dst: list[npt.NDArray[np.uint8]]) -> None:
    """Copy the plan's runs byte for byte, as a transport would."""
    for row in plan.runs.tolist():
        sb, so, db, do, n = (row[i] for i in (SRC_BUFFER, SRC_OFFSET, DST_BUFFER, DST_OFFSET, LENGTH))
        dst[db][do : do + n] = src[sb][so : so + n]


def cuts(num_tokens: int) -> list[tuple[int, int]]:
    """The request split into three chunks that do not start or end on page boundaries (for the
    page sizes used here), each no longer than the tokens before it after the first."""
    a, b = num_tokens * 37 // 100, num_tokens * 67 // 100
    return [(0, a), (a, b - a), (b, num_tokens - b)]


def page_list(layout: KVLayout, num_tokens: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    need = -(-num_tokens // layout.page_size)
    return rng.permutation(layout.num_pages)[:need].astype(np.int64)
