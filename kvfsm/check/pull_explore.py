"""Breadth-first exploration of pull mode (``kvfsm.check.pull_model``): presets, mutants and the
shortest counterexample.

Every reachable state is stored with its parent and the label of the edge that reached it, so a
violation's trace is the shortest one (breadth first). ``always`` properties are notes on edges
(``!name``), ``sometimes`` properties notes that witness them (``~name``); ``no_leaked_blocks``
is checked on quiescent states: states whose only successor is a tick that changes nothing (a
crash or an engine abort left in the budget does not count: liveness must not rest on them).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvfsm.check.explore import CheckResult, print_outcome
from kvfsm.check.mutants import _drop_actions, _machine, _rows
from kvfsm.check.properties import load_properties
from kvfsm.check.pull_model import TIMEOUTS, Label, PullConfig, PullModel, State
from kvfsm.protocol import Protocol, load_spec
from kvfsm.protocol.actions import PostRead
from kvfsm.protocol.functions import ACTIONS, StepContext
from kvfsm.protocol.pull import post_reads
from kvfsm.protocol.spec import MachineSpec, ProtocolSpec

PULL_PRESETS: dict[str, PullConfig] = {
    # runs in CI: every fault but crashes on one prefill/decode pair
    "pull-smoke": PullConfig(1, 1, loss=1, dup=1, aborts=1, max_epoch=2),
    # every fault, a decode crash among them (its read may still land)
    "pull": PullConfig(1, 1, loss=1, dup=1, crash=1, aborts=1, max_epoch=2),
    # decode reads from two sources (each grants, each read lands or is cancelled on its own)
    "pull-2p1d": PullConfig(2, 1, max_epoch=2),
}


# --------------------------------------------------------------------- mutants


def _post_reads_unbounded(room: Any, ev: Any, ctx: StepContext, arg: str) -> None:
    """vLLM: the read carries no deadline (the transport never cancels it at the lease's end)."""
    post_reads(room, ev, ctx, arg)
    ctx.out[:] = [replace(a, deadline=float("inf")) if isinstance(a, PostRead) else a for a in ctx.out]


ACTIONS.setdefault("mutant_post_reads_unbounded", _post_reads_unbounded)


def _rename(old: str, new: str) -> Callable[[MachineSpec], MachineSpec]:
    return lambda ms: _rows(ms, lambda rows: [replace(r, actions=tuple(new if a == old else a for a in r.actions))
                                              for r in rows])  # fmt: skip


def _row_without(rid: str, action: str) -> Callable[[MachineSpec], MachineSpec]:
    return lambda ms: _rows(ms, lambda rows: [replace(r, actions=tuple(a for a in r.actions if a != action))
                                              if r.id == rid else r for r in rows])  # fmt: skip


@dataclass(frozen=True)
class PullMutant:
    name: str
    bug: str
    expect: str
    config: PullConfig
    transform: Callable[[ProtocolSpec], ProtocolSpec]


PULL_MUTANTS: dict[str, PullMutant] = {
    m.name: m
    for m in [
        PullMutant(
            "vllm_read_after_expiry",
            "vLLM: decode's reads carry no lease deadline while prefill frees its blocks on a timeout (read after expiry)",
            "no_read_of_freed_blocks",
            PullConfig(1, 1),
            lambda s: _machine(s, "decode_pull", _rename("post_reads", "mutant_post_reads_unbounded")),
        ),
        PullMutant(
            "heartbeat_never_extends",
            "Prefill grants a renewal (Q3) without extending the lease: decode counts from the renewal",
            "no_read_of_freed_blocks",
            PullConfig(1, 1),
            lambda s: _machine(s, "prefill_pull", _row_without("Q3", "arm:lease")),
        ),
        PullMutant(
            "lost_notification_no_expiry",
            "Prefill frees only on decode's notification (no lease timer): a lost notification pins the blocks",
            "no_leaked_blocks",
            PullConfig(1, 1, loss=1),
            lambda s: _machine(s, "prefill_pull", _drop_actions({"arm:lease"})),
        ),
    ]
}


def pull_protocol(mutant: str | None) -> Protocol:
    spec = load_spec()
    if mutant is not None:
        spec = PULL_MUTANTS[mutant].transform(spec)
    return Protocol(spec, timeouts=TIMEOUTS)


# --------------------------------------------------------------------- exploration


def explore_pull(cfg: PullConfig, *, max_states: int | None = None, stop_at_first: bool = True) -> CheckResult:
    """Explore every state reachable in ``cfg`` (or ``max_states`` of them), breadth first."""
    props = load_properties("pull")
    model = PullModel(cfg, pull_protocol(cfg.mutant))
    res = CheckResult(cfg, witnessed={name: False for name in props["sometimes"]})  # type: ignore[arg-type]
    t0 = time.perf_counter()
    init = model.initial()
    ids: dict[State, int] = {init: 0}
    parent: list[int] = [-1]
    labels: list[Label] = [()]
    depth: list[int] = [0]
    queue: deque[State] = deque([init])
    violated: set[str] = set()
    sid = -1
    while queue:
        s = queue.popleft()
        sid += 1
        quiet = True
        for label, t, notes in model.successors(s):
            if "refused" in notes:
                continue
            if t == s and label == ("tick",):
                continue
            if label[0] not in ("crash", "abort"):  # faults and engine choices are no progress
                quiet = False
            if "cleared" in notes:
                label = (*label, "+clear")
            res.edges += 1
            for note in notes:
                if note[0] == "~":
                    res.witnessed[note[1:]] = True
                elif note[0] == "!" and note[1:] not in violated:
                    violated.add(note[1:])
                    res.violations.append(_violation(note[1:], "", _trace(parent, labels, sid) + [label]))
            if t not in ids:
                ids[t] = len(parent)
                parent.append(sid)
                labels.append(label)
                depth.append(depth[sid] + 1)
                queue.append(t)
        if quiet:
            leaked = model.leaked(s)
            if leaked and "no_leaked_blocks" not in violated:
                violated.add("no_leaked_blocks")
                detail = "quiescent with " + ", ".join(leaked)
                res.violations.append(_violation("no_leaked_blocks", detail, _trace(parent, labels, sid)))
        if (res.violations and stop_at_first) or (max_states is not None and len(parent) >= max_states):
            break
    res.distinct_states = len(parent)
    res.max_depth = max(depth)
    res.complete = not queue and not (res.violations and stop_at_first)
    res.seconds = time.perf_counter() - t0
    return res


def _trace(parent: list[int], labels: list[Label], sid: int) -> list[Label]:
    out: list[Label] = []
    while sid > 0:
        out.append(labels[sid])
        sid = parent[sid]
    return out[::-1]


def _violation(name: str, detail: str, trace: list[Label]) -> dict[str, Any]:
    return {"name": name, "detail": detail, "trace": [list(_jsonable(x) for x in label) for label in trace]}


def _jsonable(x: Any) -> Any:
    if isinstance(x, tuple):
        return [_jsonable(y) for y in x]
    return x


def describe(label: list[Any]) -> str:
    """A trace step in words."""
    if label[-1] == "+clear":
        return describe(label[:-1]) + "; the engine clears the concluded room (frees its pages)"
    kind = label[0]
    if kind == "tick":
        return "time advances one tick"
    if kind == "timer":
        return f"{label[1]}: {label[2]} timer fires"
    if kind in ("create", "allocate", "abort", "clear", "crash"):
        what = {"create": "engine creates the room", "allocate": "engine allocates its pages",
                "abort": "engine aborts the room", "clear": "engine clears the room (frees its pages)",
                "crash": "rank crashes"}[kind]  # fmt: skip
        return f"{label[1]}: {what}"
    if kind == "land":
        return f"read {label[1]} -> {label[2]} lands (copies {label[1]}'s pages)"
    if kind == "cancel":
        return f"read {label[1]} -> {label[2]} cancelled at its deadline"
    if kind == "report":
        return f"{label[1]}: transport reports {label[2]} from {label[3]}"
    if kind == "peer_lost":
        return f"{label[1]}: peer lost {label[2]}"
    item = label[1]
    if kind == "drop":
        return f"dropped (no such room): {item}"
    side, rank, msg = item
    fields = ", ".join(str(v) for v in msg[2:])
    return f"{kind} {msg[0]}({fields}) to {side}{rank}"


def print_pull_result(res: CheckResult, cfg: PullConfig) -> None:
    mode = "mutant " + cfg.mutant if cfg.mutant else "protocol"
    print(f"kvfsm check ({mode}, pull): {cfg.prefill_ranks} P x {cfg.decode_ranks} D ranks, 1 room, "
          f"loss {cfg.loss}, dup {cfg.dup}, crash {cfg.crash}, aborts {cfg.aborts}, early {cfg.early}, "
          f"max epoch {cfg.max_epoch}, timers {TIMEOUTS}")  # fmt: skip
    print_outcome(res, describe)


def pull_config(args: argparse.Namespace) -> PullConfig:
    """The configuration of ``kvfsm check`` in pull mode: the preset or the mutant's own, then the flags."""
    if args.mutant:
        cfg = PULL_PRESETS[args.preset] if args.preset in PULL_PRESETS else PULL_MUTANTS[args.mutant].config
    else:
        cfg = PULL_PRESETS[args.preset]
    changes = {n: getattr(args, n) for n in ("prefill_ranks", "decode_ranks", "loss", "dup", "crash", "aborts")}
    return replace(cfg, mutant=args.mutant, **{n: v for n, v in changes.items() if v is not None})


def pull_main(args: argparse.Namespace) -> int:
    """``kvfsm check --preset pull*`` or ``--mutant`` of pull mode: the result line (or JSON), the
    shortest trace of each violation; exit 1 on a violation."""
    cfg = pull_config(args)
    res = explore_pull(cfg, max_states=args.max_states, stop_at_first=not args.all)
    if args.trace_out and res.violations:
        v = res.violations[0]
        with args.trace_out.open("w") as f:
            f.write(
                json.dumps({"config": res.as_json()["config"], "violation": v["name"], "detail": v["detail"]}) + "\n"
            )
            for i, label in enumerate(v["trace"], 1):
                f.write(json.dumps({"step": i, "label": label, "text": describe(label)}) + "\n")
    if args.json:
        out = res.as_json()
        out["mode"] = "pull"
        out["timeouts"] = TIMEOUTS
        print(json.dumps(out))
    else:
        print_pull_result(res, cfg)
    return 0 if res.ok else 1
