"""Every leaf state x every event its machine has rows for (h2's test_state_machines).

A room is driven into the state along a path the protocol allows (protocol_kit.reachable), then
one arbitrary event is applied. Whatever the pair, the step is either a valid transition of some
row whose source includes the state, or the on_remote_error row for a remote event, or a
LocalProtocolError for a local one that leaves the room untouched (protocol_kit.checked_step holds
the full list of invariants). A remote event never raises.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_kit import (
    ALL_TRIGGERS,
    CAUSE,
    FAILED,
    KINDS,
    MACHINES,
    announce,
    checked_step,
    event_for,
    kvpoll_of,
    machine_spec,
    new_room,
    reachable,
    ready,
    run,
    snapshot,
)

from kvfsm.protocol import LocalProtocolError, RecordProtocolError
from kvfsm.protocol.events import Clear

PAIRS = [
    (kind, state, trigger)
    for kind in KINDS
    for state in machine_spec(kind).states
    for trigger in machine_spec(kind).triggers
]
FOREIGN = [(kind, t) for kind in KINDS for t in ALL_TRIGGERS if t not in machine_spec(kind).triggers]
LOCAL = [t for t in ALL_TRIGGERS if CAUSE[t] == "local"]
REMOTE = [t for t in ALL_TRIGGERS if CAUSE[t] == "remote"]


def _apply(kind, room, event):
    """One checked step; returns the actions, or None for a LocalProtocolError."""
    try:
        return checked_step(kind, room, event, 1000.0)
    except LocalProtocolError:
        assert event.cause == "local"
        return None


def test_every_machine_has_rows_for_all_four_prefill_timers_and_the_three_decode_timers():
    assert {"bootstrap_timeout", "hold_timeout", "input_timeout", "transfer_timeout"} <= set(
        machine_spec("prefill").triggers
    )
    assert {"bootstrap_timeout", "transfer_timeout", "fence_timeout"} <= set(machine_spec("decode").triggers)


@pytest.mark.parametrize(("kind", "state", "trigger"), PAIRS, ids=["-".join(p) for p in PAIRS])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_any_event_in_any_state_is_a_row_a_protocol_error_or_a_local_error(data, kind, state, trigger):
    room = data.draw(reachable(kind, state), label="path").build()
    event = data.draw(event_for(trigger, room), label="event")
    actions = _apply(kind, room, event)
    if actions is None:  # LocalProtocolError: only for a (state, event) no row's guards accept
        assert CAUSE[trigger] == "local"


@pytest.mark.parametrize(("kind", "trigger"), FOREIGN, ids=["-".join(p) for p in FOREIGN])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_event_of_the_other_side_is_refused_in_every_state(data, kind, trigger):
    state = data.draw(st.sampled_from(list(machine_spec(kind).states)), label="state")
    room = data.draw(reachable(kind, state), label="path").build()
    event = data.draw(event_for(trigger, room), label="event")
    actions = _apply(kind, room, event)
    if CAUSE[trigger] == "local":
        assert actions is None, "a local event no row names must raise LocalProtocolError"
    else:
        assert room.last_row == "on_remote_error"
        assert room.state == (state if MACHINES[kind].is_terminal(state) else machine_spec(kind).error_dest)
        assert isinstance(actions[-1], RecordProtocolError)


FAILED_STATES = [(kind, s) for kind in KINDS for s in machine_spec(kind).states if kvpoll_of(kind, s) == FAILED]


def test_the_failed_states_are_failed_and_fenced():
    assert FAILED_STATES == [("prefill", "Failed"), ("decode", "Fenced"), ("decode", "Failed")]


@pytest.mark.parametrize(("kind", "state"), FAILED_STATES, ids=["-".join(p) for p in FAILED_STATES])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_failed_is_sticky(data, kind, state):
    # KVPoll Failed never shows another code before clear: Failed stays Failed, Fenced stays Fenced
    # or moves on to Failed. In Fenced only events its own runtime can deliver are drawn: a foreign
    # one is a protocol error there, which fences the room afresh with a new reason.
    room = data.draw(reachable(kind, state), label="path").build()
    failure = room.failure
    triggers = ALL_TRIGGERS if state == "Failed" else machine_spec(kind).triggers
    for _ in range(data.draw(st.integers(1, 4), label="n")):
        trigger = data.draw(st.sampled_from([t for t in triggers if t != "clear"]), label="trigger")
        before = room.state
        _apply(kind, room, data.draw(event_for(trigger, room), label="event"))
        assert room.state == "Failed" if before == "Failed" else room.state in ("Fenced", "Failed")
        assert MACHINES[kind].kvpoll(room) == FAILED
    assert room.failure == failure, "a failed room keeps its first reason"


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_clear_while_fenced_raises_and_changes_nothing(data):
    room = data.draw(reachable("decode", "Fenced"), label="path").build()
    before = snapshot(room)
    with pytest.raises(LocalProtocolError, match="clear is not accepted in state Fenced"):
        MACHINES["decode"].step(room, Clear(), 1.0)
    assert snapshot(room) == before
    assert room.undrained and room.timers == {"fence"}, "the pages stay fenced"


def test_every_remote_trigger_of_decode_is_accepted_while_fenced():
    # A peer's message while fenced (late notification, duplicate drained, another rank's news) is a
    # row, never a protocol error: that would fence the room afresh and forget the confirmations.
    m = MACHINES["decode"]
    for trigger in m.spec.triggers:
        if CAUSE[trigger] == "remote":
            assert m.accepts("Fenced", trigger), f"{trigger} while fenced would be a protocol error"
    assert not m.accepts("Fenced", "clear")


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_fence_is_released_only_when_every_writer_drained_or_died_or_its_timer_fired(data):
    room = data.draw(reachable("decode", "Fenced"), label="path").build()
    waiting = set(room.undrained)
    for _ in range(8):
        trigger = data.draw(st.sampled_from(["writes_drained", "peer_lost", "fence_timeout"]), label="trigger")
        event = data.draw(event_for(trigger, room), label="event")
        _apply("decode", room, event)
        if trigger == "fence_timeout":
            assert room.state == "Failed" and room.last_row == "D27"
            break
        waiting.discard(event.prefill_rank if trigger == "writes_drained" else event.peer_rank)
        assert room.state == ("Fenced" if waiting else "Failed"), (event, waiting)
        assert room.undrained == waiting
        if not waiting:
            assert room.last_row == "D25" and not room.timers
            break


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_success_never_becomes_failed(data, kind):
    room = data.draw(reachable(kind, "Success"), label="path").build()
    for _ in range(data.draw(st.integers(1, 4), label="n")):
        trigger = data.draw(st.sampled_from([t for t in ALL_TRIGGERS if t != "clear"]), label="trigger")
        _apply(kind, room, data.draw(event_for(trigger, room), label="event"))
        assert room.state == "Success"


@pytest.mark.parametrize("kind", KINDS)
def test_every_remote_trigger_of_a_machine_is_accepted_after_success(kind):
    # Late news after success (a duplicate, a late abort, a peer dying afterwards) must be a row,
    # not a protocol error that would fail a successful room.
    m = MACHINES[kind]
    for trigger in m.spec.triggers:
        if CAUSE[trigger] == "remote":
            assert m.accepts("Success", trigger), f"{kind}: {trigger} after Success would fail the room"


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_cleared_room_raises_for_every_local_event(data, kind):
    room = data.draw(reachable(kind, "Cleared"), label="path").build()
    trigger = data.draw(st.sampled_from(LOCAL), label="trigger")
    event = data.draw(event_for(trigger, room), label="event")
    before = snapshot(room)
    with pytest.raises(LocalProtocolError):
        MACHINES[kind].step(room, event, 1.0)
    assert snapshot(room) == before


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_remote_event_on_a_cleared_room_is_reported_and_changes_nothing(data, kind):
    # Cleared has no rows, so a remote event is a protocol error (machine.py); in a terminal state
    # it is only reported. The runtime forgets cleared rooms and should not deliver one at all.
    room = data.draw(reachable(kind, "Cleared"), label="path").build()
    trigger = data.draw(st.sampled_from(REMOTE), label="trigger")
    before = snapshot(room)
    actions = _apply(kind, room, data.draw(event_for(trigger, room), label="event"))
    assert room.last_row == "on_remote_error"
    assert [type(a) for a in actions] == [RecordProtocolError]
    assert snapshot(room) == before | {"last_row": "on_remote_error"}


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_local_protocol_error_leaves_the_room_unchanged(data, kind):
    state = data.draw(st.sampled_from(list(machine_spec(kind).states)), label="state")
    room = data.draw(reachable(kind, state), label="path").build()
    trigger = data.draw(st.sampled_from(LOCAL), label="trigger")
    event = data.draw(event_for(trigger, room), label="event")
    before = snapshot(room)
    try:
        MACHINES[kind].step(room, event, 1.0)
    except LocalProtocolError:
        assert snapshot(room) == before


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([announce(), ready([0, 1, 2, 3], last=True)], "chunk_ready is not accepted in state Transferring.Draining"),
        ([ready([0, 1], last=True)], "send\\(\\) after the last chunk"),  # held, decode not yet announced
    ],
    ids=["posted", "held"],
)
def test_chunk_after_the_last_chunk_raises_and_changes_nothing(events, message):
    room = new_room("prefill")
    run("prefill", room, events)
    before = snapshot(room)
    with pytest.raises(LocalProtocolError, match=message):
        MACHINES["prefill"].step(room, ready([4]), 3.0)
    assert snapshot(room) == before


def test_clear_before_a_terminal_state_is_misuse():
    room = new_room("decode")
    with pytest.raises(LocalProtocolError, match="clear is not accepted in state Bootstrapping"):
        MACHINES["decode"].step(room, Clear(), 1.0)
    assert room.state == "Bootstrapping"
