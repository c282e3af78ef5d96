"""Room machines: spec rows -> ``transitions`` machines -> compiled dispatch table.

Theory of operation
-------------------
``RoomMachine`` builds one ``transitions.Machine`` per machine kind from spec/ (no models are
added to it: ``add_model`` is O(n) per add, so rooms are never registered with it). That machine
is the declaration and the reference interpreter: ``step_reference`` fires its events directly on
a room object. ``step`` runs the same rows from a dispatch table that is compiled *from the
transitions machine* by introspection (``machine.events[trigger].transitions[state]``): same
guards, same order, same actions, ~20x cheaper than a ``transitions`` fire (8 µs here). A
differential test checks that both paths agree on random event sequences.

A step is ``(room, event, now) -> [actions]``. It never does I/O, reads a clock or sleeps.
An event no row accepts is a protocol error: for a local cause it raises LocalProtocolError and
leaves the room untouched; for a remote cause the spec's ``on_remote_error`` row fires (the room
fails with a reason) and a RecordProtocolError action reports it. In a terminal state the room is
left as it is and only the RecordProtocolError is returned (Success never turns into Failed).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

from transitions import Machine

from kvfsm.protocol.actions import Action, RecordProtocolError
from kvfsm.protocol.errors import LocalProtocolError, SpecError
from kvfsm.protocol.events import Event
from kvfsm.protocol.functions import ACTION_ARGS, ACTIONS, EXPLAIN, GUARDS, StepContext
from kvfsm.protocol.rooms import DecodeRoom, PrefillRoom
from kvfsm.protocol.spec import MachineSpec, ProtocolSpec, load_spec
from kvfsm.protocol.wire import Codec

Callback = Callable[[Any, Any, StepContext], None]


class _Bound:
    """An action bound to its spec argument; called as a transitions ``after`` callback."""

    __slots__ = ("fn", "arg", "name")

    def __init__(self, name: str, fn: Callable[[Any, Any, StepContext, str], None], arg: str) -> None:
        self.name = name
        self.fn = fn
        self.arg = arg

    def __call__(self, room: Any, ev: Any, ctx: StepContext) -> None:
        self.fn(room, ev, ctx, self.arg)


class _RowMark:
    """Last callback of every row: records which spec row fired (row coverage, tracing)."""

    __slots__ = ("row_id",)

    def __init__(self, row_id: str) -> None:
        self.row_id = row_id

    def __call__(self, room: Any, ev: Any, ctx: StepContext) -> None:
        room.last_row = self.row_id


class _GuardCall:
    """Adapts ``guard(room, event)`` to the transitions condition call ``(room, event, ctx)``."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any, Any], bool]) -> None:
        self.fn = fn

    def __call__(self, room: Any, ev: Any, ctx: StepContext) -> bool:
        return self.fn(room, ev)


def _guard(name: str) -> _GuardCall:
    fn = GUARDS.get(name)
    if fn is None:
        raise SpecError(f"unknown guard {name!r} (known: {sorted(GUARDS)})")
    return _GuardCall(fn)


def _bind_actions(names: Sequence[str], timers: Collection[str]) -> list[Callback]:
    out: list[Callback] = []
    for spec_name in names:
        name, _, arg = spec_name.partition(":")
        fn = ACTIONS.get(name)
        if fn is None:
            raise SpecError(f"unknown action {name!r} (known: {sorted(ACTIONS)})")
        kind = ACTION_ARGS.get(name)
        if kind is None and arg:
            raise SpecError(f"action {name!r} takes no argument, got {spec_name!r}")
        if kind == "timer" and arg not in timers:
            raise SpecError(f"{spec_name!r}: {arg!r} is not a timer of this machine ({sorted(timers)})")
        if kind == "text" and not arg:
            raise SpecError(f"{spec_name!r}: {name} needs a text argument ({name}:why)")
        if isinstance(kind, tuple) and arg not in kind:
            raise SpecError(f"{spec_name!r}: argument must be one of {list(kind)}")
        out.append(_Bound(name, fn, arg))
    return out


@dataclass(frozen=True, slots=True)
class CompiledRow:
    row_id: str
    conditions: tuple[Callable[[Any, Any], bool], ...]
    unless: tuple[Callable[[Any, Any], bool], ...]
    dest: str | None
    # the row's ``after`` callbacks unwrapped: (action function, spec argument) of each _Bound in
    # order, the closing _RowMark being ``row_id`` (one call per action, not two)
    actions: tuple[tuple[Callable[[Any, Any, StepContext, str], None], str], ...]


def _fire(room: Any, event: Any, ctx: StepContext, row: CompiledRow) -> list[Action]:
    """Take ``row``: enter its destination, run its actions, then record the row (as _RowMark)."""
    if row.dest is not None:
        room.state = row.dest
    for fn, arg in row.actions:
        fn(room, event, ctx, arg)
    room.last_row = row.row_id
    return ctx.out


class RoomMachine:
    """One machine kind (prefill_room or decode_room), shared by every room of that kind."""

    def __init__(self, spec: MachineSpec, kvpoll: dict[str, int], timeouts: dict[str, float] | None = None) -> None:
        self.spec = spec
        self.timeouts = {name: t.default_s for name, t in spec.timers.items()}
        if timeouts:
            unknown = set(timeouts) - set(self.timeouts)
            if unknown:
                raise LocalProtocolError(f"{spec.name} has no timers {sorted(unknown)}; it has {sorted(self.timeouts)}")
            self.timeouts.update(timeouts)
        self._kvpoll = {name: (kvpoll[s.kvpoll] if s.kvpoll else None) for name, s in spec.states.items()}
        self._timer_triggers = {t.trigger for t in spec.timers.values()}
        self._on_create = _bind_actions(spec.on_create, spec.timers)
        self._error_callbacks: tuple[Callback, ...] = (
            *_bind_actions(spec.error_actions, spec.timers),
            _RowMark("on_remote_error"),
        )
        self.machine = self._build_transitions()
        self.table = self._compile()
        # (state, trigger) whose rows share a guard (P9-P11 all test chunk_ok): step evaluates
        # each guard once there. Guards are pure functions of (room, event) and no action runs
        # before a row is chosen, so a second evaluation could only repeat the first.
        self._shared_guards = {
            key
            for key, rows in self.table.items()
            if len(fns := [g for r in rows for g in (*r.conditions, *r.unless)]) != len(set(fns))
        }

    # ------------------------------------------------------------------ building

    def _build_transitions(self) -> Machine:
        m = Machine(
            model=None,
            states=list(self.spec.states),
            initial=self.spec.initial,
            auto_transitions=False,
            send_event=False,
            ignore_invalid_triggers=False,
        )
        for row in self.spec.rows:
            conditions: list[Any] = [_guard(g) for g in row.guards if not g.startswith("!")]
            unless: list[Any] = [_guard(g[1:]) for g in row.guards if g.startswith("!")]
            after: list[Any] = [*_bind_actions(row.actions, self.spec.timers), _RowMark(row.id)]
            for trigger in row.triggers:
                for src in row.sources:
                    m.add_transition(trigger, src, row.dest, conditions=conditions, unless=unless, after=after)
        return m

    def _compile(self) -> dict[tuple[str, str], tuple[CompiledRow, ...]]:
        """Read the transitions machine back into a (state, trigger) -> rows dispatch table."""
        table: dict[tuple[str, str], tuple[CompiledRow, ...]] = {}
        for trigger, event in self.machine.events.items():
            for state, transitions in event.transitions.items():
                rows = []
                for t in transitions:
                    *bound, mark = t.after  # as _build_transitions made them: actions, then the row mark
                    assert isinstance(mark, _RowMark) and all(isinstance(cb, _Bound) for cb in bound), t.after
                    rows.append(
                        CompiledRow(
                            row_id=mark.row_id,
                            conditions=tuple(cast(_GuardCall, c.func).fn for c in t.conditions if c.target),
                            unless=tuple(cast(_GuardCall, c.func).fn for c in t.conditions if not c.target),
                            dest=t.dest,
                            actions=tuple((cb.fn, cb.arg) for cb in cast(list[_Bound], bound)),
                        )
                    )
                table[(state, trigger)] = tuple(rows)
        return table

    # ------------------------------------------------------------------ rooms

    def create(self, room: PrefillRoom | DecodeRoom, now: float) -> list[Action]:
        """Put a fresh room in the initial state; returns the on_create actions (timers)."""
        room.state = self.spec.initial
        ctx = StepContext(now, self.timeouts, source=self.spec.initial)
        for cb in self._on_create:
            cb(room, None, ctx)
        return ctx.out

    def kvpoll(self, room: PrefillRoom | DecodeRoom) -> int:
        code = self._kvpoll[room.state]
        if code is None:
            raise LocalProtocolError(f"room {room.room} was cleared; it has no status any more")
        return code

    def is_terminal(self, state: str) -> bool:
        return self.spec.states[state].terminal

    def accepts(self, state: str, trigger: str) -> bool:
        """Some row exists for (state, trigger) (its guards may still refuse a given event)."""
        return (state, trigger) in self.table

    # ------------------------------------------------------------------ stepping

    def step(self, room: Any, event: Event, now: float) -> list[Action]:
        """Apply ``event`` to ``room`` (compiled table). Returns the actions to carry out next."""
        ctx = StepContext(now, self.timeouts, room.state)
        key = (room.state, event.trigger)
        rows = self.table.get(key)
        if rows is not None:
            if key in self._shared_guards:
                return self._step_shared(room, event, ctx, rows)
            for row in rows:
                for g in row.conditions:
                    if not g(room, event):
                        break
                else:
                    for g in row.unless:
                        if g(room, event):
                            break
                    else:
                        return _fire(room, event, ctx, row)
        return self._reject(room, event, ctx, rows)

    def _step_shared(self, room: Any, event: Any, ctx: StepContext, rows: tuple[CompiledRow, ...]) -> list[Action]:
        """``step`` for rows that share guards: each guard is evaluated at most once."""
        seen: dict[Callable[[Any, Any], bool], bool] = {}
        for row in rows:
            for g in row.conditions:
                v = seen.get(g)
                if v is None:
                    v = seen[g] = bool(g(room, event))
                if not v:
                    break
            else:
                for g in row.unless:
                    v = seen.get(g)
                    if v is None:
                        v = seen[g] = bool(g(room, event))
                    if v:
                        break
                else:
                    return _fire(room, event, ctx, row)
        return self._reject(room, event, ctx, rows)

    def step_reference(self, room: Any, event: Event, now: float) -> list[Action]:
        """Apply ``event`` by firing the ``transitions`` machine itself (reference interpreter)."""
        ctx = StepContext(now, self.timeouts, source=room.state)
        ev = self.machine.events.get(event.trigger)
        if ev is not None and room.state in ev.transitions and ev.trigger(room, room, event, ctx):
            return ctx.out
        return self._reject(room, event, ctx, self.table.get((room.state, event.trigger)))

    def _reject(self, room: Any, event: Event, ctx: StepContext, rows: tuple[CompiledRow, ...] | None) -> list[Action]:
        if rows is None:
            why = f"{event.trigger} is not accepted in state {room.state}"
        else:
            refused = [g.__name__ for r in rows for g in r.conditions if not g(room, event)]
            refused += ["!" + g.__name__ for r in rows for g in r.unless if g(room, event)]
            details = [EXPLAIN[n](room, event) for n in refused if n in EXPLAIN]
            why = f"{event.trigger} refused in state {room.state} by guards {sorted(set(refused))}"
            if any(details):
                why += ": " + "; ".join(d for d in details if d)
        if event.cause == "local":
            raise LocalProtocolError(f"{self.spec.name} room {room.room}: {why}")
        ctx.error = why
        if self.spec.states[room.state].terminal:
            # A concluded room never changes on a peer's fault: Success never turns into Failed
            # (P19/P21, D15/D17), Failed keeps its first reason, Cleared stays forgotten. Report only.
            room.last_row = "on_remote_error"
            ctx.out.append(RecordProtocolError(why))
            return ctx.out
        room.state = self.spec.error_dest
        for cb in self._error_callbacks:
            cb(room, event, ctx)
        ctx.out.append(RecordProtocolError(why))
        return ctx.out


class Protocol:
    """Both machines of the loaded spec, with the timeouts in force."""

    def __init__(self, spec: ProtocolSpec | None = None, timeouts: dict[str, dict[str, float]] | None = None) -> None:
        self.spec = spec or load_spec()
        timeouts = timeouts or {}
        self.prefill = RoomMachine(self.spec.machines["prefill_room"], self.spec.kvpoll, timeouts.get("prefill"))
        self.decode = RoomMachine(self.spec.machines["decode_room"], self.spec.kvpoll, timeouts.get("decode"))
        self.codec = Codec(
            self.spec.version,
            {n: m.fields for n, m in self.spec.messages.items()},
            {n: m.binary_id for n, m in self.spec.messages.items() if m.binary_id is not None},
        )

    def machine_for(self, side: str, timeouts: dict[str, float] | None = None) -> RoomMachine:
        """The machine of ``side``; with ``timeouts`` (timer -> seconds, timers of the other side
        ignored) a separate machine with those deadlines."""
        base = self.prefill if side == "prefill" else self.decode
        if not timeouts:
            return base
        known = set(self.prefill.timeouts) | set(self.decode.timeouts)
        unknown = set(timeouts) - known
        if unknown:
            raise LocalProtocolError(f"unknown timers {sorted(unknown)}; timers are {sorted(known)}")
        mine = {k: v for k, v in timeouts.items() if k in base.timeouts}
        return RoomMachine(base.spec, self.spec.kvpoll, mine)
