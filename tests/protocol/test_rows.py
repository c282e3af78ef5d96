"""Every spec row fires: for each row id a scenario from a fresh room whose last step fires it.

Each case is run through both interpreters (the compiled table and the transitions machine).
A test checks that the cases cover exactly the rows of spec/, so a new row needs a case here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from protocol_kit import (
    AUX_SLOTS,
    DECODE_AUX,
    DECODE_PAGES,
    KV_PAGES,
    MACHINES,
    allocated,
    announce,
    arrived,
    checked_step,
    fired,
    machine_spec,
    messages,
    new_room,
    of_type,
    ready,
    rows_by_id,
    run,
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
    SendMessage,
    SetTimer,
)
from kvfsm.protocol.events import (
    Abort,
    AbortReceived,
    AuxArrived,
    Clear,
    FailureReceived,
    PeerLost,
    PeersReady,
    WriteCompleted,
    WriteFailed,
    WritesDrained,
)
from kvfsm.protocol.wire import AbortNotice, Drained, RoomFailed, RoomPages


@dataclass(frozen=True)
class Case:
    row: str
    events: tuple[Any, ...]
    state: str
    room: dict[str, Any] = field(default_factory=dict)
    then: Callable[[Any, list[Any]], None] | None = None  # (room, actions of the last step)


def ignored(room: Any, actions: list[Any]) -> None:
    assert of_type(actions, RecordIgnored), actions
    assert not of_type(actions, SendMessage) and not of_type(actions, PostWrite)


def failed_with(word: str) -> Callable[[Any, list[Any]], None]:
    def then(room: Any, actions: list[Any]) -> None:
        assert room.failure and word in room.failure, room.failure
        assert not room.timers and not of_type(actions, SetTimer)

    return then


def because(word: str) -> Callable[[Any, list[Any]], None]:
    def then(room: Any, actions: list[Any]) -> None:
        assert room.failure and word in room.failure, room.failure

    return then


def told_decode(kind: type) -> Callable[[Any, list[Any]], None]:
    def then(room: Any, actions: list[Any]) -> None:
        assert not room.timers
        sent = messages(actions, kind)
        assert sorted(r for r, _ in sent) == sorted(room.dests), sent
        assert all(m.room == room.room and m.reason == room.failure for _, m in sent)

    return then


def told_prefill(room: Any, actions: list[Any]) -> None:
    sent = messages(actions, AbortNotice)
    assert [r for r, _ in sent] == list(room.sources)
    assert all(m.side == "decode" and m.reason == room.failure for _, m in sent)


def both(*checks: Callable[[Any, list[Any]], Any]) -> Callable[[Any, list[Any]], None]:
    def then(room: Any, actions: list[Any]) -> None:
        for check in checks:
            result = check(room, actions)
            assert result is None or result, f"{check}: {actions}"

    return then


def drained_now(room: Any, actions: list[Any]) -> None:
    """Prefill: nothing is in flight, so every announced decode rank is told at once (after the notice)."""
    assert not room.inflight
    sent = messages(actions, Drained)
    assert sent == [(d, Drained(room.room, room.rank)) for d in sorted(room.dests)], sent
    drained = [isinstance(a.message, Drained) for a in of_type(actions, SendMessage)]
    assert drained == sorted(drained), "a decode rank hears why the room failed before it hears drained"


def answers_drained(room: Any, actions: list[Any]) -> None:
    """Prefill P21: a concluded room ignores a decode rank's abort or loss, but (nothing in flight)
    answers it with drained to every decode rank again, in case the first drained was lost."""
    assert of_type(actions, RecordIgnored) and not of_type(actions, PostWrite), actions
    assert [type(a) for a in actions] == [RecordIgnored] + [SendMessage] * len(room.dests), actions
    drained_now(room, actions)


def answers_the_unrecorded_aborter(room: Any, actions: list[Any]) -> None:
    """Prefill P21: a decode rank that aborts without ever having announced is answered drained."""
    assert [d for d, _ in messages(actions, Drained)] == [0], actions


def rejects_announcer(dest: int) -> Callable[[Any, list[Any]], None]:
    """Prefill P2: the rejected announcer is never recorded and nothing was written to it, so it is
    told why and, at once, that it may release its pages (it would otherwise wait for its fence timer)."""

    def then(room: Any, actions: list[Any]) -> None:
        assert dest not in room.dests and not room.inflight
        sent = [(a.peer_rank, type(a.message)) for a in of_type(actions, SendMessage)]
        assert sent == [(dest, RoomFailed), (dest, Drained)], sent

    return then


def not_drained_yet(room: Any, actions: list[Any]) -> None:
    """Prefill: a write is still in flight, so no decode rank may release its pages yet."""
    assert room.inflight and not messages(actions, Drained), actions


def fenced_with(word: str) -> Callable[[Any, list[Any]], None]:
    """Decode: failed while a source may still write: every source fenced, the fence timer armed."""

    def then(room: Any, actions: list[Any]) -> None:
        assert room.failure and word in room.failure, room.failure
        assert room.undrained == set(room.sources), room.undrained
        assert room.timers == {"fence"} and [t.timer for t in of_type(actions, SetTimer)] == ["fence"]
        told_prefill(room, actions)

    return then


def released(room: Any, actions: list[Any]) -> None:
    """Decode: the fence is released: Failed, the fence timer cancelled, nothing sent."""
    assert room.state == "Failed" and not room.timers and CancelTimer("fence") in actions
    assert not of_type(actions, SendMessage)


# ---------------------------------------------------------------- prefill scenarios

A = announce()  # decode rank 0 announces DECODE_PAGES (4 pages) and DECODE_AUX
CHUNK = ready([0, 1])
LAST = ready([0, 1, 2, 3], last=True)
TO_DRAINING = (A, LAST)
TO_SUCCESS = (A, LAST, WriteCompleted(0, 0), WriteCompleted(0, AUX_WRITE))


def _p10_posts_chunk_and_aux(room: Any, actions: list[Any]) -> None:
    (w,) = of_type(actions, PostWrite)
    assert (w.dest_rank, w.chunk_id, w.src_pages, w.dst_pages) == (0, 0, (0, 1, 2, 3), DECODE_PAGES)
    (aux,) = of_type(actions, PostAuxWrite)
    assert (aux.dest_rank, aux.dst_slot) == (0, DECODE_AUX)
    assert room.inflight == {(0, 0), (0, AUX_WRITE)}
    assert CancelTimer("input") in actions and of_type(actions, SetTimer)[0].timer == "transfer"


def _p6_posts_every_held_chunk(room: Any, actions: list[Any]) -> None:
    writes = of_type(actions, PostWrite)
    assert [(w.chunk_id, w.dst_pages) for w in writes] == [(0, (10, 11)), (1, (12, 13))]
    assert len(of_type(actions, PostAuxWrite)) == 1 and not room.held
    assert {CancelTimer("bootstrap"), CancelTimer("hold")} <= set(actions)


def _p2_tells_the_recorded_rank_and_the_rejected_one(room: Any, actions: list[Any]) -> None:
    # decode rank 0 announced (recorded), rank 1's room_pages is rejected: both hold pages, neither
    # was written to, so both are told why and then drained
    assert room.dests.keys() == {0} and not room.inflight
    assert [r for r, _ in messages(actions, RoomFailed)] == [0, 1]
    assert sorted(messages(actions, Drained)) == [
        (0, Drained(room.room, room.rank)),
        (1, Drained(room.room, room.rank)),
    ]


def _p23_tells_the_announcer(room: Any, actions: list[Any]) -> None:
    # nothing was ever written to a decode rank that announces after the failure: drained at once
    sent = [(a.peer_rank, type(a.message)) for a in of_type(actions, SendMessage)]
    assert sent == [(0, RoomFailed), (0, Drained)], sent


def _p23_no_drained_while_a_write_to_it_is_in_flight(room: Any, actions: list[Any]) -> None:
    # a duplicated room_pages of a decode rank this room still writes to: told, but not released
    sent = [(a.peer_rank, type(a.message)) for a in of_type(actions, SendMessage)]
    assert sent == [(0, RoomFailed)] and room.inflight == {(0, 0)}, sent


PREFILL_CASES = [
    Case("P1", (A, A), "WaitingForInput", then=ignored),
    Case("P1", (*TO_SUCCESS, A), "Success", then=ignored),
    Case("P2", (announce([10, 99]),), "Failed", then=both(failed_with("outside"), rejects_announcer(0))),
    Case("P2", (announce(peer_kv_pages=0),), "Failed", then=both(failed_with("registered"), rejects_announcer(0))),
    Case("P2", (announce(required=2), announce([10, 99], dest=1, required=2)), "Failed",
         then=_p2_tells_the_recorded_rank_and_the_rejected_one),
    Case("P3", (announce(required=2),), "Bootstrapping.Waiting"),
    Case("P4", (A,), "WaitingForInput", then=lambda r, a: a == [CancelTimer("bootstrap"), SetTimer("input", 301.0)]),
    Case("P5", (ready([0, 1, 2], last=True), A), "Failed", then=both(failed_with("page count mismatch"), drained_now)),
    Case("P6", (CHUNK, ready([2, 3], last=True), A), "Transferring.Draining", then=_p6_posts_every_held_chunk),
    Case("P7", (CHUNK, A), "Transferring.Sending", then=lambda r, a: len(of_type(a, PostWrite)) == 1),
    Case("P8", (CHUNK,), "Bootstrapping.Holding", then=lambda r, a: a == [SetTimer("hold", 31.0)]),
    Case("P9", (A, ready([0, 1, 2, 3, 4])), "Failed", then=both(told_decode(RoomFailed), drained_now)),
    Case("P9", (A, ready([0, 1, 2], last=True)), "Failed", then=failed_with("page count mismatch")),
    Case("P9", (A, CHUNK, ready([2, 3, 4], last=True)), "Failed", then=not_drained_yet),
    Case("P10", TO_DRAINING, "Transferring.Draining", then=_p10_posts_chunk_and_aux),
    Case("P11", (A, CHUNK), "Transferring.Sending"),
    Case("P12", (Abort(), CHUNK), "Failed", then=ignored),
    Case("P13", (A, CHUNK, WriteCompleted(0, 5)), "Transferring.Sending", then=ignored),
    Case("P13", (A, CHUNK, WriteCompleted(1, 0)), "Transferring.Sending", then=ignored),
    Case("P14", TO_SUCCESS, "Success", then=lambda r, a: not r.inflight and a == [CancelTimer("transfer")]),
    Case("P15", (A, CHUNK, WriteCompleted(0, 0)), "Transferring.Sending"),
    Case("P15", (*TO_DRAINING, WriteCompleted(0, AUX_WRITE)), "Transferring.Draining"),
    Case("P16", (A, CHUNK, WriteFailed(0, 0, "nic")), "Failed", then=both(told_decode(RoomFailed), drained_now)),
    Case("P16", (*TO_DRAINING, WriteFailed(0, 0, "nic")), "Failed", then=not_drained_yet),  # aux write in flight
    Case("P28", (A, CHUNK, WriteFailed(0, 7, "foreign")), "Transferring.Sending", then=ignored),
    Case("P28b", (A, CHUNK, Abort(), WriteCompleted(0, 0)), "Failed", then=drained_now),
    Case("P28b", (*TO_DRAINING, Abort(), WriteCompleted(0, AUX_WRITE)), "Failed", then=not_drained_yet),
    Case("P28b", (*TO_DRAINING, Abort(), WriteCompleted(0, AUX_WRITE), WriteFailed(0, 0, "late")), "Failed",
         then=drained_now),
    Case("P17", (*TO_SUCCESS, WriteCompleted(0, 0)), "Success", then=ignored),
    Case("P17", (A, CHUNK, Abort(), WriteCompleted(0, 0), WriteFailed(0, 0, "late")), "Failed", then=ignored),
    Case("P17", (A, CHUNK, Abort(), WriteCompleted(1, 0)), "Failed", then=both(ignored, not_drained_yet)),
    Case("P18", (A, Abort("user")), "Failed", then=both(told_decode(AbortNotice), drained_now)),
    Case("P18", (A, CHUNK, Abort("user")), "Failed", then=both(told_decode(AbortNotice), not_drained_yet)),
    Case("P19", (*TO_SUCCESS, Abort()), "Success", then=ignored),
    Case("P19", (Abort(), Abort()), "Failed", then=ignored),
    Case("P20", (A, CHUNK, AbortReceived(0, "decode", "gone")), "Failed", then=failed_with("peer")),
    Case(
        "P20",
        (announce(required=2), announce(dest=1, required=2), AbortReceived(0, "decode", "gone")),
        "Failed",
        then=both(told_decode(RoomFailed), drained_now),
    ),
    Case("P20", (PeerLost(0, "link down"),), "Failed", then=failed_with("link down")),
    Case("P21", (*TO_SUCCESS, PeerLost(0, "late")), "Success", then=answers_drained),
    Case("P21", (*TO_SUCCESS, AbortReceived(0, "decode", "fence timer")), "Success", then=answers_drained),
    Case("P21", (Abort(), AbortReceived(0, "decode", "late")), "Failed",
         then=answers_the_unrecorded_aborter),
    Case("P21", (A, Abort(), AbortReceived(0, "decode", "late")), "Failed", then=answers_drained),
    Case("P21", (A, CHUNK, Abort(), AbortReceived(0, "decode", "late")), "Failed",
         then=both(ignored, not_drained_yet)),  # its write may still land: drained when it concludes (P28b)
    Case("P22", (*TO_SUCCESS, announce([1, 2, 3, 4], dest=1)), "Success", then=ignored),
    Case("P23", (Abort(), A), "Failed", then=_p23_tells_the_announcer),
    Case("P23", (A, CHUNK, Abort(), A), "Failed", then=_p23_no_drained_while_a_write_to_it_is_in_flight),
    Case("P24", (fired("bootstrap"),), "Failed", then=failed_with("timeout")),
    Case("P24", (CHUNK, fired("hold")), "Failed", then=failed_with("timeout")),
    Case("P25", (A, fired("input")), "Failed", then=both(told_decode(RoomFailed), drained_now)),
    Case("P26", (A, CHUNK, fired("transfer")), "Failed", then=both(told_decode(RoomFailed), not_drained_yet)),
    Case("P26", (*TO_DRAINING, fired("transfer")), "Failed", then=failed_with("timeout")),
    Case("P27", (*TO_SUCCESS, Clear()), "Cleared"),
    Case("P27", (fired("bootstrap"), Clear()), "Cleared"),
    Case("P27", (A, CHUNK, Abort(), WriteCompleted(0, 0), Clear()), "Cleared"),
]  # fmt: skip

# ---------------------------------------------------------------- decode scenarios

ANNOUNCED = (PeersReady(), allocated())
WHOLE = arrived(0, 0, 4, last=True)
TWO = {"sources": (0, 1)}  # a decode room with two prefill sources
FENCED = (*ANNOUNCED, Abort("user"))  # D22: pages announced, then the engine aborts


def _d2_announces_to_every_source(room: Any, actions: list[Any]) -> None:
    sent = messages(actions, RoomPages)
    assert [r for r, _ in sent] == [0, 1]
    assert all(m == RoomPages(room.room, room.rank, DECODE_PAGES, DECODE_AUX, 2, len(DECODE_PAGES)) for _, m in sent)
    assert CancelTimer("bootstrap") in actions and SetTimer("transfer", 2.0 + 300.0) in actions


def _undrained(*ranks: int) -> Callable[[Any, list[Any]], bool]:
    return lambda room, actions: room.undrained == set(ranks) and room.timers == {"fence"}


def not_fenced(room: Any, actions: list[Any]) -> None:
    """Decode: failed with nothing announced, so nothing can land: no fence, no timer left (D29)."""
    assert room.state == "Failed" and not room.undrained and not room.timers
    assert not of_type(actions, SetTimer)


def _timers(*names: str) -> Callable[[Any, list[Any]], bool]:
    return lambda room, actions: room.timers == set(names) and not of_type(actions, SetTimer | CancelTimer)


def _d26_records_one_confirmation(room: Any, actions: list[Any]) -> None:
    assert actions == [] and room.undrained == {0} and room.timers == {"fence"}


DECODE_CASES = [
    Case("D1", (PeersReady(),), "WaitingForInput.Allocating"),
    Case("D2", ANNOUNCED, "WaitingForInput.Announced", room={"sources": (0, 1), "required_dests": 2},
         then=_d2_announces_to_every_source),
    Case("D3", (Abort(), PeersReady()), "Failed", then=ignored),
    Case("D3", (PeersReady(), Abort(), allocated()), "Failed", then=ignored),
    Case("D3", (*FENCED, allocated()), "Fenced", then=ignored),
    Case("D4", (*ANNOUNCED, arrived(0, 0, 2), arrived(0, 0, 2)), "Transferring", then=ignored),
    Case("D4", (*ANNOUNCED, AuxArrived(0), WHOLE, WHOLE), "Success", then=ignored),
    Case("D5", (*ANNOUNCED, arrived(0, 0, 2, src=5)), "Fenced", then=fenced_with("prefill rank 5")),
    Case("D5", (*ANNOUNCED, arrived(1, 2, 2, last=True), arrived(2, 0, 1)), "Fenced",
         then=fenced_with("beyond the last chunk")),
    Case("D5", (*ANNOUNCED, arrived(0, 2, 3)), "Fenced", then=fenced_with("outside")),
    Case("D6", (*ANNOUNCED, AuxArrived(0), arrived(0, 0, 3, last=True)), "Fenced",
         then=fenced_with("page coverage mismatch")),
    Case("D7", (*ANNOUNCED, AuxArrived(0), WHOLE), "Success", then=lambda r, a: a == [CancelTimer("transfer")]),
    Case("D8", (*ANNOUNCED, arrived(0, 0, 2)), "Transferring"),
    Case("D9", (*ANNOUNCED, AuxArrived(0), AuxArrived(0)), "Transferring", then=ignored),
    Case("D9", (*ANNOUNCED, WHOLE, AuxArrived(0), AuxArrived(0)), "Success", then=ignored),
    Case("D10", (*ANNOUNCED, AuxArrived(7)), "Fenced", then=fenced_with("unexpected source")),
    Case("D11", (*ANNOUNCED, arrived(0, 0, 3, last=True), AuxArrived(0)), "Fenced",
         then=fenced_with("page coverage mismatch")),
    Case("D12", (*ANNOUNCED, WHOLE, AuxArrived(0)), "Success"),
    Case("D13", (*ANNOUNCED, AuxArrived(0)), "Transferring"),
    Case("D29", (arrived(0, 0, 2),), "Failed", then=both(failed_with("before pages were announced"), told_prefill,
                                                           not_fenced)),
    Case("D29", (PeersReady(), AuxArrived(1)), "Failed", room=TWO,
         then=both(failed_with("before pages were announced"), told_prefill, not_fenced)),
    Case("D29", (PeersReady(), arrived(0, 0, 4, last=True)), "Failed", then=not_fenced),
    Case("D30", (WritesDrained(0),), "Bootstrapping", then=both(ignored, _timers("bootstrap"))),
    Case("D30", (PeersReady(), WritesDrained(3)), "WaitingForInput.Allocating", then=ignored),
    Case("D30", (*ANNOUNCED, WritesDrained(0)), "WaitingForInput.Announced", then=both(ignored, _timers("transfer"))),
    Case("D30", (*ANNOUNCED, arrived(0, 0, 2), WritesDrained(0)), "Transferring",
         then=both(ignored, _timers("transfer"), lambda r, a: a == [of_type(a, RecordIgnored)[0]])),
    Case("D14", (Abort("user"),), "Failed", then=both(told_prefill, failed_with("user"))),
    Case("D14", (PeersReady(), Abort("user")), "Failed", room=TWO, then=both(told_prefill, failed_with("user"))),
    Case("D22", FENCED, "Fenced", room=TWO, then=fenced_with("user")),
    Case("D22", (*ANNOUNCED, arrived(0, 0, 2), Abort("user")), "Fenced", then=fenced_with("user")),
    Case("D15", (Abort(), Abort()), "Failed", then=ignored),
    Case("D15", (*ANNOUNCED, WHOLE, AuxArrived(0), Abort()), "Success", then=ignored),
    Case("D15", (*FENCED, Abort()), "Fenced", then=ignored),
    Case("D16", (FailureReceived(0, "prefill broke"),), "Failed", then=both(failed_with("prefill broke"), told_prefill)),
    Case("D16", (PeersReady(), AbortReceived(1, "prefill", "x")), "Failed", room=TWO, then=told_prefill),
    Case("D16", (PeersReady(), PeerLost(0, "crash")), "Failed", then=failed_with("crash")),
    Case("D23", (*ANNOUNCED, PeerLost(0, "crash")), "Failed", then=both(failed_with("crash"), told_prefill)),
    Case("D23", (*ANNOUNCED, arrived(0, 0, 2), PeerLost(0, "crash")), "Failed", then=failed_with("crash")),
    Case("D24", (*ANNOUNCED, AbortReceived(0, "prefill", "x")), "Fenced", then=fenced_with("x")),
    Case("D24", (*ANNOUNCED, arrived(0, 0, 2), FailureReceived(0, "broke")), "Fenced", then=fenced_with("broke")),
    Case("D24", (*ANNOUNCED, PeerLost(0, "crash")), "Fenced", room=TWO,
         then=both(_undrained(1), told_prefill)),  # the dead source cannot write; the other one may
    Case("D21", (*ANNOUNCED, FailureReceived(3, "not my source")), "WaitingForInput.Announced", then=ignored),
    Case("D21", (PeersReady(), PeerLost(9, "another link")), "WaitingForInput.Allocating", then=ignored),
    Case("D17", (Abort(), arrived(0, 0, 2)), "Failed", then=ignored),
    Case("D17", (*ANNOUNCED, WHOLE, AuxArrived(0), FailureReceived(0, "late")), "Success", then=ignored),
    Case("D17", (*FENCED, WritesDrained(0), WritesDrained(0)), "Failed", then=ignored),
    Case("D18", (fired("bootstrap"),), "Failed", then=failed_with("timeout")),
    Case("D18", (PeersReady(), fired("bootstrap")), "Failed", then=told_prefill),
    Case("D19", (*ANNOUNCED, fired("transfer")), "Fenced", then=fenced_with("timeout")),
    Case("D19", (*ANNOUNCED, arrived(0, 0, 2), fired("transfer")), "Fenced", room=TWO,
         then=fenced_with("transfer timer expired")),
    Case("D25", (*FENCED, WritesDrained(0)), "Failed", then=both(released, failed_with("user"))),
    Case("D25", (*FENCED, WritesDrained(1), PeerLost(0, "crash")), "Failed", room=TWO, then=released),
    Case("D26", (*FENCED, WritesDrained(1)), "Fenced", room=TWO, then=_d26_records_one_confirmation),
    Case("D26", (*FENCED, PeerLost(1, "crash")), "Fenced", room=TWO, then=_undrained(0)),
    Case("D27", (*FENCED, fired("fence")), "Failed", then=both(released, failed_with("user"))),
    Case("D27", (*FENCED, WritesDrained(1), fired("fence")), "Failed", room=TWO, then=released),
    Case("D28", (*FENCED, WritesDrained(3)), "Fenced", then=both(ignored, _undrained(0))),
    Case("D28", (*FENCED, WritesDrained(1), WritesDrained(1)), "Fenced", room=TWO, then=both(ignored, _undrained(0))),
    Case("D28", (*FENCED, WHOLE), "Fenced", then=ignored),  # a write that landed before the drain
    Case("D28", (*FENCED, AuxArrived(0)), "Fenced", then=ignored),
    Case("D28", (*FENCED, FailureReceived(0, "prefill failed too")), "Fenced", then=both(ignored, because("user"))),
    Case("D28", (*FENCED, PeerLost(5, "another link")), "Fenced", then=both(ignored, _undrained(0))),
    Case("D20", (Abort(), Clear()), "Cleared"),
    Case("D20", (*ANNOUNCED, WHOLE, AuxArrived(0), Clear()), "Cleared"),
    Case("D20", (*FENCED, WritesDrained(0), Clear()), "Cleared"),
]  # fmt: skip

CASES = [("prefill", c) for c in PREFILL_CASES] + [("decode", c) for c in DECODE_CASES]


def _id(case: tuple[str, Case]) -> str:
    kind, c = case
    return f"{c.row}-{c.state}-{'-'.join(type(e).__name__ for e in c.events[-2:])}"


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_cases_cover_exactly_the_spec_rows(kind):
    spec_rows = {r.id for r in machine_spec(kind).rows}
    covered = {c.row for k, c in CASES if k == kind}
    assert covered == spec_rows, f"missing: {sorted(spec_rows - covered)}, unknown: {sorted(covered - spec_rows)}"


@pytest.mark.parametrize("reference", [False, True], ids=["compiled", "transitions"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_row_fires(case, reference):
    kind, c = case
    room = new_room(kind, **c.room)
    *before, last = c.events
    run(kind, room, before, reference=reference)
    actions = checked_step(kind, room, last, float(len(before) + 1), reference=reference)
    assert room.last_row == c.row
    assert room.state == c.state
    assert room.state == (rows_by_id(kind)[c.row].dest or room.state)
    if c.then is not None:
        result = c.then(room, actions)
        assert result is None or result, f"{c.row}: the check of its actions failed: {actions}"


# ---------------------------------------------------------------- key actions, spelled out


def test_last_chunk_posts_a_write_and_the_aux_write_to_every_decode_rank():  # P10
    room = new_room("prefill")
    run(
        "prefill",
        room,
        [announce([1, 2, 3], dest=0, aux=4, required=2), announce([7, 8, 9], dest=3, aux=5, required=2)],
    )
    assert room.state == "WaitingForInput"
    actions = checked_step("prefill", room, ready([20, 21], last=False), 3.0)
    actions += checked_step("prefill", room, ready([22], last=True, aux=6), 4.0)
    assert room.last_row == "P10"
    writes = [(w.dest_rank, w.chunk_id, w.src_pages, w.dst_pages) for w in of_type(actions, PostWrite)]
    assert writes == [(0, 0, (20, 21), (1, 2)), (3, 0, (20, 21), (7, 8)), (0, 1, (22,), (3,)), (3, 1, (22,), (9,))]
    aux = [(w.dest_rank, w.src_slot, w.dst_slot) for w in of_type(actions, PostAuxWrite)]
    assert aux == [(0, 6, 4), (3, 6, 5)]
    notes = [w.notification for w in of_type(actions, PostWrite)]
    assert [(n.chunk_id, n.is_last, n.token_start, n.num_tokens) for n in notes] == [
        (0, False, 0, 2), (0, False, 0, 2), (1, True, 2, 1), (1, True, 2, 1)
    ]  # fmt: skip
    assert room.inflight == {(0, 0), (3, 0), (0, 1), (3, 1), (0, AUX_WRITE), (3, AUX_WRITE)}


def test_decode_sends_room_pages_to_every_source():  # D2
    room = new_room("decode", rank=2, sources=(4, 1, 6))
    run("decode", room, [PeersReady()])
    actions = checked_step("decode", room, allocated([5, 6], 3), 2.0)
    assert messages(actions, RoomPages) == [(src, RoomPages(room.room, 2, (5, 6), 3, 1, 2)) for src in (4, 1, 6)]
    assert (room.pages, room.aux_slot) == ((5, 6), 3)


def test_write_failure_sends_room_failed_to_every_decode_rank():  # P16
    room = new_room("prefill", rank=1)
    run("prefill", room, [announce(dest=0, required=2), announce([20, 21, 22, 23], dest=5, required=2), CHUNK])
    actions = checked_step("prefill", room, WriteFailed(5, 0, "RDMA error"), 4.0)
    sent = messages(actions, RoomFailed)
    assert [r for r, _ in sent] == [0, 5]
    assert all(m.prefill_rank == 1 and "RDMA error" in m.reason for _, m in sent)
    assert CancelTimer("transfer") in actions and not room.timers


def test_decode_transfer_timeout_sends_abort_notice_to_every_source():  # D19
    room = new_room("decode", sources=(0, 3))
    run("decode", room, [*ANNOUNCED, arrived(0, 0, 4, src=3, last=True)])
    actions = checked_step("decode", room, fired("transfer"), 500.0)
    sent = messages(actions, AbortNotice)
    assert [r for r, _ in sent] == [0, 3]
    assert all(m.side == "decode" and "timeout" in m.reason for _, m in sent)


def test_prefill_failure_after_an_invalid_announcement_tells_the_announcer():  # P2
    room = new_room("prefill")
    actions = checked_step("prefill", room, announce([3, KV_PAGES], dest=2), 1.0)
    assert room.last_row == "P2" and not room.dests
    assert [r for r, _ in messages(actions, RoomFailed)] == [2], "decode rank 2 would wait for its timeout"
    assert messages(actions, Drained) == [(2, Drained(room.room, 0))], "nothing was written: release at once"


def test_aux_slot_outside_the_peer_region_is_an_invalid_announcement():  # P2
    room = new_room("prefill")
    checked_step("prefill", room, announce(aux=AUX_SLOTS, peer_aux_slots=AUX_SLOTS), 1.0)
    assert room.last_row == "P2" and "aux slot" in room.failure


def test_decode_abort_with_pages_announced_fences_them_and_tells_every_source():  # D22
    room = new_room("decode", rank=2, sources=(4, 1, 6))
    run("decode", room, [*ANNOUNCED, arrived(0, 0, 2, src=1)])
    actions = checked_step("decode", room, Abort("client went away"), 10.0)
    assert room.last_row == "D22" and room.state == "Fenced"
    assert messages(actions, AbortNotice) == [
        (src, AbortNotice(room.room, 2, "decode", "aborted: abort: client went away")) for src in (4, 1, 6)
    ]
    assert CancelTimer("transfer") in actions and SetTimer("fence", 10.0 + 900.0) in actions
    assert room.timers == {"fence"} and room.undrained == {4, 1, 6}
    assert MACHINES["decode"].kvpoll(room) == KVPoll.Failed, "fenced is failed to the engine"
    with pytest.raises(LocalProtocolError, match="clear is not accepted in state Fenced"):
        MACHINES["decode"].step(room, Clear(), 11.0)


def test_decode_abort_before_announcing_frees_the_pages_at_once():  # D14
    room = new_room("decode", sources=(0, 1))
    run("decode", room, [PeersReady()])
    actions = checked_step("decode", room, Abort(), 2.0)
    assert (room.last_row, room.state, room.timers) == ("D14", "Failed", set())
    assert [r for r, _ in messages(actions, AbortNotice)] == [0, 1]
    checked_step("decode", room, Clear(), 3.0)


def test_decode_notice_from_one_source_before_announcing_tells_the_other_sources():  # D16
    room = new_room("decode", sources=(0, 1, 2))
    actions = checked_step("decode", room, FailureReceived(1, "prefill rank 1 broke"), 1.0)
    assert (room.last_row, room.state) == ("D16", "Failed")
    assert [r for r, _ in messages(actions, AbortNotice)] == [0, 1, 2]
    assert all("prefill rank 1 broke" in m.reason for _, m in messages(actions, AbortNotice))


def test_only_the_loss_of_every_writer_frees_announced_pages_without_a_fence():  # D23, D24
    alone = new_room("decode", sources=(3,))
    run("decode", alone, ANNOUNCED)
    checked_step("decode", alone, PeerLost(3, "rank 3 died"), 3.0)
    assert (alone.last_row, alone.state, alone.timers) == ("D23", "Failed", set())
    told = new_room("decode", sources=(3,))  # an abort or failure notice: the source lives, may still write
    run("decode", told, ANNOUNCED)
    checked_step("decode", told, AbortReceived(3, "prefill", "aborted"), 3.0)
    assert (told.last_row, told.state, told.undrained) == ("D24", "Fenced", {3})
    pair = new_room("decode", sources=(3, 5))
    run("decode", pair, ANNOUNCED)
    checked_step("decode", pair, PeerLost(3, "rank 3 died"), 3.0)
    assert (pair.last_row, pair.state, pair.undrained) == ("D24", "Fenced", {5})


def test_fence_is_released_when_the_last_source_confirms_and_its_timer_is_cancelled():  # D26, D25
    room = new_room("decode", sources=(0, 1, 2))
    run("decode", room, FENCED)
    assert room.undrained == {0, 1, 2}
    assert checked_step("decode", room, WritesDrained(2), 4.0) == [] and room.last_row == "D26"
    assert checked_step("decode", room, PeerLost(0, "crash"), 5.0) == [] and room.last_row == "D26"
    assert room.state == "Fenced" and room.undrained == {1}
    actions = checked_step("decode", room, WritesDrained(1), 6.0)
    assert room.last_row == "D25" and room.state == "Failed"
    assert actions == [CancelTimer("fence")] and not room.timers and not room.undrained
    checked_step("decode", room, Clear(), 7.0)
    assert room.state == "Cleared"


def test_fence_timer_releases_the_pages_without_confirmation():  # D27
    room = new_room("decode", sources=(0, 1))
    run("decode", room, FENCED)
    checked_step("decode", room, WritesDrained(0), 4.0)
    actions = checked_step("decode", room, fired("fence"), 903.0)
    assert (room.last_row, room.state, room.timers) == ("D27", "Failed", set())
    assert actions == [CancelTimer("fence")] and "aborted" in room.failure


def test_failure_with_nothing_in_flight_sends_drained_to_every_decode_rank_at_once():  # tell_drained
    room = new_room("prefill", rank=1)
    run("prefill", room, [announce(dest=3, required=2), announce([20, 21, 22, 23], dest=0, required=2)])
    actions = checked_step("prefill", room, Abort("user"), 3.0)
    assert room.last_row == "P18" and not room.inflight
    sent = [(a.peer_rank, a.message) for a in of_type(actions, SendMessage)]
    notice = AbortNotice(room.room, 1, "prefill", room.failure)
    assert sent == [(0, notice), (3, notice), (0, Drained(room.room, 1)), (3, Drained(room.room, 1))]


def test_drained_goes_to_every_decode_rank_exactly_when_the_last_pending_write_concludes():  # P28b
    room = new_room("prefill", rank=2)
    run("prefill", room, [announce(dest=0, required=2), announce([20, 21, 22, 23], dest=1, required=2)])
    run("prefill", room, [ready([0, 1]), ready([2, 3], last=True, aux=1)], t0=3.0)
    pending = sorted(room.inflight)
    assert pending == [(0, AUX_WRITE), (0, 0), (0, 1), (1, AUX_WRITE), (1, 0), (1, 1)]
    checked_step("prefill", room, WriteCompleted(1, 0), 5.0)  # one completes before the failure (P15)
    actions = checked_step("prefill", room, fired("transfer"), 65.0)
    assert room.last_row == "P26" and not messages(actions, Drained), "writes are still in flight"
    remaining = [w for w in pending if w != (1, 0)]
    for i, (dest, cid) in enumerate(remaining):
        done = WriteFailed(dest, cid, "cancelled") if i % 2 else WriteCompleted(dest, cid)
        actions = checked_step("prefill", room, done, 70.0 + i)
        assert room.last_row == "P28b" and room.state == "Failed"
        if i < len(remaining) - 1:
            assert actions == [] and room.inflight
        else:
            assert messages(actions, Drained) == [(0, Drained(room.room, 2)), (1, Drained(room.room, 2))]
    actions = checked_step("prefill", room, WriteCompleted(0, 0), 80.0)  # a duplicate: drained only once
    assert room.last_row == "P17" and not messages(actions, Drained)


def test_prefill_clear_waits_until_no_posted_write_reads_the_source_pages():  # P27's guard
    room = new_room("prefill")
    run("prefill", room, [A, CHUNK, Abort()])
    before = snapshot(room)
    with pytest.raises(LocalProtocolError, match="writes_outstanding"):
        MACHINES["prefill"].step(room, Clear(), 4.0)
    assert snapshot(room) == before
    checked_step("prefill", room, WriteCompleted(0, 0), 5.0)
    checked_step("prefill", room, Clear(), 6.0)
    assert room.state == "Cleared"
