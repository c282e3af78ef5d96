"""The proof that the fast rows are the spec's rows: every (state, event) pair.

Every leaf state of each machine x every event type a fast row takes (prefill: ``chunk_ready``
through ``fastpath.chunk`` (its pages a tuple, and a PageRun as the runtime hands a run over),
``write_completed`` through
``fastpath.completion``; decode: ``chunk_arrived`` through ``fastpath.arrival``). A room is
driven into the state along a path the protocol allows (``protocol_kit.reachable``), an event is
drawn to take each branch of the rows' guards (a chunk that is valid or not, fits or not, last or
not, one run of pages or scattered; a write pending or unknown, the last of a draining room or
not; a notification new, repeated, invalid, completing the room or not), and the fast row is
tried on one copy of the room and the generic step on another (``fast_kit``): where the fast row
applies, the rooms end equal and the generic step's actions are what the fast row returned;
where it refuses, its copy is untouched. Each pair also asserts which outcomes it saw, so that a
pair where a fast row can apply really took it, and really saw the generic step take the rows
the fast row refuses.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
from fast_kit import check_arrival, check_chunk, check_completion, check_run_chunk, next_chunk, next_notification
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_kit import KV_PAGES, MACHINES, announce, event_for, machine_spec, new_room, reachable, ready

from kvfsm.protocol import LocalProtocolError, fastpath
from kvfsm.protocol.events import WriteCompleted

# the fast rows' event types, per machine kind
TRIGGERS = {"prefill": ("chunk_ready", "write_completed"), "decode": ("chunk_arrived",)}
PAIRS = [(kind, state, t) for kind, ts in TRIGGERS.items() for state in machine_spec(kind).states for t in ts]

# where a fast row may apply: what each pair must have seen (fast row taken, generic row taken
# where the fast row refused; "error": no row, LocalProtocolError)
EXPECTED = {
    ("prefill", fastpath.WAITING, "chunk_ready"): {"P10", "P11", "run P10", "run P11", "generic P9", "generic error"},
    ("prefill", fastpath.SENDING, "chunk_ready"): {"P10", "P11", "run P10", "run P11", "generic P9", "generic error"},
    ("prefill", fastpath.SENDING, "write_completed"): {"P15", "generic P13"},
    ("prefill", fastpath.DRAINING, "write_completed"): {"P14", "P15", "generic P13"},
    ("decode", fastpath.RECEIVING, "chunk_arrived"): {"D8", "generic D4", "generic D5", "generic D7"},
}


@st.composite
def _announced_as_runs(draw, state):
    """A prefill room in ``state`` (WaitingForInput, Sending or Draining) whose decode ranks
    announced ascending runs of pages, mostly one rank: where the one-run shape applies (the random
    pages of ``reachable`` are seldom a run)."""
    m = MACHINES["prefill"]
    dests = draw(st.sampled_from([(0,), (0,), (1,), (0, 2)]))
    n = draw(st.integers(2, 12))
    room = new_room("prefill", required_dests=len(dests))
    for d in dests:
        first = draw(st.integers(0, KV_PAGES - n))
        m.step(room, announce(range(first, first + n), dest=d, required=len(dests)), 1.0)
    if state == fastpath.SENDING:
        m.step(room, ready(range(draw(st.integers(1, n - 1)))), 1.0)
    elif state == fastpath.DRAINING:
        m.step(room, ready(range(n), last=True), 1.0)
        for write in sorted(room.inflight)[: draw(st.integers(0, len(room.inflight) - 1))]:
            m.step(room, WriteCompleted(*write), 1.0)
    assert room.state == state, room.state
    return room


def _room(data, kind, state):
    if kind == "prefill" and state in (fastpath.WAITING, fastpath.SENDING, fastpath.DRAINING):
        if data.draw(st.booleans(), label="runs"):
            return data.draw(_announced_as_runs(state), label="room")
    return data.draw(reachable(kind, state), label="path").build()


@st.composite
def _event(draw, kind, trigger, room):
    """An event of ``trigger`` for ``room``: mostly one that continues what the room holds (a
    chunk that fits, a pending write, the next notification), else an arbitrary one, or a
    repeat, or (chunks) one made invalid."""
    pick = draw(st.sampled_from(["continue"] * 5 + ["arbitrary"] * 2 + ["odd"]))
    if trigger == "chunk_ready":
        if pick == "continue":
            return draw(next_chunk(room))
        if pick == "odd":  # a page twice, or aux_slot on a chunk that is not the last
            ev = draw(next_chunk(room))
            return (
                ready([*ev.pages, *ev.pages[:1]] or [0, 0], last=ev.is_last)
                if draw(st.booleans())
                else (type(ev)(ev.pages, False, 0))
            )
    if trigger == "write_completed" and room.inflight and pick != "arbitrary":
        return WriteCompleted(*draw(st.sampled_from(sorted(room.inflight))))
    if trigger == "chunk_arrived":
        if pick == "continue":
            return draw(next_notification(room))
        received = [(src, cid, got) for src, chunks in room.received.items() for cid, got in chunks.items()]
        if pick == "odd" and received:  # a repeated notification, same contents or not
            src, cid, (start, n, last) = draw(st.sampled_from(received))
            return type(draw(next_notification(room)))(src, cid, last, start, n + draw(st.integers(0, 1)))
    return draw(event_for(trigger, room))


def _generic_row(kind, room, event) -> str:
    scratch = copy.deepcopy(room)
    try:
        MACHINES[kind].step(scratch, event, 1.0)
    except LocalProtocolError:
        return "generic error"
    return f"generic {scratch.last_row}"


def _prove(kind, room, event, now: float) -> list[str]:
    """Fast row against generic step for one (room, event); the outcomes seen."""
    if event.trigger == "chunk_ready":
        seen = ["run P10" if event.is_last else "run P11"] if check_run_chunk(room, event, now) else []
        row = check_chunk(room, event, now)  # (the event's pages a tuple: the general shape)
        if row is not None:
            return [*seen, row]
        assert not seen, f"{event} in {room.state}: taken as one run, not as a tuple of pages"
        return [_generic_row(kind, room, event)]
    if event.trigger == "write_completed":
        final = room.state == fastpath.DRAINING and len(room.inflight) == 1
        if check_completion(room, event, now):
            return ["P14" if final else "P15"]
        return [_generic_row(kind, room, event)]
    if check_arrival(room, event, now):
        return ["D8"]
    return [_generic_row(kind, room, event)]


@pytest.mark.parametrize(("kind", "state", "trigger"), PAIRS, ids=["-".join(p) for p in PAIRS])
def test_the_fast_row_equals_the_generic_step(kind, state, trigger):
    seen: Counter[str] = Counter()
    want = EXPECTED.get((kind, state, trigger), set())

    @settings(max_examples=150 if want else 25, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(data=st.data())
    def prove(data):
        room = _room(data, kind, state)
        for _ in range(data.draw(st.integers(1, 3), label="events")):
            event = data.draw(_event(kind, trigger, room), label="event")
            seen.update(_prove(kind, room, event, 2.0))
            try:
                MACHINES[kind].step(room, event, 2.0)  # the next event meets the room it leaves
            except LocalProtocolError:
                pass
            if room.state != state:
                break

    prove()
    fast = {o for o in seen if not o.startswith("generic")}
    if not want:
        assert not fast, f"a fast row applied in {state}: {fast}"
    else:
        assert want <= set(seen), f"outcomes never seen in {state} x {trigger}: {sorted(want - set(seen))}"
