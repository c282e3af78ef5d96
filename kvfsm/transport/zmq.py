"""ZeroMQ control plane: small messages between named peers over TCP, and a bootstrap service.

Theory of operation
-------------------
Timers and limits come from a ``ZmqConfig`` (``config=``, see ``kvfsm.transport.zmq_config``);
``heartbeat_s``, ``peer_timeout_s``, ``max_message``, ``max_descriptor``, ``queue_limit`` and
``linger_s`` below are its fields.

Each ``ZmqControlPlane`` has one I/O thread, and that thread owns every zmq socket of the plane
(zmq sockets are not thread-safe). ``send()`` from any thread appends to an outbox under a lock
and wakes the thread through a socketpair registered in its ``zmq.Poller``; when idle the thread
sleeps in ``poll`` until a socket, the waker or the next deadline (a connect or lookup timeout)
needs it: no busy polling.

A ROUTER bound at ``bind`` receives from every peer. To talk to peer X the plane opens its own
DEALER (routing id = our name) connected to X's ROUTER, so one ordered pipe carries everything we
say to X. X's address comes from the static ``peers`` map, from X's HELLO, or from an
asynchronous lookup at the bootstrap service (a DEALER owned by the I/O thread; messages wait for
the answer; an unknown name or a lookup timeout drops them, counted). With ``bootstrap`` the plane
registers (name, address, side, rank) in ``__init__`` (waiting up to ``max(1, peer_timeout_s)``
seconds for the service; TransportError if it does not answer) and unregisters in ``close``.

Framing: every message is ``[kind, payload...]`` (the ROUTER prepends the sender's identity):
``H`` HELLO ``[b"H", header, descriptor]``, ``M`` message ``[b"M", payload]``, ``B`` BYE ``[b"B"]``.
The HELLO header is the JSON object ``{"v": 1, "name": str, "address": "tcp://..."}``, exactly
these fields; another ``v`` is ``dropped.unsupported_version``. The first thing sent on a new
DEALER is HELLO with our data-plane descriptor, so nothing we say can overtake it. Inbound
checks: frame count per kind, header size and types, identity == HELLO name, ``max_message``
and ``max_descriptor``; a frame above both limits plus 64 KiB makes zmq drop the connection
(``MAXMSGSIZE``). Anything that fails is dropped and counted in ``stats()`` as
``dropped.<reason>``; a peer's bytes never raise out of the I/O thread, and nothing is pickled.

On X's HELLO the plane calls ``add_peer(X, descriptor)`` before delivering any message of X (if
``attach_data`` comes later, it is called then, for every peer already heard). If it raises, X is
refused: its messages are ``dropped.refused_peer``. Once the plane is *ready* (``attach_data``
was called, or it sent something) it also opens a DEALER back to every peer that said HELLO, so
each side holds the other's descriptor and watches the other's liveness. ``attach_data`` after
the first ``send`` raises: peers may already hold our empty descriptor.

Peer loss. Each DEALER has a socket monitor and ZMTP heartbeats (``heartbeat_s`` interval, a
timeout of ``peer_timeout_s - heartbeat_s``, ``HANDSHAKE_IVL`` = ``peer_timeout_s``). After the
handshake with X succeeded, a disconnect (RST/FIN of a crashed process: milliseconds; silence of a
frozen host or a cut network: about ``peer_timeout_s``) or X's BYE means X is lost; so does a
DEALER that has not completed a handshake within ``peer_timeout_s`` of being opened (its queued
messages are ``dropped.not_connected``). Loss of X: ``remove_peer(X)`` if ``add_peer(X)`` had
succeeded, then ``Inbound("peer_lost", X, reason=...)`` exactly once, and X's DEALER is closed.
**Once lost, a name stays lost for the plane's lifetime**: later sends to X and anything from X
(even a HELLO of a restarted process with the same name) are ``dropped.lost_peer``. A restarted
worker therefore needs a new name, or its peers need new planes. A peer that only ever talked to
a plane that is never ready has no DEALER watching it; only its BYE reports it lost.

Handlers (and ``add_peer``/``remove_peer``) run in the I/O thread, never under the plane's lock;
an exception from them is logged and counted (``handler_errors``), never propagated. ``close()``
from a handler cannot join its own thread; the thread then finishes after the handler returns.

Bind to a concrete interface: ``address`` is the ROUTER's resolved endpoint and is what peers
connect to, so ``tcp://0.0.0.0:*`` would advertise an unreachable address.


The bootstrap service (``BootstrapServer``, ``BootstrapClient``) lives in ``zmq_bootstrap`` and is
re-exported here.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvfsm.transport.base import AddPeer, Handler, Inbound, RemovePeer, TransportError
from kvfsm.transport.zmq_bootstrap import (
    MAX_HEADER,
    MAX_REQUEST,
    VERSION,
    BootstrapClient,
    BootstrapServer,
    Waker,
    check_address,
    check_name,
    dump_json,
    is_int,
    load_json,
)
from kvfsm.transport.zmq_config import ZmqConfig

__all__ = ["BootstrapClient", "BootstrapServer", "ZmqConfig", "ZmqControlPlane"]

log = logging.getLogger(__name__)

HELLO, MESSAGE, BYE = b"H", b"M", b"B"
FRAMES = {HELLO: 3, MESSAGE: 2, BYE: 1}  # frames per kind, kind included, identity excluded
# A frame above every limit by this much makes zmq drop the connection (MAXMSGSIZE): a frame just
# over a limit is still received, so that it is dropped and counted rather than cutting the link.
_FRAME_SLACK = 64 << 10
_RECONNECT_MS = 100  # the most a DEALER waits between attempts to reach a peer (less with faster heartbeats)
_monitor_ids = itertools.count()


# ---------------------------------------------------------------------- control plane


@dataclass(eq=False)
class _Peer:
    """What the I/O thread knows about one peer name."""

    name: str
    address: str | None = None
    dealer: zmq.Socket[bytes] | None = None
    monitor: zmq.Socket[bytes] | None = None
    connected: bool = False  # the DEALER's ZMTP handshake succeeded
    connect_deadline: float | None = None
    unconfirmed: int = 0  # messages posted before the handshake
    waiting: deque[bytes] = field(default_factory=deque)  # messages waiting for a lookup
    lookup_deadline: float | None = None
    helloed: bool = False  # its HELLO reached our ROUTER
    descriptor: bytes | None = None  # from its HELLO, kept until attach_data
    added: bool = False  # add_peer accepted it
    refused: bool = False  # add_peer rejected it: not heard


class ZmqControlPlane:
    """kvfsm.transport.base.ControlPlane over TCP. See the module docstring."""

    def __init__(
        self,
        name: str,
        *,
        bootstrap: str | None = None,
        side: str = "",
        rank: int = -1,
        bind: str = "tcp://127.0.0.1:*",
        peers: Mapping[str, str] | None = None,
        config: ZmqConfig | None = None,
    ) -> None:
        if why := check_name(name):
            raise ValueError(f"plane name {name!r}: {why}")
        self.name = name
        self.config = cfg = config or ZmqConfig()
        self.max_message = cfg.max_message
        self.max_descriptor = cfg.max_descriptor
        self.peer_timeout_s = cfg.peer_timeout_s
        self._hb_ms = max(1, int(cfg.heartbeat_s * 1000))
        self._timeout_ms = max(1, int(cfg.peer_timeout_s * 1000))
        self._linger_ms = int(cfg.linger_s * 1000)
        self._queue_limit = cfg.queue_limit
        self._static = dict(peers or {})
        self._lock = threading.Lock()
        # shared with callers, under _lock
        self._outbox: deque[tuple[str, bytes]] = deque()
        self._wake_pending = False
        self._closed = False
        self._sealed = False  # something was sent: attach_data is too late
        self._attach: tuple[bytes, AddPeer, RemovePeer] | None = None  # set once, taken by the I/O thread
        self._lost: set[str] = set()
        self._counts: dict[str, int] = {}
        self._handler: Handler | None = None
        # I/O thread only
        self._peers: dict[str, _Peer] = {}
        self._monitors: dict[zmq.Socket[bytes], _Peer] = {}
        self._lookups: dict[int, _Peer] = {}
        self._lookup_ids = itertools.count(1)
        self._descriptor = b""
        self._add_peer: AddPeer | None = None
        self._remove_peer: RemovePeer | None = None
        self._ready = False

        self._ctx = zmq.Context()
        self._waker = Waker()
        self._poller = zmq.Poller()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._bs_sock: zmq.Socket[bytes] | None = None
        self._bs_client: BootstrapClient | None = None
        try:
            self._tune(self._router)
            frame_limit = max(cfg.max_message, cfg.max_descriptor, MAX_HEADER) + _FRAME_SLACK
            self._router.setsockopt(zmq.MAXMSGSIZE, frame_limit)
            self._router.setsockopt(zmq.RCVHWM, cfg.queue_limit)
            self._router.bind(bind)
            self.address: str = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
            if bootstrap is not None:
                self._bs_client = BootstrapClient(bootstrap, timeout_s=max(1.0, cfg.peer_timeout_s))
                self._bs_client.register(name, self.address, side, rank)
                self._bs_sock = self._ctx.socket(zmq.DEALER)
                self._bs_sock.setsockopt(zmq.LINGER, 0)
                self._bs_sock.connect(bootstrap)
        except BaseException:
            self._release()
            raise
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._waker.fileno(), zmq.POLLIN)
        if self._bs_sock is not None:
            self._poller.register(self._bs_sock, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name=f"kvfsm-zmq-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller-facing

    def set_handler(self, handler: Handler) -> None:
        self._handler = handler

    def attach_data(self, descriptor: bytes, add_peer: AddPeer, remove_peer: RemovePeer) -> None:
        """Carry ``descriptor`` in every HELLO from now on. Call it once, before the first send."""
        if len(descriptor) > self.max_descriptor:
            raise TransportError(f"descriptor of {len(descriptor)} bytes is over max_descriptor={self.max_descriptor}")
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.name}: attach_data on a closed control plane")
            if self._sealed or self._attach is not None or self._add_peer is not None:
                raise TransportError(
                    f"{self.name}: attach_data must be called once, before the first send "
                    "(SplitEndpoint.register_memory before any message)"
                )
            self._attach = (bytes(descriptor), add_peer, remove_peer)
        self._wake()

    def send(self, peer: str, data: bytes) -> None:
        """Queue ``data`` for ``peer``; never blocks, never raises for a peer's fate."""
        data = bytes(data)
        with self._lock:
            if self._closed:
                reason = "closed"
            elif peer in self._lost:
                reason = "lost_peer"
            elif len(data) > self.max_message:
                reason = "oversize_local"
                log.error("%s: message of %d bytes to %s is over max_message; dropped", self.name, len(data), peer)
            else:
                self._sealed = True
                self._outbox.append((peer, data))
                reason = ""
        if reason:
            self._count(f"dropped.{reason}")
        else:
            self._wake()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Unregister, say BYE to every peer, close every socket and join the I/O thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._bs_client is not None:
            try:
                self._bs_client.unregister(self.name, self.address, timeout_s=0.5)
            except TransportError as exc:
                log.warning("%s: could not unregister: %s", self.name, exc)
            self._bs_client.close()
        self._waker.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ------------------------------------------------------------------ shared helpers

    def _wake(self) -> None:
        with self._lock:
            if self._wake_pending:
                return
            self._wake_pending = True
        self._waker.wake()

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    def _drop(self, reason: str, peer: str, n: int = 1) -> None:
        self._count(f"dropped.{reason}", n)
        log.debug("%s: dropped %d (%s) for/from %r", self.name, n, reason, peer)

    def _tune(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._hb_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(self._hb_ms, self._timeout_ms - self._hb_ms))
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(self._timeout_ms, 6_553_500))
        sock.setsockopt(zmq.HANDSHAKE_IVL, self._timeout_ms)

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        try:
            while True:
                events = dict(self._poller.poll(self._next_timeout_ms()))
                if self._waker.fileno() in events and self._take_outbox():
                    break
                if self._router in events:
                    self._drain_router()
                if self._bs_sock is not None and self._bs_sock in events:
                    self._drain_bootstrap()
                for sock in [s for s in self._monitors if s in events]:
                    if sock in self._monitors:  # not closed by an earlier loss in this round
                        self._drain_monitor(self._monitors[sock])
                self._expire(time.monotonic())
        except Exception:  # noqa: BLE001 - a bug here must not leave sockets open
            log.exception("%s: control-plane I/O thread failed", self.name)
            with self._lock:
                self._closed = True
        finally:
            self._shutdown()

    def _next_timeout_ms(self) -> int | None:
        deadlines = [d for p in self._peers.values() for d in (p.connect_deadline, p.lookup_deadline) if d is not None]
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _take_outbox(self) -> bool:
        """Process what callers queued; True when the plane is closing."""
        self._waker.drain()  # before taking: a send after this wakes us again
        with self._lock:
            items, self._outbox = self._outbox, deque()
            self._wake_pending = False
            attach, self._attach = self._attach, None
            closing = self._closed
        if attach is not None:
            self._descriptor, self._add_peer, self._remove_peer = attach
            for p in list(self._peers.values()):
                if p.helloed and not p.added and not p.refused and p.descriptor is not None:
                    self._accept(p, p.descriptor)
            self._become_ready()
        if items and not self._ready:
            self._become_ready()
        for peer, data in items:
            self._send_to(peer, data)
        return closing

    def _become_ready(self) -> None:
        self._ready = True
        for p in list(self._peers.values()):
            if p.helloed and not p.refused and p.dealer is None and p.name not in self._lost:
                self._open(p)

    def _peer(self, name: str) -> _Peer:
        p = self._peers.get(name)
        if p is None:
            p = self._peers[name] = _Peer(name, self._static.get(name))
        return p

    def _send_to(self, name: str, data: bytes) -> None:
        if name in self._lost:
            self._drop("lost_peer", name)
            return
        p = self._peer(name)
        if p.dealer is None and p.address is not None:
            self._open(p)
        if p.dealer is not None:
            self._post(p, [MESSAGE, data])
        elif name in self._lost:  # _open could not connect
            self._drop("lost_peer", name)
        elif self._bs_sock is None:
            self._drop("unknown_peer", name)
        elif len(p.waiting) >= self._queue_limit:
            self._drop("hwm", name)
        else:
            p.waiting.append(data)
            if p.lookup_deadline is None:
                rid = next(self._lookup_ids)
                p.lookup_deadline = time.monotonic() + self.peer_timeout_s
                self._count("lookups")
                try:
                    self._bs_sock.send(dump_json({"v": VERSION, "id": rid, "op": "lookup", "name": name}), zmq.NOBLOCK)
                except zmq.Again:  # the bootstrap service is unreachable and its queue is full
                    self._fail_lookup(p, "lookup_failed")
                    return
                self._lookups[rid] = p

    def _open(self, p: _Peer) -> None:
        """A DEALER to ``p``'s ROUTER, HELLO first."""
        assert p.address is not None
        dealer = self._ctx.socket(zmq.DEALER)
        self._tune(dealer)
        dealer.setsockopt(zmq.ROUTING_ID, self.name.encode())
        dealer.setsockopt(zmq.SNDHWM, self._queue_limit)
        dealer.setsockopt(zmq.RECONNECT_IVL, min(_RECONNECT_MS, self._hb_ms))
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        monitor = dealer.get_monitor_socket(events, f"inproc://kvfsm-monitor-{next(_monitor_ids)}")
        p.dealer, p.monitor = dealer, monitor
        self._monitors[monitor] = p
        self._poller.register(monitor, zmq.POLLIN)
        p.connect_deadline = time.monotonic() + self.peer_timeout_s
        try:
            dealer.connect(p.address)
        except zmq.ZMQError as exc:
            self._lose(p, f"cannot connect to {p.name} at {p.address}: {exc}")
            return
        header = dump_json({"v": VERSION, "name": self.name, "address": self.address})
        dealer.send_multipart([HELLO, header, self._descriptor], zmq.NOBLOCK)  # an empty pipe: never EAGAIN
        self._count("hellos_sent")
        waiting, p.waiting, p.lookup_deadline = p.waiting, deque(), None
        for data in waiting:
            self._post(p, [MESSAGE, data])

    def _post(self, p: _Peer, frames: list[bytes]) -> None:
        assert p.dealer is not None
        try:
            p.dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self._drop("hwm", p.name)
            return
        self._count("sent")
        if not p.connected:
            p.unconfirmed += 1

    def _drain_bootstrap(self) -> None:
        assert self._bs_sock is not None
        while True:
            try:
                frames = self._bs_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = load_json(frames[0], MAX_REQUEST) if len(frames) == 1 else {}
            except ValueError:
                reply = {}
            p = self._lookups.pop(reply["id"], None) if is_int(reply.get("id")) else None
            if p is None or p.lookup_deadline is None or p.name in self._lost:
                continue  # late, or answered by a HELLO meanwhile
            address = reply.get("address")
            if reply.get("v") != VERSION or reply.get("ok") is not True or (address and check_address(address)):
                self._fail_lookup(p, "lookup_failed")
            elif address is None:
                self._fail_lookup(p, "unknown_peer")
            else:
                p.address = address
                self._open(p)

    def _fail_lookup(self, p: _Peer, reason: str) -> None:
        self._drop(reason, p.name, len(p.waiting))
        p.waiting.clear()
        p.lookup_deadline = None

    def _expire(self, now: float) -> None:
        for p in list(self._peers.values()):
            if p.lookup_deadline is not None and p.lookup_deadline <= now:
                self._lookups = {k: v for k, v in self._lookups.items() if v is not p}
                self._fail_lookup(p, "lookup_failed")
            if p.connect_deadline is not None and p.connect_deadline <= now and not p.connected:
                self._drop("not_connected", p.name, p.unconfirmed)
                self._lose(p, f"no connection to {p.name} at {p.address} within {self.peer_timeout_s}s")

    def _drain_monitor(self, p: _Peer) -> None:
        assert p.monitor is not None
        while p.monitor is not None:
            try:
                event = parse_monitor_message(p.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                p.connected, p.connect_deadline, p.unconfirmed = True, None, 0
            elif event == zmq.EVENT_DISCONNECTED and p.connected:
                self._lose(p, f"connection to {p.name} at {p.address} lost")

    def _drain_router(self) -> None:
        for _ in range(1024):  # then let the other sockets have a turn
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        """One inbound message from the ROUTER: validate strictly, drop and count anything bad."""
        kind = frames[1] if len(frames) > 1 else b""
        if kind not in FRAMES:
            self._drop("unknown_kind" if kind else "malformed", repr(frames[0]))
            return
        if len(frames) - 1 != FRAMES[kind]:
            self._drop("malformed", repr(frames[0]))
            return
        try:
            name = frames[0].decode()
        except UnicodeDecodeError:
            self._drop("malformed", repr(frames[0]))
            return
        if name in self._lost:
            self._drop("lost_peer", name)
            return
        if kind == HELLO:
            self._on_hello(name, frames[2], frames[3])
            return
        p = self._peers.get(name)
        if p is None or not p.helloed:
            self._drop("no_hello", name)
        elif kind == BYE:
            self._count("byes")
            self._lose(p, f"{name} closed")
        elif p.refused:
            self._drop("refused_peer", name)
        elif len(frames[2]) > self.max_message:
            self._drop("oversize", name)
        else:
            self._count("received")
            self._deliver(Inbound("message", name, data=frames[2]))

    def _on_hello(self, name: str, header: bytes, descriptor: bytes) -> None:
        try:
            hello = load_json(header, MAX_HEADER)
        except ValueError:
            self._drop("oversize" if len(header) > MAX_HEADER else "bad_hello", name)
            return
        if not is_int(hello.get("v")):
            self._drop("bad_hello", name)
            return
        if hello["v"] != VERSION:
            self._drop("unsupported_version", name)
            log.warning("%s: HELLO version %s from %r; this plane speaks %d", self.name, hello["v"], name, VERSION)
            return
        if set(hello) != {"v", "name", "address"} or check_name(hello["name"]) or check_address(hello["address"]):
            self._drop("bad_hello", name)
            return
        if hello["name"] != name:
            self._drop("name_mismatch", name)
            return
        if len(descriptor) > self.max_descriptor:
            self._drop("oversize", name)
            return
        p = self._peer(name)
        if p.helloed:
            self._drop("duplicate_hello", name)
            return
        p.helloed = True
        self._count("hellos")
        if p.dealer is None:
            p.address = hello["address"]  # the peer's own word beats a cached lookup
        if self._add_peer is not None:
            self._accept(p, descriptor)
        else:
            p.descriptor = descriptor
        if self._ready and p.dealer is None and not p.refused:
            self._open(p)

    def _accept(self, p: _Peer, descriptor: bytes) -> None:
        assert self._add_peer is not None
        p.descriptor = None
        try:
            self._add_peer(p.name, descriptor)
        except Exception as exc:  # noqa: BLE001 - TransportError is the contract; anything else is refusal too
            p.refused = True
            self._count("refused_peers")
            log.warning("%s: refused peer %r: add_peer raised %r", self.name, p.name, exc)
            return
        p.added = True

    def _lose(self, p: _Peer, reason: str) -> None:
        """``p`` is gone for good: close its DEALER, tell the data plane and the handler once."""
        with self._lock:
            if p.name in self._lost:
                return
            self._lost.add(p.name)
            self._counts["peers_lost"] = self._counts.get("peers_lost", 0) + 1
        log.warning("%s: peer lost: %s", self.name, reason)
        self._close_dealer(p, linger=0)
        if p.waiting:
            self._drop("lost_peer", p.name, len(p.waiting))
            p.waiting.clear()
        p.connect_deadline = p.lookup_deadline = None
        if p.added and self._remove_peer is not None:
            try:
                self._remove_peer(p.name)
            except Exception:  # noqa: BLE001
                self._count("handler_errors")
                log.exception("%s: remove_peer(%r) failed", self.name, p.name)
        self._deliver(Inbound("peer_lost", p.name, reason=reason))

    def _close_dealer(self, p: _Peer, linger: int) -> None:
        if p.monitor is not None:
            self._poller.unregister(p.monitor)
            del self._monitors[p.monitor]
            assert p.dealer is not None
            p.dealer.disable_monitor()
            p.monitor.close(0)
            p.monitor = None
        if p.dealer is not None:
            p.dealer.close(linger)
            p.dealer = None

    def _deliver(self, item: Inbound) -> None:
        handler = self._handler
        if handler is None:
            self._drop("no_handler", item.peer)
            return
        try:
            handler(item)
        except Exception:  # noqa: BLE001 - the owner's bug must not kill the I/O thread
            self._count("handler_errors")
            log.exception("%s: handler failed on %s from %r", self.name, item.kind, item.peer)

    def _shutdown(self) -> None:
        for p in self._peers.values():
            if p.dealer is not None and p.name not in self._lost:
                try:
                    p.dealer.send_multipart([BYE], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._close_dealer(p, linger=self._linger_ms)
        self._release()

    def _release(self) -> None:
        self._router.close(0)
        if self._bs_sock is not None:
            self._bs_sock.close(0)
        if self._bs_client is not None:
            self._bs_client.close()
        self._waker.close()
        self._ctx.term()
