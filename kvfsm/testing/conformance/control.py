"""The control-plane checks: messages arrive once and in order, payloads are opaque, a peer's
descriptor is installed before its first message, peer loss is told once. See
``kvfsm.testing.conformance``."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvfsm.testing.conformance.harness import Net, PlanesFactory, case
from kvfsm.transport.base import Inbound, TransportError


@contextmanager
def _control_case(make: PlanesFactory, label: str, timeout: float) -> Iterator[Net]:
    with case(make, label, ("a", "b", "c"), timeout, Net) as net:
        yield net


def _crash(net: Net, name: str) -> None:
    if net.made.crash is not None:
        net.made.crash(name)
    else:
        net.planes[name].close()


def _payloads(sender: str, n: int) -> list[bytes]:
    rng = random.Random(sender)
    return [f"{sender}:{i}:".encode() + rng.randbytes(rng.randint(0, 300)) for i in range(n)]


def check_messages_arrive_in_order_both_ways(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """200 messages each way between a and b, and from c to b, interleaved: every message
    arrives once, in the order sent per (sender, receiver), and no one else hears them."""
    with _control_case(make, "messages in order", timeout) as net:
        n = 200
        sent = {("a", "b"): _payloads("a>b", n), ("b", "a"): _payloads("b>a", n), ("c", "b"): _payloads("c>b", n)}
        for i in range(n):
            for (src, dst), msgs in sent.items():
                net.planes[src].send(dst, msgs[i])
        net.wait(lambda: len(net.rec.got("b", "message")) == 2 * n, f"{2 * n} messages at b")
        net.wait(lambda: len(net.rec.got("a", "message")) == n, f"{n} messages at a")
        for (src, dst), msgs in sent.items():
            got = [m.data for m in net.rec.got(dst, "message") if m.peer == src]
            assert got == msgs, f"{src}->{dst} lost, duplicated or reordered messages"
        assert net.rec.got("c", "message") == [], "a bystander heard messages"


def check_binary_and_empty_payloads_are_opaque(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """Empty, NUL-filled, every-byte and JSON-looking payloads arrive exactly as sent."""
    with _control_case(make, "opaque payloads", timeout) as net:
        msgs = [b"", b"\x00" * 1000, bytes(range(256)), b'{"v":1}']
        for m in msgs:
            net.planes["a"].send("b", m)
        net.wait(lambda: len(net.rec.got("b", "message")) == len(msgs), f"{len(msgs)} messages at b")
        got = [m.data for m in net.rec.got("b", "message")]
        assert got == msgs, f"payloads changed on the way: {got!r}"


def check_descriptor_is_installed_before_the_first_message(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """A peer's descriptor reaches ``add_peer`` before any of its messages is delivered, and a
    peer whose descriptor ``add_peer`` refuses is not heard."""
    with _control_case(make, "descriptor before the first message", timeout) as net:
        added: dict[str, dict[str, bytes]] = {n: {} for n in net.planes}
        removed: dict[str, list[str]] = {n: [] for n in net.planes}
        for n, p in net.planes.items():

            def add(peer: str, desc: bytes, n: str = n) -> None:
                if peer == "c":
                    raise TransportError("c's descriptor is refused")
                added[n][peer] = desc

            p.attach_data(f"desc-of-{n}".encode(), add, removed[n].append)
        early: list[str] = []

        def check(name: str, item: Inbound) -> None:
            if item.kind == "message" and item.peer not in added[name]:
                early.append(f"{item.peer}->{name}")

        net.rec.hooks.append(check)
        for i in range(20):
            net.planes["a"].send("b", b"from-a-%d" % i)
            net.planes["c"].send("b", b"from-c-%d" % i)
        net.wait(lambda: len(net.rec.got("b", "message")) == 20, "a's 20 messages at b")
        time.sleep(0.05)
        net.settle()
        assert not early, f"messages delivered before their sender's descriptor: {early[:3]}"
        assert added["b"] == {"a": b"desc-of-a"}, f"b's add_peer got {added['b']}"
        assert all(m.peer == "a" for m in net.rec.got("b", "message")), "a refused peer was heard"


def check_send_to_unknown_peer_does_not_raise(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """A send to a name no one has drops the message quietly; the plane goes on."""
    with _control_case(make, "send to an unknown peer", timeout) as net:
        net.planes["a"].send("nobody", b"hello?")
        net.planes["a"].send("b", b"after")
        net.wait(lambda: len(net.rec.got("b", "message")) == 1, "the next message at b")


def check_peer_loss_is_told_once(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """When b is gone, a (which talked with b) gets one "peer_lost" for b and one
    ``remove_peer("b")``; a send to b does not raise, and a still reaches c."""
    with _control_case(make, "peer loss", timeout) as net:
        removed: list[str] = []
        net.planes["a"].attach_data(b"d-a", lambda peer, d: None, removed.append)
        for n in ("b", "c"):
            net.planes[n].attach_data(f"d-{n}".encode(), lambda peer, d: None, lambda peer: None)
        net.planes["a"].send("b", b"ping")
        net.planes["b"].send("a", b"pong")
        net.wait(lambda: bool(net.rec.got("a", "message")) and bool(net.rec.got("b", "message")), "ping and pong")
        _crash(net, "b")
        net.wait(lambda: bool(net.rec.got("a", "peer_lost")), "peer_lost at a", timeout=timeout * 1.5)
        net.planes["a"].send("b", b"into the void")  # must not raise
        net.planes["a"].send("c", b"still here")
        net.wait(lambda: bool(net.rec.got("c", "message")), "a's message at c after the loss")
        time.sleep(0.2)
        net.settle()
        lost = net.rec.got("a", "peer_lost")
        assert [x.peer for x in lost] == ["b"], f"peer_lost at a: {lost}"
        assert removed == ["b"], f"remove_peer at a: {removed}"


def check_concurrent_senders_keep_per_thread_order(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """Four threads sending through one plane at once: each thread's messages arrive in order."""
    with _control_case(make, "concurrent senders", timeout) as net:
        threads, per = 4, 50

        def sender(t: int) -> None:
            for i in range(per):
                net.planes["a"].send("b", f"{t}:{i}".encode())

        ts = [threading.Thread(target=sender, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        net.wait(lambda: len(net.rec.got("b", "message")) == threads * per, f"{threads * per} messages at b")
        seqs: dict[str, list[int]] = {}
        for m in net.rec.got("b", "message"):
            thread, i = m.data.decode().split(":")
            seqs.setdefault(thread, []).append(int(i))
        assert len(seqs) == threads, f"messages from {len(seqs)} threads, not {threads}"
        assert all(s == list(range(per)) for s in seqs.values()), "a thread's messages arrived out of order"


CONTROL_PLANE_CHECKS: tuple[Callable[..., None], ...] = (
    check_messages_arrive_in_order_both_ways,
    check_binary_and_empty_payloads_are_opaque,
    check_descriptor_is_installed_before_the_first_message,
    check_send_to_unknown_peer_does_not_raise,
    check_peer_loss_is_told_once,
    check_concurrent_senders_keep_per_thread_order,
)


def check_control_plane(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """Run every control-plane check (``CONTROL_PLANE_CHECKS``) on the planes ``make`` builds;
    each wait gives up after ``timeout`` seconds. Raises AssertionError at the first violation."""
    for check in CONTROL_PLANE_CHECKS:
        check(make, timeout=timeout)
