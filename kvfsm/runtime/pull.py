"""Pull mode in the runtime: the engine's handles (``KVOffer`` on prefill, ``KVPuller`` on
decode) and how a decode rank carries out its reads.

A pull room runs the pull machines (spec/prefill_pull.toml, spec/decode_pull.toml) in the same
manager as push rooms: the room's ``RoomRuntime.machine`` says which. Prefill offers a request's
pages once its KV is complete and keeps them until ``clear()`` is accepted (``pages_in_use``);
decode claims, is granted, and reads. A read is described like a push write (whole pages without
a layout, a plan between the two layouts with one), with the source and destination swapped,
and handed to the data plane with what is left of its deadline: the data plane cancels it there
(``DataPlane.read(..., within_s=)``), and one that cannot start before it fails at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvfsm.layout import verify_plan
from kvfsm.protocol import LocalProtocolError
from kvfsm.protocol.actions import PostRead
from kvfsm.protocol.events import Abort, PagesAllocated, ReadCompleted, ReadFailed
from kvfsm.protocol.rooms import PullSource
from kvfsm.runtime.manager import RoomHandle, RoomRuntime, log
from kvfsm.runtime.pages import as_index, as_pages, coalesce
from kvfsm.transport.base import Segment, SegmentArray

if TYPE_CHECKING:
    from kvfsm.runtime.decode import DecodeManager
    from kvfsm.runtime.prefill import PrefillManager

READ = "read"  # first item of a read's completion tag: (READ, room, prefill rank)


class KVOffer(RoomHandle):
    """One request's KV on one prefill rank in pull mode, as the engine sees it: decode ranks
    read its pages. The engine keeps the pages while ``pages_in_use()``; ``clear()`` is refused
    until then."""

    __slots__ = ()
    manager: PrefillManager

    def pages_in_use(self) -> bool:
        """A decode rank may still read the pages: not concluded, or failed while its lease
        runs (a granted read may be in flight)."""
        with self.manager._lock:
            rt = self.manager._rooms.get(self.room)
            if rt is None:
                return False
            room = rt.room
            return room.state not in ("Success", "Failed") or "lease" in room.timers


class KVPuller(RoomHandle):
    """One request on one decode rank in pull mode, as the engine sees it: it reads the
    request's KV from the prefill ranks into the pages given to ``init``."""

    __slots__ = ()
    manager: DecodeManager

    def init(self, pages: Sequence[int] | Any, tokens: int | None = None) -> None:
        """The pages the engine allocated for the request (they must hold its tokens exactly;
        None: every token of them). May come before or after the grants; the reads start once
        both are there. Raises LocalProtocolError once the room concluded or for pages outside
        the region."""
        pages = as_pages(pages)
        n = len(pages) * self.manager.page_size if tokens is None else as_index(tokens, "tokens")
        self.manager._local(self.room, PagesAllocated(pages, 0, n))

    def pages_in_use(self) -> bool:
        """A read may still land in the pages: keep them (clear() is refused)."""
        with self.manager._lock:
            rt = self.manager._rooms.get(self.room)
            return bool(rt is not None and rt.room.reading)


def offer(manager: PrefillManager, rid: int, pages: Sequence[int] | Any, tokens: int | None) -> KVOffer:
    """``PrefillManager.create_offer``: the room, its early claims replayed."""
    pages = as_pages(pages)
    size = manager.page_size
    n = len(pages) * size if tokens is None else as_index(tokens, "tokens")
    if not pages or -(-n // size) != len(pages):
        raise LocalProtocolError(f"{len(pages)} pages of {size} tokens cannot hold exactly {n} tokens")
    if min(pages) < 0 or max(pages) >= manager.kv_pages or len(set(pages)) != len(pages):
        raise LocalProtocolError(f"pages must be distinct and below {manager.kv_pages}")
    with manager._lock:
        decision = manager._new_room(rid, PullSource(rid, manager.rank, pages, n, size), manager.pull_machine)
        if decision.abort:
            manager._dispatch(rid, Abort(manager._failures.pop(rid, "claim expired")))
        if decision.replay:
            for _peer, event in manager._early.pop(rid):
                manager._dispatch(rid, event)
    return KVOffer(manager, rid)


def read_segments(manager: DecodeManager, a: PostRead) -> Sequence[Segment]:
    """The byte runs of read ``a``: prefill rank ``a.src_rank``'s pages (``src``, its offsets)
    into ours (``dst``)."""
    if manager.layout is None:
        if len(a.src_pages) != a.tokens or len(a.dst_pages) != a.tokens:
            raise LocalProtocolError("without a KV layout a page is a token: the page lists must match the tokens")
        return coalesce(a.src_pages, a.dst_pages, manager.page_bytes)
    planner = manager._planners.get(a.src_rank)
    if planner is None:
        raise LocalProtocolError(f"prefill rank {a.src_rank} declared no KV layout to plan a read from")
    plan = planner.plan(a.src_pages, a.dst_pages, 0, a.tokens)
    if manager.config.verify_plans:
        first, n = planner.span(0, a.tokens)
        verify_plan(plan, planner.src, planner.dst, a.src_pages, a.dst_pages, first, n, planner.mapping)
    return SegmentArray(*plan.segments(planner.src, planner.dst))


def post_read(manager: DecodeManager, rt: RoomRuntime, a: PostRead) -> None:
    """Carry out a PostRead (the lock held): refused at once if its deadline leaves no time;
    else handed to the data plane with the rest of its deadline. A read that cannot be
    described or posted fails its room (as ReadFailed, after the step)."""
    tag = (READ, a.room, a.src_rank)
    within = a.deadline - manager.clock()
    try:
        if within <= 0:
            raise LocalProtocolError(f"the lease ended {-within:.3f}s before the read could start")
        peer = manager._peer_name(a.src_rank)
        if peer is None:
            raise LocalProtocolError(f"no route to prefill rank {a.src_rank}")
        segments = read_segments(manager, a)
        note = manager.codec.encode(a.notification)
        moved = manager.endpoint.read(peer, "kv", segments, note, tag, within)
    except Exception as exc:  # noqa: BLE001 - the read fails, not the step (the room has moved on)
        manager.telemetry.count("read_errors")
        log.warning("decode%d room %d: read from prefill rank %d failed: %r", manager.rank, a.room, a.src_rank, exc)
        manager._queue.append((a.room, ReadFailed(a.src_rank, f"{type(exc).__name__}: {exc}")))
        return
    rt.bytes += moved
    rt.descriptors += len(segments)
    manager.telemetry.count3("reads_posted", 1, "descriptors", len(segments), "bytes_read", moved)


def read_completed(manager: DecodeManager, tag: tuple[Any, ...], ok: bool, reason: str) -> None:
    """The data plane's report of read ``tag`` (the lock held)."""
    _, rid, src = tag
    if rid not in manager._rooms:
        manager._count_drop("completion_for_gone_room", f"read of room {rid}")
        return
    manager._dispatch(rid, ReadCompleted(src) if ok else ReadFailed(src, reason or "read failed"))


__all__ = ["READ", "KVOffer", "KVPuller", "offer", "post_read", "read_completed", "read_segments"]
