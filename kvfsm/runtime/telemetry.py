"""Per-manager telemetry: counters and histograms, snapshotted by ``stats()``.

Histograms keep exact count/sum/min/max and a window of the most recent samples for
percentiles (p50/p95/p99), so memory stays bounded however many rooms pass through.
``kvfsm.runtime.metrics.KvfsmCollector`` exposes the same snapshot as Prometheus metrics.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Any


class Histogram:
    __slots__ = ("count", "total", "lo", "hi", "_window")

    def __init__(self, window: int = 16384) -> None:
        self.count = 0
        self.total = 0.0
        self.lo = float("inf")
        self.hi = float("-inf")
        self._window: deque[float] = deque(maxlen=window)

    def record(self, value: float) -> None:
        self.count += 1
        self.total += value
        if value < self.lo:  # (comparisons, not min()/max(): a call each costs more)
            self.lo = value
        if value > self.hi:
            self.hi = value
        self._window.append(value)

    def snapshot(self) -> dict[str, float]:
        if not self.count:
            return {"count": 0}
        ordered = sorted(self._window)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

        return {
            "count": self.count,
            "sum": self.total,
            "mean": self.total / self.count,
            "min": self.lo,
            "p50": pct(0.50),
            "p95": pct(0.95),
            "p99": pct(0.99),
            "max": self.hi,
        }


class Telemetry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # a plain dict, not a Counter: item access on a dict subclass is not specialised by the
        # interpreter, and count() runs several times per chunk
        self.counters: dict[str, int] = {}
        self.histograms: dict[str, Histogram] = {}

    def count(self, name: str, n: int = 1) -> None:
        # acquire/release rather than ``with``: the context-manager protocol costs ~90 ns more
        self._lock.acquire()
        try:
            self.counters[name] = self.counters.get(name, 0) + n
        finally:
            self._lock.release()

    def count2(self, name: str, n: int, other: str, m: int) -> None:
        """``count(name, n)`` and ``count(other, m)`` under one acquisition of the lock (a write
        counts itself and its descriptors)."""
        self._lock.acquire()
        try:
            counters = self.counters
            counters[name] = counters.get(name, 0) + n
            counters[other] = counters.get(other, 0) + m
        finally:
            self._lock.release()

    def count3(self, name: str, n: int, other: str, m: int, third: str, k: int) -> None:
        """``count2`` and ``count(third, k)`` under one acquisition of the lock (a write posted:
        itself, its descriptors and its bytes)."""
        self._lock.acquire()
        try:
            counters = self.counters
            counters[name] = counters.get(name, 0) + n
            counters[other] = counters.get(other, 0) + m
            counters[third] = counters.get(third, 0) + k
        finally:
            self._lock.release()

    def observe(self, name: str, value: float) -> None:
        self._lock.acquire()
        try:
            self._histogram(name).record(value)
        finally:
            self._lock.release()

    def observe_many(self, samples: Iterable[tuple[str, float]]) -> None:
        """``observe`` each (name, value) of ``samples``, under one acquisition of the lock (a room
        that concludes records several)."""
        self._lock.acquire()
        try:
            for name, value in samples:
                self._histogram(name).record(value)
        finally:
            self._lock.release()

    def _histogram(self, name: str) -> Histogram:
        """The histogram ``name``, made on first use (the lock held)."""
        h = self.histograms.get(name)
        if h is None:
            h = self.histograms[name] = Histogram()
        return h

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "counters": dict(sorted(self.counters.items())),
                "histograms": {k: h.snapshot() for k, h in sorted(self.histograms.items())},
            }
