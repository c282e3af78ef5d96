"""Guards and actions of pull mode (spec/prefill_pull.toml, spec/decode_pull.toml).

Theory of operation
-------------------
In pull mode decode reads prefill's pages. The danger is a read that lands after prefill freed
them (vLLM frees on a timeout measured from the end of prefill, whatever decode is doing). Here
prefill frees only when every reader said it is done, or when its lease ends; and decode posts a
read only with a deadline no later than the lease's end *as decode can bound it*:

* decode notes when it sends each claim (epoch 1, 2, ...); prefill, on a claim's arrival,
  re-arms its lease timer for the lease's length and grants, echoing the epoch;
* once every source granted an epoch, the lease ends for decode at ``sent(e) + length * (1 -
  LEASE_SKEW)``, ``e`` the oldest of the epochs they granted: each source's lease runs at least
  ``length`` from the arrival of that claim, which is later than its sending. ``LEASE_SKEW``
  covers clocks that run at slightly different rates;
* every read is posted with that end as its deadline; the runtime refuses a read that cannot
  end by then and the transport cancels one still in flight there;
* decode forgets a claim once two newer ones went out (``KEPT_CLAIMS``): a grant of an older
  epoch is stale, so a grant that took longer than two renewal periods to come back never opens
  a window that is already closing (with the renewal period well below the lease, the last two
  claims' leases leave at least the read budget).

So no read is in flight when a lease ends, whatever the delays of claims and grants. A room
that fails keeps its lease running (prefill) or its pages reserved (decode) until the reads are
over; ``clear`` waits for that.
"""

from __future__ import annotations

from typing import Any

from kvfsm.protocol.actions import PostRead, SendMessage, SetTimer
from kvfsm.protocol.events import LeaseClaimed, LeaseGranted, PagesAllocated, ReadCompleted
from kvfsm.protocol.functions import ACTION_ARGS, EXPLAIN, StepContext, _distinct, _within, action, guard
from kvfsm.protocol.rooms import Grant, PullSink, PullSource
from kvfsm.protocol.wire import LeaseClaim, LeaseGrant, LeaseRelease, ReadsDone, RoomFailed

LEASE_SKEW = 0.01  # the part of a lease decode does not count on (clock rates; NTP slews at most 0.05%)
KEPT_CLAIMS = 2  # decode's claims whose grants it still takes: the newest and the one before

ACTION_ARGS.update({"tell_readers": ("failed", "aborted"), "tell_claimant": ("failed",)})


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


# ====================================================================== prefill (prefill_pull)


def _claim_problem(room: PullSource, ev: LeaseClaimed) -> str:
    if ev.readers < 1:
        return "a claim must count at least one reader"
    if room.readers and ev.readers != room.readers:
        return f"claim counts {ev.readers} readers, an earlier one {room.readers}"
    if ev.decode_rank not in room.claimants and len(room.claimants) >= ev.readers:
        return f"decode rank {ev.decode_rank} claims as reader {len(room.claimants) + 1} of {ev.readers}"
    if ev.tokens and ev.tokens != room.tokens:
        return f"decode expects {ev.tokens} tokens, the room holds {room.tokens}"
    return ""


@guard
def claim_valid(room: PullSource, ev: LeaseClaimed) -> bool:
    """The claim agrees with the room and the earlier claims (readers, tokens)."""
    return not _claim_problem(room, ev)


EXPLAIN["claim_valid"] = EXPLAIN["invalid claim"] = _claim_problem


@guard
def reader_done_repeat(room: PullSource, ev: Any) -> bool:
    """This reader's end was already recorded (a duplicated notification or release)."""
    return ev.decode_rank in room.done


@guard
def readers_done_after(room: PullSource, ev: Any) -> bool:
    """With this report every reader that claimed is done, and all of them claimed."""
    done = (room.done | {ev.decode_rank}) & room.claimants
    return room.readers > 0 and len(done) >= room.readers


@guard
def lease_live(room: PullSource, ev: Any) -> bool:
    """The lease timer runs: a granted read may be in flight."""
    return "lease" in room.timers


@guard
def lost_peer_reads(room: PullSource, ev: Any) -> bool:
    """The lost decode rank claimed this room and is not done with it."""
    return ev.peer_rank in room.claimants and ev.peer_rank not in room.done


@action("record_claim")
def record_claim(room: PullSource, ev: LeaseClaimed, ctx: StepContext, arg: str) -> None:
    room.readers = ev.readers
    room.claimants.add(ev.decode_rank)


@action("grant")
def grant(room: PullSource, ev: LeaseClaimed, ctx: StepContext, arg: str) -> None:
    """Answer the claim with the pages, the tokens and the lease's length, echoing its epoch."""
    lease_ms = int(ctx.timeouts["lease"] * 1000)
    msg = LeaseGrant(room.room, room.rank, ev.epoch, lease_ms, room.pages, room.tokens, room.page_size)
    ctx.out.append(SendMessage(ev.decode_rank, msg))


@action("record_reader_done")
def record_reader_done(room: PullSource, ev: Any, ctx: StepContext, arg: str) -> None:
    if ev.decode_rank in room.claimants:
        room.done.add(ev.decode_rank)


@action("tell_claimant")
def tell_claimant(room: PullSource, ev: LeaseClaimed, ctx: StepContext, arg: str) -> None:
    ctx.out.append(SendMessage(ev.decode_rank, RoomFailed(room.room, room.rank, room.failure or arg)))


@action("tell_readers")
def tell_readers(room: PullSource, ev: Any, ctx: StepContext, arg: str) -> None:
    """Tell every reader not yet done that the room failed (or was aborted here)."""
    reason = room.failure or arg
    told = ev.decode_rank if isinstance(ev, LeaseClaimed) else None  # (tell_claimant told it)
    for rank in sorted(room.claimants - room.done):
        if rank != told:
            ctx.out.append(SendMessage(rank, RoomFailed(room.room, room.rank, reason)))


# ====================================================================== decode (decode_pull)


def _grant_problem(room: PullSink, ev: LeaseGranted) -> str:
    if ev.epoch not in room.claims:  # (older epochs than open_window keeps are stale: G1)
        return f"grant of epoch {ev.epoch}, never claimed (newest claim {room.epoch})"
    if ev.lease_ms <= 0:
        return "grant of an empty lease"
    if ev.tokens <= 0:
        return "grant of no tokens"
    if ev.page_size <= 0:
        return "grant of pages of no tokens"
    need = _pages_for(ev.tokens, ev.page_size)
    if len(ev.pages) != need or not _distinct(ev.pages):
        return f"{len(ev.pages)} pages for {ev.tokens} tokens of {ev.page_size} a page (need {need} distinct)"
    for src, g in room.grants.items():
        if src != ev.prefill_rank and g.tokens != ev.tokens:
            return f"prefill rank {ev.prefill_rank} grants {ev.tokens} tokens, rank {src} {g.tokens}"
    if room.tokens and ev.tokens != room.tokens:
        return f"grant of {ev.tokens} tokens, decode expects {room.tokens}"
    return ""


@guard
def grant_stale(room: PullSink, ev: LeaseGranted) -> bool:
    """From a rank we do not read from, or no newer than the grant recorded for it."""
    if ev.prefill_rank not in room.sources:
        return True
    if 0 < ev.epoch < room.epoch and ev.epoch not in room.claims:  # forgotten: too old to use
        return True
    g = room.grants.get(ev.prefill_rank)
    return g is not None and ev.epoch <= g.epoch


@guard
def grant_valid(room: PullSink, ev: LeaseGranted) -> bool:
    """The grant answers a claim we sent and its pages hold the tokens we expect."""
    return not _grant_problem(room, ev)


EXPLAIN["grant_valid"] = EXPLAIN["invalid grant"] = _grant_problem


@guard
def grants_complete_after(room: PullSink, ev: LeaseGranted) -> bool:
    return set(room.sources) <= set(room.grants) | {ev.prefill_rank}


def _lease_end(room: PullSink, grants: dict[int, Grant]) -> float:
    """The lease's end for decode with ``grants`` (every source's newest; see open_window); 0 when
    the oldest of them answers a claim already forgotten (no lease to count on)."""
    sent = room.claims.get(min(g.epoch for g in grants.values()))
    if sent is None:
        return 0.0
    return sent + min(g.lease_s for g in grants.values()) * (1 - LEASE_SKEW)


@guard
def lease_extended_after(room: PullSink, ev: LeaseGranted) -> bool:
    """With this grant recorded, the lease ends later than the one the room has (the first
    complete set of grants, or a renewal every source has now granted)."""
    g = Grant(ev.epoch, ev.lease_ms / 1000, ev.pages, ev.tokens, ev.page_size)
    return _lease_end(room, room.grants | {ev.prefill_rank: g}) > room.lease_end


@guard
def pages_known(room: PullSink, ev: Any) -> bool:
    return room.pages is not None


def _pages_problem(room: PullSink, ev: PagesAllocated) -> str:
    if not _distinct(ev.pages) or not _within(ev.pages, room.kv_pages):
        return f"pages must be distinct and below {room.kv_pages}"
    expected = room.tokens or next((g.tokens for g in room.grants.values()), 0)
    if ev.tokens and expected and ev.tokens != expected:
        return f"pages for {ev.tokens} tokens, the room has {expected}"
    tokens = ev.tokens or expected
    if tokens and len(ev.pages) != _pages_for(tokens, room.page_size):
        return f"{len(ev.pages)} pages for {tokens} tokens of {room.page_size} a page"
    if not ev.pages:
        return "no pages"
    return ""


@guard
def pull_pages_ok(room: PullSink, ev: PagesAllocated) -> bool:
    """Distinct pages inside the region that hold the room's tokens exactly."""
    return not _pages_problem(room, ev)


EXPLAIN["pull_pages_ok"] = EXPLAIN["invalid pages"] = _pages_problem


@guard
def window_open(room: PullSink, ev: Any) -> bool:
    """At least the read budget of the lease remains (the window timer has not fired)."""
    return "window" in room.timers


@guard
def read_pending(room: PullSink, ev: Any) -> bool:
    return ev.prefill_rank in room.reading


@guard
def reads_done_after(room: PullSink, ev: Any) -> bool:
    return set(room.sources) <= room.read | {ev.prefill_rank}


@guard
def reads_outstanding(room: PullSink, ev: Any) -> bool:
    return bool(room.reading)


@action("claim")
def claim(room: PullSink, ev: Any, ctx: StepContext, arg: str) -> None:
    """Claim (or renew) the lease of every source under a new epoch, noting when."""
    room.epoch += 1
    room.claims[room.epoch] = ctx.now
    room.claims.pop(room.epoch - KEPT_CLAIMS, None)
    for src in room.sources:
        ctx.out.append(SendMessage(src, LeaseClaim(room.room, room.rank, room.epoch, room.readers, room.tokens)))


@action("record_grant")
def record_grant(room: PullSink, ev: LeaseGranted, ctx: StepContext, arg: str) -> None:
    room.grants[ev.prefill_rank] = Grant(ev.epoch, ev.lease_ms / 1000, ev.pages, ev.tokens, ev.page_size)
    if not room.tokens:
        room.tokens = ev.tokens


@action("open_window")
def open_window(room: PullSink, ev: Any, ctx: StepContext, arg: str) -> None:
    """Every source granted: the lease ends for decode at the sending of the oldest granted
    epoch's claim plus the shortest lease (less the skew); the window closes the read budget
    before that."""
    oldest = min(g.epoch for g in room.grants.values())
    end = _lease_end(room, room.grants)
    for e in [e for e in room.claims if e < oldest]:
        del room.claims[e]
    if end <= room.lease_end:
        return
    room.lease_end = end
    room.timers.add("window")
    ctx.out.append(SetTimer("window", end - ctx.timeouts["window"]))


@action("record_pages")
def record_pages(room: PullSink, ev: PagesAllocated, ctx: StepContext, arg: str) -> None:
    room.pages = ev.pages
    if not room.tokens:
        room.tokens = ev.tokens or len(ev.pages) * room.page_size


@action("post_reads")
def post_reads(room: PullSink, ev: Any, ctx: StepContext, arg: str) -> None:
    """Read every source's pages into ours, each read due by the lease's end; the read timer
    backs the transport's cancellation up."""
    assert room.pages is not None
    note = ReadsDone(room.room, room.rank)
    for src in room.sources:
        g = room.grants[src]
        room.reading.add(src)
        ctx.out.append(PostRead(room.room, src, g.pages, room.pages, room.tokens, room.lease_end, note))
    room.timers.add("read")
    ctx.out.append(SetTimer("read", room.lease_end + ctx.timeouts["read"]))


@action("complete_read")
def complete_read(room: PullSink, ev: Any, ctx: StepContext, arg: str) -> None:
    room.reading.discard(ev.prefill_rank)
    if isinstance(ev, ReadCompleted):
        room.read.add(ev.prefill_rank)


def _release(room: PullSink, src: int, ctx: StepContext) -> None:
    ctx.out.append(SendMessage(src, LeaseRelease(room.room, room.rank, room.failure or "released")))


@action("release_idle")
def release_idle(room: PullSink, ev: Any, ctx: StepContext, arg: str) -> None:
    """Tell every source whose read is neither in flight nor landed that we are done with it
    (a landed read's notification already told its source). Nothing before the first claim."""
    if not room.epoch:
        return
    for src in room.sources:
        if src not in room.reading and src not in room.read:
            _release(room, src, ctx)


@action("release_source")
def release_source(room: PullSink, ev: Any, ctx: StepContext, arg: str) -> None:
    """The read from ``ev.prefill_rank`` ended without landing: release that source."""
    _release(room, ev.prefill_rank, ctx)
