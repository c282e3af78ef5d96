"""Guard and action functions named in spec/*.toml.

Theory of operation: a guard is ``guard(room, event) -> bool`` and must be pure. An action is
``action(room, event, ctx, arg)``: it updates the room's declared fields and appends the actions
the runtime must carry out to ``ctx.out``. Neither ever sends, sleeps, reads a clock or touches
memory; time is ``ctx.now``. ``arg`` is the text after ``:`` in the spec (``arm:transfer``).

The registry maps spec names to functions; an unknown name fails when machines are built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvfsm.protocol.actions import (
    Action,
    CancelTimer,
    PostAuxWrite,
    PostWrite,
    RecordIgnored,
    SendMessage,
    SetTimer,
)
from kvfsm.protocol.events import AUX_WRITE, ChunkReady
from kvfsm.protocol.pages import RUN_MIN, Pages, page_summary
from kvfsm.protocol.rooms import Announcement, DecodeRoom, PrefillRoom
from kvfsm.protocol.wire import AbortNotice, AuxWritten, ChunkWritten, Drained, RoomFailed, RoomPages


@dataclass(slots=True)
class StepContext:
    now: float
    timeouts: dict[str, float]
    source: str = ""  # the state the room was in when the event arrived
    error: str = ""  # set for the on_remote_error row: why no row accepted the event
    out: list[Action] = field(default_factory=list)


Guard = Callable[[Any, Any], bool]
ActionFn = Callable[[Any, Any, StepContext, str], None]

GUARDS: dict[str, Guard] = {}
ACTIONS: dict[str, ActionFn] = {}
EXPLAIN: dict[str, Callable[[Any, Any], str]] = {}

# What the text after ":" may be, checked when machines are built: "timer" (a timer of the
# machine), "text" (free text), a tuple of allowed words; actions not listed take no argument.
ACTION_ARGS: dict[str, str | tuple[str, ...]] = {
    "arm": "timer",
    "arm_once": "timer",
    "cancel": "timer",
    "fail": "text",
    "ignore": "text",
    "tell_decode": ("failed", "aborted"),
    "tell_announcer": ("failed", "aborted"),
    "tell_prefill": ("aborted",),
}


def guard(fn: Guard) -> Guard:
    GUARDS[fn.__name__] = fn
    return fn


def action(name: str) -> Callable[[ActionFn], ActionFn]:
    def register(fn: ActionFn) -> ActionFn:
        ACTIONS[name] = fn
        return fn

    return register


def _distinct(pages: Pages) -> bool:
    return page_summary(pages)[2]


def _within(pages: Pages, limit: int) -> bool:
    """Every page index is in [0, limit)."""
    lo, hi, _, _ = page_summary(pages)
    return not pages or (lo >= 0 and hi < limit)


# ====================================================================== prefill guards


@guard
def announce_repeat(room: PrefillRoom, ev: Any) -> bool:
    """The same decode rank announced exactly this before (a duplicated room_pages)."""
    known = room.dests.get(ev.dest_rank)
    return (
        known is not None
        and known.pages == ev.pages
        and known.aux_slot == ev.aux_slot
        and known.tokens == (ev.tokens or len(ev.pages) * ev.peer_page_size)
        and room.required_dests == ev.required_dests
    )


def _announce_problem(room: PrefillRoom, ev: Any) -> str:
    if ev.peer_kv_pages == 0:
        return f"decode rank {ev.dest_rank} announced pages without a registered region"
    if ev.dest_rank in room.dests:
        return f"decode rank {ev.dest_rank} announced different pages twice"
    if ev.required_dests < 1 or (room.required_dests and ev.required_dests != room.required_dests):
        return f"required_dests {ev.required_dests} disagrees with {room.required_dests or 'at least 1'}"
    if len(room.dests) >= ev.required_dests:
        return f"more than {ev.required_dests} decode ranks announced"
    bad = [] if _within(ev.pages, ev.peer_kv_pages) else [p for p in ev.pages if p >= ev.peer_kv_pages]
    if bad:
        return f"pages {bad[:4]} outside decode rank {ev.dest_rank}'s {ev.peer_kv_pages} registered pages"
    if not _distinct(ev.pages):
        return "a page is announced twice"
    if ev.aux_slot >= ev.peer_aux_slots:
        return f"aux slot {ev.aux_slot} outside {ev.peer_aux_slots} registered slots"
    ps = ev.peer_page_size
    if ps < 1:
        return f"decode rank {ev.dest_rank} registered {ps} tokens per page"
    tokens = ev.tokens or len(ev.pages) * ps
    if -(-tokens // ps) != len(ev.pages):
        return f"{len(ev.pages)} pages of {ps} tokens do not hold exactly {tokens} tokens"
    known = {a.tokens for a in room.dests.values()}
    if known and tokens not in known:
        return f"{tokens} tokens announced, other decode ranks announced {sorted(known)}"
    return ""


@guard
def announce_valid(room: PrefillRoom, ev: Any) -> bool:
    """room_pages is within the peer's registered region, its pages hold exactly its tokens, and
    it is consistent with earlier ones."""
    return not _announce_problem(room, ev)


EXPLAIN["invalid room_pages"] = _announce_problem


@guard
def announce_completes(room: PrefillRoom, ev: Any) -> bool:
    """With this announcement every expected decode rank has announced."""
    return bool(len(room.dests) + 1 == ev.required_dests)


def _fits(dests: Iterable[Announcement], page_size: int, start: int, n: int, last: bool) -> bool:
    """A chunk of ``n`` pages of ``page_size`` tokens from token ``start`` fits every announcement:
    a chunk ends inside the room's tokens, and the last one ends at its last token (its last page
    may be partly used; an empty last chunk starts there)."""
    end = start + n * page_size
    for d in dests:
        t = d.tokens
        if last:
            if (start != t) if n == 0 else not (end - page_size < t <= end):
                return False
        elif end > t:
            return False
    return True


@guard
def held_fit_after_announce(room: PrefillRoom, ev: Any) -> bool:
    """The held chunks, each in turn, fit the pages of every decode rank (the last one exactly,
    if it is held)."""
    dests = [*room.dests.values(), Announcement.of(ev.pages, ev.aux_slot, ev.tokens, ev.peer_page_size)]
    start, ps = room.cursor, room.page_size
    for c in room.held:
        n = len(c.pages)
        if not _fits(dests, ps, start, n, c.is_last):
            return False
        start += n * ps
    return True


@guard
def held_has_last(room: PrefillRoom, ev: Any) -> bool:
    return any(c.is_last for c in room.held)


def _chunk_problem(room: PrefillRoom, ev: ChunkReady) -> str:
    if room.last_seen:
        return "send() after the last chunk"
    if not ev.pages and not ev.is_last:
        return "an empty chunk that is not the last"
    if ev.is_last != (ev.aux_slot is not None):
        return "the last chunk, and only the last, carries aux_slot"
    if ev.aux_slot is not None and not 0 <= ev.aux_slot < room.aux_slots:
        return f"aux_slot {ev.aux_slot} outside the {room.aux_slots} registered slots"
    pages = ev.pages
    if pages:
        lo, hi, distinct, _ = page_summary(pages)  # (as _within and _distinct read it, once)
        if lo < 0 or hi >= room.kv_pages:
            return f"pages outside the {room.kv_pages} registered pages"
        if not distinct:
            return "a page appears twice in one chunk"
    return ""


@guard
def chunk_ok(room: PrefillRoom, ev: ChunkReady) -> bool:
    """The engine's chunk is well formed (local pages registered, aux on the last chunk only)."""
    return not _chunk_problem(room, ev)


EXPLAIN["chunk_ok"] = _chunk_problem


@guard
def chunk_fits(room: PrefillRoom, ev: ChunkReady) -> bool:
    """The chunk fits every announcement; the last one ends exactly at the room's last token."""
    return _fits(room.dests.values(), room.page_size, room.cursor, len(ev.pages), ev.is_last)


@guard
def chunk_is_last(room: PrefillRoom, ev: ChunkReady) -> bool:
    return ev.is_last


@guard
def writes_outstanding(room: PrefillRoom, ev: Any) -> bool:
    """A posted write has not completed yet: it may still read the source pages."""
    return bool(room.inflight)


EXPLAIN["writes_outstanding"] = lambda room, ev: (
    f"{len(room.inflight)} posted writes still read the source pages; clear() after they complete"
    if room.inflight
    else ""
)


@guard
def write_pending(room: PrefillRoom, ev: Any) -> bool:
    return (ev.dest_rank, ev.chunk_id) in room.inflight


@guard
def write_is_final(room: PrefillRoom, ev: Any) -> bool:
    """This completion is the only write still outstanding (everything else already completed)."""
    return len(room.inflight) == 1 and (ev.dest_rank, ev.chunk_id) in room.inflight


# ====================================================================== prefill actions


@action("record_dest")
def record_dest(room: PrefillRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    room.dests[ev.dest_rank] = Announcement.of(ev.pages, ev.aux_slot, ev.tokens, ev.peer_page_size)
    room.required_dests = ev.required_dests


@action("hold_chunk")
def hold_chunk(room: PrefillRoom, ev: ChunkReady, ctx: StepContext, arg: str) -> None:
    room.held.append(ev)
    room.last_seen = ev.is_last


def advance(room: PrefillRoom, chunk: ChunkReady) -> tuple[int, ChunkWritten, list[tuple[int, Pages, bool]]]:
    """Take ``chunk`` as the room's next one: (its chunk id, its notification, the same for
    every decode rank, and per decode rank in rank order (rank, its pages that hold the chunk's
    tokens, whether both page lists are one ascending run each of the same page size: then
    page i goes to page i)). The chunk is the tokens from the cursor to the end of its pages,
    or to the room's last token. The cursor, the next chunk id, the pending writes (the KV;
    with the last chunk the aux write too) and ``last_seen`` advance."""
    chunk_id = room.next_chunk
    pages = chunk.pages
    n = len(pages)
    start = room.cursor
    ps = room.page_size
    dests = room.dests
    stop = start + n * ps
    if n and ps != 1:
        stop = min(stop, next(iter(dests.values())).tokens)  # the last page may be partly used
    note = ChunkWritten(room.room, room.rank, chunk_id, chunk.is_last, start, stop - start)
    run = page_summary(pages)[3]  # one ascending run: with the dest's pages one too, one segment
    inflight = room.inflight
    writes = []
    for dest, ann in dests.items() if len(dests) == 1 else sorted(dests.items()):
        dp = ann.page_size
        if dp == 1:
            lo, hi = start, stop
        else:  # the pages holding tokens [start, stop): the first and last may be shared with other chunks
            lo, hi = start // dp, (-(-stop // dp) if stop > start else start // dp)
        dst = (ann.span if hi - lo >= RUN_MIN and ann.span is not None else ann.pages)[lo:hi]
        writes.append((dest, dst, ann.run and run and dp == ps))
        inflight.add((dest, chunk_id))
        if chunk.is_last:
            inflight.add((dest, AUX_WRITE))
    room.cursor = stop
    room.next_chunk = chunk_id + 1
    room.last_seen = chunk.is_last
    return chunk_id, note, writes


def aux_write(room: PrefillRoom, chunk: ChunkReady, dest: int) -> PostAuxWrite:
    """The aux write that goes with the last chunk ``chunk`` to decode rank ``dest``."""
    assert chunk.aux_slot is not None  # chunk_ok
    return PostAuxWrite(room.room, dest, chunk.aux_slot, room.dests[dest].aux_slot, AuxWritten(room.room, room.rank))


def _post(room: PrefillRoom, chunk: ChunkReady, out: list[Action]) -> None:
    """Post ``chunk``'s writes (and the aux writes, with the last chunk) to every decode rank:
    actions appended to ``out`` (see ``advance``)."""
    chunk_id, note, writes = advance(room, chunk)
    for dest, dst, contiguous in writes:
        out.append(PostWrite(room.room, dest, chunk_id, chunk.pages, dst, note, contiguous))
        if chunk.is_last:
            out.append(aux_write(room, chunk, dest))


@action("post_chunk")
def post_chunk(room: PrefillRoom, ev: ChunkReady, ctx: StepContext, arg: str) -> None:
    _post(room, ev, ctx.out)


@action("post_held")
def post_held(room: PrefillRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    held, room.held = room.held, []
    for chunk in held:
        _post(room, chunk, ctx.out)


@action("complete_write")
def complete_write(room: PrefillRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    room.inflight.discard((ev.dest_rank, ev.chunk_id))


@action("tell_decode")
def tell_decode(room: PrefillRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    """Tell every decode rank that announced (and so holds pages for this room) why it failed,
    including one whose room_pages is being rejected (P2, on_remote_error): it holds pages too,
    and would otherwise wait for its transfer timeout (#36033)."""
    reason = room.failure or arg
    dests = set(room.dests)
    if getattr(ev, "trigger", None) == "pages_announced":
        dests.add(ev.dest_rank)
    for dest in sorted(dests):
        ctx.out.append(SendMessage(dest, _prefill_notice(room, arg, reason)))


@action("tell_announcer")
def tell_announcer(room: PrefillRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    """Tell a decode rank that announced after the failure. Its pages may be released at once
    unless a write to it is still outstanding (a duplicated room_pages of a known dest: then
    tell_drained confirms when the last completion arrives)."""
    ctx.out.append(SendMessage(ev.dest_rank, _prefill_notice(room, arg, room.failure or arg)))
    if not any(dest == ev.dest_rank for dest, _ in room.inflight):
        ctx.out.append(SendMessage(ev.dest_rank, Drained(room.room, room.rank)))


@action("tell_drained")
def tell_drained(room: PrefillRoom, ev: Any, ctx: StepContext, arg: str) -> None:
    """Once no posted write is outstanding, tell every decode rank it may release its pages. A
    rejected announcer (never recorded, never written to) is told at once."""
    if ev is not None and ev.trigger == "pages_announced" and ev.dest_rank not in room.dests:
        ctx.out.append(SendMessage(ev.dest_rank, Drained(room.room, room.rank)))
    elif ev is not None and ev.trigger == "abort_received" and ev.side == "decode" and ev.rank not in room.dests:
        ctx.out.append(SendMessage(ev.rank, Drained(room.room, room.rank)))  # never recorded, never written
    if not room.inflight:
        for dest in sorted(room.dests):
            ctx.out.append(SendMessage(dest, Drained(room.room, room.rank)))


def _prefill_notice(room: PrefillRoom, kind: str, reason: str) -> AbortNotice | RoomFailed:
    if kind == "aborted":
        return AbortNotice(room.room, room.rank, "prefill", reason)
    return RoomFailed(room.room, room.rank, reason)


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


# ====================================================================== shared actions


@action("arm")
def arm(room: Any, ev: Any, ctx: StepContext, arg: str) -> None:
    room.timers.add(arg)
    ctx.out.append(SetTimer(arg, ctx.now + ctx.timeouts[arg]))


@action("arm_once")
def arm_once(room: Any, ev: Any, ctx: StepContext, arg: str) -> None:
    if arg not in room.timers:
        arm(room, ev, ctx, arg)


@action("cancel")
def cancel(room: Any, ev: Any, ctx: StepContext, arg: str) -> None:
    if arg in room.timers:
        room.timers.discard(arg)
        ctx.out.append(CancelTimer(arg))


@action("cancel_timers")
def cancel_timers(room: Any, ev: Any, ctx: StepContext, arg: str) -> None:
    for t in sorted(room.timers):
        ctx.out.append(CancelTimer(t))
    room.timers.clear()


@action("ignore")
def ignore(room: Any, ev: Any, ctx: StepContext, arg: str) -> None:
    ctx.out.append(RecordIgnored(f"{arg} ({ev.trigger} in {ctx.source})"))


def _event_detail(ev: Any, ctx: StepContext) -> str:
    if ev.trigger.endswith("_timeout"):
        return f"{ev.timer} timer expired in {ctx.source}"
    reason = getattr(ev, "reason", None)
    if reason is not None:
        return f"{ev.trigger}: {reason}"
    return f"{ev.trigger} in {ctx.source}"


@action("fail")
def fail(room: Any, ev: Any, ctx: StepContext, arg: str) -> None:
    """Record why the room failed. The reason is what failure_exception() reports."""
    if arg == "protocol_error":
        detail = ctx.error
    else:
        explain = EXPLAIN.get(arg)
        detail = (explain(room, ev) if explain else "") or _event_detail(ev, ctx)
    room.failure = f"{arg}: {detail}"
