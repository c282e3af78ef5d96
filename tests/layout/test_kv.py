"""KVLayout: validation, and addressing (both ways) against the engines' own tensor shapes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from layout_kit import to_memory

from kvfsm.layout import KVLayout, KVOrder, LayoutError, RankMap, compatible, plan_chunk

ORDERS = list(KVOrder)


def cases() -> list[tuple[KVOrder, bool, int, int]]:
    out = [(o, False, tp, r) for o in ORDERS for tp in (1, 2, 4) for r in (0, tp - 1)]
    return out + [(o, True, tp, tp - 1) for o in (KVOrder.SGLANG, KVOrder.VLLM_NHD) for tp in (1, 2)]


@pytest.mark.parametrize(("order", "mla", "tp", "rank"), cases())
def test_address_and_identify_agree_with_the_engine_tensor(order: KVOrder, mla: bool, tp: int, rank: int) -> None:
    lay = KVLayout(3, 1 if mla else 4, 4, 2, tp, rank, 8, 5, order, mla)
    # a cache whose every head vector holds its own (layer, kv, page, off, local head) number
    shape = (lay.num_layers, lay.num_kv, lay.num_pages, lay.page_size, len(lay.local_heads))
    ids = np.arange(int(np.prod(shape)), dtype=np.uint16).reshape(*shape, 1).repeat(lay.head_dim, axis=-1)
    mem = to_memory(lay, ids)
    assert lay.buffers() == tuple(b.size for b in mem)
    vb = lay.vector_bytes
    for idx in itertools.product(*(range(n) for n in shape)):
        buf, off = lay.address(*idx)
        assert off % vb == 0
        got = mem[buf][off : off + vb].view(np.uint16)
        assert (got == np.ravel_multi_index(idx, shape)).all(), (idx, buf, off)
    for buf in range(lay.num_buffers):  # the inverse names every vector of every buffer, once
        layer, kv, slot, head = lay.vectors_of(buf)
        page, off = np.divmod(slot, lay.page_size)
        want = mem[buf].view(np.uint16)[:: lay.head_dim]
        assert (np.ravel_multi_index((layer, kv, page, off, head), shape) == want).all()


def test_the_latent_and_k_v_buffers_engines_allocate() -> None:
    sg = KVLayout(2, 8, 128, 2, 2, 1, 16, 10)
    assert sg.local_heads == range(4, 8) and sg.vector_bytes == 256
    assert sg.buffers() == (160 * 4 * 256,) * 4  # K of layers 0, 1 then V of layers 0, 1
    assert KVLayout(2, 8, 128, 2, 2, 1, 16, 10, KVOrder.VLLM_HND).buffers() == (2 * 160 * 4 * 256,) * 2
    assert KVLayout(2, 8, 128, 2, 2, 1, 16, 10, KVOrder.VLLM_CPU).buffers() == (2 * 160 * 4 * 256,) * 2
    mla = KVLayout(2, 1, 576, 2, 4, 3, 64, 10, KVOrder.SGLANG, mla=True)
    assert mla.local_heads == range(1) and mla.buffers() == (640 * 1152,) * 2
    assert KVLayout(2, 1, 576, 2, 4, 3, 64, 10, "vllm_nhd", mla=True).buffers() == (640 * 1152,) * 2  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"tp_rank": 2}, "tp_rank must be in [0, 2)"),
        ({"num_kv_heads": 3}, "do not split evenly"),
        ({"order": "vllm_xyz"}, "order must be one of"),
        ({"mla": True}, "one latent head"),
        ({"mla": True, "num_kv_heads": 1, "order": KVOrder.VLLM_CPU}, "has no MLA form"),
        ({"page_size": True}, "page_size must be a positive int"),
    ],
)
def test_a_layout_that_cannot_exist_is_refused_at_construction(kwargs: dict[str, object], words: str) -> None:
    base: dict[str, object] = dict(
        num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=2, tp_size=2, tp_rank=0, page_size=16, num_pages=4
    )
    with pytest.raises(LayoutError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        KVLayout(**{**base, **kwargs})  # type: ignore[arg-type]


def test_an_address_outside_the_layout_is_refused() -> None:
    lay = KVLayout(2, 4, 8, 2, 2, 0, 16, 4)
    with pytest.raises(LayoutError, match="local_head 2 is outside"):
        lay.address(0, 0, 0, 0, 2)
    with pytest.raises(LayoutError, match="page 4 is outside"):
        lay.address(0, 1, 4, 0, 0)


@pytest.mark.parametrize(
    ("dst_changes", "reason"),
    [
        ({"num_layers": 3}, "model shape differs: num_layers 2 at prefill, 3 at decode"),
        ({"num_kv_heads": 8}, "model shape differs: num_kv_heads 4 at prefill, 8 at decode"),
        ({"head_dim": 16}, "model shape differs: head_dim 8 at prefill, 16 at decode"),
        ({"dtype_bytes": 1}, "model shape differs: dtype_bytes 2 at prefill, 1 at decode"),
        ({"num_kv_heads": 1, "mla": True}, "model shape differs: num_kv_heads 4 at prefill, 1 at decode"),
    ],
)
def test_incompatible_layouts_are_refused_with_the_reason(dst_changes: dict[str, object], reason: str) -> None:
    base: dict[str, object] = dict(
        num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=2, tp_size=2, tp_rank=0, page_size=16, num_pages=4
    )
    src = KVLayout(**base)  # type: ignore[arg-type]
    dst = KVLayout(**{**base, **dst_changes})  # type: ignore[arg-type]
    assert compatible(src, dst) == reason
    assert compatible(src, src) is None
    with pytest.raises(LayoutError, match="cannot send to decode rank 0: " + reason):
        plan_chunk(src, dst, [0], [0], 0, 4, RankMap(4, 2, 2))


def test_mla_on_one_side_only_and_a_mapping_for_other_groups_are_refused() -> None:
    one = KVLayout(2, 1, 8, 2, 1, 0, 16, 4)
    mla = KVLayout(2, 1, 8, 2, 1, 0, 16, 4, mla=True)
    assert compatible(one, mla) == "MLA on one side only (prefill mla=False, decode mla=True)"
    with pytest.raises(LayoutError, match="does not describe prefill TP 1 -> decode TP 1"):
        plan_chunk(one, one, [0], [0], 0, 4, RankMap(1, 2, 1))
    with pytest.raises(LayoutError, match="does not describe"):
        plan_chunk(mla, mla, [0], [0], 0, 4, RankMap(1, 1, 1, mla=False))
