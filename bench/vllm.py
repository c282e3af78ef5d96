"""vLLM prefill/decode through KvfsmConnector against vLLM's own NixlConnector, in one run.

For each connector a prefill engine and a decode engine (their own processes, a tiny random
Llama, NIXL over UCX on DRAM) serve the same N concurrent requests for several rounds: the prefill
legs of a round together, then their decode legs together. Measured per request at the decode
engine: time to first token (vLLM's own request timing, from the decode leg's arrival; it holds
the KV transfer, since decode computes its first token only once the whole prompt's KV landed),
the KV transfer latency as the decode engine sees it (from the request's queueing to its
scheduling, which vLLM does only once the connector reported the request's KV in place),
the decode leg's wall time per round, and the CPU time both engines' processes spent per request
(every process of each engine, counted rounds only: same model and prompts, so a difference is
the connector's). The baselines are vLLM's own connectors in the same run: NixlConnector (pull,
vLLM's default) and NixlPushConnector (push: a request's two legs sent at once under one id, as
its proxy does, so its decode TTFT holds the prefill); the goal is kvfsm's TTFT and KV transfer
latency at most 1.0x the baseline's of the same mode. Every
round's greedy tokens are compared with one plain engine's (no connector) on the same prompts.

    python bench/vllm.py                  # writes bench/results/vllm.json
    python bench/vllm.py --requests 16 --tokens 512 --rounds 4

Needs vLLM (``pip install -e ".[dev]"``, see the README).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvfsm.testing.tiny_llama import VOCAB, make_tiny_llama
from kvfsm.testing.vllm_pd import PDPair, single

RESULTS = Path(__file__).resolve().parent / "results"
CONNECTORS: dict[str, tuple[str, str | None, dict[str, Any] | None, str | None]] = {
    # name: (kv_connector, kv_connector_module_path, extra config, transfer_mode)
    "nixl_pull": ("NixlConnector", None, None, None),
    # vLLM's push (PR 35264): the proxy sends both legs at once, under one request id
    "nixl_push": ("NixlPushConnector", None, None, "push"),
    "kvfsm_push": ("KvfsmConnector", "kvfsm.connectors.vllm", None, "push"),
    "kvfsm_pull": ("KvfsmConnector", "kvfsm.connectors.vllm", None, "pull"),
}
_TICK = os.sysconf("SC_CLK_TCK")


def _group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (Linux /proc)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # (fields after the command: state, ppid, pgrp, ...)
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def _pair_cpu_s(pair: PDPair) -> float:
    return sum(_group_cpu_s(os.getpgid(e.proc.pid)) for e in (pair.prefill_engine, pair.decode_engine))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _both_legs_at_once(pair: PDPair, prompts: list[list[int]], max_tokens: int, r: int) -> list[dict[str, Any]]:
    """vLLM's push connector's flow: each request's prefill leg and decode leg sent at once under
    one request id, the decode leg naming the prefill engine (its TTFT then holds the prefill)."""
    ids = [f"round{r}-{i}" for i in range(len(prompts))]
    role = "kv_producer"
    where = {"remote_engine_id": pair.engine_ids[role], "remote_host": "127.0.0.1",
             "remote_port": pair.side_ports[role], "tp_size": 1}  # fmt: skip
    legs = [{"do_remote_prefill": True, "remote_request_id": rid, **where} for rid in ids]
    errors: list[BaseException] = []

    def prefill() -> None:
        try:
            pair.prefill_engine.generate_ids(prompts, 1, [{"do_remote_decode": True} for _ in ids], ids)
        except BaseException as exc:  # noqa: BLE001 - reported after the decode legs
            errors.append(exc)

    thread = threading.Thread(target=prefill)
    thread.start()
    outs = pair.decode_engine.generate_ids(prompts, max_tokens, legs, ids)
    thread.join()
    if errors:
        raise errors[0]
    return outs


def run(
    name: str, model: str, prompts: list[list[int]], rounds: int, max_tokens: int, reference: list[list[int]]
) -> dict[str, Any]:
    connector, module, extra, mode = CONNECTORS[name]
    ttft: list[float] = []
    kv_wait: list[float] = []
    walls: list[float] = []
    differ: list[tuple[int, int]] = []  # (round, prompt) whose tokens are not the plain engine's
    cpu = 0.0
    t0 = time.monotonic()
    with PDPair(model, connector, module, extra) as pair:
        start = time.monotonic() - t0
        for r in range(rounds + 1):  # round 0 warms both engines up and is not counted
            cpu0 = _pair_cpu_s(pair)
            t = time.monotonic()
            if connector == "NixlPushConnector":
                outs = _both_legs_at_once(pair, prompts, max_tokens, r)
            else:
                params = pair.prefill(prompts, mode)
                t = time.monotonic()
                outs = pair.decode_engine.generate(prompts, max_tokens, params)
            wall = time.monotonic() - t
            differ += [(r, i) for i, o in enumerate(outs) if list(o["tokens"]) != reference[i]]
            if r == 0:
                continue
            cpu += _pair_cpu_s(pair) - cpu0
            walls.append(wall)
            ttft += [float(o["ttft_s"]) for o in outs if o.get("ttft_s") is not None]
            kv_wait += [float(o["kv_wait_s"]) for o in outs if o.get("kv_wait_s") is not None]
    return {
        "connector": connector,
        "transfer_mode": mode or "pull",
        "engine_start_s": start,
        "requests": len(prompts) * rounds,
        "ttft_ms": {"p50": 1e3 * _pct(ttft, 0.5), "p99": 1e3 * _pct(ttft, 0.99), "mean": 1e3 * statistics.fmean(ttft)}
        if ttft
        else None,
        "kv_transfer_ms": {"p50": 1e3 * _pct(kv_wait, 0.5), "p99": 1e3 * _pct(kv_wait, 0.99)} if kv_wait else None,
        "decode_round_ms": {"p50": 1e3 * _pct(walls, 0.5), "max": 1e3 * max(walls)},
        "engine_cpu_ms_per_request": 1e3 * cpu / (len(prompts) * rounds),
        "tokens_differ": differ,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="concurrent requests per round")
    p.add_argument("--tokens", type=int, default=400, help="prompt length")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4, help="tokens each decode leg generates")
    p.add_argument("--out", type=Path, default=RESULTS / "vllm.json")
    args = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.tokens)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_llama(Path(tmp) / "model", seed=0))
        reference = single(model, prompts, args.max_tokens)
        res: dict[str, dict[str, Any]] = {}
        for name in CONNECTORS:
            try:
                res[name] = run(name, model, prompts, args.rounds, args.max_tokens, reference)
            except Exception as exc:  # noqa: BLE001 - a connector that cannot serve the run is reported
                res[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    out: dict[str, Any] = {
        "config": vars(args) | {"out": str(args.out)},
        "results": res,
        # as the plain engine's, every round
        "same_tokens": {k: not v["tokens_differ"] for k, v in res.items() if "tokens_differ" in v},
    }
    goal = True
    for name, base_name in (("kvfsm_push", "nixl_push"), ("kvfsm_pull", "nixl_pull")):
        ours, base = res[name], res[base_name]
        for metric in ("ttft_ms", "kv_transfer_ms"):
            if base.get(metric) and ours.get(metric):
                ratios = {q: ours[metric][q] / base[metric][q] for q in ("p50", "p99")}
                out[f"{name}_{metric.removesuffix('_ms')}_ratio"] = ratios
                goal = goal and all(v <= 1.0 for v in ratios.values())
            else:
                goal = False
    # TTFT and KV transfer latency, p50 and p99, each mode against vLLM's connector of that mode
    out["goal_le_1x"] = goal
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
