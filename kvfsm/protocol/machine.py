"""Room machines: spec rows -> ``transitions`` machines -> compiled dispatch table.

Theory of operation
-------------------
``RoomMachine`` builds one ``transitions.Machine`` per machine kind from spec/ (no models are
added to it: ``add_model`` is O(n) per add, so rooms are never registered with it). That machine
is the declaration and the reference interpreter: ``step_reference`` fires its events directly on
a room object. ``step`` runs the same rows from a dispatch table that is compiled *from the
transitions machine* by introspection (``machine.events[trigger].transitions[state]``): same
guards, same order, same actions, ~20x cheaper than a ``transitions`` fire (8 µs here). Each
(state, trigger) of the table is then turned into one generated function (``_row_function``)
that tests its rows' guards in order, each at most once, and takes the first row whose guards
hold: no loop over rows, guard lists or action lists is left on the per-chunk path. A
differential test checks that ``step`` and the transitions machine agree on random event
sequences.

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


RowFunction = Callable[[Any, Any, StepContext], "list[Action] | None"]


def _row_function(key: tuple[str, str], rows: Sequence[CompiledRow]) -> RowFunction:
    """One function for the rows of ``key`` (a state and a trigger), generated as dataclasses
    generates ``__init__``: it takes the first row whose conditions hold and whose ``unless``
    guards do not (entering its destination, calling its actions with their spec arguments in
    order, recording the row as _RowMark does) and returns the actions; None if no row does.
    A guard that several rows test (P9-P11 all test chunk_ok) is evaluated once and its result
    kept: guards are pure functions of (room, event) and no action runs before a row is chosen,
    so a second evaluation could only repeat the first."""
    names: dict[Callable[..., Any], str] = {}  # function -> its name in the generated code
    namespace: dict[str, Any] = {}

    def name_of(fn: Callable[..., Any], prefix: str) -> str:
        if fn not in names:
            names[fn] = f"{prefix}{len(names)}"
            namespace[names[fn]] = fn
        return names[fn]

    tests = [g for r in rows for g in (*r.conditions, *r.unless)]
    shared = {g for g in tests if tests.count(g) > 1}
    lines = ["def step(room, ev, ctx):"]
    lines += [f"    {name_of(g, '_g')}_ = None" for g in dict.fromkeys(tests) if g in shared]
    for row in rows:
        lines.append(f"    # row {row.row_id}")
        indent = "    "
        for g, want in [*((g, True) for g in row.conditions), *((g, False) for g in row.unless)]:
            call = f"{name_of(g, '_g')}(room, ev)"
            if g in shared:
                memo = f"{names[g]}_"
                lines.append(f"{indent}if {memo} is None:")
                lines.append(f"{indent}    {memo} = {call}")
                call = memo
            lines.append(f"{indent}if {'' if want else 'not '}{call}:")
            indent += "    "
        if row.dest is not None:
            lines.append(f"{indent}room.state = {row.dest!r}")
        for fn, arg in row.actions:
            lines.append(f"{indent}{name_of(fn, '_a')}(room, ev, ctx, {arg!r})")
        lines.append(f"{indent}room.last_row = {row.row_id!r}")
        lines.append(f"{indent}return ctx.out")
    lines.append("    return None")
    exec("\n".join(lines), namespace)  # noqa: S102 - code generated from the compiled rows only
    fn = namespace["step"]
    fn.__qualname__ = fn.__name__ = f"step[{key[0]}, {key[1]}]"
    return fn  # type: ignore[no-any-return]


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
        self._steps = {key: _row_function(key, rows) for key, rows in self.table.items()}

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
        state = room.state
        ctx = StepContext(now, self.timeouts, state, "", [])
        fn = self._steps.get((state, event.trigger))
        if fn is not None:
            out = fn(room, event, ctx)
            if out is not None:
                return out
        return self._reject(room, event, ctx, self.table.get((state, event.trigger)))

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
