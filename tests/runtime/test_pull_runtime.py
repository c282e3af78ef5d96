"""Pull mode through the managers over loopback: decode claims, is granted, reads prefill's pages
(byte-exact, with and without KV layouts); leases, heartbeats, aborts on either side, a dead
decode rank, and a lease that ended before the read could start."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_layouts import SENTINEL, Net, check_room, layouts

from kvfsm.protocol import KVPoll, LocalProtocolError
from kvfsm.runtime import DecodeManager, PrefillManager, RuntimeConfig
from kvfsm.testing import ManualClock
from kvfsm.transport.loopback import Fabric

PAGE = 64
AUX = 16
PAGES = 32
LEASE = 30.0


class Pair:
    """One prefill and one decode rank without layouts (a page a token)."""

    def __init__(self, **timeouts: float) -> None:
        self.clock = ManualClock()
        self.fabric = Fabric(0)
        config = RuntimeConfig(workers=0, pull_timeouts=timeouts)
        rng = np.random.default_rng(0)
        self.pkv = rng.integers(0, 256, PAGE * PAGES, dtype=np.uint8)
        self.dkv = np.full(PAGE * PAGES, SENTINEL, np.uint8)
        self.prefill = PrefillManager(
            0, self.fabric.endpoint("p0"), kv=self.pkv, aux=np.zeros(4 * AUX, np.uint8),
            page_bytes=PAGE, aux_slot_bytes=AUX, config=config, clock=self.clock,
        )  # fmt: skip
        self.decode = DecodeManager(
            0, self.fabric.endpoint("d0"), prefill_peers={0: "p0"}, kv=self.dkv, aux=np.zeros(4 * AUX, np.uint8),
            page_bytes=PAGE, aux_slot_bytes=AUX, config=config, clock=self.clock,
        )  # fmt: skip
        self.decode.connect()
        self.settle()

    def settle(self) -> None:
        while self.fabric.pump():
            pass

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.prefill.tick()
        self.decode.tick()
        self.settle()

    def same(self, src: list[int], dst: list[int]) -> bool:
        return all(
            np.array_equal(self.pkv[s * PAGE : (s + 1) * PAGE], self.dkv[d * PAGE : (d + 1) * PAGE])
            for s, d in zip(src, dst, strict=True)
        )


def test_decode_reads_prefills_pages_and_both_succeed():
    net = Pair()
    src, dst = [3, 4, 5, 9, 1], [20, 2, 7, 8, 30]
    offer = net.prefill.create_offer(7, src)
    assert offer.poll() == KVPoll.WaitingForInput and offer.pages_in_use()
    puller = net.decode.create_puller(7)
    puller.init(dst)
    net.settle()
    assert puller.poll() == KVPoll.Success, net.decode._rooms[7].room.failure
    assert net.same(src, dst)
    assert puller.transferred()[0] == len(src) * PAGE
    assert offer.poll() == KVPoll.Success and not offer.pages_in_use()  # the read's notification
    offer.clear()
    puller.clear()
    assert net.prefill.live_rooms() == net.decode.live_rooms() == 0
    untouched = np.ones(PAGES, bool)
    untouched[dst] = False
    assert (net.dkv.reshape(PAGES, PAGE)[untouched] == SENTINEL).all()


def test_pages_allocated_before_the_grant_and_a_claim_before_the_offer():
    net = Pair()
    puller = net.decode.create_puller(1, tokens=3)
    puller.init([0, 1, 2])
    net.settle()  # the claim reaches prefill before the engine offered the room: kept
    assert puller.poll() == KVPoll.Bootstrapping
    offer = net.prefill.create_offer(1, [10, 11, 12])
    net.settle()
    assert puller.poll() == KVPoll.Success and offer.poll() == KVPoll.Success
    assert net.same([10, 11, 12], [0, 1, 2])


def test_heartbeats_keep_the_lease_while_decode_waits_for_pages():
    net = Pair(lease=LEASE, renew=5.0)
    offer = net.prefill.create_offer(2, [1, 2])
    puller = net.decode.create_puller(2)
    net.settle()
    assert puller.poll() == KVPoll.WaitingForInput  # granted; no pages yet
    for _ in range(20):  # 100 s: three leases' worth, the lease renewed every 5 s
        net.advance(5.0)
    assert offer.poll() == KVPoll.Transferring
    claims = net.decode._rooms[2].room.epoch
    assert claims >= 20
    puller.init([5, 6])
    net.settle()
    assert puller.poll() == KVPoll.Success and offer.poll() == KVPoll.Success
    assert net.same([1, 2], [5, 6])


def test_a_silent_decode_lets_the_lease_expire_and_the_pages_free():
    net = Pair(lease=LEASE)
    offer = net.prefill.create_offer(3, [1, 2])
    net.decode.create_puller(3)
    net.settle()
    net.fabric.crash("d0")  # no more claims; prefill is not told
    net.clock.advance(LEASE - 1)
    net.prefill.tick()
    assert offer.pages_in_use() and offer.poll() == KVPoll.Transferring
    net.clock.advance(1.5)
    net.prefill.tick()
    assert offer.poll() == KVPoll.Failed and not offer.pages_in_use()
    assert "lease expired" in str(offer.failure_exception())
    offer.clear()


def test_prefill_abort_keeps_the_pages_until_decode_is_done():
    net = Pair()
    offer = net.prefill.create_offer(4, [1, 2])
    puller = net.decode.create_puller(4)
    net.fabric.pump(1)  # the claim
    net.fabric.pump(1)  # the grant
    offer.abort("engine shut the request")
    assert offer.poll() == KVPoll.Failed
    assert offer.pages_in_use()  # a granted read may be in flight
    with pytest.raises(LocalProtocolError):
        offer.clear()
    net.settle()  # decode hears of the failure and releases its lease
    assert puller.poll() == KVPoll.Failed
    assert not offer.pages_in_use()
    offer.clear()
    puller.clear()


def test_decode_aborted_mid_read_frees_prefill_and_waits_for_its_read():
    net = Pair()
    offer = net.prefill.create_offer(5, [1, 2, 3])
    puller = net.decode.create_puller(5)
    net.settle()
    puller.init([7, 8, 9])  # the read is posted; its completion is still on the fabric
    puller.abort("client went away")
    assert puller.poll() == KVPoll.Failed and puller.pages_in_use()
    with pytest.raises(LocalProtocolError):
        puller.clear()
    net.settle()
    assert not puller.pages_in_use()
    puller.clear()
    assert not offer.pages_in_use()  # the read landed: its notification freed prefill
    offer.clear()


def test_decode_aborted_before_reading_releases_prefill_at_once():
    net = Pair()
    offer = net.prefill.create_offer(6, [1, 2])
    puller = net.decode.create_puller(6)
    net.settle()
    puller.abort("client went away")
    net.settle()
    assert offer.poll() == KVPoll.Failed and not offer.pages_in_use()
    assert "released" in str(offer.failure_exception())
    offer.clear()
    puller.clear()


def test_a_read_is_never_posted_after_the_lease_decode_counted():
    net = Pair(lease=LEASE)
    net.prefill.create_offer(8, [1, 2])
    puller = net.decode.create_puller(8)
    puller.init([3, 4])
    net.fabric.pump(1)  # the claim arrives at once: the grant waits on the wire ...
    net.clock.advance(LEASE)  # ... longer than the lease
    net.settle()
    assert puller.poll() == KVPoll.Failed
    assert "lease ended" in str(puller.failure_exception())
    assert (net.dkv == SENTINEL).all()  # nothing was read


def test_claims_for_a_failed_room_are_answered_not_granted():
    net = Pair()
    offer = net.prefill.create_offer(9, [1])
    offer.abort()
    puller = net.decode.create_puller(9)
    net.settle()
    assert puller.poll() == KVPoll.Failed and "aborted" in str(puller.failure_exception())


def test_tokens_that_disagree_fail_the_room_with_the_reason():
    net = Pair()
    net.prefill.create_offer(10, [1, 2, 3])
    puller = net.decode.create_puller(10, tokens=2)
    net.settle()
    assert puller.poll() == KVPoll.Failed
    assert "tokens" in str(puller.failure_exception())


def test_offer_refuses_pages_that_do_not_hold_the_tokens():
    net = Pair()
    with pytest.raises(LocalProtocolError):
        net.prefill.create_offer(11, [1, 2], tokens=3)
    with pytest.raises(LocalProtocolError):
        net.prefill.create_offer(12, [PAGES])


PULL_CASES = [
    # (prefill TP, prefill page, decode TP, decode page, orders, heads, mla)
    (1, 32, 1, 32, ("vllm_cpu", "vllm_cpu"), 2, False),
    (2, 16, 4, 64, ("sglang", "sglang"), 4, False),
    (4, 64, 2, 16, ("vllm_nhd", "vllm_hnd"), 4, False),
    (2, 16, 4, 32, ("sglang", "sglang"), 2, False),  # replicated heads at decode
    (4, 16, 2, 64, ("sglang", "vllm_nhd"), 1, True),  # MLA: each decode rank reads one source
]


@pytest.mark.parametrize(("tp", "ps", "td", "pd", "orders", "heads", "mla"), PULL_CASES)
def test_every_head_vector_is_read_from_its_source(tp, ps, td, pd, orders, heads, mla):
    net = Net(
        layouts(tp, ps, 256 // ps + 4, orders[0], heads=heads, mla=mla),
        layouts(td, pd, 256 // pd + 4, orders[1], heads=heads, mla=mla),
    )
    mapping = net.mapping()
    rng = random.Random(2)
    for rid, tokens in enumerate((ps * 3 + 5, pd + 1, 7)):
        src_pages = {p: rng.sample(range(lay.num_pages), -(-tokens // lay.page_size)) for p, lay in enumerate(net.src)}
        dst_pages = {d: rng.sample(range(lay.num_pages), -(-tokens // lay.page_size)) for d, lay in enumerate(net.dst)}
        offers = [net.prefill[p].create_offer(rid, src_pages[p], tokens) for p in range(tp) if mapping.dests_of(p)]
        pullers = [m.create_puller(rid, tokens=tokens) for m in net.decode]
        for d, pl in enumerate(pullers):
            pl.init(dst_pages[d], tokens)
        net.settle()
        for d, pl in enumerate(pullers):
            assert pl.poll() == KVPoll.Success, (d, net.decode[d]._rooms[rid].room.failure)
        for o in offers:
            assert o.poll() == KVPoll.Success
        assert check_room(net, tokens, dst_pages, src_pages) > 0
        for h in [*offers, *pullers]:
            h.clear()
        for buf in net.dbuf:
            for b in buf:
                b.fill(SENTINEL)
    assert all(m.live_rooms() == 0 for m in [*net.prefill, *net.decode])
