"""Loopback: the embedded default transport. Control and data plane in one process.

Theory of operation
-------------------
A ``Fabric`` is the network: endpoints attach to it by name. A registered buffer is real bytes
and ``write`` really copies them (``memoryview`` slice assignment: a memcpy), synchronously in
the calling thread (a transfer worker), exactly like a synchronous RDMA write. What happens after
the bytes moved is queued as *items*: the notification for the destination and the completion
for the writer. Control messages are items too. A notification item is created only after its
data was copied, so a notification is never delivered before its data.

``pump()`` delivers queued items to the endpoints' handlers. Which item goes next is chosen by a
seeded ``random.Random``: with ``ordered=True`` per (sender, receiver) pair FIFO, pairs interleaved;
otherwise any queued item. Fault injection applies at send time to messages and notifications:
``drop`` and ``dup`` probabilities, ``delay`` (probability that an item is held back for a few
picks). ``crash(name)`` kills an endpoint: its queued items vanish, writes to it fail, and every
endpoint that talked to it receives a ``peer_lost`` item. Completions are never dropped (the
transport always reports the fate of our own writes), but they do race with notifications.

Handlers run in the pumping thread, never while the fabric's lock is held.
"""

from __future__ import annotations

import ctypes
import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvfsm.config import non_negative, positive_int, setting, validate
from kvfsm.transport.base import (
    AddPeer,
    Handler,
    Inbound,
    Parts,
    Region,
    RemovePeer,
    Segment,
    TransportError,
    as_regions,
    check_segments,
)
from kvfsm.transport.loopback_memory import Pieces, address_of, check_pieces, copy_pieces, host_view

log = logging.getLogger("kvfsm.transport.loopback")


def _probability(x: Any) -> bool:
    return non_negative(x) and x <= 1


@dataclass(frozen=True, slots=True)
class Faults:
    """What the fabric does wrong, on purpose: fault injection for messages and notifications
    (completions are never dropped, duplicated or delayed). Validated at construction."""

    drop: float = setting(
        0.0,
        doc="Probability that a message or notification is lost.",
        when="Test that the protocol's timers and retries cover a lossy network.",
        check=_probability,
        must="a probability in [0, 1]",
    )
    dup: float = setting(
        0.0,
        doc="Probability that a message or notification is delivered twice.",
        when="Test that duplicates are harmless.",
        check=_probability,
        must="a probability in [0, 1]",
    )
    delay: float = setting(
        0.0,
        doc="Probability that a message or notification is held back for up to max_delay picks.",
        when="Test reordering beyond what the ordering model allows.",
        check=_probability,
        must="a probability in [0, 1]",
    )
    max_delay: int = setting(
        8,
        doc="The most picks a delayed item waits.",
        when="Raise it for longer reorderings under delay.",
        check=positive_int,
        must="an int >= 1 (picks)",
    )

    def __post_init__(self) -> None:
        validate(self)

    @property
    def any(self) -> bool:
        return bool(self.drop or self.dup or self.delay)


@dataclass(slots=True)
class _Item:
    src: str
    dst: str
    inbound: Inbound
    hold: int = 0  # picks to wait (delay fault)
    job: tuple[Any, ...] | None = None  # async_writes: (writer, region, segments, notification) of a write in flight


@dataclass
class FabricStats:
    sent: int = 0
    delivered: int = 0
    dropped: int = 0
    duplicated: int = 0
    delayed: int = 0
    bytes_written: int = 0
    writes: int = 0
    segments: int = 0
    undeliverable: int = 0
    counts: dict[str, int] = field(default_factory=dict)


class Fabric:
    """The in-process network. Thread-safe; deterministic for a seed when pumped by one thread.

    Its arguments are the network model a test or a replay picks: ``seed`` (the delivery order's
    random choices), ``ordered`` (FIFO per pair, or any queued item next), ``faults`` (what goes
    wrong on purpose) and ``async_writes`` (a write's data lands when its queued item is
    delivered, like an RDMA write in flight, instead of inside ``write()``; replay uses it to
    follow checker traces). None of them is tuning, and none has a right value for a GPU server,
    so the loopback has no configuration object: ``Faults`` is the one validated, documented part.
    """

    def __init__(
        self, seed: int = 0, *, ordered: bool = True, faults: Faults | None = None, async_writes: bool = False
    ) -> None:
        self.rng = random.Random(seed)
        self.ordered = ordered
        self.async_writes = async_writes
        self.faults = faults or Faults()
        self._lock = threading.Lock()
        self._endpoints: dict[str, LoopbackEndpoint] = {}
        self._dead: set[str] = set()
        self._queues: dict[tuple[str, str], deque[_Item]] = {}
        self._pending = 0
        self._contacts: dict[str, set[str]] = {}
        self.stats = FabricStats()

    # ------------------------------------------------------------------ endpoints

    def endpoint(self, name: str) -> LoopbackEndpoint:
        with self._lock:
            if name in self._endpoints:
                raise ValueError(f"endpoint {name!r} already attached")
            ep = LoopbackEndpoint(self, name)
            self._endpoints[name] = ep
            self._contacts[name] = set()
            return ep

    def is_dead(self, name: str) -> bool:
        return name in self._dead

    def crash(self, name: str) -> None:
        """Kill ``name``: its queued items vanish, its memory is gone, peers learn of the loss."""
        with self._lock:
            if name in self._dead or name not in self._endpoints:
                return
            self._dead.add(name)
            for key in [k for k in self._queues if name in k]:
                for item in self._queues.pop(key):
                    self._pending -= 1
                    if item.inbound.kind == "completion" and item.job is None and item.dst != name:
                        # the fate of a survivor's write into the dead node: still owed to it
                        self._enqueue(replace(item, hold=0))
                        self.stats.sent -= 1  # re-queued, not sent again
                    elif item.job is not None and item.dst == name and item.src not in self._dead:
                        # a write in flight into the dead node fails: its writer learns it
                        self._enqueue(
                            _Item(
                                name,
                                item.src,
                                Inbound("completion", name, tag=item.inbound.tag, ok=False, reason=f"{name} crashed"),
                            )
                        )
            for other in sorted(self._contacts.get(name, ())):
                if other not in self._dead:
                    self._enqueue(_Item(name, other, Inbound("peer_lost", name, reason=f"{name} crashed")))

    # ------------------------------------------------------------------ queueing

    def _enqueue(self, item: _Item) -> None:
        # caller holds the lock
        self._queues.setdefault((item.src, item.dst), deque()).append(item)
        self._pending += 1
        self.stats.sent += 1

    def _post(self, src: str, dst: str, inbound: Inbound, faulty: bool) -> None:
        with self._lock:
            self._post_locked(src, dst, inbound, faulty)

    def _post_locked(self, src: str, dst: str, inbound: Inbound, faulty: bool) -> None:
        if src in self._dead:
            return
        if dst in self._dead or dst not in self._endpoints:
            self.stats.undeliverable += 1
            return
        self._contacts[src].add(dst)
        self._contacts[dst].add(src)
        copies = 1
        hold = 0
        f = self.faults
        if faulty and f.any:
            if f.drop and self.rng.random() < f.drop:
                self.stats.dropped += 1
                return
            if f.dup and self.rng.random() < f.dup:
                self.stats.duplicated += 1
                copies = 2
            if f.delay and self.rng.random() < f.delay:
                self.stats.delayed += 1
                hold = self.rng.randint(1, f.max_delay)
        for _ in range(copies):
            self._enqueue(_Item(src, dst, inbound, hold))

    @property
    def pending(self) -> int:
        return self._pending

    def _pick(self) -> _Item | None:
        # caller holds the lock. Candidates: each pair's head (ordered) or every queued item.
        if not self._pending:
            return None
        cands = [(key, idx) for key, q in self._queues.items() for idx in (range(1) if self.ordered else range(len(q)))]
        ready = []
        for key, idx in cands:
            item = self._queues[key][idx]
            if item.hold:
                item.hold -= 1  # a held-back item ages with every pick that passes it over
            else:
                ready.append((key, idx))
        pool = ready or cands
        key, idx = pool[self.rng.randrange(len(pool))] if len(pool) > 1 else pool[0]
        q = self._queues[key]
        item = q[idx]
        del q[idx]
        if not q:
            del self._queues[key]
        self._pending -= 1
        return item

    def pump(self, max_items: int | None = None) -> int:
        """Deliver up to ``max_items`` queued items (all, if None). Returns how many."""
        n = 0
        while max_items is None or n < max_items:
            with self._lock:
                item = self._pick()
                if item is None:
                    break
                n += 1
            self.deliver(item)
        return n

    def deliver(self, item: _Item) -> None:
        """Deliver one item taken from the queues (pump, or a replay choosing it by hand)."""
        with self._lock:
            ep = self._endpoints.get(item.dst)
            dead = item.dst in self._dead
            if item.job is None and (ep is None or dead or ep.handler is None):
                self.stats.undeliverable += 1
                return
            self.stats.delivered += 1
        if item.job is not None:
            writer, region, segments, notification = item.job
            self._land(writer, item.dst, region, segments, notification, item.inbound.tag)
        else:
            assert ep is not None and ep.handler is not None
            if ep._admit(item.inbound):
                ep.handler(item.inbound)  # never under the lock: handlers send and write

    def take(self, match: Callable[[_Item], bool]) -> _Item | None:
        """Remove and return the first queued item ``match`` accepts (replay and fault tests)."""
        with self._lock:
            for key, q in self._queues.items():
                for idx, item in enumerate(q):
                    if match(item):
                        del q[idx]
                        if not q:
                            del self._queues[key]
                        self._pending -= 1
                        return item
        return None

    def fail_write(self, item: _Item) -> None:
        """A write taken from the queues is lost: its writer is told it failed (the data plane
        always reports the fate of a posted write)."""
        assert item.job is not None
        with self._lock:
            self._enqueue(
                _Item(
                    item.dst,
                    item.src,
                    Inbound("completion", item.dst, tag=item.inbound.tag, ok=False, reason="write lost"),
                )
            )

    def requeue(self, item: _Item) -> None:
        """Queue ``item`` again (a duplicate, when chosen by a replay)."""
        with self._lock:
            self._enqueue(replace(item, hold=0))

    def queued(self) -> list[_Item]:
        with self._lock:
            return [item for q in self._queues.values() for item in q]

    # ------------------------------------------------------------------ data plane

    def _write(
        self,
        src: LoopbackEndpoint,
        peer: str,
        region: Region,
        segments: Sequence[Segment],
        notification: bytes,
        tag: object,
    ) -> int:
        with self._lock:
            dst = self._endpoints.get(peer)
            dead = src.name in self._dead or peer in self._dead
        if dead or dst is None:
            if self.async_writes and dst is not None and src.name not in self._dead:
                # like a posted RDMA write to a dead peer: accepted, then reported failed
                with self._lock:
                    self._enqueue(
                        _Item(peer, src.name, Inbound("completion", peer, tag=tag, ok=False, reason=f"{peer} is dead"))
                    )
                return 0
            raise TransportError(f"write to {peer}: peer is not reachable")
        if (src._parts or dst._parts) and (region in src._parts or region in dst._parts):  # several buffers
            moved = check_pieces(src.pieces(region), dst.pieces(region), segments, f"write {src.name}->{peer} {region}")
            if moved is not None:
                if self.async_writes:
                    with self._lock:
                        self._contacts[src.name].add(peer)
                        self._contacts[peer].add(src.name)
                        self._enqueue(
                            _Item(
                                src.name,
                                peer,
                                Inbound("completion", peer, tag=tag),
                                job=(src, region, segments, notification),
                            )
                        )
                    return moved
                return self._land(src, peer, region, segments, notification, tag)
        src_mv = src.region(region)
        dst_mv = dst.region(region)
        if src_mv is None or dst_mv is None:
            raise TransportError(f"write {src.name}->{peer}: {region} region not registered on both ends")
        if dst_mv.readonly:
            raise TransportError(f"write {src.name}->{peer}: {peer}'s {region} region is read-only")
        # Reject before any byte is written.
        for s in segments:
            if (
                s.length < 0
                or s.src < 0
                or s.dst < 0
                or s.src + s.length > len(src_mv)
                or s.dst + s.length > len(dst_mv)
            ):
                raise TransportError(
                    f"write {src.name}->{peer}: segment {s} outside registered {region} "
                    f"({len(src_mv)} local, {len(dst_mv)} remote bytes)"
                )
        if self.async_writes:
            with self._lock:
                self._contacts[src.name].add(peer)
                self._contacts[peer].add(src.name)
                self._enqueue(
                    _Item(
                        src.name, peer, Inbound("completion", peer, tag=tag), job=(src, region, segments, notification)
                    )
                )
            return sum(s.length for s in segments)
        return self._land(src, peer, region, segments, notification, tag)

    def _land(
        self, src: LoopbackEndpoint, peer: str, region: Region, segments: Sequence[Segment], notification: bytes,
        tag: object,
    ) -> int:  # fmt: skip
        with self._lock:
            dst = self._endpoints.get(peer)
            if peer in self._dead or dst is None:
                if src.name not in self._dead:
                    self._enqueue(
                        _Item(peer, src.name, Inbound("completion", peer, tag=tag, ok=False, reason=f"{peer} is dead"))
                    )
                return 0
        if (src._parts or dst._parts) and (region in src._parts or region in dst._parts):
            moved = copy_pieces(src.pieces(region), dst.pieces(region), segments)
        else:
            moved = 0
            src_mv, dst_mv = src.region(region), dst.region(region)
            assert src_mv is not None and dst_mv is not None  # checked by _write
            src_addr, dst_addr = src.address(region), dst.address(region)
            for s in segments:
                if src_addr and dst_addr:
                    # memmove through ctypes releases the GIL: copies run in parallel with the
                    # control path and with other transfer workers, as a real data plane does.
                    ctypes.memmove(dst_addr + s.dst, src_addr + s.src, s.length)
                else:
                    dst_mv[s.dst : s.dst + s.length] = src_mv[s.src : s.src + s.length]
                moved += s.length
        with self._lock:
            self.stats.bytes_written += moved
            self.stats.writes += 1
            self.stats.segments += len(segments)
            if src.name in self._dead:
                return moved  # the writer died meanwhile: nobody left to tell
            if peer in self._dead:
                # The peer died during the copy: the writer still learns the fate of its write.
                self._enqueue(
                    _Item(
                        peer,
                        src.name,
                        Inbound("completion", peer, tag=tag, ok=False, reason=f"{peer} crashed during the write"),
                    )
                )
                return moved
            # Data first, then its notification; the completion races with it.
            self._post_locked(src.name, peer, Inbound("notification", src.name, data=notification), faulty=True)
            self._post_locked(peer, src.name, Inbound("completion", peer, tag=tag), faulty=False)
        return moved

    def _read(
        self, me: LoopbackEndpoint, peer: str, region: Region, segments: Sequence[Segment], notification: bytes,
        tag: object,
    ) -> int:  # fmt: skip
        """One-sided read, synchronous: ``peer``'s bytes (``src`` offsets) land in ours (``dst``),
        then ``peer`` is notified and we complete."""
        with self._lock:
            src = self._endpoints.get(peer)
            if me.name in self._dead or peer in self._dead or src is None:
                raise TransportError(f"read {peer}->{me.name}: peer is not reachable")
        pieces = (src._parts or me._parts) and (region in src._parts or region in me._parts)
        if pieces:
            moved = check_pieces(src.pieces(region), me.pieces(region), segments, f"read {peer}->{me.name} {region}")
            if moved is None:
                raise TransportError(f"read {peer}->{me.name}: {region} region not registered on both ends")
            copy_pieces(src.pieces(region), me.pieces(region), segments)
            with self._lock:
                self.stats.bytes_written += moved
                self.stats.segments += len(segments)
                self._post_locked(me.name, peer, Inbound("notification", me.name, data=notification), faulty=True)
                self._post_locked(peer, me.name, Inbound("completion", peer, tag=tag), faulty=False)
            return moved
        src_mv, dst_mv = src.region(region), me.region(region)
        if src_mv is None or dst_mv is None:
            raise TransportError(f"read {peer}->{me.name}: {region} region not registered on both ends")
        if dst_mv.readonly:
            raise TransportError(f"read {peer}->{me.name}: our {region} region is read-only")
        moved = check_segments(segments, len(src_mv), len(dst_mv), f"read {peer}->{me.name} {region}")
        for s in segments:
            dst_mv[s.dst : s.dst + s.length] = src_mv[s.src : s.src + s.length]
        with self._lock:
            self.stats.bytes_written += moved
            self.stats.segments += len(segments)
            self._post_locked(me.name, peer, Inbound("notification", me.name, data=notification), faulty=True)
            self._post_locked(peer, me.name, Inbound("completion", peer, tag=tag), faulty=False)
        return moved


class LoopbackEndpoint:
    """One (side, rank)'s attachment to a Fabric: both ports of kvfsm.transport.base.Endpoint."""

    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric = fabric
        self.name = name
        self.handler: Handler | None = None
        self._kv: memoryview | None = None
        self._aux: memoryview | None = None
        self._addr: dict[str, int] = {}
        # a region of several buffers: its parts' views, their addresses (0: copy through the
        # view) and where they lie in the region's virtual space; absent for one buffer
        self._parts: dict[str, Pieces] = {}
        # attach_data: a separate data plane's descriptor and hooks (loopback as a control plane)
        self._descriptor = b""
        self._add_peer: AddPeer | None = None
        self._remove_peer: RemovePeer | None = None
        self._introduced: dict[str, bool] = {}  # peer -> its descriptor was accepted

    def attach_data(self, descriptor: bytes, add_peer: AddPeer, remove_peer: RemovePeer) -> None:
        """Use this endpoint as the control plane of another data plane: every peer's descriptor
        reaches ``add_peer`` before its first message is delivered here."""
        self._descriptor, self._add_peer, self._remove_peer = descriptor, add_peer, remove_peer

    def _admit(self, item: Inbound) -> bool:
        """Run the attached data plane's hooks for an inbound item; False drops it."""
        if self._add_peer is None or item.kind not in ("message", "peer_lost"):
            return True
        peer = item.peer
        if item.kind == "peer_lost":
            self._introduced[peer] = False
            assert self._remove_peer is not None
            self._remove_peer(peer)
            return True
        known = self._introduced.get(peer)
        if known is None:
            other = self.fabric._endpoints.get(peer)
            try:
                self._add_peer(peer, other._descriptor if other is not None else b"")
                known = True
            except TransportError as exc:
                log.warning("%s: refused descriptor of %s: %s", self.name, peer, exc)
                known = False
            self._introduced[peer] = known
        if not known:
            self.fabric.stats.counts["refused_peer"] = self.fabric.stats.counts.get("refused_peer", 0) + 1
        return known

    def set_handler(self, handler: Handler) -> None:
        self.handler = handler

    def register_memory(self, kv: Any, aux: Any, *, kv_block: int = 0, aux_block: int = 0) -> None:
        self._parts = {}
        if isinstance(kv, list | tuple) and len(kv) != 1:
            as_regions(kv)  # (the same checks as any data plane's)
            views = [host_view(b) for b in kv]
            self._parts["kv"] = Pieces(views, [address_of(v) for v in views], Parts([len(v) for v in views]))
            self._kv = None
        else:
            self._kv = host_view(kv[0] if isinstance(kv, list | tuple) else kv)
        self._aux = host_view(aux)
        self._addr = {"kv": address_of(self._kv) if self._kv is not None else 0, "aux": address_of(self._aux)}

    def descriptor(self) -> bytes:
        return b""  # the fabric knows every endpoint's memory

    def add_peer(self, peer: str, descriptor: bytes) -> None:
        if descriptor:
            raise TransportError(f"loopback peers carry no descriptor ({len(descriptor)} bytes from {peer!r})")

    def remove_peer(self, peer: str) -> None:
        pass

    def close(self) -> None:
        pass

    def region(self, region: Region) -> memoryview | None:
        """The bytes of a region of one buffer (None: not registered, or of several buffers)."""
        if region == "kv":
            return self._kv
        if region == "aux":
            return self._aux
        raise TransportError(f"unknown region {region!r}: 'kv' or 'aux'")

    def pieces(self, region: Region) -> Pieces | None:
        """A registered region's parts: views, addresses (0: copy through the view) and layout
        (``Parts``); one part for a region of one buffer. None: not registered."""
        found = self._parts.get(region)
        if found is not None:
            return found
        mv = self.region(region)
        return None if mv is None else Pieces([mv], [self.address(region)], Parts([len(mv)]))

    def address(self, region: Region) -> int:
        """Base address of a registered writable region (0: unknown, copy through memoryview)."""
        return self._addr.get(region, 0)

    def send(self, peer: str, data: bytes) -> None:
        self.fabric._post(self.name, peer, Inbound("message", self.name, data=data), faulty=True)

    def write(self, peer: str, region: Region, segments: Sequence[Segment], notification: bytes, tag: object) -> int:
        return self.fabric._write(self, peer, region, segments, notification, tag)

    def write_run(
        self, peer: str, region: Region, src: int, dst: int, length: int, notification: bytes, tag: object
    ) -> int:
        """``write`` of one segment (``DataPlane``'s optional ``write_run``)."""
        return self.fabric._write(self, peer, region, [Segment(src, dst, length)], notification, tag)

    def read(
        self,
        peer: str,
        region: Region,
        segments: Sequence[Segment],
        notification: bytes,
        tag: object,
        within_s: float | None = None,
    ) -> int:
        """(``within_s`` holds trivially: the bytes move inside the call.)"""
        return self.fabric._read(self, peer, region, segments, notification, tag)

    def inject(self, peer: str, inbound: Inbound) -> None:
        """Test hook: queue an arbitrary inbound item for this endpoint as if ``peer`` sent it."""
        with self.fabric._lock:
            self.fabric._enqueue(_Item(peer, self.name, inbound))
