"""Shared machinery of the prefill and decode managers.

Theory of operation
-------------------
A manager runs the room machines of one (side, rank). Every event for every room goes through
``_dispatch`` under the manager's lock and is processed run-to-completion: events raised while
the actions of a step are being carried out (an inline write that fails, a timer) are queued and
stepped afterwards, never in the middle of another step. After each step the manager carries out
the actions (send, post a write to the worker pool, arm/cancel a timer, count), records telemetry
when the state changed, and forgets a room when it reaches Cleared (leaving a tombstone so that a
late message for it is dropped and counted, never re-creating it). Which room an inbound item
belongs to, and what a tombstone or a not-yet-created room does with it, is decided by the pure
functions of ``kvfsm.protocol.routing``, the same the model checker runs; ``Manager.routing``
selects a mutant of them (trace replay only).

Inbound transport items are decoded and validated here: a malformed or unknown-version message,
one whose claimed rank does not match the sending endpoint, or one for an unknown room is dropped
and counted with a logged reason; it never raises out of the runtime.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvfsm.layout.kv import KVLayout
from kvfsm.protocol import (
    Action,
    CancelTimer,
    Event,
    KVTransferError,
    LocalProtocolError,
    MalformedMessage,
    PostAuxWrite,
    PostWrite,
    Protocol,
    RecordIgnored,
    RecordProtocolError,
    SendMessage,
    SetTimer,
    TimerFired,
    UnsupportedVersion,
    fastpath,
)
from kvfsm.protocol.actions import PostRead
from kvfsm.protocol.machine import RoomMachine
from kvfsm.protocol.routing import EARLY, LIVE, ROUTING, UNKNOWN, Create, Routing, cleared, create, route_message
from kvfsm.protocol.wire import Codec, Message
from kvfsm.runtime.config import RuntimeConfig
from kvfsm.runtime.telemetry import Telemetry
from kvfsm.runtime.timers import TimerWheel
from kvfsm.runtime.workers import WorkerPool
from kvfsm.transport.base import Endpoint, Inbound, as_regions, region_nbytes

log = logging.getLogger("kvfsm.runtime")
_STATE_SECONDS: dict[str, str] = {}  # state -> its histogram name ("state_seconds.<state>"), built once

MAX_ROOM_ID = (1 << 63) - 1

__all__ = ["Manager", "RoomHandle", "RoomRuntime", "RuntimeConfig"]


@dataclass(slots=True)
class RoomRuntime:
    room: Any  # PrefillRoom | DecodeRoom, or in pull mode PullSource | PullSink
    machine: RoomMachine  # the machine that steps it (push or pull)
    created: float
    state_since: float
    started: float | None = None  # first write posted (prefill) / pages announced (decode)
    bytes: int = 0
    descriptors: int = 0


class RoomHandle:
    """One room on one rank, as the engine sees it; KVSender and KVReceiver add their verbs."""

    __slots__ = ("manager", "room")

    def __init__(self, manager: Manager, room: int) -> None:
        self.manager = manager
        self.room = room

    def poll(self) -> int:
        """KVPoll code (Failed=0 … Success=4); fires due timers first."""
        return self.manager.poll(self.room)

    def wait(self, until: int = 4, timeout: float | None = None) -> int:
        """Block until the room reaches KVPoll ``until`` (default Success) or beyond, or fails,
        or ``timeout`` seconds pass; returns its KVPoll code. Timers fire while it waits."""
        return self.manager.wait([self.room], until, timeout)[0]

    def abort(self, reason: str = "aborted by engine") -> None:
        self.manager.abort(self.room, reason)

    def transferred(self) -> tuple[int, int]:
        """(bytes, descriptors) of this room's KV and aux moved so far: on prefill, posted (a
        descriptor is one contiguous run of a write); on decode, the KV bytes notified. (0, 0)
        once the room is cleared."""
        with self.manager._lock:
            rt = self.manager._rooms.get(self.room)
            return (rt.bytes, rt.descriptors) if rt is not None else (0, 0)

    def clear(self) -> None:
        """Forget the concluded room on this rank. Before Success/Failed, abort() first."""
        self.manager.clear(self.room)

    def failure_exception(self) -> KVTransferError:
        return self.manager.failure_exception(self.room)


class Manager:
    side: str
    # Peers write into this side's memory (push mode: decode's pages). While such a rank has
    # rooms it tells its endpoint to expect traffic (``expect_traffic``); otherwise a data plane
    # that polls may poll rarely when nothing of its own is in flight.
    receives_writes = False

    def __init__(
        self,
        rank: int,
        endpoint: Endpoint,
        protocol: Protocol | None = None,
        *,
        kv: Any,
        aux: Any,
        page_bytes: int = 0,
        aux_slot_bytes: int,
        layout: KVLayout | None = None,
        config: RuntimeConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        routing: Routing = ROUTING,
    ) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.config = config or RuntimeConfig()
        # the routing decisions' variant: ROUTING, or a checker's routing mutant (kvfsm replay)
        self.routing = routing
        protocol = protocol or Protocol()
        self.protocol = protocol
        self.machine: RoomMachine = protocol.machine_for(self.side, self.config.timeouts)
        self.pull_machine: RoomMachine = protocol.pull_machine_for(self.side, self.config.pull_timeouts)
        # the rows taken once per chunk or write, applied directly (kvfsm.protocol.fastpath)
        # where this machine's rows are exactly those; off, every event takes the generic step
        self.fast_rows = fastpath.applies(self.machine)
        self._fast_posting = False  # prefill: carrying out P11's or P10's posts (see _fast_ok)
        self._transfer_s = self.machine.timeouts.get(fastpath.TIMER, 0.0)
        self.codec: Codec = protocol.codec
        self.clock = clock
        self.kv = kv  # a host buffer or a tensor (CPU or GPU): the transport registers it
        self.aux = aux
        kv_bytes, aux_bytes = region_nbytes(kv), region_nbytes(aux)
        # with a layout the engine's KV is its buffers as the layout lays them out (``kv``: a list
        # of them in buffer-id order), a page holds page_size tokens, and writes are planned
        self.layout = layout
        self.page_size = 1
        if layout is not None:
            sizes = tuple(r.nbytes for r in as_regions(kv))
            if sizes != layout.buffers():
                raise LocalProtocolError(
                    f"the layout has {layout.num_buffers} KV buffers of {layout.buffers()[0]} bytes; "
                    f"kv has {len(sizes)} of {sorted(set(sizes))} bytes"
                )
            page_bytes, self.page_size = layout.page_bytes, layout.page_size
        if page_bytes <= 0 or kv_bytes % page_bytes:
            raise LocalProtocolError(f"KV region of {kv_bytes} bytes is not a whole number of {page_bytes}-byte pages")
        if aux_slot_bytes <= 0 or aux_bytes % aux_slot_bytes:
            raise LocalProtocolError(
                f"aux region of {aux_bytes} bytes is not a whole number of {aux_slot_bytes}-byte slots"
            )
        self.page_bytes = page_bytes
        self.aux_slot_bytes = aux_slot_bytes
        self.kv_pages = kv_bytes // page_bytes
        self.aux_slots = aux_bytes // aux_slot_bytes
        self.telemetry = Telemetry()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a room changed state (wait())
        self._rooms: dict[int, RoomRuntime] = {}
        self._timers = TimerWheel()
        self._tombstones: dict[
            int, tuple[str, float]
        ] = {}  # room -> (routing kind CLEARED, CLEARED_FAILED or EXPIRED, expiry)
        # prefill: events for rooms the engine has not created yet (decode was faster), replayed on create
        self._early: dict[int, list[tuple[str, Event]]] = {}
        self._tomb_order: deque[tuple[float, int]] = deque()
        self._queue: deque[tuple[int, Event]] = deque()
        self._draining = False
        self._failures: dict[int, str] = {}
        # Only prefill posts writes (push mode); decode needs no transfer workers.
        self.pool = WorkerPool(self.config.workers if self.side == "prefill" else 0, name=f"{self.side}{rank}")
        # (a layout's pages are spread over its buffers: no page-sized blocks to prepare)
        endpoint.register_memory(self.kv, self.aux, kv_block=0 if layout else page_bytes, aux_block=aux_slot_bytes)
        endpoint.set_handler(self._on_inbound)
        batch = getattr(endpoint, "set_batch_handler", None)
        if batch is not None:
            batch(self._on_inbound_batch)
        self._traffic_hint = getattr(endpoint, "expect_traffic", None)
        self._expecting: bool | None = None
        self._expect_traffic()

    # ------------------------------------------------------------------ engine-facing helpers

    def poll(self, room: int) -> int:
        """KVPoll code of ``room``; also fires due timers (as SGLang checks deadlines in poll)."""
        self.tick()
        with self._lock:
            rt = self._get(room)
            return rt.machine.kvpoll(rt.room)

    def wait(self, rooms: Iterable[int], until: int = 4, timeout: float | None = None) -> list[int]:
        """Block until every room in ``rooms`` has reached KVPoll ``until`` (default Success) or
        beyond, or failed, or until ``timeout`` seconds (None: no limit) pass; returns their
        KVPoll codes, in order. Armed timers fire on time meanwhile (a room's own timeouts end
        the wait too), and so does the rank's own bookkeeping (decode's register retries).
        Woken by the transport threads as rooms change state: the blocking alternative to
        calling ``poll()`` in a loop (no CPU spent while waiting, no polling interval added to
        a transfer's latency). Raises LocalProtocolError for a room that does not exist."""
        rooms = list(rooms)
        deadline = None if timeout is None else time.monotonic() + timeout  # real time, whatever the clock
        flush = getattr(self.endpoint, "flush", None)
        if flush is not None:
            # the engine hands nothing over while it waits: writes held back to go together
            # go now, and their completions are looked for closely (see the endpoint's flush)
            flush()
        with self._changed:
            while True:
                self.tick()
                codes = [rt.machine.kvpoll(rt.room) for rt in map(self._get, rooms)]
                if all(c >= until or c == 0 for c in codes):
                    return codes
                waits = []
                if deadline is not None:
                    waits.append(deadline - time.monotonic())
                    if waits[0] <= 0:
                        return codes
                now = self.clock()
                for nxt in (self._timers.next_deadline(), self._side_deadline()):
                    if nxt is not None:
                        waits.append(max(0.0, nxt - now))
                self._changed.wait(min(waits) if waits else None)

    def abort(self, room: int, reason: str = "aborted by engine") -> None:
        from kvfsm.protocol.events import Abort

        self._local(room, Abort(reason))

    def clear(self, room: int) -> None:
        """Forget a concluded room (Success or Failed). Before that, call abort() first."""
        from kvfsm.protocol.events import Clear

        self._local(room, Clear())

    def failure_exception(self, room: int) -> KVTransferError:
        with self._lock:
            rt = self._rooms.get(room)
            reason = rt.room.failure if rt is not None else self._failures.get(room)
        return KVTransferError(room, reason or "room did not fail", side=self.side, rank=self.rank)

    def state(self, room: int) -> str:
        """The machine's leaf state name (finer than KVPoll), for logs and tests."""
        with self._lock:
            return str(self._get(room).room.state)

    def live_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    def stats(self) -> dict[str, Any]:
        snap = self.telemetry.snapshot()
        with self._lock:
            snap["live_rooms"] = len(self._rooms)
            snap["armed_timers"] = len(self._timers)
            snap["tombstones"] = len(self._tombstones)
            snap["workers_alive"] = self.pool.alive
        snap["side"] = self.side
        snap["rank"] = self.rank
        return snap

    def tick(self, now: float | None = None) -> None:
        """Fire due timers and expire bookkeeping. Call it regularly (poll() does)."""
        with self._lock:
            now = self.clock() if now is None else now
            while (due := self._timers.pop_next_due(now)) is not None:
                self._dispatch(due[0], TimerFired(due[1]))  # may cancel the room's other due timers
            while self._tomb_order and self._tomb_order[0][0] <= now:
                _, rid = self._tomb_order.popleft()
                entry = self._tombstones.get(rid)
                if entry is not None and entry[1] <= now:
                    del self._tombstones[rid]
                    self._failures.pop(rid, None)
            self._tick_side(now)

    def fire_timer(self, room: int, timer: str) -> None:
        """Fire one armed timer now, whatever its deadline (trace replay and tests)."""
        with self._lock:
            if not self._timers.armed(room, timer):
                raise LocalProtocolError(f"timer {timer!r} of room {room} is not armed on {self.side} rank {self.rank}")
            self._timers.cancel(room, timer)
            self._dispatch(room, TimerFired(timer))

    def next_deadline(self) -> float | None:
        with self._lock:
            return self._timers.next_deadline()

    def close(self) -> None:
        self.pool.close()

    # ------------------------------------------------------------------ internals

    def _tick_side(self, now: float) -> None:
        pass

    def _expect_traffic(self) -> None:
        """Tell the endpoint whether peers may write into us now, when that changes (see
        ``receives_writes``; the lock held, or in __init__)."""
        on = self.receives_writes and bool(self._rooms)
        if on != self._expecting and self._traffic_hint is not None:
            self._traffic_hint(on)
        self._expecting = on

    def _side_deadline(self) -> float | None:
        """When ``_tick_side`` next has work (wait() wakes for it), or None."""
        return None

    def _get(self, room: int) -> RoomRuntime:
        rt = self._rooms.get(room)
        if rt is None:
            if room in self._tombstones:
                raise LocalProtocolError(f"room {room} was cleared on {self.side} rank {self.rank}")
            raise LocalProtocolError(f"room {room} does not exist on {self.side} rank {self.rank}; create it first")
        return rt

    def _known(self, rid: int) -> str:
        """What this rank knows of room ``rid`` (a ``kvfsm.protocol.routing`` kind)."""
        if rid in self._rooms:
            return LIVE
        tomb = self._tombstones.get(rid)
        if tomb is not None:
            return tomb[0]
        return EARLY if rid in self._early else UNKNOWN

    def _new_room(self, rid: int, room: Any, machine: RoomMachine | None = None) -> Create:
        """Create room ``rid``'s machine (``machine``, default the push one), as
        ``routing.create`` decides over what is known of the id; the decision is returned for
        the caller to carry out the rest (abort, replay)."""
        if type(rid) is not int or not 0 <= rid <= MAX_ROOM_ID:
            raise LocalProtocolError(f"room id must be an integer in [0, 2**63): {rid!r}")
        decision = create(self._known(rid))
        if decision.refuse == "duplicate":
            raise LocalProtocolError(
                f"room {rid} already exists on {self.side} rank {self.rank} (duplicate bootstrap_room)"
            )
        if decision.refuse:
            raise LocalProtocolError(
                f"room {rid} was used and cleared recently on {self.side} rank {self.rank}; room ids must be unique"
            )
        self._tombstones.pop(rid, None)  # an expiry tombstone: the room now exists, and fails (decision.abort)
        now = self.clock()
        machine = machine or self.machine
        self._rooms[rid] = RoomRuntime(room, machine, now, now)
        self._expect_traffic()
        self.telemetry.count("rooms_created")
        self._execute(self._rooms[rid], machine.create(room, now), now)
        return decision

    def _local(self, rid: int, event: Event) -> None:
        """A local event: misuse raises LocalProtocolError to the caller, the room unchanged."""
        with self._lock:
            rt = self._rooms.get(rid) or self._get(rid)  # (_get raises for a missing room)
            nested, self._draining = self._draining, True  # events raised meanwhile wait their turn
            try:
                self._step(rt, event)
            finally:
                self._draining = nested
            if self._queue:  # events raised meanwhile (the usual case: none)
                self._drain()

    def _fast_ok(self) -> bool:
        """May an inbound event take its fast row now? Only with nothing queued before it (events
        apply in order) and no room in the middle of a generic step (run to completion). While
        a chunk of P11 or P10 is being posted its room is already stepped, so a write that a
        posting caller finds completed meanwhile (the NIXL data plane completes transfers as it
        posts) takes it too, instead of waiting in the queue for the post's end."""
        return self.fast_rows and not self._queue and (not self._draining or self._fast_posting)

    def _dispatch(self, rid: int, event: Event) -> None:
        """Queue an event for a room and run the queue to completion (lock held)."""
        self._queue.append((rid, event))
        self._drain()

    def _drain(self) -> None:
        if self._draining or not self._queue:  # nested, or nothing raised: the usual case
            return
        self._draining = True
        try:
            while self._queue:
                rid, event = self._queue.popleft()
                rt = self._rooms.get(rid)
                if rt is None:
                    self._count_drop("event_for_gone_room", f"{event.trigger} for room {rid} that no longer exists")
                    continue
                try:
                    self._step(rt, event)
                except LocalProtocolError as exc:
                    # An internal event our runtime should never produce in this state.
                    self.telemetry.count("internal_errors")
                    log.error("%s%d room %d: %s", self.side, self.rank, rid, exc)
        finally:
            self._draining = False

    def _step(self, rt: RoomRuntime, event: Event) -> None:
        now = self.clock()
        before = rt.room.state
        actions = rt.machine.step(rt.room, event, now)
        if rt.room.state != before:
            self._state_changed(rt, before, now)
        self._execute(rt, actions, now)

    def _state_changed(self, rt: RoomRuntime, before: str, now: float) -> None:
        room = rt.room
        self._changed.notify_all()
        key = _STATE_SECONDS.get(before) or _STATE_SECONDS.setdefault(before, f"state_seconds.{before}")
        since, rt.state_since = rt.state_since, now
        after = room.state
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s%d room %d: %s -> %s (%s)", self.side, self.rank, room.room, before, after, room.last_row)
        if after == "Success":
            self.telemetry.count("rooms_succeeded")
            samples = [(key, now - since), ("room_seconds", now - rt.created)]
            if rt.started is not None:
                samples.append(("transfer_seconds", now - rt.started))
            samples += (("room_bytes", rt.bytes), ("room_descriptors", rt.descriptors))
            self.telemetry.observe_many(samples)
            return
        self.telemetry.observe(key, now - since)
        if after == "Failed":
            self.telemetry.count("rooms_failed")
            code = (room.failure or "unknown").split(":", 1)[0]
            self.telemetry.count(f"failure.{code}")
            self._failures[room.room] = room.failure or ""
            log.info("%s%d room %d failed in %s: %s", self.side, self.rank, room.room, before, room.failure)
        elif after == "Cleared":
            self.telemetry.count("rooms_cleared")
            known = cleared(self.routing, before == "Failed")
            self._timers.cancel_room(room.room)
            if known == LIVE:
                return  # a routing mutant: the cleared room's machine stays routable
            del self._rooms[room.room]
            self._expect_traffic()
            expiry = now + self.config.tombstone_ttl_s
            self._tombstones[room.room] = (known, expiry)
            self._tomb_order.append((expiry, room.room))
            if before != "Failed":
                self._failures.pop(room.room, None)

    def _execute(self, rt: RoomRuntime, actions: list[Action], now: float) -> None:
        rid = rt.room.room
        for a in actions:
            # most frequent first: every chunk and completion arms a timer, every chunk posts (two
            # isinstance calls, not one on PostWrite | PostAuxWrite: that builds a union each time)
            if isinstance(a, SetTimer):
                self._timers.set(rid, a.timer, a.deadline)
            elif isinstance(a, PostWrite) or isinstance(a, PostAuxWrite):
                if rt.started is None:
                    rt.started = now
                self._post(rt, a)
            elif isinstance(a, CancelTimer):
                self._timers.cancel(rid, a.timer)
            elif isinstance(a, SendMessage):
                try:
                    self._send(a.peer_rank, a.message)
                except Exception as exc:  # noqa: BLE001 - a send is best effort: lost, not fatal
                    # The room has moved on and the rest of its actions (timers) must still be
                    # carried out; a lost message is what the protocol's timers already cover.
                    self._count_drop("send_error", f"{a.message.TYPE} to rank {a.peer_rank}: {exc!r}")
                    log.error("%s%d room %d: sending %s failed: %r", self.side, self.rank, rid, a.message.TYPE, exc)
            elif isinstance(a, PostRead):
                if rt.started is None:
                    rt.started = now
                self._post_read(rt, a)
            elif isinstance(a, RecordIgnored):
                self.telemetry.count("ignored")
                log.debug("%s%d room %d: ignored %s", self.side, self.rank, rid, a.reason)
            elif isinstance(a, RecordProtocolError):
                self.telemetry.count("protocol_errors")
                log.warning("%s%d room %d: protocol error: %s", self.side, self.rank, rid, a.reason)
            else:  # pragma: no cover - exhaustive over Action
                raise AssertionError(f"unhandled action {a!r}")

    def _post(self, rt: RoomRuntime, action: PostWrite | PostAuxWrite) -> None:
        raise LocalProtocolError(f"{self.side} rooms do not write")

    def _post_read(self, rt: RoomRuntime, action: PostRead) -> None:
        raise LocalProtocolError(f"{self.side} rooms do not read")

    def _peer_name(self, rank: int) -> str | None:
        raise NotImplementedError

    def _send(self, peer_rank: int, msg: Message) -> None:
        name = self._peer_name(peer_rank)
        if name is None:
            self._count_drop("no_route", f"{msg.TYPE} to unknown {peer_rank=}")
            return
        self.telemetry.count("messages_out")
        self.endpoint.send(name, self.codec.encode(msg))

    def _count_drop(self, what: str, detail: str) -> None:
        self.telemetry.count(f"dropped.{what}")
        log.debug("%s%d dropped (%s): %s", self.side, self.rank, what, detail)

    def _on_inbound(self, item: Inbound) -> None:
        """Transport handler: never raises (a peer's bad input is counted, not propagated)."""
        with self._lock:
            self._handle_inbound(item)

    def _on_inbound_batch(self, items: list[Inbound]) -> None:
        """Several items under one acquisition of the lock (a NIXL poll round: the completions
        of a folded transfer): an engine thread handing over chunks meanwhile waits once, not
        once per item. Never raises, as ``_on_inbound``."""
        with self._lock:
            for item in items:
                self._handle_inbound(item)

    def _handle_inbound(self, item: Inbound) -> None:
        """One inbound item, the lock held. Never raises."""
        if item.kind == "completions":  # the most frequent kind on prefill (NIXL: a transfer's writes)
            self._on_completions(item)
            return
        try:
            if item.kind == "completion":
                self._on_completion(item.tag, item.ok, item.reason)
            elif item.kind in ("message", "notification"):
                try:
                    msg = self.codec.decode(item.data)
                except UnsupportedVersion as exc:
                    self._count_drop("unsupported_version", f"from {item.peer}: {exc}")
                    log.warning("%s%d: %s from %s", self.side, self.rank, exc, item.peer)
                    return
                except MalformedMessage as exc:
                    self._count_drop("malformed", f"from {item.peer}: {exc}")
                    log.warning("%s%d: malformed message from %s: %s", self.side, self.rank, item.peer, exc)
                    return
                self.telemetry.count("messages_in")
                self._on_message(item.peer, item.kind, msg)
            elif item.kind == "peer_lost":
                self.telemetry.count("peers_lost")
                self._on_peer_lost(item.peer, item.reason)
            self._drain()
        except Exception:  # noqa: BLE001 - last line of defence: never kill the transport thread
            self._internal_error(item)

    def _internal_error(self, item: Inbound) -> None:
        """Handling ``item`` raised (a bug of ours): count and log it, with the exception."""
        self.telemetry.count("internal_errors")
        log.exception("%s%d: error handling %s from %s", self.side, self.rank, item.kind, item.peer)

    def _room_for_message(self, rid: int, what: str) -> RoomRuntime | None:
        """The room a message ``what`` for ``rid`` goes to, or None: dropped and counted as
        ``routing.route_message`` decides (decode: no stash, no reply). (A room in ``_rooms`` is
        LIVE, whose route is always dispatch: looked up first, as it is on every notification.)"""
        rt = self._rooms.get(rid)
        if rt is None:
            known = self._known(rid)
            self._count_drop(route_message(known, self.side, what).drop, f"{what} for room {rid} ({known})")
        return rt

    def _on_message(self, peer: str, kind: str, msg: Message) -> None:
        raise NotImplementedError

    def _on_completions(self, item: Inbound) -> None:
        """A transfer's writes (``item.tag``, their tags), all completed: each as
        ``_on_completion(tag, True, "")`` takes it. One that raises is counted and logged, and
        the others still complete. The lock held."""
        for tag in item.tag:  # type: ignore[attr-defined]
            try:
                self._on_completion(tag, True, "")  # (it runs the event queue: _dispatch)
            except Exception:  # noqa: BLE001 - as _handle_inbound, and the item's other writes still complete
                self._internal_error(item)

    def _on_completion(self, tag: object, ok: bool, reason: str) -> None:
        """Our write ``tag`` completed (``ok``) or failed (``reason``). The lock held."""
        self._count_drop("unexpected_completion", f"of write {tag!r}")

    def _on_peer_lost(self, peer: str, reason: str) -> None:
        raise NotImplementedError
