from __future__ import annotations

from kvfsm.runtime.timers import TimerWheel


def test_due_timers_fire_in_deadline_order_once() -> None:
    w = TimerWheel()
    w.set(1, "a", 5.0)
    w.set(2, "a", 3.0)
    w.set(1, "b", 4.0)
    assert w.next_deadline() == 3.0
    assert w.pop_due(4.5) == [(2, "a"), (1, "b")]
    assert w.pop_due(4.5) == []
    assert len(w) == 1 and w.pop_due(10) == [(1, "a")] and len(w) == 0


def test_rearming_replaces_the_deadline_and_cancel_disarms() -> None:
    w = TimerWheel()
    w.set(1, "t", 1.0)
    w.set(1, "t", 9.0)  # re-armed: the old entry must not fire
    assert w.pop_due(5.0) == [] and len(w) == 1
    w.cancel(1, "t")
    assert w.pop_due(100.0) == [] and len(w) == 0 and w.next_deadline() is None


def test_cancel_room_forgets_only_that_room() -> None:
    w = TimerWheel()
    for room in range(5):
        w.set(room, "x", float(room))
        w.set(room, "y", float(room) + 0.5)
    w.cancel_room(2)
    assert len(w) == 8
    assert sorted(w.pop_due(100.0)) == sorted((r, t) for r in (0, 1, 3, 4) for t in ("x", "y"))


def test_stale_entries_are_compacted() -> None:
    w = TimerWheel()
    for i in range(5000):
        w.set(1, "t", float(i))  # one armed timer, thousands of re-arms
    assert len(w) == 1 and len(w._heap) <= 4 * 1024


def test_stepping_one_due_timer_can_cancel_another_due_in_the_same_tick() -> None:
    w = TimerWheel()
    w.set(7, "bootstrap", 5.0)
    w.set(7, "hold", 5.0)
    first = w.pop_next_due(10.0)
    assert first is not None
    w.cancel_room(7)  # the step of the first timer failed the room: cancel_timers
    assert w.pop_next_due(10.0) is None


def test_rearming_later_pushes_nothing_and_fires_at_the_latest_deadline() -> None:
    w = TimerWheel()
    w.set(1, "t", 1.0)
    for i in range(2, 1000):
        w.set(1, "t", float(i))  # an inactivity timer re-armed on every chunk, later each time
    assert len(w._heap) == 1  # recorded, not pushed
    assert w.next_deadline() == 999.0  # every query sees the deadline armed last
    assert w.pop_due(998.5) == [] and len(w) == 1
    assert w.pop_next_due(999.0) == (1, "t") and len(w) == 0 and w.next_deadline() is None


def test_rearming_earlier_after_later_fires_at_the_earlier_deadline() -> None:
    w = TimerWheel()
    w.set(1, "t", 5.0)
    w.set(1, "t", 9.0)  # later: recorded
    w.set(1, "t", 2.0)  # earlier than the heap entry: a new entry, the old one stale
    w.set(2, "u", 3.0)
    assert w.next_deadline() == 2.0
    assert w.pop_due(4.0) == [(1, "t"), (2, "u")]
    assert w.pop_due(100.0) == [] and len(w) == 0


def test_order_across_rooms_follows_the_recorded_deadlines() -> None:
    w = TimerWheel()
    w.set(1, "t", 1.0)
    w.set(2, "t", 2.0)
    w.set(1, "t", 3.0)  # room 1 re-armed past room 2
    assert w.pop_due(10.0) == [(2, "t"), (1, "t")]


def test_stale_entries_of_earlier_rearms_are_compacted() -> None:
    w = TimerWheel()
    for i in range(5000):
        w.set(1, "t", float(5000 - i))  # re-armed earlier each time: a new heap entry each time
    assert len(w) == 1 and len(w._heap) <= 4 * 1024
    assert w.next_deadline() == 1.0 and w.pop_due(1.0) == [(1, "t")] and w.next_deadline() is None
