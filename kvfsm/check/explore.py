"""Breadth-first exploration of the model: shortest counterexamples, statistics, liveness.

States are deduplicated by their 64-bit hash (a fingerprint; a collision could hide a state, the
usual trade of explicit-state checkers). For each new state the explorer keeps its parent's
fingerprint, the transition label and its depth, which is enough to rebuild the shortest trace to
any state. Edges are recorded as integer ids in discovery order (compressed sparse rows for free),
and a topological sort over them proves the graph acyclic (liveness.no_progress_cycle).
"""

from __future__ import annotations

import resource
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfsm.check.model import CheckConfig, Label, Model, State, sources_of
from kvfsm.check.properties import load_properties, stuck_rooms


@dataclass
class CheckResult:
    config: CheckConfig
    distinct_states: int = 0
    edges: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    complete: bool = False  # every reachable state explored
    violations: list[dict[str, Any]] = field(default_factory=list)
    witnessed: dict[str, bool] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    step_cache_entries: int = 0

    @property
    def states_per_second(self) -> float:
        return self.distinct_states / self.seconds if self.seconds else 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "config": asdict(self.config),
            "distinct_states": self.distinct_states,
            "edges": self.edges,
            "max_depth": self.max_depth,
            "seconds": self.seconds,
            "states_per_second": self.states_per_second,
            "complete": self.complete,
            "violations": self.violations,
            "sometimes": self.witnessed,
            "peak_rss_bytes": self.peak_rss_bytes,
            "step_cache_entries": self.step_cache_entries,
            "ok": self.ok,
        }


def explore(
    cfg: CheckConfig,
    *,
    max_states: int | None = None,
    stop_at_first: bool = True,
    cycles: bool = True,
    progress: Callable[[int, int, int], None] | None = None,
) -> CheckResult:
    """Explore every state reachable from the initial one (or ``max_states`` of them)."""
    props = load_properties()
    model = Model(cfg)
    res = CheckResult(cfg, witnessed={name: False for name in props["sometimes"]})
    t0 = time.perf_counter()
    init = model.initial()
    init_fp = hash(init)
    # fp -> (id, parent fp, label, depth)
    seen: dict[int, tuple[int, int | None, Label | None, int]] = {init_fp: (0, None, None, 0)}
    queue: deque[tuple[State, int]] = deque([(init, init_fp)])
    dst = array("q")  # edge targets, grouped by source id (sources are expanded in id order)
    offsets = array("q", [0])
    violated: set[str] = set()

    def trace_to(fp: int) -> list[Label]:
        labels: list[Label] = []
        cur: int | None = fp
        while cur is not None:
            _, parent, label, _ = seen[cur]
            if label is not None:
                labels.append(label)
            cur = parent
        return labels[::-1]

    def record(name: str, fp: int, last: Label | None, detail: str = "") -> None:
        if name in violated:
            return
        violated.add(name)
        trace = trace_to(fp) + ([last] if last is not None else [])
        res.violations.append({"name": name, "trace": [_label_json(x) for x in trace], "detail": detail})

    stopped = False
    while queue and not stopped:
        state, fp = queue.popleft()
        depth = seen[fp][3]
        n_succ = 0
        for label, nxt, notes in model.successors(state):
            n_succ += 1
            res.edges += 1
            nfp = hash(nxt)
            entry = seen.get(nfp)
            if entry is None:
                entry = (len(seen), fp, label, depth + 1)
                seen[nfp] = entry
                queue.append((nxt, nfp))
                if depth + 1 > res.max_depth:
                    res.max_depth = depth + 1
            if cycles:
                dst.append(entry[0])
            for note in notes:
                if note[0] == "!":
                    record(note[1:], fp, label)
                else:
                    res.witnessed[note[1:]] = True
            if res.violations and stop_at_first:
                stopped = True
                break
        if cycles:
            offsets.append(len(dst))
        if n_succ == 0:
            stuck = stuck_rooms(model, state)
            if stuck:
                record("no_stuck_room", fp, None, "; ".join(stuck))
                stopped = stop_at_first
        if progress is not None and len(seen) % 20000 < n_succ + 1:
            progress(len(seen), res.edges, depth)
        if max_states is not None and len(seen) >= max_states:
            break
    res.complete = not queue and not stopped
    res.distinct_states = len(seen)
    if res.complete:
        if cycles:
            cycle_at = _find_cycle(offsets, dst)
            if cycle_at is not None:
                fp_by_id = {v[0]: k for k, v in seen.items()}
                record("no_progress_cycle", fp_by_id[cycle_at], None, "a state on a cycle")
        for name, hit in res.witnessed.items():
            if not hit:
                res.violations.append({"name": f"sometimes.{name}", "trace": [], "detail": "never witnessed"})
    res.seconds = time.perf_counter() - t0
    res.step_cache_entries = len(model._cache)
    res.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def _find_cycle(offsets: array[int], dst: array[int]) -> int | None:
    """Kahn's topological sort over the recorded edges; returns a node left on a cycle, or None."""
    n = len(offsets) - 1
    indeg = array("i", bytes(4 * n))
    for v in dst:
        indeg[v] += 1
    ready = [v for v in range(n) if indeg[v] == 0]
    removed = 0
    while ready:
        u = ready.pop()
        removed += 1
        for k in range(offsets[u], offsets[u + 1]):
            v = dst[k]
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    if removed == n:
        return None
    return next(v for v in range(n) if indeg[v] > 0)


def _label_json(label: Label) -> list[Any]:
    out: list[Any] = []
    for x in label:
        out.append(_jsonable(x))
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, tuple):
        return [_jsonable(v) for v in x]
    return x


def print_progress(states: int, edges: int, depth: int) -> None:
    print(f"\r  {states:>10,} states  {edges:>12,} edges  depth {depth}", end="", file=sys.stderr, flush=True)


def components(cfg: CheckConfig) -> list[tuple[CheckConfig, int]]:
    """Independent components of ``cfg`` and how many copies of each it contains.

    Rooms share nothing, and rank groups that never exchange a message (connected components of
    the prefill/decode mapping) share nothing either, except the global fault budgets and a node
    crash, which hits every room on the node. Exploring one representative per class, with the
    *whole* fault budget, over-approximates what each copy can do inside the product (it may see
    every fault the product could give it, at any time), so every per-room property that holds
    there holds in the product. ``--reduction none`` explores the product itself.
    """
    edges: dict[int, set[int]] = {}
    for d in range(cfg.decode_ranks):
        for p in sources_of(cfg, d):
            edges.setdefault(d, set()).add(p)
    groups: dict[tuple[int, int], int] = {}
    seen_p: set[int] = set()
    seen_d: set[int] = set()
    for d in range(cfg.decode_ranks):
        if d in seen_d:
            continue
        ds, ps = {d}, set(edges[d])
        changed = True
        while changed:
            changed = False
            for d2 in range(cfg.decode_ranks):
                if d2 not in ds and edges[d2] & ps:
                    ds.add(d2)
                    ps |= edges[d2]
                    changed = True
        seen_d |= ds
        seen_p |= ps
        key = (len(ps), len(ds))
        groups[key] = groups.get(key, 0) + 1
    out = []
    for (p, d), n in sorted(groups.items()):
        sub = CheckConfig(
            prefill_ranks=p, decode_ranks=d, rooms=1, chunks=cfg.chunks, loss=cfg.loss, dup=cfg.dup,
            crash=cfg.crash, aborts=cfg.aborts, ordered=cfg.ordered, order=cfg.order, mutant=cfg.mutant,
        )  # fmt: skip
        out.append((sub, n * cfg.rooms))
    return out


def explore_reduced(cfg: CheckConfig, **kwargs: Any) -> tuple[CheckResult, list[tuple[CheckConfig, int, CheckResult]]]:
    """Explore each independent component class once (see ``components``); merge the results."""
    parts = []
    total = CheckResult(cfg, witnessed={})
    total.complete = True
    for sub, copies in components(cfg):
        r = explore(sub, **kwargs)
        parts.append((sub, copies, r))
        total.distinct_states += r.distinct_states
        total.edges += r.edges
        total.max_depth = max(total.max_depth, r.max_depth)
        total.seconds += r.seconds
        total.complete &= r.complete
        total.peak_rss_bytes = max(total.peak_rss_bytes, r.peak_rss_bytes)
        total.step_cache_entries += r.step_cache_entries
        for v in r.violations:
            total.violations.append(
                {**v, "component": {"prefill_ranks": sub.prefill_ranks, "decode_ranks": sub.decode_ranks, "rooms": 1}}
            )
        for k, hit in r.witnessed.items():
            total.witnessed[k] = total.witnessed.get(k, False) or hit
        if r.violations and kwargs.get("stop_at_first", True):
            total.complete = False
            break
    return total, parts
