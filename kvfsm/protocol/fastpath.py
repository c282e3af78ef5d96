"""Fast rows: the rows taken once per chunk and once per write, applied directly.

Theory of operation
-------------------
A prefill room takes row P11 for every chunk but its last (post it, re-arm the transfer timer;
the first one also moves the room from WaitingForInput to Transferring.Sending), row P10 for its
last chunk (the same, with the aux writes, into Transferring.Draining), row P15 for every
completed write but its last (forget the write, re-arm the timer) and row P14 for its last (the
room succeeds); a decode room takes row D8 for every chunk notification but the one that
completes it (record the chunk, re-arm the timer). The generic step (``RoomMachine.step``)
builds a context, tests the rows of the (state, trigger) in order through the guard functions,
calls the action functions, which emit action objects, and the runtime then dispatches those
by type; for these rows that machinery costs more than the rows' own work (``bench/core.py``
``nixl_path`` and ``decode_path``: the CPU per chunk with and without this module).

``chunk``, ``completion`` and ``arrival`` apply those rows directly: the same tests (the guards'
own helpers), the same changes to the room (its state included: the caller tells the runtime
of a change as it does after a step), and they return only what the runtime must still carry
out. They are an optimisation of the spec, never a second definition of it:

* ``applies(machine)`` is true only if the machine's compiled rows for the (state, trigger)
  pairs involved (``EXPECTED``, per machine) are exactly the rows implemented here (row ids,
  guard and action functions by identity, action arguments, destinations). An edited spec or a
  mutant (``kvfsm.check.mutants``) turns the fast rows off and every event takes the generic
  step;
* each function returns None or False, the room untouched, wherever the generic step would take
  any other row (an invalid chunk, one that does not fit, an unknown write, a repeated, invalid
  or completing notification), and the caller then steps the event generically;
* ``tests/protocol/test_fastpath.py`` steps random events both ways and compares the rooms and
  the actions; ``tests/runtime/test_fast_rows.py`` plays seeded runs with the fast rows on and
  off and compares everything the runtime does.

Pure: no I/O, no clock (the caller sets the timer deadlines it is told to arm).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvfsm.protocol import functions as f
from kvfsm.protocol.actions import PostAuxWrite
from kvfsm.protocol.events import AUX_WRITE, ChunkArrived, ChunkReady
from kvfsm.protocol.machine import RoomMachine
from kvfsm.protocol.pages import Pages
from kvfsm.protocol.rooms import DecodeRoom, PrefillRoom
from kvfsm.protocol.wire import ChunkWritten

WAITING = "WaitingForInput"
SENDING = "Transferring.Sending"
DRAINING = "Transferring.Draining"
SUCCESS = "Success"
TIMER = "transfer"  # the timer every fast row arms
INPUT = "input"  # the timer P11 cancels

_Row = tuple[
    str, tuple[Callable[..., Any], ...], tuple[Callable[..., Any], ...], str | None, tuple[tuple[Any, str], ...]
]
_CHUNK: tuple[_Row, ...] = (
    ("P9", (f.chunk_ok,), (f.chunk_fits,), "Failed",
     ((f.fail, "page count mismatch"), (f.tell_decode, "failed"), (f.tell_drained, ""), (f.cancel_timers, ""))),
    ("P10", (f.chunk_ok, f.chunk_is_last), (), DRAINING, ((f.cancel, INPUT), (f.post_chunk, ""), (f.arm, TIMER))),
    ("P11", (f.chunk_ok,), (), SENDING, ((f.cancel, INPUT), (f.post_chunk, ""), (f.arm, TIMER))),
)  # fmt: skip
_UNKNOWN_WRITE: _Row = ("P13", (), (f.write_pending,), None, ((f.ignore, "completion of unknown write"),))
_PROGRESS: _Row = ("P15", (), (), None, ((f.complete_write, ""), (f.arm, TIMER)))
_FINAL: _Row = ("P14", (f.write_is_final,), (), SUCCESS, ((f.complete_write, ""), (f.cancel, TIMER)))
RECEIVING = "Transferring"  # a decode room's state while chunks arrive
_FENCE = ((f.tell_prefill, "aborted"), (f.cancel_timers, ""), (f.fence, ""), (f.arm, "fence"))
_ARRIVAL: tuple[_Row, ...] = (
    ("D4", (f.chunk_repeat,), (), None, ((f.ignore, "duplicate chunk notification"),)),
    ("D5", (), (f.chunk_valid,), "Fenced", ((f.fail, "invalid chunk notification"), *_FENCE)),
    ("D6", (f.completes_room,), (f.coverage_exact,), "Fenced",
     ((f.record_chunk, ""), (f.fail, "page coverage mismatch"), *_FENCE)),
    ("D7", (f.completes_room,), (), "Success", ((f.record_chunk, ""), (f.cancel, TIMER))),
    ("D8", (), (), RECEIVING, ((f.record_chunk, ""), (f.arm, TIMER))),
)  # fmt: skip
# per machine, the rows each (state, trigger) must have, in order, for the fast rows to stand in
EXPECTED: dict[str, dict[tuple[str, str], tuple[_Row, ...]]] = {
    "prefill_room": {
        (WAITING, "chunk_ready"): _CHUNK,
        (SENDING, "chunk_ready"): _CHUNK,
        (SENDING, "write_completed"): (_UNKNOWN_WRITE, _PROGRESS),
        (DRAINING, "write_completed"): (_UNKNOWN_WRITE, _FINAL, _PROGRESS),
    },
    "decode_room": {(RECEIVING, "chunk_arrived"): _ARRIVAL},
}


def applies(machine: RoomMachine) -> bool:
    """Do ``machine``'s compiled rows match the rows implemented here for it, exactly?"""
    expected = EXPECTED.get(machine.spec.name)
    if not expected:
        return False
    for key, want in expected.items():
        rows = machine.table.get(key)
        got = tuple((r.row_id, r.conditions, r.unless, r.dest, r.actions) for r in rows or ())
        if got != want:
            return False
    return True


# what P10 and P11 leave to the caller: chunk id, notification, per decode rank (rank,
# destination pages, contiguous), whether the input timer was armed, and (P10) the aux writes,
# one per decode rank in the same order (none for P11)
ChunkPosts = tuple[int, ChunkWritten, list[tuple[int, Pages, bool]], bool, Sequence[PostAuxWrite]]


def chunk(room: PrefillRoom, ev: ChunkReady) -> ChunkPosts | None:
    """Row P11, or P10 for the last chunk, for ``ev`` where the generic step takes it (a valid
    chunk that fits, in WaitingForInput or Transferring.Sending): the room updated as the row
    updates it (its state too: the caller tells the runtime of a change, as after a step), and
    what its actions leave to the caller: the chunk's writes as ``functions.advance`` gives them
    (chunk id, notification, per decode rank (rank, destination pages, contiguous): a PostWrite
    each, of ``ev.pages``), whether the input timer was armed (both rows cancel it) and, for the
    last chunk, the aux writes (``functions.aux_write``; each goes after its rank's PostWrite).
    The transfer timer is armed in ``room.timers``: the caller sets its deadline. None, the room
    untouched, where the generic step would take another row or none."""
    state = room.state
    if state != SENDING and state != WAITING:
        return None
    last = ev.is_last
    if f._chunk_problem(room, ev) or not f._fits(room.dests.values(), room.cursor + len(ev.pages), last):
        return None  # P9 (a chunk that does not fit) or no row (an invalid chunk): generic
    timers = room.timers
    cancelled = INPUT in timers
    if cancelled:
        timers.discard(INPUT)
    room.state = DRAINING if last else SENDING
    chunk_id, note, writes = f.advance(room, ev)
    timers.add(TIMER)
    room.last_row = "P10" if last else "P11"
    return chunk_id, note, writes, cancelled, [f.aux_write(room, ev, w[0]) for w in writes] if last else ()


# what run_chunk leaves to the caller: chunk id, decode rank, the first destination page, the
# chunk's first index into the announcement, whether the input timer was armed, and the decode
# rank's aux slot (the aux write's destination, with the last chunk)
RunPosts = tuple[int, int, int, int, bool, int]


def run_chunk(room: PrefillRoom, first: int, n: int, aux_slot: int | None = None) -> RunPosts | None:
    """Row P11 (``aux_slot`` None) or P10 (the last chunk, with its aux slot) for a chunk of the
    ``n`` pages ``first, first + 1, ...`` (the caller knows they are one ascending run of ints:
    ``chunk`` is given them as such), where ``chunk`` would take it and post exactly one write of
    one segment (and, with the last chunk, its one aux write): a room in WaitingForInput or
    Transferring.Sending with one decode rank, whose announced pages are one ascending run. The
    room updated exactly as ``chunk`` updates it (its state too: the caller tells the runtime of
    a change, as after a step); returns what ``RunPosts`` lists, from which the caller builds
    the write, its notification (``functions.advance``'s, for ``n`` pages) and, with the last
    chunk, the aux write (``functions.aux_write``'s). None, the room untouched, otherwise
    (``chunk`` or the generic step then takes the chunk)."""
    state = room.state
    if (state != SENDING and state != WAITING) or room.last_seen or n < 1 or first < 0 or first + n > room.kv_pages:
        return None
    dests = room.dests
    if len(dests) != 1:
        return None
    ((dest, ann),) = dests.items()
    start = room.cursor
    end = start + n
    if not ann.run:
        return None  # not one segment
    if aux_slot is None:
        if end > len(ann.pages):
            return None  # P9 (a chunk that does not fit)
    elif end != len(ann.pages) or not 0 <= aux_slot < room.aux_slots:
        return None  # P9, or an invalid chunk
    timers = room.timers
    cancelled = INPUT in timers
    if cancelled:
        timers.discard(INPUT)
    chunk_id = room.next_chunk
    inflight = room.inflight
    inflight.add((dest, chunk_id))
    if aux_slot is None:
        room.state = SENDING
        room.last_row = "P11"
    else:
        inflight.add((dest, AUX_WRITE))
        room.last_seen = True
        room.state = DRAINING
        room.last_row = "P10"
    room.cursor = end
    room.next_chunk = chunk_id + 1
    timers.add(TIMER)
    return chunk_id, dest, ann.pages[start], start, cancelled, ann.aux_slot


def completion(room: PrefillRoom, dest: int, chunk_id: int) -> bool:
    """Row P15 for WriteCompleted(dest, chunk_id) where the generic step takes it (a pending
    write, not the last of a draining room): the write forgotten and the transfer timer armed in
    ``room.timers`` (the caller sets its deadline); or row P14 for a draining room's last write:
    the write forgotten, the room in Success and the transfer timer disarmed in ``room.timers``
    (the caller tells the runtime of the change and cancels the timer). False, the room
    untouched, otherwise."""
    inflight = room.inflight
    key = (dest, chunk_id)
    if key not in inflight:
        return False  # P13 (an unknown or duplicate completion), or not Transferring
    state = room.state
    if state == SENDING or (state == DRAINING and len(inflight) > 1):
        inflight.discard(key)
        room.timers.add(TIMER)
        room.last_row = "P15"
        return True
    if state != DRAINING:
        return False  # another state
    room.state = SUCCESS  # P14: the last write of a draining room
    inflight.discard(key)
    room.timers.discard(TIMER)
    room.last_row = "P14"
    return True


def arrival(room: DecodeRoom, ev: ChunkArrived) -> bool:
    """Row D8 for ``ev`` where the generic step takes it (a valid, new chunk notification that
    does not complete the room, while Transferring): the chunk recorded and the transfer timer
    armed in ``room.timers`` (the caller sets its deadline). False, the room untouched,
    otherwise."""
    if room.state != RECEIVING or f._chunk_notice_problem(room, ev):
        return False  # D5, D4 (a chunk id received already is a problem too) or another state
    if f.completes_room(room, ev):
        return False  # D6 or D7: the room concludes
    f.record_chunk(room, ev, None, "")  # type: ignore[arg-type] # (it reads no context)
    room.timers.add(TIMER)
    room.last_row = "D8"
    return True
