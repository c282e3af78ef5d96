"""``kvfsm check``: explore the protocol exhaustively and report violations with the shortest trace."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvfsm.check.explore import CheckResult, components, explore, explore_reduced, print_outcome, print_progress
from kvfsm.check.model import CheckConfig
from kvfsm.check.mutants import MUTANTS
from kvfsm.check.pull_explore import PULL_MUTANTS, PULL_PRESETS, pull_main

PRESETS: dict[str, CheckConfig] = {
    # runs in CI: every fault kind on one prefill/decode pair
    "smoke": CheckConfig(1, 1, 1, 1, loss=1, dup=1, crash=0, aborts=1),
    # the bar: 2 P x 2 D ranks, 2 rooms, 2 chunks, one loss, one duplication, one crash
    "standard": CheckConfig(2, 2, 2, 2, loss=1, dup=1, crash=1, aborts=1),
    # many prefill ranks into one decode rank (Tp > Td), unordered control plane
    "deep": CheckConfig(2, 1, 2, 2, loss=1, dup=1, crash=1, aborts=1, ordered=False),
    # TP mappings (kvfsm.layout.mapping.RankMap), each within a minute: fan-in, the decode rank
    # waits for two prefill ranks (faults on 2 P -> 1 D: see "deep", which takes minutes)
    "2p1d": CheckConfig(2, 1, 1, 1),
    # fan-out: one prefill rank writes two decode ranks (which tell it so in room_pages)
    "1p2d": CheckConfig(1, 2, 1, 1, aborts=1),
    # fan-out with two destinations per source, two independent 1P -> 2D groups
    "2p4d": CheckConfig(2, 4, 1, 1, aborts=1),
    # MLA: one latent that every rank holds; one prefill rank sends, the other takes no part
    "2p1d-mla": CheckConfig(2, 1, 2, 2, loss=1, dup=1, crash=1, aborts=1, mla=True),
    "1p2d-mla": CheckConfig(1, 2, 1, 1, mla=True),
    # 2 KV heads over prefill TP 4: replicated heads, one holder of each sends, two ranks take no part
    "4p2d-replicated": CheckConfig(4, 2, 2, 2, loss=1, dup=1, crash=1, aborts=1, kv_heads=2),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(PULL_PRESETS),
                   help="a named configuration (flags below override it); pull*: pull mode")  # fmt: skip
    p.add_argument("--prefill-ranks", type=int)
    p.add_argument("--decode-ranks", type=int)
    p.add_argument("--kv-heads", type=int, help="KV heads of the model (default: lcm of the TP sizes)")
    p.add_argument("--mla", action=argparse.BooleanOptionalAction, default=None,
                   help="MLA: one latent that every rank holds (one prefill rank sends it)")  # fmt: skip
    p.add_argument("--rooms", type=int)
    p.add_argument("--chunks", type=int)
    p.add_argument("--loss", type=int, help="messages, notifications or writes that may be lost")
    p.add_argument("--dup", type=int, help="messages or notifications that may be duplicated")
    p.add_argument("--crash", type=int, help="ranks that may crash")
    p.add_argument("--aborts", type=int, help="engine abort() calls")
    p.add_argument("--unordered", action="store_true", help="no per-pair FIFO on the control plane")
    p.add_argument("--order", choices=["any", "decode-first", "prefill-first"],
                   help="push scenario: decode-first (1), prefill-first (2), any (both)")  # fmt: skip
    p.add_argument("--mutant", help="explore a named historical bug instead of the protocol (see --list-mutants)")
    p.add_argument("--list-mutants", action="store_true")
    p.add_argument("--reduction", choices=["independent", "none"], default="independent",
                   help="independent: explore each class of independent rooms/rank groups once (default)")  # fmt: skip
    p.add_argument("--symmetry", action=argparse.BooleanOptionalAction, default=True,
                   help="store one state per orbit of interchangeable rooms and rank groups (default: on)")  # fmt: skip
    p.add_argument("--max-states", type=int)
    p.add_argument("--all", action="store_true", help="keep exploring after the first violation")
    p.add_argument("--no-cycles", action="store_true", help="skip the no-progress-cycle check")
    p.add_argument("--progress", action="store_true", help="progress on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace-out", type=Path, help="write the first violation's trace as JSONL (for kvfsm replay)")


def config_from(args: argparse.Namespace) -> CheckConfig:
    cfg = PRESETS[args.preset] if args.preset else CheckConfig(1, 1, 1, 1)
    if args.mutant:
        if args.mutant not in MUTANTS:
            raise SystemExit(f"unknown mutant {args.mutant!r}; kvfsm check --list-mutants")
        if not args.preset:
            cfg = MUTANTS[args.mutant].config
    changes: dict[str, Any] = {}
    names = ("prefill_ranks", "decode_ranks", "kv_heads", "mla", "rooms", "chunks", "loss", "dup", "crash", "aborts",
             "order")  # fmt: skip
    for name in names:
        v = getattr(args, name)
        if v is not None:
            changes[name] = v
    if args.unordered:
        changes["ordered"] = False
    changes["mutant"] = args.mutant
    return replace(cfg, **changes)


def mermaid(trace: list[list[Any]], cfg: CheckConfig) -> str:
    nodes = [f"P{p}" for p in range(cfg.prefill_ranks)] + [f"D{d}" for d in range(cfg.decode_ranks)]
    lines = ["sequenceDiagram"] + [f"    participant {n}" for n in nodes]
    for step, label in enumerate(trace, 1):
        kind = label[0]
        if kind in ("create", "abort", "clear"):
            lines.append(f"    Note over {label[1]}{label[2]}: {step}. engine {kind} room {label[3]}")
        elif kind == "send":
            lines.append(f"    Note over P{label[1]}: {step}. engine send chunk {label[3]} of room {label[2]}")
        elif kind == "init":
            lines.append(f"    Note over D{label[1]}: {step}. engine allocates room {label[2]}")
        elif kind == "expire":
            lines.append(f"    Note over P{label[1]}: {step}. early messages of room {label[2]} expire")
        elif kind == "timer":
            lines.append(f"    Note over {label[1]}{label[2]}: {step}. {label[4]} timer of room {label[3]} fires")
        elif kind == "crash":
            lines.append(f"    Note over {label[1]}{label[2]}: {step}. crash")
        else:
            item = label[1]
            what = _item_text(item)
            src, dst = (item[1], item[2]) if item[0] in ("m", "n", "w") else (item[1], item[1])
            if item[0] == "c":
                src, dst = f"D{item[3]}", item[1]
            elif item[0] == "l":
                src, dst = item[2], item[1]
            arrow = {"deliver": "->>", "lose": "--x", "duplicate": "-->>"}[kind]
            verb = {"deliver": "", "lose": "lost: ", "duplicate": "duplicated: "}[kind]
            lines.append(f"    {src}{arrow}{dst}: {step}. {verb}{what}")
    return "\n".join(lines)


def _item_text(item: list[Any]) -> str:
    kind = item[0]
    if kind in ("m", "n"):
        msg = item[3]
        return f"{msg[0]} room {msg[1]}"
    if kind == "w":
        return f"write {'aux' if item[4] == -1 else 'chunk ' + str(item[4])} of room {item[3]} lands"
    if kind == "c":
        return f"completion {'ok' if item[5] else 'FAILED'} (room {item[2]}, chunk {item[4]})"
    return f"peer lost: {item[2]}"


def _print_result(res: CheckResult, cfg: CheckConfig, parts: list[Any]) -> None:
    mode = "mutant " + cfg.mutant if cfg.mutant else "protocol"
    heads = "MLA" if cfg.mla else f"{cfg.heads} KV heads"
    print(f"kvfsm check ({mode}): {cfg.prefill_ranks} P x {cfg.decode_ranks} D ranks ({heads}), {cfg.rooms} rooms, "
          f"{cfg.chunks} chunks, loss {cfg.loss}, dup {cfg.dup}, crash {cfg.crash}, aborts {cfg.aborts}, "
          f"{'FIFO' if cfg.ordered else 'unordered'} control plane, order {cfg.order}")  # fmt: skip
    for sub, copies, r in parts:
        if (
            len(parts) > 1
            or copies > 1
            or (sub.prefill_ranks, sub.decode_ranks, sub.rooms) != (cfg.prefill_ranks, cfg.decode_ranks, cfg.rooms)
        ):
            print(f"  component {sub.prefill_ranks} P x {sub.decode_ranks} D x 1 room (x{copies} independent copies): "
                  f"{r.distinct_states:,} states")  # fmt: skip
    mapping = cfg.mapping()
    idle = [f"P{p}" for p in range(cfg.prefill_ranks) if not mapping.peers_of("P", p)]
    if idle:
        print(f"  take no part (no destination, nobody waits for them): {', '.join(idle)}")
    if res.symmetries > 1:
        print(f"  symmetry reduction: one state per orbit of {res.symmetries} renamings of rooms and ranks")
    print_outcome(res, json.dumps, lambda trace: "\n```mermaid\n" + mermaid(trace, cfg) + "\n```")


def main(args: argparse.Namespace) -> int:
    if args.list_mutants:
        rows = [(m.name, m.expect, m.bug) for m in MUTANTS.values()]
        rows += [(m.name, m.expect, m.bug) for m in PULL_MUTANTS.values()]
        for name, expect, bug in rows:
            print(f"{name:30s} {expect:28s} {bug}")
        return 0
    if args.preset in PULL_PRESETS or args.mutant in PULL_MUTANTS:
        return pull_main(args)
    cfg = config_from(args)
    kwargs = dict(
        max_states=args.max_states, stop_at_first=not args.all, cycles=not args.no_cycles,
        progress=print_progress if args.progress else None, symmetry=args.symmetry,
    )  # fmt: skip
    if args.reduction == "independent":
        res, parts = explore_reduced(cfg, **kwargs)
        trace_cfg = parts[-1][0] if parts else cfg
    else:
        res = explore(cfg, **kwargs)
        parts = [(cfg, 1, res)]
        trace_cfg = cfg
    if args.progress:
        print(file=sys.stderr)
    if args.trace_out and res.violations:
        v = res.violations[0]
        with args.trace_out.open("w") as f:
            f.write(
                json.dumps({"config": asdict(trace_cfg), "violation": v["name"], "detail": v.get("detail", "")}) + "\n"
            )
            for i, label in enumerate(v["trace"], 1):
                f.write(json.dumps({"step": i, "label": label}) + "\n")
    if args.json:
        out = res.as_json()
        out["components"] = [
            {
                "prefill_ranks": s.prefill_ranks,
                "decode_ranks": s.decode_ranks,
                "copies": n,
                "distinct_states": r.distinct_states,
            }
            for s, n, r in parts
        ]
        out["reduction"] = args.reduction
        out["symmetry"] = args.symmetry
        print(json.dumps(out))
    else:
        _print_result(res, cfg, parts)
    return 0 if res.ok else 1


__all__ = ["PRESETS", "add_arguments", "components", "main"]
