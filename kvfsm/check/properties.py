"""Predicates of the properties named in spec/invariants.toml.

``edge_notes`` runs on every room step the model takes and ``landing_notes`` whenever a write's
data lands (which KV heads a landed write carries follows from the model's rank mapping,
``Model.mapping``: the landed set of (room, source, chunk, destination) is the ghost state; the
bytes it moves follow from ``kvfsm.layout``'s plan, ``Model.plans``); they add ``!name`` (an
``always`` property broken by this transition) or ``~name``
(a ``sometimes`` property witnessed) to the transition's notes. ``stuck_rooms`` is the
quiescent-state predicate of ``liveness.no_stuck_room``; ``no_progress_cycle`` is checked on the
explored graph by the explorer. ``PREDICATES`` maps every spec name to its predicate, and a test
checks that the two agree.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvfsm.protocol.events import AbortReceived, FailureReceived, PeerLost, TimerFired
from kvfsm.protocol.spec import spec_dir

if TYPE_CHECKING:
    from kvfsm.check.encoding import _Builder
    from kvfsm.check.model import Model

FAILED, SUCCESS = 0, 4


def load_properties(mode: str = "push") -> dict[str, dict[str, dict[str, str]]]:
    """spec/invariants.toml: {"always": {name: {kind, why}}, "sometimes": ..., "liveness": ...},
    the properties of ``mode`` only (an entry's ``mode``, "push" where it names none; pull mode's
    predicates are ``kvfsm.check.pull_model.PULL_PREDICATES``)."""
    raw = tomllib.loads((spec_dir() / "invariants.toml").read_text())
    return {
        group: {n: p for n, p in raw.get(group, {}).items() if p.get("mode", "push") == mode}
        for group in ("always", "sometimes", "liveness")
    }


def _cause_rank(event: Any) -> int | None:
    if isinstance(event, AbortReceived):
        return event.rank
    if isinstance(event, FailureReceived):
        return event.prefill_rank
    if isinstance(event, PeerLost):
        return event.peer_rank
    return None


def _told(outputs: tuple[tuple[Any, ...], ...], me: str, peers: set[str]) -> bool:
    reached = {item[2] for item in outputs if item[0] == "m" and item[1] == me}
    return peers <= reached


def edge_notes(
    model: Model, b: _Builder, idx: int, side: str, room: int, rank: int, before: Any, new: Any,
    outputs: tuple[tuple[Any, ...], ...], row: str, event: Any,
) -> None:  # fmt: skip
    notes = b.notes
    poll_before = model.kvpoll(side, before)
    poll_after = model.kvpoll(side, new)
    cleared_now = new[0] == "Cleared"
    # always.no_resurrection
    if before[0] == "Cleared" and not cleared_now:
        notes.add("!no_resurrection")
    # always.failed_is_sticky / always.success_is_final
    if poll_before == FAILED and not cleared_now and poll_after != FAILED:
        notes.add("!failed_is_sticky")
    if poll_before == SUCCESS and poll_after == FAILED:
        notes.add("!success_is_final")
    entered_failed = poll_after == FAILED and poll_before not in (FAILED, None)
    if entered_failed:
        # always.failure_is_told: every rank of the other side this room was paired with hears of it
        cause = _cause_rank(event)
        me = model.node(side, rank)
        if side == "P":
            peers = {model.node("D", d) for d, *_ in new[3] if d != cause}
        else:
            peers = {model.node("P", p) for p in model.sources[rank] if p != cause}
        if not _told(outputs, me, peers):
            notes.add("!failure_is_told")
        if isinstance(event, TimerFired):
            notes.add("~room_fails_by_timeout")
        # liveness.no_wait_for_silent_rank: it failed with nothing left to come from its senders
        if side == "D" and _received_from_every_sender(model, rank, before):
            notes.add("!no_wait_for_silent_rank")
    if side == "D" and poll_after == SUCCESS and poll_before != SUCCESS:
        notes.add("~room_succeeds")
        # always.no_false_success: every chunk and the aux of every source landed here
        for p in model.sources[rank]:
            for chunk in (*range(model.cfg.chunks), -1):
                b.require_landed((room, p, chunk, rank), "!no_false_success")
        # always.head_written_once: every head this rank holds, of every chunk, was written
        for cover in model.mapping.covers(rank):
            for chunk in range(model.cfg.chunks):
                b.require_any_landed(tuple((room, p, chunk, rank) for p in cover), "!head_written_once")
    if row == "P4":
        notes.add("~scenario_1")
    elif row in ("P6", "P7"):
        notes.add("~scenario_2")


def _received_from_every_sender(model: Model, rank: int, frozen: Any) -> bool:
    """Decode rank ``rank``'s room (frozen) has every chunk and the aux of every prefill rank that
    writes to it: whatever it still waits for will not come."""
    received, last_count, aux_done = dict(frozen[5]), dict(frozen[6]), frozen[7]
    senders = model.mapping.senders_of(rank)
    return bool(senders) and all(
        p in last_count and len(received.get(p, ())) == last_count[p] and p in aux_done for p in senders
    )


def landing_notes(model: Model, b: _Builder, room: int, p: int, d: int, chunk_id: int) -> None:
    b.land((room, p, chunk_id, d), "!write_at_most_once")
    if chunk_id >= 0:  # a KV chunk: no other source's write of the same chunk carries one of its heads
        for q in model.head_conflicts.get((p, d), ()):
            b.forbid_landed((room, q, chunk_id, d), "!head_written_once")
        # its plan (kvfsm.layout) writes exactly the chunk's head vectors the pair moves
        if not model.plans.exact(p, d, chunk_id, model.pages(room)):
            b.notes.add("!write_plan_exact")
    slot = b.slots[model.slot_index[("D", room, d)]]
    # pages must be allocated to this room (announced) and not yet handed back (cleared)
    if not isinstance(slot, tuple) or slot[0] in ("E", "X", "Cleared") or not slot[3]:
        b.notes.add("!no_write_into_freed_pages")
    source = b.slots[model.slot_index[("P", room, p)]]
    if not isinstance(source, tuple) or source[0] == "Cleared":
        b.notes.add("!no_read_of_released_source")


def stuck_rooms(model: Model, state: Any) -> list[str]:
    """liveness.no_stuck_room: rooms (of live nodes) not concluded and cleared in a final state."""
    slots, crashed = model.slots(state), model.crashed(state)
    stuck = []
    for idx, (side, room, rank) in enumerate(model.slot_info):
        if model.node(side, rank) in crashed:
            continue
        s = slots[idx]
        if side == "P" and not model.dests[rank] and (s is None or s[0] == "X"):
            continue  # a prefill rank that writes nobody takes no part in the room
        if not (isinstance(s, tuple) and s[0] == "Cleared"):
            stuck.append(f"{side}{rank} room {room}: {s[0] if isinstance(s, tuple) else 'never created'}")
    return stuck


def _edge(_: Any) -> bool:  # checked inside edge_notes / landing_notes
    return True


PREDICATES: dict[str, Callable[..., Any]] = {
    "no_false_success": edge_notes,
    "no_write_into_freed_pages": landing_notes,
    "write_at_most_once": landing_notes,
    "no_read_of_released_source": landing_notes,
    "failed_is_sticky": edge_notes,
    "success_is_final": edge_notes,
    "failure_is_told": edge_notes,
    "no_resurrection": edge_notes,
    "room_succeeds": edge_notes,
    "room_fails_by_timeout": edge_notes,
    "scenario_1": edge_notes,
    "scenario_2": edge_notes,
    "head_written_once": landing_notes,
    "write_plan_exact": landing_notes,
    "no_stuck_room": stuck_rooms,
    "no_wait_for_silent_rank": edge_notes,
    "no_progress_cycle": _edge,  # the explorer's topological sort of the explored graph
}
