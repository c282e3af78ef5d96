"""Helpers for the pull machines' tests (tests/protocol/test_pull.py; not collected itself).

``Driven`` wraps one pull room and its machine: every step goes through it, so it keeps what the
emitted actions say about the room (timers armed and not yet fired or cancelled, claims sent and
when) and checks after each step that the room agrees (``room.timers`` is exactly the set the
actions armed). ``TAKEN`` collects the row each step took, for the row-coverage test.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvfsm.protocol import Action, CancelTimer, Protocol, RoomMachine, SendMessage, SetTimer
from kvfsm.protocol.actions import PostRead
from kvfsm.protocol.events import PeersReady, TimerFired
from kvfsm.protocol.rooms import PullSink, PullSource
from kvfsm.protocol.wire import LeaseClaim

PROTOCOL = Protocol()
PRE: RoomMachine = PROTOCOL.prefill_pull
DEC: RoomMachine = PROTOCOL.decode_pull
ROOM = 7
KV_PAGES = 64
LEASE = PRE.timeouts["lease"]  # prefill's lease, seconds (what a grant carries)
LEASE_MS = int(LEASE * 1000)

# machine name -> row ids taken by any step driven through ``Driven`` in this process
TAKEN: dict[str, set[str]] = {PRE.spec.name: set(), DEC.spec.name: set()}


def row_ids(machine: RoomMachine) -> set[str]:
    return {r.id for r in machine.spec.rows}


@dataclass
class Driven:
    """One pull room driven step by step with explicit ``now`` values."""

    machine: RoomMachine
    room: Any
    now: float = 0.0
    armed: dict[str, float] = field(default_factory=dict)  # timer -> deadline, per the actions
    claims_sent: dict[int, float] = field(default_factory=dict)  # epoch -> when decode sent it
    last: list[Action] = field(default_factory=list)

    def _apply(self, actions: list[Action], fired: str | None) -> list[Action]:
        if fired is not None:
            self.armed.pop(fired, None)  # a fired timer is no longer armed unless re-armed below
        for a in actions:
            if isinstance(a, SetTimer):
                self.armed[a.timer] = a.deadline
            elif isinstance(a, CancelTimer):
                self.armed.pop(a.timer, None)
            elif isinstance(a, SendMessage) and isinstance(a.message, LeaseClaim):
                self.claims_sent.setdefault(a.message.epoch, self.now)
        assert self.room.timers == set(self.armed), (self.room.last_row, self.room.timers, self.armed)
        self.last = actions
        return actions

    def create(self, now: float = 0.0) -> list[Action]:
        self.now = now
        return self._apply(self.machine.create(self.room, now), None)

    def step(self, event: Any, now: float | None = None) -> list[Action]:
        """One step at ``now`` (default: the time of the previous step)."""
        if now is not None:
            assert now >= self.now, "time runs forward"
            self.now = now
        out = self.machine.step(self.room, event, self.now)
        TAKEN[self.machine.spec.name].add(self.room.last_row)
        return self._apply(out, event.timer if isinstance(event, TimerFired) else None)

    def fire(self, timer: str) -> list[Action]:
        """The timer ``timer`` fires at its deadline (it must be armed)."""
        assert timer in self.armed, (timer, self.armed)
        return self.step(TimerFired(timer), max(self.now, self.armed[timer]))

    @property
    def state(self) -> str:
        return str(self.room.state)


def source(
    pages: Iterable[int] = (3, 4, 5),
    tokens: int = 3,
    *,
    rank: int = 0,
    page_size: int = 1,
    machine: RoomMachine = PRE,
    now: float = 0.0,
) -> Driven:
    """A prefill room (Offered) holding ``tokens`` in ``pages`` of ``page_size`` tokens."""
    d = Driven(machine, PullSource(ROOM, rank, tuple(pages), tokens, page_size))
    d.create(now)
    return d


def sink(
    sources: Iterable[int] = (0,),
    *,
    rank: int = 1,
    readers: int = 1,
    page_size: int = 1,
    tokens: int = 0,
    kv_pages: int = KV_PAGES,
    linked: bool = True,
    machine: RoomMachine = DEC,
    now: float = 0.0,
) -> Driven:
    """A decode room. Linked (the default): every source acknowledged the handshake at ``now``
    and the claims of epoch 1 went out then (Claiming; ``last`` is the link step's actions).
    Not linked: just created (Linking)."""
    room = PullSink(ROOM, rank, kv_pages, tuple(sources), readers=readers, page_size=page_size, tokens=tokens)
    d = Driven(machine, room)
    d.create(now)
    if linked:
        d.step(PeersReady())
    return d


def messages(actions: Iterable[Action], kind: type | None = None) -> list[tuple[int, Any]]:
    """(peer, message) of every SendMessage in ``actions`` (of type ``kind`` if given)."""
    return [
        (a.peer_rank, a.message)
        for a in actions
        if isinstance(a, SendMessage) and (kind is None or isinstance(a.message, kind))
    ]


def timers_set(actions: Iterable[Action]) -> dict[str, float]:
    return {a.timer: a.deadline for a in actions if isinstance(a, SetTimer)}


def timers_cancelled(actions: Iterable[Action]) -> set[str]:
    return {a.timer for a in actions if isinstance(a, CancelTimer)}


def reads(actions: Iterable[Action]) -> list[PostRead]:
    return [a for a in actions if isinstance(a, PostRead)]
