"""Room machines: spec rows -> one compiled table -> ``step``.

Theory of operation
-------------------
A transition row exists once, in spec/ (``RowSpec``). ``compile_rows`` is the one compiler from a
machine's rows to the dispatch table the runtime steps: it resolves each row's guard and action
names to the functions of ``kvfsm.protocol.functions`` (checking every argument) and files the
row under every (state, trigger) it covers, in spec order. ``RoomMachine.step`` runs that table:
for the (state, trigger) of an event it takes the first row whose guards hold (each guard
evaluated at most once per step: guards are pure, and no action runs before a row is chosen),
enters its destination, calls its actions in order and records the row's id. Each (state,
trigger)'s rows run as one function generated from the table (``row_function``), so no loop over
rows, guards or actions is left on the per-event path.

The ``transitions`` library is the reference interpreter, not a second compiler:
``reference_machine`` adds every spec row to a ``transitions.Machine`` as it is declared (its own
expansion of sources and triggers, its own order and firing), built lazily because only tests and
``bench/core.py`` fire it (``RoomMachine.step_reference``). ``tests/protocol/test_differential.py``
requires both interpreters to agree on random event sequences; the fast rows of
``kvfsm.protocol.fastpath`` are checked against ``step`` (see there).

A step is ``(room, event, now) -> [actions]``. It never does I/O, reads a clock or sleeps.
An event no row accepts is a protocol error: for a local cause it raises LocalProtocolError and
leaves the room untouched; for a remote cause the spec's ``on_remote_error`` row fires (the room
fails with a reason) and a RecordProtocolError action reports it. In a terminal state the room is
left as it is and only the RecordProtocolError is returned (Success never turns into Failed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from transitions import Machine

from kvfsm.protocol.actions import Action, RecordProtocolError

# (the decode room's and the link machines' guards and actions register themselves on import)
from kvfsm.protocol.decode_rules import alloc_ok  # noqa: F401
from kvfsm.protocol.errors import LocalProtocolError, SpecError
from kvfsm.protocol.events import Event
from kvfsm.protocol.functions import ACTION_ARGS, ACTIONS, EXPLAIN, GUARDS, ActionFn, Guard, StepContext
from kvfsm.protocol.links import accept_link  # noqa: F401
from kvfsm.protocol.pull import claim  # noqa: F401
from kvfsm.protocol.rooms import DecodeLink, DecodeRoom, PrefillLink, PrefillRoom
from kvfsm.protocol.spec import MachineSpec, ProtocolSpec, RowSpec, load_spec
from kvfsm.protocol.wire import Codec

# an action function with its spec argument ("arm:transfer" -> (arm, "transfer"))
BoundAction = tuple[ActionFn, str]


@dataclass(frozen=True, slots=True)
class CompiledRow:
    """One spec row with its names resolved: what ``step`` runs. Equal rows are the same row
    (guard and action functions compare by identity), which ``fastpath.applies`` relies on."""

    row_id: str
    conditions: tuple[Guard, ...]  # must all hold
    unless: tuple[Guard, ...]  # must all fail (the spec's "!name")
    dest: str | None  # None: stay
    actions: tuple[BoundAction, ...]


# (state, trigger) -> the rows a step tries, in spec order
Table = dict[tuple[str, str], tuple[CompiledRow, ...]]


def _guard(name: str) -> Guard:
    fn = GUARDS.get(name)
    if fn is None:
        raise SpecError(f"unknown guard {name!r} (known: {sorted(GUARDS)})")
    return fn


def bind_actions(names: Sequence[str], timers: Collection[str]) -> tuple[BoundAction, ...]:
    """Resolve spec action names (``name`` or ``name:arg``) and check each argument."""
    out: list[BoundAction] = []
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
        out.append((fn, arg))
    return tuple(out)


def compile_row(row: RowSpec, timers: Collection[str]) -> CompiledRow:
    """One spec row, its guard and action names resolved (SpecError for an unknown name or a
    bad argument)."""
    return CompiledRow(
        row_id=row.id,
        conditions=tuple(_guard(g) for g in row.guards if not g.startswith("!")),
        unless=tuple(_guard(g[1:]) for g in row.guards if g.startswith("!")),
        dest=row.dest,
        actions=bind_actions(row.actions, timers),
    )


def compile_rows(spec: MachineSpec) -> Table:
    """The one compiler from a machine's spec rows to its dispatch table: every row filed under
    each (source state, trigger) it declares, the rows of a pair in spec order."""
    table: dict[tuple[str, str], list[CompiledRow]] = {}
    for row in spec.rows:
        compiled = compile_row(row, spec.timers)
        for trigger in row.triggers:
            for state in row.sources:
                table.setdefault((state, trigger), []).append(compiled)
    return {key: tuple(rows) for key, rows in table.items()}


# One (state, trigger)'s rows as a function: the actions of the row taken, None if none is.
RowFunction = Callable[[Any, Any, StepContext], "list[Action] | None"]


def row_function(key: tuple[str, str], rows: Sequence[CompiledRow]) -> RowFunction:
    """The rows of ``key`` (a state and a trigger) as one function, generated from the compiled
    rows as dataclasses generates ``__init__``: it takes the first row whose conditions hold and
    whose ``unless`` guards do not, enters its destination, calls its actions with their spec
    arguments in order, records the row's id and returns the actions; None if no row is taken.
    A guard that several rows test (P9-P11 all test chunk_ok) is evaluated once and its result
    kept: guards are pure functions of (room, event) and no action runs before a row is chosen,
    so a second evaluation could only repeat the first.

    Generated rather than a closure that loops over the rows: the loops over rows, guards and
    actions cost about a fifth of a step (docs/design.md has the figures). The source names only
    the rows' own guard and action functions, their spec arguments, states and row ids."""
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
    exec("\n".join(lines), namespace)  # noqa: S102 - generated from the compiled rows only
    fn = namespace["step"]
    fn.__qualname__ = fn.__name__ = f"step[{key[0]}, {key[1]}]"
    return fn  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- the reference interpreter


class _GuardCall:
    """Adapts ``guard(room, event)`` to the transitions condition call ``(room, event, ctx)``."""

    __slots__ = ("fn",)

    def __init__(self, fn: Guard) -> None:
        self.fn = fn

    def __call__(self, room: Any, ev: Any, ctx: StepContext) -> bool:
        return self.fn(room, ev)


class _ActionCall:
    """An action with its spec argument, called as a transitions ``after`` callback."""

    __slots__ = ("fn", "arg")

    def __init__(self, fn: ActionFn, arg: str) -> None:
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


def reference_machine(spec: MachineSpec) -> Machine:
    """A ``transitions.Machine`` holding every row of ``spec`` as declared: fired with
    ``trigger(room, room, event, ctx)``, it interprets the rows by its own rules (which
    transitions a (state, trigger) has, in which order, which one fires). No model is ever added
    (``add_model`` is O(n) per add): the room is passed as the event's first argument."""
    m = Machine(
        model=None,
        states=list(spec.states),
        initial=spec.initial,
        auto_transitions=False,
        send_event=False,
        ignore_invalid_triggers=False,
    )
    for row in spec.rows:
        compiled = compile_row(row, spec.timers)
        conditions: list[Any] = [_GuardCall(g) for g in compiled.conditions]
        unless: list[Any] = [_GuardCall(g) for g in compiled.unless]
        after: list[Any] = [*(_ActionCall(fn, arg) for fn, arg in compiled.actions), _RowMark(row.id)]
        for trigger in row.triggers:
            for src in row.sources:
                m.add_transition(trigger, src, row.dest, conditions=conditions, unless=unless, after=after)
    return m


# ---------------------------------------------------------------------- machines


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
        self._on_create = bind_actions(spec.on_create, spec.timers)
        self._on_error = bind_actions(spec.error_actions, spec.timers)
        self.table: Table = compile_rows(spec)
        self._steps = {key: row_function(key, rows) for key, rows in self.table.items()}

    @functools.cached_property
    def machine(self) -> Machine:
        """The reference interpreter of this machine's rows (built on first use)."""
        return reference_machine(self.spec)

    # ------------------------------------------------------------------ rooms

    def create(self, room: PrefillRoom | DecodeRoom | PrefillLink | DecodeLink, now: float) -> list[Action]:
        """Put a fresh room in the initial state; returns the on_create actions (timers)."""
        room.state = self.spec.initial
        ctx = StepContext(now, self.timeouts, source=self.spec.initial)
        for fn, arg in self._on_create:
            fn(room, None, ctx, arg)
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
        """Apply ``event`` by firing the ``transitions`` machine (the reference interpreter)."""
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
        for fn, arg in self._on_error:
            fn(room, event, ctx, arg)
        room.last_row = "on_remote_error"
        ctx.out.append(RecordProtocolError(why))
        return ctx.out


class Protocol:
    """The machines of the loaded spec (a room's on each side, a link's on each side), with the
    timeouts in force."""

    def __init__(self, spec: ProtocolSpec | None = None, timeouts: dict[str, dict[str, float]] | None = None) -> None:
        self.spec = spec or load_spec()
        timeouts = timeouts or {}
        self.prefill = RoomMachine(self.spec.machines["prefill_room"], self.spec.kvpoll, timeouts.get("prefill"))
        self.decode = RoomMachine(self.spec.machines["decode_room"], self.spec.kvpoll, timeouts.get("decode"))
        # the handshake of each (prefill rank, decode rank) pair, as each side sees it
        self.prefill_link = RoomMachine(self.spec.machines["prefill_link"], self.spec.kvpoll)
        self.decode_link = RoomMachine(self.spec.machines["decode_link"], self.spec.kvpoll)
        # pull mode: decode reads prefill's pages under a lease
        self.prefill_pull = RoomMachine(
            self.spec.machines["prefill_pull"], self.spec.kvpoll, timeouts.get("prefill_pull")
        )
        self.decode_pull = RoomMachine(self.spec.machines["decode_pull"], self.spec.kvpoll, timeouts.get("decode_pull"))
        self.codec = Codec(
            self.spec.version,
            {n: m.fields for n, m in self.spec.messages.items()},
            {n: m.binary_id for n, m in self.spec.messages.items() if m.binary_id is not None},
        )

    def machine_for(self, side: str, timeouts: dict[str, float] | None = None) -> RoomMachine:
        """The machine of ``side``; with ``timeouts`` (timer -> seconds, timers of the other side
        ignored) a separate machine with those deadlines."""
        return self._with_timeouts(side, (self.prefill, self.decode), timeouts, "timers")

    def pull_machine_for(self, side: str, timeouts: dict[str, float] | None = None) -> RoomMachine:
        """The pull-mode machine of ``side``; with ``timeouts`` (timer -> seconds, timers of the
        other side's pull machine ignored) a separate machine with those deadlines."""
        return self._with_timeouts(side, (self.prefill_pull, self.decode_pull), timeouts, "pull timers")

    def _with_timeouts(
        self, side: str, pair: tuple[RoomMachine, RoomMachine], timeouts: dict[str, float] | None, what: str
    ) -> RoomMachine:
        """``side``'s machine of ``pair`` (prefill's, decode's), rebuilt with ``timeouts`` where
        given; a timer neither machine has is refused."""
        base = pair[0] if side == "prefill" else pair[1]
        if not timeouts:
            return base
        known = set(pair[0].timeouts) | set(pair[1].timeouts)
        unknown = set(timeouts) - known
        if unknown:
            raise LocalProtocolError(f"unknown {what} {sorted(unknown)}; they are {sorted(known)}")
        mine = {k: v for k, v in timeouts.items() if k in base.timeouts}
        return RoomMachine(base.spec, self.spec.kvpoll, mine)
