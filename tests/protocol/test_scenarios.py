"""Machine-level scenarios: prefill and decode rooms paired by hand over a fake wire.

``Wire`` (protocol_kit) carries control messages through the codec, lands posted writes (data,
then the notification to decode, then the completion to prefill) and fires timers as its clock
advances. Each test reads as one story of the protocol.
"""

from __future__ import annotations

import pytest
from protocol_kit import (
    AUX_SLOTS,
    CODEC,
    DECODE_AUX,
    DECODE_PAGES,
    ROOM_ID,
    Wire,
    arrived,
    completion_id,
    messages,
    notified,
    of_type,
    ready,
    snapshot,
)

from kvfsm.protocol import (
    AUX_WRITE,
    CancelTimer,
    KVPoll,
    LocalProtocolError,
    PostAuxWrite,
    PostWrite,
    RecordIgnored,
    RecordProtocolError,
    SendMessage,
)
from kvfsm.protocol.events import Abort, AuxArrived, Clear, PeerLost, WriteCompleted, WriteFailed
from kvfsm.protocol.wire import AbortNotice, Drained, RoomFailed

LOCAL = [40, 41, 42, 43]  # the prefill rank's KV pages of the request, in order


def _expected_memory(local, announced, src=0):
    return {d: {src: s} for s, d in zip(local, announced, strict=True)}


def _no_timers(w: Wire) -> bool:
    return all(not ts for ts in w.deadlines.values())


def _writes(w: Wire) -> list:
    return of_type(w.actions("prefill"), PostWrite) + of_type(w.actions("prefill"), PostAuxWrite)


# ---------------------------------------------------------------- the two orders of SGLang push mode


def test_decode_announces_before_prefill_chunks_are_ready():  # scenario 1
    w = Wire()
    assert (w.kvpoll("prefill"), w.kvpoll("decode")) == (KVPoll.Bootstrapping, KVPoll.Bootstrapping)
    w.decode_announces()
    assert w.d().state == "WaitingForInput.Announced" and w.kvpoll("decode") == KVPoll.WaitingForInput
    w.deliver()
    assert w.p().state == "WaitingForInput" and w.kvpoll("prefill") == KVPoll.WaitingForInput

    w.prefill(ready(LOCAL[:2]))
    assert w.p().state == "Transferring.Sending" and w.kvpoll("prefill") == KVPoll.Transferring
    w.land_all()
    assert w.d().state == "Transferring" and w.kvpoll("decode") == KVPoll.Transferring

    w.prefill(ready(LOCAL[2:], last=True, aux=5))
    assert w.p().state == "Transferring.Draining"
    w.land_all()
    assert (w.kvpoll("prefill"), w.kvpoll("decode")) == (KVPoll.Success, KVPoll.Success)
    assert w.memory[0] == _expected_memory(LOCAL, DECODE_PAGES)
    assert w.aux_memory[0] == {DECODE_AUX: {0: 5}}
    assert _no_timers(w)


def test_prefill_holds_chunks_until_decode_announces_then_posts_them():  # scenario 2
    w = Wire()
    w.prefill(ready(LOCAL[:1]))
    w.prefill(ready(LOCAL[1:], last=True, aux=3))
    assert w.p().state == "Bootstrapping.Holding" and w.kvpoll("prefill") == KVPoll.Bootstrapping
    assert not w.writes, "nothing may be written before decode announced its pages"

    w.decode_announces()
    w.deliver()
    assert w.p().state == "Transferring.Draining" and not w.p().held
    assert [(type(a).__name__, completion_id(a)) for _, a in w.writes] == [
        ("PostWrite", 0), ("PostWrite", 1), ("PostAuxWrite", AUX_WRITE)
    ]  # fmt: skip
    w.land_all()
    assert (w.p().state, w.d().state) == ("Success", "Success")
    assert w.memory[0] == _expected_memory(LOCAL, DECODE_PAGES)


def test_held_chunks_are_posted_and_later_chunks_follow():  # scenario 2, room not complete when held
    w = Wire()
    w.prefill(ready(LOCAL[:2]))
    w.decode_announces()
    w.deliver()
    assert w.p().state == "Transferring.Sending" and len(w.writes) == 1
    w.prefill(ready(LOCAL[2:], last=True))
    w.land_all()
    assert (w.p().state, w.d().state) == ("Success", "Success")
    assert w.memory[0] == _expected_memory(LOCAL, DECODE_PAGES)


def test_multi_chunk_room_succeeds_whatever_order_the_writes_land_in():
    local = list(range(30, 37))
    pages = [3, 9, 4, 8, 5, 7, 6]
    w = Wire()
    w.decode_announces(pages, aux=1)
    w.deliver()
    for chunk in ([30, 31], [32], [33, 34, 35]):
        w.prefill(ready(chunk))
    w.prefill(ready([36], last=True))
    assert [completion_id(a) for _, a in w.writes] == [0, 1, 2, 3, AUX_WRITE]
    for _ in range(4):
        w.land(len(w.writes) - 1)  # newest first: the aux write, then the last chunk ...
        assert w.d().state == "Transferring" and w.p().state == "Transferring.Draining"
    w.land(0)
    assert (w.p().state, w.d().state) == ("Success", "Success")
    assert w.memory[0] == _expected_memory(local, pages)
    assert w.d().last_count == {0: 4}


def test_decode_with_two_prefill_sources_succeeds_only_when_both_delivered():
    w = Wire(prefill_ranks=(0, 1))
    assert w.d().sources == (0, 1)
    w.decode_announces()
    w.deliver()
    assert w.p(0).state == w.p(1).state == "WaitingForInput"

    w.prefill(ready(LOCAL, last=True, aux=1), rank=0)
    w.land_all()
    assert w.p(0).state == "Success"
    assert w.d().state == "Transferring", "one source's chunks and aux are not the room"

    w.prefill(ready([50, 51]), rank=1)
    w.prefill(ready([52, 53], last=True, aux=2), rank=1)
    w.land_all()
    assert (w.p(1).state, w.d().state) == ("Success", "Success")
    assert w.memory[0] == {d: {0: a, 1: b} for d, a, b in zip(DECODE_PAGES, LOCAL, [50, 51, 52, 53], strict=True)}
    assert w.aux_memory[0] == {DECODE_AUX: {0: 1, 1: 2}}


def test_prefill_rank_with_two_decode_ranks_writes_to_both():
    w = Wire(decode_ranks=(0, 1))
    assert w.d(0).required_dests == w.d(1).required_dests == 2
    w.decode_announces(DECODE_PAGES, aux=2, rank=0)
    w.deliver()
    assert w.p().state == "Bootstrapping.Waiting", "one of two decode ranks announced"
    w.prefill(ready(LOCAL, last=True))
    assert w.p().state == "Bootstrapping.Holding" and not w.writes

    w.decode_announces([20, 21, 22, 23], aux=6, rank=1)
    w.deliver()
    assert w.p().state == "Transferring.Draining"
    assert sorted((a.dest_rank, completion_id(a)) for _, a in w.writes) == [(0, -1), (0, 0), (1, -1), (1, 0)]
    for _ in range(3):
        w.land(0)
        assert w.p().state == "Transferring.Draining", "success needs every write to every decode rank"
    w.land(0)
    assert (w.p().state, w.d(0).state, w.d(1).state) == ("Success", "Success", "Success")
    assert w.memory == {0: _expected_memory(LOCAL, DECODE_PAGES), 1: _expected_memory(LOCAL, [20, 21, 22, 23])}
    assert w.aux_memory == {0: {2: {0: 0}}, 1: {6: {0: 0}}}


# ---------------------------------------------------------------- every timeout ends in Failed


def _failed_by_timeout(w: Wire, side: str, rank: int = 0) -> None:
    """Failed by a timer; a decode room whose pages may still be written keeps only its fence timer."""
    room = w.rooms[side, rank]
    assert w.kvpoll(side, rank) == KVPoll.Failed
    assert room.failure.startswith("timeout"), room.failure
    assert set(w.deadlines[side, rank]) == ({"fence"} if room.state == "Fenced" else set())


def test_prefill_times_out_when_decode_never_announces():  # bootstrap
    w = Wire(decode_ranks=())
    w.advance(299.0)
    assert w.p().state == "Bootstrapping.Waiting"
    w.advance(1.0)
    _failed_by_timeout(w, "prefill")
    assert "bootstrap timer expired" in w.p().failure


def test_prefill_stops_holding_kv_when_decode_never_announces():  # hold
    w = Wire(decode_ranks=())
    w.prefill(ready(LOCAL, last=True))
    w.advance(30.0)
    _failed_by_timeout(w, "prefill")
    assert "hold timer expired" in w.p().failure
    assert w.now == 30.0, "the hold timer, not the bootstrap timer, ended it"


def test_prefill_times_out_when_engine_never_hands_over_a_chunk_and_tells_decode():  # input
    w = Wire(timeouts={"decode": {"transfer": 900.0}})
    w.decode_announces()
    w.deliver()
    w.advance(300.0)
    _failed_by_timeout(w, "prefill")
    assert "input timer expired" in w.p().failure
    assert w.d().state == "WaitingForInput.Announced"
    w.deliver()  # the RoomFailed it sent
    assert w.d().state == "Failed" and "input timer expired" in w.d().failure
    assert _no_timers(w)


def test_prefill_times_out_when_a_write_never_completes_and_tells_decode():  # transfer
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.advance(59.0)
    assert w.p().state == "Transferring.Sending"
    w.advance(1.0)
    _failed_by_timeout(w, "prefill")
    assert messages(w.actions("prefill"), RoomFailed)
    assert not messages(w.actions("prefill"), Drained), "the write never completed: it may still land"
    w.deliver()
    assert w.d().state == "Fenced" and w.kvpoll("decode") == KVPoll.Failed
    w.advance(900.0)  # nothing confirms the drain: decode's fence timer releases the pages
    assert w.d().state == "Failed" and w.d().last_row == "D27" and _no_timers(w)


def test_decode_times_out_when_the_handshake_never_finishes():  # bootstrap
    w = Wire(timeouts={"prefill": {"bootstrap": 900.0}})
    w.advance(300.0)
    _failed_by_timeout(w, "decode")
    assert [r for r, _ in messages(w.actions("decode"), AbortNotice)] == [0]
    w.deliver()
    assert w.p().state == "Failed" and "timeout" in w.p().failure


def test_decode_times_out_when_prefill_never_writes():  # transfer
    w = Wire(timeouts={"prefill": {"input": 900.0}})
    w.decode_announces()
    w.deliver()
    w.advance(300.0)
    _failed_by_timeout(w, "decode")
    assert "transfer timer expired" in w.d().failure
    assert w.d().state == "Fenced", "prefill may have posted writes decode has not heard of"
    w.deliver()  # the abort; prefill never wrote, so it answers drained at once
    assert w.p().state == "Failed" and not w.deadlines["prefill", 0]
    assert w.d().state == "Failed" and _no_timers(w)


def test_decode_transfer_timeout_is_re_armed_by_every_arrival():
    w = Wire(timeouts={"prefill": {"transfer": 900.0}})
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.advance(200.0)
    w.land_all()  # an arrival at t=200 re-arms decode's inactivity timer
    w.advance(250.0)
    assert w.d().state == "Transferring"
    w.advance(50.0)
    _failed_by_timeout(w, "decode")
    assert w.now == 500.0


# ---------------------------------------------------------------- aborts from either side


def test_prefill_abort_fails_the_decode_room():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.prefill(Abort("engine dropped the request"))
    assert w.p().state == "Failed" and _writes(w)
    (notice,) = [m for _, m in messages(w.actions("prefill"), AbortNotice)]
    assert notice.side == "prefill" and "engine dropped the request" in notice.reason
    assert not messages(w.actions("prefill"), Drained), "its write is still in flight"
    w.deliver()
    assert w.d().state == "Fenced" and "engine dropped the request" in w.d().failure

    w.land_all()  # the write posted before the abort lands late, into pages still fenced for this room
    assert of_type(w.log[-2][3], RecordIgnored), "decode ignores the notification"
    assert w.p().last_row == "P28b" and messages(w.log[-1][3], Drained) == [(0, Drained(ROOM_ID, 0))]
    w.deliver()
    assert (w.p().state, w.d().state) == ("Failed", "Failed")
    assert _no_timers(w)


def test_decode_abort_fails_the_prefill_room_and_stops_its_writes():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.decode(Abort("client went away"))
    w.deliver()
    assert w.p().state == "Failed" and "client went away" in w.p().failure
    posted = len(_writes(w))
    actions = w.prefill(ready(LOCAL[2:], last=True))  # the engine had not polled the failure yet
    assert of_type(actions, RecordIgnored) and len(_writes(w)) == posted


def test_lost_decode_peer_fails_the_prefill_room():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(PeerLost(0, "decode rank 0 crashed"))
    assert w.p().state == "Failed" and not w.deadlines["prefill", 0]


def test_clear_after_success_forgets_both_rooms():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL, last=True))
    w.land_all()
    w.prefill(Clear())
    w.decode(Clear())
    assert (w.p().state, w.d().state) == ("Cleared", "Cleared") and _no_timers(w)
    with pytest.raises(Exception, match="cleared"):
        w.kvpoll("decode")


# ---------------------------------------------------------------- the fence: no write lands in released pages


def _fenced(w: Wire, rank: int = 0) -> None:
    """Failed to the engine, but the pages stay reserved: clear() is refused and changes nothing."""
    room = w.d(rank)
    assert room.state == "Fenced" and w.kvpoll("decode", rank) == KVPoll.Failed
    before = snapshot(room)
    with pytest.raises(LocalProtocolError, match="clear is not accepted in state Fenced"):
        w.decode(Clear(), rank)
    assert snapshot(room) == before | {"last_row": room.last_row}  # last_row: a trace field the kit resets


def test_decode_abort_while_writes_in_flight_fences_pages_until_prefill_drains():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    assert len(w.writes) == 1, "prefill posted a write into decode's pages; it has not landed"

    w.decode(Abort("client went away"))
    _fenced(w)
    assert w.d().undrained == {0} and set(w.deadlines["decode", 0]) == {"fence"}
    w.deliver()  # the abort reaches prefill: it fails, but its write is still in flight
    assert w.p().state == "Failed" and "client went away" in w.p().failure and w.p().inflight
    assert not messages(w.actions("prefill"), Drained)
    _fenced(w)

    w.land(0)  # the write lands in pages still reserved for this room, then completes at prefill
    assert w.memory[0] == {10: {0: 40}, 11: {0: 41}}
    assert w.p().last_row == "P28b" and messages(w.log[-1][3], Drained) == [(0, Drained(ROOM_ID, 0))]
    assert w.d().state == "Fenced", "decode has not heard yet"
    w.deliver()
    assert w.d().state == "Failed" and w.d().last_row == "D25" and w.kvpoll("decode") == KVPoll.Failed
    assert "client went away" in w.d().failure, "the first reason stays"
    w.decode(Clear())
    w.prefill(Clear())
    assert (w.p().state, w.d().state) == ("Cleared", "Cleared") and _no_timers(w)


def test_fence_released_when_the_only_source_dies():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.land(0)
    w.prefill(ready(LOCAL[2:], last=True))  # chunk 1 and the aux write in flight
    w.decode(Abort("client went away"))
    _fenced(w)
    w.outbox.clear()  # prefill rank 0 crashes before it reads the abort: no drained will ever come
    actions = w.decode(PeerLost(0, "prefill rank 0 crashed"))  # a dead rank writes nothing more
    assert w.d().state == "Failed" and w.d().last_row == "D25" and not w.d().undrained
    assert actions == [CancelTimer("fence")] and not w.deadlines["decode", 0], "the fence timer is cancelled"
    w.decode(Clear())
    assert w.d().state == "Cleared"


def test_announced_pages_are_released_at_once_when_the_only_source_dies():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.land(0)
    w.decode(PeerLost(0, "prefill rank 0 crashed"))  # no source is left that could write
    assert w.d().state == "Failed" and w.d().last_row == "D23" and not w.deadlines["decode", 0]
    w.decode(Clear())


def test_fence_timer_releases_pages_when_drained_is_lost():
    w = Wire(timeouts={"decode": {"fence": 30.0}})
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.decode(Abort())
    w.deliver()
    w.land(0)  # the write completes: prefill sends drained ...
    assert [type(CODEC.decode(data)) for _, _, data in w.outbox] == [Drained]
    w.outbox.clear()  # ... and the network loses it
    w.advance(29.0)
    _fenced(w)
    w.advance(1.0)
    assert w.d().state == "Failed" and w.d().last_row == "D27" and _no_timers(w)
    assert w.d().failure.startswith("aborted"), "the fence timer is not the failure's reason"
    w.decode(Clear())
    assert w.d().state == "Cleared"


def test_multi_source_decode_failure_tells_every_other_source():
    w = Wire(prefill_ranks=(0, 1))
    assert w.d().sources == (0, 1)
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL, last=True, aux=1), rank=0)  # rank 0's chunk and aux write in flight
    w.prefill(ready([50, 51]), rank=1)  # rank 1's first chunk in flight
    w.prefill(Abort("engine dropped the request"), rank=1)
    assert w.p(1).state == "Failed" and not messages(w.actions("prefill", 1), Drained)

    w.deliver()  # rank 1's abort fails decode, which tells every source, rank 0 too
    assert w.d().state == "Fenced" and w.d().undrained == {0, 1}
    told = [r for r, _ in messages(w.actions("decode"), AbortNotice)]
    assert told == [0, 1]
    assert w.p(0).state == "Failed" and "engine dropped the request" in w.p(0).failure
    assert w.p(1).last_row == "P21", "rank 1 ignores the echo of its own failure"
    posted = len(_writes(w))
    w.prefill(ready([52, 53], last=True), rank=1)  # the engine had not polled the failure yet
    assert len(_writes(w)) == posted, "no source writes after the failure"

    assert [src for src, _ in w.writes] == [0, 0, 1]
    w.land(2)  # rank 1's write: its last one, so it confirms drained
    w.deliver()
    _fenced(w)
    assert w.d().undrained == {0}, "rank 0 still writes"
    w.land(1)  # rank 0's aux write; its chunk is still in flight
    w.deliver()
    _fenced(w)
    w.land(0)
    w.deliver()
    assert [r for r, _ in messages(w.actions("prefill"), Drained)] == [0, 0]  # each prefill rank to decode 0
    assert [s for s, r, e, _ in w.log if type(e).__name__ == "WritesDrained"] == ["decode", "decode"]
    assert w.d().state == "Failed" and w.d().last_row == "D25" and _no_timers(w)
    w.decode(Clear())


def test_a_lost_drained_is_sent_again_when_the_fenced_decode_aborts():  # P21
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(Abort("engine dropped the request"))  # nothing posted: the notice and drained go at once ...
    assert [type(CODEC.decode(data)) for _, _, data in w.outbox] == [AbortNotice, Drained]
    w.outbox.clear()  # ... and the network loses both
    w.advance(300.0)  # decode hears nothing: its transfer timer fences the pages and tells prefill
    assert w.d().state == "Fenced" and w.d().last_row == "D19"
    w.deliver()  # the abort reaches the failed prefill room, which answers drained again
    assert w.p().last_row == "P21" and w.p().state == "Failed"
    assert [r for r, _ in messages(w.actions("prefill"), Drained)] == [0, 0]
    assert w.d().state == "Failed" and w.d().last_row == "D25", "released without waiting for the fence timer"
    assert "transfer timer expired" in w.d().failure and _no_timers(w)


def test_late_room_pages_never_releases_pages_a_write_may_still_land_in():
    w = Wire()
    w.decode_announces()
    (room_pages,) = w.outbox
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.decode(Abort())
    w.deliver()
    assert w.p().state == "Failed" and w.p().inflight
    w.outbox.append(room_pages)  # a duplicated (retried) room_pages arrives late
    w.deliver()
    assert w.p().last_row == "P23" and w.d().state == "Fenced", "told again, but not drained: a write is in flight"
    assert not messages(w.actions("prefill"), Drained)
    w.land(0)
    w.deliver()
    assert w.d().state == "Failed"


def test_a_failed_write_lets_decode_release_its_pages_at_once():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.writes.clear()
    actions = w.prefill(WriteFailed(0, 0, "RDMA error"))  # the only write concluded, with an error
    assert w.p().last_row == "P16" and not w.p().inflight
    assert [type(m) for _, m in messages(actions, RoomFailed) + messages(actions, Drained)] == [RoomFailed, Drained]
    w.deliver()
    assert w.d().state == "Failed" and "RDMA error" in w.d().failure and _no_timers(w)


def test_a_rejected_announcer_is_told_it_may_release_its_pages():
    w = Wire(registered={0: (2, AUX_SLOTS)})
    w.decode_announces()
    w.deliver()
    assert w.p().last_row in ("P2", "P21") and w.p().state == "Failed"
    assert w.d().state == "Failed", "nothing was written to it, yet it waits for the fence timer"


# ---------------------------------------------------------------- duplicates and late news are ignored


def _ignored(w: Wire, side: str, event, rank: int = 0) -> None:
    room = w.rooms[side, rank]
    before = snapshot(room)
    actions = w.step(side, rank, event)
    assert [type(a) for a in actions] == [RecordIgnored], actions
    assert snapshot(room) == before | {"last_row": room.last_row}


def test_duplicate_room_pages_is_ignored():
    w = Wire()
    w.decode_announces()
    (duplicate,) = w.outbox
    w.deliver()
    w.outbox.append(duplicate)  # a retried or duplicated room_pages
    _ignored(w, "prefill", w._event_of("prefill", CODEC.decode(duplicate[2])))
    assert w.p().state == "WaitingForInput"


def test_duplicate_chunk_and_aux_notifications_are_ignored():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.prefill(ready(LOCAL[2:], last=True))
    chunk0, aux = w.writes[0][1], w.writes[2][1]
    w.land(0)
    w.land(1)  # the aux write (index 1 once chunk 0 is gone)
    _ignored(w, "decode", notified(chunk0))
    _ignored(w, "decode", notified(aux))
    assert w.d().state == "Transferring"
    w.land_all()
    assert w.d().state == "Success"
    _ignored(w, "decode", notified(chunk0))  # even after success


def test_duplicate_and_late_write_completions_are_ignored():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:2]))
    w.land(0)
    _ignored(w, "prefill", WriteCompleted(0, 0))  # counted once
    _ignored(w, "prefill", WriteCompleted(3, 0))  # a decode rank this room never wrote to
    w.prefill(ready(LOCAL[2:], last=True))
    w.land_all()
    assert w.p().state == "Success"
    _ignored(w, "prefill", WriteCompleted(0, 1))


def test_a_successful_prefill_room_answers_a_late_decode_abort_with_drained():  # P21
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL, last=True))
    w.land_all()
    assert (w.p().state, w.d().state) == ("Success", "Success")
    before = snapshot(w.p())
    actions = w.prefill(PeerLost(0, "decode rank restarted"))  # late news: ignored, nothing in flight ...
    assert w.p().last_row == "P21" and snapshot(w.p()) == before | {"last_row": "P21"}
    assert [type(a) for a in actions] == [RecordIgnored, SendMessage]
    assert messages(actions, Drained) == [(0, Drained(ROOM_ID, 0))], "... so it confirms drained (again)"
    w.deliver()  # a drained for a successful decode room is late news too
    assert w.d().state == "Success" and w.d().last_row == "D17"


# ---------------------------------------------------------------- peers' faults fail the room


@pytest.mark.parametrize(
    ("registered", "why"),
    [((2, AUX_SLOTS), "outside decode rank 0's 2 registered pages"), ((0, 0), "without a registered region"),
     ((64, 1), "aux slot 2 outside 1 registered slots")],
    ids=["beyond-region", "unregistered", "aux-beyond-region"],
)  # fmt: skip
def test_pages_outside_the_registered_region_are_rejected_before_any_write(registered, why):
    w = Wire(registered={0: registered})  # what prefill learned from decode rank 0's register message
    w.prefill(ready(LOCAL[:2]))  # held: scenario 2, so a bad announcement would post at once
    w.decode_announces()
    w.deliver()
    assert w.p().state == "Failed" and why in w.p().failure
    w.prefill(ready(LOCAL[2:], last=True))
    assert not _writes(w), "no byte may be written into pages the peer never registered"
    assert [r for r, _ in messages(w.actions("prefill"), RoomFailed)] == [0], "the announcer is told at once"
    w.deliver()
    assert w.kvpoll("decode") == KVPoll.Failed and why in w.d().failure


def test_chunk_notification_from_an_unexpected_source_fails_the_decode_room():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.decode(arrived(0, 0, 4, src=3, last=True))
    assert w.d().state == "Fenced" and "prefill rank 3, expected [0]" in w.d().failure
    assert [(r, m.side) for r, m in messages(w.actions("decode"), AbortNotice)] == [(0, "decode")]
    w.deliver()
    assert w.p().state == "Failed"
    assert w.d().state == "Failed", "prefill had posted nothing: drained at once"


def test_decode_fails_when_chunk_id_beyond_last():
    w = Wire()
    w.decode_announces()
    w.decode(arrived(1, 2, 2, last=True))  # two chunks in all
    w.decode(arrived(2, 0, 1))
    assert w.d().state == "Fenced" and "beyond the last chunk (2 chunks)" in w.d().failure


def test_decode_fails_on_a_second_last_chunk():
    w = Wire()
    w.decode_announces()
    w.decode(arrived(0, 0, 2, last=True))
    w.decode(arrived(1, 2, 2, last=True))
    assert w.d().state == "Fenced" and "a second last chunk" in w.d().failure


def test_prefill_chunks_that_do_not_cover_the_announced_pages_fail_before_writing():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL[:3], last=True))  # 3 pages for 4 announced
    assert w.p().state == "Failed" and w.p().failure.startswith("page count mismatch")
    assert not _writes(w)
    w.deliver()
    assert w.d().state == "Failed"


def test_held_chunks_that_overflow_the_announcement_fail_when_decode_announces():
    w = Wire()
    w.prefill(ready(LOCAL + [44]))  # five pages held
    w.decode_announces()  # four pages announced
    w.deliver()
    assert w.p().state == "Failed" and w.p().failure.startswith("page count mismatch") and not _writes(w)
    w.deliver()
    assert w.d().state == "Failed"


def test_overlapping_chunk_notifications_fail_the_decode_room_on_page_coverage():
    w = Wire()
    w.decode_announces()
    w.decode(AuxArrived(0))
    w.decode(arrived(0, 0, 2))
    w.decode(arrived(1, 1, 2, last=True))  # pages 1..2: overlaps chunk 0, page 3 never written; sizes add up
    assert w.d().state == "Fenced" and w.d().failure.startswith("page coverage mismatch")
    assert messages(w.actions("decode"), AbortNotice)


def test_a_peer_event_no_row_accepts_fails_a_live_room_and_is_reported():
    w = Wire()
    actions = w.prefill(AuxArrived(0))  # a decode-side notification delivered to a prefill room
    assert w.p().state == "Failed" and w.p().failure.startswith("protocol_error")
    assert isinstance(actions[-1], RecordProtocolError)


def test_a_peer_event_no_row_accepts_leaves_a_successful_room_successful():
    w = Wire()
    w.decode_announces()
    w.deliver()
    w.prefill(ready(LOCAL, last=True))
    w.land_all()
    actions = w.decode(WriteCompleted(0, 0))  # a prefill-side completion delivered to a decode room
    assert [type(a) for a in actions] == [RecordProtocolError]
    assert w.d().state == "Success" and w.d().failure is None
