"""Routing of inbound items to rooms: pure decisions shared by the runtime and the checker.

Theory of operation
-------------------
A rank knows a room id in one of six ways (the kinds below): a machine that takes events (``LIVE``);
a tombstone of a room that was cleared (``CLEARED``), or cleared after it failed
(``CLEARED_FAILED``); a tombstone of a room whose early messages expired before the engine
created it (``EXPIRED``, prefill only); messages kept for a room that the engine has not created
yet (``EARLY``, prefill only: decode announced before prefill's engine got there); or nothing
(``UNKNOWN``).

From that, the functions here decide what the rank does with an inbound item: dispatch its event
to the room's machine, keep it until the room is created (``STASH``), or drop it, counted under a
name, and perhaps answer the sender so that a decode rank does not wait for its fence timer
(``Drained``: nothing of this room is written into your pages any more; ``RoomFailed``: the room
cannot run here). They also decide what creating a room over what is known does, what expiring a
stash leaves behind and sends, and what clearing a room leaves behind. Every decision is a value;
nothing here reads a clock, does I/O or holds state. The runtime (``kvfsm.runtime``) carries the
decisions out on real endpoints and the checker (``kvfsm.check``) on its model of the network, so
the routing that is model-checked is the routing that runs.

``Routing`` selects variants of these decisions that reintroduce historical bugs: the checker's
routing mutants, which ``kvfsm replay`` also hands to the runtime to reproduce their traces there.
Production code uses ``ROUTING``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvfsm.protocol.events import (
    AbortReceived,
    AuxArrived,
    ChunkArrived,
    Event,
    FailureReceived,
    LeaseClaimed,
    LeaseGranted,
    LeaseReleased,
    PagesAnnounced,
    ReadsNotified,
    WritesDrained,
)
from kvfsm.protocol.wire import (
    AbortNotice,
    AuxWritten,
    ChunkWritten,
    Drained,
    LeaseClaim,
    LeaseGrant,
    LeaseRelease,
    Message,
    ReadsDone,
    RoomFailed,
    RoomPages,
)

# What a rank knows of a room id.
LIVE: Final = "live"
CLEARED: Final = "cleared"
CLEARED_FAILED: Final = "cleared_failed"
EXPIRED: Final = "expired"
EARLY: Final = "early"
UNKNOWN: Final = "unknown"


@dataclass(frozen=True, slots=True)
class Routing:
    """Which routing runs: the correct one (``ROUTING``) or a mutant of it (``ROUTING_MUTANTS``).

    ``keep_cleared``: a cleared room's machine stays routable, so a late message reaches it (the
    #24539 class of SGLang bugs: a late notification re-creates a cleared room).
    ``forget_expired``: a room whose early messages expired leaves no tombstone, so a late
    duplicate announcement starts writes into pages the decode rank was told to release.
    """

    keep_cleared: bool = False
    forget_expired: bool = False


ROUTING: Final = Routing()
ROUTING_MUTANTS: Final[dict[str, Routing]] = {
    "late_message_resurrects": Routing(keep_cleared=True),
    "early_expiry_forgotten": Routing(forget_expired=True),
}


def routing_for(mutant: str | None) -> Routing:
    """The routing a checker mutant runs: its routing variant, or ``ROUTING`` for any other mutant."""
    return ROUTING_MUTANTS.get(mutant, ROUTING) if mutant is not None else ROUTING


@dataclass(frozen=True, slots=True)
class Route:
    """What to do with an inbound item for a room.

    ``action``: ``"dispatch"`` (step the room's machine with the item's event), ``"stash"`` (keep
    the event until the engine creates the room) or ``"drop"``. ``drop``: the counter a dropped
    item is counted under (``dropped.<drop>``). ``reply``: answers to the sender, in order
    (``"room_failed"``, ``"drained"``; build them with ``replies``).
    """

    action: str
    drop: str = ""
    reply: tuple[str, ...] = ()


DISPATCH: Final = Route("dispatch")
STASH: Final = Route("stash")
_LATE: Final = Route("drop", "late_for_cleared_room")
_LATE_DRAINED: Final = Route("drop", "late_for_cleared_room", ("drained",))
_LATE_FAILED: Final = Route("drop", "late_for_cleared_room", ("room_failed", "drained"))
_LATE_CLAIM: Final = Route("drop", "late_for_cleared_room", ("room_failed",))
_UNKNOWN: Final = Route("drop", "unknown_room")
_OVERFLOW: Final = Route("drop", "early_overflow")
_GONE: Final = Route("drop", "completion_for_gone_room")


def route_message(known: str, side: str, msg_type: str, *, stash_full: bool = False) -> Route:
    """Where a room message (``msg_type``: ``room_pages`` or ``abort`` on prefill; ``abort``,
    ``room_failed``, ``drained``, ``chunk_written`` or ``aux_written`` on decode) goes on a rank of
    ``side`` that knows its room as ``known``. ``stash_full``: prefill already keeps messages for
    as many not-yet-created rooms as it may (a new room's are dropped, its room's still kept).

    A tombstone never re-creates a room: the late message is dropped. On prefill it is answered:
    an abort with ``Drained`` (a cleared, expired or never-written room has no write outstanding,
    so the aborting decode rank may release its pages now instead of at its fence timer), and an
    announcement for a room that failed or expired here with ``RoomFailed`` and ``Drained`` (the
    decode rank holds pages for a room that cannot run)."""
    if known == LIVE:
        return DISPATCH
    if side == "prefill":
        if known == EARLY:
            return STASH
        if known == UNKNOWN:
            return _OVERFLOW if stash_full else STASH
        if msg_type == "abort":
            return _LATE_DRAINED
        if msg_type == "room_pages" and known != CLEARED:
            return _LATE_FAILED
        if msg_type == "lease_claim" and known != CLEARED:
            return _LATE_CLAIM  # (pull mode: no write of ours is in its pages; only the failure)
        return _LATE
    return _UNKNOWN if known == UNKNOWN else _LATE


def route_completion(known: str) -> Route:
    """Where the completion (or failure) of one of a prefill room's writes goes."""
    return DISPATCH if known == LIVE else _GONE


def replies(route: Route, room: int, prefill_rank: int, reason: str) -> tuple[Message, ...]:
    """The messages ``route`` answers the sender with, from prefill rank ``prefill_rank``;
    ``reason``: why the room failed here (``RoomFailed``)."""
    out: list[Message] = []
    for kind in route.reply:
        out.append(RoomFailed(room, prefill_rank, reason) if kind == "room_failed" else Drained(room, prefill_rank))
    return tuple(out)


def message_event(
    side: str, msg: Message, peer_kv_pages: int = 0, peer_aux_slots: int = 0, peer_page_size: int = 1
) -> Event | None:
    """The event a room message is to its machine on a rank of ``side``, or None for a message no
    room of that side takes. ``peer_kv_pages``, ``peer_aux_slots``, ``peer_page_size``: the
    registered size of the announcing decode rank's regions and its tokens per page (prefill's
    ``room_pages``; 0 pages where it has not registered)."""
    if side == "decode":
        if isinstance(msg, ChunkWritten):  # the most frequent
            return ChunkArrived(msg.src, msg.chunk_id, msg.is_last, msg.token_start, msg.num_tokens)
        if isinstance(msg, AuxWritten):
            return AuxArrived(msg.src)
        if isinstance(msg, AbortNotice):
            return AbortReceived(msg.rank, msg.side, msg.reason)
        if isinstance(msg, RoomFailed):
            return FailureReceived(msg.prefill_rank, msg.reason)
        if isinstance(msg, Drained):
            return WritesDrained(msg.prefill_rank)
        if isinstance(msg, LeaseGrant):
            return LeaseGranted(msg.prefill_rank, msg.epoch, msg.lease_ms, msg.pages, msg.tokens, msg.page_size)
        return None
    if isinstance(msg, RoomPages):
        return PagesAnnounced(
            msg.decode_rank,
            msg.pages,
            msg.aux_slot,
            msg.required_dests,
            peer_kv_pages,
            peer_aux_slots,
            msg.tokens,
            peer_page_size,
        )
    if isinstance(msg, AbortNotice):
        return AbortReceived(msg.rank, msg.side, msg.reason)
    if isinstance(msg, LeaseClaim):
        return LeaseClaimed(msg.decode_rank, msg.epoch, msg.readers, msg.tokens)
    if isinstance(msg, ReadsDone):
        return ReadsNotified(msg.dst)
    if isinstance(msg, LeaseRelease):
        return LeaseReleased(msg.decode_rank, msg.reason)
    return None


@dataclass(frozen=True, slots=True)
class Create:
    """What the engine's create of a room does over what the rank knows of its id.

    ``refuse``: why the create is refused (our misuse: a duplicate or recently used room id), or
    ``""``. ``abort``: the new room is aborted at once (its early announcement expired and the
    decode rank was told the room failed). ``replay``: the stashed events are then applied, in
    the order they arrived."""

    refuse: str = ""
    abort: bool = False
    replay: bool = False


_CREATE: Final = Create()
_CREATE_EARLY: Final = Create(replay=True)
_CREATE_EXPIRED: Final = Create(abort=True)
_DUPLICATE: Final = Create(refuse="duplicate")
_REUSED: Final = Create(refuse="reused")


def create(known: str) -> Create:
    """Creating a room that the rank knows as ``known``: allowed over nothing, over its stash and
    over an expiry tombstone; refused over a live room and over a cleared room's tombstone (room
    ids must be unique)."""
    if known == UNKNOWN:
        return _CREATE
    if known == EARLY:
        return _CREATE_EARLY
    if known == EXPIRED:
        return _CREATE_EXPIRED
    return _DUPLICATE if known == LIVE else _REUSED


def cleared(routing: Routing, failed: bool) -> str:
    """How a rank knows a room once it reached Cleared (``failed``: from Failed): by a tombstone,
    or, with the ``keep_cleared`` mutant, still as a live machine."""
    if routing.keep_cleared:
        return LIVE
    return CLEARED_FAILED if failed else CLEARED


@dataclass(frozen=True, slots=True)
class Expiry:
    """What expiring a not-yet-created room's stash does on prefill rank ``rank``.

    ``known``: what the rank knows of the room afterwards (``EXPIRED``: a tombstone, so that a late
    duplicate announcement is refused and the engine's late create fails the room; ``UNKNOWN``
    with the ``forget_expired`` mutant). ``sends``: (decode rank, message), in order: every
    announcer is told that the room failed and that nothing was written into its pages; a decode
    rank that aborted is told the latter (it is fenced, and its announcement may have been lost).
    """

    known: str
    sends: tuple[tuple[int, Message], ...]


def expire(routing: Routing, room: int, rank: int, stash: tuple[Event, ...] | list[Event], reason: str) -> Expiry:
    """Expire the events ``stash`` kept on prefill rank ``rank`` for ``room``."""
    sends: list[tuple[int, Message]] = []
    for ev in stash:
        if isinstance(ev, PagesAnnounced):
            sends += ((ev.dest_rank, RoomFailed(room, rank, reason)), (ev.dest_rank, Drained(room, rank)))
        elif isinstance(ev, AbortReceived) and ev.side == "decode":
            sends.append((ev.rank, Drained(room, rank)))
        elif isinstance(ev, LeaseClaimed):  # pull mode: the claimant waits for a grant
            sends.append((ev.decode_rank, RoomFailed(room, rank, reason)))
    return Expiry(UNKNOWN if routing.forget_expired else EXPIRED, tuple(sends))


__all__ = [
    "CLEARED",
    "CLEARED_FAILED",
    "DISPATCH",
    "EARLY",
    "EXPIRED",
    "LIVE",
    "ROUTING",
    "ROUTING_MUTANTS",
    "STASH",
    "UNKNOWN",
    "Create",
    "Expiry",
    "Route",
    "Routing",
    "cleared",
    "create",
    "expire",
    "message_event",
    "replies",
    "route_completion",
    "route_message",
    "routing_for",
]
