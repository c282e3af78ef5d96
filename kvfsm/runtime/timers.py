"""Timer wheel: the runtime side of SetTimer / CancelTimer actions.

Deadlines are on the manager's clock. Set, cancel and re-arm are O(log n) / O(1): armed timers
are indexed by room (so forgetting a room costs its own timers, not every live room's), and heap
entries are deleted lazily (an entry fires only if it is still the armed generation).

Re-arming later is lazy: an inactivity timer is re-armed on every chunk and every completion,
always a little later than before, so ``set`` then only records the new deadline, and the heap
entry, which comes due first, is pushed again at the recorded deadline when it reaches the top
(once per timeout period, not once per chunk). Every query (``next_deadline``, ``pop_due``,
``pop_next_due``) sees the recorded deadlines only. Re-arming earlier pushes a new entry at
once. The heap is compacted when stale entries (cancelled, or re-armed earlier) dominate.
"""

from __future__ import annotations

import heapq


class TimerWheel:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, str]] = []
        # room -> timer -> [generation, deadline of its heap entry, deadline armed]
        self._armed: dict[int, dict[str, list[float]]] = {}
        self._count = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._count

    def set(self, room: int, timer: str, deadline: float) -> None:
        timers = self._armed.get(room)
        if timers is None:  # not setdefault: a room re-arms on every chunk, a new dict each time
            timers = self._armed[room] = {}
        entry = timers.get(timer)
        if entry is not None and entry[1] <= deadline:
            entry[2] = deadline  # later: the heap entry comes due first and is pushed again then
            return
        if entry is None:
            self._count += 1
        seq = self._seq = self._seq + 1
        timers[timer] = [seq, deadline, deadline]
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

    def _live(self, seq: int, room: int, timer: str) -> list[float] | None:
        """The armed entry of (room, timer) if the heap entry ``seq`` is still its generation."""
        timers = self._armed.get(room)
        entry = timers.get(timer) if timers is not None else None
        return entry if entry is not None and entry[0] == seq else None

    def _top(self) -> tuple[float, int, str] | None:
        """The heap's top as (deadline, room, timer), every stale entry above it dropped and every
        entry re-armed later pushed again at its recorded deadline; None if nothing is armed."""
        heap = self._heap
        while heap:
            deadline, seq, room, timer = heap[0]
            entry = self._live(seq, room, timer)
            if entry is None:
                heapq.heappop(heap)  # cancelled, or re-armed earlier (a newer entry exists)
            elif entry[2] > deadline:
                entry[1] = entry[2]  # re-armed later meanwhile: move the entry there
                heapq.heapreplace(heap, (entry[2], seq, room, timer))
            else:
                return deadline, room, timer
        return None

    def next_deadline(self) -> float | None:
        top = self._top()
        return None if top is None else top[0]

    def pop_next_due(self, now: float) -> tuple[int, str] | None:
        """Disarm and return the earliest (room, timer) due at ``now``, or None. Pop one at a time
        and step it before popping the next: stepping one may cancel another that is also due."""
        top = self._top()
        if top is None or top[0] > now:
            return None
        heapq.heappop(self._heap)
        self.cancel(top[1], top[2])
        return top[1], top[2]

    def pop_due(self, now: float) -> list[tuple[int, str]]:
        """Disarm and return every (room, timer) whose deadline is <= now, in deadline order."""
        due = []
        while (nxt := self.pop_next_due(now)) is not None:
            due.append(nxt)
        return due

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live(e[1], e[2], e[3]) is not None]
        heapq.heapify(self._heap)
