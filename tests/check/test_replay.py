"""kvfsm replay: checker traces drive the real runtime over loopback to the same states."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.check import CheckConfig, explore
from kvfsm.check.explore import _jsonable
from kvfsm.check.model import Model
from kvfsm.check.mutants import MUTANTS
from kvfsm.check.plans import PLAN_MUTANTS
from kvfsm.check.replay import Replayer, replay
from kvfsm.protocol.routing import ROUTING, ROUTING_MUTANTS

# Mutants of the routing that the model and the runtime share (kvfsm.protocol.routing): replay
# hands the model's Routing to the runtime; with the correct routing their traces do not reproduce.
ROUTED = sorted(ROUTING_MUTANTS)
# Plan mutants (kvfsm.check.plans) change the bytes a write moves, which the runtime does not plan
# yet: the checker finds them (tests/check/test_plans.py), replay has nothing to run.
REPLAYED = sorted(set(MUTANTS) - set(PLAN_MUTANTS))


def _write_trace(path: Path, cfg: CheckConfig, labels: list[list[object]], violation: str = "") -> Path:
    with path.open("w") as f:
        f.write(json.dumps({"config": asdict(cfg), "violation": violation}) + "\n")
        for i, label in enumerate(labels, 1):
            f.write(json.dumps({"step": i, "label": label}) + "\n")
    return path


@pytest.mark.parametrize("name", REPLAYED)
def test_every_mutant_trace_reproduces_on_the_runtime(name: str, tmp_path: Path) -> None:
    """The runtime follows every mutant's trace state for state and shows the violation where it
    is observable there. A mapping mutant reaches the runtime through the engine calls (decode is
    told the mutant's sources); ``replicated_heads_written_twice`` breaks ``head_written_once``,
    which the runtime cannot see (its writes are pages, not heads): only the checker sees it.
    Plan mutants are left out (``REPLAYED``): the runtime does not execute plans yet."""
    m = MUTANTS[name]
    cfg = replace(m.config, mutant=name)
    r = explore(cfg)
    v = next(v for v in r.violations if v["name"] == m.expect)
    res = replay(_write_trace(tmp_path / "t.jsonl", cfg, v["trace"], m.expect))
    assert res.divergences == [] and res.steps == len(v["trace"])
    assert res.reproduced, res.observed


@pytest.mark.parametrize("name", ROUTED)
def test_a_routing_mutant_found_by_the_checker_reproduces_on_the_runtime_through_the_shared_routing(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = MUTANTS[name]
    cfg = replace(m.config, mutant=name)
    # the checker finds it, and the runtime that replays its trace runs the very same Routing value
    # through the same functions (kvfsm.protocol.routing): no switch of the runtime's own
    v = next(v for v in explore(cfg).violations if v["name"] == m.expect)
    r = Replayer(cfg)
    assert r.model.routing is ROUTING_MUTANTS[name]
    assert all(mgr.routing is r.model.routing for mgr in r.c.managers)
    r.c.close()
    res = replay(_write_trace(tmp_path / "t.jsonl", cfg, v["trace"], m.expect))
    assert res.divergences == [] and res.steps == len(v["trace"])
    assert m.expect in res.observed  # the violation itself is seen on the runtime
    # the mutant is the routing variant: the same model with the correct routing does not break
    monkeypatch.setattr("kvfsm.check.model.routing_for", lambda mutant: ROUTING)
    assert m.expect not in {v["name"] for v in explore(cfg, stop_at_first=False).violations}


@pytest.mark.parametrize("name", ROUTED)
def test_the_correct_routing_stops_the_routing_mutants(name: str, tmp_path: Path) -> None:
    m = MUTANTS[name]
    cfg = replace(m.config, mutant=name)
    v = next(v for v in explore(cfg).violations if v["name"] == m.expect)
    res = replay(_write_trace(tmp_path / "t.jsonl", cfg, v["trace"], m.expect), routing_bugs=False)
    assert not res.reproduced
    assert res.divergences  # the runtime left the model's path where its fix applies


def _random_walk(cfg: CheckConfig, seed: int, steps: int) -> list[list[object]]:
    rng = random.Random(seed)
    model = Model(cfg)
    state = model.initial()
    labels = []
    for _ in range(steps):
        succ = list(model.successors(state))
        if not succ:
            break
        label, state, _ = succ[rng.randrange(len(succ))]
        labels.append(_jsonable(label))
    return labels


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    cfg=st.sampled_from([
        CheckConfig(1, 1, 1, 2, loss=1, dup=1, crash=1, aborts=1),
        CheckConfig(1, 1, 2, 1, loss=1, dup=1, aborts=1, ordered=False),
        CheckConfig(2, 1, 1, 1, dup=1, crash=1, aborts=1),
        CheckConfig(1, 2, 1, 2, loss=1, aborts=1),
        CheckConfig(2, 1, 1, 1, crash=1, aborts=1, mla=True),  # P1 writes nobody and takes no part
    ]),
)  # fmt: skip
def test_random_model_runs_replay_on_the_runtime_state_for_state(
    seed: int, cfg: CheckConfig, tmp_path_factory: pytest.TempPathFactory
) -> None:
    labels = _random_walk(cfg, seed, 60)
    path = _write_trace(tmp_path_factory.mktemp("walk") / "t.jsonl", cfg, labels)
    res = replay(path)
    assert res.divergences == [], res.divergences[:3]
    assert res.steps == len(labels)
    assert res.observed == []  # the correct protocol shows no violation on the runtime either
