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

from kvfsm.protocol import CancelTimer, PostAuxWrite, PostWrite, SetTimer, fastpath
from kvfsm.protocol.events import ChunkArrived, ChunkReady, WriteCompleted
from kvfsm.protocol.pages import PageRun
from kvfsm.protocol.wire import AuxWritten, ChunkWritten
from kvfsm.runtime.pages import as_pages

M = MACHINES["prefill"]
TRANSFER_S = M.timeouts[fastpath.TIMER]
LEAN_STATES = (fastpath.WAITING, fastpath.SENDING)  # where the one-run shape may apply


def _fields(actions):
    """Actions as comparable values (PostWrite's derived ``contiguous`` is left out of ``==``)."""
    return [(type(a).__name__, dataclasses.astuple(a), getattr(a, "contiguous", None)) for a in actions]


def check_chunk(room, ev: ChunkReady, now: float) -> str | None:
    """``fastpath.chunk`` against the generic step; where it applies, the row it took ("P10" or
    "P11", "run P10" or "run P11" where it gave the one-run shape, RunPosts), else None."""
    fast, generic = copy.deepcopy(room), copy.deepcopy(room)
    got = fastpath.chunk(fast, ev.pages, ev.is_last, ev.aux_slot)
    if got is None:
        assert snapshot(fast) == snapshot(room), f"{ev} in {room.state}: refused, yet the room changed"
        return None
    actions = M.step(generic, ev, now)  # the fast row applied: the generic step must accept it too
    row = "P10" if ev.is_last else "P11"
    if len(got) == 8:  # RunPosts: one write of one run to one decode rank, built from its fields
        chunk_id, dest, first, n, dst_first, start, cancelled, dst_slot = got
        assert type(ev.pages) is PageRun and list(room.dests) == [dest], f"{ev} in {room.state}: {got}"
        assert (first, n) == (ev.pages[0], len(ev.pages))
        dst = room.dests[dest].pages[start : start + n]
        assert dst[0] == dst_first
        note = ChunkWritten(room.room, room.rank, chunk_id, ev.is_last, start, n)
        writes = [(dest, dst, True)]
        aux = (
            [PostAuxWrite(room.room, dest, ev.aux_slot, dst_slot, AuxWritten(room.room, room.rank))]
            if ev.is_last
            else []
        )
        row = "run " + row
    else:
        chunk_id, note, writes, cancelled, aux = got
    want: list = [CancelTimer(fastpath.INPUT)] if cancelled else []
    for i, (d, dst, one_run) in enumerate(writes):
        want.append(PostWrite(room.room, d, chunk_id, ev.pages, dst, note, one_run))
        want += aux[i : i + 1]
    want.append(SetTimer(fastpath.TIMER, now + TRANSFER_S))
    assert len(aux) == (len(writes) if ev.is_last else 0)
    assert _fields(actions) == _fields(want), f"{ev} in {room.state}"
    assert generic.last_row == row[-3:]
    assert snapshot(fast) == snapshot(generic), f"{ev} in {room.state}: rooms differ"
    return row


def as_engine_hands_it(ev: ChunkReady) -> ChunkReady:
    """``ev`` with its pages in the form the runtime gives every chunk (``as_pages``: a PageRun
    for an ascending run of two pages or more)."""
    return ChunkReady(as_pages(ev.pages), ev.is_last, ev.aux_slot)


def check_run_chunk(room, ev: ChunkReady, now: float) -> bool:
    """``check_chunk`` for ``ev`` as the runtime hands it over (its pages a PageRun where they
    are a run); True where ``fastpath.chunk`` took the one-run shape (RunPosts) and it equals
    the generic step. Where the pages are a run and one write of one run to one decode rank is
    what the generic step posts, that shape must have been taken."""
    ev = as_engine_hands_it(ev)
    if type(ev.pages) is not PageRun:
        return False
    row = check_chunk(room, ev, now)
    if row is None or not row.startswith("run"):
        if row is not None:
            generic = copy.deepcopy(room)
            posts = [a for a in M.step(generic, ev, now) if isinstance(a, PostWrite)]
            assert not (len(posts) == 1 and posts[0].contiguous), f"{ev} in {room.state}: one run, not taken as one"
        return False
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
