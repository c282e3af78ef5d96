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

``chunk``, ``completion`` and ``arrival`` apply those rows directly: the same
tests (the spec's guard functions), the same changes to the room (its state included: the
caller tells the runtime of a change as it does after a step), and they return only what the
runtime must still carry out. They are an optimisation of the spec's rows, proven equal to the
generic step, never a second definition of them:

* ``ROWS`` names, per machine, the (state, trigger) pairs whose rows these functions stand in
  for and those rows' ids. ``applies(machine)`` is true only if the machine's compiled rows for
  those pairs are exactly the shipped spec's, as ``compile_rows`` compiles them (row ids, guard
  and action functions by identity, arguments, destinations), with the ids named here. Another
  spec, an edited row or a checker mutant (``kvfsm.check.mutants``) turns the fast rows off and
  every event takes the generic step;
* each function returns None or False, the room untouched, wherever the generic step would take
  any other row (an invalid chunk, one that does not fit, an unknown write, a repeated, invalid
  or completing notification), and the caller then steps the event generically;
* the proof that they equal the shipped rows is ``tests/protocol/test_fast_rows_all_pairs.py``:
  every state of each machine x every event type these functions take, with rooms and events
  drawn to take every branch of the rows' guards, fast row against generic step (rooms,
  actions, returned posts). ``tests/protocol/test_fastpath.py`` adds random event sequences and
  ``tests/runtime/test_fast_rows.py`` seeded runs of the runtime with the fast rows on and off.

Pure: no I/O, no clock (the caller sets the timer deadlines it is told to arm).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from kvfsm.protocol import functions as f
from kvfsm.protocol.actions import PostAuxWrite
from kvfsm.protocol.events import AUX_WRITE, ChunkArrived, ChunkReady
from kvfsm.protocol.machine import CompiledRow, RoomMachine, compile_rows
from kvfsm.protocol.pages import PageRun, Pages
from kvfsm.protocol.rooms import DecodeRoom, PrefillRoom
from kvfsm.protocol.spec import load_spec
from kvfsm.protocol.wire import ChunkWritten

WAITING = "WaitingForInput"
SENDING = "Transferring.Sending"
DRAINING = "Transferring.Draining"
SUCCESS = "Success"
TIMER = "transfer"  # the timer every fast row arms
INPUT = "input"  # the timer P11 cancels

RECEIVING = "Transferring"  # a decode room's state while chunks arrive

# per machine, the (state, trigger) pairs the fast rows stand in for, and the ids of their rows
# in spec order (the fast rows take P10, P11, P14, P15 and D8; the others they refuse)
ROWS: dict[str, dict[tuple[str, str], tuple[str, ...]]] = {
    "prefill_room": {
        (WAITING, "chunk_ready"): ("P9", "P10", "P11"),
        (SENDING, "chunk_ready"): ("P9", "P10", "P11"),
        (SENDING, "write_completed"): ("P13", "P15"),
        (DRAINING, "write_completed"): ("P13", "P14", "P15"),
    },
    "decode_room": {(RECEIVING, "chunk_arrived"): ("D4", "D5", "D6", "D7", "D8")},
}


@functools.cache
def shipped_rows(name: str) -> dict[tuple[str, str], tuple[CompiledRow, ...]]:
    """The shipped spec's compiled rows for the pairs of ``ROWS[name]``: the rows the fast rows
    are proven equal to."""
    table = compile_rows(load_spec().machines[name])
    return {key: table.get(key, ()) for key in ROWS[name]}


def applies(machine: RoomMachine) -> bool:
    """Are ``machine``'s compiled rows for the fast rows' pairs exactly the shipped spec's, with
    the row ids of ``ROWS``?"""
    name = machine.spec.name
    if name not in ROWS:
        return False
    shipped = shipped_rows(name)
    for key, ids in ROWS[name].items():
        rows = machine.table.get(key, ())
        if rows != shipped[key] or tuple(r.row_id for r in rows) != ids:
            return False
    return True


# What P10 and P11 leave to the caller, in one of two shapes. ChunkPosts (five items): chunk
# id, notification, per decode rank (rank, destination pages, contiguous), whether the input
# timer was armed, and (P10) the aux writes, one per decode rank in the same order (none for
# P11). RunPosts (eight items), where the chunk is one write of one run of pages to one decode
# rank: chunk id, decode rank, the chunk's first page and length, the first destination page,
# the chunk's first index into the announcement, whether the input timer was armed, and the
# decode rank's aux slot (the aux write's destination, with the last chunk); the caller builds
# the write and its notification from these fields, as ``functions.advance`` and
# ``functions.aux_write`` would build them.
ChunkPosts = tuple[int, ChunkWritten, list[tuple[int, Pages, bool]], bool, Sequence[PostAuxWrite]]
RunPosts = tuple[int, int, int, int, int, int, bool, int]


def chunk(room: PrefillRoom, pages: Pages, is_last: bool, aux_slot: int | None) -> ChunkPosts | RunPosts | None:
    """Row P11, or P10 for the last chunk, for the chunk ``ChunkReady(pages, is_last,
    aux_slot)`` (``ev`` below) where the generic step takes it (a valid
    chunk that fits, in WaitingForInput or Transferring.Sending): the room updated as the row
    updates it (its state too: the caller tells the runtime of a change, as after a step), and
    what its actions leave to the caller. For a chunk whose pages are a ``PageRun`` (the form
    the runtime gives every ascending run an engine hands over) going as one write of one run
    to one decode rank, a ``RunPosts`` (eight items: no notification, page list or aux write
    object is built); otherwise a ``ChunkPosts``: the chunk's writes as ``functions.advance``
    gives them (chunk id, notification, per decode rank (rank, destination pages, contiguous):
    a PostWrite each, of ``ev.pages``), whether the input timer was armed (both rows cancel it)
    and, for the last chunk, the aux writes (``functions.aux_write``; each goes after its
    rank's PostWrite). The transfer timer is armed in ``room.timers``: the caller sets its
    deadline. None, the room untouched, where the generic step would take another row or none."""
    state = room.state
    if state != SENDING and state != WAITING:
        return None
    if type(pages) is PageRun:
        run = _one_run(room, pages._r, is_last, aux_slot)
        if run is not None:
            return run
    ev = ChunkReady(pages, is_last, aux_slot)
    last = is_last
    if not f.chunk_ok(room, ev) or not f.chunk_fits(room, ev):
        return None  # no row (an invalid chunk) or P9 (a chunk that does not fit): generic
    timers = room.timers
    cancelled = INPUT in timers
    if cancelled:
        timers.discard(INPUT)
    room.state = DRAINING if last else SENDING
    chunk_id, note, writes = f.advance(room, ev)
    timers.add(TIMER)
    room.last_row = "P10" if last else "P11"
    return chunk_id, note, writes, cancelled, [f.aux_write(room, ev, w[0]) for w in writes] if last else ()


def _one_run(room: PrefillRoom, r: range, is_last: bool, aux_slot: int | None) -> RunPosts | None:
    """``chunk`` for a chunk of a PageRun (its range ``r``: ascending, distinct pages >= 0) where
    it posts exactly one write of one segment (and, with the last chunk, its one aux write): a
    room in WaitingForInput or Transferring.Sending (the caller checked) with one decode rank,
    whose announced pages are one ascending run. None, the room untouched, otherwise: ``chunk``
    then takes the general branch, which also refuses what this refuses as invalid or not
    fitting."""
    n = len(r)  # (the PageRun's range: its bounds without a Python-level call)
    if not n:
        return None
    first = r.start
    if is_last:
        if type(aux_slot) is not int:
            return None  # an invalid last chunk: the general branch refuses it
    elif aux_slot is not None:
        return None  # an aux slot on a chunk that is not the last: invalid
    if room.last_seen or first + n > room.kv_pages or room.page_size != 1:
        return None  # (pages of several tokens: the general branch finds the chunk's tokens)
    dests = room.dests
    if len(dests) != 1:
        return None
    ((dest, ann),) = dests.items()
    start = room.cursor
    end = start + n
    if not ann.run or ann.page_size != 1:
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
    return chunk_id, dest, first, n, ann.pages[start], start, cancelled, ann.aux_slot


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
    if room.state != RECEIVING or not f.chunk_valid(room, ev):
        return False  # D5, D4 (a chunk id received already is a problem too) or another state
    if f.completes_room(room, ev):
        return False  # D6 or D7: the room concludes
    f.record_chunk(room, ev, None, "")  # type: ignore[arg-type] # (it reads no context)
    room.timers.add(TIMER)
    room.last_row = "D8"
    return True
