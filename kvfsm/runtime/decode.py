"""Decode side: ``DecodeManager`` (one per decode rank) and its per-room ``KVReceiver``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvfsm.protocol import LocalProtocolError, Protocol, fastpath
from kvfsm.protocol.events import ChunkArrived, PagesAllocated, PeerLost, PeersReady
from kvfsm.protocol.rooms import DecodeRoom
from kvfsm.protocol.routing import message_event
from kvfsm.protocol.wire import (
    AbortNotice,
    AuxWritten,
    ChunkWritten,
    Drained,
    Message,
    Register,
    RegisterAck,
    RoomFailed,
)
from kvfsm.runtime.manager import Manager, RoomHandle, log
from kvfsm.runtime.pages import as_index, as_pages


class KVReceiver(RoomHandle):
    """One room on one decode rank, as the engine sees it (SGLang's KVReceiver)."""

    __slots__ = ()
    manager: DecodeManager

    def pages_fenced(self) -> bool:
        """The room failed but a source may still write into its pages: keep them; clear() is
        refused until every source confirmed its writes drained, died, or the fence timer expired."""
        return self.manager.state(self.room) == "Fenced"

    def init(self, pages: Sequence[int] | Any, aux_slot: int) -> None:
        """Announce the allocated pages and aux slot to every source. Call once poll() says
        WaitingForInput; raises LocalProtocolError otherwise or if pages are outside the region.
        ``pages``: a list, tuple or range of ints, or a 1-D integer numpy array or tensor."""
        self.manager._local(self.room, PagesAllocated(as_pages(pages), as_index(aux_slot, "aux_slot")))


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
        # prefill rank -> "pending" | "ready" | "refused" | "lost"
        self._links: dict[int, str] = {r: "pending" for r in self._peer_names}
        self._link_reason: dict[int, str] = {}
        self._next_register = 0.0

    def connect(self) -> None:
        """Start the handshake with every prefill peer (re-sent until acknowledged)."""
        with self._lock:
            self._register_pending(self.clock())

    def link_state(self, prefill_rank: int) -> str:
        with self._lock:
            return self._links[prefill_rank]

    def create_receiver(self, room: int, sources: tuple[int, ...] | None = None, required_dests: int = 1) -> KVReceiver:
        """Create room ``room``: ``sources`` are the prefill ranks it receives KV from (default:
        the same rank, equal TP); ``required_dests`` is how many decode ranks each of them feeds."""
        sources = (self.rank,) if sources is None else tuple(as_index(s, "a source rank") for s in sources)
        required_dests = as_index(required_dests, "required_dests")
        unknown = [s for s in sources if s not in self._peer_names]
        if not sources or unknown:
            raise LocalProtocolError(f"sources {unknown or '()'} are not prefill peers of decode rank {self.rank}")
        with self._lock:
            self._new_room(room, DecodeRoom(room, self.rank, self.kv_pages, self.aux_slots, sources, required_dests))
            broken = [s for s in sources if self._links[s] in ("refused", "lost")]
            if broken:
                self._dispatch(room, PeerLost(broken[0], self._link_reason.get(broken[0], "link down")))
            elif all(self._links[s] == "ready" for s in sources):
                self._dispatch(room, PeersReady())
        return KVReceiver(self, room)

    # ------------------------------------------------------------------ handshake

    def _register_pending(self, now: float) -> None:
        reg = Register(
            self.rank, self.endpoint.name, self.kv_pages, self.page_bytes, self.aux_slots, self.aux_slot_bytes
        )
        for rank, state in self._links.items():
            if state == "pending":
                self._send(rank, reg)
        self._next_register = now + self.config.register_retry_s

    def _tick_side(self, now: float) -> None:
        if now >= self._next_register and any(s == "pending" for s in self._links.values()):
            self._register_pending(now)

    def _side_deadline(self) -> float | None:
        return self._next_register if any(s == "pending" for s in self._links.values()) else None

    def _peer_name(self, rank: int) -> str | None:
        return self._peer_names.get(rank)

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
                if type(event) is ChunkArrived:
                    if self._fast_ok() and fastpath.arrival(rt.room, event):
                        # row D8 applied directly (fastpath): arm the transfer timer as its action does
                        self._timers.set(msg.room, fastpath.TIMER, self.clock() + self._transfer_s)
                    else:
                        self._dispatch(msg.room, event)
                    rt.bytes += event.num_pages * self.page_bytes
                elif event is not None:
                    self._dispatch(msg.room, event)
            return
        if isinstance(msg, RegisterAck):
            self._on_ack(rank, msg)
        elif (
            (isinstance(msg, AbortNotice) and msg.side == "prefill" and msg.rank == rank)
            or (isinstance(msg, RoomFailed) and msg.prefill_rank == rank)
            or (isinstance(msg, Drained) and msg.prefill_rank == rank)
        ):
            if self._room_for_message(msg.room, msg.TYPE) is not None:
                event = message_event("decode", msg)
                assert event is not None  # (an abort, room_failed or drained message)
                self._dispatch(msg.room, event)
        else:
            self._count_drop("unexpected_message", f"{msg.TYPE} from {peer}")

    def _on_ack(self, rank: int, msg: RegisterAck) -> None:
        if msg.prefill_rank != rank:
            self._count_drop("wrong_sender", f"register_ack claiming prefill rank {msg.prefill_rank}")
            return
        if self._links[rank] != "pending":
            self._count_drop("duplicate_ack", f"register_ack from prefill rank {rank}")
            return
        if not msg.accepted:
            self._links[rank] = "refused"
            self._link_reason[rank] = f"registration refused by prefill rank {rank}: {msg.reason}"
            log.warning("decode%d: %s", self.rank, self._link_reason[rank])
            self._fail_rooms_of(rank, self._link_reason[rank])
            return
        self._links[rank] = "ready"
        self.telemetry.count("links_ready")
        for rid, rt in list(self._rooms.items()):
            room = rt.room
            if room.state == "Bootstrapping" and rank in room.sources:
                if all(self._links[s] == "ready" for s in room.sources):
                    self._dispatch(rid, PeersReady())

    def _on_peer_lost(self, peer: str, reason: str) -> None:
        rank = self._peer_ranks.get(peer)
        if rank is None:
            return
        self._links[rank] = "lost"
        self._link_reason[rank] = reason
        self._fail_rooms_of(rank, reason)

    def _fail_rooms_of(self, rank: int, reason: str) -> None:
        for rid, rt in list(self._rooms.items()):
            if rank in rt.room.sources:
                self._dispatch(rid, PeerLost(rank, reason))
