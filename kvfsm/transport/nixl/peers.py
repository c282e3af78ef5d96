"""Peer lifecycle: our memory registered, described to peers, and peers' memory made reachable.

``register_memory`` registers the KV and aux regions (torch tensors, numpy arrays or host
buffers; the KV region may be several buffers, each registered, addressed as one virtual region)
and, when their page and slot sizes are known, prepares a *local* descriptor list per region of
one buffer at that block granularity (one strided row, so preparing 10^5 pages costs
microseconds). A region of several buffers (ours or a peer's) has no prepared list and no
``_Route``: its writes are described as exact byte ranges by ``plan.describe_spread``.
``descriptor()`` describes us to peers (``descriptors``). ``add_peer`` validates a peer's
descriptor strictly, loads its agent metadata, checks that NIXL names the agent as the peer
claims, and prepares the peer's regions as *remote* lists; ``remove_peer`` drops the peer's agent
(NIXL then refuses its handles, which fail their transfers). Each known (peer, region) pair gets
a ``_Route``, what the usual one-run write needs in one lookup. ``_job`` validates a write or
read against all this (raising ``TransportError`` before anything moves) and describes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfsm.transport.base import MemoryRegion, Region, Segment, TransportError, as_region, as_regions
from kvfsm.transport.nixl.descriptors import REGIONS, RemoteRegion, decode_descriptor, encode_descriptor
from kvfsm.transport.nixl.plan import Spread, _Job, _Route, describe, describe_spread, run_job
from kvfsm.transport.nixl.state import _PlaneState

_LOCAL = "NIXL_INIT_AGENT"  # the name NIXL gives our own agent's prepared lists


@dataclass(slots=True)
class _Peer:
    name: str
    regions: dict[str, RemoteRegion]
    prepped: dict[str, Any] = field(default_factory=dict)  # region -> remote prepped dlist handle
    spread: dict[str, Spread] = field(default_factory=dict)  # region -> its buffers, if several
    fingerprint: bytes = b""


class _Peers(_PlaneState):
    """Memory registration, descriptors and peers of a ``NixlDataPlane``."""

    def register_memory(self, kv: Any, aux: Any, *, kv_block: int = 0, aux_block: int = 0) -> None:
        parts = {"kv": as_regions(kv), "aux": (as_region(aux),)}
        regions = {k: _whole(p) for k, p in parts.items()}
        blocks = {"kv": kv_block, "aux": aux_block}
        with self._lock:
            if self._local:
                raise TransportError(f"{self.name}: memory is already registered")
            for key, r in regions.items():
                if not r.nbytes:
                    continue
                bufs = [(b.addr, b.nbytes, b.device, "") for b in parts[key] if b.nbytes]
                try:
                    self._reg.append(self.agent.register_memory(bufs, r.mem))
                except self._nixl_errors as exc:
                    raise TransportError(f"{self.name}: cannot register {key} ({r.nbytes} B {r.mem}): {exc!r}") from exc
                if len(parts[key]) > 1:
                    self._spread[key] = Spread.of([(b.addr, b.nbytes) for b in parts[key]])
                    continue  # no prepared block list: a list spans one registration
                blk = blocks[key]
                if blk > 0 and r.nbytes % blk == 0:
                    rows = np.array([[r.addr, blk, r.device, blk, r.nbytes // blk]], dtype=np.uint64)
                    self._prepped[key] = self.agent.prep_xfer_dlist(_LOCAL, rows, r.mem)
                    self._blocks[key] = blk
            self._local = regions
            for p in self._peers.values():
                self._add_routes(p)
        kv = regions.get("kv")
        if self.config.poller_sched == "auto" and kv is not None and kv.nbytes and kv.mem == "DRAM":
            self._schedule_poller()  # KV in host memory: CPUs copy it

    def descriptor(self) -> bytes:
        with self._lock:
            if not self._local:
                raise TransportError(f"{self.name}: register memory before describing it")
            regions = {
                k: RemoteRegion(r.addr, r.nbytes, r.device, r.mem, self._blocks.get(k, 0), self._buffers(k))
                for k, r in self._local.items()
            }
            return encode_descriptor(self.name, regions, bytes(self.agent.get_agent_metadata()))

    def _buffers(self, region: str) -> tuple[tuple[int, int], ...]:
        """(address, bytes) of each buffer of our region of several buffers; () for one buffer."""
        spread = self._spread.get(region)
        if spread is None:
            return ()
        return tuple(zip(spread.addrs.tolist(), spread.parts.sizes.tolist(), strict=True))

    def add_peer(self, peer: str, descriptor: bytes) -> None:
        agent, regions, metadata = decode_descriptor(descriptor)
        if agent != peer:
            raise TransportError(f"descriptor of agent {agent!r} offered by peer {peer!r}")
        if peer == self.name:
            raise TransportError(f"peer {peer!r} has our own name")
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.name}: closed")
            old = self._peers.get(peer)
            if old is not None:
                if old.fingerprint == descriptor:
                    return  # the same peer said hello again
                self._drop_peer(old)
            try:
                loaded = self.agent.add_remote_agent(metadata)
            except self._nixl_errors as exc:
                raise TransportError(f"NIXL refused the agent metadata of {peer!r}: {exc!r}") from exc
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            p = _Peer(peer, dict(regions), fingerprint=bytes(descriptor))
            if loaded != peer:
                self._peers[loaded] = p  # so that _drop_peer removes what NIXL loaded
                p.name = loaded
                self._drop_peer(p)
                raise TransportError(f"peer {peer!r} sent the agent metadata of {loaded!r}")
            for key, r in regions.items():
                if r.parts:
                    p.spread[key] = Spread.of(r.parts)
                if r.block and r.nbytes:
                    rows = np.array([[r.addr, r.block, r.device, r.block, r.nbytes // r.block]], dtype=np.uint64)
                    try:
                        p.prepped[key] = self.agent.prep_xfer_dlist(peer, rows, r.mem)
                    except self._nixl_errors as exc:
                        self._peers[peer] = p
                        self._drop_peer(p)
                        raise TransportError(f"cannot prepare {peer!r}'s {key} region: {exc!r}") from exc
            self._peers[peer] = p
            self._removed.discard(peer)
            self._add_routes(p)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            p = self._peers.get(peer)
            if p is not None:
                self._drop_peer(p)
            self._removed.add(peer)

    def _job(self, op: str, peer: str, region: Region, segments: Sequence[Segment], note: bytes, tag: object) -> _Job:
        """Validate a write or read (raises TransportError before anything moves) and describe it."""
        if op == "WRITE" and len(segments) == 1:  # the usual write: one run, to a known peer
            route = self._routes.get((peer, region))
            if route is not None:
                s = segments[0]
                job = run_job(route, peer, region, s.src, s.dst, s.length, note, tag)
                if job is not None:
                    return job
        if region not in REGIONS:
            raise TransportError(f"unknown region {region!r}: 'kv' or 'aux'")
        if self._closed:
            raise TransportError(f"{op.lower()} {self.name}->{peer}: data plane is closed")
        p = self._peers.get(peer)
        if p is None:
            gone = "was removed (lost)" if peer in self._removed else "is unknown (no descriptor)"
            raise TransportError(f"{op.lower()} {self.name}->{peer} {region}: peer {gone}")
        local = self._local.get(region)
        if local is None:
            raise TransportError(f"{op.lower()} {self.name}->{peer}: no local {region} region registered")
        if self._spread or p.spread:  # a region of several buffers, ours or the peer's
            lspread, rspread = self._spread.get(region), p.spread.get(region)
            if lspread is not None or rspread is not None:
                remote = p.regions[region]
                return describe_spread(
                    self.name, op, peer, region, segments, note, tag, local, remote, lspread, rspread
                )
        lblk = self._blocks.get(region, 0)
        return describe(
            self.name, op, peer, region, segments, note, tag, local, p.regions[region], lblk, region in p.prepped
        )

    def _add_routes(self, p: _Peer) -> None:
        """Routes to ``p``'s regions (see ``_routes``), once our memory is registered."""
        for key, local in self._local.items():
            remote = p.regions.get(key)
            if remote is not None and local.nbytes and remote.nbytes and not remote.parts and key not in self._spread:
                route = _Route(
                    local.addr,
                    local.nbytes,
                    local.device,
                    remote.addr,
                    remote.nbytes,
                    remote.device,
                    (local.mem, remote.mem),
                )
                self._routes[(p.name, key)] = route

    def _drop_peer(self, p: _Peer) -> None:
        for key in REGIONS:
            self._routes.pop((p.name, key), None)
        for h in p.prepped.values():
            self._quietly(self.agent.release_dlist_handle, h)
        p.prepped.clear()
        self._quietly(self.agent.remove_remote_agent, p.name)
        self._peers.pop(p.name, None)


def _whole(parts: tuple[MemoryRegion, ...]) -> MemoryRegion:
    """A region as one: its only buffer, or for several the region of their virtual space (at
    the first's address, their bytes in all, read-only if one is; ``owner`` keeps them alive)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    nbytes = sum(b.nbytes for b in parts)
    return MemoryRegion(first.addr, nbytes, first.mem, first.device, parts, any(b.readonly for b in parts))
