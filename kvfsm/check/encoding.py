"""How the checker's model writes rooms, messages and items down: small hashable tuples.

A room's machine is *frozen* into a tuple of its fields (``freeze_prefill``, ``freeze_decode``),
whose first element is its state, and *thawed* back into a room object to be stepped by the
compiled protocol (``thaw_prefill``, ``thaw_decode``). A message is a tuple led by its type, with
free-text reasons blanked (``_msg_tuple``; ``_msg`` builds it back). A network item is one of:

* ``("m", sender, receiver, message)``: a control message;
* ``("n", sender, receiver, message)``: a notification (it travels with a write's data);
* ``("w", source, destination, room, chunk, notification)``: a write in flight;
* ``("c", source, room, destination rank, chunk, ok)``: a write's completion at its source;
* ``("l", node, dead peer)``: a peer-loss notice.

``_Builder`` collects one successor's effect while the model computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvfsm.protocol.events import ChunkReady
from kvfsm.protocol.rooms import Announcement, DecodeRoom, PrefillRoom
from kvfsm.protocol.wire import MESSAGE_CLASSES, Message

Item = tuple[Any, ...]
State = tuple[int, ...]
Label = tuple[Any, ...]
Ctrl = tuple[tuple[Any, ...], tuple[str, ...], tuple[tuple[str, str], ...]]  # slots, crashed, lost
# (label, control', budget index or -1, its unit, network deltas, notes, None or the rare parts:
#  (fence condition, landing, landed checks, ops applied item by item))
Effect = tuple[Any, ...]
WriteKey = tuple[int, int, int, int]  # (room, source, chunk, destination) of a write


def _code(failure: str | None) -> str:
    return "" if failure is None else failure.split(":", 1)[0]


def freeze_prefill(r: PrefillRoom) -> tuple[Any, ...]:
    return (
        r.state,
        _code(r.failure),
        tuple(sorted(r.timers)),
        tuple(sorted((k, a.pages, a.aux_slot) for k, a in r.dests.items())),
        r.required_dests,
        tuple((c.pages, c.is_last, -1 if c.aux_slot is None else c.aux_slot) for c in r.held),
        r.last_seen,
        r.next_chunk,
        r.cursor,
        tuple(sorted(r.inflight)),
    )


def thaw_prefill(t: tuple[Any, ...], room: int, rank: int, kv_pages: int, aux_slots: int) -> PrefillRoom:
    state, code, timers, dests, req, held, last_seen, next_chunk, cursor, inflight = t
    return PrefillRoom(
        room, rank, kv_pages, aux_slots, state=state, failure=code or None, timers=set(timers),
        dests={k: Announcement.of(pages, aux) for k, pages, aux in dests}, required_dests=req,
        held=[ChunkReady(pages, last, None if aux < 0 else aux) for pages, last, aux in held],
        last_seen=last_seen, next_chunk=next_chunk, cursor=cursor, inflight=set(inflight),
    )  # fmt: skip


def freeze_decode(r: DecodeRoom) -> tuple[Any, ...]:
    return (
        r.state,
        _code(r.failure),
        tuple(sorted(r.timers)),
        r.pages,
        r.aux_slot,
        tuple(sorted((src, tuple(sorted((cid, *v) for cid, v in got.items()))) for src, got in r.received.items())),
        tuple(sorted(r.last_count.items())),
        tuple(sorted(r.aux_done)),
        tuple(sorted(getattr(r, "undrained", ()))),
    )


def thaw_decode(
    t: tuple[Any, ...], room: int, rank: int, kv_pages: int, aux_slots: int, sources: tuple[int, ...], req: int
) -> DecodeRoom:
    state, code, timers, pages, aux, received, last_count, aux_done, undrained = t
    r = DecodeRoom(
        room, rank, kv_pages, aux_slots, sources, req, state=state, failure=code or None, timers=set(timers),
        pages=pages, aux_slot=aux, tokens=len(pages),  # (the model's ranks declare no layout: a page a token)
        received={src: {cid: (start, n, last) for cid, start, n, last in got} for src, got in received},
        last_count=dict(last_count), aux_done=set(aux_done),
    )  # fmt: skip
    if hasattr(r, "undrained"):
        r.undrained = set(undrained)
    return r


def _msg_tuple(msg: Message) -> tuple[Any, ...]:
    """A message as a sortable tuple, with free-text reasons blanked (they do not change behaviour)."""
    return (msg.TYPE, *("" if f.name == "reason" else getattr(msg, f.name) for f in fields(msg)))


def _msg(t: tuple[Any, ...]) -> Message:
    cls: Any = MESSAGE_CLASSES[t[0]]
    msg: Message = cls(*t[1:])
    return msg


@dataclass
class _Builder:
    """One successor's effect while it is computed from the control part of a state.

    ``slots``, ``crashed`` and ``lost`` are copies that the action mutates; the network is not
    read (except by the fence timer's condition, see ``_fence_may_fire``) but written through
    ``ops``: ``("take", item)`` first, then ``("put", item)`` in order, or ``("crash", node)``.
    The ghost set of landed writes is read through deferred checks (``land``, ``require_landed``),
    evaluated against the state the effect is applied to.
    """

    slots: list[Any]
    crashed: set[str]
    lost: set[tuple[str, str]]  # (node, dead peer) once the node received the peer-loss notice
    ops: list[tuple[str, Any]] = field(default_factory=list)
    budget: int = -1  # index of the fault budget this action spends (LOSS, DUP, CRASH, ABORTS)
    landing: tuple[WriteKey, str] | None = None
    # deferred checks of the landed set: (keys, note, mode), see ALL, ANY and NONE
    required: list[tuple[tuple[WriteKey, ...], str, int]] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)

    def land(self, key: WriteKey, note_if_landed: str) -> None:
        """The write ``key`` (room, source, chunk, destination) lands; ``note_if_landed`` if it already had."""
        self.landing = (key, note_if_landed)

    def require_landed(self, key: WriteKey, note_if_missing: str) -> None:
        self.required.append(((key,), note_if_missing, ALL))

    def require_any_landed(self, keys: tuple[WriteKey, ...], note_if_none: str) -> None:
        """At least one of ``keys`` has landed (none given: ``note_if_none`` always)."""
        self.required.append((keys, note_if_none, ANY))

    def forbid_landed(self, key: WriteKey, note_if_landed: str) -> None:
        self.required.append(((key,), note_if_landed, NONE))


LOSS, DUP, CRASH, ABORTS = range(4)
ALL, ANY, NONE = range(3)  # a landed-set check: every key landed, at least one, none
EMPTY_QUEUE, EMPTY_BAG = 0, 1  # ids of the empty sequences
NO_NOTES: tuple[str, ...] = ()
