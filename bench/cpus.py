"""bench/cpus.py: how fast this machine's CPUs run the interpreter, each alone and beside a busy
one (JSON). A reading aid for ``bench/transfer.py``, not a goal.

kvfsm's engine thread is CPU-bound at small chunks on a GPU, and it runs as fast as the CPU it
lands on. On a virtual machine the guest's CPUs may share hardware the guest does not see
(``lscpu`` can report one thread per core), and the host's load can slow some of them for
seconds at a time; a run of ``bench/transfer.py`` that lands on slow ones gives a lower ratio
with the same code. This bench measures, in the same run:

  alone    per CPU, a fixed Python loop pinned to it (nothing else of ours running): µs per
           iteration, and the spread between the fastest and the slowest CPU
  beside   per CPU in ``--busy`` (default: the first, the middle and the last), a second process
           spinning on it, the loop on every other CPU in turn: each one's slowdown against its
           own time alone (CPUs slowed by more than ``--slowed`` (1.15x) are listed: they share
           hardware with the busy one, or the host moved them meanwhile)
  over_time  the loop pinned to one CPU for ``--seconds``: the median and the 95th percentile of
           its ~5 ms rounds, and the median of each second (slow phases show as slow seconds)

Linux only (``os.sched_setaffinity``). Writes JSON (default bench/results/cpus.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TABLE = {i: i for i in range(1000)}


def _loop(n: int = 1000) -> int:
    """The fixed work: dict look-ups and integer arithmetic, as the interpreter runs a step."""
    s = 0
    for i in range(n):
        s += TABLE[i]
        if s & 1:
            s ^= 1
    return s


@contextmanager
def _pinned(cpu: int) -> Iterator[None]:
    """This thread on ``cpu`` alone meanwhile, then on the CPUs it had."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def speed(cpu: int, seconds: float) -> float:
    """µs of CPU per iteration of ``_loop`` on ``cpu`` over ``seconds`` of wall time."""
    with _pinned(cpu):
        n, c0, end = 0, time.thread_time(), time.perf_counter() + seconds
        while time.perf_counter() < end:
            _loop()
            n += 1
        return (time.thread_time() - c0) / n * 1e6


def _spin(cpu: int, stop: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        _loop()


def beside(busy: int, cpus: list[int], alone: dict[int, float], seconds: float, slowed: float) -> dict[str, Any]:
    """The loop's slowdown on every CPU but ``busy`` while a process spins on ``busy``."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    p = ctx.Process(target=_spin, args=(busy, stop), daemon=True)
    p.start()
    time.sleep(0.2)  # (the spinner started)
    try:
        ratio = {c: speed(c, seconds) / alone[c] for c in cpus if c != busy}
    finally:
        stop.set()
        p.join(timeout=10)
    return {
        "slowdown": {str(c): r for c, r in ratio.items()},
        "slowed": sorted(c for c, r in ratio.items() if r > slowed),
        "median_slowdown": statistics.median(ratio.values()) if ratio else None,
    }


def over_time(cpu: int, seconds: float) -> dict[str, Any]:
    """The loop pinned to ``cpu`` in ~5 ms rounds for ``seconds``."""
    per_round = max(1, int(5000 / max(speed(cpu, 0.05), 1e-3)))  # iterations in ~5 ms
    rounds: list[tuple[float, float]] = []
    with _pinned(cpu):
        start = time.perf_counter()
        while (now := time.perf_counter()) - start < seconds:
            c0 = time.thread_time()
            for _ in range(per_round):
                _loop()
            rounds.append((now - start, (time.thread_time() - c0) * 1e3))
    by_second: dict[int, list[float]] = {}
    for t, ms in rounds:
        by_second.setdefault(int(t), []).append(ms)
    ms_all = sorted(ms for _, ms in rounds)
    return {
        "cpu": cpu,
        "rounds": len(rounds),
        "round_ms_median": statistics.median(ms_all),
        "round_ms_p95": ms_all[int(0.95 * (len(ms_all) - 1))],
        "second_medians_ms": [statistics.median(v) for _, v in sorted(by_second.items())],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", default="bench/results/cpus.json")
    ap.add_argument("--quick", action="store_true", help="short measurements (tests)")
    ap.add_argument("--busy", help="comma-separated CPUs to spin on (default: the first, the middle and the last)")
    ap.add_argument("--slowed", type=float, default=1.15, help="slowdown from which a CPU is listed as slowed")
    ap.add_argument("--seconds", type=float, default=10.0, help="over_time: seconds of the pinned loop")
    args = ap.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        print("bench/cpus.py: needs os.sched_setaffinity (Linux)", file=sys.stderr)
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    each = 0.05 if args.quick else 0.25
    alone = {c: speed(c, each) for c in cpus}
    busy = [int(c) for c in args.busy.split(",")] if args.busy else sorted({cpus[0], cpus[len(cpus) // 2], cpus[-1]})
    result: dict[str, Any] = {
        "bench": "cpus",
        "cpus": cpus,
        "alone_us_per_iteration": {str(c): v for c, v in alone.items()},
        "alone_slowest_over_fastest": max(alone.values()) / min(alone.values()),
        "beside": {str(b): beside(b, cpus, alone, each, args.slowed) for b in busy if b in alone},
        "over_time": over_time(cpus[len(cpus) // 2], 1.0 if args.quick else args.seconds),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"alone: {min(alone.values()):.1f}-{max(alone.values()):.1f} µs per iteration over {len(cpus)} CPUs "
          f"(slowest / fastest {result['alone_slowest_over_fastest']:.2f})")  # fmt: skip
    for b, row in result["beside"].items():
        print(f"beside a busy CPU {b}: slowed {row['slowed']} (median slowdown {row['median_slowdown']})")
    t = result["over_time"]
    print(f"over time, CPU {t['cpu']}: round median {t['round_ms_median']:.2f} ms, p95 {t['round_ms_p95']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
