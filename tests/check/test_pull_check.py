"""kvfsm check in pull mode: the explorer steps the spec's pull machines, finds every pull mutant
and an unsafe clock, and the pull properties of spec/invariants.toml have their predicates."""

from __future__ import annotations

import tomllib
from dataclasses import replace

import pytest

from kvfsm.check.mutants import _machine, _rows
from kvfsm.check.properties import PREDICATES, load_properties
from kvfsm.check.pull_explore import PULL_MUTANTS, PULL_PRESETS, describe, explore_pull
from kvfsm.check.pull_model import TIMEOUTS, PullConfig, PullModel
from kvfsm.protocol import Protocol, load_spec
from kvfsm.protocol.spec import MachineSpec, spec_dir


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


def _bootstrap_while_granted(ms: MachineSpec) -> MachineSpec:
    """The fix proposed for the liveness gap pull-smoke finds: while Granted, the bootstrap timer
    bounds the sources' silence (re-armed by every complete grant, cancelled when reads post)."""

    def rows(old: tuple) -> list:  # type: ignore[type-arg]
        out = []
        for r in old:
            if r.id == "G5":
                r = replace(r, actions=tuple("arm:bootstrap" if a == "cancel:bootstrap" else a for a in r.actions))
            elif r.id == "A2":
                r = replace(r, actions=(*r.actions[:2], "cancel:bootstrap", *r.actions[2:]))
            elif r.id == "H3":
                r = replace(r, sources=("Claiming", "Granted"), source_decl=("Claiming", "Granted"))
            out.append(r)
        return out

    return _rows(ms, rows)


def test_pull_smoke_finds_a_decode_room_that_renews_forever_toward_a_cleared_source() -> None:
    # A decode room in Granted has no timer but renew: once its source is cleared (claims to a
    # cleared room are dropped) and the source's room_failed is lost, it renews forever.
    res = explore_pull(PULL_PRESETS["pull-smoke"])
    assert [v["name"] for v in res.violations] == ["no_leaked_blocks"]
    v = res.violations[0]
    assert "D0: Granted" in v["detail"]
    assert any(label[0] == "lose" and label[1][2][0] == "room_failed" for label in v["trace"])


@pytest.fixture
def proposed_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Explore the protocol with the proposed fix on top (of the mutant, if any)."""
    import kvfsm.check.pull_explore as pe

    def protocol(mutant: str | None) -> Protocol:
        spec = load_spec() if mutant is None else PULL_MUTANTS[mutant].transform(load_spec())
        return Protocol(_machine(spec, "decode_pull", _bootstrap_while_granted), timeouts=TIMEOUTS)

    monkeypatch.setattr(pe, "pull_protocol", protocol)


@pytest.mark.usefixtures("proposed_fix")
def test_pull_smoke_passes_with_the_proposed_fix() -> None:
    res = explore_pull(PULL_PRESETS["pull-smoke"])
    assert res.ok and res.complete, res.violations
    assert all(res.witnessed.values()), res.witnessed  # a room succeeds, a renewal extends a lease


@pytest.mark.usefixtures("proposed_fix")
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
