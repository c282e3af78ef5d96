"""kvfsm check in pull mode: the explorer steps the spec's pull machines, finds every pull mutant
and an unsafe clock, and the pull properties of spec/invariants.toml have their predicates."""

from __future__ import annotations

import tomllib
from dataclasses import replace

import pytest

from kvfsm.check.mutants import _machine
from kvfsm.check.properties import PREDICATES, load_properties
from kvfsm.check.pull_explore import PULL_MUTANTS, PULL_PRESETS, describe, explore_pull
from kvfsm.check.pull_model import TIMEOUTS, PullConfig, PullModel
from kvfsm.protocol import Protocol, load_spec
from kvfsm.protocol.spec import MachineSpec, RowSpec, spec_dir


def test_every_pull_property_has_one_predicate_and_each_entry_one_mode() -> None:
    from kvfsm.check.pull_model import PULL_PREDICATES

    pull = load_properties("pull")
    assert {n for g in pull.values() for n in g} == set(PULL_PREDICATES)
    raw = tomllib.loads((spec_dir() / "invariants.toml").read_text())
    every = {n for g in ("always", "sometimes", "liveness") for n in raw[g]}
    assert every == set(PREDICATES) | set(PULL_PREDICATES)
    assert not set(PREDICATES) & set(PULL_PREDICATES)


def test_the_model_steps_the_spec_machines_with_small_consistent_timers() -> None:
    model = PullModel(PullConfig(), Protocol(timeouts=TIMEOUTS))
    assert model.prefill.spec.name == "prefill_pull" and model.decode.spec.name == "decode_pull"
    pre, dec = TIMEOUTS["prefill_pull"], TIMEOUTS["decode_pull"]
    assert dec["renew"] < pre["lease"] and dec["window"] < pre["lease"]


def test_pull_smoke_passes() -> None:
    res = explore_pull(PULL_PRESETS["pull-smoke"])
    assert res.ok and res.complete, res.violations
    assert all(res.witnessed.values()), res.witnessed  # a room succeeds, a renewal extends a lease


def test_a_decode_room_that_renews_toward_a_silent_source_was_a_leak() -> None:
    """pull-smoke's first find: in Granted only the renew timer ran, so a decode room whose
    source was cleared (claims to it dropped) and whose room_failed was lost renewed forever.
    The bootstrap timer now bounds the sources' silence there (G5, H3); without it the checker
    finds the leak again."""

    def no_bootstrap_in_granted(ms: MachineSpec) -> MachineSpec:
        def g5(r: RowSpec) -> RowSpec:  # as G5 was: the bootstrap timer cancelled, nothing bounding Granted
            return replace(r, actions=tuple("cancel:bootstrap" if a == "arm:bootstrap" else a for a in r.actions))

        rows = [g5(r) if r.id == "G5" else r for r in ms.rows]
        return replace(ms, rows=tuple(rows))

    import kvfsm.check.pull_explore as pe

    old = pe.pull_protocol
    try:
        pe.pull_protocol = lambda mutant: Protocol(  # type: ignore[assignment]
            _machine(load_spec(), "decode_pull", no_bootstrap_in_granted), timeouts=TIMEOUTS
        )
        res = explore_pull(PULL_PRESETS["pull-smoke"])
    finally:
        pe.pull_protocol = old
    assert [v["name"] for v in res.violations] == ["no_leaked_blocks"]
    assert "D0: Granted" in res.violations[0]["detail"]


@pytest.mark.parametrize("name", sorted(PULL_MUTANTS))
def test_each_pull_mutant_is_found_with_its_property(name: str) -> None:
    mutant = PULL_MUTANTS[name]
    found = explore_pull(replace(mutant.config, mutant=name))
    assert found.violations and found.violations[0]["name"] == mutant.expect
    assert all(describe(label) for label in found.violations[0]["trace"])
    # the protocol passes the mutant's own configuration
    base = explore_pull(mutant.config)
    assert base.ok and base.complete, base.violations


def test_a_prefill_clock_running_fast_is_caught() -> None:
    # prefill's lease timer firing one tick early (far beyond LEASE_SKEW) frees pages a read targets
    res = explore_pull(PullConfig(1, 1, early=1))
    assert res.violations and res.violations[0]["name"] == "no_read_of_freed_blocks"
    assert explore_pull(PullConfig(1, 1)).ok


def test_cli_runs_a_pull_mutant_and_lists_it(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvfsm.check.cli import add_arguments, main

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert main(p.parse_args(["--list-mutants"])) == 0
    assert "heartbeat_never_extends" in capsys.readouterr().out
    assert main(p.parse_args(["--mutant", "heartbeat_never_extends"])) == 1
    out = capsys.readouterr().out
    assert "VIOLATION no_read_of_freed_blocks" in out and "lands" in out
