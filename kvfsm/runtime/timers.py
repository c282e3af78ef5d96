"""Timer wheel: the runtime side of SetTimer / CancelTimer actions.

Deadlines are on the manager's clock. Set, cancel and re-arm are O(log n) / O(1): armed timers
are indexed by room (so forgetting a room costs its own timers, not every live room's), and heap
entries are deleted lazily (an entry fires only if it is still the armed generation). The heap is
compacted when stale entries dominate, so re-arming an inactivity timer on every chunk does not
grow memory without bound.
"""

from __future__ import annotations

import heapq


class TimerWheel:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, str]] = []
        self._armed: dict[int, dict[str, int]] = {}  # room -> timer -> generation
        self._count = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._count

    def _is_armed(self, room: int, timer: str, seq: int) -> bool:
        timers = self._armed.get(room)
        return timers is not None and timers.get(timer) == seq

    def set(self, room: int, timer: str, deadline: float) -> None:
        seq = self._seq = self._seq + 1
        timers = self._armed.get(room)
        if timers is None:  # not setdefault: a room re-arms on every chunk, a new dict each time
            timers = self._armed[room] = {}
        if timer not in timers:
            self._count += 1
        timers[timer] = seq
        heapq.heappush(self._heap, (deadline, seq, room, timer))
        if len(self._heap) > 1024 and len(self._heap) > 4 * self._count:
            self._compact()

    def armed(self, room: int, timer: str) -> bool:
        return timer in self._armed.get(room, {})

    def cancel(self, room: int, timer: str) -> None:
        timers = self._armed.get(room)
        if timers is not None and timers.pop(timer, None) is not None:
            self._count -= 1
            if not timers:
                del self._armed[room]

    def cancel_room(self, room: int) -> None:
        timers = self._armed.pop(room, None)
        if timers:
            self._count -= len(timers)

    def next_deadline(self) -> float | None:
        while self._heap:
            deadline, seq, room, timer = self._heap[0]
            if self._is_armed(room, timer, seq):
                return deadline
            heapq.heappop(self._heap)
        return None

    def pop_next_due(self, now: float) -> tuple[int, str] | None:
        """Disarm and return the earliest (room, timer) due at ``now``, or None. Pop one at a time
        and step it before popping the next: stepping one may cancel another that is also due."""
        while self._heap and self._heap[0][0] <= now:
            _, seq, room, timer = heapq.heappop(self._heap)
            if self._is_armed(room, timer, seq):
                self.cancel(room, timer)
                return room, timer
        return None

    def pop_due(self, now: float) -> list[tuple[int, str]]:
        """Disarm and return every (room, timer) whose deadline is <= now, in deadline order."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            _, seq, room, timer = heapq.heappop(self._heap)
            if self._is_armed(room, timer, seq):
                self.cancel(room, timer)
                due.append((room, timer))
        return due

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._is_armed(e[2], e[3], e[1])]
        heapq.heapify(self._heap)
