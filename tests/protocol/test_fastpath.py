"""The fast rows (``kvfsm.protocol.fastpath``) change a room exactly as the generic step does.

Random event sequences from a random reachable prefill room: before each chunk and each write
completion, the fast row is tried on one copy of the room and the generic step on another. Where
the fast row applies, both rooms end equal and the generic step's actions are exactly what the
fast row left to the caller (the input timer's cancellation, the writes, the transfer timer);
where it does not, its copy is untouched. The rows must also be the spec's: a spec whose rows
for these (state, trigger) pairs differ turns the fast rows off.
"""

from __future__ import annotations

import dataclasses

import pytest
from fast_kit import (
    LEAN_STATES,
    D,
    M,
    check_arrival,
    check_chunk,
    check_completion,
    check_run_chunk,
    next_chunk,
    next_notification,
)
from hypothesis import event as label
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_kit import (
    ALL_TRIGGERS,
    AUX_SLOTS,
    KV_PAGES,
    MACHINES,
    SPEC,
    allocated,
    announce,
    any_reachable,
    arrived,
    event_for,
    new_room,
    ready,
    run,
)

from kvfsm.check.mutants import MUTANTS, mutated_protocol
from kvfsm.protocol import LocalProtocolError, Protocol, fastpath
from kvfsm.protocol.events import PeersReady, WriteCompleted
from kvfsm.protocol.spec import ProtocolSpec

# chunks and completions most of the time, anything else (aborts, timers, ...) now and then
_TRIGGERS = st.sampled_from(["chunk_ready"] * 7 + ["write_completed"] * 7 + ["any"] * 2).flatmap(
    lambda t: st.sampled_from(ALL_TRIGGERS) if t == "any" else st.just(t)
)
_PAGES = st.lists(st.integers(0, KV_PAGES - 1), unique=True, max_size=KV_PAGES)


@st.composite
def _announced(draw):
    """A room that 1-3 decode ranks announced (a run of pages, or any distinct pages, up to the
    whole region: long runs are sliced as PageRuns), no chunk handed over yet or a few."""
    dests = draw(st.lists(st.integers(0, 3), unique=True, min_size=1, max_size=3))
    n = draw(st.integers(1, KV_PAGES))
    room = new_room("prefill", required_dests=len(dests))
    for d in dests:
        first = draw(st.integers(0, KV_PAGES - n))
        pages = draw(st.just(tuple(range(first, first + n))) | st.permutations(range(KV_PAGES)).map(lambda p: p[:n]))
        M.step(room, announce(pages, dest=d, required=len(dests)), 1.0)
    return room


def _event(data, trigger, room):
    if trigger == "chunk_ready" and data.draw(st.integers(0, 7), label="fitting"):
        return data.draw(next_chunk(room), label="event")
    if (
        trigger == "write_completed"
        and getattr(room, "inflight", None)
        and data.draw(st.integers(0, 3), label="pending")
    ):
        return WriteCompleted(*data.draw(st.sampled_from(sorted(room.inflight)), label="event"))
    return data.draw(event_for(trigger, room), label="event")


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_fast_rows_change_a_room_as_the_generic_step_does(data):
    now = 0.0
    if data.draw(st.booleans(), label="announced"):
        room = data.draw(_announced(), label="room")
    else:
        path = data.draw(any_reachable("prefill"), label="path")
        room = new_room("prefill", **dict(path.kwargs))
        for event in path.events:
            now += 1.0
            M.step(room, event, now)
    for _ in range(data.draw(st.integers(1, 24), label="n")):
        trigger = data.draw(_TRIGGERS, label="trigger")
        event = _event(data, trigger, room)
        now += data.draw(st.floats(0.0, 50.0), label="dt")
        if trigger == "chunk_ready" and check_run_chunk(room, event, now):
            label(f"fast {'P10' if event.is_last else 'P11'} as one run (RunPosts)")
        if trigger == "chunk_ready" and check_chunk(room, event, now):
            label(f"fast {'P10' if event.is_last else 'P11'} from {room.state}")
        if trigger == "write_completed" and check_completion(room, event, now):
            label(f"fast {'P15' if room.state == fastpath.SENDING or len(room.inflight) > 1 else 'P14'}")
        try:
            M.step(room, event, now)
        except LocalProtocolError:
            pass  # misuse: the room is unchanged


def _sending_room(dests=(0,), pages_per_dest=8):
    """A room announced by ``dests`` and one chunk in: Transferring.Sending, its input timer gone."""
    room = new_room("prefill", required_dests=len(dests))
    for d in dests:
        M.step(room, announce(range(10 * d, 10 * d + pages_per_dest), dest=d, required=len(dests)), 1.0)
    M.step(room, ready([0, 1]), 2.0)
    assert room.state == fastpath.SENDING and fastpath.INPUT not in room.timers
    return room


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_chunk_of_one_run_changes_a_room_as_the_generic_step_does(data):
    """Rooms where the leanest path mostly applies (one decode rank, in WaitingForInput or
    Sending, chunks that are runs, the last one too), and now and then where it must not (pages
    announced out of order, several decode ranks, a chunk that does not fit, a last chunk that
    does not end the announcement or whose aux slot is not registered, a completion in
    between)."""
    dests = data.draw(st.sampled_from([(0,)] * 6 + [(1,), (0, 2)]), label="dests")
    n = data.draw(st.integers(2, KV_PAGES), label="announced")
    room = new_room("prefill", required_dests=len(dests))
    for d in dests:
        first = data.draw(st.integers(0, KV_PAGES - n), label="first")
        pages = tuple(range(first, first + n))
        if data.draw(st.integers(0, 5), label="scrambled") == 0:
            pages = pages[::-1]
        M.step(room, announce(pages, dest=d, required=len(dests)), 1.0)
    if data.draw(st.booleans(), label="first chunk in"):
        M.step(room, ready([0]), 2.0)
    applied = 0
    for _ in range(data.draw(st.integers(1, 12), label="chunks")):
        left = len(room.dests[dests[0]].pages) - room.cursor if room.state in LEAN_STATES else 1
        k = data.draw(st.integers(1, max(1, left + 1)), label="pages")
        first = data.draw(st.integers(-1, KV_PAGES - k + 1), label="from")
        pages = tuple(range(first, first + k))
        last = k == left or data.draw(st.integers(0, 9), label="last") == 0
        ev = ready(pages, last=last, aux=data.draw(st.sampled_from([0, 1, AUX_SLOTS]), label="aux"))
        applied += check_run_chunk(room, ev, 3.0)
        try:
            M.step(room, ev, 3.0)
        except LocalProtocolError:
            pass
        if room.inflight and data.draw(st.booleans(), label="complete"):
            M.step(room, WriteCompleted(*sorted(room.inflight)[0]), 4.0)
    label(f"the one-run shape applied {min(applied, 3)}+ times")


@pytest.mark.parametrize("dests", [(0,), (2, 0, 1)])
def test_a_steady_chunk_and_its_completion_take_the_fast_rows(dests):
    room = _sending_room(dests)
    assert check_chunk(room, ready([5, 6, 7]), 3.0)  # (one run here, not at decode rank 0: 12, 13, 14)
    M.step(room, ready([5, 6, 7]), 3.0)
    assert check_completion(room, WriteCompleted(dests[0], 0), 4.0)
    assert not check_completion(room, WriteCompleted(dests[0], 9), 4.0)  # no such write: P13
    assert not check_chunk(room, ready([3, 4, 8, 9]), 5.0)  # beyond decode's 8 pages: P9
    assert not check_chunk(room, ready([3, 3]), 5.0)  # an invalid chunk: no row
    assert not check_chunk(room, ready([3, 4], last=True), 5.0)  # the last chunk short of decode's 8: P9
    assert check_chunk(room, ready([2, 3, 4], last=True), 5.0)  # the last chunk: P10, with the aux writes


def test_the_first_chunk_leaves_waiting_for_input_by_the_fast_row():
    room = new_room("prefill")
    M.step(room, announce(range(8)), 1.0)
    assert room.state == fastpath.WAITING and fastpath.INPUT in room.timers
    assert check_chunk(room, ready([0, 1]), 2.0)  # P11: into Transferring.Sending, the input timer cancelled
    assert check_chunk(room, ready(range(8), last=True), 2.0)  # P10: the whole room as one chunk


def test_the_input_timer_is_cancelled_as_p11_does():
    room = _sending_room()
    room.timers.add(fastpath.INPUT)  # (as armed by a row that leaves it running)
    assert check_chunk(room, ready([2, 3]), 3.0)


def test_the_last_write_of_a_draining_room_takes_p14():
    room = _sending_room()
    M.step(room, ready(range(2, 8), last=True), 3.0)
    assert room.state == fastpath.DRAINING
    pending = sorted(room.inflight)
    for d, c in pending[:-1]:
        assert check_completion(room, WriteCompleted(d, c), 4.0)
        M.step(room, WriteCompleted(d, c), 4.0)
    assert check_completion(room, WriteCompleted(*pending[-1]), 5.0)  # P14: Success
    room.timers.discard(fastpath.TIMER)  # (no timer armed: none to cancel)
    assert check_completion(room, WriteCompleted(*pending[-1]), 5.0)
    M.step(room, WriteCompleted(*pending[-1]), 5.0)
    assert room.state == "Success"
    assert not check_completion(room, WriteCompleted(*pending[-1]), 6.0)  # a late repeat: P17


def _edited(row_id: str, machine: str = "prefill_room", **change) -> ProtocolSpec:
    ms = SPEC.machines[machine]
    rows = tuple(dataclasses.replace(r, **change) if r.id == row_id else r for r in ms.rows)
    return dataclasses.replace(SPEC, machines={**SPEC.machines, machine: dataclasses.replace(ms, rows=rows)})


def test_the_fast_rows_apply_to_the_shipped_spec_only():
    assert fastpath.applies(Protocol(SPEC).prefill) and fastpath.applies(Protocol(SPEC).decode)
    # P15 without re-arming the timer, or P11 posting nothing: not the rows implemented here
    assert not fastpath.applies(Protocol(_edited("P15", actions=("complete_write",))).prefill)
    assert not fastpath.applies(Protocol(_edited("P11", actions=("cancel:input", "arm:transfer"))).prefill)
    assert not fastpath.applies(Protocol(_edited("P10", guards=("chunk_ok",))).prefill)
    # D8 not re-arming the timer, or D7 taking a chunk that does not complete the room
    assert not fastpath.applies(Protocol(_edited("D8", "decode_room", actions=("record_chunk",))).decode)
    assert not fastpath.applies(Protocol(_edited("D7", "decode_room", guards=())).decode)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_mutant_that_rewrites_these_rows_turns_them_off(name):
    mutated = mutated_protocol(name)
    for kind, machine in (("prefill", mutated.prefill), ("decode", mutated.decode)):
        shipped = MACHINES[kind]
        same = all(machine.table.get(k) == shipped.table.get(k) for k in fastpath.ROWS[shipped.spec.name])
        assert fastpath.applies(machine) == same, (name, kind)


# ====================================================================== decode: row D8


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_fast_arrivals_change_a_room_as_the_generic_step_does(data):
    path = data.draw(any_reachable("decode"), label="path")
    room = new_room("decode", **dict(path.kwargs))
    now = 0.0
    for event in path.events:
        now += 1.0
        D.step(room, event, now)
    for _ in range(data.draw(st.integers(1, 24), label="n")):
        pick = data.draw(st.sampled_from(["next"] * 6 + ["chunk_arrived"] * 2 + ["any"]), label="pick")
        if pick == "next":
            trigger, event = "chunk_arrived", data.draw(next_notification(room), label="event")
        else:
            trigger = "chunk_arrived" if pick == "chunk_arrived" else data.draw(st.sampled_from(ALL_TRIGGERS))
            event = data.draw(event_for(trigger, room), label="event")
        now += data.draw(st.floats(0.0, 50.0), label="dt")
        if trigger == "chunk_arrived" and check_arrival(room, event, now):
            label("fast D8")
        try:
            D.step(room, event, now)
        except LocalProtocolError:
            pass


def test_a_steady_notification_takes_the_fast_row_and_the_completing_one_does_not():
    room = new_room("decode", sources=(0, 1))
    run("decode", room, [PeersReady(), allocated(range(10))])
    D.step(room, arrived(0, 0, 4, src=0), 1.0)
    assert room.state == fastpath.RECEIVING
    assert check_arrival(room, arrived(1, 4, 6, src=0, last=True), 2.0)  # source 0 done, source 1 not
    assert not check_arrival(room, arrived(0, 0, 4, src=0), 2.0)  # a duplicate: D4
    assert not check_arrival(room, arrived(1, 4, 9, src=1), 2.0)  # pages outside: D5
