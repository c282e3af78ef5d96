"""Decode side: ``DecodeManager`` (one per decode rank) and its per-room ``KVReceiver``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvfsm.layout import KVLayout, Planner
from kvfsm.layout.mapping import RankMap
from kvfsm.protocol import LocalProtocolError, Protocol, fastpath
from kvfsm.protocol.actions import PostRead
from kvfsm.protocol.events import AckReceived, ChunkArrived, PagesAllocated, PeerLost, PeersReady
from kvfsm.protocol.rooms import DecodeLink, DecodeRoom, PullSink
from kvfsm.protocol.routing import message_event
from kvfsm.protocol.wire import (
    AbortNotice,
    AuxWritten,
    ChunkWritten,
    Drained,
    LeaseGrant,
    Message,
    Register,
    RegisterAck,
    RoomFailed,
)
from kvfsm.runtime.manager import Manager, RoomHandle, RoomRuntime, log
from kvfsm.runtime.pages import as_index, as_pages
from kvfsm.runtime.pull import READ, KVPuller, post_read, read_completed


class KVReceiver(RoomHandle):
    """One room on one decode rank, as the engine sees it (SGLang's KVReceiver)."""

    __slots__ = ()
    manager: DecodeManager

    def pages_fenced(self) -> bool:
        """The room failed but a source may still write into its pages: keep them; clear() is
        refused until every source confirmed its writes drained, died, or the fence timer expired."""
        return self.manager.state(self.room) == "Fenced"

    def init(self, pages: Sequence[int] | Any, aux_slot: int, tokens: int | None = None) -> None:
        """Announce the allocated pages and aux slot to every source. Call once poll() says
        WaitingForInput; raises LocalProtocolError otherwise or if pages are outside the region.
        ``pages``: a list, tuple or range of ints, or a 1-D integer numpy array or tensor.
        ``tokens``: the request's tokens, which the pages must hold exactly (with a KV layout the
        last page may be partly used); None: every token of the pages."""
        pages = as_pages(pages)
        n = len(pages) * self.manager.page_size if tokens is None else as_index(tokens, "tokens")
        self.manager._local(self.room, PagesAllocated(pages, as_index(aux_slot, "aux_slot"), n))


class DecodeManager(Manager):
    side = "decode"
    receives_writes = True  # push mode: prefill writes into our pages

    def __init__(
        self,
        rank: int,
        endpoint: Any,
        protocol: Protocol | None = None,
        *,
        prefill_peers: Mapping[int, str],
        **kwargs: Any,
    ) -> None:
        super().__init__(rank, endpoint, protocol, **kwargs)
        self._peer_names = dict(prefill_peers)
        self._peer_ranks = {name: rank for rank, name in self._peer_names.items()}
        self._wire_layout = self.layout.to_wire() if self.layout is not None else None
        # prefill rank -> its link (decode_link: Pending, Ready, Refused or Lost)
        self._link_machine = self.protocol.decode_link
        self._links: dict[int, DecodeLink] = {}
        for r in self._peer_names:
            link = DecodeLink(r, self.rank, self._wire_layout, len(self._peer_names))
            self._link_machine.create(link, self.clock())
            self._links[r] = link
        # with a layout, who sends to this rank follows from the two TP groups
        self.mapping: RankMap | None = None
        # where this rank sits in its TP group: its layout's TP rank (its id in the protocol,
        # ``rank``, may differ: several decode engines can register with one prefill engine)
        self.tp_rank = self.layout.tp_rank if self.layout is not None else rank
        if self.layout is not None:
            lay = self.layout
            self.mapping = RankMap(lay.num_kv_heads, len(self._peer_names), lay.tp_size, lay.mla)
        # bytes a source writes per token (for the rooms' byte counts): a page without a layout
        self._token_bytes: dict[int, int] = {}
        if self.mapping is not None and self.layout is not None:
            per_head = self.layout.num_layers * self.layout.num_kv * self.layout.vector_bytes
            self._token_bytes = {p: per_head * len(self.mapping.heads(p, self.tp_rank)) for p in self._peer_names}
        self._next_register = 0.0
        # pull mode: prefill rank -> plans from its layout into ours (from its register_ack)
        self._planners: dict[int, Planner] = {}

    def connect(self) -> None:
        """Start the handshake with every prefill peer (re-sent until acknowledged)."""
        with self._lock:
            self._register_pending(self.clock())

    def link_state(self, prefill_rank: int) -> str:
        """The link to ``prefill_rank``: "pending", "ready", "refused" or "lost"."""
        with self._lock:
            return self._links[prefill_rank].state.lower()

    def link_failure(self, prefill_rank: int) -> str | None:
        """Why the link to ``prefill_rank`` was refused or lost (None while pending or ready)."""
        with self._lock:
            return self._links[prefill_rank].failure

    def create_receiver(
        self, room: int, sources: tuple[int, ...] | None = None, required_dests: int | None = None
    ) -> KVReceiver:
        """Create room ``room``: ``sources`` are the prefill ranks it receives KV from,
        ``required_dests`` how many decode ranks each of them feeds. Defaults: with a KV layout,
        as the rank mapping between the two TP groups says (``kvfsm.layout.RankMap``: the
        prefill ranks that send this rank heads, however many decode ranks each feeds); without
        one, the prefill rank of the same number, feeding this rank alone (equal TP)."""
        sources, required_dests = self._sources(sources, required_dests)
        with self._lock:
            decode_room = DecodeRoom(
                room, self.rank, self.kv_pages, self.aux_slots, sources, required_dests, self.page_size
            )
            self._new_room(room, decode_room)
            self._link_news(room, sources)
        return KVReceiver(self, room)

    def create_puller(
        self,
        room: int,
        sources: tuple[int, ...] | None = None,
        readers: int | None = None,
        tokens: int | None = None,
    ) -> KVPuller:
        """Pull mode: create room ``room``, which reads its KV from prefill ranks ``sources``
        (``readers``: how many decode ranks read from each of them; defaults as
        ``create_receiver``'s). ``tokens``: the request's tokens, if known (a grant or the pages
        that disagree fail the room). The claims go out once every source's link is ready."""
        sources, readers = self._sources(sources, readers)
        n = 0 if tokens is None else as_index(tokens, "tokens")
        with self._lock:
            self._new_room(
                room,
                PullSink(room, self.rank, self.kv_pages, sources, readers, self.page_size, n),
                self.pull_machine,
            )
            self._link_news(room, sources)
        return KVPuller(self, room)

    def _sources(self, sources: tuple[int, ...] | None, fan_out: int | None) -> tuple[tuple[int, ...], int]:
        """A room's sources and how many decode ranks each feeds, defaults filled in (see
        ``create_receiver``); LocalProtocolError for a rank that is not a prefill peer."""
        mapping = self.mapping
        if sources is None:
            sources = mapping.sources_of(self.tp_rank) if mapping is not None else (self.rank,)
        else:
            sources = tuple(as_index(s, "a source rank") for s in sources)
        if fan_out is None:
            fan_out = len(mapping.dests_of(sources[0])) if mapping is not None and sources else 1
        fan_out = as_index(fan_out, "required_dests")
        unknown = [s for s in sources if s not in self._peer_names]
        if not sources or unknown:
            raise LocalProtocolError(f"sources {unknown or '()'} are not prefill peers of decode rank {self.rank}")
        return sources, fan_out

    def _link_news(self, room: int, sources: tuple[int, ...]) -> None:
        """Tell a new room what its sources' links already say: one is down, or all are ready."""
        broken = [s for s in sources if self._links[s].state in ("Refused", "Lost")]
        if broken:
            self._dispatch(room, PeerLost(broken[0], self._links[broken[0]].failure or "link down"))
        elif all(self._links[s].state == "Ready" for s in sources):
            self._dispatch(room, PeersReady())

    # ------------------------------------------------------------------ handshake

    def _register_pending(self, now: float) -> None:
        reg = Register(
            self.rank,
            self.endpoint.name,
            self.kv_pages,
            self.page_bytes,
            self.aux_slots,
            self.aux_slot_bytes,
            self._wire_layout,
        )
        for rank, link in self._links.items():
            if link.state == "Pending":
                self._send(rank, reg)
        self._next_register = now + self.config.register_retry_s

    def _pending(self) -> bool:
        return any(link.state == "Pending" for link in self._links.values())

    def _tick_side(self, now: float) -> None:
        if now >= self._next_register and self._pending():
            self._register_pending(now)

    def _side_deadline(self) -> float | None:
        return self._next_register if self._pending() else None

    def _peer_name(self, rank: int) -> str | None:
        return self._peer_names.get(rank)

    def _post_read(self, rt: RoomRuntime, action: PostRead) -> None:
        post_read(self, rt, action)

    def _on_completion(self, tag: object, ok: bool, reason: str) -> None:
        if type(tag) is tuple and len(tag) == 3 and tag[0] == READ:
            read_completed(self, tag, ok, reason)
        else:
            self._count_drop("unexpected_completion", f"of {tag!r}")

    # ------------------------------------------------------------------ inbound

    def _on_message(self, peer: str, kind: str, msg: Message) -> None:
        rank = self._peer_ranks.get(peer)
        if rank is None:
            self._count_drop("unknown_peer", f"{msg.TYPE} from {peer}")
            return
        if kind == "notification":
            if not isinstance(msg, ChunkWritten | AuxWritten):
                self._count_drop("unexpected_notification", f"{msg.TYPE} from {peer}")
            elif msg.src != rank:
                self._count_drop("wrong_sender", f"{msg.TYPE} claiming src {msg.src} from {peer}")
            elif (rt := self._room_for_message(msg.room, msg.TYPE)) is not None:
                event = message_event("decode", msg)
                if type(event) is ChunkArrived and type(rt.room) is DecodeRoom:
                    if self._fast_ok() and fastpath.arrival(rt.room, event):
                        # row D8 applied directly (fastpath): arm the transfer timer as its action does
                        self._timers.set(msg.room, fastpath.TIMER, self.clock() + self._transfer_s)
                    else:
                        self._dispatch(msg.room, event)
                    rt.bytes += event.num_tokens * self._token_bytes.get(event.src, self.page_bytes)
                elif event is not None:
                    self._dispatch(msg.room, event)
            return
        if isinstance(msg, RegisterAck):
            self._on_ack(rank, msg)
        elif (
            (isinstance(msg, AbortNotice) and msg.side == "prefill" and msg.rank == rank)
            or (isinstance(msg, RoomFailed) and msg.prefill_rank == rank)
            or (isinstance(msg, Drained) and msg.prefill_rank == rank)
            or (isinstance(msg, LeaseGrant) and msg.prefill_rank == rank)
        ):
            if self._room_for_message(msg.room, msg.TYPE) is not None:
                event = message_event("decode", msg)
                assert event is not None  # (an abort, room_failed, drained or lease_grant message)
                self._dispatch(msg.room, event)
        else:
            self._count_drop("unexpected_message", f"{msg.TYPE} from {peer}")

    def _on_ack(self, rank: int, msg: RegisterAck) -> None:
        """The prefill rank's answer, judged by the link (decode_link): Ready lets the rooms that
        wait for it on; Refused fails them with the reason."""
        if msg.prefill_rank != rank:
            self._count_drop("wrong_sender", f"register_ack claiming prefill rank {msg.prefill_rank}")
            return
        link = self._links[rank]
        before = link.state
        self._link_machine.step(link, AckReceived(msg), self.clock())
        if link.state == before:
            self._count_drop("duplicate_ack", f"register_ack from prefill rank {rank}")
            return
        if link.state != "Ready":
            log.warning("decode%d: %s", self.rank, link.failure)
            self._fail_rooms_of(rank, link.failure or "link refused")
            return
        self.telemetry.count("links_ready")
        if self.layout is not None and msg.layout is not None:
            theirs = KVLayout.from_wire(msg.layout)  # (the link's guard proved it can)
            mapping = RankMap(theirs.num_kv_heads, theirs.tp_size, self.layout.tp_size, theirs.mla)
            self._planners[rank] = Planner(theirs, self.layout, mapping)
        for rid, rt in list(self._rooms.items()):
            room = rt.room
            if room.state in ("Bootstrapping", "Linking") and rank in room.sources:
                if all(self._links[s].state == "Ready" for s in room.sources):
                    self._dispatch(rid, PeersReady())

    def _on_peer_lost(self, peer: str, reason: str) -> None:
        rank = self._peer_ranks.get(peer)
        if rank is None:
            return
        self._link_machine.step(self._links[rank], PeerLost(rank, reason), self.clock())
        self._fail_rooms_of(rank, reason)

    def _fail_rooms_of(self, rank: int, reason: str) -> None:
        for rid, rt in list(self._rooms.items()):
            if rank in rt.room.sources:
                self._dispatch(rid, PeerLost(rank, reason))
