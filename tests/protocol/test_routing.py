"""kvfsm.protocol.routing: the pure routing decisions that the runtime and the checker share."""

from __future__ import annotations

import pytest

from kvfsm.protocol.events import (
    AbortReceived,
    AuxArrived,
    ChunkArrived,
    FailureReceived,
    PagesAnnounced,
    WritesDrained,
)
from kvfsm.protocol.routing import (
    CLEARED,
    CLEARED_FAILED,
    DISPATCH,
    EARLY,
    EXPIRED,
    LIVE,
    ROUTING,
    ROUTING_MUTANTS,
    STASH,
    UNKNOWN,
    cleared,
    create,
    expire,
    message_event,
    replies,
    route_completion,
    route_message,
    routing_for,
)
from kvfsm.protocol.wire import AbortNotice, AuxWritten, ChunkWritten, Drained, RegisterAck, RoomFailed, RoomPages

KNOWN = (LIVE, CLEARED, CLEARED_FAILED, EXPIRED, EARLY, UNKNOWN)


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("known", KNOWN)
def test_a_live_room_takes_every_message_and_nothing_else_resurrects_one(side: str, known: str) -> None:
    types = ("room_pages", "abort") if side == "prefill" else ("abort", "room_failed", "drained", "chunk_written")
    for t in types:
        route = route_message(known, side, t)
        assert (route is DISPATCH) == (known == LIVE), (known, t)


def test_prefill_keeps_messages_for_a_room_not_created_yet_until_its_stash_is_full() -> None:
    assert route_message(UNKNOWN, "prefill", "room_pages") is STASH
    assert route_message(EARLY, "prefill", "abort", stash_full=True) is STASH  # its room's are still kept
    full = route_message(UNKNOWN, "prefill", "room_pages", stash_full=True)
    assert (full.action, full.drop, full.reply) == ("drop", "early_overflow", ())


def test_decode_drops_a_message_for_a_room_it_does_not_have() -> None:
    assert route_message(UNKNOWN, "decode", "chunk_written").drop == "unknown_room"
    for known in (CLEARED, CLEARED_FAILED):
        route = route_message(known, "decode", "drained")
        assert (route.action, route.drop, route.reply) == ("drop", "late_for_cleared_room", ())


@pytest.mark.parametrize(
    ("known", "msg_type", "reply"),
    [
        (CLEARED, "abort", ("drained",)),
        (CLEARED_FAILED, "abort", ("drained",)),
        (EXPIRED, "abort", ("drained",)),
        (CLEARED, "room_pages", ()),
        (CLEARED_FAILED, "room_pages", ("room_failed", "drained")),
        (EXPIRED, "room_pages", ("room_failed", "drained")),
    ],
)
def test_a_prefill_tombstone_drops_a_late_message_and_answers_the_decode_rank(
    known: str, msg_type: str, reply: tuple[str, ...]
) -> None:
    route = route_message(known, "prefill", msg_type)
    assert (route.action, route.drop, route.reply) == ("drop", "late_for_cleared_room", reply)
    msgs = replies(route, 7, 1, "why")
    assert [m.TYPE for m in msgs] == list(reply)
    assert all(m.room == 7 and m.prefill_rank == 1 for m in msgs)
    assert all(m.reason == "why" for m in msgs if isinstance(m, RoomFailed))


def test_only_a_live_room_takes_its_writes_completions() -> None:
    for known in KNOWN:
        route = route_completion(known)
        assert (route is DISPATCH) == (known == LIVE)
        assert route is DISPATCH or route.drop == "completion_for_gone_room"


def test_create_is_allowed_over_nothing_a_stash_or_an_expiry_and_refused_over_a_room_or_its_tombstone() -> None:
    assert create(UNKNOWN).refuse == "" and not create(UNKNOWN).abort and not create(UNKNOWN).replay
    assert create(EARLY).replay and not create(EARLY).abort
    assert create(EXPIRED).abort and not create(EXPIRED).replay
    assert create(LIVE).refuse == "duplicate"
    assert create(CLEARED).refuse == create(CLEARED_FAILED).refuse == "reused"


def test_expiry_tells_every_announcer_and_every_aborter_and_leaves_a_tombstone() -> None:
    stash = [
        PagesAnnounced(0, (1, 2), 0, 1, 8, 2),
        AbortReceived(1, "decode", ""),
        AbortReceived(0, "prefill", ""),  # not from a decode rank: nothing to answer
    ]
    done = expire(ROUTING, 5, 3, stash, "expired")
    assert done.known == EXPIRED
    assert done.sends == (
        (0, RoomFailed(5, 3, "expired")),
        (0, Drained(5, 3)),
        (1, Drained(5, 3)),
    )
    assert expire(ROUTING_MUTANTS["early_expiry_forgotten"], 5, 3, stash, "").known == UNKNOWN


def test_a_cleared_room_leaves_a_tombstone_unless_the_mutant_keeps_it_routable() -> None:
    assert cleared(ROUTING, failed=False) == CLEARED
    assert cleared(ROUTING, failed=True) == CLEARED_FAILED
    assert cleared(ROUTING_MUTANTS["late_message_resurrects"], failed=True) == LIVE


def test_routing_for_a_mutant_name() -> None:
    assert routing_for(None) is ROUTING
    assert routing_for("abort_flips_success") is ROUTING  # a spec mutant: the routing is correct
    for name, routing in ROUTING_MUTANTS.items():
        assert routing_for(name) is routing and routing != ROUTING


def test_message_event_of_every_room_message() -> None:
    assert message_event("decode", ChunkWritten(1, 0, 2, True, 4, 3)) == ChunkArrived(0, 2, True, 4, 3)
    assert message_event("decode", AuxWritten(1, 0)) == AuxArrived(0)
    assert message_event("decode", AbortNotice(1, 0, "prefill", "r")) == AbortReceived(0, "prefill", "r")
    assert message_event("decode", RoomFailed(1, 0, "r")) == FailureReceived(0, "r")
    assert message_event("decode", Drained(1, 0)) == WritesDrained(0)
    assert message_event("prefill", RoomPages(1, 0, (4, 5), 1, 2), 64, 8) == PagesAnnounced(0, (4, 5), 1, 2, 64, 8)
    assert message_event("prefill", AbortNotice(1, 0, "decode", "r")) == AbortReceived(0, "decode", "r")
    assert message_event("prefill", Drained(1, 0)) is None
    assert message_event("decode", RegisterAck(0, 32, 8, True, "")) is None
