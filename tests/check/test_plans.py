"""always.write_plan_exact: each landed KV write's plan (kvfsm.layout) passes verify_plan.

The plan mutants (``kvfsm.check.plans.PLAN_MUTANTS``) are plan-level: they change the bytes a
write moves, and the runtime does not execute plans yet, so their traces have nothing to replay
on it (replay is not applicable); the checker finds them through ``write_plan_exact``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfsm.check import CheckConfig, Model, explore
from kvfsm.check.cli import PRESETS
from kvfsm.check.explore import components, explore_reduced
from kvfsm.check.mutants import MUTANTS
from kvfsm.check.plans import PLAN_MUTANTS, RANK_SENSITIVE
from kvfsm.layout import RankMap, heads_of


def _inexact(cfg: CheckConfig) -> set[tuple[int, int, int]]:
    """(source, destination, chunk) of every pair that moves heads and whose plan fails verify_plan."""
    model = Model(cfg)
    pairs = RankMap(cfg.heads, cfg.prefill_ranks, cfg.decode_ranks, cfg.mla).pairs()
    return {
        (p, d, c)
        for room in range(cfg.rooms)
        for p, d in pairs
        for c in range(cfg.chunks)
        if not model.plans.exact(p, d, c, model.pages(room))
    }


@pytest.mark.parametrize(("p", "d", "heads", "mla"), [(1, 1, 0, False), (2, 1, 0, False), (1, 2, 0, False),
                                                      (2, 4, 0, False), (4, 2, 2, False), (4, 2, 0, False),
                                                      (2, 1, 0, True), (1, 2, 0, True)])  # fmt: skip
def test_plans_are_exact_unless_a_plan_mutant_plans_them(p: int, d: int, heads: int, mla: bool) -> None:
    cfg = CheckConfig(p, d, 2, 3, kv_heads=heads, mla=mla)
    assert _inexact(cfg) == set()
    # the chunk's own length as its offset is right for the first chunk and for a second one of
    # the same length only: chunk 1 (two tokens) and the short last chunk 2 land elsewhere
    overwrite = _inexact(replace(cfg, mutant="multi_chunk_overwrite"))
    assert overwrite == {(s, t, 2) for s, t in RankMap(cfg.heads, p, d, mla).pairs()}
    # the global rank as head offset is wrong exactly where it differs from the heads' place on decode
    mapping = RankMap(cfg.heads, p, d, mla)
    wrong = set()
    for s, t in mapping.pairs():
        moved = mapping.heads(s, t)
        dst_heads = heads_of(1 if mla else cfg.heads, d, t)
        if s * len(moved) != moved.start - dst_heads.start:
            wrong |= {(s, t, c) for c in range(cfg.chunks)}
    assert _inexact(replace(cfg, mutant="head_offset_from_global_rank")) == wrong
    assert bool(wrong) == ((p, d, heads) in {(2, 4, 0), (4, 2, 2), (4, 2, 0)})


def test_the_plan_mutants_are_the_layout_mutants() -> None:
    from kvfsm.layout import MUTANTS as LAYOUT_MUTANTS

    assert sorted(PLAN_MUTANTS.values()) == sorted(LAYOUT_MUTANTS)
    assert set(PLAN_MUTANTS) <= set(MUTANTS) and all(MUTANTS[n].expect == "write_plan_exact" for n in PLAN_MUTANTS)
    # rank-sensitive: no renumbered components and no rank renamings (room renamings stay)
    cfg = replace(PRESETS["2p4d"], rooms=2, mutant="head_offset_from_global_rank")
    assert [(c.prefill_ranks, c.decode_ranks, n) for c, n in components(cfg)] == [(2, 4, 2)]
    assert len(Model(cfg).symmetries()) == 1 and "head_offset_from_global_rank" in RANK_SENSITIVE


# (mutant, preset, shortest trace on the preset). The fan-out case of the head offset (P1 -> D2,
# D3) is the mutant's own configuration, 2P x 4D with one room and one chunk (test_checker's
# shortest-trace test, 9 steps); on the whole 2p4d preset, which this mutant keeps from being split
# into components, the same 9-step trace takes over a minute to confirm against the correct planner.
ON_PRESETS = [
    ("head_offset_from_global_rank", "4p2d-replicated", 6),  # fan-in with replicated heads: P3 -> D1
    ("multi_chunk_overwrite", "standard", 7),
]


@pytest.mark.parametrize(("name", "preset", "length"), ON_PRESETS)
def test_plan_mutants_are_found_on_their_presets_and_the_correct_planner_passes_them(
    name: str, preset: str, length: int
) -> None:
    cfg = replace(PRESETS[preset], mutant=name)
    r, parts = explore_reduced(cfg)
    v = r.violations[0]
    assert (v["name"], len(v["trace"])) == ("write_plan_exact", length)
    # the correct planner, in the same configuration the mutant was explored in, over at least
    # the same breadth-first prefix: no violation
    ((sub, _, found),) = parts[-1:]
    ok = explore(replace(sub, mutant=None), max_states=2 * found.distinct_states, cycles=False)
    assert ok.ok, ok.violations[:1]
    assert ok.distinct_states > found.distinct_states or ok.complete
