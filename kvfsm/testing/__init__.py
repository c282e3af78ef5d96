"""Test helpers for engines embedding kvfsm: a manual clock and a loopback cluster; and, in
``kvfsm.testing.conformance``, the checks every transport's control and data plane must pass.

``LoopbackCluster`` wires P prefill and D decode managers over one ``Fabric`` with seeded random
KV contents, so a test can drive rooms step by step and check every byte at decode.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfsm.protocol import KVPoll, Protocol
from kvfsm.protocol.routing import ROUTING, Routing
from kvfsm.runtime import DecodeManager, PrefillManager, RuntimeConfig
from kvfsm.transport.loopback import Fabric, Faults


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class LoopbackCluster:
    prefill_ranks: int = 1
    decode_ranks: int = 1
    pages: int = 64
    page_bytes: int = 256
    aux_slots: int = 8
    aux_bytes: int = 32
    seed: int = 0
    workers: int = 0
    ordered: bool = True
    faults: Faults = field(default_factory=Faults)
    timeouts: dict[str, float] = field(default_factory=dict)
    connect: bool = True
    clock: Callable[[], float] = field(default_factory=ManualClock)
    config: RuntimeConfig | None = None  # overrides workers and timeouts when given
    protocol: Protocol | None = None  # e.g. a mutant's (kvfsm.check.mutants.mutated_protocol)
    async_writes: bool = False  # a write's data lands when its queued item is delivered
    routing: Routing = ROUTING  # the shared routing, or a checker mutant of it (kvfsm replay)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.fabric = Fabric(self.seed, ordered=self.ordered, faults=self.faults, async_writes=self.async_writes)
        self.protocol = self.protocol or Protocol()
        cfg = self.config or RuntimeConfig(workers=self.workers, timeouts=dict(self.timeouts))
        self.pkv = [bytearray(rng.randbytes(self.pages * self.page_bytes)) for _ in range(self.prefill_ranks)]
        self.paux = [bytearray(rng.randbytes(self.aux_slots * self.aux_bytes)) for _ in range(self.prefill_ranks)]
        self.dkv = [bytearray(self.pages * self.page_bytes) for _ in range(self.decode_ranks)]
        self.daux = [bytearray(self.aux_slots * self.aux_bytes) for _ in range(self.decode_ranks)]
        self.prefill = [
            PrefillManager(
                r,
                self.fabric.endpoint(f"prefill/{r}"),
                self.protocol,
                kv=self.pkv[r],
                aux=self.paux[r],
                page_bytes=self.page_bytes,
                aux_slot_bytes=self.aux_bytes,
                config=cfg,
                clock=self.clock,
                routing=self.routing,
            )
            for r in range(self.prefill_ranks)
        ]
        peers = {r: f"prefill/{r}" for r in range(self.prefill_ranks)}
        self.decode = [
            DecodeManager(
                r,
                self.fabric.endpoint(f"decode/{r}"),
                self.protocol,
                prefill_peers=peers,
                kv=self.dkv[r],
                aux=self.daux[r],
                page_bytes=self.page_bytes,
                aux_slot_bytes=self.aux_bytes,
                config=cfg,
                clock=self.clock,
                routing=self.routing,
            )
            for r in range(self.decode_ranks)
        ]
        if self.connect:
            for d in self.decode:
                d.connect()
            self.settle()

    @property
    def managers(self) -> list[PrefillManager | DecodeManager]:
        return [*self.prefill, *self.decode]

    def settle(self, max_items: int | None = None) -> int:
        """Deliver queued items (and wait for transfer workers) until nothing moves."""
        total = 0
        while True:
            for m in self.prefill:
                m.pool.wait_idle(10)
            n = self.fabric.pump(max_items)
            total += n
            if max_items is not None or (
                not n and not self.fabric.pending and not any(m.pool.outstanding for m in self.prefill)
            ):
                return total

    def advance(self, seconds: float) -> None:
        """Move the (manual) clock and fire due timers on every manager, then settle."""
        assert isinstance(self.clock, ManualClock), "advance() needs the default ManualClock"
        self.clock.advance(seconds)
        for m in self.managers:
            m.tick()
        self.settle()

    def kv_equal(self, p_rank: int, src_pages: list[int], d_rank: int, dst_pages: list[int]) -> bool:
        b = self.page_bytes
        return all(
            self.dkv[d_rank][dp * b : (dp + 1) * b] == self.pkv[p_rank][sp * b : (sp + 1) * b]
            for sp, dp in zip(src_pages, dst_pages, strict=True)
        )

    def aux_equal(self, p_rank: int, src_slot: int, d_rank: int, dst_slot: int) -> bool:
        b = self.aux_bytes
        return (
            self.daux[d_rank][dst_slot * b : (dst_slot + 1) * b] == self.paux[p_rank][src_slot * b : (src_slot + 1) * b]
        )

    def close(self) -> None:
        for m in self.managers:
            m.close()


TERMINAL = (KVPoll.Success, KVPoll.Failed)
