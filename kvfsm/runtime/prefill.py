"""Prefill side: ``PrefillManager`` (one per prefill rank) and its per-room ``KVSender``."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from kvfsm.layout import KVLayout, Planner, RankMap
from kvfsm.protocol import LocalProtocolError, Protocol, fastpath
from kvfsm.protocol.actions import SendMessage
from kvfsm.protocol.events import (
    AUX_WRITE,
    Abort,
    ChunkReady,
    PeerLost,
    RegistrationReceived,
    WriteCompleted,
    WriteFailed,
)
from kvfsm.protocol.pages import Pages, run_of
from kvfsm.protocol.rooms import PrefillLink, PrefillRoom, PullSource
from kvfsm.protocol.routing import (
    DISPATCH,
    EXPIRED,
    STASH,
    expire,
    message_event,
    replies,
    route_completion,
    route_message,
)
from kvfsm.protocol.wire import (
    AbortNotice,
    ChunkWritten,
    LeaseClaim,
    LeaseRelease,
    Message,
    ReadsDone,
    Register,
    RegisterAck,
    RoomPages,
)
from kvfsm.runtime.manager import RoomHandle, RoomRuntime, log
from kvfsm.runtime.pages import as_index, as_pages
from kvfsm.runtime.posting import WritePoster
from kvfsm.runtime.pull import KVOffer, offer
from kvfsm.transport.base import Inbound


class KVSender(RoomHandle):
    """One room on one prefill rank, as the engine sees it (SGLang's KVSender)."""

    __slots__ = ()
    manager: PrefillManager

    def pages_in_use(self) -> bool:
        """Posted writes still read this room's source pages: keep them; clear() is refused."""
        with self.manager._lock:
            rt = self.manager._rooms.get(self.room)
            return bool(rt is not None and rt.room.inflight)

    def send(self, pages: Sequence[int] | Any, is_last: bool = False, aux_slot: int | None = None) -> None:
        """Hand over the next chunk: local page indices (a list, tuple or range of ints, or a 1-D
        integer numpy array or tensor); the last chunk carries the aux slot. Chunks ready before
        decode announced its pages are held (scenario 2). Raises LocalProtocolError on misuse (a
        chunk after the last, pages outside the KV region, indices that are not integers)."""
        slot = aux_slot if aux_slot is None or type(aux_slot) is int else as_index(aux_slot, "aux_slot")
        self.manager._chunk(self.room, as_pages(pages), is_last is True or bool(is_last), slot)


class PrefillManager(WritePoster):
    side = "prefill"

    def __init__(self, rank: int, endpoint: Any, protocol: Protocol | None = None, **kwargs: Any) -> None:
        super().__init__(rank, endpoint, protocol, **kwargs)
        self._link_machine = self.protocol.prefill_link
        self._wire_layout = self.layout.to_wire() if self.layout is not None else None
        # decode rank -> its link (prefill_link), which holds the registration it accepted
        self._links: dict[int, PrefillLink] = {}
        self._peer_ranks: dict[str, int] = {}
        self._early_order: deque[tuple[float, int]] = deque()

    def create_sender(self, room: int) -> KVSender:
        """Create room ``room`` on this rank. Messages that arrived for it earlier are applied now."""
        with self._lock:
            decision = self._new_room(room, PrefillRoom(room, self.rank, self.kv_pages, self.aux_slots, self.page_size))
            if decision.abort:
                # decode's announcement expired here and decode was told: the room cannot run
                self._dispatch(room, Abort(self._failures.pop(room, "announcement expired")))
            if decision.replay:
                for _peer, event in self._early.pop(room):
                    self._dispatch(room, event)
        return KVSender(self, room)

    def create_offer(self, room: int, pages: Sequence[int] | Any, tokens: int | None = None) -> KVOffer:
        """Pull mode: offer room ``room``, whose KV is complete in ``pages`` (they hold
        ``tokens`` exactly; None: every token of them), to the decode ranks that will read it.
        Claims that arrived for it earlier are applied now. Keep the pages while the offer's
        ``pages_in_use()``; raises LocalProtocolError for pages outside the region or that do
        not hold the tokens."""
        return offer(self, room, pages, tokens)

    def send_many(self, chunks: Iterable[Sequence[Any]]) -> None:
        """Hand over several rooms' next chunks at once: an engine's batch (every room of a
        forward step). Each item is ``(room, pages)``, ``(room, pages, is_last)`` or ``(room,
        pages, is_last, aux_slot)``, ``room`` a room id or its KVSender. The items are applied in
        order exactly as a loop of ``send()`` would apply them (a misuse raises
        LocalProtocolError after the items before it were applied; the items after it are not),
        except that the writes they post are handed to the data plane together (``write_many``:
        the NIXL data plane posts them at once, folded into as few transfers as its limits
        allow, instead of one at a time): at the end, and whenever ``RuntimeConfig.batch_bytes``
        or ``batch_segments`` are pending (large chunks, and scattered ones, which cost the most
        to post, start moving while the rest of the batch is stepped). Aux writes always go at
        the end, together."""
        with self._lock:
            outer = self._batch
            if outer is None:
                self._batch, self._batch_bytes, self._batch_segments = [], 0, 0
            try:
                for item in chunks:
                    self._chunk(*self._chunk_item(item))
            finally:
                if outer is None:
                    batch, self._batch = self._batch, None
                    aux, self._batch_aux = self._batch_aux, []
                    runs, self._batch_runs = self._batch_runs, 0
                    if runs:  # the one-segment writes _post_run added, counted as _hand counts a write
                        self.telemetry.count2("writes_posted", runs, "descriptors", runs)
                    self._hand_batch([*(batch or []), *aux])

    def _chunk_item(self, item: Sequence[Any]) -> tuple[int, Pages, bool, int | None]:
        """One send_many() item normalised as ``send()`` normalises its arguments: (room id,
        pages, is_last, aux slot); LocalProtocolError if malformed."""
        if not 2 <= len(item) <= 4:
            raise LocalProtocolError(f"send_many: an item is (room, pages[, is_last[, aux_slot]]), not {item!r}")
        room = item[0]
        if isinstance(room, KVSender):
            if room.manager is not self:
                raise LocalProtocolError(f"send_many: room {room.room}'s sender belongs to another manager")
            room = room.room
        k = len(item)
        slot = item[3] if k > 3 else None
        if slot is not None and type(slot) is not int:
            slot = as_index(slot, "aux_slot")
        rid = room if type(room) is int else as_index(room, "room")
        return rid, as_pages(item[1]), k > 2 and (item[2] is True or bool(item[2])), slot

    def _chunk(self, rid: int, pages: Pages, is_last: bool, aux_slot: int | None) -> None:
        """The engine's chunk, its pages normalised once at the API boundary (``as_pages``: the
        one form the rest of the path carries): row P11 or P10 applied directly where it is the
        row taken (``fastpath.chunk``, the one fast path), its writes posted as the row's actions
        would post them; else the generic step of ``ChunkReady`` (``_local``: misuse raises
        LocalProtocolError, the room unchanged)."""
        with self._lock:
            rt = self._rooms.get(rid)
            if (
                rt is not None
                and rt.machine is self.machine
                and self.fast_rows
                and not self._draining
                and not self._queue
            ):
                before = rt.room.state
                done = fastpath.chunk(rt.room, pages, is_last, aux_slot)
                if done is not None:
                    if len(done) == 8:  # RunPosts: one write of one run to one decode rank
                        self._run_posted(rt, aux_slot if is_last else None, done, before)
                    else:
                        self._chunk_posted(rt, pages, done, before)
                    return
            self._local(rid, ChunkReady(pages, is_last, aux_slot))

    def _run_posted(self, rt: RoomRuntime, aux_slot: int | None, done: fastpath.RunPosts, before: str) -> None:
        """Carry out row P11 or P10 taken directly as one write of one run (``fastpath.chunk``'s
        RunPosts) as ``_chunk_posted`` carries out the row (the room's change of state, the
        timers), its write and, with the last chunk, its aux write posted as ``_post_kv`` and
        ``_post`` would post them (``_post_run``), from their fields: no segment list, page
        tuple or notification object is built. The lock held."""
        chunk_id, dest, first, n, dst_first, start, cancelled, dst_slot = done
        rid = rt.room.room
        self._row_taken(rt, before, cancelled)
        self._draining = self._fast_posting = True  # as _chunk_posted: completions meanwhile
        try:
            page = self.page_bytes
            tag = (rid, dest, chunk_id)
            if self.layout is not None:  # (a layout of one token per page: the run is planned)
                written = ChunkWritten(rid, rt.room.rank, chunk_id, aux_slot is not None, start, n)
                self._post_kv(rt, dest, chunk_id, run_of(first, n), run_of(dst_first, n), written, True)
            else:
                try:
                    note = self._pack_note(rid, rt.room.rank, chunk_id, aux_slot is not None, start, n)
                except Exception as exc:  # noqa: BLE001 - as _post_kv: the write fails, not the step
                    self._fail_write(tag, exc)
                else:
                    self._post_run(rt, tag, "kv", first * page, dst_first * page, n * page, note)
            if aux_slot is not None:
                tag = (rid, dest, AUX_WRITE)
                size = self.aux_slot_bytes
                try:
                    note = self._pack_aux(rid, rt.room.rank)
                except Exception as exc:  # noqa: BLE001 - as _post: the write fails, not the step
                    self._fail_write(tag, exc)
                else:
                    self._post_run(rt, tag, "aux", aux_slot * size, dst_slot * size, size, note)
        finally:
            self._draining = self._fast_posting = False
        if self._queue:
            self._drain()

    def _row_taken(self, rt: RoomRuntime, before: str, cancelled: bool) -> None:
        """What row P11 or P10 (taken directly) leaves to the runtime before the writes: the
        room's change of state from ``before`` (the first chunk into Sending, the last into
        Draining), the input timer cancelled if it was armed, the transfer timer armed, the
        transfer's start."""
        now = self.clock()
        rid = rt.room.room
        if rt.room.state != before:
            self._state_changed(rt, before, now)
        if cancelled:
            self._timers.cancel(rid, fastpath.INPUT)
        self._timers.set(rid, fastpath.TIMER, now + self._transfer_s)
        if rt.started is None:
            rt.started = now

    def _chunk_posted(self, rt: RoomRuntime, pages: Pages, done: fastpath.ChunkPosts, before: str) -> None:
        """Carry out row P11's or P10's actions as ``_step`` would: the room's change of state
        (from ``before``), then cancel the input timer, arm the transfer timer, post the writes
        (each rank's aux write after its KV, with the last chunk); events raised meanwhile (a
        write that fails at once) are stepped afterwards, as ``_local`` does. (The timers go
        first: a completion handed over during the posts then re-arms the timer after the row
        did, as it would after the step.)"""
        chunk_id, note, writes, cancelled, aux = done
        self._row_taken(rt, before, cancelled)
        self._draining = self._fast_posting = True
        try:
            for i, (dest, dst, contiguous) in enumerate(writes):
                self._post_kv(rt, dest, chunk_id, pages, dst, note, contiguous)
                if aux:
                    self._post(rt, aux[i])
        finally:
            self._draining = self._fast_posting = False
        if self._queue:
            self._drain()

    # ------------------------------------------------------------------ inbound

    def _peer_name(self, rank: int) -> str | None:
        return self._peer_names.get(rank)

    def _on_message(self, peer: str, kind: str, msg: Message) -> None:
        if kind != "message":
            if isinstance(msg, ReadsDone) and self._claims(peer, msg.dst, msg):
                self._room_event(peer, msg.dst, msg)  # pull mode: a decode rank's read completed
            else:
                self._count_drop("unexpected_notification", f"{msg.TYPE} from {peer}")
        elif isinstance(msg, Register):
            self._on_register(peer, msg)
        elif isinstance(msg, RoomPages):
            if not self._claims(peer, msg.decode_rank, msg):
                return
            link = self._links.get(msg.decode_rank)
            reg = link.registration if link is not None else None
            if reg is None:
                self._room_event(peer, msg.decode_rank, msg)
            else:
                page_size = reg.layout.page_size if reg.layout is not None else 1
                self._room_event(peer, msg.decode_rank, msg, reg.kv_pages, reg.aux_slots, page_size)
        elif isinstance(msg, AbortNotice):
            if msg.side != "decode" or not self._claims(peer, msg.rank, msg):
                return
            self._room_event(peer, msg.rank, msg)
        elif isinstance(msg, LeaseClaim | LeaseRelease):
            if self._claims(peer, msg.decode_rank, msg):
                self._room_event(peer, msg.decode_rank, msg)
        else:
            self._count_drop("unexpected_message", f"{msg.TYPE} from {peer}")

    def _claims(self, peer: str, rank: int, msg: Message) -> bool:
        if self._peer_ranks.get(peer) != rank:
            self._count_drop("wrong_sender", f"{msg.TYPE} claiming decode rank {rank} from {peer}")
            log.warning("prefill%d: %s from %s claims decode rank %d", self.rank, msg.TYPE, peer, rank)
            return False
        return True

    def _on_register(self, peer: str, msg: Register) -> None:
        """A decode rank's registration, judged by its link (prefill_link: declared rows decide
        whether the pair can exchange KV, and answer). A registration that claims a rank another
        peer holds is refused here: the link belongs to that peer."""
        rank = msg.decode_rank
        bound = self._peer_names.get(rank)
        if bound is not None and bound != peer:
            reason = f"decode rank {rank} is already registered from {bound}"
            self.telemetry.count("registrations_refused")
            log.warning("prefill%d: refused registration from %s: %s", self.rank, peer, reason)
            ack = RegisterAck(self.rank, self.page_bytes, self.aux_slot_bytes, False, reason, self._wire_layout)
            self.endpoint.send(peer, self.codec.encode(ack))
            return
        link = self._links.get(rank)
        if link is None:
            link = PrefillLink(rank, self.rank, self.page_bytes, self.aux_slot_bytes, self._wire_layout)
            self._link_machine.create(link, self.clock())
            self._links[rank] = link
        before = link.registration
        actions = self._link_machine.step(link, RegistrationReceived(msg), self.clock())
        if link.state == "Ready":
            if before != msg:
                if self.layout is not None and msg.layout is not None:
                    theirs = KVLayout.from_wire(msg.layout)  # (the link's guard proved it can)
                    mapping = RankMap(self.layout.num_kv_heads, self.layout.tp_size, theirs.tp_size, self.layout.mla)
                    self._planners[rank] = Planner(self.layout, theirs, mapping)
                self.telemetry.count("registrations")
            self._peer_names[rank] = peer
            self._peer_ranks[peer] = rank
        else:
            self._planners.pop(rank, None)
            self.telemetry.count("registrations_refused")
            log.warning("prefill%d: refused registration from %s: %s", self.rank, peer, link.failure)
        for a in actions:
            if isinstance(a, SendMessage):
                self.telemetry.count("messages_out")
                self.endpoint.send(peer, self.codec.encode(a.message))

    def _room_event(
        self,
        peer: str,
        sender: int,
        msg: RoomPages | AbortNotice | LeaseClaim | LeaseRelease | ReadsDone,
        kv_pages: int = 0,
        aux_slots: int = 0,
        page_size: int = 1,
    ) -> None:
        """A room message from decode rank ``sender``, routed as ``routing.route_message`` decides
        (``kv_pages``, ``aux_slots``, ``page_size``: the sender's registered regions and tokens
        per page, for an announcement)."""
        rid = msg.room
        event = message_event("prefill", msg, kv_pages, aux_slots, page_size)
        assert event is not None  # (a room_pages, abort or pull-mode message)
        full = len(self._early) >= self.config.max_early_rooms
        route = route_message(self._known(rid), "prefill", msg.TYPE, stash_full=full)
        if route is DISPATCH:
            self._dispatch(rid, event)
        elif route is STASH:
            if rid not in self._early:
                self._early_order.append((self.clock() + self.config.early_ttl_s, rid))
            self._early.setdefault(rid, []).append((peer, event))
            self.telemetry.count("early_messages")
        else:
            self._count_drop(route.drop, f"{msg.TYPE} for room {rid}")
            reason = self._failures.get(rid) or "room failed on prefill"
            for reply in replies(route, rid, self.rank, reason):
                self._send(sender, reply)

    def expire_early(self, room: int) -> None:
        """Expire the messages kept for a not-yet-created room now (trace replay and tests)."""
        with self._lock:
            self._expire(room, self.clock())

    def _tick_side(self, now: float) -> None:
        while self._early_order and self._early_order[0][0] <= now:
            _, rid = self._early_order.popleft()
            self._expire(rid, now)

    def _side_deadline(self) -> float | None:
        return self._early_order[0][0] if self._early_order else None

    def _expire(self, rid: int, now: float) -> None:
        events = self._early.pop(rid, None)
        if events is None:
            return
        self._count_drop("early_expired", f"room {rid} was never created on this rank")
        reason = f"prefill rank {self.rank} never created room {rid} within {self.config.early_ttl_s}s"
        done = expire(self.routing, rid, self.rank, [event for _peer, event in events], reason)
        if done.known == EXPIRED:
            # remembered: decode was told the room failed and released its pages, so neither a
            # late duplicate room_pages nor the engine's late create_sender may start writes
            self._tombstones[rid] = (EXPIRED, now + self.config.tombstone_ttl_s)
            self._tomb_order.append((now + self.config.tombstone_ttl_s, rid))
            self._failures[rid] = reason
        for dest, reply in done.sends:
            self._send(dest, reply)

    def _on_completion(self, tag: object, ok: bool, reason: str) -> None:
        if not (type(tag) is tuple and len(tag) == 3):
            self._count_drop("unexpected_completion", f"tag {tag!r}")
            return
        rid, dest, chunk_id = tag
        if rid not in self._rooms:  # a room not LIVE: routing.route_completion drops it
            self._count_drop(route_completion(self._known(rid)).drop, f"room {rid}")
            return
        if ok:
            if self._fast_ok():
                rt = self._rooms[rid]
                before = rt.room.state
                if fastpath.completion(rt.room, dest, chunk_id):
                    self._completed(rt, before, self.clock())
                    return
            self._dispatch(rid, WriteCompleted(dest, chunk_id))
        else:
            self._dispatch(rid, WriteFailed(dest, chunk_id, reason))

    def _on_completions(self, item: Inbound) -> None:
        """A folded transfer's writes, all completed: each as ``_on_completion`` takes it, in one
        loop where rows P15 and P14 apply directly (one clock read for the item; the event queue
        looked at again only after a write that took the generic path)."""
        rooms = self._rooms
        now: float | None = None
        fast = self._fast_ok()
        # Rooms whose transfer timer a P15 re-arms: armed once each (a folded transfer holds several
        # writes of a room), at the end, at the deadline each P15 would set (one clock read for the
        # item); a P14 (Success) drops its room. The same as arming it at each P15: a later write
        # of such a room that takes the generic path is P13 (a duplicate: no timer touched), or
        # waits in the event queue until after this item (events queued, or a step under way).
        rearm: dict[int, None] = {}
        try:
            for tag in item.tag:  # type: ignore[attr-defined]
                try:
                    if fast and type(tag) is tuple and len(tag) == 3:
                        rid = tag[0]
                        rt = rooms.get(rid)
                        if rt is not None:
                            room = rt.room
                            before = room.state
                            if fastpath.completion(room, tag[1], tag[2]):
                                if now is None:
                                    now = self.clock()
                                if room.state == before:
                                    rearm[rid] = None
                                else:  # P14: the room succeeded (as _completed carries it out)
                                    rearm.pop(rid, None)
                                    self._completed(rt, before, now)
                                continue
                    self._on_completion(tag, True, "")
                    fast = self._fast_ok()
                except Exception:  # noqa: BLE001 - as Manager._on_completions: the item's other writes still complete
                    self._internal_error(item)
                    fast = self._fast_ok()
        finally:
            if rearm:
                self._rearm(rearm, now)  # type: ignore[arg-type]

    def _rearm(self, rooms: dict[int, None], now: float) -> None:
        """Arm the transfer timer of ``rooms`` (``_on_completions``'s P15 rows) at ``now`` plus the
        transfer timeout; ``rooms`` emptied."""
        deadline = now + self._transfer_s
        timers = self._timers
        for rid in rooms:
            timers.set(rid, fastpath.TIMER, deadline)
        rooms.clear()

    def _completed(self, rt: RoomRuntime, before: str, now: float) -> None:
        """What is left of row P15 or P14, applied directly (``fastpath.completion``) to a room
        that was in ``before``: P15 arms the transfer timer; P14 (the room succeeded) tells the
        runtime of the change and cancels the timer."""
        rid = rt.room.room
        if rt.room.state == before:
            self._timers.set(rid, fastpath.TIMER, now + self._transfer_s)
        else:
            self._state_changed(rt, before, now)
            self._timers.cancel(rid, fastpath.TIMER)

    def _on_peer_lost(self, peer: str, reason: str) -> None:
        rank = self._peer_ranks.pop(peer, None)
        if rank is None:
            return
        self._planners.pop(rank, None)
        self._links.pop(rank, None)
        self._peer_names.pop(rank, None)
        for rid, rt in list(self._rooms.items()):
            room = rt.room
            if rank in (room.claimants if type(room) is PullSource else room.dests):
                self._dispatch(rid, PeerLost(rank, reason))
