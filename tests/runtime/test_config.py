"""RuntimeConfig: documented, validated at construction, frozen."""

from __future__ import annotations

import dataclasses

import pytest

from kvfsm.config import ConfigError, reference
from kvfsm.runtime import RuntimeConfig


def test_defaults_are_valid_and_every_field_is_documented() -> None:
    cfg = RuntimeConfig()
    assert cfg.workers == 4 and cfg.timeouts == {}
    rows = reference(RuntimeConfig)
    assert [r.name for r in rows] == [
        "timeouts", "pull_timeouts", "workers", "batch_bytes", "batch_segments", "register_retry_s",
        "tombstone_ttl_s", "early_ttl_s", "max_early_rooms", "verify_plans",
    ]  # fmt: skip
    assert all(r.doc and r.must for r in rows)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("workers", -1),
        ("workers", 1.5),
        ("batch_bytes", 0),
        ("batch_segments", True),
        ("register_retry_s", 0.0),
        ("tombstone_ttl_s", -1.0),
        ("early_ttl_s", "300"),
        ("max_early_rooms", 0),
        ("timeouts", {"transfer": 0.0}),
        ("pull_timeouts", {"lease": -1.0}),
        ("timeouts", {"transfer": "5"}),
        ("timeouts", [("transfer", 5.0)]),
    ],
)
def test_an_out_of_range_value_is_refused_at_construction(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"RuntimeConfig.{field}"):
        RuntimeConfig(**{field: value})  # type: ignore[arg-type]


def test_it_is_frozen_and_changed_by_replace() -> None:
    cfg = RuntimeConfig(workers=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers = 2  # type: ignore[misc]
    assert dataclasses.replace(cfg, workers=2).workers == 2
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, workers=-2)


def test_replay_switches_are_not_in_the_production_config() -> None:
    assert "routing_mutant" not in {f.name for f in dataclasses.fields(RuntimeConfig)}
