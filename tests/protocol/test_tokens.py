"""Rooms count tokens: pages of different sizes on the two sides, a last page partly used.

Without a layout a page is one token and every figure below reduces to the page counts the rows
always used (the rest of the protocol tests); here prefill pages hold ``PS`` tokens and decode
pages ``DS``, and a chunk covers the tokens of its pages up to the room's last."""

from __future__ import annotations

import pytest
from protocol_kit import AUX_SLOTS, KV_PAGES, MACHINES, ROOM_ID, checked_step, messages, ready

from kvfsm.protocol import DecodeRoom, PostWrite, PrefillRoom
from kvfsm.protocol.events import AuxArrived, ChunkArrived, PagesAllocated, PagesAnnounced, PeersReady
from kvfsm.protocol.wire import RoomPages

PS, DS = 16, 64


def prefill_room(page_size: int = PS) -> PrefillRoom:
    room = PrefillRoom(ROOM_ID, 0, KV_PAGES, AUX_SLOTS, page_size)
    MACHINES["prefill"].create(room, 0.0)
    return room


def announced(pages, tokens, *, dest=0, required=1, page_size=DS) -> PagesAnnounced:
    return PagesAnnounced(dest, tuple(pages), 1, required, KV_PAGES, AUX_SLOTS, tokens, page_size)


def writes(actions) -> list[PostWrite]:
    return [a for a in actions if isinstance(a, PostWrite)]


def test_chunks_cover_tokens_and_land_in_the_decode_pages_that_hold_them():
    room = prefill_room()
    checked_step("prefill", room, announced([7, 3], 100), 1.0)  # 100 tokens: two decode pages of 64
    w = writes(checked_step("prefill", room, ready([0, 1, 2]), 2.0))  # tokens [0, 48)
    assert [(x.dst_pages, x.notification.token_start, x.notification.num_tokens) for x in w] == [((7,), 0, 48)]
    w = writes(checked_step("prefill", room, ready([4, 5]), 3.0))  # [48, 80): crosses into page 3
    assert [(x.dst_pages, x.notification.token_start, x.notification.num_tokens) for x in w] == [((7, 3), 48, 32)]
    assert room.cursor == 80 and room.state == "Transferring.Sending" and room.dests[0].tokens == 100
    w = writes(checked_step("prefill", room, ready([6, 9], last=True), 4.0))  # [80, 100): page 9 partly used
    assert [(x.dst_pages, x.notification.token_start, x.notification.num_tokens) for x in w] == [((3,), 80, 20)]


def test_the_last_chunk_ends_at_the_last_token_its_last_page_partly_used():
    room = prefill_room()
    checked_step("prefill", room, announced([9, 2], 70), 1.0)
    checked_step("prefill", room, ready([0, 1, 2, 3]), 2.0)  # [0, 64)
    w = writes(checked_step("prefill", room, ready([8], last=True), 3.0))  # [64, 70): 6 tokens of page 8
    assert [(x.src_pages, x.dst_pages, x.notification.token_start, x.notification.num_tokens) for x in w] == [
        ((8,), (2,), 64, 6)
    ]
    assert room.state == "Transferring.Draining" and room.cursor == 70


@pytest.mark.parametrize(
    ("chunks", "ok"),
    [
        ([([0, 1, 2, 3, 4], True)], True),  # 80 tokens of pages for 70: the last page partly used
        ([([0, 1, 2, 3], True)], False),  # 64 < 70: short
        ([([0, 1, 2, 3, 4, 5], True)], False),  # a whole page past the last token
        ([([0, 1, 2, 3, 4], False)], False),  # not the last, yet it runs past token 70
        ([([0, 1, 2, 3], False), ([], True)], False),  # an empty last chunk must start at token 70
    ],
)
def test_a_chunk_fits_only_if_it_covers_the_tokens_exactly(chunks, ok):
    room = prefill_room()
    checked_step("prefill", room, announced([9, 2], 70), 1.0)
    for i, (pages, last) in enumerate(chunks):
        checked_step("prefill", room, ready(pages, last=last), 2.0 + i)
    assert (room.state != "Failed") == ok, room.failure


def test_held_chunks_are_judged_one_by_one_when_decode_announces():
    room = prefill_room()
    checked_step("prefill", room, ready([0, 1, 2, 3, 4]), 1.0)  # held: not the last, 80 tokens
    checked_step("prefill", room, ready([], last=True), 1.5)
    checked_step("prefill", room, announced([9, 2], 70), 2.0)  # the first held chunk overruns 70
    assert room.state == "Failed" and "page count mismatch" in (room.failure or "")


@pytest.mark.parametrize(
    ("pages", "tokens", "problem"),
    [
        ([1, 2], 129, "do not hold exactly 129 tokens"),
        ([1, 2, 3], 128, "do not hold exactly 128 tokens"),
        ([1], 64, None),
        ([1, 2], 65, None),
        ([1, 2], 0, None),  # 0: every token of the pages
    ],
)
def test_an_announcement_whose_pages_do_not_hold_its_tokens_is_refused(pages, tokens, problem):
    room = prefill_room()
    checked_step("prefill", room, announced(pages, tokens), 1.0)
    if problem is None:
        assert room.state == "WaitingForInput"
        assert room.dests[0].tokens == (tokens or 64 * len(pages))
    else:
        assert room.state == "Failed" and problem in (room.failure or "")


def test_decode_ranks_of_one_room_must_announce_the_same_tokens():
    room = prefill_room()
    checked_step("prefill", room, announced([1, 2], 100, dest=0, required=2), 1.0)
    checked_step("prefill", room, announced([5, 6], 90, dest=1, required=2), 2.0)
    assert room.state == "Failed" and "100" in (room.failure or "")


def decode_room(sources=(0,), page_size=DS) -> DecodeRoom:
    room = DecodeRoom(ROOM_ID, 0, KV_PAGES, AUX_SLOTS, tuple(sources), 1, page_size)
    MACHINES["decode"].create(room, 0.0)
    checked_step("decode", room, PeersReady(), 0.5)
    return room


def test_decode_announces_its_tokens_and_concludes_on_an_exact_partition_of_them():
    room = decode_room(sources=(0, 1))
    sent = messages(checked_step("decode", room, PagesAllocated((4, 5), 1, 70), 1.0), RoomPages)
    assert {m.tokens for _, m in sent} == {70}
    for src in (0, 1):
        checked_step("decode", room, ChunkArrived(src, 0, False, 0, 48), 2.0)
        checked_step("decode", room, ChunkArrived(src, 1, True, 48, 22), 3.0)
        checked_step("decode", room, AuxArrived(src), 4.0)
    assert room.state == "Success"


def test_decode_refuses_a_chunk_past_its_tokens_and_a_gap():
    room = decode_room()
    checked_step("decode", room, PagesAllocated((4, 5), 1, 70), 1.0)
    checked_step("decode", room, ChunkArrived(0, 0, False, 0, 71), 2.0)
    assert room.state == "Fenced" and "outside the room's 70" in (room.failure or "")
    room = decode_room()
    checked_step("decode", room, PagesAllocated((4, 5), 1, 70), 1.0)
    checked_step("decode", room, ChunkArrived(0, 0, False, 0, 30), 2.0)
    checked_step("decode", room, ChunkArrived(0, 1, True, 31, 39), 3.0)
    checked_step("decode", room, AuxArrived(0), 4.0)
    assert room.state == "Fenced"  # [0, 30) and [31, 70) leave token 30 unwritten


def test_the_engine_may_not_allocate_pages_that_do_not_hold_its_tokens():
    room = decode_room()
    with pytest.raises(Exception, match="do not hold exactly 200 tokens"):
        MACHINES["decode"].step(room, PagesAllocated((4, 5), 1, 200), 1.0)
    assert room.state == "WaitingForInput.Allocating"
