"""One conformance suite for every transport (trio's ``check_two_way_stream`` is the model).

Data planes (loopback, NIXL) and control planes (loopback, ZMQ) are each driven through the port
they implement (kvfsm/transport/base.py) and must behave alike: bytes land exactly, a notification
is seen only after its data, every posted transfer completes exactly once, bad input is refused
before a byte moves, a peer's descriptor is installed before its first message, peer loss is told
once. NIXL runs real agents (UCX over loopback/shared memory on DRAM); ZMQ real sockets on
127.0.0.1. Each net is built by a factory so adding a transport is adding one factory.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvfsm.transport.base import Inbound, Segment, SegmentArray, TransportError
from kvfsm.transport.loopback import Fabric
from kvfsm.transport.nixl import nixl_available

NIXL_MISSING = nixl_available()
KV_BLOCK = 512
KV_BYTES = 64 * KV_BLOCK
AUX_BLOCK = 64
AUX_BYTES = 16 * AUX_BLOCK


def wait_until(pred: Callable[[], bool], settle: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        settle()
        if pred():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached within the deadline")
        time.sleep(0.0005)


class Recorder:
    """A handler per endpoint that logs every inbound item, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, Inbound]] = []
        self.hooks: list[Callable[[str, Inbound], None]] = []

    def handler(self, name: str) -> Callable[[Inbound], None]:
        def handle(item: Inbound) -> None:
            for hook in self.hooks:
                hook(name, item)
            with self.lock:
                self.items.append((name, item))

        return handle

    def got(self, name: str, kind: str) -> list[Inbound]:
        with self.lock:
            return [ib for dst, ib in self.items if dst == name and ib.kind == kind]


# --------------------------------------------------------------------------------- data planes


class DataNet:
    def __init__(self, kind: str, names: tuple[str, ...], seed: int = 0) -> None:
        self.kind = kind
        self.rec = Recorder()
        rng = np.random.default_rng(seed)
        self.kv = {n: rng.integers(0, 256, KV_BYTES, dtype=np.uint8) for n in names}
        self.aux = {n: rng.integers(0, 256, AUX_BYTES, dtype=np.uint8) for n in names}
        self.fabric: Fabric | None = None
        self.planes: dict[str, Any] = {}
        if kind == "loopback":
            self.fabric = Fabric(seed)
            for n in names:
                self.planes[n] = self.fabric.endpoint(n)
        else:
            from kvfsm.transport.nixl import NixlConfig, NixlDataPlane

            for n in names:
                self.planes[n] = NixlDataPlane(n, config=NixlConfig(caller_posts=CALLER_POSTS[kind]))
        for n, p in self.planes.items():
            p.set_handler(self.rec.handler(n))
            p.register_memory(self.kv[n], self.aux[n], kv_block=KV_BLOCK, aux_block=AUX_BLOCK)
        for n, p in self.planes.items():
            for m, q in self.planes.items():
                if m != n:
                    p.add_peer(m, q.descriptor())

    def region(self, name: str, region: str) -> np.ndarray:
        return self.kv[name] if region == "kv" else self.aux[name]

    def settle(self) -> None:
        if self.fabric is not None:
            self.fabric.pump()

    def wait(self, pred: Callable[[], bool], timeout: float = 10.0) -> None:
        wait_until(pred, self.settle, timeout)

    def close(self) -> None:
        for p in self.planes.values():
            p.close()


# NIXL twice: writes posted by the data plane's posting thread, and by the caller (Nagle-style,
# as for device memory): both paths pass the whole suite on real agents.
CALLER_POSTS = {"nixl": "never", "nixl-caller": "always"}
DATA_KINDS = [
    "loopback",
    *(
        pytest.param(k, marks=pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}"))
        for k in CALLER_POSTS
    ),
]


@pytest.fixture(params=DATA_KINDS)
def data_net(request: pytest.FixtureRequest) -> Iterator[DataNet]:
    net = DataNet(request.param, ("a", "b", "c"))
    yield net
    net.close()


def _apply(dst: np.ndarray, src: np.ndarray, segments: list[Segment]) -> np.ndarray:
    out = dst.copy()
    for s in segments:
        out[s.dst : s.dst + s.length] = src[s.src : s.src + s.length]
    return out


def _random_segments(rng: random.Random, src_len: int, dst_len: int, n: int, block: int = 1) -> list[Segment]:
    segs = []
    for _ in range(n):
        length = rng.randint(1, min(src_len, dst_len) // 4 // block) * block
        src = rng.randrange(0, (src_len - length) // block + 1) * block
        dst = rng.randrange(0, (dst_len - length) // block + 1) * block
        segs.append(Segment(src, dst, length))
    return segs


def _watch_notifications(data_net: DataNet, dst: np.ndarray) -> tuple[dict[bytes, bool], dict[bytes, np.ndarray]]:
    """(seen, plans): for each notification ``b`` receives, whether ``dst`` held exactly
    ``plans[note]`` (what the test expects once that write landed) when it arrived."""
    seen_at_notify: dict[bytes, bool] = {}
    plans: dict[bytes, np.ndarray] = {}

    def check(name: str, item: Inbound) -> None:
        if name == "b" and item.kind == "notification":
            seen_at_notify[item.data] = bool((dst == plans[item.data]).all())

    data_net.rec.hooks.append(check)
    return seen_at_notify, plans


@pytest.mark.parametrize("region", ["kv", "aux"])
@pytest.mark.parametrize("aligned", [True, False], ids=["block-aligned", "byte-ranges"])
def test_write_lands_exactly_and_notifies_after_data(data_net: DataNet, region: str, aligned: bool) -> None:
    rng = random.Random(7)
    block = (KV_BLOCK if region == "kv" else AUX_BLOCK) if aligned else 1
    src, dst = data_net.region("a", region), data_net.region("b", region)
    expected = dst.copy()
    seen_at_notify, plans = _watch_notifications(data_net, dst)
    for i in range(5):
        segs = _random_segments(rng, len(src), len(dst), rng.randint(1, 4), block)
        # segments of one write may overlap at the destination; later ones win, as in the model
        expected = _apply(expected, src, segs)
        note = f"w{i}".encode()
        plans[note] = expected.copy()
        moved = data_net.planes["a"].write("b", region, segs, note, ("tag", i))
        assert moved == sum(s.length for s in segs)
        data_net.wait(lambda i=i: len(data_net.rec.got("a", "completion")) == i + 1)
        data_net.wait(lambda note=note: note in seen_at_notify)
    assert (dst == expected).all()
    assert all(seen_at_notify.values()), "a notification arrived before its data"
    done = data_net.rec.got("a", "completion")
    assert [c.tag for c in done] == [("tag", i) for i in range(5)]
    assert all(c.ok and c.peer == "b" for c in done)
    assert [n.peer for n in data_net.rec.got("b", "notification")] == ["a"] * 5
    assert data_net.rec.got("c", "notification") == []


def test_read_copies_from_peer_and_notifies_it(data_net: DataNet) -> None:
    segs = [Segment(3 * KV_BLOCK, 10 * KV_BLOCK, 2 * KV_BLOCK), Segment(100, 7, 300)]
    expected = _apply(data_net.kv["a"], data_net.kv["b"], segs)
    moved = data_net.planes["a"].read("b", "kv", segs, b"read-done", "r1")
    assert moved == 2 * KV_BLOCK + 300
    data_net.wait(lambda: data_net.rec.got("a", "completion") and data_net.rec.got("b", "notification"))
    assert (data_net.kv["a"] == expected).all()
    (note,) = data_net.rec.got("b", "notification")
    assert (note.peer, note.data) == ("a", b"read-done")
    (done,) = data_net.rec.got("a", "completion")
    assert (done.tag, done.ok) == ("r1", True)


def test_empty_write_still_notifies_and_completes(data_net: DataNet) -> None:
    before = data_net.kv["b"].copy()
    assert data_net.planes["a"].write("b", "kv", [], b"nothing", "e") == 0
    data_net.wait(lambda: data_net.rec.got("a", "completion") and data_net.rec.got("b", "notification"))
    assert (data_net.kv["b"] == before).all()
    assert data_net.rec.got("b", "notification")[0].data == b"nothing"
    assert data_net.rec.got("a", "completion")[0].tag == "e"


@pytest.mark.parametrize("form", ["list", "array"])
@pytest.mark.parametrize(
    ("per_segment", "reverse"),
    [(KV_BLOCK, True), (2 * KV_BLOCK, False), (100, True)],
    ids=["blocks-reversed", "two-block-runs", "byte-ranges"],
)
def test_a_scattered_write_lands_exactly_as_segments_or_as_a_segment_array(
    data_net: DataNet, form: str, per_segment: int, reverse: bool
) -> None:
    """A write of many short runs (a scattered chunk: one segment per page or run, here 24..64)
    lands byte for byte whether its segments come as ``Segment``s or as a ``SegmentArray`` (the
    runtime's form for long scattered chunks), and counts the same bytes."""
    n = min(64, KV_BYTES // per_segment // 2)
    order = list(range(n))[::-1] if reverse else list(range(n))
    segs = [Segment(i * per_segment, (n + j) * per_segment, per_segment) for i, j in enumerate(order)]
    arg: Any = segs if form == "list" else SegmentArray.of(segs)
    expected = _apply(data_net.kv["b"], data_net.kv["a"], segs)
    assert data_net.planes["a"].write("b", "kv", arg, b"scattered", "s") == n * per_segment
    data_net.wait(lambda: data_net.rec.got("a", "completion") and data_net.rec.got("b", "notification"))
    assert (data_net.kv["b"] == expected).all()
    (done,) = data_net.rec.got("a", "completion")
    assert (done.tag, done.ok) == ("s", True)


@pytest.mark.parametrize("form", ["list", "array"])
@pytest.mark.parametrize(
    "bad",
    [
        Segment(0, KV_BYTES - 10, 11),  # past the end of the peer's region
        Segment(KV_BYTES, 0, 1),  # past the end of ours
        Segment(-1, 0, 4),
        Segment(0, -1, 4),
        Segment(0, 0, -4),
    ],
    ids=["remote-overflow", "local-overflow", "negative-offset", "negative-remote-offset", "negative-length"],
)
@pytest.mark.parametrize("alone", [False, True], ids=["after-a-good-one", "alone"])
def test_out_of_bounds_is_refused_before_any_byte_moves(
    data_net: DataNet, bad: Segment, alone: bool, form: str
) -> None:
    before = data_net.kv["b"].copy()
    good = Segment(0, 0, KV_BLOCK)
    segs = [bad] if alone else [good, bad]
    with pytest.raises(TransportError, match="outside registered") as err:
        data_net.planes["a"].write("b", "kv", segs if form == "list" else SegmentArray.of(segs), b"x", "t")
    assert str(bad) in str(err.value), "the error names the bad segment"
    time.sleep(0.02)
    data_net.settle()
    assert (data_net.kv["b"] == before).all()
    assert data_net.rec.got("b", "notification") == []
    assert data_net.rec.got("a", "completion") == []


def test_write_run_is_a_write_of_one_segment(data_net: DataNet) -> None:
    """``write_run`` (the runtime's leanest path) lands, notifies after its data and completes
    exactly as ``write`` of the one segment, and refuses what ``write`` refuses, before a byte
    moves: out of either region, a negative offset or length, an unknown or removed peer."""
    plane, src, dst = data_net.planes["a"], data_net.kv["a"], data_net.kv["b"]
    rng = random.Random(3)
    expected = dst.copy()
    seen_at_notify, plans = _watch_notifications(data_net, dst)
    runs = [(0, 0, KV_BLOCK), (KV_BYTES - 3 * KV_BLOCK, 5 * KV_BLOCK, 3 * KV_BLOCK), (17, KV_BYTES - 40, 40)]
    runs += [(g.src, g.dst, g.length) for g in _random_segments(rng, KV_BYTES, KV_BYTES, 3)]
    for i, (s, d, n) in enumerate(runs):
        expected = _apply(expected, src, [Segment(s, d, n)])
        note = f"run{i}".encode()
        plans[note] = expected.copy()
        assert plane.write_run("b", "kv", s, d, n, note, ("run", i)) == n
        data_net.wait(lambda i=i: len(data_net.rec.got("a", "completion")) == i + 1)
        data_net.wait(lambda note=note: note in seen_at_notify)
    assert (dst == expected).all()
    assert all(seen_at_notify.values()), "a notification arrived before its data"
    assert [c.tag for c in data_net.rec.got("a", "completion")] == [("run", i) for i in range(len(runs))]
    bad = [(0, KV_BYTES - 10, 11), (KV_BYTES, 0, 1), (-1, 0, 4), (0, -1, 4), (0, 0, -4)]
    for s, d, n in bad:
        with pytest.raises(TransportError, match="outside registered") as err:
            plane.write_run("b", "kv", s, d, n, b"x", "t")
        assert str(Segment(s, d, n)) in str(err.value), "the error names the bad segment"
    with pytest.raises(TransportError):
        plane.write_run("nobody", "kv", 0, 0, 8, b"x", "t")
    if data_net.kind == "loopback":
        data_net.fabric.crash("c")  # type: ignore[union-attr]
    else:
        plane.remove_peer("c")
    with pytest.raises(TransportError):
        plane.write_run("c", "kv", 0, 0, 8, b"x", "t")
    time.sleep(0.02)
    data_net.settle()
    assert (dst == expected).all()
    assert len(data_net.rec.got("a", "completion")) == len(runs)
    assert len(data_net.rec.got("b", "notification")) == len(runs)


def test_unknown_or_removed_peer_is_refused(data_net: DataNet) -> None:
    with pytest.raises(TransportError):
        data_net.planes["a"].write("nobody", "kv", [Segment(0, 0, 8)], b"x", "t")
    with pytest.raises(TransportError):
        data_net.planes["a"].write("b", "gpu", [Segment(0, 0, 8)], b"x", "t")  # type: ignore[arg-type]
    if data_net.kind == "loopback":
        data_net.fabric.crash("c")  # type: ignore[union-attr]  # the fabric is loopback's peer table
    else:
        data_net.planes["a"].remove_peer("c")
    with pytest.raises(TransportError):
        data_net.planes["a"].write("c", "kv", [Segment(0, 0, 8)], b"x", "t")
    data_net.planes["a"].write("b", "kv", [Segment(0, 0, 8)], b"still-works", "ok")
    data_net.wait(lambda: bool(data_net.rec.got("b", "notification")))


@pytest.mark.parametrize(
    "descriptor",
    [b"garbage", b"KVFSMNX1\xff\xff\xff\xff", b"KVFSMNX1\x05\x00\x00\x00{}xyz" + b"m" * 10],
    ids=["garbage", "header-overflow", "bad-header"],
)
def test_malformed_descriptor_is_refused(data_net: DataNet, descriptor: bytes) -> None:
    with pytest.raises(TransportError):
        data_net.planes["a"].add_peer("mallory", descriptor)
    with pytest.raises(TransportError):
        data_net.planes["a"].write("mallory", "kv", [Segment(0, 0, 8)], b"x", "t")


def test_write_many_is_each_write_in_order_and_refuses_only_the_bad_ones(data_net: DataNet) -> None:
    """``write_many`` (the NIXL data plane's own, or ``base.write_many`` falling back to one
    ``write`` at a time for the loopback): each write's bytes or the error that refused it, in
    order; a refused write moves nothing, and every other write lands, notifies after its data
    and completes once."""
    from kvfsm.transport.base import write_many

    src, dst = data_net.kv["a"], data_net.kv["b"]
    in_place: list[int] = []

    def check(name: str, item: Inbound) -> None:  # the write's own page holds its data already
        if name == "b" and item.kind == "notification":
            i = int(item.data[1:])
            if (dst[(40 + i) * KV_BLOCK : (41 + i) * KV_BLOCK] == src[i * KV_BLOCK : (i + 1) * KV_BLOCK]).all():
                in_place.append(i)

    data_net.rec.hooks.append(check)
    writes: list[Any] = []
    expected = dst.copy()
    good = []
    for i in range(12):
        seg = Segment(i * KV_BLOCK, (40 + i) * KV_BLOCK, KV_BLOCK)
        if i == 3:
            writes.append(("b", "kv", [Segment(0, KV_BYTES, KV_BLOCK)], b"m3", ("m", i)))  # beyond b's region
        elif i == 7:
            writes.append(("nobody", "kv", [seg], b"m7", ("m", i)))
        else:
            expected = _apply(expected, src, [seg])
            writes.append(("b", "kv", [seg], f"m{i}".encode(), ("m", i)))
            good.append(i)
    results = write_many(data_net.planes["a"], writes)
    assert [type(r) is int for r in results] == [i in good for i in range(12)]
    assert isinstance(results[3], TransportError) and isinstance(results[7], TransportError)
    data_net.wait(lambda: len(data_net.rec.got("a", "completion")) == len(good))
    data_net.wait(lambda: len(data_net.rec.got("b", "notification")) == len(good))
    assert (dst == expected).all()
    assert sorted(in_place) == good, "a notification arrived before its data"
    tags = sorted(c.tag for c in data_net.rec.got("a", "completion"))
    assert tags == [("m", i) for i in good] and all(c.ok for c in data_net.rec.got("a", "completion"))


def test_concurrent_writers_each_complete_exactly_once(data_net: DataNet) -> None:
    src, dst = data_net.kv["a"], data_net.kv["b"]
    writers, per = 4, 16
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(per):
                page = w * per + i  # disjoint destination pages
                seg = Segment((page * 7 % 64) * KV_BLOCK, (page % 64) * KV_BLOCK, KV_BLOCK)
                data_net.planes["a"].write("b", "kv", [seg], f"{w}.{i}".encode(), (w, i))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    data_net.wait(lambda: len(data_net.rec.got("a", "completion")) == writers * per)
    data_net.wait(lambda: len(data_net.rec.got("b", "notification")) == writers * per)
    tags = sorted(c.tag for c in data_net.rec.got("a", "completion"))
    assert tags == sorted((w, i) for w in range(writers) for i in range(per))
    for page in range(writers * per):
        s = (page * 7 % 64) * KV_BLOCK
        d = (page % 64) * KV_BLOCK
        assert (dst[d : d + KV_BLOCK] == src[s : s + KV_BLOCK]).all()


def test_registers_torch_tensors(data_net: DataNet) -> None:
    torch = pytest.importorskip("torch")
    kind = data_net.kind
    net = DataNet.__new__(DataNet)
    net.kind, net.rec, net.fabric, net.planes = kind, Recorder(), None, {}
    g = torch.Generator().manual_seed(3)
    tensors = {n: torch.randint(0, 256, (KV_BYTES,), dtype=torch.uint8, generator=g) for n in ("x", "y")}
    aux = {n: torch.zeros(AUX_BYTES, dtype=torch.uint8) for n in ("x", "y")}
    if kind == "loopback":
        net.fabric = Fabric(0)
        net.planes = {n: net.fabric.endpoint(n) for n in ("x", "y")}
    else:
        from kvfsm.transport.nixl import NixlConfig, NixlDataPlane

        net.planes = {
            n: NixlDataPlane(f"t-{n}", config=NixlConfig(caller_posts=CALLER_POSTS[kind])) for n in ("x", "y")
        }
    try:
        names = {n: p.name for n, p in net.planes.items()}
        for n, p in net.planes.items():
            p.set_handler(net.rec.handler(n))
            p.register_memory(tensors[n], aux[n], kv_block=KV_BLOCK, aux_block=AUX_BLOCK)
        net.planes["x"].add_peer(names["y"], net.planes["y"].descriptor())
        net.planes["x"].write(names["y"], "kv", [Segment(KV_BLOCK, 0, 4 * KV_BLOCK)], b"t", "t")
        net.wait(lambda: bool(net.rec.got("x", "completion")))
        assert torch.equal(tensors["y"][: 4 * KV_BLOCK], tensors["x"][KV_BLOCK : 5 * KV_BLOCK])
    finally:
        net.close()


# --------------------------------------------------------------------------------- control planes


class ControlNet:
    def __init__(self, kind: str, names: tuple[str, ...]) -> None:
        self.kind = kind
        self.rec = Recorder()
        self.fabric: Fabric | None = None
        self.server: Any = None
        self.planes: dict[str, Any] = {}
        if kind == "loopback":
            self.fabric = Fabric(0)
            for n in names:
                ep = self.fabric.endpoint(n)
                ep.register_memory(bytearray(8), bytearray(8))
                self.planes[n] = ep
        else:
            from kvfsm.transport.zmq import BootstrapServer, ZmqControlPlane

            self.server = BootstrapServer()
            for n in names:
                self.planes[n] = ZmqControlPlane(n, bootstrap=self.server.address)
        for n, p in self.planes.items():
            p.set_handler(self.rec.handler(n))

    def settle(self) -> None:
        if self.fabric is not None:
            self.fabric.pump()

    def wait(self, pred: Callable[[], bool], timeout: float = 10.0) -> None:
        wait_until(pred, self.settle, timeout)

    def crash(self, name: str) -> None:
        if self.fabric is not None:
            self.fabric.crash(name)
        else:
            self.planes[name].close()  # the process-kill case is in test_zmq.py and the demo tests

    def close(self) -> None:
        for p in self.planes.values():
            p.close()
        if self.server is not None:
            self.server.close()


@pytest.fixture(params=["loopback", "zmq"])
def control_net(request: pytest.FixtureRequest) -> Iterator[ControlNet]:
    net = ControlNet(request.param, ("a", "b", "c"))
    yield net
    net.close()


def _payloads(sender: str, n: int) -> list[bytes]:
    rng = random.Random(sender)
    return [f"{sender}:{i}:".encode() + rng.randbytes(rng.randint(0, 300)) for i in range(n)]


def test_messages_arrive_in_order_both_ways(control_net: ControlNet) -> None:
    n = 200
    sent = {("a", "b"): _payloads("a>b", n), ("b", "a"): _payloads("b>a", n), ("c", "b"): _payloads("c>b", n)}
    for i in range(n):
        for (src, dst), msgs in sent.items():
            control_net.planes[src].send(dst, msgs[i])
    control_net.wait(lambda: len(control_net.rec.got("b", "message")) == 2 * n)
    control_net.wait(lambda: len(control_net.rec.got("a", "message")) == n)
    for (src, dst), msgs in sent.items():
        got = [m.data for m in control_net.rec.got(dst, "message") if m.peer == src]
        assert got == msgs, f"{src}->{dst} lost, duplicated or reordered messages"
    assert control_net.rec.got("c", "message") == []


def test_binary_and_empty_payloads_are_opaque(control_net: ControlNet) -> None:
    msgs = [b"", b"\x00" * 1000, bytes(range(256)), b'{"v":1}']
    for m in msgs:
        control_net.planes["a"].send("b", m)
    control_net.wait(lambda: len(control_net.rec.got("b", "message")) == len(msgs))
    assert [m.data for m in control_net.rec.got("b", "message")] == msgs


def test_descriptor_is_installed_before_the_first_message(control_net: ControlNet) -> None:
    added: dict[str, dict[str, bytes]] = {n: {} for n in control_net.planes}
    removed: dict[str, list[str]] = {n: [] for n in control_net.planes}
    for n, p in control_net.planes.items():

        def add(peer: str, desc: bytes, n: str = n) -> None:
            if peer == "c":
                raise TransportError("c's descriptor is refused")
            added[n][peer] = desc

        p.attach_data(f"desc-of-{n}".encode(), add, removed[n].append)
    early: list[str] = []

    def check(name: str, item: Inbound) -> None:
        if item.kind == "message" and item.peer not in added[name]:
            early.append(f"{item.peer}->{name}")

    control_net.rec.hooks.append(check)
    for i in range(20):
        control_net.planes["a"].send("b", b"from-a-%d" % i)
        control_net.planes["c"].send("b", b"from-c-%d" % i)
    control_net.wait(lambda: len(control_net.rec.got("b", "message")) == 20)
    time.sleep(0.05)
    control_net.settle()
    assert not early, f"messages delivered before their sender's descriptor: {early[:3]}"
    assert added["b"] == {"a": b"desc-of-a"}
    assert all(m.peer == "a" for m in control_net.rec.got("b", "message")), "a refused peer was heard"


def test_send_to_unknown_peer_does_not_raise(control_net: ControlNet) -> None:
    control_net.planes["a"].send("nobody", b"hello?")
    control_net.planes["a"].send("b", b"after")
    control_net.wait(lambda: len(control_net.rec.got("b", "message")) == 1)


def test_peer_loss_is_told_once(control_net: ControlNet) -> None:
    removed: list[str] = []
    control_net.planes["a"].attach_data(b"d-a", lambda peer, d: None, removed.append)
    for n in ("b", "c"):
        control_net.planes[n].attach_data(f"d-{n}".encode(), lambda peer, d: None, lambda peer: None)
    control_net.planes["a"].send("b", b"ping")
    control_net.planes["b"].send("a", b"pong")
    control_net.wait(lambda: bool(control_net.rec.got("a", "message")) and bool(control_net.rec.got("b", "message")))
    control_net.crash("b")
    control_net.wait(lambda: bool(control_net.rec.got("a", "peer_lost")), timeout=15)
    control_net.planes["a"].send("b", b"into the void")  # must not raise
    control_net.planes["a"].send("c", b"still here")
    control_net.wait(lambda: bool(control_net.rec.got("c", "message")))
    time.sleep(0.2)
    control_net.settle()
    lost = control_net.rec.got("a", "peer_lost")
    assert [x.peer for x in lost] == ["b"]
    assert removed == ["b"]


def test_concurrent_senders_keep_per_thread_order(control_net: ControlNet) -> None:
    threads, per = 4, 50

    def sender(t: int) -> None:
        for i in range(per):
            control_net.planes["a"].send("b", f"{t}:{i}".encode())

    ts = [threading.Thread(target=sender, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    control_net.wait(lambda: len(control_net.rec.got("b", "message")) == threads * per)
    seqs: dict[str, list[int]] = {}
    for m in control_net.rec.got("b", "message"):
        t, i = m.data.decode().split(":")
        seqs.setdefault(t, []).append(int(i))
    assert all(s == list(range(per)) for s in seqs.values()) and len(seqs) == threads
