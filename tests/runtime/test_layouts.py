"""Managers with KV layouts over loopback: the handshake judges the pair by its declared rows,
rooms count tokens, and every chunk's write is planned between the two layouts.

Byte-exact: each decode rank's buffers are checked head vector by head vector against the
prefill rank that holds the head (addresses from ``KVLayout.address``, not from a plan), and
every byte outside the request's tokens must still hold its sentinel."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from kvfsm.layout import KVLayout, KVOrder, RankMap
from kvfsm.protocol import KVPoll
from kvfsm.runtime import DecodeManager, PrefillManager, RuntimeConfig
from kvfsm.testing import ManualClock
from kvfsm.transport.loopback import Fabric

AUX = 16
SENTINEL = 0xA5


@dataclass
class Net:
    """P prefill and D decode managers with layouts on one loopback fabric."""

    src: list[KVLayout]
    dst: list[KVLayout]
    config: RuntimeConfig = field(default_factory=lambda: RuntimeConfig(workers=0, verify_plans=True))

    def __post_init__(self) -> None:
        self.clock = ManualClock()
        self.fabric = Fabric(0)
        rng = np.random.default_rng(0)
        self.pbuf = [[rng.integers(0, 256, n, dtype=np.uint8) for n in lay.buffers()] for lay in self.src]
        self.dbuf = [[np.full(n, SENTINEL, np.uint8) for n in lay.buffers()] for lay in self.dst]
        self.paux = [rng.integers(0, 256, 4 * AUX, dtype=np.uint8) for _ in self.src]
        self.daux = [np.zeros(4 * AUX, np.uint8) for _ in self.dst]
        self.prefill = [
            PrefillManager(
                lay.tp_rank,
                self.fabric.endpoint(f"prefill/{lay.tp_rank}"),
                kv=self.pbuf[i],
                aux=self.paux[i],
                aux_slot_bytes=AUX,
                layout=lay,
                config=self.config,
                clock=self.clock,
            )  # fmt: skip
            for i, lay in enumerate(self.src)
        ]
        peers = {p.tp_rank: f"prefill/{p.tp_rank}" for p in self.src}
        self.decode = [
            DecodeManager(
                lay.tp_rank,
                self.fabric.endpoint(f"decode/{lay.tp_rank}"),
                prefill_peers=peers,
                kv=self.dbuf[i],
                aux=self.daux[i],
                aux_slot_bytes=AUX,
                layout=lay,
                config=self.config,
                clock=self.clock,
            )  # fmt: skip
            for i, lay in enumerate(self.dst)
        ]
        for d in self.decode:
            d.connect()
        self.settle()

    def settle(self) -> None:
        while self.fabric.pump():
            pass

    def mapping(self) -> RankMap:
        s, d = self.src[0], self.dst[0]
        return RankMap(s.num_kv_heads, s.tp_size, d.tp_size, s.mla)


def layouts(
    tp: int, page: int, pages: int, order: str = "sglang", *, heads: int = 4, mla: bool = False
) -> list[KVLayout]:
    return [KVLayout(2, 1 if mla else heads, 8, 2, tp, r, page, pages, KVOrder(order), mla) for r in range(tp)]


def run_room(
    net: Net, rid: int, tokens: int, chunk_pages: int, rng: random.Random, *, batched: bool = False
) -> dict[int, list[int]]:
    """One request of ``tokens`` tokens: decode ranks allocate random pages, prefill ranks that take
    part send random pages in chunks of ``chunk_pages`` pages. Returns each decode rank's pages."""
    mapping = net.mapping()
    src_pages = {}
    for p, lay in enumerate(net.src):
        if mapping.dests_of(p):
            src_pages[p] = rng.sample(range(lay.num_pages), -(-tokens // lay.page_size))
    dst_pages = {d: rng.sample(range(lay.num_pages), -(-tokens // lay.page_size)) for d, lay in enumerate(net.dst)}
    receivers = [m.create_receiver(rid) for m in net.decode]
    senders = {p: net.prefill[p].create_sender(rid) for p in src_pages}
    net.settle()
    for d, r in enumerate(receivers):
        assert r.poll() == KVPoll.WaitingForInput, net.decode[d].state(rid)
        r.init(dst_pages[d], aux_slot=1, tokens=tokens)
    net.settle()
    for p, s in senders.items():
        pages = src_pages[p]
        items = []
        for i in range(0, len(pages), chunk_pages):
            last = i + chunk_pages >= len(pages)
            items.append((s, pages[i : i + chunk_pages], last, 0 if last else None))
        if batched:  # every chunk of the rank in one hand-over (an engine's send_many)
            net.prefill[p].send_many(items)
        else:
            for item in items:
                s.send(*item[1:])
        net.settle()
    for d, r in enumerate(receivers):
        assert r.poll() == KVPoll.Success, (d, net.decode[d].state(rid), net.decode[d]._rooms[rid].room.failure)
    for s in senders.values():
        assert s.poll() == KVPoll.Success
        s.clear()
    for r in receivers:
        r.clear()
    return dst_pages


def check_room(net: Net, tokens: int, dst_pages: dict[int, list[int]], src_pages_of: dict[int, list[int]]) -> int:
    """Every head vector of the request at each decode rank equals the one the sending prefill
    rank holds; returns how many were checked."""
    mapping, checked = net.mapping(), 0
    for d, dlay in enumerate(net.dst):
        for p in mapping.sources_of(d):
            slay = net.src[p]
            for g in mapping.heads(p, d):
                for t in range(tokens):
                    for layer in range(dlay.num_layers):
                        for kv in range(dlay.num_kv):
                            db, do = dlay.address(layer, kv, dst_pages[d][t // dlay.page_size],
                                                  t % dlay.page_size, g - dlay.local_heads.start)  # fmt: skip
                            sb, so = slay.address(layer, kv, src_pages_of[p][t // slay.page_size],
                                                  t % slay.page_size, g - slay.local_heads.start)  # fmt: skip
                            n = dlay.vector_bytes
                            got, want = net.dbuf[d][db][do : do + n], net.pbuf[p][sb][so : so + n]
                            assert np.array_equal(got, want), (d, p, g, t, layer, kv)
                            checked += 1
    return checked


CASES = [
    # (prefill TP, prefill page, decode TP, decode page, order of each side, heads, mla)
    (2, 16, 4, 64, ("sglang", "sglang"), 4, False),
    (4, 64, 2, 16, ("sglang", "sglang"), 4, False),
    (2, 16, 2, 16, ("vllm_nhd", "vllm_hnd"), 4, False),
    (1, 32, 2, 16, ("vllm_cpu", "sglang"), 2, False),
    (2, 16, 4, 32, ("sglang", "sglang"), 2, False),  # replicated heads at decode
    (4, 16, 2, 64, ("sglang", "vllm_nhd"), 1, True),  # MLA: one sender per decode rank
    (2, 1, 4, 1, ("sglang", "sglang"), 4, False),  # a page a token (SGLang's default page size)
]


@pytest.mark.parametrize(("tp", "ps", "td", "pd", "orders", "heads", "mla"), CASES)
def test_every_head_vector_of_every_token_lands_from_its_source(tp, ps, td, pd, orders, heads, mla):
    src = layouts(tp, ps, 256 // ps + 4, orders[0], heads=heads, mla=mla)
    net = Net(src, layouts(td, pd, 256 // pd + 4, orders[1], heads=heads, mla=mla))
    assert all(d.link_state(p) == "ready" for d in net.decode for p in range(tp))
    rng = random.Random(1)
    for rid, tokens in enumerate((ps * 3 + 5, pd + 1, 7, 2 * max(ps, pd))):
        # the pages prefill will send, drawn as run_room draws them (same seed, same order)
        state = rng.getstate()
        dst_pages = run_room(net, rid, tokens, 2, rng, batched=rid % 2 == 1)
        rng.setstate(state)
        src_pages = {
            p: rng.sample(range(lay.num_pages), -(-tokens // lay.page_size))
            for p, lay in enumerate(net.src)
            if net.mapping().dests_of(p)
        }
        _ = {d: rng.sample(range(lay.num_pages), -(-tokens // lay.page_size)) for d, lay in enumerate(net.dst)}
        assert check_room(net, tokens, dst_pages, src_pages) > 0
        for buf in net.dbuf:  # clean for the next request: everything back to the sentinel
            for b in buf:
                b.fill(SENTINEL)
    assert all(m.live_rooms() == 0 for m in [*net.prefill, *net.decode])


def test_nothing_outside_the_request_is_written():
    net = Net(layouts(2, 16, 16), layouts(4, 64, 4))
    rng = random.Random(3)
    dst_pages = run_room(net, 1, 70, 1, rng)
    for d, lay in enumerate(net.dst):
        touched = np.zeros(sum(lay.buffers()), bool)
        bases = np.concatenate(([0], np.cumsum(lay.buffers())[:-1]))
        for t in range(70):
            for g in lay.local_heads:
                for layer in range(lay.num_layers):
                    for kv in range(lay.num_kv):
                        b, o = lay.address(layer, kv, dst_pages[d][t // lay.page_size], t % lay.page_size,
                                           g - lay.local_heads.start)  # fmt: skip
                        touched[bases[b] + o : bases[b] + o + lay.vector_bytes] = True
        whole = np.concatenate(net.dbuf[d])
        assert (whole[~touched] == SENTINEL).all(), f"decode rank {d} has bytes written outside the request"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"num_layers": 3}, "model shape differs: num_layers"),
        ({"head_dim": 16}, "model shape differs: head_dim"),
        ({"num_kv_heads": 2}, "model shape differs: num_kv_heads"),
        ({"dtype_bytes": 4}, "model shape differs: dtype_bytes"),
    ],
)
def test_an_incompatible_pair_is_refused_at_the_handshake_with_the_reason(change, reason):
    src = layouts(2, 16, 8)
    dst = [replace(lay, **change) for lay in layouts(2, 16, 8)]
    net = Net(src, dst)
    for d in net.decode:
        assert all(d.link_state(p) == "refused" for p in range(2))
        assert reason in (d.link_failure(0) or "")
        r = d.create_receiver(5)
        assert r.poll() == KVPoll.Failed and reason in r.failure_exception().reason
    assert net.prefill[0].stats()["counters"].get("registrations_refused", 0) >= 1


def test_a_layout_on_one_side_only_is_refused():
    fabric, clock = Fabric(0), ManualClock()
    lay = layouts(1, 16, 8)[0]
    p = PrefillManager(0, fabric.endpoint("prefill/0"), kv=[np.zeros(n, np.uint8) for n in lay.buffers()],
                       aux=np.zeros(4 * AUX, np.uint8), aux_slot_bytes=AUX, layout=lay, clock=clock,
                       config=RuntimeConfig(workers=0))  # fmt: skip
    d = DecodeManager(0, fabric.endpoint("decode/0"), prefill_peers={0: "prefill/0"}, kv=np.zeros(8 * 512, np.uint8),
                      aux=np.zeros(4 * AUX, np.uint8), page_bytes=512, aux_slot_bytes=AUX, clock=clock,
                      config=RuntimeConfig(workers=0))  # fmt: skip
    d.connect()
    while fabric.pump():
        pass
    assert d.link_state(0) == "refused" and "only prefill declares a KV layout" in (d.link_failure(0) or "")
    assert p.live_rooms() == 0


def test_decode_pages_that_do_not_hold_the_tokens_exactly_are_refused_by_the_engine_call():
    net = Net(layouts(1, 16, 8), layouts(1, 64, 4))
    r = net.decode[0].create_receiver(1)
    net.settle()
    with pytest.raises(Exception, match="do not hold exactly"):
        r.init([0, 1], aux_slot=0, tokens=64)  # two pages of 64 for 64 tokens: one too many


def test_a_chunk_that_overruns_the_tokens_fails_the_room_before_any_byte_moves():
    net = Net(layouts(1, 16, 8), layouts(1, 64, 4))
    r = net.decode[0].create_receiver(1)
    s = net.prefill[0].create_sender(1)
    net.settle()
    r.init([2], aux_slot=0, tokens=40)  # 40 tokens: three prefill pages of 16
    net.settle()
    s.send([0, 1, 2], is_last=False)  # not the last, yet it ends past token 40
    net.settle()
    assert s.poll() == KVPoll.Failed and "page count mismatch" in s.failure_exception().reason
    assert (np.concatenate(net.dbuf[0]) == SENTINEL).all()


def test_a_run_of_pages_a_token_each_is_planned_too():
    """One token per page, one destination, ascending runs on both sides: the one-run fast row
    applies; with layouts its write is still planned between the two orders."""
    net = Net(layouts(1, 1, 64, "vllm_nhd"), layouts(1, 1, 64, "sglang"))
    r = net.decode[0].create_receiver(1)
    s = net.prefill[0].create_sender(1)
    net.settle()
    r.init(range(20, 50), aux_slot=0, tokens=30)
    net.settle()
    s.send(range(0, 10))
    s.send(range(10, 30), is_last=True, aux_slot=1)
    net.settle()
    assert r.poll() == KVPoll.Success and s.poll() == KVPoll.Success
    assert net.prefill[0].stats()["counters"]["descriptors"] > 2  # planned per head vector, not one run
    assert check_room(net, 30, {0: list(range(20, 50))}, {0: list(range(30))}) == 30 * 4 * 2 * 2


def test_opaque_pages_move_whole_and_only_between_equal_layouts():
    """vLLM's CPU cache keeps each block's K transposed: a layout declared ``opaque`` moves whole
    (page, head) cells, the last page of a request whole, and pairs only with its own order (TP
    may differ; another page size only between vLLM CPU caches, tests/layout/test_cells.py)."""
    src = [replace(lay, opaque=True) for lay in layouts(2, 16, 16, "vllm_cpu")]
    net = Net(src, [replace(lay, opaque=True) for lay in layouts(4, 16, 16, "vllm_cpu")])
    rng = random.Random(5)
    dst_pages = run_room(net, 1, 37, 1, rng)  # 37 tokens: the third page holds 5 of 16
    for d, lay in enumerate(net.dst):
        for b, buffer in enumerate(net.dbuf[d]):
            cells = buffer.reshape(lay.num_pages, -1)  # a page's cells, every local head
            assert not (cells[dst_pages[d]] == SENTINEL).all(axis=1).any(), (d, b)  # every page whole
            others = np.setdiff1d(np.arange(lay.num_pages), dst_pages[d])
            assert (cells[others] == SENTINEL).all()
    other = Net(src, [replace(lay, opaque=True) for lay in layouts(4, 16, 16, "vllm_nhd")])
    assert "same order" in (other.decode[0].link_failure(0) or "")


def test_two_decode_engines_receive_from_one_prefill_engine_under_ids_of_their_own():
    """A decode rank's id in the protocol is its own (here 7 and 9); its layout says where it
    sits in its TP group (both are TP rank 0 of a TP-1 engine)."""
    fabric, clock = Fabric(0), ManualClock()
    cfg = RuntimeConfig(workers=0, verify_plans=True)
    src, dst = layouts(1, 16, 16)[0], layouts(1, 64, 4)[0]
    pbuf = [np.arange(n, dtype=np.uint64).astype(np.uint8) for n in src.buffers()]
    p = PrefillManager(0, fabric.endpoint("p"), kv=pbuf, aux=np.zeros(4 * AUX, np.uint8), aux_slot_bytes=AUX,
                       layout=src, config=cfg, clock=clock)  # fmt: skip
    decodes = {
        ident: DecodeManager(
            ident,
            fabric.endpoint(f"d{ident}"),
            prefill_peers={0: "p"},
            kv=[np.zeros(n, np.uint8) for n in dst.buffers()],
            aux=np.zeros(4 * AUX, np.uint8),
            aux_slot_bytes=AUX,
            layout=dst,
            config=cfg,
            clock=clock,
        )  # fmt: skip
        for ident in (7, 9)
    }
    for d in decodes.values():
        d.connect()
    while fabric.pump():
        pass
    assert all(d.link_state(0) == "ready" for d in decodes.values())
    for room, (ident, d) in enumerate(decodes.items()):
        r = d.create_receiver(room)
        s = p.create_sender(room)
        r.init([1, 2], aux_slot=0, tokens=70)
        s.send(range(5), is_last=True, aux_slot=room)
        while fabric.pump():
            pass
        assert r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, ident
        got = np.concatenate([b.reshape(4, -1)[[1, 2]].reshape(-1) for b in d.kv])
        assert got.any()
