"""``Manager.wait`` / ``RoomHandle.wait``: block until rooms reach a KVPoll code, fail, or time out,
woken by the threads that move the rooms, firing timers on time meanwhile."""

from __future__ import annotations

import threading
import time

import pytest

from kvfsm.protocol import KVPoll, LocalProtocolError
from kvfsm.runtime import RuntimeConfig
from kvfsm.testing import LoopbackCluster


def _in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    t.start()
    return t, out


def test_wait_returns_when_another_thread_moves_every_room_to_success() -> None:
    c = LoopbackCluster()
    try:
        senders = [c.prefill[0].create_sender(r) for r in (1, 2)]
        recv = [c.decode[0].create_receiver(r) for r in (1, 2)]
        t, out = _in_thread(lambda: c.prefill[0].wait([1, 2], KVPoll.Success, timeout=30))
        time.sleep(0.05)
        assert t.is_alive() and not out  # nothing moved yet: it blocks
        for i, (s, rc) in enumerate(zip(senders, recv, strict=True)):
            rc.init([10 * i, 10 * i + 1], i)
            c.settle()
            s.send([i, i + 4], is_last=True, aux_slot=i)
            c.settle()
        t.join(5)
        assert not t.is_alive() and out == [[KVPoll.Success, KVPoll.Success]]
        assert c.kv_equal(0, [1, 5], 0, [10, 11])
        assert recv[0].wait(timeout=5) == KVPoll.Success  # already there: returns at once
    finally:
        c.close()


def test_wait_for_an_earlier_code_and_the_timeout_returns_the_codes_reached() -> None:
    c = LoopbackCluster()
    try:
        s = c.prefill[0].create_sender(7)
        assert s.wait(KVPoll.WaitingForInput, timeout=0.05) == KVPoll.Bootstrapping
        t0 = time.monotonic()
        assert s.wait(KVPoll.Success, timeout=0.2) == KVPoll.Bootstrapping
        assert time.monotonic() - t0 >= 0.2
        rc = c.decode[0].create_receiver(7)
        rc.init([0], 0)
        c.settle()
        assert s.wait(KVPoll.WaitingForInput, timeout=5) == KVPoll.WaitingForInput
    finally:
        c.close()


def test_a_timer_that_fails_the_room_ends_the_wait_without_any_poll() -> None:
    c = LoopbackCluster(clock=time.monotonic, timeouts={"bootstrap": 0.2})
    try:
        s = c.prefill[0].create_sender(3)  # decode never announces: the bootstrap timer fires
        t0 = time.monotonic()
        assert s.wait(timeout=10) == KVPoll.Failed
        assert 0.15 <= time.monotonic() - t0 < 5
        assert "timeout" in str(s.failure_exception())
    finally:
        c.close()


def test_wait_on_an_unknown_room_raises() -> None:
    c = LoopbackCluster()
    try:
        with pytest.raises(LocalProtocolError):
            c.prefill[0].wait([99], timeout=1)
    finally:
        c.close()


def test_wait_wakes_for_the_ranks_own_bookkeeping_a_lost_register_is_resent() -> None:
    """The first register is lost: decode re-sends it from tick(), and wait() must wake for that
    (nothing else will: no room changes state before the handshake)."""
    c = LoopbackCluster(clock=time.monotonic, connect=False, config=RuntimeConfig(workers=0, register_retry_s=0.1))
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            c.fabric.pump()
            time.sleep(0.005)

    try:
        rc = c.decode[0].create_receiver(5)
        c.decode[0].connect()
        assert c.fabric.take(lambda item: item.dst == "prefill/0") is not None  # the register, lost
        pumper = threading.Thread(target=pump)
        pumper.start()
        t0 = time.monotonic()
        assert rc.wait(KVPoll.WaitingForInput, timeout=10) == KVPoll.WaitingForInput
        assert time.monotonic() - t0 < 5
        assert c.decode[0].link_state(0) == "ready"
    finally:
        stop.set()
        c.close()


def test_wait_tells_the_endpoint_to_flush_before_it_blocks() -> None:
    """``wait()`` gives the endpoint's optional ``flush`` hint (the engine hands nothing over
    while it waits: writes held back go now), once per call, before it blocks; an endpoint
    without ``flush`` is left alone."""
    c = LoopbackCluster()
    flushes: list[int] = []
    try:
        s = c.prefill[0].create_sender(3)
        c.prefill[0].endpoint.flush = lambda: flushes.append(1)  # type: ignore[attr-defined]
        t, out = _in_thread(lambda: c.prefill[0].wait([3], KVPoll.Success, timeout=30))
        time.sleep(0.05)
        assert t.is_alive() and len(flushes) == 1, "wait() blocks after one flush"
        rc = c.decode[0].create_receiver(3)
        rc.init([0, 1], 0)
        c.settle()
        s.send([2, 3], is_last=True, aux_slot=0)
        c.settle()
        t.join(5)
        assert not t.is_alive() and out == [[KVPoll.Success]] and len(flushes) == 1
        assert rc.wait(timeout=5) == KVPoll.Success  # the decode endpoint has no flush: unaffected
    finally:
        c.close()
