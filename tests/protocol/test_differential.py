"""The compiled dispatch table (``step``) and the transitions machine (``step_reference``) agree.

Random event sequences, starting from a random reachable room, are applied to two copies of the
room, one through each interpreter. After every event both produce the same actions, the same
state, the same row and the same fields, or both raise the same LocalProtocolError.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_kit import ALL_TRIGGERS, KINDS, MACHINES, any_reachable, event_for, new_room, snapshot

from kvfsm.protocol import LocalProtocolError
from kvfsm.protocol.events import Clear


def _outcome(step, room, event, now):
    try:
        return "ok", step(room, event, now)
    except LocalProtocolError as e:
        return "raised", (type(e), str(e))


def _compare(kind, a, b, event, now):
    m = MACHINES[kind]
    got_a = _outcome(m.step, a, event, now)
    got_b = _outcome(m.step_reference, b, event, now)
    assert got_a == got_b, f"{event} in {a.state}: compiled {got_a} != transitions {got_b}"
    assert snapshot(a) == snapshot(b), f"{event}: rooms differ after the step"
    return got_a


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_compiled_table_and_transitions_machine_agree(data, kind):
    path = data.draw(any_reachable(kind), label="path")
    a, b = new_room(kind, **dict(path.kwargs)), new_room(kind, **dict(path.kwargs))
    assert snapshot(a) == snapshot(b)
    now = 0.0
    for event in path.events:
        now += 1.0
        assert _compare(kind, a, b, event, now)[0] == "ok"
    for _ in range(data.draw(st.integers(1, 12), label="n")):
        trigger = data.draw(st.sampled_from(ALL_TRIGGERS), label="trigger")
        event = data.draw(event_for(trigger, a), label="event")
        now += data.draw(st.floats(0.0, 50.0), label="dt")
        _compare(kind, a, b, event, now)


@pytest.mark.parametrize("kind", KINDS)
def test_both_interpreters_raise_the_same_error_for_local_misuse(kind):
    a, b = new_room(kind), new_room(kind)
    outcome, (cls, message) = _compare(kind, a, b, Clear(), 1.0)
    assert outcome == "raised" and cls is LocalProtocolError and "clear is not accepted" in message
