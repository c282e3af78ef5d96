"""bench/layout.py: transfer plans between heterogeneous KV layouts, per room.

For a realistic model (32 layers, 8 KV heads, head_dim 128, bf16) and a 4,096-token prompt, each
room is one prompt moved from every prefill rank to every decode rank the mapping pairs it with
(``RankMap.pairs()``), in SGLang's memory order unless the room's name says otherwise:

  descriptors       runs per room (all pairs), the prompt planned as one chunk, pages scattered
                    (each side's page list a random draw from a pool twice the prompt's size)
  descriptors_chunked  the same prompt planned in four chunks of 1,024 tokens (chunked prefill)
  descriptors_contiguous  the prompt as one chunk with each side's pages adjacent (the best case)
  prepare_us        building the room's ``Planner``s (once per peer and layout)
  plan_us           planning the room's chunk on every pair (median of reps)
  verify_us         ``verify_plan`` on every pair's plan (median of reps)

Baseline, measured in the same run: ``tp2_tp2_p16`` (equal TP, equal pages: a direct plan); every
room reports ``descriptors_ratio`` and ``plan_us_ratio`` against it. These are the numbers a staged
plan (gather the heads a peer needs into contiguous memory first) will have to beat.

Writes JSON (default bench/results/layout.json, ``--out``); ``--quick`` shrinks the model and the
prompt for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvfsm.layout import KVLayout, KVOrder, Planner, RankMap, verify_plan

BASELINE = "tp2_tp2_p16"
# name -> (prefill TP, decode TP, prefill page, decode page, order)
ROOMS: dict[str, tuple[int, int, int, int, KVOrder]] = {
    "tp2_tp2_p16": (2, 2, 16, 16, KVOrder.SGLANG),
    "tp2_tp2_p64": (2, 2, 64, 64, KVOrder.SGLANG),
    "tp2_tp2_p16_p64": (2, 2, 16, 64, KVOrder.SGLANG),
    "tp2_tp4_p16": (2, 4, 16, 16, KVOrder.SGLANG),
    "tp2_tp4_p64": (2, 4, 64, 64, KVOrder.SGLANG),
    "tp2_tp4_p16_p64": (2, 4, 16, 64, KVOrder.SGLANG),
    "tp4_tp2_p16": (4, 2, 16, 16, KVOrder.SGLANG),
    "tp4_tp2_p64": (4, 2, 64, 64, KVOrder.SGLANG),
    "tp4_tp2_p64_p16": (4, 2, 64, 16, KVOrder.SGLANG),
    "tp2_tp4_p16_vllm_hnd": (2, 4, 16, 16, KVOrder.VLLM_HND),
}


def _median_us(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def bench_room(
    tp: int, td: int, ps: int, pd: int, order: KVOrder, model: dict[str, int], reps: int, seed: int
) -> dict[str, Any]:
    tokens = model["tokens"]
    mapping = RankMap(model["kv_heads"], tp, td)
    rng = np.random.default_rng(seed)

    def side(t: int, page: int) -> tuple[list[KVLayout], list[Any], list[Any]]:
        need = -(-tokens // page)
        lays = [
            KVLayout(
                model["layers"], model["kv_heads"], model["head_dim"], model["dtype_bytes"], t, r, page, 2 * need, order
            )
            for r in range(t)
        ]
        scattered = [rng.permutation(2 * need)[:need] for _ in range(t)]
        contiguous = [np.arange(need) for _ in range(t)]
        return lays, scattered, contiguous

    srcs, s_pages, s_contig = side(tp, ps)
    dsts, d_pages, d_contig = side(td, pd)
    pairs = mapping.pairs()
    t0 = time.perf_counter()
    planners = {(p, d): Planner(srcs[p], dsts[d], mapping) for p, d in pairs}
    prepare_us = (time.perf_counter() - t0) * 1e6

    def plan_all() -> list[Any]:
        return [planners[p, d].plan(s_pages[p], d_pages[d], 0, tokens) for p, d in pairs]

    plans = plan_all()
    plan_us = _median_us(plan_all, reps)

    def verify_all() -> None:
        for (p, d), plan in zip(pairs, plans, strict=True):
            verify_plan(plan, srcs[p], dsts[d], s_pages[p], d_pages[d], 0, tokens, mapping)

    verify_all()  # also proves the plans the figures describe
    verify_us = _median_us(verify_all, max(1, reps // 2))
    chunk = tokens // 4
    chunked = sum(
        planners[p, d].plan(s_pages[p], d_pages[d], first, chunk).descriptors
        for p, d in pairs
        for first in range(0, tokens, chunk)
    )
    contiguous = sum(planners[p, d].plan(s_contig[p], d_contig[d], 0, tokens).descriptors for p, d in pairs)
    kinds = sorted({plan.kind for plan in plans})
    return {
        "prefill_tp": tp,
        "decode_tp": td,
        "prefill_page": ps,
        "decode_page": pd,
        "order": order.value,
        "kind": kinds[0] if len(kinds) == 1 else "mixed",
        "pairs": len(pairs),
        "bytes": sum(plan.bytes for plan in plans),
        "descriptors": sum(plan.descriptors for plan in plans),
        "descriptors_per_pair": max(plan.descriptors for plan in plans),
        "descriptors_chunked": chunked,
        "descriptors_contiguous": contiguous,
        "prepare_us": round(prepare_us, 1),
        "plan_us": round(plan_us, 1),
        "verify_us": round(verify_us, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "layout.json"))
    ap.add_argument("--quick", action="store_true", help="a small model and prompt: a smoke test")
    ap.add_argument("--reps", type=int, default=0, help="timing repetitions (default 7, 2 with --quick)")
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 7)
    model = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "tokens": 4096}
    if args.quick:
        model.update(layers=2, head_dim=16, tokens=512)
    rooms = {
        name: bench_room(tp, td, ps, pd, order, model, reps, seed)
        for seed, (name, (tp, td, ps, pd, order)) in enumerate(ROOMS.items())
    }
    base = rooms[BASELINE]
    for row in rooms.values():
        row["descriptors_ratio"] = round(row["descriptors"] / base["descriptors"], 2)
        row["plan_us_ratio"] = round(row["plan_us"] / base["plan_us"], 2)
    result = {
        "model": model,
        "quick": args.quick,
        "reps": reps,
        "baseline": BASELINE,
        "rooms": rooms,
        "env": {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
