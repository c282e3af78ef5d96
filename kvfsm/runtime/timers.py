"""Timer wheel: the runtime side of SetTimer / CancelTimer actions.

Deadlines are on the manager's clock. Cancel and re-arm are O(1) (lazy deletion: a heap entry
fires only if it is still the armed generation); the heap is compacted when stale entries
dominate, so re-arming an inactivity timer on every chunk does not grow memory without bound.
"""

from __future__ import annotations

import heapq


class TimerWheel:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, str]] = []
        self._armed: dict[tuple[int, str], int] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._armed)

    def set(self, room: int, timer: str, deadline: float) -> None:
        self._seq += 1
        self._armed[(room, timer)] = self._seq
        heapq.heappush(self._heap, (deadline, self._seq, room, timer))
        if len(self._heap) > 1024 and len(self._heap) > 4 * len(self._armed):
            self._compact()

    def cancel(self, room: int, timer: str) -> None:
        self._armed.pop((room, timer), None)

    def cancel_room(self, room: int) -> None:
        for key in [k for k in self._armed if k[0] == room]:
            del self._armed[key]

    def next_deadline(self) -> float | None:
        while self._heap:
            deadline, seq, room, timer = self._heap[0]
            if self._armed.get((room, timer)) == seq:
                return deadline
            heapq.heappop(self._heap)
        return None

    def pop_due(self, now: float) -> list[tuple[int, str]]:
        """Disarm and return every (room, timer) whose deadline is <= now, in deadline order."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            _, seq, room, timer = heapq.heappop(self._heap)
            if self._armed.get((room, timer)) == seq:
                del self._armed[(room, timer)]
                due.append((room, timer))
        return due

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._armed.get((e[2], e[3])) == e[1]]
        heapq.heapify(self._heap)
