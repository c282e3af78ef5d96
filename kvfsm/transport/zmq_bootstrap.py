"""The bootstrap service of the ZMQ control plane, and the helpers both share.

Bootstrap service: ``BootstrapServer`` (a ROUTER in its own thread) keeps name -> (side, rank,
address); ``BootstrapClient`` talks to it through a DEALER under a lock. Requests and replies are
single JSON frames ``{"v": 1, "id": n, "op": ..., **fields}`` / ``{"v": 1, "id": n, "ok": bool,
...}``, validated strictly on both ends; a bad request gets an error reply and is counted.
Registering a name again replaces its entry (a restarted process); ``unregister`` with an address
only removes the entry if it still has that address.

Prefill ranks register their control-plane endpoints here and decode ranks look them up
(``kvfsm.transport.zmq`` does both for its planes); one service serves a whole deployment.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket as _socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import zmq

from kvfsm.transport.base import TransportError

log = logging.getLogger("kvfsm.transport.zmq")

VERSION = 1
MAX_HEADER = 4096  # bytes of a HELLO header or a bootstrap request/reply entry
MAX_REQUEST = 64 << 10
MAX_NAME = 255  # bytes: a zmq routing id
MAX_ADDRESS = 1024
_MAX_REPLY = 64 << 20  # what a client accepts: a peers table of a large deployment


def dump_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def load_json(data: bytes, limit: int) -> dict[str, Any]:
    """A JSON object from a peer's bytes; ValueError for anything else."""
    if len(data) > limit:
        raise ValueError(f"{len(data)} bytes, over the {limit}-byte limit")
    try:
        obj = json.loads(data)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_name(name: object) -> str | None:
    """Why ``name`` is not a valid peer name (None if it is)."""
    if not isinstance(name, str) or not name:
        return "a name is a non-empty string"
    if len(name.encode()) > MAX_NAME or name.startswith("\0"):
        return f"a name is at most {MAX_NAME} UTF-8 bytes and does not start with NUL"
    return None


def check_address(address: object) -> str | None:
    if not isinstance(address, str) or not address.startswith("tcp://") or len(address) > MAX_ADDRESS:
        return f"an address is a 'tcp://host:port' string of at most {MAX_ADDRESS} characters"
    return None


class Waker:
    """A socketpair whose read end wakes a ``zmq.Poller``; ``wake()`` is safe from any thread."""

    def __init__(self) -> None:
        self._r, self._w = _socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        return self._r.fileno()

    def wake(self) -> None:
        try:
            self._w.send(b"\0")
        except OSError:  # buffer full (a wake is already pending) or closed
            pass

    def drain(self) -> None:
        try:
            while self._r.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self._r.close()
        self._w.close()


# ---------------------------------------------------------------------- bootstrap service

_REQUESTS: dict[str, dict[str, tuple[type, ...]]] = {
    "register": {"name": (str,), "address": (str,), "side": (str,), "rank": (int,)},
    "unregister": {"name": (str,), "address": (str, type(None))},
    "lookup": {"name": (str,)},
    "peers": {"side": (str, type(None))},
}


class BootstrapServer:
    """Where prefill ranks register their endpoints and decode ranks look them up."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        try:
            self._sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError:
            self._sock.close(0)
            self._ctx.term()
            raise
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        self._registry: dict[str, tuple[str, int, str]] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._waker = Waker()
        self._thread = threading.Thread(target=self._run, name=f"kvfsm-bootstrap-{self.address}", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts) | {"registered": len(self._registry)}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._waker.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        try:
            while not self._closed:
                poller.poll()
                self._waker.drain()
                while not self._closed:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        reply = self._handle(frames[1:])
                    except Exception:  # noqa: BLE001 - a request must never kill the service
                        log.exception("bootstrap: error handling a request")
                        reply = dump_json({"v": VERSION, "id": None, "ok": False, "error": "internal error"})
                    try:
                        self._sock.send_multipart([frames[0], reply], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        self._count("reply_failed")
        finally:
            self._sock.close(0)
            self._waker.close()
            self._ctx.term()

    def _error(self, rid: int | None, reason: str) -> bytes:
        self._count("errors")
        log.warning("bootstrap: bad request: %s", reason)
        return dump_json({"v": VERSION, "id": rid, "ok": False, "error": reason})

    def _handle(self, frames: list[bytes]) -> bytes:
        self._count("requests")
        if len(frames) != 1:
            return self._error(None, f"a request is one frame, got {len(frames)}")
        try:
            req = load_json(frames[0], MAX_REQUEST)
        except ValueError as exc:
            return self._error(None, f"bad JSON: {exc}")
        rid = req["id"] if is_int(req.get("id")) else None
        if not is_int(req.get("v")):
            return self._error(rid, "missing integer version 'v'")
        if req["v"] != VERSION:
            return self._error(rid, f"unsupported version {req['v']} (this service speaks {VERSION})")
        op = req.get("op")
        schema = _REQUESTS.get(op) if isinstance(op, str) else None
        if schema is None:
            return self._error(rid, f"unknown op {op!r}")
        if rid is None or set(req) != {"v", "id", "op", *schema}:
            return self._error(rid, f"{op} takes an integer 'id' and exactly the fields {sorted(schema)}")
        for key, types in schema.items():
            if isinstance(req[key], bool) or not isinstance(req[key], types):
                return self._error(rid, f"{op}: field {key!r} has the wrong type")
        if "name" in schema and (why := check_name(req["name"])):
            return self._error(rid, f"{op}: {why}")
        if op == "register":
            if why := check_address(req["address"]):
                return self._error(rid, f"register: {why}")
            if len(req["side"]) > MAX_NAME or not -1 <= req["rank"] < 1 << 31:
                return self._error(rid, "register: side is a short string and rank an int32 (or -1)")
        ok: dict[str, Any] = {"v": VERSION, "id": rid, "ok": True}
        with self._lock:  # _error takes it too: nothing below may fail
            if op == "register":
                self._registry[req["name"]] = (req["side"], req["rank"], req["address"])
            elif op == "unregister":
                entry = self._registry.get(req["name"])
                if entry is not None and req["address"] in (None, entry[2]):
                    del self._registry[req["name"]]
            elif op == "lookup":
                entry = self._registry.get(req["name"])
                ok["address"] = entry[2] if entry else None
            else:
                side = req["side"]
                ok["peers"] = {n: list(e) for n, e in self._registry.items() if side is None or e[0] == side}
        return dump_json(ok)


class BootstrapClient:
    """Blocking calls to a BootstrapServer. Thread-safe; every call raises TransportError on
    timeout or a bad reply."""

    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        if why := check_address(address):
            raise ValueError(f"bootstrap address {address!r}: {why}")
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY)
        self._sock.connect(address)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    def register(self, name: str, address: str, side: str, rank: int) -> None:
        self._call({"op": "register", "name": name, "address": address, "side": side, "rank": rank})

    def unregister(self, name: str, address: str | None = None, *, timeout_s: float | None = None) -> None:
        """Forget ``name`` (only if it is still registered at ``address``, when given)."""
        self._call({"op": "unregister", "name": name, "address": address}, timeout_s)

    def lookup(self, name: str) -> str | None:
        address = self._call({"op": "lookup", "name": name}).get("address")
        if address is not None and check_address(address):
            raise TransportError(f"bootstrap lookup {name!r}: bad address in reply")
        return address

    def wait_for(self, names: Iterable[str], timeout_s: float) -> dict[str, str]:
        """Poll until every name is registered; returns name -> address."""
        wanted = set(names)
        deadline = time.monotonic() + timeout_s
        while True:
            known = {n: e[2] for n, e in self.peers().items() if n in wanted}
            missing = wanted - known.keys()
            if not missing:
                return known
            if time.monotonic() >= deadline:
                raise TransportError(f"bootstrap: still unknown after {timeout_s}s: {', '.join(sorted(missing))}")
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def peers(self, side: str | None = None) -> dict[str, tuple[str, int, str]]:
        table = self._call({"op": "peers", "side": side}).get("peers")
        if not isinstance(table, dict):
            raise TransportError("bootstrap peers: bad reply")
        out: dict[str, tuple[str, int, str]] = {}
        for name, entry in table.items():
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and isinstance(entry[0], str)
                and is_int(entry[1])
                and not check_address(entry[2])
            ):
                raise TransportError(f"bootstrap peers: bad entry for {name!r}")
            out[name] = (entry[0], entry[1], entry[2])
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(0)
            self._ctx.term()

    def _call(self, req: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        op = req["op"]
        with self._lock:
            if self._closed:
                raise TransportError("bootstrap client is closed")
            rid = next(self._ids)
            try:
                self._sock.send(dump_json({"v": VERSION, "id": rid, **req}), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                raise TransportError(f"bootstrap {op}: cannot send: {exc}") from exc
            timeout_s = self.timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"bootstrap {op}: no reply from {self.address} within {timeout_s}s")
                if not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    continue
                frames = self._sock.recv_multipart()
                try:
                    reply = load_json(frames[0], _MAX_REPLY) if len(frames) == 1 else None
                except ValueError:
                    reply = None
                if reply is None or reply.get("v") != VERSION or not isinstance(reply.get("ok"), bool):
                    raise TransportError(f"bootstrap {op}: malformed reply")
                if reply.get("id") != rid:
                    continue  # the late answer to a call that timed out
                if not reply["ok"]:
                    raise TransportError(f"bootstrap {op} refused: {reply.get('error')}")
                return reply
