"""PrefillManager.send_many: an engine's batch of chunks (every room of a forward step) applied as a
loop of send() would apply it, with the writes handed to the data plane together at the end."""

from __future__ import annotations

from typing import Any

import pytest

from kvfsm.protocol import KVPoll, LocalProtocolError
from kvfsm.testing import LoopbackCluster
from kvfsm.transport.base import TransportError

ROOMS = 6
CHUNKS = [[0, 1], [2, 3], [4], [5]]  # per room, offset by 8 * room (the second: the leanest path)


def _pages(rid: int, i: int) -> list[int]:
    return [8 * rid + p for p in CHUNKS[i]]


def _announce(c: LoopbackCluster, rids: range) -> list[Any]:
    recv = []
    for rid in rids:
        r = c.decode[0].create_receiver(rid)
        r.init([8 * rid + 2 + p for p in range(6)], rid)  # other pages at decode than at prefill
        recv.append(r)
    c.settle()
    return recv


def _run(batched: bool, workers: int) -> tuple[LoopbackCluster, list[Any], list[Any]]:
    c = LoopbackCluster(pages=64, workers=workers)
    recv = _announce(c, range(ROOMS))
    senders = [c.prefill[0].create_sender(rid) for rid in range(ROOMS)]
    for i in range(len(CHUNKS)):
        last = i == len(CHUNKS) - 1
        if batched:
            # rooms by id or by their sender, in any mix
            items = [(s if s.room % 2 else s.room, _pages(s.room, i), last, s.room if last else None) for s in senders]
            c.prefill[0].send_many(items)
        else:
            for s in senders:
                s.send(_pages(s.room, i), is_last=last, aux_slot=s.room if last else None)
    c.settle()
    return c, senders, recv


@pytest.mark.parametrize("workers", [0, 2])
def test_send_many_moves_every_room_as_a_loop_of_send_does(workers: int) -> None:
    c, senders, recv = _run(True, workers)
    ref, _, _ = _run(False, workers)
    try:
        assert [s.poll() for s in senders] == [KVPoll.Success] * ROOMS
        assert [r.poll() for r in recv] == [KVPoll.Success] * ROOMS
        for rid in range(ROOMS):
            src = [p for i in range(len(CHUNKS)) for p in _pages(rid, i)]
            assert c.kv_equal(0, src, 0, [8 * rid + 2 + p for p in range(6)])
            assert c.aux_equal(0, rid, 0, rid)
        counters = ("writes_posted", "descriptors", "bytes_written", "rooms_succeeded")
        got, want = c.prefill[0].stats()["counters"], ref.prefill[0].stats()["counters"]
        assert {k: got[k] for k in counters} == {k: want[k] for k in counters}
        assert c.fabric.stats.writes == ref.fabric.stats.writes == ROOMS * (len(CHUNKS) + 1)  # + aux
    finally:
        c.close()
        ref.close()


@pytest.mark.parametrize(
    "bad",
    [
        (1, [0.5]),  # a page that is not an integer
        (1, "pages"),
        (1,),  # no pages
        (1, [3], True, 0, "extra"),
        ("one", [3]),  # a room id that is not an integer
        (1, [3], True, 1.5),  # an aux slot that is not an integer
        (7, [3]),  # a room that does not exist
    ],
)
def test_a_malformed_item_raises_after_the_items_before_it_as_a_loop_of_send_would(bad: tuple[Any, ...]) -> None:
    c = LoopbackCluster()
    try:
        recv = _announce(c, range(3))
        senders = [c.prefill[0].create_sender(rid) for rid in range(3)]
        with pytest.raises(LocalProtocolError):
            c.prefill[0].send_many([(0, list(range(6)), True, 0), bad, (2, list(range(16, 22)), True, 2)])
        c.settle()
        assert c.fabric.stats.writes == 2  # room 0's chunk and aux went out; nothing after the bad item
        assert [s.poll() for s in senders] == [KVPoll.Success, KVPoll.WaitingForInput, KVPoll.WaitingForInput]
        assert [r.poll() for r in recv] == [KVPoll.Success, KVPoll.WaitingForInput, KVPoll.WaitingForInput]
    finally:
        c.close()


def test_writes_are_handed_over_whenever_batch_bytes_are_pending() -> None:
    """A batch's writes go to the data plane in one ``write_many`` at the end, and earlier each
    time ``batch_bytes`` are pending, so that large chunks start moving while the rest of the
    batch is stepped."""
    from kvfsm.runtime import RuntimeConfig

    c = LoopbackCluster(config=RuntimeConfig(workers=0, batch_bytes=4 * 256))  # 4 pages of 256 bytes
    try:
        recv = _announce(c, range(4))
        p = c.prefill[0]
        calls: list[int] = []

        def write_many(writes: list[Any]) -> list[int]:
            calls.append(len(writes))
            return [p.endpoint.write(*w) for w in writes]

        p.endpoint.write_many = write_many  # type: ignore[attr-defined]
        senders = [p.create_sender(rid) for rid in range(4)]
        p.send_many([(s, [8 * s.room + q for q in range(2)]) for s in senders])  # 2 pages each
        assert calls == [2, 2]  # at 4 pages pending, then the rest at the end
        calls.clear()
        p.send_many([(s, [8 * s.room + q for q in range(2, 6)], True, s.room) for s in senders[:3]])
        # a 4-page chunk fills the batch at once; the aux writes (32 bytes each) go at its end, together
        assert calls == [1, 1, 1, 3]
        c.settle()
        assert [s.poll() for s in senders[:3]] == [KVPoll.Success] * 3 and senders[3].poll() == KVPoll.Transferring
        assert all(r.poll() == KVPoll.Success for r in recv[:3])
    finally:
        c.close()


def test_a_sender_of_another_manager_is_refused() -> None:
    c = LoopbackCluster(prefill_ranks=2)
    try:
        _announce(c, range(1))
        other = c.prefill[1].create_sender(0)
        c.prefill[0].create_sender(0)
        with pytest.raises(LocalProtocolError, match="another manager"):
            c.prefill[0].send_many([(other, [0])])
        assert c.fabric.stats.writes == 0
    finally:
        c.close()


def test_a_misuse_midway_keeps_the_items_before_it_and_applies_none_after_it() -> None:
    c = LoopbackCluster()
    try:
        recv = _announce(c, range(3))
        p = c.prefill[0]
        a, b, d = (p.create_sender(rid) for rid in range(3))
        a.send(list(range(6)), is_last=True, aux_slot=0)  # room 0 is complete
        c.settle()
        with pytest.raises(LocalProtocolError):
            p.send_many([(b, _pages(1, 0)), (a, [1]), (d, _pages(2, 0))])  # a chunk after room 0's last
        c.settle()
        assert a.poll() == KVPoll.Success and recv[0].poll() == KVPoll.Success  # unchanged by the misuse
        assert p.stats()["counters"]["writes_posted"] == 2 + 1  # room 0's chunk and aux, room 1's chunk
        assert c.kv_equal(0, _pages(1, 0), 0, [8 + 2, 8 + 3])  # room 1's chunk was handed over
        assert recv[2].poll() == KVPoll.WaitingForInput and p.state(2) == d.manager.state(2)
        d.send(list(range(16, 22)), is_last=True, aux_slot=2)  # room 2 was left as it was: it still runs
        b.send([10, 11, 12, 13], is_last=True, aux_slot=1)
        c.settle()
        assert [x.poll() for x in (b, d)] == [KVPoll.Success] * 2
    finally:
        c.close()


@pytest.mark.parametrize("error", [TransportError("peer refused"), RuntimeError("simulated bug")])
def test_a_write_refused_within_a_batch_fails_only_its_room(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """The loopback data plane has no write_many: the runtime's fallback writes one at a time, and
    a write that raises fails its own room; the batch's other rooms finish."""
    c = LoopbackCluster()
    try:
        recv = _announce(c, range(3))
        p = c.prefill[0]
        real = p.endpoint.write

        def refuse_room_1(peer: str, region: str, segments: Any, note: bytes, tag: Any) -> int:
            if tag[0] == 1:
                raise error
            return real(peer, region, segments, note, tag)

        monkeypatch.setattr(p.endpoint, "write", refuse_room_1)
        senders = [p.create_sender(rid) for rid in range(3)]
        p.send_many([(s, [8 * s.room + q for q in range(6)], True, s.room) for s in senders])
        c.settle()
        assert [s.poll() for s in senders] == [KVPoll.Success, KVPoll.Failed, KVPoll.Success]
        assert [r.poll() for r in recv] == [KVPoll.Success, KVPoll.Failed, KVPoll.Success]
        assert str(error) in p.failure_exception(1).reason
        assert p.stats()["counters"]["write_errors"] == 2  # room 1's chunk and its aux write
    finally:
        c.close()


def test_writes_are_handed_over_whenever_batch_segments_are_pending() -> None:
    """Scattered chunks (one segment per run of pages) cost the most to post: they are handed
    over once ``batch_segments`` are pending, whatever their bytes."""
    from kvfsm.runtime import RuntimeConfig

    c = LoopbackCluster(config=RuntimeConfig(workers=0, batch_bytes=1 << 30, batch_segments=4))
    try:
        recv = _announce(c, range(4))
        p = c.prefill[0]
        calls: list[int] = []

        def write_many(writes: list[Any]) -> list[int]:
            calls.append(sum(len(w[2]) for w in writes))  # segments per hand-over
            return [p.endpoint.write(*w) for w in writes]

        p.endpoint.write_many = write_many  # type: ignore[attr-defined]
        senders = [p.create_sender(rid) for rid in range(4)]
        p.send_many([(s, [8 * s.room + 4, 8 * s.room + 2, 8 * s.room]) for s in senders])  # 3 runs each
        assert calls == [6, 6]  # two rooms' chunks (6 segments >= 4) at a time
        p.send_many([(s, [8 * s.room + q for q in (1, 3, 5)], True, s.room) for s in senders])
        c.settle()
        assert all(s.poll() == KVPoll.Success for s in senders) and all(r.poll() == KVPoll.Success for r in recv)
        for rid in range(4):
            src = [8 * rid + q for q in (4, 2, 0, 1, 3, 5)]
            assert c.kv_equal(0, src, 0, [8 * rid + 2 + q for q in range(6)])
    finally:
        c.close()
