"""Prometheus metrics of kvfsm managers: a ``prometheus_client`` collector over ``stats()``.

An engine registers one collector for the managers of its process::

    from prometheus_client import REGISTRY
    from kvfsm.runtime.metrics import KvfsmCollector

    REGISTRY.register(KvfsmCollector([prefill_manager, decode_manager]))

Every scrape reads each manager's ``stats()`` (the same snapshot an engine logs; nothing is
counted twice and the hot path is untouched) and maps it, with labels ``side`` and ``rank`` on
every sample:

* a counter ``name`` is ``kvfsm_<name>_total``; a counter of a family, ``dropped.<reason>`` and
  ``failure.<code>``, is one metric with the rest as a label: ``kvfsm_dropped_total{reason}``,
  ``kvfsm_room_failures_total{code}``;
* a histogram ``name`` is a summary ``kvfsm_<name>`` (``_count``, ``_sum``, and the quantiles
  0.5, 0.95 and 0.99 over the telemetry's window of recent samples); ``state_seconds.<State>``
  is ``kvfsm_state_seconds{state}``: the time a room spent in a state before it left it;
* the gauges ``kvfsm_live_rooms``, ``kvfsm_armed_timers``, ``kvfsm_tombstones``,
  ``kvfsm_workers_alive``.

``prometheus_client`` is optional (``pip install "kvfsm[prometheus]"``): kvfsm imports it only
when a collector is made.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

PREFIX = "kvfsm"
LABELS = ("side", "rank")
# counter and histogram families: telemetry name before the dot -> (metric, label of the rest)
_FAMILIES = {
    "dropped": ("dropped", "reason"),
    "failure": ("room_failures", "code"),
    "state_seconds": ("state_seconds", "state"),
}
_GAUGES = {
    "live_rooms": "Rooms this manager holds (not yet cleared).",
    "armed_timers": "Timers armed across the manager's rooms.",
    "tombstones": "Cleared or expired rooms remembered so that late messages for them are dropped.",
    "workers_alive": "Transfer worker threads alive.",
}
_HELP = {
    "rooms_created": "Rooms created by the engine.",
    "rooms_succeeded": "Rooms that reached Success.",
    "rooms_failed": "Rooms that reached Failed.",
    "rooms_cleared": "Rooms cleared by the engine.",
    "messages_in": "Control messages and notifications received.",
    "messages_out": "Control messages sent.",
    "writes_posted": "KV and aux writes posted to the data plane.",
    "descriptors": "Transfer descriptors (contiguous runs) in the posted writes.",
    "bytes_written": "Bytes the posted writes move.",
    "dropped": "Inbound items dropped without reaching a room, by reason.",
    "room_failures": "Rooms failed, by failure code.",
    "protocol_errors": "Events a room machine refused (a peer's fault: the room failed).",
    "ignored": "Events a room's spec row ignores (a duplicate or late event, harmless).",
    "early_messages": "Messages held for a room the engine has not created yet.",
    "registrations": "Decode ranks' registrations accepted (prefill).",
    "registrations_refused": "Decode ranks' registrations refused: page or aux sizes differ (prefill).",
    "links_ready": "Prefill ranks that acknowledged this decode rank's registration.",
    "peers_lost": "Peers the transport reported lost.",
    "write_errors": "Posted writes the data plane reported failed.",
    "internal_errors": "Exceptions caught in the runtime itself.",
    "state_seconds": "Seconds a room spent in a state before leaving it.",
    "room_seconds": "Seconds from a room's creation to its Success.",
    "transfer_seconds": "Seconds from a room's first transfer to its Success.",
    "room_bytes": "Bytes moved per successful room.",
    "room_descriptors": "Transfer descriptors per successful room.",
}
_QUANTILES = (("0.5", "p50"), ("0.95", "p95"), ("0.99", "p99"))
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


@runtime_checkable
class StatsSource(Protocol):
    """What the collector reads: a ``PrefillManager`` or ``DecodeManager``."""

    def stats(self) -> dict[str, Any]: ...


class KvfsmCollector:
    """A ``prometheus_client`` collector of the managers' ``stats()`` (see the module doc).
    Register it with ``registry.register(KvfsmCollector(managers))``; ``managers`` is one
    manager or several (a process that runs many ranks)."""

    def __init__(self, managers: StatsSource | Iterable[StatsSource]) -> None:
        try:
            import prometheus_client  # noqa: F401  (optional: fail here, not at the first scrape)
        except ImportError as e:
            raise ImportError('KvfsmCollector needs prometheus_client: pip install "kvfsm[prometheus]"') from e
        self._managers = [managers] if isinstance(managers, StatsSource) else list(managers)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from prometheus_client.metrics_core import Metric

        families: dict[str, Metric] = {}

        def family(kind: str, name: str, extra: tuple[str, ...] = ()) -> Metric:
            metric = families.get(name)
            if metric is None:
                doc = _HELP.get(name[len(PREFIX) + 1 :]) or _GAUGES.get(name[len(PREFIX) + 1 :]) or name
                if kind == "counter":
                    metric = CounterMetricFamily(name, doc, labels=[*LABELS, *extra])
                elif kind == "gauge":
                    metric = GaugeMetricFamily(name, doc, labels=[*LABELS, *extra])
                else:
                    metric = Metric(name, doc, "summary")
                families[name] = metric
            return metric

        for manager in self._managers:
            stats = manager.stats()
            ids = [str(stats["side"]), str(stats["rank"])]
            for key, value in stats["counters"].items():
                name, extra, label = _metric_name(key)
                metric = family("counter", name, extra)
                metric.add_metric([*ids, *label], value)  # type: ignore[attr-defined]
            for key, snap in stats["histograms"].items():
                name, extra, label = _metric_name(key)
                metric = family("summary", name)
                labels = dict(zip((*LABELS, *extra), (*ids, *label), strict=True))
                count = snap["count"]
                metric.add_sample(f"{name}_count", labels, count)
                metric.add_sample(f"{name}_sum", labels, snap["sum"] if count else 0.0)
                if count:
                    for quantile, pct in _QUANTILES:
                        metric.add_sample(name, {**labels, "quantile": quantile}, snap[pct])
            for key in _GAUGES:
                family("gauge", f"{PREFIX}_{key}").add_metric(ids, stats[key])  # type: ignore[attr-defined]
        yield from families.values()


def _metric_name(key: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """A telemetry name -> (metric name, extra label names, their values)."""
    head, dot, rest = key.partition(".")
    if dot and head in _FAMILIES:
        metric, label = _FAMILIES[head]
        return f"{PREFIX}_{metric}", (label,), (rest,)
    return f"{PREFIX}_{_UNSAFE.sub('_', key)}", (), ()
