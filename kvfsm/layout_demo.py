"""``kvfsm demo --prefill-tp P --decode-tp D --prefill-page A --decode-page B [--mla]``: KV moved
between TP groups of different sizes, page sizes and memory orders, every element checked.

Theory of operation
-------------------
Every rank of both sides runs in this process with its KV cache held as its engine holds it
(``EngineCache``: one buffer per layer, or per layer and K/V, in the order's tensor shape) and
registered with its data plane as that list of buffers; over ``loopback`` (one in-process
``Fabric``) or ``nixl`` (a NIXL agent per rank on DRAM, ZMQ control planes on 127.0.0.1 and an
in-process bootstrap service). Rooms run in waves of ``concurrency``:

1. Each room gets a prompt length that is a multiple of neither page size, a seed, and pages from
   each rank's shuffled free list. Every prefill rank fills its heads of the prompt with
   ``value(layer, token, head, dim, K/V, seed)``; aux bytes are a function of the seed (the same
   on every prefill rank, as an engine's metadata is).
2. Every decode rank creates a receiver; a prefill rank creates a sender only where
   ``RankMap.dests_of`` names a destination (a rank that sends nothing takes no part in the room),
   and hands over the prompt in chunks of whole prefill pages, the last one covering the rest.
   ``--order`` picks who starts first, as in the equal-TP demo.
3. Once every rank concluded, each decode rank's cache must hold, element for element, what a
   single engine with decode's layout would hold for the request (``EngineCache.check``, written
   from the engine's tensor shapes, never from the planner), and its aux slot the seed's bytes.
   The room is cleared and its tokens erased back to the sentinel; after each wave every byte
   of every cache must be the sentinel again (``EngineCache.untouched``): nothing was written
   outside a request's tokens and heads.

Exit status 1 on any mismatch, a room that failed or did not conclude, or a room left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvfsm.layout import KVLayout, KVOrder, LayoutError, RankMap
from kvfsm.layout.engine import CacheMismatch, EngineCache
from kvfsm.protocol import KVPOLL_NAMES, KVPoll, LocalProtocolError
from kvfsm.runtime import DecodeManager, KVReceiver, KVSender, PrefillManager, RuntimeConfig

TERMINAL = (KVPoll.Success, KVPoll.Failed)
_MLA_HEAD_DIM = 576  # DeepSeek's latent: 512 compressed KV + 64 rotary dims


@dataclass
class LayoutDemoConfig:
    prefill_tp: int = 2
    decode_tp: int = 4
    prefill_page: int = 16
    decode_page: int = 64
    mla: bool = False
    kv_order: str = KVOrder.SGLANG.value
    layers: int = 4
    kv_heads: int = 8
    head_dim: int = 64
    dtype_bytes: int = 2
    rooms: int = 16
    chunks: int = 4  # chunks per room at most (whole prefill pages each but the last)
    tokens_min: int = 100
    tokens_max: int = 700
    concurrency: int = 8
    aux_bytes: int = 64
    order: str = "mixed"  # decode-first | prefill-first | mixed
    seed: int = 0
    transport: str = "loopback"  # loopback | nixl
    workers: int = 2
    transfer_timeout: float = 5.0
    verify_plans: bool = False  # prefill proves every plan (verify_plan) before posting its write
    ucx_params: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mla:
            self.kv_heads = 1
        for name in ("rooms", "chunks", "tokens_min", "concurrency", "aux_bytes"):
            if getattr(self, name) < 1:
                raise LayoutError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.tokens_max < self.tokens_min:
            raise LayoutError(f"--tokens-max {self.tokens_max} is below --tokens-min {self.tokens_min}")
        self.concurrency = min(self.concurrency, self.rooms)

    def layout(self, side: str, rank: int) -> KVLayout:
        """The KV layout of ``rank`` on ``side``, with room for a wave's longest prompts."""
        tp, page = (self.prefill_tp, self.prefill_page) if side == "prefill" else (self.decode_tp, self.decode_page)
        pages = self.concurrency * -(-self.tokens_max // page) + 2  # two never used: stray writes show
        return KVLayout(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype_bytes,
            tp,
            rank,
            page,
            pages,
            KVOrder(self.kv_order),
            self.mla,
        )

    def runtime(self) -> RuntimeConfig:
        t = self.transfer_timeout
        return RuntimeConfig(
            workers=self.workers,
            timeouts={"transfer": t, "hold": 2 * t, "bootstrap": 4 * t, "input": 4 * t, "fence": 8 * t},
            register_retry_s=0.05 if self.transport == "loopback" else 0.2,
            early_ttl_s=4 * t,
            verify_plans=self.verify_plans,
        )


class PagePool:
    """A rank's free pages: in order, or shuffled with ``rng`` (a room's pages then scattered)."""

    def __init__(self, n: int, rng: random.Random | None = None) -> None:
        self.free = list(range(n - 1, -1, -1))
        if rng is not None:
            rng.shuffle(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("page pool exhausted")
        return [self.free.pop() for _ in range(n)]

    def give(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))


@dataclass
class _Room:
    rid: int
    slot: int  # aux slot on every rank
    seed: int
    tokens: int
    first: str  # "decode" or "prefill": who starts the room
    ppages: list[list[int]]  # per prefill rank
    dpages: list[list[int]]  # per decode rank
    senders: dict[int, KVSender] = field(default_factory=dict)
    receivers: dict[int, KVReceiver] = field(default_factory=dict)
    inited: set[int] = field(default_factory=set)


def aux_bytes_of(seed: int, n: int) -> np.ndarray:
    """The aux bytes of the request ``seed`` (every prefill rank holds the same)."""
    return np.random.default_rng([seed, 0xA0]).integers(0, 256, n, dtype=np.uint8)


class _Ranks:
    """Every rank of both sides over one transport: caches, aux regions, managers, and ``step``."""

    def __init__(self, cfg: LayoutDemoConfig) -> None:
        self.cfg = cfg
        self.pcache = [EngineCache(cfg.layout("prefill", r)) for r in range(cfg.prefill_tp)]
        self.dcache = [EngineCache(cfg.layout("decode", r)) for r in range(cfg.decode_tp)]
        self.paux = [np.zeros(cfg.concurrency * cfg.aux_bytes, dtype=np.uint8) for _ in range(cfg.prefill_tp)]
        self.daux = [np.zeros(cfg.concurrency * cfg.aux_bytes, dtype=np.uint8) for _ in range(cfg.decode_tp)]
        self.prefill: list[PrefillManager] = []
        self.decode: list[DecodeManager] = []
        self._closers: list[Callable[[], None]] = []
        try:
            self._loopback() if cfg.transport == "loopback" else self._nixl()
        except BaseException:
            self.close()  # what was started so far: threads, agents, the bootstrap service
            raise

    @property
    def managers(self) -> list[PrefillManager | DecodeManager]:
        return [*self.prefill, *self.decode]

    def _prefill_manager(self, r: int, ep: Any) -> PrefillManager:
        c = self.cfg
        return PrefillManager(
            r,
            ep,
            kv=self.pcache[r].buffers,
            aux=self.paux[r],
            aux_slot_bytes=c.aux_bytes,
            layout=self.pcache[r].layout,
            config=c.runtime(),
        )

    def _decode_manager(self, r: int, ep: Any, peers: dict[int, str]) -> DecodeManager:
        c = self.cfg
        return DecodeManager(
            r,
            ep,
            prefill_peers=peers,
            kv=self.dcache[r].buffers,
            aux=self.daux[r],
            aux_slot_bytes=c.aux_bytes,
            layout=self.dcache[r].layout,
            config=c.runtime(),
        )

    def _loopback(self) -> None:
        from kvfsm.transport.loopback import Fabric

        fabric = Fabric(self.cfg.seed)
        self.fabric = fabric
        self.prefill = [self._prefill_manager(r, fabric.endpoint(f"prefill/{r}")) for r in range(self.cfg.prefill_tp)]
        peers = {r: f"prefill/{r}" for r in range(self.cfg.prefill_tp)}
        self.decode = [
            self._decode_manager(r, fabric.endpoint(f"decode/{r}"), peers) for r in range(self.cfg.decode_tp)
        ]
        for d in self.decode:
            d.connect()
        self.step = self._settle

    def _settle(self) -> None:
        """Deliver everything that can be delivered (waiting for transfer workers); fire due timers."""
        while True:
            for m in self.prefill:
                m.pool.wait_idle(10)
            moved = self.fabric.pump()
            for mgr in self.managers:
                mgr.tick()
            if not moved and not self.fabric.pending and not any(m.pool.outstanding for m in self.prefill):
                return

    def _nixl(self) -> None:
        from kvfsm.transport.base import SplitEndpoint
        from kvfsm.transport.nixl import NixlConfig, NixlDataPlane
        from kvfsm.transport.zmq import BootstrapClient, BootstrapServer, ZmqConfig, ZmqControlPlane

        c = self.cfg
        server = BootstrapServer(host="127.0.0.1")
        self._closers.append(server.close)

        def endpoint(side: str, rank: int) -> Any:
            name = f"{side}-{rank}"
            data = NixlDataPlane(name, config=NixlConfig(backend_params=c.ucx_params))
            control = ZmqControlPlane(
                name,
                bootstrap=server.address,
                side=side,
                rank=rank,
                bind="tcp://127.0.0.1:*",
                config=ZmqConfig(peer_timeout_s=min(3.0, c.transfer_timeout / 2), heartbeat_s=0.25),
            )
            ep = SplitEndpoint(control, data)
            self._closers.insert(0, ep.close)  # endpoints close before the bootstrap service
            return ep

        self.prefill = [self._prefill_manager(r, endpoint("prefill", r)) for r in range(c.prefill_tp)]
        peers = {r: f"prefill-{r}" for r in range(c.prefill_tp)}
        client = BootstrapClient(server.address)
        try:
            client.wait_for(peers.values(), timeout_s=4 * c.transfer_timeout)
        finally:
            client.close()
        self.decode = [self._decode_manager(r, endpoint("decode", r), peers) for r in range(c.decode_tp)]
        for d in self.decode:
            d.connect()
        self.step = self._pause

    @staticmethod
    def _pause() -> None:
        time.sleep(0.0002)  # the control and data planes deliver on their own threads

    def close(self) -> None:
        for m in self.managers:
            m.close()
        for close in self._closers:
            close()


def run_layout_demo(cfg: LayoutDemoConfig) -> dict[str, Any]:
    """Run the rooms (see the module docstring); returns a JSON-able result with ``ok``."""
    rng = random.Random(cfg.seed)
    mapping = RankMap(cfg.kv_heads, cfg.prefill_tp, cfg.decode_tp, cfg.mla)
    active = [p for p in range(cfg.prefill_tp) if mapping.dests_of(p)]
    ranks = _Ranks(cfg)
    c = cfg
    ppools = [PagePool(cache.layout.num_pages, rng) for cache in ranks.pcache]
    dpools = [PagePool(cache.layout.num_pages, rng) for cache in ranks.dcache]
    outcome = {"succeeded": 0, "failed": 0, "stuck": 0}
    problems: list[str] = []
    descriptors: list[int] = []
    elements = aux_checked = 0
    tokens_moved = 0
    ab = c.aux_bytes

    def start_decode(room: _Room) -> None:
        room.receivers = {d: ranks.decode[d].create_receiver(room.rid) for d in range(c.decode_tp)}

    def start_prefill(room: _Room) -> None:
        for p in active:
            s = room.senders[p] = ranks.prefill[p].create_sender(room.rid)
            pages = room.ppages[p]
            chunks = min(c.chunks, len(pages))
            per = -(-len(pages) // chunks)
            for first in range(0, len(pages), per):
                last = first + per >= len(pages)
                if s.poll() == KVPoll.Failed:
                    break
                s.send(pages[first : first + per], is_last=last, aux_slot=room.slot if last else None)

    def conclude(room: _Room) -> None:
        nonlocal elements, aux_checked
        codes = [r.poll() for r in room.receivers.values()] + [s.poll() for s in room.senders.values()]
        descriptors.append(sum(s.transferred()[1] for s in room.senders.values()))
        if all(code == KVPoll.Success for code in codes):
            outcome["succeeded"] += 1
            for d, cache in enumerate(ranks.dcache):
                try:
                    elements += cache.check(room.dpages[d], room.tokens, room.seed)
                except CacheMismatch as exc:
                    problems.append(f"room {room.rid} ({room.tokens} tokens) at decode: {exc}")
                got = ranks.daux[d][room.slot * ab : (room.slot + 1) * ab]
                if not (got == aux_bytes_of(room.seed, ab)).all():
                    problems.append(f"room {room.rid}: decode rank {d} aux slot {room.slot} differs from prefill's")
                aux_checked += ab
        else:
            outcome["failed"] += 1
            handles: list[Any] = [*room.receivers.values(), *room.senders.values()]
            why = [str(h.failure_exception()) for h in handles if h.poll() == KVPoll.Failed]
            problems.append(f"room {room.rid} failed: {why[0] if why else 'ranks disagree'}")
        for h in [*room.senders.values(), *room.receivers.values()]:
            h.clear()
        for d, cache in enumerate(ranks.dcache):
            cache.erase(room.dpages[d], room.tokens)
            ranks.daux[d][room.slot * ab : (room.slot + 1) * ab] = 0
            dpools[d].give(room.dpages[d])
        for p, cache in enumerate(ranks.pcache):
            cache.erase(room.ppages[p], room.tokens)
            ranks.paux[p][room.slot * ab : (room.slot + 1) * ab] = 0
            ppools[p].give(room.ppages[p])

    def done(room: _Room) -> bool:
        for d, r in room.receivers.items():
            if d not in room.inited and r.poll() == KVPoll.WaitingForInput:
                r.init(room.dpages[d], room.slot, tokens=room.tokens)
                room.inited.add(d)
        return (
            len(room.receivers) == c.decode_tp
            and len(room.senders) == len(active)
            and all(r.poll() in TERMINAL and not r.pages_fenced() for r in room.receivers.values())
            and all(s.poll() in TERMINAL and not s.pages_in_use() for s in room.senders.values())
        )

    ids = [1000 + 7 * i for i in range(c.rooms)]  # sparse room ids, as engines use
    try:
        t0 = time.perf_counter()
        for w in range(0, c.rooms, c.concurrency):
            wave: list[_Room] = []
            for slot, rid in enumerate(ids[w : w + c.concurrency]):
                tokens = rng.randint(c.tokens_min, c.tokens_max)
                while tokens > 1 and (tokens % c.prefill_page == 0 or tokens % c.decode_page == 0):
                    tokens -= 1  # a prompt that ends inside a page on both sides
                first = c.order.split("-")[0] if c.order != "mixed" else rng.choice(["decode", "prefill"])
                room = _Room(
                    rid,
                    slot,
                    seed=c.seed * 1_000_003 + rid,
                    tokens=tokens,
                    first=first,
                    ppages=[pool.take(-(-tokens // c.prefill_page)) for pool in ppools],
                    dpages=[pool.take(-(-tokens // c.decode_page)) for pool in dpools],
                )
                for p, cache in enumerate(ranks.pcache):
                    cache.fill(room.ppages[p], tokens, room.seed)
                    ranks.paux[p][slot * ab : (slot + 1) * ab] = aux_bytes_of(room.seed, ab)
                tokens_moved += tokens
                wave.append(room)
            for room in wave:
                (start_decode if room.first == "decode" else start_prefill)(room)
            ranks.step()
            for room in wave:
                (start_prefill if room.first == "decode" else start_decode)(room)
            pending = list(wave)
            limit = time.monotonic() + 10 * c.transfer_timeout
            while pending and time.monotonic() < limit:
                ranks.step()
                for room in [r for r in pending if done(r)]:
                    conclude(room)
                    pending.remove(room)
            for room in pending:
                outcome["stuck"] += 1
                states = {f"decode{d}": KVPOLL_NAMES[r.poll()] for d, r in room.receivers.items()}
                states |= {f"prefill{p}": KVPOLL_NAMES[s.poll()] for p, s in room.senders.items()}
                problems.append(f"room {room.rid} did not conclude in {10 * c.transfer_timeout} s: {states}")
            if not pending:  # every room of the wave concluded and was erased: all caches are sentinel again
                for side, caches in (("decode", ranks.dcache), ("prefill", ranks.pcache)):
                    for r, cache in enumerate(caches):
                        try:
                            cache.untouched()
                        except CacheMismatch as exc:
                            problems.append(f"after wave {w // c.concurrency}, {side} rank {r}: {exc}")
            if outcome["stuck"]:
                break  # their pages may still be written: a later wave could not be checked
        seconds = time.perf_counter() - t0
        leftovers = sum(m.live_rooms() for m in ranks.managers)
        stats = {f"{m.side}{m.rank}": m.stats() for m in ranks.managers}
    finally:
        ranks.close()
    if leftovers:
        problems.append(f"{leftovers} rooms left behind after clear")
    counters = [s["counters"] for s in stats.values() if s["side"] == "prefill"]
    result = {
        "config": asdict(cfg),
        "transport": "loopback" if c.transport == "loopback" else "zmq+nixl",
        "mapping": {
            "pairs": mapping.pairs(),
            "sending_prefill_ranks": active,
            "sources_per_decode_rank": [len(mapping.sources_of(d)) for d in range(c.decode_tp)],
        },
        "rooms": c.rooms,
        **outcome,
        "tokens": tokens_moved,
        "elements_checked": elements,
        "aux_bytes_checked": aux_checked,
        "bytes_checked": elements * c.dtype_bytes + aux_checked,
        "bytes_written_by_prefill": sum(ct.get("bytes_written", 0) for ct in counters),
        "descriptors": sum(ct.get("descriptors", 0) for ct in counters),
        "descriptors_per_room": {
            "min": min(descriptors, default=0),
            "mean": sum(descriptors) / len(descriptors) if descriptors else 0.0,
            "max": max(descriptors, default=0),
        },
        "seconds": seconds,
        "leftover_rooms": leftovers,
        "problems": problems,
        "ok": not problems and outcome["succeeded"] == c.rooms,
        "stats": stats,
    }
    return result


# ------------------------------------------------------------------------------------- CLI

LAYOUT_FLAGS = ("prefill_tp", "decode_tp", "prefill_page", "decode_page", "mla")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The layout demo's flags (``kvfsm demo``; any of ``LAYOUT_FLAGS`` selects it)."""
    d = LayoutDemoConfig()
    g = p.add_argument_group(
        "heterogeneous layouts (any of --prefill-tp/--decode-tp/--prefill-page/--decode-page/--mla selects them)"
    )
    g.add_argument("--prefill-tp", type=int, default=None, help=f"prefill TP ranks (default {d.prefill_tp})")
    g.add_argument("--decode-tp", type=int, default=None, help=f"decode TP ranks (default {d.decode_tp})")
    g.add_argument("--prefill-page", type=int, default=None, help=f"prefill page size in tokens ({d.prefill_page})")
    g.add_argument("--decode-page", type=int, default=None, help=f"decode page size in tokens ({d.decode_page})")
    g.add_argument("--mla", action="store_true", default=None, help="one latent vector per token (MLA)")
    g.add_argument("--kv-order", choices=[o.value for o in KVOrder], default=d.kv_order, help="both sides' KV order")
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--kv-heads", type=int, default=d.kv_heads, help="the model's KV heads (1 with --mla)")
    g.add_argument("--head-dim", type=int, default=None, help=f"{d.head_dim}; {_MLA_HEAD_DIM} with --mla")
    g.add_argument("--tokens-min", type=int, default=d.tokens_min, help="shortest prompt")
    g.add_argument("--tokens-max", type=int, default=d.tokens_max, help="longest prompt")
    g.add_argument("--verify-plans", action="store_true", help="prefill proves every plan before its write")


def requested(args: argparse.Namespace) -> bool:
    """True when the command line asks for the layout demo."""
    return any(getattr(args, name, None) is not None for name in LAYOUT_FLAGS)


def refused(args: argparse.Namespace) -> str | None:
    """Why these flags cannot run the layout demo, or None."""
    if args.ranks is not None:
        return "--ranks (equal TP on both sides) conflicts with --prefill-tp/--decode-tp; give one or the other"
    if args.drop or args.dup or args.delay or args.unordered:
        return "the layout demo runs without fault injection (--drop/--dup/--delay/--unordered)"
    if args.kill_prefill is not None or args.batch or args.prefill_netns or args.decode_netns:
        return "--kill-prefill, --batch and network namespaces belong to the equal-TP demo"
    return None


def config_from(args: argparse.Namespace) -> LayoutDemoConfig:
    d = LayoutDemoConfig()
    mla = bool(args.mla)
    return LayoutDemoConfig(
        prefill_tp=args.prefill_tp if args.prefill_tp is not None else d.prefill_tp,
        decode_tp=args.decode_tp if args.decode_tp is not None else d.decode_tp,
        prefill_page=args.prefill_page if args.prefill_page is not None else d.prefill_page,
        decode_page=args.decode_page if args.decode_page is not None else d.decode_page,
        mla=mla,
        kv_order=args.kv_order,
        layers=args.layers,
        kv_heads=1 if mla else args.kv_heads,
        head_dim=args.head_dim if args.head_dim is not None else (_MLA_HEAD_DIM if mla else d.head_dim),
        rooms=args.rooms,
        chunks=args.chunks,
        tokens_min=args.tokens_min,
        tokens_max=args.tokens_max,
        concurrency=args.concurrency,
        order=args.order,
        seed=args.seed,
        transport=args.transport,
        workers=args.workers,
        transfer_timeout=args.transfer_timeout,
        verify_plans=args.verify_plans,
        ucx_params=dict(kv.split("=", 1) for kv in args.ucx),
    )


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send whatever writes to stdout meanwhile (NIXL's and UCX's logs) to stderr, so that
    stdout carries only the demo's own report (one JSON object with --json)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(args: argparse.Namespace) -> int:
    why = refused(args)
    if why is not None:
        print(f"kvfsm demo: {why}", file=sys.stderr)
        return 2
    try:
        cfg = config_from(args)
        cfg.layout("prefill", 0), cfg.layout("decode", 0)
        RankMap(cfg.kv_heads, cfg.prefill_tp, cfg.decode_tp, cfg.mla)
    except (LayoutError, LocalProtocolError) as exc:
        print(f"kvfsm demo: {exc}", file=sys.stderr)
        return 2
    with _stdout_to_stderr() if cfg.transport == "nixl" else contextlib.nullcontext():
        res = run_layout_demo(cfg)
    if args.json:
        print(json.dumps(res, sort_keys=True))
        return 0 if res["ok"] else 1
    model = f"MLA latent {cfg.head_dim}" if cfg.mla else f"{cfg.kv_heads} KV heads x {cfg.head_dim}"
    print(
        f"kvfsm layout demo over {res['transport']}: prefill TP{cfg.prefill_tp} page {cfg.prefill_page} -> "
        f"decode TP{cfg.decode_tp} page {cfg.decode_page}, {cfg.kv_order}, {cfg.layers} layers, {model}, "
        f"{cfg.dtype_bytes}-byte elements"
    )
    m = res["mapping"]
    print(f"  mapping: pairs {m['pairs']}; sending prefill ranks {m['sending_prefill_ranks']}")
    print(
        f"  rooms {res['rooms']}: succeeded {res['succeeded']}, failed {res['failed']}, stuck {res['stuck']}; "
        f"{res['tokens']} tokens"
    )
    dpr = res["descriptors_per_room"]
    print(
        f"  elements checked {res['elements_checked']} ({res['bytes_checked'] / 2**20:.1f} MiB with aux); "
        f"descriptors per room min {dpr['min']} mean {dpr['mean']:.0f} max {dpr['max']}; {res['seconds']:.2f} s"
    )
    print(f"  leftover rooms {res['leftover_rooms']}")
    for problem in res["problems"][:10]:
        print(f"  problem: {problem}")
    print("  OK" if res["ok"] else "  FAILED")
    return 0 if res["ok"] else 1
