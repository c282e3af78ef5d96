"""bench/check.py: model-checker throughput (JSON), with a baseline measured in the same run.

  states/s and bytes per state exploring the standard preset (reduced to its independent
  component) and the smoke preset. Baselines measured in the same run: the same exploration of
  the smoke preset with the effect tables off (``memo=False``: every successor computed from the
  readable model code with a mutable builder, without the flat-state fast path), and the bare
  protocol steps per second of the transitions machines.

Writes JSON (default bench/results/check.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from kvfsm.check.cli import PRESETS
from kvfsm.check.explore import components, explore


def measure(name: str, bytes_sample: int, memo: bool = True) -> dict[str, Any]:
    cfg = PRESETS[name]
    (sub, copies), *_ = components(cfg)
    r = explore(sub, memo=memo)
    # bytes per state: a separate, bounded run under tracemalloc (it slows exploration down)
    tracemalloc.start()
    small = explore(sub, max_states=bytes_sample, cycles=False, memo=memo)
    _current, peak = tracemalloc.get_traced_memory()  # peak: visited table, queue, edges, caches
    tracemalloc.stop()
    return {
        "preset": name,
        "effect_tables": memo,
        "component": {"prefill_ranks": sub.prefill_ranks, "decode_ranks": sub.decode_ranks, "copies": copies},
        "distinct_states": r.distinct_states,
        "edges": r.edges,
        "max_depth": r.max_depth,
        "seconds": r.seconds,
        "states_per_second": r.states_per_second,
        "edges_per_second": r.edges / r.seconds if r.seconds else 0.0,
        "complete": r.complete,
        "violations": [v["name"] for v in r.violations],
        "bytes_per_state": peak / small.distinct_states,
        "step_cache_entries": r.step_cache_entries,
    }


def transitions_baseline(n: int = 20000) -> float:
    """Protocol steps/s of the transitions machines (what a checker stepping them would top out at)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from core import bench_step

    res = bench_step(max(1, n // 30))
    return 1e6 / float(res["us_per_step_transitions"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/check.json")
    ap.add_argument("--quick", action="store_true", help="smoke preset only")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    runs = [measure("smoke", 5000)] + ([] if args.quick else [measure("standard", 20000)])
    unmemoised = measure("smoke", 5000, memo=False)
    base = transitions_baseline()
    result = {
        "runs": runs,
        "baseline_no_effect_tables": unmemoised,
        "speedup_over_no_effect_tables": {
            r["preset"]: r["states_per_second"] / unmemoised["states_per_second"] for r in runs
        },
        "transitions_steps_per_second": base,
        "ratio_states_per_second_to_transitions_steps": {r["preset"]: r["states_per_second"] / base for r in runs},
        "goal_100k_states_per_second": {r["preset"]: r["states_per_second"] >= 100_000 for r in runs},
        "seconds_total": time.perf_counter() - t,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
