"""``kvfsm demo``: N rooms x C chunks across P prefill and D decode ranks over loopback.

An engine-like driver: each room spans every rank on both sides (equal TP: prefill rank i feeds
decode rank i). Prefill KV pages are filled with seeded random bytes; decode allocates pages from
a free list, announces them, prefill writes each chunk; when every rank of a room concluded, the
driver checks every byte of KV and aux at decode against prefill, clears both sides and frees the
pages. The clock is real time that skips ahead to the next timer deadline whenever nothing else
can happen (so timeouts under fault injection do not take minutes).

Exit status 1 if any byte differs, any room ends other than as expected (all Success without
faults; Success or Failed consistently on every rank with faults), or anything is left behind.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvfsm import layout_demo
from kvfsm.layout_demo import PagePool
from kvfsm.protocol import KVPoll
from kvfsm.runtime import KVReceiver, KVSender, RuntimeConfig
from kvfsm.testing import LoopbackCluster
from kvfsm.transport.loopback import Faults

KILL_CHUNK_INTERVAL_S = 0.4  # --kill-prefill without --chunk-interval: the pause between chunk rounds


@dataclass
class DemoConfig:
    rooms: int = 64
    chunks: int = 4
    ranks: int = 2
    pages_per_chunk: int = 4
    page_bytes: int = 4096
    aux_bytes: int = 64
    concurrency: int = 32
    workers: int = 2
    order: str = "mixed"  # decode-first | prefill-first | mixed
    seed: int = 0
    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0
    ordered: bool = True
    transfer_timeout: float = 5.0

    @property
    def faulty(self) -> bool:
        return bool(self.drop or self.dup or self.delay)


class SkipClock:
    """Monotonic time plus an offset that the driver advances past idle gaps."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skipped

    def skip_to(self, t: float) -> None:
        now = self()
        if t > now:
            self.skipped += t - now


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    clock = SkipClock()
    rcfg = RuntimeConfig(
        workers=cfg.workers,
        timeouts={
            "fence": 8 * cfg.transfer_timeout,
            "transfer": cfg.transfer_timeout,
            "hold": 2 * cfg.transfer_timeout,
            "bootstrap": 4 * cfg.transfer_timeout,
            "input": 4 * cfg.transfer_timeout,
        },
        register_retry_s=0.05,
        early_ttl_s=4 * cfg.transfer_timeout,
    )
    pages_per_room = cfg.chunks * cfg.pages_per_chunk
    region_pages = pages_per_room * cfg.concurrency
    aux_slots = cfg.concurrency
    cluster = LoopbackCluster(
        prefill_ranks=cfg.ranks,
        decode_ranks=cfg.ranks,
        pages=region_pages,
        page_bytes=cfg.page_bytes,
        aux_slots=aux_slots,
        aux_bytes=cfg.aux_bytes,
        seed=cfg.seed,
        ordered=cfg.ordered,
        faults=Faults(cfg.drop, cfg.dup, cfg.delay),
        clock=clock,
        config=rcfg,
    )
    fabric, prefill, decode = cluster.fabric, cluster.prefill, cluster.decode
    pkv, paux, dkv, daux = cluster.pkv, cluster.paux, cluster.dkv, cluster.daux
    managers = cluster.managers

    def settle() -> None:
        """Deliver everything that can be delivered; fire timers that are due."""
        while True:
            moved = cluster.settle()
            for m in managers:
                m.tick()
            if not moved and not fabric.pending:
                return

    def idle_skip() -> None:
        deadlines = [d for m in managers if (d := m.next_deadline()) is not None]
        if deadlines:
            clock.skip_to(min(deadlines) + 1e-6)

    ppools = [PagePool(region_pages) for _ in range(cfg.ranks)]
    dpools = [PagePool(region_pages) for _ in range(cfg.ranks)]
    paux_free = [list(range(aux_slots)) for _ in range(cfg.ranks)]
    daux_free = [list(range(aux_slots)) for _ in range(cfg.ranks)]

    outcome = {"success": 0, "failed": 0, "inconsistent": 0}
    bytes_verified = 0
    mismatched_rooms: list[int] = []
    t0 = time.perf_counter()
    room_ids = list(range(1, cfg.rooms + 1))
    rng.shuffle(room_ids)  # room ids need not be dense or ordered
    for w in range(0, cfg.rooms, cfg.concurrency):
        wave = room_ids[w : w + cfg.concurrency]
        plan: dict[int, dict[str, Any]] = {}
        for rid in wave:
            order = cfg.order if cfg.order != "mixed" else rng.choice(["decode-first", "prefill-first"])
            plan[rid] = {
                "order": order,
                "src": [ppools[r].take(pages_per_room) for r in range(cfg.ranks)],
                "dst": [dpools[r].take(pages_per_room) for r in range(cfg.ranks)],
                "saux": [paux_free[r].pop() for r in range(cfg.ranks)],
                "daux": [daux_free[r].pop() for r in range(cfg.ranks)],
                "senders": [],
                "receivers": [],
                "inited": [False] * cfg.ranks,
            }

        def start_decode(rid: int, p: dict[str, Any]) -> None:
            p["receivers"] = [decode[r].create_receiver(rid) for r in range(cfg.ranks)]

        def start_prefill(rid: int, p: dict[str, Any]) -> None:
            p["senders"] = [prefill[r].create_sender(rid) for r in range(cfg.ranks)]
            for r, s in enumerate(p["senders"]):
                src = p["src"][r]
                for c in range(cfg.chunks):
                    pages = src[c * cfg.pages_per_chunk : (c + 1) * cfg.pages_per_chunk]
                    last = c == cfg.chunks - 1
                    if s.poll() == KVPoll.Failed:
                        break
                    s.send(pages, is_last=last, aux_slot=p["saux"][r] if last else None)

        for rid in wave:
            (start_decode if plan[rid]["order"] == "decode-first" else start_prefill)(rid, plan[rid])
        settle()
        for rid in wave:
            (start_prefill if plan[rid]["order"] == "decode-first" else start_decode)(rid, plan[rid])

        pending = set(wave)
        while pending:
            for rid in sorted(pending):
                p = plan[rid]
                recv: list[KVReceiver] = p["receivers"]
                for r, rc in enumerate(recv):
                    if not p["inited"][r] and rc.poll() == KVPoll.WaitingForInput:
                        rc.init(p["dst"][r], p["daux"][r])
                        p["inited"][r] = True
            settle()
            done = []
            for rid in sorted(pending):
                p = plan[rid]
                senders: list[KVSender] = p["senders"]
                recv = p["receivers"]
                polls = [s.poll() for s in senders] + [rc.poll() for rc in recv]
                if not all(code in (KVPoll.Success, KVPoll.Failed) for code in polls):
                    continue
                if any(rc.pages_fenced() for rc in recv) or any(s.pages_in_use() for s in senders):
                    continue  # a write may still land in (or read) these pages: keep them
                done.append(rid)
                dec = [rc.poll() for rc in recv]
                if all(c == KVPoll.Success for c in dec):
                    outcome["success"] += 1
                    ok = True
                    for r in range(cfg.ranks):
                        pb, ab = cfg.page_bytes, cfg.aux_bytes
                        for sp, dp in zip(p["src"][r], p["dst"][r], strict=True):
                            ok &= dkv[r][dp * pb : (dp + 1) * pb] == pkv[r][sp * pb : (sp + 1) * pb]
                        sa, da = p["saux"][r], p["daux"][r]
                        ok &= daux[r][da * ab : (da + 1) * ab] == paux[r][sa * ab : (sa + 1) * ab]
                        bytes_verified += len(p["src"][r]) * pb + ab
                    if not ok:
                        mismatched_rooms.append(rid)
                elif all(c == KVPoll.Failed for c in dec):
                    outcome["failed"] += 1
                else:
                    outcome["inconsistent"] += 1  # ranks disagree: the engine's MIN-reduce fails it
                    outcome["failed"] += 1
                for s in senders:
                    s.clear()
                for rc in recv:
                    rc.clear()
                for r in range(cfg.ranks):
                    ppools[r].give(p["src"][r])
                    dpools[r].give(p["dst"][r])
                    paux_free[r].append(p["saux"][r])
                    daux_free[r].append(p["daux"][r])
            pending -= set(done)
            if pending and not done and not fabric.pending:
                idle_skip()
    seconds = time.perf_counter() - t0
    settle()
    leftovers = sum(m.live_rooms() for m in managers)
    workers_alive = sum(m.pool.alive for m in managers)
    stats = {f"{m.side}{m.rank}": m.stats() for m in managers}
    cluster.close()
    expected_ok = outcome["success"] == cfg.rooms if not cfg.faulty else True
    result = {
        "config": asdict(cfg),
        "rooms": cfg.rooms,
        "succeeded": outcome["success"],
        "failed": outcome["failed"],
        "ranks_disagreed": outcome["inconsistent"],
        "bytes_verified": bytes_verified,
        "mismatched_rooms": sorted(mismatched_rooms),
        "seconds": seconds,
        "rooms_per_second": cfg.rooms / seconds if seconds else 0.0,
        "simulated_seconds_skipped": clock.skipped,
        "leftover_rooms": leftovers,
        "workers_alive": workers_alive,
        "fabric": asdict(fabric.stats),
        "transfer_seconds_p50_p99": _merge_pct(stats, "transfer_seconds"),
        "ok": expected_ok and not mismatched_rooms and leftovers == 0,
        "stats": stats,
    }
    return result


def _merge_pct(stats: dict[str, Any], name: str) -> list[float]:
    vals = [s["histograms"][name] for s in stats.values() if name in s["histograms"]]
    if not vals:
        return []
    return [max(v["p50"] for v in vals), max(v["p99"] for v in vals)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--rooms", type=int, default=d.rooms)
    p.add_argument("--chunks", type=int, default=d.chunks)
    p.add_argument("--ranks", type=int, default=None, help=f"TP ranks on each side (equal TP; default {d.ranks})")
    p.add_argument("--pages-per-chunk", type=int, default=d.pages_per_chunk)
    p.add_argument("--page-bytes", type=int, default=d.page_bytes)
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="rooms in flight at once")
    p.add_argument("--workers", type=int, default=d.workers, help="transfer workers per prefill rank (0: inline)")
    p.add_argument(
        "--order",
        choices=["decode-first", "prefill-first", "mixed"],
        default=d.order,
        help="decode-first: scenario 1; prefill-first: scenario 2 (chunks held until decode announces)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--drop", type=float, default=0.0, help="probability a message/notification is lost")
    p.add_argument("--dup", type=float, default=0.0, help="probability a message/notification is duplicated")
    p.add_argument("--delay", type=float, default=0.0, help="probability a message/notification is held back")
    p.add_argument("--unordered", action="store_true", help="no per-pair FIFO on the loopback network")
    p.add_argument("--transfer-timeout", type=float, default=d.transfer_timeout)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    real = p.add_argument_group("real transports (--transport nixl: one process per rank on this host)")
    real.add_argument(
        "--transport",
        choices=["loopback", "nixl"],
        default="loopback",
        help="loopback: in-process (default); nixl: P and D ranks as processes, ZMQ control + NIXL data",
    )
    real.add_argument("--kill-prefill", type=int, default=None, metavar="RANK",
                      help="SIGKILL this prefill rank's process in the middle of the second wave")  # fmt: skip
    real.add_argument(
        "--chunk-interval",
        type=float,
        default=None,
        help=f"prefill: seconds between chunk rounds (default 0, or {KILL_CHUNK_INTERVAL_S} with --kill-prefill, so "
        "that the kill lands mid-transfer: without a pause a wave moves in milliseconds)",
    )
    real.add_argument("--batch", action="store_true", help="prefill: each chunk round of all rooms in one send_many()")
    real.add_argument("--ucx", action="append", default=[], metavar="KEY=VALUE", help="NIXL UCX backend parameter")
    real.add_argument("--prefill-netns", default="", help="run prefill ranks (and bootstrap) in this netns")
    real.add_argument("--decode-netns", default="", help="run decode ranks in this network namespace")
    real.add_argument("--prefill-host", default="127.0.0.1", help="address prefill ranks bind to")
    real.add_argument("--decode-host", default="127.0.0.1", help="address decode ranks bind to")
    layout_demo.add_arguments(p)


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    """The flags both demos share: how many rooms, chunks, ranks, pages, and the timeout."""
    return {
        "rooms": args.rooms,
        "chunks": args.chunks,
        "ranks": args.ranks if args.ranks is not None else DemoConfig.ranks,
        "pages_per_chunk": args.pages_per_chunk,
        "page_bytes": args.page_bytes,
        "concurrency": min(args.concurrency, args.rooms),
        "seed": args.seed,
        "transfer_timeout": args.transfer_timeout,
    }


def _chunk_interval(args: argparse.Namespace) -> float:
    """``--chunk-interval``, defaulting to KILL_CHUNK_INTERVAL_S when a prefill rank is to be
    killed: the kill comes at the second wave's first chunk, and a wave of the defaults moves in
    a few milliseconds, so without pauses the rooms were over before the kill landed."""
    if args.chunk_interval is not None:
        return float(args.chunk_interval)
    return KILL_CHUNK_INTERVAL_S if args.kill_prefill is not None else 0.0


def main_processes(args: argparse.Namespace) -> int:
    from kvfsm.node import ClusterConfig, run_cluster

    cfg = ClusterConfig(
        **_shape(args),
        chunk_interval=_chunk_interval(args),
        ucx_params=dict(kv.split("=", 1) for kv in args.ucx),
        prefill_host=args.prefill_host,
        decode_host=args.decode_host,
        prefill_netns=args.prefill_netns,
        decode_netns=args.decode_netns,
        batched=args.batch,
    )
    res = run_cluster(cfg, kill_prefill=args.kill_prefill)
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(
            f"kvfsm demo over ZMQ + NIXL: {res['processes']} processes "
            f"({cfg.ranks} prefill + {cfg.ranks} decode ranks + bootstrap), "
            f"{cfg.rooms} rooms x {cfg.chunks} chunks per rank pair"
        )
        print(f"  succeeded {res['succeeded']}, failed {res['failed']} of {res['rooms']} decode rooms")
        print(
            f"  bytes verified {res['bytes_verified']} ({res['bytes_verified'] / 2**20:.1f} MiB), "
            f"mismatched rooms {len(res['mismatched_rooms'])}, {res['seconds']:.2f} s"
        )
        if res["killed_prefill"] is not None:
            print(
                f"  killed prefill rank {res['killed_prefill']}; its decode rank concluded "
                f"{res['seconds_kill_to_decode_concluded']} s later"
            )
        print(f"  exit codes {res['exit_codes']}")
        for problem in res["problems"]:
            print(f"  problem: {problem}")
        for label, tail in res["stderr_tail"].items():
            print(f"  --- {label} stderr ---\n{tail}")
        print("  OK" if res["ok"] else "  FAILED")
    return 0 if res["ok"] else 1


def main(args: argparse.Namespace) -> int:
    if layout_demo.requested(args):  # TP, page size or MLA differ between the sides
        return layout_demo.main(args)
    if args.transport != "loopback":
        return main_processes(args)
    cfg = DemoConfig(
        **_shape(args),
        workers=args.workers,
        order=args.order,
        drop=args.drop,
        dup=args.dup,
        delay=args.delay,
        ordered=not args.unordered,
    )
    res = run_demo(cfg)
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(
            f"kvfsm demo over loopback: {cfg.rooms} rooms x {cfg.chunks} chunks, "
            f"{cfg.ranks} prefill + {cfg.ranks} decode ranks, order={cfg.order}, workers={cfg.workers}"
        )
        print(f"  succeeded {res['succeeded']}, failed {res['failed']} (ranks disagreed {res['ranks_disagreed']})")
        print(
            f"  bytes verified {res['bytes_verified']} ({res['bytes_verified'] / 2**20:.1f} MiB), "
            f"mismatched rooms {len(res['mismatched_rooms'])}"
        )
        print(
            f"  {res['rooms_per_second']:.0f} rooms/s ({res['seconds']:.3f} s wall"
            + (
                f", {res['simulated_seconds_skipped']:.1f} s of idle timer time skipped"
                if res["simulated_seconds_skipped"]
                else ""
            )
            + ")"
        )
        f = res["fabric"]
        print(
            f"  network: {f['sent']} items, {f['dropped']} dropped, {f['duplicated']} duplicated, "
            f"{f['delayed']} delayed; {f['writes']} writes, {f['segments']} descriptors"
        )
        print(f"  leftover rooms {res['leftover_rooms']}, workers alive {res['workers_alive']}")
        print("  OK" if res["ok"] else "  FAILED")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvfsm demo")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
