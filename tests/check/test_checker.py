"""kvfsm check: the model checker explores the protocol the runtime runs, finds every mutant."""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from dataclasses import replace
from pathlib import Path

import pytest

from kvfsm.check import CheckConfig, Model, explore
from kvfsm.check.cli import PRESETS, mermaid
from kvfsm.check.explore import _jsonable, components, explore_reduced
from kvfsm.check.mapping import model_mapping
from kvfsm.check.mutants import MUTANTS
from kvfsm.check.properties import PREDICATES, load_properties


def test_every_property_in_the_spec_has_a_predicate_and_back() -> None:
    props = load_properties()
    names = {n for group in props.values() for n in group}
    assert names == set(PREDICATES)
    assert set(props["sometimes"]) == {"room_succeeds", "room_fails_by_timeout", "scenario_1", "scenario_2"}


# Stateright style: any change of semantics changes these numbers. Update them deliberately.
PINNED = [
    (CheckConfig(1, 1, 1, 1), 1487, 3717, 19),
    (CheckConfig(1, 1, 1, 2), 6946, 22388, 23),
    (CheckConfig(1, 1, 1, 1, loss=1), 4151, 11773, 19),
    (CheckConfig(1, 1, 1, 1, dup=1), 7865, 24110, 21),
    (CheckConfig(1, 1, 1, 1, crash=1), 3738, 9478, 19),
    (CheckConfig(1, 1, 1, 1, aborts=1), 4853, 14197, 20),
    (CheckConfig(1, 1, 1, 1, dup=1, ordered=False), 9647, 32145, 21),
]


@pytest.mark.parametrize(("cfg", "states", "edges", "depth"), PINNED)
def test_pinned_state_counts_and_every_property_holds(cfg: CheckConfig, states: int, edges: int, depth: int) -> None:
    r = explore(cfg, symmetry=False)
    assert r.complete and r.violations == []
    assert (r.distinct_states, r.edges, r.max_depth) == (states, edges, depth)


def test_effect_tables_do_not_change_the_explored_graph() -> None:
    # memo=False recomputes every effect and network delta from the readable model code
    cfg, states, edges, depth = PINNED[-1]
    r = explore(cfg, memo=False, symmetry=False)
    assert (r.distinct_states, r.edges, r.max_depth) == (states, edges, depth)


# Symmetry reduction: (config, states and edges without, with, depth, first violation and its trace length).
SYMMETRIC = [
    (replace(MUTANTS["completion_per_pp_rank"].config, mutant="completion_per_pp_rank"),
     (29488, 92311), (15100, 47481), 14, ("no_false_success", 14)),
    (CheckConfig(1, 1, 2, 1, order="prefill-first"), (216, 460), (133, 294), 7, ("no_stuck_room", 6)),
    (CheckConfig(1, 1, 2, 1, aborts=1, mutant="decode_abort_untold"), (18, 22), (11, 16), 2, ("failure_is_told", 2)),
]  # fmt: skip


@pytest.mark.parametrize(("cfg", "plain", "reduced", "depth", "first"), SYMMETRIC)
def test_symmetry_reduction_keeps_verdicts_and_shortest_traces(
    cfg: CheckConfig, plain: tuple[int, int], reduced: tuple[int, int], depth: int, first: tuple[str, int]
) -> None:
    model = Model(cfg)
    assert model.symmetries()  # rooms or rank groups are interchangeable here
    runs = {sym: explore(cfg, symmetry=sym) for sym in (False, True)}
    for sym, r in runs.items():
        assert r.symmetries == (2 if sym else 1)
        assert (r.distinct_states, r.edges) == (reduced if sym else plain)
        assert r.max_depth == depth
        v = r.violations[0]
        assert (v["name"], len(v["trace"])) == first
        # the trace is concrete: every step is enabled in the unreduced model
        state = model.initial()
        for label in v["trace"]:
            state = next(nxt for lab, nxt, _ in model.successors(state) if _jsonable(lab) == label)
    assert runs[True].witnessed == runs[False].witnessed


def test_rank_symmetry_needs_at_most_one_crash() -> None:
    assert len(Model(CheckConfig(2, 1, 1, 1, crash=1)).symmetries()) == 1
    assert Model(CheckConfig(2, 1, 1, 1, crash=2)).symmetries() == []
    assert len(Model(CheckConfig(2, 2, 2, 1, crash=1)).symmetries()) == 3  # rooms x the two P-D pairs


def test_smoke_preset_explores_everything_and_witnesses_every_sometimes() -> None:
    r = explore(PRESETS["smoke"])
    assert r.complete and r.ok, r.violations
    assert all(r.witnessed.values()), r.witnessed  # the model is not vacuous


# Shortest counterexample lengths (BFS); a change means the protocol or the model changed.
TRACE_LENGTH = {
    "failed_revived_by_success": 8,
    "abort_flips_success": 10,
    "completion_per_pp_rank": 14,
    "success_before_aux": 7,
    "no_bootstrap_timeout": 6,
    "prefill_failure_untold": 6,
    "decode_abort_untold": 2,
    "late_message_resurrects": 12,
    "pages_released_before_drain": 8,
    "drained_before_writes_done": 10,
    "source_released_in_flight": 8,
    "early_expiry_forgotten": 12,
    # mapping mutants (kvfsm.check.mapping.MAPPING_MUTANTS) on 2 P -> 1 D with MLA
    "replicated_heads_written_twice": 10,
    "mla_decode_waits_for_every_rank": 10,
    # plan mutants (kvfsm.check.plans.PLAN_MUTANTS): 2 P -> 4 D, and 1 P -> 1 D with two chunks
    "head_offset_from_global_rank": 9,
    "multi_chunk_overwrite": 7,
}


def test_the_mutant_catalogue_has_at_least_ten_bug_classes() -> None:
    assert len(MUTANTS) >= 10 and set(TRACE_LENGTH) == set(MUTANTS)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_checker_finds_every_mutant_with_its_shortest_trace(name: str) -> None:
    m = MUTANTS[name]
    r = explore(replace(m.config, mutant=name))
    found = {v["name"]: v for v in r.violations}
    assert m.expect in found, f"{name}: expected {m.expect}, found {list(found)}"
    assert len(found[m.expect]["trace"]) == TRACE_LENGTH[name]
    assert r.seconds < 10


def test_the_correct_protocol_passes_each_mutant_configuration() -> None:
    # Every mutant is found within its first 30k states; the correct protocol must show no
    # violation in (at least) the same breadth-first prefix of the same configuration.
    for m in MUTANTS.values():
        r = explore(m.config, max_states=60_000, cycles=False)
        assert r.ok, (m.name, r.violations[:1])


def test_independent_rooms_and_rank_pairs_reduce_to_one_component() -> None:
    assert [(c.prefill_ranks, c.decode_ranks, c.rooms, n) for c, n in components(PRESETS["standard"])] == [(1, 1, 1, 4)]
    assert [(c.prefill_ranks, c.decode_ranks, n) for c, n in components(CheckConfig(4, 2, 3, 1))] == [(2, 1, 6)]
    assert [(c.prefill_ranks, c.decode_ranks, n) for c, n in components(CheckConfig(1, 2, 1, 1))] == [(1, 2, 1)]


def _sglang_sources(p: int, d: int, rank: int) -> tuple[int, ...]:
    """The equal/fan formula the model used before the rank mapping (sglang.md §3.1)."""
    if p >= d:
        return tuple(q for q in range(p) if q % d == rank)
    return (rank % p,)


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_the_rank_mapping_gives_the_existing_configurations_their_former_sources(p: int, d: int) -> None:
    # every pinned configuration and preset component is one of these shapes: same sources, same counts
    model = Model(CheckConfig(p, d, 1, 1))
    assert model.sources == [_sglang_sources(p, d, rank) for rank in range(d)]
    assert model.dests == [tuple(r for r in range(d) if q in model.sources[r]) for q in range(p)]
    assert model.required == [len(model.dests[model.sources[r][0]]) for r in range(d)]


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("d", [1, 2, 4, 8])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_every_head_a_decode_rank_holds_has_exactly_one_writer_and_decode_waits_for_exactly_its_writers(
    p: int, d: int, heads: int, mla: bool
) -> None:
    m = model_mapping(p, d, heads, mla)
    for rank in range(d):
        assert m.covers(rank) and all(len(c) == 1 for c in m.covers(rank))
        assert m.expected[rank] == m.senders_of(rank)
    # the replicated-heads mutant writes some head twice exactly where prefill replicates heads
    twice = model_mapping(p, d, heads, mla, "replicated_heads_written_twice")
    effective = 1 if mla else heads
    assert any(len(c) > 1 for r in range(d) for c in twice.covers(r)) == (p > effective)
    # the MLA mutant waits for a rank that will not send exactly where MLA has Tp > Td
    waits = model_mapping(p, d, heads, mla, "mla_decode_waits_for_every_rank")
    silent = any(set(waits.expected[r]) - set(waits.senders_of(r)) for r in range(d))
    assert silent == (mla and p > d)


def test_a_prefill_rank_that_writes_nobody_takes_no_part() -> None:
    # MLA 2 P -> 1 D: P0 sends the latent, P1 creates no room, and nobody waits for it
    model = Model(CheckConfig(2, 1, 1, 1, mla=True))
    assert model.sources == [(0,)] and model.dests == [(0,), ()]
    r = explore(CheckConfig(2, 1, 1, 1, mla=True), symmetry=False)
    assert r.ok and r.complete
    assert r.distinct_states == explore(CheckConfig(1, 1, 1, 1), symmetry=False).distinct_states
    assert [(c.prefill_ranks, c.decode_ranks, n) for c, n in components(PRESETS["2p1d-mla"])] == [(1, 1, 2)]
    assert [(c.prefill_ranks, c.decode_ranks, n) for c, n in components(PRESETS["4p2d-replicated"])] == [(1, 1, 4)]


def test_tp_mapping_presets_reduce_to_their_rank_groups() -> None:
    shapes = {name: [(c.prefill_ranks, c.decode_ranks, n) for c, n in components(PRESETS[name])]
              for name in ("2p1d", "1p2d", "2p4d", "1p2d-mla")}  # fmt: skip
    assert shapes == {"2p1d": [(2, 1, 1)], "1p2d": [(1, 2, 1)], "2p4d": [(1, 2, 2)], "1p2d-mla": [(1, 2, 1)]}
    # a mapping mutant keeps its shape in the component: both holders of the replicated head write it
    ((sub, n),) = components(replace(PRESETS["4p2d-replicated"], mutant="replicated_heads_written_twice"))
    assert (sub.prefill_ranks, sub.decode_ranks, n) == (2, 1, 4)
    assert [len(c) for c in sub.mapping().covers(0)] == [2]


@pytest.mark.parametrize(("preset", "states"), [("2p1d-mla", 558219), ("4p2d-replicated", 558219)])
def test_replicated_head_presets_pass_every_property(preset: str, states: int) -> None:
    r = explore_reduced(PRESETS[preset])[0]
    assert r.complete and r.ok, r.violations
    assert r.distinct_states == states
    assert all(r.witnessed.values()), r.witnessed


# (mutant, preset, shortest trace on the preset)
ON_PRESETS = [
    ("replicated_heads_written_twice", "2p1d-mla", 10),
    ("replicated_heads_written_twice", "4p2d-replicated", 10),
    ("mla_decode_waits_for_every_rank", "2p1d-mla", 13),
]


@pytest.mark.parametrize(("name", "preset", "length"), ON_PRESETS)
def test_mapping_mutants_are_found_on_the_tp_mapping_presets(name: str, preset: str, length: int) -> None:
    r, _ = explore_reduced(replace(PRESETS[preset], mutant=name))
    v = r.violations[0]
    assert (v["name"], len(v["trace"])) == (MUTANTS[name].expect, length)


def test_a_violation_found_in_the_component_is_also_found_in_the_product() -> None:
    cfg = CheckConfig(1, 1, 2, 1, mutant="decode_abort_untold", aborts=1)
    reduced, _ = explore_reduced(cfg)
    product = explore(cfg)
    assert {v["name"] for v in reduced.violations} == {v["name"] for v in product.violations} == {"failure_is_told"}


def test_mermaid_trace_names_every_rank_and_step() -> None:
    r = explore(replace(MUTANTS["pages_released_before_drain"].config, mutant="pages_released_before_drain"))
    text = mermaid(r.violations[0]["trace"], r.config)
    assert text.startswith("sequenceDiagram") and "participant P0" in text and "participant D0" in text
    assert "8. write aux of room 0 lands" in text


def _kvfsm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfsm.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_reports_a_mutant_with_exit_status_1_json_and_a_jsonl_trace(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    p = _kvfsm("check", "--mutant", "success_before_aux", "--json", "--trace-out", str(out))
    assert p.returncode == 1, p.stderr
    res = json.loads(p.stdout)
    assert {"distinct_states", "edges", "max_depth", "seconds", "states_per_second", "violations"} <= set(res)
    assert res["violations"][0]["name"] == "no_false_success"
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["violation"] == "no_false_success" and lines[0]["config"]["mutant"] == "success_before_aux"
    assert [x["step"] for x in lines[1:]] == list(range(1, 8))


def test_cli_smoke_preset_passes_and_lists_mutants() -> None:
    p = _kvfsm("check", "--preset", "smoke")
    assert p.returncode == 0 and "every property holds" in p.stdout, p.stdout + p.stderr
    p = _kvfsm("check", "--rooms", "2", "--order", "prefill-first", "--reduction", "none", "--no-symmetry", "--json")
    assert json.loads(p.stdout)["distinct_states"] == 216 and json.loads(p.stdout)["symmetry"] is False
    p = _kvfsm("check", "--list-mutants")
    assert p.returncode == 0 and all(name in p.stdout for name in MUTANTS)


def _csr(n: int, edges: list[tuple[int, int]]) -> tuple[array[int], array[int]]:
    offsets, dst = array("q", [0]), array("q")
    for u in range(n):
        dst.extend(v for a, v in edges if a == u)
        offsets.append(len(dst))
    return offsets, dst


@pytest.mark.parametrize(
    ("n", "edges", "on_cycle"),
    [
        (5, [(0, 1), (1, 2), (0, 2), (2, 3), (3, 4)], None),  # a DAG with a diamond
        (4, [(0, 1), (1, 2), (2, 1), (2, 3)], {1, 2, 3}),  # 1 <-> 2, and 3 hangs off the cycle
        (3, [(0, 0), (1, 2)], {0}),  # a self-loop
        (1, [], None),
    ],
)
def test_cycle_check_finds_exactly_the_cyclic_graphs(
    n: int, edges: list[tuple[int, int]], on_cycle: set[int] | None
) -> None:
    from kvfsm.check.explore import _find_cycle

    found = _find_cycle(*_csr(n, edges))
    assert (found is None) == (on_cycle is None)
    if on_cycle is not None:
        assert found in on_cycle
