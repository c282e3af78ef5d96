"""Guard and action functions of the decode room (spec/decode_room.toml); the registry and the
prefill room's are in ``kvfsm.protocol.functions``, whose theory of operation holds here too.

A decode room counts tokens: the engine's pages hold exactly the room's tokens (the last page
may be partly used), and each source's chunks must partition them, in chunk-id order, with no
gap and no overlap, before the room succeeds."""

from __future__ import annotations

from typing import Any

from kvfsm.protocol.actions import SendMessage
from kvfsm.protocol.functions import EXPLAIN, StepContext, _distinct, _within, action, guard
from kvfsm.protocol.rooms import DecodeRoom
from kvfsm.protocol.wire import AbortNotice, RoomPages

# ====================================================================== decode guards


@guard
def alloc_ok(room: DecodeRoom, ev: Any) -> bool:
    """The engine's pages and aux slot lie in this rank's registered region, pages distinct, and
    the pages hold exactly the room's tokens."""
    return (
        _within(ev.pages, room.kv_pages)
        and _distinct(ev.pages)
        and 0 <= ev.aux_slot < room.aux_slots
        and (not ev.tokens or -(-ev.tokens // room.page_size) == len(ev.pages))
    )


EXPLAIN["alloc_ok"] = lambda room, ev: (
    ""
    if alloc_ok(room, ev)
    else f"pages or aux slot outside the registered {room.kv_pages} pages / {room.aux_slots} slots, a page "
    f"twice, or {len(ev.pages)} pages of {room.page_size} tokens that do not hold exactly {ev.tokens} tokens"
)


@guard
def chunk_repeat(room: DecodeRoom, ev: Any) -> bool:
    got = room.received.get(ev.src, {}).get(ev.chunk_id)
    return got == (ev.token_start, ev.num_tokens, ev.is_last)


def _chunk_notice_problem(room: DecodeRoom, ev: Any) -> str:
    if ev.src not in room.sources:
        return f"notification from prefill rank {ev.src}, expected {list(room.sources)}"
    got = room.received.get(ev.src, {})
    if ev.chunk_id in got:
        return f"chunk {ev.chunk_id} from rank {ev.src} notified twice with different contents"
    count = room.last_count.get(ev.src)
    if ev.is_last:
        if count is not None:
            return f"a second last chunk from rank {ev.src}"
        if got and max(got) > ev.chunk_id:
            return f"last chunk id {ev.chunk_id} below an already received id {max(got)}"
    elif count is not None and ev.chunk_id >= count:
        return f"chunk id {ev.chunk_id} beyond the last chunk ({count} chunks)"
    if ev.token_start + ev.num_tokens > room.tokens:
        return f"tokens [{ev.token_start}, {ev.token_start + ev.num_tokens}) outside the room's {room.tokens}"
    return ""


@guard
def chunk_valid(room: DecodeRoom, ev: Any) -> bool:
    """Known source, no conflicting duplicate, ids below the last chunk's, tokens inside the room's."""
    return not _chunk_notice_problem(room, ev)


EXPLAIN["invalid chunk notification"] = _chunk_notice_problem


def _source_done(room: DecodeRoom, src: int, ev: Any) -> bool:
    got = room.received.get(src, {})
    count = room.last_count.get(src)
    n_got = len(got)
    aux = src in room.aux_done
    if ev.trigger == "chunk_arrived" and ev.src == src:
        n_got += 1
        if ev.is_last:
            count = ev.chunk_id + 1
    elif ev.trigger == "aux_arrived" and ev.src == src:
        aux = True
    return aux and count is not None and n_got == count


@guard
def completes_room(room: DecodeRoom, ev: Any) -> bool:
    """With this notification, every expected source delivered chunks 0..n-1 and its aux."""
    return all(_source_done(room, src, ev) for src in room.sources)


@guard
def coverage_exact(room: DecodeRoom, ev: Any) -> bool:
    """Each source's chunks, in id order, partition the room's tokens exactly (no gap, no overlap)."""
    for src in room.sources:
        chunks = dict(room.received.get(src, {}))
        if ev.trigger == "chunk_arrived" and ev.src == src:
            chunks[ev.chunk_id] = (ev.token_start, ev.num_tokens, ev.is_last)
        cursor = 0
        for cid in sorted(chunks):
            start, n, _ = chunks[cid]
            if start != cursor:
                return False
            cursor += n
        if cursor != room.tokens:
            return False
    return True


@guard
def source_expected(room: DecodeRoom, ev: Any) -> bool:
    return ev.src in room.sources


@guard
def notice_from_source(room: DecodeRoom, ev: Any) -> bool:
    """The abort, failure or loss concerns one of this room's sources."""
    rank = (
        ev.peer_rank if ev.trigger == "peer_lost" else ev.prefill_rank if ev.trigger == "failure_received" else ev.rank
    )
    return rank in room.sources


def _notice_rank(ev: Any) -> int:
    if ev.trigger == "peer_lost":
        return int(ev.peer_rank)
    if ev.trigger in ("failure_received", "writes_drained"):
        return int(ev.prefill_rank)
    return int(ev.rank)


@guard
def writers_remain(room: DecodeRoom, ev: Any) -> bool:
    """Some source may still write into our pages (a source that died cannot)."""
    lost = _notice_rank(ev) if ev.trigger == "peer_lost" else None
    return any(s != lost for s in room.sources)


@guard
def drain_pending(room: DecodeRoom, ev: Any) -> bool:
    """The confirming (or dead) source is one the fence still waits for."""
    return _notice_rank(ev) in room.undrained


@guard
def drain_completes(room: DecodeRoom, ev: Any) -> bool:
    """It is the last source the fence waits for."""
    return room.undrained == {_notice_rank(ev)}


@guard
def aux_repeat(room: DecodeRoom, ev: Any) -> bool:
    return ev.src in room.aux_done


# ====================================================================== decode actions


@action("record_alloc")
def record_alloc(room: DecodeRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    room.pages = ev.pages
    room.aux_slot = ev.aux_slot
    room.tokens = ev.tokens or len(ev.pages) * room.page_size


@action("announce_pages")
def announce_pages(room: DecodeRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    for src in room.sources:
        msg = RoomPages(room.room, room.rank, room.pages, room.aux_slot, room.required_dests, room.tokens)
        ctx.out.append(SendMessage(src, msg))


@action("record_chunk")
def record_chunk(room: DecodeRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    room.received.setdefault(ev.src, {})[ev.chunk_id] = (ev.token_start, ev.num_tokens, ev.is_last)
    if ev.is_last:
        room.last_count[ev.src] = ev.chunk_id + 1


@action("record_aux")
def record_aux(room: DecodeRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    room.aux_done.add(ev.src)


@action("fence")
def fence(room: DecodeRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    """Keep the pages until every source that may still write confirms (a dead one cannot write)."""
    lost = _notice_rank(ev) if ev is not None and ev.trigger == "peer_lost" else None
    room.undrained = {s for s in room.sources if s != lost}


@action("record_drained")
def record_drained(room: DecodeRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    room.undrained.discard(_notice_rank(ev))


@action("tell_prefill")
def tell_prefill(room: DecodeRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    """ABORT to every source (SGLang D9/D11) so prefill stops writing into our pages."""
    for src in room.sources:
        ctx.out.append(SendMessage(src, AbortNotice(room.room, room.rank, "decode", room.failure or arg)))
