"""Behaviour of the loopback transport (kvfsm/transport/loopback.py), read as the port's contract.

The fabric is driven the way the runtime drives it: endpoints with real registered bytes, writes
that copy, and ``pump()`` delivering queued items to handlers. Every test can fail: copies are
checked byte for byte against a model, orders against per-pair sequence numbers, and "sometimes"
properties (reordering happens, seeds matter) guard against vacuous schedulers.
"""

from __future__ import annotations

import ctypes
import random
import sys
import threading
from collections import Counter
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.config import ConfigError
from kvfsm.transport.base import Inbound, Segment, TransportError
from kvfsm.transport.loopback import Fabric, Faults, LoopbackEndpoint

PROPERTY = settings(max_examples=200, deadline=None)
SEEDS = st.integers(min_value=0, max_value=2**32 - 1)


class Net:
    """Endpoints on one fabric, each with random registered kv/aux bytes and a shared delivery log."""

    def __init__(self, fabric: Fabric, *names: str, kv: int = 256, aux: int = 64, seed: int = 0) -> None:
        self.fabric = fabric
        self.log: list[tuple[str, Inbound]] = []
        self.eps: dict[str, LoopbackEndpoint] = {}
        self.kv: dict[str, bytearray] = {}
        self.aux: dict[str, bytearray] = {}
        r = random.Random(seed)
        for name in names:
            ep = fabric.endpoint(name)
            self.kv[name] = bytearray(r.randbytes(kv))
            self.aux[name] = bytearray(r.randbytes(aux))
            ep.register_memory(memoryview(self.kv[name]), memoryview(self.aux[name]))
            ep.set_handler(lambda ib, name=name: self.log.append((name, ib)))
            self.eps[name] = ep

    def __getitem__(self, name: str) -> LoopbackEndpoint:
        return self.eps[name]

    def got(self, name: str, kind: str | None = None) -> list[Inbound]:
        return [ib for dst, ib in self.log if dst == name and (kind is None or ib.kind == kind)]

    def trace(self) -> list[tuple[str, str, str, bytes, object]]:
        return [(dst, ib.kind, ib.peer, ib.data, ib.tag) for dst, ib in self.log]


def _expected_after(dst: bytes, src: bytes, segments: Iterable[Segment]) -> bytearray:
    out = bytearray(dst)
    for s in segments:
        out[s.dst : s.dst + s.length] = src[s.src : s.src + s.length]
    return out


@st.composite
def _segments_within(draw: st.DrawFn, src_len: int, dst_len: int, max_segments: int = 6) -> list[Segment]:
    segs = []
    for _ in range(draw(st.integers(0, max_segments))):
        length = draw(st.integers(0, min(src_len, dst_len)))
        segs.append(Segment(draw(st.integers(0, src_len - length)), draw(st.integers(0, dst_len - length)), length))
    return segs


# --------------------------------------------------------------------------------- data plane


@PROPERTY
@given(
    data=st.data(),
    region=st.sampled_from(["kv", "aux"]),
    src_len=st.integers(1, 512),
    dst_len=st.integers(1, 512),
    seed=SEEDS,
)
def test_write_copies_exactly_the_segment_bytes_and_nothing_else(
    data: st.DataObject, region: str, src_len: int, dst_len: int, seed: int
) -> None:
    r = random.Random(seed)
    fabric = Fabric(seed)
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    a_mem = {"kv": bytearray(r.randbytes(src_len)), "aux": bytearray(r.randbytes(src_len))}
    b_mem = {"kv": bytearray(r.randbytes(dst_len)), "aux": bytearray(r.randbytes(dst_len))}
    a.register_memory(memoryview(a_mem["kv"]), memoryview(a_mem["aux"]))
    b.register_memory(memoryview(b_mem["kv"]), memoryview(b_mem["aux"]))
    segs = data.draw(_segments_within(src_len, dst_len))
    a_before = {k: bytes(v) for k, v in a_mem.items()}
    expected = {k: bytes(v) for k, v in b_mem.items()}
    expected[region] = bytes(_expected_after(b_mem[region], a_mem[region], segs))

    moved = a.write("b", region, segs, b"n", tag=None)

    assert moved == sum(s.length for s in segs)
    assert {k: bytes(v) for k, v in b_mem.items()} == expected  # the other region is untouched too
    assert {k: bytes(v) for k, v in a_mem.items()} == a_before  # the source is only read
    assert fabric.stats.bytes_written == moved
    assert fabric.stats.segments == len(segs)


def test_writer_gets_a_completion_carrying_its_tag_and_the_peer_gets_the_notification() -> None:
    fabric = Fabric(3)
    net = Net(fabric, "prefill", "decode")
    tag = object()
    net["prefill"].write("decode", "kv", [Segment(0, 8, 32)], b"chunk-0", tag)
    assert fabric.pending == 2
    fabric.pump()
    [completion] = net.got("prefill")
    assert completion.kind == "completion" and completion.tag is tag
    assert completion.ok and completion.peer == "decode"
    [note] = net.got("decode")
    assert note == Inbound("notification", "prefill", data=b"chunk-0")


def test_notification_is_delivered_only_after_its_data_is_in_place() -> None:
    # A transfer thread writes while the main thread pumps; the handler checks, at delivery time,
    # that the bytes the notification announces are already in the destination.
    chunk, n = 64 * 1024, 48
    fabric = Fabric(11)
    src = bytearray(random.Random(1).randbytes(chunk * n))
    dst = bytearray(chunk * n)
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    a.register_memory(memoryview(src), memoryview(bytearray(8)))
    b.register_memory(memoryview(dst), memoryview(bytearray(8)))
    early: list[int] = []
    noted: list[int] = []
    tags: list[object] = []

    def on_notification(ib: Inbound) -> None:
        assert ib.kind == "notification"
        i = int(ib.data)
        if dst[i * chunk : (i + 1) * chunk] != src[i * chunk : (i + 1) * chunk]:
            early.append(i)
        noted.append(i)

    b.set_handler(on_notification)
    a.set_handler(lambda ib: tags.append(ib.tag))

    def transfer() -> None:
        for i in range(n):
            a.write("b", "kv", [Segment(i * chunk, i * chunk, chunk)], str(i).encode(), tag=("chunk", i))

    worker = threading.Thread(target=transfer)
    worker.start()
    while worker.is_alive() or fabric.pending:
        fabric.pump()
    worker.join()

    assert early == []
    assert sorted(noted) == list(range(n))
    assert sorted(tags) == [("chunk", i) for i in range(n)]
    assert dst == src


_GOOD = [Segment(0, 0, 16), Segment(16, 40, 16)]
_BAD = {
    # source kv is 256 bytes, destination kv 128: each overrun is in-bounds on the other side
    "src overrun": Segment(200, 0, 60),
    "dst overrun": Segment(0, 100, 60),
    "negative src": Segment(-8, 0, 4),
    "negative dst": Segment(0, -8, 4),
    "negative length": Segment(8, 8, -1),
    "src overrun by one byte": Segment(241, 0, 16),
    "dst overrun by one byte": Segment(0, 113, 16),
}


@pytest.mark.parametrize("bad", list(_BAD.values()), ids=list(_BAD))
@pytest.mark.parametrize("bad_at", [0, 1, 2])
def test_segment_outside_a_registered_region_is_rejected_before_any_byte_is_written(bad: Segment, bad_at: int) -> None:
    fabric = Fabric(0)
    src = Net(fabric, "a", kv=256)
    dst = bytearray(random.Random(5).randbytes(128))
    b = fabric.endpoint("b")
    b.register_memory(memoryview(dst), memoryview(bytearray(64)))
    b.set_handler(lambda ib: src.log.append(("b", ib)))
    before = bytes(dst)
    segments = _GOOD[:bad_at] + [bad] + _GOOD[bad_at:]

    with pytest.raises(TransportError, match="outside registered kv"):
        src["a"].write("b", "kv", segments, b"n", tag=1)

    assert bytes(dst) == before
    assert fabric.pending == 0
    assert fabric.pump() == 0 and src.log == []
    assert (fabric.stats.writes, fabric.stats.bytes_written, fabric.stats.sent) == (0, 0, 0)


def test_segments_ending_exactly_at_the_end_of_both_regions_are_accepted() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a", "b", kv=256, aux=64)
    assert net["a"].write("b", "kv", [Segment(240, 112, 16), Segment(0, 256, 0)], b"n", tag=1) == 16
    assert net.kv["b"][112:128] == net.kv["a"][240:256]


@PROPERTY
@given(data=st.data(), seed=SEEDS)
def test_any_bad_segment_among_good_ones_leaves_the_destination_untouched(data: st.DataObject, seed: int) -> None:
    fabric = Fabric(seed)
    net = Net(fabric, "a", "b", kv=96, seed=seed)
    good = data.draw(_segments_within(96, 96))
    off = st.integers(-200, 200)
    bad = data.draw(
        st.builds(Segment, off, off, st.integers(-4, 200)).filter(
            lambda s: s.length < 0 or s.src < 0 or s.dst < 0 or s.src + s.length > 96 or s.dst + s.length > 96
        )
    )
    at = data.draw(st.integers(0, len(good)))
    before = bytes(net.kv["b"])
    with pytest.raises(TransportError):
        net["a"].write("b", "kv", good[:at] + [bad] + good[at:], b"n", tag=1)
    assert bytes(net.kv["b"]) == before
    assert fabric.pending == 0


def test_write_before_memory_is_registered_raises_transport_error() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a")
    fabric.endpoint("bare")
    with pytest.raises(TransportError, match="not registered"):
        net["a"].write("bare", "kv", [Segment(0, 0, 1)], b"", tag=1)
    assert fabric.pending == 0


def test_write_to_an_unknown_peer_raises_but_send_to_one_is_dropped_quietly() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a")
    with pytest.raises(TransportError, match="not reachable"):
        net["a"].write("ghost", "kv", [Segment(0, 0, 1)], b"", tag=1)
    net["a"].send("ghost", b"hello")
    assert fabric.pending == 0
    assert fabric.stats.undeliverable == 1


def test_items_for_an_endpoint_without_a_handler_are_counted_undeliverable() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a")
    fabric.endpoint("mute")
    net["a"].send("mute", b"x")
    assert fabric.pump() == 1
    assert (fabric.stats.delivered, fabric.stats.undeliverable) == (0, 1)


def test_attaching_the_same_name_twice_is_refused() -> None:
    fabric = Fabric(0)
    fabric.endpoint("a")
    with pytest.raises(ValueError, match="already attached"):
        fabric.endpoint("a")


# --------------------------------------------------------------------------------- crashes


def test_write_to_a_crashed_peer_raises_and_copies_nothing() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a", "b")
    fabric.crash("b")
    before = bytes(net.kv["b"])
    with pytest.raises(TransportError, match="not reachable"):
        net["a"].write("b", "kv", [Segment(0, 0, 64)], b"n", tag=1)
    assert bytes(net.kv["b"]) == before
    assert fabric.pending == 0


def test_a_crashed_endpoint_cannot_write_either() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a", "b")
    fabric.crash("a")
    with pytest.raises(TransportError):
        net["a"].write("b", "kv", [Segment(0, 0, 64)], b"n", tag=1)


def test_crash_drops_queued_items_to_and_from_the_crashed_endpoint() -> None:
    fabric = Fabric(4)
    net = Net(fabric, "a", "b", "c")
    net["a"].send("c", b"a->c")
    net["c"].send("a", b"c->a")
    net["c"].write("a", "kv", [Segment(0, 0, 8)], b"c wrote", tag="c-tag")  # notification + completion
    net["b"].send("a", b"b->a")
    assert fabric.pending == 5

    fabric.crash("c")

    assert fabric.pending == 2  # b->a and the peer_lost for a
    fabric.pump()
    assert net.got("c") == []
    assert [ib.data for ib in net.got("a", "message")] == [b"b->a"]
    assert net.got("a", "notification") == []
    [lost] = net.got("a", "peer_lost")
    assert lost.peer == "c" and "c" in lost.reason


def test_sends_from_a_crashed_endpoint_vanish() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a", "c")
    fabric.crash("c")
    net["c"].send("a", b"from beyond")
    assert fabric.pending == 0
    fabric.pump()
    assert net.log == []


def test_peer_lost_reaches_exactly_the_live_endpoints_that_exchanged_items_with_the_crashed_one() -> None:
    fabric = Fabric(9)
    net = Net(fabric, "victim", "sent_to", "heard_from", "wrote_to", "stranger", "dead_friend")
    net["sent_to"].send("victim", b"1")
    net["victim"].send("heard_from", b"2")
    net["victim"].write("wrote_to", "aux", [Segment(0, 0, 4)], b"3", tag=3)
    net["dead_friend"].send("victim", b"4")
    net["stranger"].send("sent_to", b"5")
    fabric.pump()  # delivery does not erase the acquaintance
    fabric.crash("dead_friend")
    net.log.clear()

    fabric.crash("victim")
    fabric.crash("victim")  # a second crash tells nobody anything new
    fabric.pump()

    lost = sorted(dst for dst, ib in net.log if ib.kind == "peer_lost" and ib.peer == "victim")
    assert lost == ["heard_from", "sent_to", "wrote_to"]
    assert [ib.kind for _, ib in net.log] == ["peer_lost"] * 3


_PAIR = st.tuples(st.sampled_from("abcd"), st.sampled_from("abcd"))


@PROPERTY
@given(
    seed=SEEDS,
    ordered=st.booleans(),
    before=st.lists(_PAIR, max_size=20),
    pumped=st.integers(0, 25),
    after=st.lists(_PAIR, max_size=20),
    victim=st.sampled_from("abcd"),
)
def test_after_a_crash_nothing_reaches_or_comes_from_the_victim_but_one_peer_lost_per_contact(
    seed: int, ordered: bool, before: list[tuple[str, str]], pumped: int, after: list[tuple[str, str]], victim: str
) -> None:
    fabric = Fabric(seed, ordered=ordered)
    net = Net(fabric, *"abcd")
    for src, dst in before:
        net[src].send(dst, f"{src}>{dst}".encode())
    fabric.pump(pumped)
    cut = len(net.log)
    fabric.crash(victim)
    for src, dst in after:
        net[src].send(dst, f"{src}>{dst}".encode())
    fabric.pump()

    contacts = {d for s, d in before if s == victim} | {s for s, d in before if d == victim}
    late = net.log[cut:]
    assert [dst for dst, _ in late if dst == victim] == []
    assert [ib for _, ib in late if ib.peer == victim and ib.kind != "peer_lost"] == []
    assert sorted(dst for dst, ib in late if ib.kind == "peer_lost") == sorted(contacts - {victim})


def test_writer_learns_the_fate_of_a_write_whose_peer_crashes_during_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The copy runs outside the fabric lock (and outside the GIL), so another thread may crash the
    # peer while it runs. The contract (loopback docstring): "Completions are never dropped (the
    # transport always reports the fate of our own writes)". Either write() raises, or a completion
    # for its tag arrives.
    fabric = Fabric(0)
    net = Net(fabric, "a", "b")
    real_memmove = ctypes.memmove

    def memmove_while_peer_crashes(dst: int, src: int, n: int) -> int:
        fabric.crash("b")
        return real_memmove(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", memmove_while_peer_crashes)
    try:
        net["a"].write("b", "kv", [Segment(0, 0, 16)], b"n", tag="t1")
    except TransportError:
        return
    finally:
        monkeypatch.undo()
    fabric.pump()
    assert [ib.tag for ib in net.got("a", "completion")] == ["t1"]


# --------------------------------------------------------------------------------- ordering


def _received_sequences(net: Net) -> dict[tuple[str, str], list[int]]:
    seqs: dict[tuple[str, str], list[int]] = {}
    for dst, ib in net.log:
        if ib.kind == "message":
            src, n = ib.data.decode().split("#")
            seqs.setdefault((src, dst), []).append(int(n))
    return seqs


@PROPERTY
@given(
    seed=SEEDS,
    sends=st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from("abcd"), st.integers(0, 3)), max_size=60),
    delay=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_ordered_fabric_keeps_fifo_per_pair_under_any_seed(
    seed: int, sends: list[tuple[str, str, int]], delay: float
) -> None:
    fabric = Fabric(seed, ordered=True, faults=Faults(delay=delay, max_delay=4))
    net = Net(fabric, *"abcd")
    sent: Counter[tuple[str, str]] = Counter()
    for src, dst, pump_after in sends:  # sends from several endpoints interleaved with deliveries
        net[src].send(dst, f"{src}#{sent[src, dst]}".encode())
        sent[src, dst] += 1
        fabric.pump(pump_after)
    fabric.pump()
    assert _received_sequences(net) == {pair: list(range(n)) for pair, n in sent.items()}


def test_unordered_fabric_reorders_a_pair_for_some_seed() -> None:
    orders = []
    for seed in range(5):
        fabric = Fabric(seed, ordered=False)
        net = Net(fabric, "a", "b")
        for i in range(10):
            net["a"].send("b", f"a#{i}".encode())
        fabric.pump()
        [order] = _received_sequences(net).values()
        assert sorted(order) == list(range(10))  # reordered, never lost or duplicated
        orders.append(order)
    assert any(order != sorted(order) for order in orders)


def test_ordered_fabric_interleaves_different_pairs_for_some_seed() -> None:
    # Guards the FIFO property against a vacuous scheduler that drains one pair at a time.
    shapes = set()
    for seed in range(5):
        fabric = Fabric(seed, ordered=True)
        net = Net(fabric, "a", "b", "c")
        for i in range(10):
            net["a"].send("c", f"a#{i}".encode())
            net["b"].send("c", f"b#{i}".encode())
        fabric.pump()
        shapes.add("".join(ib.peer for ib in net.got("c")))
    assert shapes - {"a" * 10 + "b" * 10, "b" * 10 + "a" * 10}


# --------------------------------------------------------------------------------- determinism

_OP = st.tuples(st.sampled_from(["send", "write"]), st.sampled_from("abc"), st.sampled_from("abc"))


def _run(seed: int, ordered: bool, faults: Faults, ops: list[tuple[str, str, str]]) -> tuple[list, tuple]:
    fabric = Fabric(seed, ordered=ordered, faults=faults)
    net = Net(fabric, "a", "b", "c")
    for i, (op, src, dst) in enumerate(ops):
        if op == "send":
            net[src].send(dst, f"{src}#{i}".encode())
        else:
            net[src].write(dst, "kv", [Segment(i % 8, i % 8, 8)], f"w{i}".encode(), tag=i)
        if i % 3 == 2:
            fabric.pump(1)
    fabric.pump()
    s = fabric.stats
    return net.trace(), (s.sent, s.delivered, s.dropped, s.duplicated, s.delayed)


@PROPERTY
@given(
    seed=SEEDS,
    ordered=st.booleans(),
    faults=st.builds(
        Faults,
        drop=st.sampled_from([0.0, 0.3]),
        dup=st.sampled_from([0.0, 0.3]),
        delay=st.sampled_from([0.0, 0.3]),
    ),
    ops=st.lists(_OP, max_size=30),
)
def test_same_seed_and_same_sends_give_the_same_delivery_sequence(
    seed: int, ordered: bool, faults: Faults, ops: list[tuple[str, str, str]]
) -> None:
    assert _run(seed, ordered, faults, ops) == _run(seed, ordered, faults, ops)


@pytest.mark.parametrize("ordered", [True, False])
def test_different_seeds_give_different_delivery_orders(ordered: bool) -> None:
    ops = [("send", src, dst) for src in "abc" for dst in "abc"] * 2 + [("write", "a", "b"), ("write", "c", "b")]
    traces = {tuple(_run(seed, ordered, Faults(), ops)[0]) for seed in range(6)}
    assert len(traces) > 1


# --------------------------------------------------------------------------------- faults


def test_drop_loses_every_message_and_notification_but_never_a_completion() -> None:
    fabric = Fabric(1, faults=Faults(drop=1.0))
    net = Net(fabric, "a", "b")
    for _ in range(5):
        net["a"].send("b", b"m")
        net["b"].send("a", b"m")
    for i in range(3):
        net["a"].write("b", "kv", [Segment(8 * i, 8 * i, 8)], b"n", tag=i)
    fabric.pump()
    assert net.got("b") == []
    assert [(ib.kind, ib.tag) for ib in net.got("a")] == [("completion", i) for i in range(3)]
    assert net.kv["b"][:24] == net.kv["a"][:24]  # the data still moved; only its notification was lost
    s = fabric.stats
    assert (s.sent, s.delivered, s.dropped, s.duplicated, s.writes) == (3, 3, 13, 0, 3)


def test_dup_delivers_every_message_and_notification_twice_and_every_completion_once() -> None:
    fabric = Fabric(2, faults=Faults(dup=1.0))
    net = Net(fabric, "a", "b")
    for i in range(4):
        net["a"].send("b", f"m{i}".encode())
    for i in range(3):
        net["a"].write("b", "aux", [Segment(i, i, 1)], f"n{i}".encode(), tag=i)
    fabric.pump()
    assert Counter(ib.data for ib in net.got("b")) == {
        **{f"m{i}".encode(): 2 for i in range(4)},
        **{f"n{i}".encode(): 2 for i in range(3)},
    }
    assert sorted(ib.tag for ib in net.got("a", "completion")) == [0, 1, 2]
    s = fabric.stats
    assert (s.sent, s.delivered, s.dropped, s.duplicated) == (17, 17, 0, 7)


@PROPERTY
@given(
    seed=SEEDS,
    ordered=st.booleans(),
    delay=st.sampled_from([0.25, 0.5, 1.0]),
    max_delay=st.integers(1, 8),
    n=st.integers(1, 30),
)
def test_delayed_items_are_each_delivered_exactly_once(
    seed: int, ordered: bool, delay: float, max_delay: int, n: int
) -> None:
    fabric = Fabric(seed, ordered=ordered, faults=Faults(delay=delay, max_delay=max_delay))
    net = Net(fabric, "a", "b", "c")
    for i in range(n):
        net["abc"[i % 3]].send("abc"[(i + 1) % 3], f"m{i}".encode())
    assert fabric.pending == n
    assert fabric.pump() == n
    assert sorted(ib.data for _, ib in net.log) == sorted(f"m{i}".encode() for i in range(n))
    s = fabric.stats
    assert (s.sent, s.delivered, s.dropped, s.duplicated) == (n, n, 0, 0)
    assert s.delayed == n if delay == 1.0 else 0 <= s.delayed <= n


@PROPERTY
@given(seed=SEEDS, ordered=st.booleans())
def test_a_delayed_item_is_held_back_behind_later_undelayed_ones(seed: int, ordered: bool) -> None:
    fabric = Fabric(seed, ordered=ordered, faults=Faults(delay=1.0, max_delay=4))
    net = Net(fabric, "a", "b", "c")
    net["a"].send("c", b"late")
    for i in range(8):  # inject() bypasses fault injection: these are never held
        net["c"].inject("b", Inbound("message", "b", data=bytes([i])))
    fabric.pump()
    datas = [ib.data for ib in net.got("c")]
    assert len(datas) == 9 and datas.count(b"late") == 1
    assert datas[0] != b"late"


def test_stats_count_what_happened_on_a_clean_fabric() -> None:
    fabric = Fabric(5)
    net = Net(fabric, "a", "b", "c")
    net["a"].send("b", b"1")
    net["b"].send("c", b"2")
    net["c"].send("a", b"3")
    net["a"].write("b", "kv", [Segment(0, 0, 10), Segment(20, 30, 5), Segment(100, 0, 7)], b"w1", tag=1)
    net["c"].write("b", "aux", [Segment(0, 0, 3), Segment(3, 60, 4)], b"w2", tag=2)
    assert fabric.pending == 7
    fabric.pump()
    s = fabric.stats
    assert (s.sent, s.delivered, s.dropped, s.duplicated, s.delayed, s.undeliverable) == (7, 7, 0, 0, 0, 0)
    assert (s.bytes_written, s.writes, s.segments) == (29, 2, 5)
    assert len(net.log) == 7


# --------------------------------------------------------------------------------- pumping


def test_pump_delivers_at_most_max_items_and_pending_counts_what_is_queued() -> None:
    fabric = Fabric(6)
    net = Net(fabric, "a", "b")
    for i in range(8):
        net["a"].send("b", bytes([i]))
    net["a"].write("b", "kv", [Segment(0, 0, 1)], b"n", tag=1)
    assert fabric.pending == 10
    assert fabric.pump(0) == 0 and net.log == []
    assert fabric.pump(3) == 3 and len(net.log) == 3
    assert fabric.pending == 7
    assert fabric.pump(100) == 7 and len(net.log) == 10
    assert fabric.pending == 0
    assert fabric.pump() == 0


def test_handlers_may_send_and_write_while_being_called() -> None:
    # Ping-pong entirely from inside handlers, in one pump(): the fabric must not hold its lock
    # while it calls a handler. Run in a thread so a deadlock fails the test instead of hanging it.
    fabric = Fabric(8)
    net = Net(fabric, "a", "b")
    rounds = 100
    seen: list[str] = []

    def ping(ib: Inbound) -> None:
        seen.append(ib.kind)
        if ib.kind == "message" and int(ib.data) < rounds:
            net["a"].write("b", "kv", [Segment(0, 0, 4)], ib.data, tag=int(ib.data))

    def pong(ib: Inbound) -> None:
        seen.append(ib.kind)
        net["b"].send("a", str(int(ib.data) + 1).encode())
        assert fabric.pending >= 1

    net["a"].set_handler(ping)
    net["b"].set_handler(pong)
    net["b"].send("a", b"0")
    pumper = threading.Thread(target=fabric.pump, daemon=True)
    pumper.start()
    pumper.join(timeout=10)
    assert not pumper.is_alive(), "pump() deadlocked when a handler sent"
    assert Counter(seen) == {"message": rounds + 1, "notification": rounds, "completion": rounds}
    assert fabric.pending == 0


# --------------------------------------------------------------------------------- buffers


def test_read_only_source_region_is_copied_through_memoryview() -> None:
    fabric = Fabric(0)
    src = random.Random(3).randbytes(128)
    dst = bytearray(128)
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    a.register_memory(memoryview(src), memoryview(b"aux-bytes"))
    b.register_memory(memoryview(dst), memoryview(bytearray(16)))
    assert a.address("kv") == 0 and a.address("aux") == 0  # no raw address: falls back
    assert b.address("kv") != 0  # writable: the ctypes.memmove path
    assert a.write("b", "kv", [Segment(0, 64, 64), Segment(64, 0, 64)], b"n", tag=1) == 128
    assert a.write("b", "aux", [Segment(0, 4, 9)], b"n", tag=2) == 9
    assert dst == bytearray(src[64:] + src[:64])
    assert b.region("aux")[4:13] == b"aux-bytes"


def test_write_into_a_read_only_destination_fails_loudly_and_queues_nothing() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a")
    b = fabric.endpoint("b")
    frozen = bytes(64)
    b.register_memory(memoryview(frozen), memoryview(bytes(8)))
    with pytest.raises((TransportError, TypeError)):
        net["a"].write("b", "kv", [Segment(0, 0, 8)], b"n", tag=1)
    assert frozen == bytes(64)
    assert fabric.pending == 0


def test_write_into_a_read_only_destination_raises_transport_error() -> None:
    fabric = Fabric(0)
    net = Net(fabric, "a")
    b = fabric.endpoint("b")
    b.register_memory(memoryview(bytes(64)), memoryview(bytes(8)))
    with pytest.raises(TransportError):
        net["a"].write("b", "kv", [Segment(0, 0, 8)], b"n", tag=1)


# --------------------------------------------------------------------------------- threads


def test_concurrent_writers_into_disjoint_ranges_deliver_every_byte_notification_and_completion() -> None:
    threads, per_thread, size = 4, 200, 256
    fabric = Fabric(12)
    dst = bytearray(threads * per_thread * size)
    b = fabric.endpoint("b")
    b.register_memory(memoryview(dst), memoryview(bytearray(8)))
    notes: list[bytes] = []
    b.set_handler(lambda ib: notes.append(ib.data))
    writers, sources, completions = [], [], {}
    for t in range(threads):
        ep = fabric.endpoint(f"w{t}")
        src = bytearray(random.Random(t).randbytes(per_thread * size))
        ep.register_memory(memoryview(src), memoryview(bytearray(8)))
        completions[t] = []
        ep.set_handler(lambda ib, t=t: completions[t].append((ib.kind, ib.tag)))
        writers.append(ep)
        sources.append(src)
    barrier = threading.Barrier(threads)

    def work(t: int) -> None:
        barrier.wait()
        base = t * per_thread * size
        for i in range(per_thread):
            writers[t].write("b", "kv", [Segment(i * size, base + i * size, size)], f"{t}.{i}".encode(), tag=i)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races in the fabric show up
    try:
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert fabric.pending == 2 * threads * per_thread
    fabric.pump()

    assert dst == b"".join(sources)
    assert sorted(notes) == sorted(f"{t}.{i}".encode() for t in range(threads) for i in range(per_thread))
    for t in range(threads):
        assert sorted(completions[t]) == [("completion", i) for i in range(per_thread)]
    s = fabric.stats
    assert (s.writes, s.segments, s.bytes_written) == (800, 800, len(dst))
    assert (s.sent, s.delivered) == (1600, 1600)


def test_a_crash_keeps_the_completions_owed_to_survivors_for_writes_into_the_dead_node() -> None:
    fab = Fabric(0)
    a, b = fab.endpoint("a"), fab.endpoint("b")
    got = []
    a.set_handler(got.append)
    b.set_handler(lambda item: None)
    for ep in (a, b):
        ep.register_memory(memoryview(bytearray(64)), memoryview(bytearray(8)))
    a.write("b", "kv", [Segment(0, 0, 8)], b"n", tag="t1")  # data landed; completion queued for a
    fab.crash("b")
    fab.pump()
    assert [(i.kind, i.tag) for i in got if i.kind == "completion"] == [("completion", "t1")]


@pytest.mark.parametrize(
    ("field", "value"),
    [("drop", -0.1), ("dup", 1.5), ("delay", "0.5"), ("max_delay", 0), ("max_delay", 2.0)],
)
def test_faults_refuse_out_of_range_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"Faults\.{field} = {value!r}: it must be"):
        Faults(**{field: value})  # type: ignore[arg-type]
