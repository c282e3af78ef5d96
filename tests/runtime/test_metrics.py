"""Prometheus metrics (kvfsm.runtime.metrics): what a scrape of a real loopback run exposes is
what the managers' ``stats()`` say, under the documented names, with side and rank labels."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfsm.protocol import KVPoll
from kvfsm.testing import LoopbackCluster

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvfsm.runtime.metrics import KvfsmCollector  # noqa: E402


@pytest.fixture
def ran() -> LoopbackCluster:
    """Two prefill and two decode ranks (prefill rank r sends to decode rank r) after three
    rooms: two succeed on both pairs, one times out at decode rank 0 (so that counters, a
    failure code, every histogram and the gauges have values)."""
    c = LoopbackCluster(prefill_ranks=2, decode_ranks=2)
    for rid, first in ((1, 0), (2, 8)):
        recv = [d.create_receiver(rid) for d in c.decode]
        for rc in recv:
            rc.init([first, first + 1], rid)
        c.settle()
        for r, p in enumerate(c.prefill):
            sender = p.create_sender(rid)
            sender.send([first + 2 * r], is_last=False)
            sender.send([first + 2 * r + 1], is_last=True, aux_slot=r)
        c.settle()
        assert [rc.poll() for rc in recv] == [KVPoll.Success] * 2
    stuck = c.decode[0].create_receiver(3)
    stuck.init([20, 21], 5)
    c.settle()
    c.advance(3600)  # nobody sends room 3: it fails on its timer
    assert stuck.poll() == KVPoll.Failed
    yield c
    c.close()


def _samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape, parsed back from the text exposition."""
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _ids(stats: dict) -> dict[str, str]:
    return {"side": stats["side"], "rank": str(stats["rank"])}


def test_a_scrape_exposes_every_counter_histogram_and_gauge_of_stats(ran: LoopbackCluster) -> None:
    registry = CollectorRegistry()
    registry.register(KvfsmCollector(ran.managers))
    samples = _samples(registry)
    seen = 0
    for manager in ran.managers:
        stats = manager.stats()
        ids = _ids(stats)
        assert stats["counters"] and stats["histograms"]
        for key, value in stats["counters"].items():
            head, _, rest = key.partition(".")
            if head == "dropped":
                name, labels = "kvfsm_dropped_total", {**ids, "reason": rest}
            elif head == "failure":
                name, labels = "kvfsm_room_failures_total", {**ids, "code": rest}
            else:
                name, labels = f"kvfsm_{key}_total", ids
            assert samples[(name, frozenset(labels.items()))] == value, key
            seen += 1
        for key, snap in stats["histograms"].items():
            head, _, rest = key.partition(".")
            name, labels = (
                ("kvfsm_state_seconds", {**ids, "state": rest}) if head == "state_seconds" else (f"kvfsm_{key}", ids)
            )
            assert samples[(f"{name}_count", frozenset(labels.items()))] == snap["count"], key
            assert samples[(f"{name}_sum", frozenset(labels.items()))] == pytest.approx(snap["sum"])
            assert snap["sum"] == pytest.approx(snap["mean"] * snap["count"])
            for quantile, pct in (("0.5", "p50"), ("0.95", "p95"), ("0.99", "p99")):
                assert samples[(name, frozenset({**labels, "quantile": quantile}.items()))] == snap[pct], key
            seen += 1
        for gauge in ("live_rooms", "armed_timers", "tombstones", "workers_alive"):
            assert samples[(f"kvfsm_{gauge}", frozenset(ids.items()))] == stats[gauge]
    assert seen >= 20  # (every manager had something to say)


def test_the_run_shows_in_the_metrics_a_dashboard_would_use(ran: LoopbackCluster) -> None:
    """Spot values known from the run itself, not read back from stats()."""
    registry = CollectorRegistry()
    registry.register(KvfsmCollector(ran.managers))
    samples = _samples(registry)
    decode = frozenset({"side": "decode", "rank": "0"}.items())
    assert samples[("kvfsm_rooms_created_total", decode)] == 3  # decode rank 0: rooms 1, 2 and 3
    assert samples[("kvfsm_rooms_succeeded_total", decode)] == 2
    assert samples[("kvfsm_rooms_failed_total", decode)] == 1
    assert samples[("kvfsm_room_seconds_count", decode)] == 2
    for rank in ("0", "1"):
        prefill = frozenset({"side": "prefill", "rank": rank}.items())
        assert samples[("kvfsm_rooms_succeeded_total", prefill)] == 2
        assert samples[("kvfsm_writes_posted_total", prefill)] >= 4  # 2 rooms x (2 chunks + aux), folded or not
    failures = [(k, v) for k, v in samples.items() if k[0] == "kvfsm_room_failures_total"]
    assert len(failures) == 1 and failures[0][1] == 1 and dict(failures[0][0][1])["side"] == "decode"


def test_one_manager_or_many_and_a_second_scrape_sees_new_counts(ran: LoopbackCluster) -> None:
    registry = CollectorRegistry()
    registry.register(KvfsmCollector(ran.decode[0]))
    decode = frozenset({"side": "decode", "rank": "0"}.items())
    before = _samples(registry)
    assert {dict(labels)["side"] for _, labels in before} == {"decode"}
    ran.decode[0].create_receiver(9)
    assert (
        _samples(registry)[("kvfsm_rooms_created_total", decode)] == before[("kvfsm_rooms_created_total", decode)] + 1
    )


def test_kvfsm_imports_and_runs_without_prometheus_client() -> None:
    """prometheus_client is optional: the runtime and the metrics module import without it, and
    only making a collector asks for it, saying what to install."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"  # (None: any import of it fails)
        "import kvfsm.runtime, kvfsm.runtime.metrics as m\n"
        "try:\n    m.KvfsmCollector([])\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kvfsm[prometheus]" in out.stdout
