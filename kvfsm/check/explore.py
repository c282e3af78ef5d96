"""Breadth-first exploration of the model: shortest counterexamples, statistics, liveness.

States are deduplicated by their 64-bit hash (a fingerprint; a collision could hide a state, the
usual trade of explicit-state checkers). For each new state the explorer keeps only its parent's
id (8 bytes); a trace is rebuilt on demand by replaying the model along the fingerprints of the
path (``_trace``), which also turns a path through symmetry-reduced representatives into a
concrete trace. Edges are recorded as integer ids in discovery order (compressed sparse rows for free),
and a topological sort over them proves the graph acyclic (liveness.no_progress_cycle). Only
edges that spend no fault budget and land no write are recorded: budgets only shrink and the
landed set only grows along every path, so no other edge can close a cycle.
"""

from __future__ import annotations

import resource
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvfsm.check.model import CheckConfig, Label, Model, State
from kvfsm.check.plans import RANK_SENSITIVE
from kvfsm.check.properties import load_properties, stuck_rooms
from kvfsm.layout.mapping import MappingError


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
    symmetries: int = 1  # size of the symmetry group the exploration was reduced by (1: none)

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
            "symmetries": self.symmetries,
            "ok": self.ok,
        }


def explore(
    cfg: CheckConfig,
    *,
    max_states: int | None = None,
    stop_at_first: bool = True,
    cycles: bool = True,
    progress: Callable[[int, int, int], None] | None = None,
    symmetry: bool = True,
    memo: bool = True,
) -> CheckResult:
    """Explore every state reachable from the initial one (or ``max_states`` of them).

    ``symmetry``: store one representative per orbit of the model's symmetries (interchangeable
    rooms and rank groups, ``Model.symmetries``); ``memo=False``: recompute every effect (baseline).
    """
    props = load_properties()
    model = Model(cfg, memo=memo)
    res = CheckResult(cfg, witnessed={name: False for name in props["sometimes"]})
    t0 = time.perf_counter()
    canon = model.canonical if symmetry and model.symmetries() else None
    res.symmetries = 1 + len(model.symmetries()) if canon else 1
    init = model.initial()
    if canon is not None:
        init = canon(init)
    seen: dict[int, int] = {hash(init): 0}  # fingerprint -> state id (ids in discovery order)
    parent = array("q", [-1])  # state id -> parent id: enough to rebuild the shortest trace
    queue: deque[State] = deque([init])
    dst = array("q")  # edge targets, grouped by source id (sources are expanded in id order)
    offsets = array("q", [0])
    found: list[tuple[str, int, bool, str]] = []  # (property, state id, on an edge from it, detail)
    violated: set[str] = set()
    expand = model.expand
    witnessed = res.witnessed
    seen_setdefault, add_parent, enqueue, add_edge = seen.setdefault, parent.append, queue.append, dst.append
    expanded, level_end, depth, edges, nseen = 0, 1, 0, 0, 1
    stopped = False
    while queue and not stopped:
        state = queue.popleft()
        sid = expanded
        expanded += 1
        if sid == level_end:  # breadth first: ids of one depth are contiguous
            depth += 1
            level_end = nseen
        succs, noted = expand(state)
        edges += len(succs)
        before = nseen
        budget, landed = state[1], state[2]
        if canon is not None:
            succs = [canon(nxt) for nxt in succs]
        if noted:
            for i, notes in noted:
                for note in notes:
                    if note[0] == "~":
                        witnessed[note[1:]] = True
                    elif note[1:] not in violated:
                        violated.add(note[1:])
                        found.append((note[1:], sid, True, ""))
                if found and stop_at_first:
                    stopped = True
                    succs = succs[: i + 1]  # as if exploring stopped right after that edge
                    break
        for nxt in succs:
            target = seen_setdefault(hash(nxt), nseen)
            if target == nseen:  # a new state
                nseen += 1
                add_parent(sid)
                enqueue(nxt)
            # budgets never grow and landed writes never unland (the landed set only gains bits,
            # so an equal mask means nothing landed): only an edge that keeps both can lie on a
            # cycle, so only those are kept for the cycle check
            if cycles and nxt[1] == budget and nxt[2] == landed:
                add_edge(target)
        if nseen > before and depth + 1 > res.max_depth:
            res.max_depth = depth + 1
        if cycles:
            offsets.append(len(dst))
        if not succs:
            stuck = stuck_rooms(model, state)
            if stuck and "no_stuck_room" not in violated:
                violated.add("no_stuck_room")
                found.append(("no_stuck_room", sid, False, "; ".join(stuck)))
                stopped = stop_at_first
        if progress is not None and nseen % 20000 < len(succs) + 1:
            progress(nseen, edges, depth)
        if max_states is not None and nseen >= max_states:
            break
    res.complete = not queue and not stopped
    res.distinct_states = len(seen)
    res.edges = edges
    if res.complete and cycles:
        cycle_at = _find_cycle(offsets, dst)
        if cycle_at is not None:
            found.append(("no_progress_cycle", cycle_at, False, "a state on a cycle"))
    if found:
        fp_of = {sid: fp for fp, sid in seen.items()}
        for name, sid, on_edge, detail in found:
            trace = _trace(model, canon, parent, fp_of, sid, f"!{name}" if on_edge else None)
            res.violations.append({"name": name, "trace": trace, "detail": detail})
    if res.complete:
        for name, hit in res.witnessed.items():
            if not hit:
                res.violations.append({"name": f"sometimes.{name}", "trace": [], "detail": "never witnessed"})
    res.seconds = time.perf_counter() - t0
    res.step_cache_entries = len(model._cache)
    res.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def _trace(
    model: Model, canon: Callable[[State], State] | None, parent: array[int], fp_of: dict[int, int], sid: int,
    note: str | None,
) -> list[list[Any]]:  # fmt: skip
    """The shortest trace to state ``sid`` (then the first edge from it with ``note``), rebuilt by
    replaying the model from the initial state: at each step, the first successor whose
    (canonical) fingerprint is the next one on the path. With symmetry reduction the stored
    states are orbit representatives; the replay yields a concrete trace through the orbits."""
    path: list[int] = []
    cur = sid
    while cur > 0:
        path.append(fp_of[cur])
        cur = parent[cur]
    state = model.initial()
    labels: list[Label] = []
    for fp in reversed(path):
        for label, nxt, _ in model.successors(state):
            if hash(canon(nxt) if canon is not None else nxt) == fp:
                labels.append(label)
                state = nxt
                break
    if note is not None:
        labels.append(next(label for label, _, notes in model.successors(state) if note in notes))
    return [_label_json(x) for x in labels]


def _find_cycle(offsets: array[int], dst: array[int]) -> int | None:
    """Kahn's topological sort over the recorded edges (CSR: node u's targets are
    ``dst[offsets[u]:offsets[u + 1]]``), peeling every node of in-degree 0 at once per round with
    numpy; returns a node left on a cycle, or None."""
    n = len(offsets) - 1
    if n <= 0:
        return None
    off = np.frombuffer(offsets, dtype=np.int64)
    targets = np.frombuffer(dst, dtype=np.int64)
    indeg = np.bincount(targets, minlength=n)
    frontier = np.flatnonzero(indeg == 0)
    removed = 0
    while frontier.size:
        removed += frontier.size
        starts, counts = off[frontier], off[frontier + 1] - off[frontier]
        total = int(counts.sum())
        if not total:
            break
        # the out-edges of every frontier node, gathered without a Python loop
        shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
        hit = targets[shift + np.arange(total)]
        dec = np.bincount(hit, minlength=n)
        indeg -= dec
        frontier = np.flatnonzero((dec > 0) & (indeg == 0))
    if removed == n:
        return None
    return int(np.flatnonzero(indeg > 0)[0])


def _label_json(label: Label) -> list[Any]:
    out: list[Any] = []
    for x in label:
        out.append(_jsonable(x))
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, tuple):
        return [_jsonable(v) for v in x]
    return x


def print_outcome(
    res: CheckResult, text: Callable[[Any], str], after_trace: Callable[[list[Any]], str] | None = None
) -> None:
    """The lines every ``kvfsm check`` prints after its header: the run's figures, the
    ``sometimes`` properties seen, and each violation with its numbered trace (``text`` writes a
    step; ``after_trace``, if given, adds a block after a non-empty trace)."""
    print(f"  {res.distinct_states:,} distinct states, {res.edges:,} edges, depth {res.max_depth}, "
          f"{res.seconds:.2f} s, {res.states_per_second:,.0f} states/s, complete: {res.complete}")  # fmt: skip
    print("  sometimes: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in sorted(res.witnessed.items())))
    if not res.violations:
        print("  every property holds")
        return
    for v in res.violations:
        print(f"\nVIOLATION {v['name']}" + (f": {v['detail']}" if v.get("detail") else ""))
        for i, label in enumerate(v["trace"], 1):
            print(f"  {i:>3}. {text(label)}")
        if v["trace"] and after_trace is not None:
            print(after_trace(v["trace"]))


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

    A prefill rank that nobody waits for and that writes nobody takes no part (no component). A
    component is explored as the configuration of one room whose rank mapping has its shape
    (``ModelMapping.shape``); where none has, the whole configuration with one room is, and so it
    is under a plan mutant that depends on the ranks' global numbers (``plans.RANK_SENSITIVE``).
    """
    if cfg.mutant in RANK_SENSITIVE:
        return [(replace(cfg, rooms=1), cfg.rooms)]  # renumbered ranks would plan other head offsets
    mapping = cfg.mapping()
    edges = {d: set(mapping.peers_of("D", d)) for d in range(cfg.decode_ranks)}
    groups: dict[CheckConfig, int] = {}
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
        sub = _component_config(cfg, mapping.restrict(sorted(ps), sorted(ds)).shape())
        groups[sub] = groups.get(sub, 0) + 1
    whole = replace(cfg, rooms=1)
    if whole in groups:
        return [(whole, cfg.rooms)]  # no smaller configuration models a part of it: the ranks stay whole
    ordered = sorted(groups.items(), key=lambda kv: (kv[0].prefill_ranks, kv[0].decode_ranks))
    return [(sub, n * cfg.rooms) for sub, n in ordered]


def _component_config(cfg: CheckConfig, shape: Any) -> CheckConfig:
    """A configuration of one room whose rank mapping has ``shape`` (the same behaviour as the
    component), with ``cfg``'s chunks, faults and mutant; ``cfg`` itself (one room) if none is found."""
    p, d = shape[0], shape[1]
    for mla in (False, True):
        for heads in (0, *range(1, max(p, d, cfg.heads) + 1)):
            try:
                sub = replace(cfg, prefill_ranks=p, decode_ranks=d, rooms=1, kv_heads=heads, mla=mla)
            except MappingError:
                continue
            if sub.mapping().shape() == shape:
                return sub
    return replace(cfg, rooms=1)


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
        total.symmetries = max(total.symmetries, r.symmetries)
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
