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
)

from kvfsm.protocol import (
    AUX_WRITE,
    CancelTimer,
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
)
from kvfsm.protocol.wire import AbortNotice, RoomFailed, RoomPages


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


def _p23_tells_the_announcer(room: Any, actions: list[Any]) -> None:
    assert [r for r, _ in messages(actions, RoomFailed)] == [0]


PREFILL_CASES = [
    Case("P1", (A, A), "WaitingForInput", then=ignored),
    Case("P1", (*TO_SUCCESS, A), "Success", then=ignored),
    Case("P2", (announce([10, 99]),), "Failed", then=failed_with("outside")),
    Case("P2", (announce(peer_kv_pages=0),), "Failed", then=failed_with("registered")),
    Case("P3", (announce(required=2),), "Bootstrapping.Waiting"),
    Case("P4", (A,), "WaitingForInput", then=lambda r, a: a == [CancelTimer("bootstrap"), SetTimer("input", 301.0)]),
    Case("P5", (ready([0, 1, 2], last=True), A), "Failed", then=failed_with("page count mismatch")),
    Case("P6", (CHUNK, ready([2, 3], last=True), A), "Transferring.Draining", then=_p6_posts_every_held_chunk),
    Case("P7", (CHUNK, A), "Transferring.Sending", then=lambda r, a: len(of_type(a, PostWrite)) == 1),
    Case("P8", (CHUNK,), "Bootstrapping.Holding", then=lambda r, a: a == [SetTimer("hold", 31.0)]),
    Case("P9", (A, ready([0, 1, 2, 3, 4])), "Failed", then=told_decode(RoomFailed)),
    Case("P9", (A, ready([0, 1, 2], last=True)), "Failed", then=failed_with("page count mismatch")),
    Case("P10", TO_DRAINING, "Transferring.Draining", then=_p10_posts_chunk_and_aux),
    Case("P11", (A, CHUNK), "Transferring.Sending"),
    Case("P12", (Abort(), CHUNK), "Failed", then=ignored),
    Case("P13", (A, CHUNK, WriteCompleted(0, 5)), "Transferring.Sending", then=ignored),
    Case("P13", (A, CHUNK, WriteCompleted(1, 0)), "Transferring.Sending", then=ignored),
    Case("P14", TO_SUCCESS, "Success", then=lambda r, a: not r.inflight and a == [CancelTimer("transfer")]),
    Case("P15", (A, CHUNK, WriteCompleted(0, 0)), "Transferring.Sending"),
    Case("P15", (*TO_DRAINING, WriteCompleted(0, AUX_WRITE)), "Transferring.Draining"),
    Case("P16", (A, CHUNK, WriteFailed(0, 0, "nic")), "Failed", then=told_decode(RoomFailed)),
    Case("P28", (A, CHUNK, WriteFailed(0, 7, "foreign")), "Transferring.Sending", then=ignored),
    Case("P17", (*TO_SUCCESS, WriteCompleted(0, 0)), "Success", then=ignored),
    Case("P17", (A, CHUNK, Abort(), WriteFailed(0, 0, "late")), "Failed", then=ignored),
    Case("P18", (A, Abort("user")), "Failed", then=told_decode(AbortNotice)),
    Case("P19", (*TO_SUCCESS, Abort()), "Success", then=ignored),
    Case("P19", (Abort(), Abort()), "Failed", then=ignored),
    Case("P20", (A, CHUNK, AbortReceived(0, "decode", "gone")), "Failed", then=failed_with("peer")),
    Case(
        "P20",
        (announce(required=2), announce(dest=1, required=2), AbortReceived(0, "decode", "gone")),
        "Failed",
        then=told_decode(RoomFailed),
    ),
    Case("P20", (PeerLost(0, "link down"),), "Failed", then=failed_with("link down")),
    Case("P21", (*TO_SUCCESS, PeerLost(0, "late")), "Success", then=ignored),
    Case("P21", (Abort(), AbortReceived(0, "decode", "late")), "Failed", then=ignored),
    Case("P22", (*TO_SUCCESS, announce([1, 2, 3, 4], dest=1)), "Success", then=ignored),
    Case("P23", (Abort(), A), "Failed", then=_p23_tells_the_announcer),
    Case("P24", (fired("bootstrap"),), "Failed", then=failed_with("timeout")),
    Case("P24", (CHUNK, fired("hold")), "Failed", then=failed_with("timeout")),
    Case("P25", (A, fired("input")), "Failed", then=told_decode(RoomFailed)),
    Case("P26", (A, CHUNK, fired("transfer")), "Failed", then=told_decode(RoomFailed)),
    Case("P26", (*TO_DRAINING, fired("transfer")), "Failed", then=failed_with("timeout")),
    Case("P27", (*TO_SUCCESS, Clear()), "Cleared"),
    Case("P27", (fired("bootstrap"), Clear()), "Cleared"),
]

# ---------------------------------------------------------------- decode scenarios

ANNOUNCED = (PeersReady(), allocated())
WHOLE = arrived(0, 0, 4, last=True)


def _d2_announces_to_every_source(room: Any, actions: list[Any]) -> None:
    sent = messages(actions, RoomPages)
    assert [r for r, _ in sent] == [0, 1]
    assert all(m == RoomPages(room.room, room.rank, DECODE_PAGES, DECODE_AUX, 2) for _, m in sent)
    assert CancelTimer("bootstrap") in actions and SetTimer("transfer", 2.0 + 300.0) in actions


DECODE_CASES = [
    Case("D1", (PeersReady(),), "WaitingForInput.Allocating"),
    Case("D2", ANNOUNCED, "WaitingForInput.Announced", room={"sources": (0, 1), "required_dests": 2},
         then=_d2_announces_to_every_source),
    Case("D3", (Abort(), PeersReady()), "Failed", then=ignored),
    Case("D3", (PeersReady(), Abort(), allocated()), "Failed", then=ignored),
    Case("D4", (*ANNOUNCED, arrived(0, 0, 2), arrived(0, 0, 2)), "Transferring", then=ignored),
    Case("D4", (*ANNOUNCED, AuxArrived(0), WHOLE, WHOLE), "Success", then=ignored),
    Case("D5", (*ANNOUNCED, arrived(0, 0, 2, src=5)), "Failed", then=told_prefill),
    Case("D5", (*ANNOUNCED, arrived(1, 2, 2, last=True), arrived(2, 0, 1)), "Failed",
         then=failed_with("beyond the last chunk")),
    Case("D5", (*ANNOUNCED, arrived(0, 2, 3)), "Failed", then=failed_with("outside")),
    Case("D6", (*ANNOUNCED, AuxArrived(0), arrived(0, 0, 3, last=True)), "Failed",
         then=failed_with("page coverage mismatch")),
    Case("D7", (*ANNOUNCED, AuxArrived(0), WHOLE), "Success", then=lambda r, a: a == [CancelTimer("transfer")]),
    Case("D8", (*ANNOUNCED, arrived(0, 0, 2)), "Transferring"),
    Case("D9", (*ANNOUNCED, AuxArrived(0), AuxArrived(0)), "Transferring", then=ignored),
    Case("D9", (*ANNOUNCED, WHOLE, AuxArrived(0), AuxArrived(0)), "Success", then=ignored),
    Case("D10", (*ANNOUNCED, AuxArrived(7)), "Failed", then=failed_with("unexpected source")),
    Case("D11", (*ANNOUNCED, arrived(0, 0, 3, last=True), AuxArrived(0)), "Failed",
         then=failed_with("page coverage mismatch")),
    Case("D12", (*ANNOUNCED, WHOLE, AuxArrived(0)), "Success"),
    Case("D13", (*ANNOUNCED, AuxArrived(0)), "Transferring"),
    Case("D14", (Abort("user"),), "Failed", then=told_prefill),
    Case("D15", (Abort(), Abort()), "Failed", then=ignored),
    Case("D15", (*ANNOUNCED, WHOLE, AuxArrived(0), Abort()), "Success", then=ignored),
    Case("D16", (FailureReceived(0, "prefill broke"),), "Failed", then=failed_with("prefill broke")),
    Case("D16", (*ANNOUNCED, AbortReceived(0, "prefill", "x")), "Failed", then=lambda r, a: not messages(a, AbortNotice)),
    Case("D16", (PeersReady(), PeerLost(0, "crash")), "Failed", then=failed_with("crash")),
    Case("D21", (*ANNOUNCED, FailureReceived(3, "not my source")), "WaitingForInput.Announced", then=ignored),
    Case("D21", (PeersReady(), PeerLost(9, "another link")), "WaitingForInput.Allocating", then=ignored),
    Case("D17", (Abort(), arrived(0, 0, 2)), "Failed", then=ignored),
    Case("D17", (*ANNOUNCED, WHOLE, AuxArrived(0), FailureReceived(0, "late")), "Success", then=ignored),
    Case("D18", (fired("bootstrap"),), "Failed", then=failed_with("timeout")),
    Case("D18", (PeersReady(), fired("bootstrap")), "Failed", then=told_prefill),
    Case("D19", (*ANNOUNCED, fired("transfer")), "Failed", then=told_prefill),
    Case("D19", (*ANNOUNCED, arrived(0, 0, 2), fired("transfer")), "Failed", then=failed_with("timeout")),
    Case("D20", (Abort(), Clear()), "Cleared"),
    Case("D20", (*ANNOUNCED, WHOLE, AuxArrived(0), Clear()), "Cleared"),
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
    assert [(n.chunk_id, n.is_last, n.page_start, n.num_pages) for n in notes] == [
        (0, False, 0, 2), (0, False, 0, 2), (1, True, 2, 1), (1, True, 2, 1)
    ]  # fmt: skip
    assert room.inflight == {(0, 0), (3, 0), (0, 1), (3, 1), (0, AUX_WRITE), (3, AUX_WRITE)}


def test_decode_sends_room_pages_to_every_source():  # D2
    room = new_room("decode", rank=2, sources=(4, 1, 6))
    run("decode", room, [PeersReady()])
    actions = checked_step("decode", room, allocated([5, 6], 3), 2.0)
    assert messages(actions, RoomPages) == [(src, RoomPages(room.room, 2, (5, 6), 3, 1)) for src in (4, 1, 6)]
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


def test_aux_slot_outside_the_peer_region_is_an_invalid_announcement():  # P2
    room = new_room("prefill")
    checked_step("prefill", room, announce(aux=AUX_SLOTS, peer_aux_slots=AUX_SLOTS), 1.0)
    assert room.last_row == "P2" and "aux slot" in room.failure
