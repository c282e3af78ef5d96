"""Behaviour of the ZeroMQ control plane and bootstrap service (kvfsm/transport/zmq.py).

Real sockets on 127.0.0.1, no mocks. Planes run with fast timers (heartbeat 0.1 s, peer timeout
0.6 s) so that loss detection is exercised within a test's budget. Every wait has a deadline;
a wait that times out is the failure, never a sleep that hopes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvfsm.config import ConfigError, reference
from kvfsm.transport.base import Inbound, TransportError
from kvfsm.transport.zmq import BootstrapClient, BootstrapServer, ZmqConfig, ZmqControlPlane

FAST = ZmqConfig(heartbeat_s=0.1, peer_timeout_s=0.6)
REPO = Path(__file__).resolve().parents[2]


def wait_until(pred: Callable[[], bool], timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Recorder:
    """A handler that keeps every inbound item."""

    def __init__(self) -> None:
        self.items: list[Inbound] = []
        self.cond = threading.Condition()

    def __call__(self, item: Inbound) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def wait(self, pred: Callable[[list[Inbound]], bool], timeout: float = 2.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred(self.items), timeout)

    def of(self, kind: str, peer: str | None = None) -> list[Inbound]:
        with self.cond:
            return [i for i in self.items if i.kind == kind and (peer is None or i.peer == peer)]


class DataPlaneSpy:
    """add_peer / remove_peer of a fake data plane, refusing the names in ``refuse``."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.added: dict[str, bytes] = {}
        self.removed: list[str] = []
        self.refuse = refuse

    def add_peer(self, peer: str, descriptor: bytes) -> None:
        if peer in self.refuse:
            raise TransportError(f"descriptor of {peer} does not match")
        self.added[peer] = descriptor

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer()
    yield srv
    srv.close()


@pytest.fixture
def make_plane() -> Iterator[Callable[..., ZmqControlPlane]]:
    made: list[ZmqControlPlane] = []

    def make(name: str, config: ZmqConfig = FAST, **kw: Any) -> ZmqControlPlane:
        plane = ZmqControlPlane(name, config=config, **kw)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        plane.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------- bootstrap service


def test_bootstrap_register_lookup_peers_unregister(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address, timeout_s=1.0)
    try:
        client.register("prefill0", "tcp://127.0.0.1:1000", "prefill", 0)
        client.register("prefill1", "tcp://127.0.0.1:1001", "prefill", 1)
        client.register("decode0", "tcp://127.0.0.1:2000", "decode", 0)
        assert client.lookup("prefill1") == "tcp://127.0.0.1:1001"
        assert client.lookup("nobody") is None
        assert client.peers("prefill") == {
            "prefill0": ("prefill", 0, "tcp://127.0.0.1:1000"),
            "prefill1": ("prefill", 1, "tcp://127.0.0.1:1001"),
        }
        assert set(client.peers()) == {"prefill0", "prefill1", "decode0"}
        client.register("prefill0", "tcp://127.0.0.1:1100", "prefill", 0)  # a restarted process
        assert client.lookup("prefill0") == "tcp://127.0.0.1:1100"
        client.unregister("prefill0", "tcp://127.0.0.1:1000")  # the old process's goodbye: ignored
        assert client.lookup("prefill0") == "tcp://127.0.0.1:1100"
        client.unregister("prefill0")
        assert client.lookup("prefill0") is None
        with pytest.raises(TransportError, match="address"):
            client.register("x", "not-an-address", "prefill", 0)
    finally:
        client.close()


def test_bootstrap_wait_for_times_out_naming_the_missing(server: BootstrapServer) -> None:
    client = BootstrapClient(server.address, timeout_s=1.0)
    try:
        client.register("p0", "tcp://127.0.0.1:1000", "prefill", 0)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="p1, p2"):
            client.wait_for(["p0", "p1", "p2"], timeout_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.5
        threading.Timer(0.1, lambda: BootstrapClient(server.address).register("p1", "tcp://h:1", "prefill", 1)).start()
        assert client.wait_for(["p0", "p1"], timeout_s=2.0) == {"p0": "tcp://127.0.0.1:1000", "p1": "tcp://h:1"}
    finally:
        client.close()


def test_bootstrap_client_times_out_without_a_server() -> None:
    client = BootstrapClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="no reply"):
        client.lookup("p0")
    assert time.monotonic() - t0 < 1.0
    client.close()
    client.close()
    with pytest.raises(TransportError, match="closed"):
        client.lookup("p0")


def test_bootstrap_server_answers_garbage_with_errors_and_keeps_serving(server: BootstrapServer) -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    good = {"v": 1, "id": 7, "op": "register", "name": "p", "address": "tcp://h:1", "side": "prefill", "rank": 0}
    garbage: list[list[bytes]] = [
        [b"two", b"frames"],
        [b"\xff\xfe not json"],
        [b"[1, 2]"],
        [b"[" * 5000],
        [json.dumps({**good, "v": 2}).encode()],
        [json.dumps({**good, "v": True}).encode()],
        [json.dumps({**good, "op": "explode"}).encode()],
        [json.dumps({k: v for k, v in good.items() if k != "side"}).encode()],
        [json.dumps({**good, "rank": "zero"}).encode()],
        [json.dumps({**good, "rank": True}).encode()],
        [json.dumps({**good, "name": ""}).encode()],
        [json.dumps({**good, "extra": 1}).encode()],
    ]
    try:
        for frames in garbage:
            raw.send_multipart(frames)
            assert raw.poll(2000), f"no reply to {frames!r:.60}"
            reply = json.loads(raw.recv())
            assert reply["ok"] is False and reply["error"], frames
        assert server.stats()["errors"] == len(garbage)
        client = BootstrapClient(server.address, timeout_s=1.0)
        client.register("p0", "tcp://127.0.0.1:1000", "prefill", 0)
        assert client.lookup("p0") == "tcp://127.0.0.1:1000"
        assert server.stats()["registered"] == 1
        client.close()
    finally:
        raw.close()
        ctx.term()


# ---------------------------------------------------------------------- two planes


def test_planes_exchange_many_messages_in_order_with_one_hello_per_pair(
    server: BootstrapServer, make_plane: Callable[..., ZmqControlPlane]
) -> None:
    n = 2000
    names = ("a", "b", "c")
    planes = {x: make_plane(x, bootstrap=server.address, side="prefill" if x == "b" else "decode") for x in names}
    recs = {x: Recorder() for x in names}
    spies = {x: DataPlaneSpy() for x in names}
    early: list[tuple[str, str]] = []  # (receiver, sender) of a message delivered before add_peer

    for x in names:

        def handler(item: Inbound, x: str = x) -> None:
            if item.kind == "message" and item.peer not in spies[x].added:
                early.append((x, item.peer))
            recs[x](item)

        planes[x].set_handler(handler)
        planes[x].attach_data(f"desc-{x}".encode(), spies[x].add_peer, spies[x].remove_peer)

    pairs = [("a", "b"), ("b", "a"), ("c", "b"), ("b", "c")]

    def blast(src: str, dst: str) -> None:
        for i in range(n):
            planes[src].send(dst, f"{src}>{dst}:{i}".encode())

    threads = [threading.Thread(target=blast, args=pair) for pair in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for src, dst in pairs:
        assert recs[dst].wait(lambda items, src=src: sum(i.peer == src for i in items) >= n, timeout=10)
    for src, dst in pairs:
        got = [i.data.decode() for i in recs[dst].of("message", src)]
        assert got == [f"{src}>{dst}:{i}" for i in range(n)]
    assert early == []
    assert spies["b"].added == {"a": b"desc-a", "c": b"desc-c"}
    assert spies["a"].added == {"b": b"desc-b"}
    stats = {x: planes[x].stats() for x in names}
    assert stats["b"]["hellos"] == 2 and stats["a"]["hellos"] == 1 and stats["c"]["hellos"] == 1
    assert stats["b"]["hellos_sent"] == 2
    assert stats["a"]["sent"] == n and stats["b"]["sent"] == 2 * n and stats["b"]["received"] == 2 * n
    assert not any(k.startswith("dropped.") for s in stats.values() for k in s)
    assert all(not recs[x].of("peer_lost") for x in names)


def test_static_peer_map_needs_no_bootstrap_and_replies_need_no_lookup(
    make_plane: Callable[..., ZmqControlPlane],
) -> None:
    b = make_plane("b")
    a = make_plane("a", peers={"b": b.address})
    ra, rb = Recorder(), Recorder()
    a.set_handler(ra)
    b.set_handler(lambda item: (rb(item), b.send(item.peer, b"re:" + item.data)))
    a.send("b", b"hi")
    assert ra.wait(lambda items: len(items) == 1)
    assert ra.items[0] == Inbound("message", "b", data=b"re:hi")
    assert "lookups" not in b.stats()


def test_descriptor_arrives_with_hello_even_when_attached_late(make_plane: Callable[..., ZmqControlPlane]) -> None:
    b = make_plane("b")
    a = make_plane("a", peers={"b": b.address})
    rb, spy_a, spy_b = Recorder(), DataPlaneSpy(), DataPlaneSpy()
    b.set_handler(rb)
    a.attach_data(b"A" * 1000, spy_a.add_peer, spy_a.remove_peer)
    a.send("b", b"one")
    assert rb.wait(lambda items: len(items) == 1)
    b.attach_data(b"B", spy_b.add_peer, spy_b.remove_peer)  # b heard a before it had a data plane
    assert wait_until(lambda: spy_b.added == {"a": b"A" * 1000} and spy_a.added == {"b": b"B"})
    with pytest.raises(TransportError, match="before the first send"):
        a.attach_data(b"again", spy_a.add_peer, spy_a.remove_peer)


def test_refused_descriptor_means_that_peer_is_not_heard(
    server: BootstrapServer, make_plane: Callable[..., ZmqControlPlane]
) -> None:
    a = make_plane("a", bootstrap=server.address)
    b = make_plane("b", bootstrap=server.address)
    c = make_plane("c", bootstrap=server.address)
    rb, spy_b = Recorder(), DataPlaneSpy(refuse=("a",))
    b.set_handler(rb)
    b.attach_data(b"B", spy_b.add_peer, spy_b.remove_peer)
    for i in range(20):
        a.send("b", b"%d" % i)
    c.send("b", b"from c")
    assert wait_until(lambda: b.stats().get("dropped.refused_peer") == 20)
    assert rb.wait(lambda items: len(items) == 1)
    assert rb.items == [Inbound("message", "c", data=b"from c")]
    assert b.stats()["refused_peers"] == 1 and "a" not in spy_b.added


def test_unknown_peers_are_dropped_and_counted_not_lost(
    server: BootstrapServer, make_plane: Callable[..., ZmqControlPlane]
) -> None:
    a = make_plane("a", bootstrap=server.address)
    lone = make_plane("lone")
    ra = Recorder()
    a.set_handler(ra)
    a.send("nobody", b"x")
    a.send("nobody", b"y")
    lone.send("nobody", b"z")
    assert wait_until(lambda: a.stats().get("dropped.unknown_peer") == 2)
    assert wait_until(lambda: lone.stats().get("dropped.unknown_peer") == 1)
    lookups = a.stats()["lookups"]
    a.send("nobody", b"later")  # not lost: a later send asks again
    assert wait_until(lambda: a.stats().get("dropped.unknown_peer") == 3 and a.stats()["lookups"] == lookups + 1)
    assert ra.items == []


def test_handler_errors_are_counted_and_delivery_goes_on(make_plane: Callable[..., ZmqControlPlane]) -> None:
    b = make_plane("b")
    a = make_plane("a", peers={"b": b.address})
    got: list[bytes] = []

    def handler(item: Inbound) -> None:
        if item.data == b"boom":
            raise RuntimeError("handler bug")
        got.append(item.data)

    b.set_handler(handler)
    for data in (b"boom", b"after"):
        a.send("b", data)
    assert wait_until(lambda: got == [b"after"])
    assert b.stats()["handler_errors"] == 1


def test_oversize_send_is_dropped_locally(make_plane: Callable[..., ZmqControlPlane]) -> None:
    a = make_plane("a", peers={"b": "tcp://127.0.0.1:1"}, config=replace(FAST, max_message=10))
    a.send("b", b"x" * 11)
    assert a.stats() == {"dropped.oversize_local": 1}


# ---------------------------------------------------------------------- malformed input

VALID = {"v": 1, "name": "mallory", "address": "tcp://127.0.0.1:9"}


def hello(identity: str = "mallory", descriptor: bytes = b"", **header: object) -> list[bytes]:
    return [b"H", json.dumps({**VALID, "name": identity, **header}).encode(), descriptor]


MALFORMED: dict[str, tuple[list[list[bytes]], str]] = {
    "message_without_payload": ([[b"M"]], "dropped.malformed"),
    "message_with_extra_frame": ([[b"M", b"a", b"b"]], "dropped.malformed"),
    "hello_without_descriptor": ([hello()[:2]], "dropped.malformed"),
    "bye_with_payload": ([[b"B", b"x"]], "dropped.malformed"),
    "empty_kind": ([[b""]], "dropped.malformed"),
    "unknown_kind": ([[b"Z", b"x"]], "dropped.unknown_kind"),
    "long_kind": ([[b"MM", b"x"]], "dropped.unknown_kind"),
    "bad_json": ([[b"H", b"{nope", b""]], "dropped.bad_hello"),
    "json_not_object": ([[b"H", b"[1]", b""]], "dropped.bad_hello"),
    "deep_json": ([[b"H", b"[" * 3000, b""]], "dropped.bad_hello"),
    "missing_version": (
        [[b"H", json.dumps({"name": "mallory", "address": "tcp://h:1"}).encode(), b""]],
        "dropped.bad_hello",
    ),
    "bool_version": ([hello(v=True)], "dropped.bad_hello"),
    "wrong_version": ([hello(v=2)], "dropped.unsupported_version"),
    "name_not_string": ([hello(name=5)], "dropped.bad_hello"),
    "address_not_tcp": ([hello(address="ipc:///tmp/x")], "dropped.bad_hello"),
    "extra_field": ([hello(extra=1)], "dropped.bad_hello"),
    "name_mismatch": ([hello("alice")], "dropped.name_mismatch"),
    "message_before_hello": ([[b"M", b"hi"]], "dropped.no_hello"),
    "bye_before_hello": ([[b"B"]], "dropped.no_hello"),
    "oversize_header": ([hello(address="tcp://" + "h" * 5000)], "dropped.oversize"),
    "oversize_descriptor": ([hello(descriptor=b"d" * 4097)], "dropped.oversize"),
    "oversize_message": ([hello(), [b"M", b"m" * 1025]], "dropped.oversize"),
    "duplicate_hello": ([hello(), hello()], "dropped.duplicate_hello"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_frames_are_dropped_counted_and_the_plane_keeps_working(
    case: str, make_plane: Callable[..., ZmqControlPlane]
) -> None:
    frames, counter = MALFORMED[case]
    target = make_plane("target", config=replace(FAST, max_message=1024, max_descriptor=4096))
    rec = Recorder()
    target.set_handler(rec)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.ROUTING_ID, b"mallory")
    raw.connect(target.address)
    try:
        for f in frames:
            raw.send_multipart(f)
        assert wait_until(lambda: target.stats().get(counter) == 1), target.stats()
        good = make_plane("good", peers={"target": target.address})
        good.send("target", b"still here")
        assert rec.wait(lambda items: len(items) == 1)
        assert rec.items == [Inbound("message", "good", data=b"still here")]
        dropped = {k: v for k, v in target.stats().items() if k.startswith("dropped.")}
        assert dropped == {counter: 1}
    finally:
        raw.close()
        ctx.term()


# ---------------------------------------------------------------------- peer loss

VICTIM = """
import sys, time
from kvfsm.transport.zmq import ZmqConfig, ZmqControlPlane
fast = ZmqConfig(heartbeat_s=0.1, peer_timeout_s=0.6)
plane = ZmqControlPlane(sys.argv[2], bootstrap=sys.argv[1], side="prefill", rank=0, config=fast)
plane.attach_data(b"victim-descriptor", lambda peer, d: None, lambda peer: None)
plane.set_handler(lambda item: item.kind == "message" and plane.send(item.peer, b"echo:" + item.data))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def victim(server: BootstrapServer) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, server.address, "victim"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def connect_to_victim(
    server: BootstrapServer, make_plane: Callable[..., ZmqControlPlane]
) -> tuple[ZmqControlPlane, Recorder, DataPlaneSpy]:
    survivor = make_plane("survivor", bootstrap=server.address, side="decode")
    rec, spy = Recorder(), DataPlaneSpy()
    survivor.set_handler(rec)
    survivor.attach_data(b"survivor-descriptor", spy.add_peer, spy.remove_peer)
    survivor.send("victim", b"ping")
    assert rec.wait(lambda items: any(i.data == b"echo:ping" for i in items), timeout=5)
    assert spy.added == {"victim": b"victim-descriptor"}
    return survivor, rec, spy


def assert_lost_once(survivor: ZmqControlPlane, rec: Recorder, spy: DataPlaneSpy, within: float) -> float:
    t0 = time.monotonic()
    assert rec.wait(lambda items: any(i.kind == "peer_lost" for i in items), timeout=within)
    elapsed = time.monotonic() - t0
    # a second report would come from a later event of the same link: give it a heartbeat or two
    assert not rec.wait(lambda items: len([i for i in items if i.kind == "peer_lost"]) > 1, timeout=0.3)
    assert spy.removed == ["victim"]
    survivor.send("victim", b"anyone?")
    assert wait_until(lambda: survivor.stats().get("dropped.lost_peer", 0) >= 1)
    assert survivor.stats()["peers_lost"] == 1
    return elapsed


def test_peer_lost_once_when_its_process_is_killed(
    server: BootstrapServer, make_plane: Callable[..., ZmqControlPlane], victim: subprocess.Popen[str]
) -> None:
    survivor, rec, spy = connect_to_victim(server, make_plane)
    victim.send_signal(signal.SIGKILL)
    elapsed = assert_lost_once(survivor, rec, spy, within=0.6 + 0.5)
    reason = rec.of("peer_lost")[0].reason
    assert reason.startswith("connection to victim at tcp://127.0.0.1:") and reason.endswith(" lost")
    print(f"SIGKILL detected in {elapsed * 1000:.1f} ms")


def test_peer_lost_when_it_freezes_silently(
    server: BootstrapServer, make_plane: Callable[..., ZmqControlPlane], victim: subprocess.Popen[str]
) -> None:
    survivor, rec, spy = connect_to_victim(server, make_plane)
    victim.send_signal(signal.SIGSTOP)  # no FIN, no RST: only heartbeats can tell
    try:
        elapsed = assert_lost_once(survivor, rec, spy, within=0.6 + 0.5)
    finally:
        victim.send_signal(signal.SIGCONT)
    assert elapsed > 0.2  # detected by heartbeat timeout, not by a closed socket
    print(f"SIGSTOP detected in {elapsed * 1000:.1f} ms")


def test_peer_never_reached_is_lost_after_peer_timeout(make_plane: Callable[..., ZmqControlPlane]) -> None:
    a = make_plane("a", peers={"ghost": f"tcp://127.0.0.1:{free_port()}"})
    rec = Recorder()
    a.set_handler(rec)
    t0 = time.monotonic()
    for i in range(3):
        a.send("ghost", b"%d" % i)
    assert rec.wait(lambda items: len(items) == 1, timeout=2.0)
    assert 0.5 <= time.monotonic() - t0 < 1.5
    assert rec.items[0].kind == "peer_lost" and "no connection to ghost" in rec.items[0].reason
    assert a.stats()["dropped.not_connected"] == 3


def test_graceful_close_is_a_loss_and_the_name_stays_lost(
    server: BootstrapServer, make_plane: Callable[..., ZmqControlPlane]
) -> None:
    a = make_plane("a", bootstrap=server.address)
    b = make_plane("b", bootstrap=server.address)
    ra, spy = Recorder(), DataPlaneSpy()
    a.set_handler(ra)
    a.attach_data(b"A", spy.add_peer, spy.remove_peer)
    b.send("a", b"hello")
    assert ra.wait(lambda items: len(items) == 1)
    b.close()
    assert ra.wait(lambda items: len(items) == 2)
    # b's BYE and the close of b's ROUTER race: either tells a that b is gone, once
    assert ra.items[1].kind == "peer_lost" and ra.items[1].peer == "b"
    assert ra.items[1].reason in ("b closed", f"connection to b at {b.address} lost")
    assert spy.removed == ["b"]
    reborn = make_plane("b", bootstrap=server.address)  # a restarted process with the same name
    reborn.send("a", b"i am back")
    assert wait_until(lambda: a.stats().get("dropped.lost_peer") == 2)  # its HELLO and its message
    a.send("b", b"x")
    assert wait_until(lambda: a.stats().get("dropped.lost_peer") == 3)
    assert not ra.wait(lambda items: len(items) > 2, timeout=0.2)


# ---------------------------------------------------------------------- lifecycle


def test_close_leaves_no_threads_and_is_idempotent() -> None:
    before = set(threading.enumerate())
    srv = BootstrapServer()
    a = ZmqControlPlane("a", bootstrap=srv.address, config=FAST)
    b = ZmqControlPlane("b", bootstrap=srv.address, config=FAST)
    rb = Recorder()
    b.set_handler(rb)
    a.send("b", b"x")
    a.send("b", b"y")
    assert rb.wait(lambda items: len(items) == 2)
    assert len(set(threading.enumerate()) - before) == 3
    for closeable in (a, b, srv):
        closeable.close()
        closeable.close()
    assert set(threading.enumerate()) == before
    a.send("b", b"after close")  # dropped, not raised
    assert a.stats()["dropped.closed"] == 1
    with pytest.raises(TransportError, match="closed"):
        a.attach_data(b"", lambda p, d: None, lambda p: None)


def test_constructor_rejects_bad_arguments_and_unreachable_bootstrap() -> None:
    with pytest.raises(ValueError, match="name"):
        ZmqControlPlane("")
    with pytest.raises(ConfigError, match="heartbeat"):
        ZmqConfig(heartbeat_s=1.0, peer_timeout_s=0.5)
    before = set(threading.enumerate())
    with pytest.raises(TransportError, match="no reply"):
        ZmqControlPlane("a", bootstrap=f"tcp://127.0.0.1:{free_port()}", config=FAST)
    assert set(threading.enumerate()) == before


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("heartbeat_s", 0),
        ("peer_timeout_s", -1.0),
        ("max_message", 0),
        ("max_descriptor", 1.5),
        ("queue_limit", True),
        ("linger_s", -0.1),
    ],
)
def test_config_refuses_out_of_range_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"ZmqConfig\.{field} = {value!r}: it must be"):
        ZmqConfig(**{field: value})  # type: ignore[arg-type]


def test_config_documents_every_field_and_defaults_to_a_server_setting() -> None:
    rows = {r.name: r for r in reference(ZmqConfig)}
    assert list(rows) == ["heartbeat_s", "peer_timeout_s", "max_message", "max_descriptor", "queue_limit", "linger_s"]
    assert all(r.doc and r.when and r.must for r in rows.values())
    cfg = ZmqConfig()
    assert cfg.heartbeat_s < cfg.peer_timeout_s and cfg.max_message == 16 << 20
