"""The runtime with its fast rows (``kvfsm.protocol.fastpath``) behaves exactly as without.

The same seeded run, with lost, duplicated and delayed messages and completions, writes that land
late, completions handed over while a chunk is being posted (as the NIXL data plane hands over
what it finds done when it posts), chunks handed over with ``send()`` and ``send_many()`` between
deliveries, the clock moving on between them (transfer timeouts), and engine aborts, is played
with the fast rows on and off: every write posted, and after every operation every room's status,
the armed timers and both managers' telemetry, and in the end decode's bytes, must be the same.
The fast rows must actually be taken in the run that has them.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvfsm.check.mutants import mutated_protocol
from kvfsm.protocol import KVPoll, LocalProtocolError, fastpath
from kvfsm.protocol.events import AUX_WRITE, Abort
from kvfsm.protocol.wire import AuxWritten, ChunkWritten
from kvfsm.testing import LoopbackCluster
from kvfsm.transport.base import Inbound, TransportError
from kvfsm.transport.loopback import Faults

ROOMS = 8
PAGES = 24  # per room


def _play(seed: int, fast: bool, taken: dict[str, int]) -> dict[str, Any]:
    c = LoopbackCluster(
        pages=ROOMS * PAGES,
        seed=seed,
        ordered=False,
        faults=Faults(drop=0.05, dup=0.2, delay=0.3),
        async_writes=True,
        timeouts={"transfer": 10.0},
    )
    p, d = c.prefill[0], c.decode[0]
    assert p.fast_rows and d.fast_rows  # the shipped spec's rows
    p.fast_rows = d.fast_rows = fast
    posted: list[Any] = []
    write = p.endpoint.write

    def spy(peer: str, region: str, segments: Any, note: bytes, tag: object) -> int:
        posted.append((peer, region, [(s.src, s.dst, s.length) for s in segments], note, tag))
        moved = write(peer, region, segments, note, tag)
        if rng.random() < 0.3:
            c.fabric.pump(rng.randint(1, 3))  # what is due now, handed over inside the post
            flush()
        return moved

    write_run = p.endpoint.write_run

    def spy_run(peer: str, region: str, src: int, dst: int, length: int, note: bytes, tag: object) -> int:
        posted.append((peer, region, [(src, dst, length)], note, tag))  # as spy() records it
        moved = write_run(peer, region, src, dst, length, note, tag)
        if rng.random() < 0.3:
            c.fabric.pump(rng.randint(1, 3))
            flush()
        return moved

    p.endpoint.write = spy  # type: ignore[method-assign]
    p.endpoint.write_run = spy_run  # type: ignore[method-assign]
    rng = random.Random(seed)

    # Completions handed over as NIXL's poller does: the writes one transfer completed, together
    # ("completions", to the batch handler), in the order they arrived.
    handler, held = p.endpoint.handler, []

    def batching(item: Inbound) -> None:
        if item.kind == "completion" and item.ok and rng.random() < 0.7:
            held.append(item.tag)
            return
        flush()
        handler(item)

    def flush() -> None:
        if held:
            tags = tuple(held)
            held.clear()
            p._on_inbound_batch([Inbound("completions", "decode/0", tag=tags)])

    p.endpoint.handler = batching
    recv = [d.create_receiver(r) for r in range(ROOMS)]
    send = [p.create_sender(r) for r in range(ROOMS)]
    polls: list[tuple[int, ...]] = []
    timers: list[dict[int, dict[str, tuple[Any, ...]]]] = []
    telemetry: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def settle_some() -> None:
        c.clock.advance(rng.choice([0.0, 0.0, 0.0, 0.5, 1.0]))  # type: ignore[attr-defined] # (transfer timeout: 10 s)
        for m in c.managers:
            m.tick()
        c.settle(max_items=rng.randint(0, 4))  # completions and messages arrive later than the sends
        flush()
        polls.append(tuple(s.poll() for s in send) + tuple(r.poll() for r in recv))
        timers.append({k: {t: tuple(e) for t, e in v.items()} for k, v in p._timers._armed.items()})
        telemetry.append((p.telemetry.snapshot(), d.telemetry.snapshot()))

    for r in range(ROOMS):
        dst = list(range(r * PAGES, (r + 1) * PAGES))
        recv[r].init(dst if r % 2 else dst[::-1], r)  # even rooms: a segment per page
        settle_some()
    cursor = [0] * ROOMS
    while any(n < PAGES for n in cursor):
        batch = []
        for r in rng.sample(range(ROOMS), rng.randint(1, ROOMS)):
            if cursor[r] >= PAGES:
                continue
            n = min(PAGES - cursor[r], rng.randint(1, 6))
            pages = list(range(r * PAGES + cursor[r], r * PAGES + cursor[r] + n))
            cursor[r] += n
            last = cursor[r] == PAGES
            batch.append((r, pages, last, r if last else None))
        if rng.random() < 0.5:
            p.send_many(batch)
        else:
            for r, pages, last, slot in batch:
                try:
                    send[r].send(pages, is_last=last, aux_slot=slot)
                except LocalProtocolError:
                    pass  # a room that failed meanwhile took its chunk as the generic step does
        if rng.random() < 0.05:
            send[rng.randrange(ROOMS)].abort("engine gave up")
        elif rng.random() < 0.05:
            recv[rng.randrange(ROOMS)].abort("engine gave up")
        settle_some()
    for _ in range(4):  # the rest delivered; writes whose completion was lost time out
        c.settle()
        flush()
        c.advance(4.0)
        settle_some()
    out = {
        "posted": posted,
        "polls": polls,
        "timers": timers,
        "telemetry": telemetry,
        "kv": bytes(c.dkv[0]),
        "aux": bytes(c.daux[0]),
    }
    c.close()
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_fast_rows_change_nothing_the_runtime_does(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = {"chunk": 0, "run": 0, "completion": 0, "arrival": 0, "P10": 0, "P14": 0}
    chunk, completion, arrival = fastpath.chunk, fastpath.completion, fastpath.arrival

    def counted_chunk(*args: Any) -> Any:
        got = chunk(*args)
        taken["chunk"] += got is not None
        taken["run"] += got is not None and len(got) == 8  # one write of one run (RunPosts)
        taken["P10"] += got is not None and args[0].last_row == "P10"
        return got

    def counted_completion(*args: Any) -> bool:
        got = completion(*args)
        taken["completion"] += got
        taken["P14"] += got and args[0].last_row == "P14"
        return got

    def counted_arrival(*args: Any) -> bool:
        got = arrival(*args)
        taken["arrival"] += got
        return got

    monkeypatch.setattr(fastpath, "chunk", counted_chunk)
    monkeypatch.setattr(fastpath, "completion", counted_completion)
    monkeypatch.setattr(fastpath, "arrival", counted_arrival)
    slow = _play(seed, False, taken)
    assert not any(taken.values())
    fast = _play(seed, True, taken)
    assert taken["chunk"] > 10 and taken["completion"] > 10 and taken["arrival"] > 10, taken
    assert taken["run"] and taken["run"] < taken["chunk"], taken  # one-run chunks, and others
    assert taken["P10"] and taken["P14"], taken  # rooms' last chunks and last writes too
    for key in slow:
        assert fast[key] == slow[key], key
    final = fast["polls"][-1]
    assert KVPoll.Success in final and KVPoll.Failed in final  # (rooms reached both ends)


def test_a_manager_on_a_spec_with_other_rows_takes_the_generic_step_only() -> None:
    """Each side's fast rows are off where that side's rows differ from the shipped spec's."""
    c = LoopbackCluster(protocol=mutated_protocol("drained_before_writes_done"))
    try:
        assert not c.prefill[0].fast_rows and c.decode[0].fast_rows  # (a prefill row rewritten)
    finally:
        c.close()
    c = LoopbackCluster(protocol=mutated_protocol("success_before_aux"))
    try:
        assert c.prefill[0].fast_rows and not c.decode[0].fast_rows  # (a decode guard rewritten)
    finally:
        c.close()


def test_a_completion_behind_a_queued_event_waits_its_turn() -> None:
    """While P11's writes are posted, a completion handed over meanwhile takes the fast row only
    if no event is queued before it (events apply in order)."""
    c = LoopbackCluster(async_writes=True)
    try:
        p = c.prefill[0]
        c.decode[0].create_receiver(1).init(list(range(8)), 0)
        s = p.create_sender(1)
        c.settle()
        s.send([0, 1])
        s.send([2, 3])  # the fast row; its write pending
        room = p._rooms[1].room
        assert (0, 1) in room.inflight and room.state == fastpath.SENDING
        with p._lock:
            p._draining = p._fast_posting = True  # as inside _chunk_posted
            p._queue.append((1, Abort("queued first")))
            p._on_completion((1, 0, 1), True, "")
            assert (0, 1) in room.inflight and len(p._queue) == 2  # queued behind the abort
            p._queue.clear()
            # in one transfer's completions: an unknown write (the generic step: queued), then ours
            p._on_inbound_batch([Inbound("completions", "decode/0", tag=((1, 0, 99), (1, 0, 1)))])
            assert (0, 1) in room.inflight and len(p._queue) == 2
            p._queue.clear()
            p._on_completion((1, 0, 1), True, "")
            assert (0, 1) not in room.inflight and room.last_row == "P15"  # nothing before it: fast
            p._draining = p._fast_posting = False
    finally:
        c.close()


def test_a_chunk_of_adjacent_pages_goes_as_one_write_run_and_a_refused_one_fails_its_room_only() -> None:
    """``send()`` of a list of adjacent pages takes the leanest path, the first chunk (from
    WaitingForInput) and the last (with its aux write) too: one ``write_run`` of the chunk's
    bytes, the notification byte for byte what the generic path encodes, the room's counts as
    ``_hand`` keeps them. A ``write_run`` that raises fails that room's write (and the room), as
    a refused ``write`` does; the other room goes on."""
    c = LoopbackCluster(pages=64, page_bytes=256)
    try:
        p, d = c.prefill[0], c.decode[0]
        calls: list[tuple[Any, ...]] = []
        write_run = p.endpoint.write_run
        refuse = {(2, 1)}  # room 2's second chunk

        def spy(peer: str, region: str, src: int, dst: int, length: int, note: bytes, tag: Any) -> int:
            calls.append((peer, region, src, dst, length, note, tag))
            if tag[::2] in refuse:
                raise TransportError("simulated: peer gone")
            return write_run(peer, region, src, dst, length, note, tag)  # type: ignore[no-any-return]

        p.endpoint.write_run = spy  # type: ignore[method-assign]
        senders = {}
        for rid, base in ((1, 0), (2, 16)):
            d.create_receiver(rid).init(list(range(base + 32, base + 40)), 1)
            senders[rid] = p.create_sender(rid)
        c.settle()
        for rid, base in ((1, 0), (2, 16)):
            senders[rid].send([base, base + 1])  # the first chunk: WaitingForInput into Sending
            note = p.codec.encode(ChunkWritten(rid, 0, 0, False, 0, 2))
            assert calls[-1] == ("decode/0", "kv", base * 256, (base + 32) * 256, 2 * 256, note, (rid, 0, 0))
            assert p.state(rid) == "Transferring.Sending" and p._rooms[rid].room.last_row == "P11"
            assert not p._timers.armed(rid, "input")
        senders[1].send([2, 3, 4])
        note = p.codec.encode(ChunkWritten(1, 0, 1, False, 2, 3))
        assert calls[-1] == ("decode/0", "kv", 2 * 256, 34 * 256, 3 * 256, note, (1, 0, 1))
        assert p._rooms[1].room.last_row == "P11" and p._rooms[1].bytes == 5 * 256
        senders[2].send([18, 19])
        assert calls[-1][6] == (2, 0, 1)
        c.settle()
        assert senders[2].poll() == KVPoll.Failed and "simulated: peer gone" in p.failure_exception(2).reason
        assert p.stats()["counters"]["write_errors"] == 1
        n = len(calls)
        senders[1].send([5, 6, 7], is_last=True, aux_slot=2)
        aux = p.aux_slot_bytes
        assert calls[n:] == [
            (
                "decode/0",
                "kv",
                5 * 256,
                37 * 256,
                3 * 256,
                p.codec.encode(ChunkWritten(1, 0, 2, True, 5, 3)),
                (1, 0, 2),
            ),
            ("decode/0", "aux", 2 * aux, 1 * aux, aux, p.codec.encode(AuxWritten(1, 0)), (1, 0, AUX_WRITE)),
        ]
        assert p._rooms[1].room.last_row == "P10" and p._rooms[1].bytes == 8 * 256 + aux
        c.settle()
        assert senders[1].poll() == KVPoll.Success
        assert c.kv_equal(0, list(range(8)), 0, list(range(32, 40)))
    finally:
        c.close()
