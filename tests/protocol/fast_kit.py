"""Checks of one fast row against the generic step (imported by the fast-row tests).

Each ``check_*`` tries the fast row on one copy of a room and the generic step on another:
where the fast row applies, both rooms end equal and the generic step's actions are exactly what
the fast row left to the caller; where it refuses, its copy is untouched. Each returns whether
the fast row applied.
"""

from __future__ import annotations

import copy
import dataclasses

from hypothesis import strategies as st
from protocol_kit import KV_PAGES, MACHINES, ready, snapshot

from kvfsm.protocol import CancelTimer, PostWrite, SetTimer, fastpath
from kvfsm.protocol.events import ChunkArrived, ChunkReady, WriteCompleted

M = MACHINES["prefill"]
TRANSFER_S = M.timeouts[fastpath.TIMER]
LEAN_STATES = (fastpath.WAITING, fastpath.SENDING)  # where run_chunk may apply


def _fields(actions):
    """Actions as comparable values (PostWrite's derived ``contiguous`` is left out of ``==``)."""
    return [(type(a).__name__, dataclasses.astuple(a), getattr(a, "contiguous", None)) for a in actions]


def check_chunk(room, ev: ChunkReady, now: float) -> bool:
    fast, generic = copy.deepcopy(room), copy.deepcopy(room)
    got = fastpath.chunk(fast, ev)
    if got is None:
        assert snapshot(fast) == snapshot(room), f"{ev} in {room.state}: refused, yet the room changed"
        return False
    actions = M.step(generic, ev, now)  # the fast row applied: the generic step must accept it too
    chunk_id, note, writes, cancelled, aux = got
    want: list = [CancelTimer(fastpath.INPUT)] if cancelled else []
    for i, (d, dst, one_run) in enumerate(writes):
        want.append(PostWrite(room.room, d, chunk_id, ev.pages, dst, note, one_run))
        want += aux[i : i + 1]
    want.append(SetTimer(fastpath.TIMER, now + TRANSFER_S))
    assert len(aux) == (len(writes) if ev.is_last else 0)
    assert _fields(actions) == _fields(want), f"{ev} in {room.state}"
    assert generic.last_row == ("P10" if ev.is_last else "P11")
    assert snapshot(fast) == snapshot(generic), f"{ev} in {room.state}: rooms differ"
    return True


def check_run_chunk(room, ev: ChunkReady) -> bool:
    """``run_chunk`` (the runtime's leanest path) against ``chunk`` for a chunk that is one run
    of pages (the last one with its aux slot): where it applies, ``chunk`` applies too, with
    exactly its one write of one segment (and, for the last chunk, its one aux write), and both
    leave the room the same; where it refuses, its copy is untouched and ``chunk`` does not take
    P11 or P10 with one such write either."""
    pages, n = ev.pages, len(ev.pages)
    if not n or tuple(pages) != tuple(range(pages[0], pages[0] + n)) or ev.is_last != (ev.aux_slot is not None):
        return False
    lane, full = copy.deepcopy(room), copy.deepcopy(room)
    got = fastpath.run_chunk(lane, pages[0], n, ev.aux_slot)
    done = fastpath.chunk(full, ev)
    if got is None:
        assert snapshot(lane) == snapshot(room), f"{ev} in {room.state}: refused, yet the room changed"
        if done is not None:
            assert len(done[2]) != 1 or not done[2][0][2], f"{ev} in {room.state}: run_chunk refused a one-run row"
        return False
    assert done is not None, f"{ev} in {room.state}: run_chunk applied, chunk did not"
    chunk_id, note, writes, cancelled, aux = done
    assert len(writes) == 1
    dest, dst, one_run = writes[0]
    assert one_run and got == (chunk_id, dest, dst[0], note.page_start, cancelled, room.dests[dest].aux_slot)
    assert (note.room, note.src, note.is_last, note.num_pages) == (room.room, room.rank, ev.is_last, n)
    if ev.is_last:
        assert [(a.dest_rank, a.src_slot, a.dst_slot) for a in aux] == [(dest, ev.aux_slot, got[5])]
    else:
        assert not aux
    assert snapshot(lane) == snapshot(full), f"{ev} in {room.state}: rooms differ"
    return True


def _check_fast(machine, room, ev, now: float, apply, expect) -> bool:
    """A fast row that leaves the caller only timers to set (P15, P14, D8): ``apply`` tries it on
    one copy, ``machine`` steps ``ev`` on another; ``expect(fast copy)`` gives the actions and the
    row the generic step must have taken."""
    fast, generic = copy.deepcopy(room), copy.deepcopy(room)
    if not apply(fast):
        assert snapshot(fast) == snapshot(room), f"{ev} in {room.state}: refused, yet the room changed"
        return False
    actions = machine.step(generic, ev, now)
    want, row = expect(fast)
    assert _fields(actions) == _fields(want), f"{ev} in {room.state}"
    assert generic.last_row == row
    assert snapshot(fast) == snapshot(generic), f"{ev} in {room.state}: rooms differ"
    return True


def check_completion(room, ev: WriteCompleted, now: float) -> bool:
    """P15 (the transfer timer re-armed) or P14: a draining room's last write, the room in
    Success and the transfer timer cancelled if it was armed, as the generic step does."""

    def expect(fast):
        if fast.state == room.state:
            return [SetTimer(fastpath.TIMER, now + TRANSFER_S)], "P15"
        return ([CancelTimer(fastpath.TIMER)] if fastpath.TIMER in room.timers else []), "P14"

    return _check_fast(M, room, ev, now, lambda r: fastpath.completion(r, ev.dest_rank, ev.chunk_id), expect)


@st.composite
def next_chunk(draw, room):
    """A chunk that mostly fits what decode announced (the last one ends exactly there, mostly),
    a run of pages or any distinct ones."""
    dests = getattr(room, "dests", {})
    left = max(0, min((len(a.pages) for a in dests.values()), default=4) - getattr(room, "cursor", 0))
    last = draw(st.integers(0, 7)) == 0
    n = draw(st.just(left) if last else st.integers(1, max(1, min(left, 8)))) + draw(st.sampled_from([0] * 9 + [1]))
    first = draw(st.integers(0, max(0, KV_PAGES - n)))
    pages = draw(st.just(tuple(range(first, first + n))) | st.permutations(range(KV_PAGES)).map(lambda p: p[:n]))
    return ready(pages, last=last)


D = MACHINES["decode"]


def check_arrival(room, ev: ChunkArrived, now: float) -> bool:
    rearm = [SetTimer(fastpath.TIMER, now + D.timeouts[fastpath.TIMER])]
    return _check_fast(D, room, ev, now, lambda r: fastpath.arrival(r, ev), lambda fast: (rearm, "D8"))


@st.composite
def next_notification(draw, room):
    """A chunk notification that mostly continues what each source sent (the next id and pages,
    the last one now and then), or repeats one, or is arbitrary (event_for)."""
    sources = sorted(getattr(room, "sources", ())) or [0]
    src = draw(st.sampled_from(sources))
    got = getattr(room, "received", {}).get(src, {})
    cid = len(got)
    start = sum(n for _, n, _ in got.values())
    left = max(0, len(getattr(room, "pages", ())) - start)
    # the rest of the source's pages as its last chunk half the time: the notification that
    # completes a room (D6, D7) is otherwise too rare for the all-pairs proof to meet reliably
    if draw(st.booleans()):
        return ChunkArrived(src, cid, draw(st.integers(0, 3)) != 0, start, left)
    n = draw(st.integers(0, max(0, min(left, 6))))
    return ChunkArrived(src, cid, draw(st.integers(0, 5)) == 0, start, n)
