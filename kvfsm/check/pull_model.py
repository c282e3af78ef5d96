"""The system model of pull mode that ``kvfsm check --preset pull*`` explores.

Theory of operation
-------------------
One room, ``prefill_ranks`` sources and ``decode_ranks`` readers (nP1D: one decode rank reads
from every prefill rank; 1PnD: every decode rank reads its heads from the one prefill rank).
Rooms are stepped with the same compiled machines the runtime runs (``Protocol().prefill_pull``
and ``.decode_pull``: ``create`` and ``step``); no row is re-implemented here.

Time is integer and the state holds only values relative to now, so the space is finite:
every room is stepped at ``now = 0``; a ``tick`` subtracts 1 from every deadline, claim send
time and lease end the state holds, clamped at a floor below which they all behave alike (a due
timer is just due, a past lease end just past). A timer fires at any time at or after its
deadline (late is what real timers do; the protocol's safety must not depend on punctuality).

Environment: the prefill room exists from the start (its KV complete). The decode engine creates
its room at any time and allocates its pages at any time after; to keep renewals finite it does
so (or aborts) before the room's epoch reaches ``max_epoch``, and from then on a renewal fires
only once no claim or grant of that rank is in flight (an environment bound, not a protocol
change: it removes only runs where heartbeats outpace every delivery for ``max_epoch`` rounds).
Engines abort (``aborts`` in all) and clear as soon as a concluded room accepts it.

Network: every SendMessage is an item delivered at any later time in any order, lost (``loss``)
or duplicated (``dup``); an item for a room that does not exist (cleared, crashed) is dropped.
A PostRead whose deadline is not after now is refused at once (ReadFailed); otherwise the read
lands at any time strictly before its deadline (the ghost state notes which (source, reader)
landed; the read invariants are checked there) or is cancelled at or after it. The transport's
report (ReadCompleted / ReadFailed) reaches decode at any later time; a landed read's
notification (ReadsDone) is a network item. A crashed decode rank's read may still land (the
fabric does not know the process died) but reports to nobody; each prefill rank hears PeerLost
of it at some later time. Prefill ranks do not crash in this model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvfsm.protocol import LocalProtocolError, Protocol
from kvfsm.protocol.actions import CancelTimer, PostRead, RecordProtocolError, SendMessage, SetTimer
from kvfsm.protocol.events import (
    Abort,
    Clear,
    FailureReceived,
    LeaseClaimed,
    LeaseGranted,
    LeaseReleased,
    PagesAllocated,
    PeerLost,
    PeersReady,
    ReadCompleted,
    ReadFailed,
    ReadsNotified,
    TimerFired,
)
from kvfsm.protocol.pull import LEASE_SKEW
from kvfsm.protocol.rooms import Grant, PullSink, PullSource

# Timer lengths of the model, in ticks: renew < lease, window budget < lease, a read's grace.
TIMEOUTS: dict[str, dict[str, float]] = {
    "prefill_pull": {"claim": 4.0, "lease": 3.0},
    "decode_pull": {"bootstrap": 3.0, "renew": 2.0, "window": 1.0, "read": 1.0},
}
TOKENS = 2  # the room's tokens (a page a token on both sides)
DECODE_KV_PAGES = 4
DECODE_PAGES = (1, 2)
ROOM = 0

_LEASE = TIMEOUTS["prefill_pull"]["lease"]
# A lease end at or before now is just "past": every read posted under it is refused at once (and
# the room fails), so its read timer never matters. A claim sent so long ago that it grants a past
# end, likewise. (Two past ends are not ordered any more: a window may be opened or not for one.)
_PAST_END = -1.0
_PAST_CLAIM = round(_PAST_END - _LEASE * (1 - LEASE_SKEW), 6)

# budgets: indices into State[0]
LOSS, DUP, CRASH, ABORTS = range(4)


@dataclass(frozen=True)
class PullConfig:
    prefill_ranks: int = 1
    decode_ranks: int = 1
    loss: int = 0  # messages or notifications lost
    dup: int = 0  # messages or notifications duplicated
    crash: int = 0  # decode ranks that crash
    aborts: int = 0  # engine abort() calls, either side
    early: int = 0  # prefill timers may fire this many ticks early (a clock too fast: unsafe)
    max_epoch: int = 3  # the engine allocates (or aborts) before its room's epoch reaches this
    mutant: str | None = None

    def __post_init__(self) -> None:
        if self.prefill_ranks < 1 or self.decode_ranks < 1:
            raise ValueError("at least one rank on each side")
        if self.prefill_ranks > 1 and self.decode_ranks > 1:
            raise ValueError("one room of nP1D or 1PnD ranks (n P x m D is their composition)")

    def sources(self, d: int) -> tuple[int, ...]:
        return tuple(range(self.prefill_ranks))

    @property
    def readers(self) -> int:
        return self.decode_ranks


# State: (budgets, prefill slots, decode slots, network, reads, reports, notices, landed)
#  prefill slot: (frozen room, deadlines)            | "Cleared" is a room state
#  decode slot:  None (not created) | "X" (crashed) | (frozen room, deadlines, allocated)
#  network item: (dest side, dest rank, message tuple)
#  read:         (decode rank, source rank, deadline)
#  report:       (decode rank, source rank, landed)
#  notice:       (prefill rank, lost decode rank)
#  landed:       (source rank, decode rank) pairs whose read landed (ghost state)
State = tuple[Any, ...]
Label = tuple[Any, ...]


def _t(x: float) -> float:
    return round(x, 6)


def _tag(failure: str | None) -> str | None:
    """A failure's kind without its detail (the details only multiply states; no guard reads them)."""
    return failure.split(":", 1)[0] if failure else failure


def freeze_source(r: PullSource) -> tuple[Any, ...]:
    return (
        r.state,
        _tag(r.failure),
        tuple(sorted(r.timers)),
        r.readers,
        tuple(sorted(r.claimants)),
        tuple(sorted(r.done)),
    )


def thaw_source(f: tuple[Any, ...], rank: int) -> PullSource:
    r = PullSource(ROOM, rank, source_pages(rank), TOKENS)
    r.state, r.failure, timers, r.readers, claimants, done = f
    r.timers, r.claimants, r.done = set(timers), set(claimants), set(done)
    return r


def source_pages(rank: int) -> tuple[int, ...]:
    return (2 * rank + 3, 2 * rank + 4)


def freeze_sink(r: PullSink) -> tuple[Any, ...]:
    grants = tuple(sorted((s, (g.epoch, g.lease_s, g.pages, g.tokens)) for s, g in r.grants.items()))
    claims = tuple(sorted((e, _past_claim(t)) for e, t in r.claims.items()))
    end = r.lease_end if r.lease_end == -math.inf else _past_end(r.lease_end)
    return (r.state, _tag(r.failure), tuple(sorted(r.timers)), r.pages, r.epoch, claims, grants, end,
            tuple(sorted(r.reading)), tuple(sorted(r.read)))  # fmt: skip


def thaw_sink(f: tuple[Any, ...], rank: int, cfg: PullConfig) -> PullSink:
    r = new_sink(rank, cfg)
    r.state, r.failure, timers, r.pages, r.epoch, claims, grants, r.lease_end, reading, read = f
    r.timers, r.claims, r.reading, r.read = set(timers), dict(claims), set(reading), set(read)
    r.grants = {s: Grant(*g) for s, g in grants}
    return r


def new_sink(rank: int, cfg: PullConfig) -> PullSink:
    r = PullSink(ROOM, rank, DECODE_KV_PAGES, cfg.sources(rank), cfg.readers, tokens=TOKENS)
    r.lease_end = -math.inf  # no lease yet (the runtime's clock starts far from 0)
    return r


def _msg(m: Any) -> tuple[Any, ...]:
    return (m.TYPE, *(_tag(v) if f == "reason" else v for f in m.__slots__ for v in (getattr(m, f),)))


def _event(side: str, m: tuple[Any, ...]) -> Any:
    kind = m[0]
    if side == "P":
        if kind == "lease_claim":
            return LeaseClaimed(m[2], m[3], m[4], m[5])
        if kind == "lease_release":
            return LeaseReleased(m[2], m[3])
        if kind == "reads_done":
            return ReadsNotified(m[2])
    elif kind == "lease_grant":
        return LeaseGranted(m[2], m[3], m[4], m[5], m[6])
    elif kind == "room_failed":
        return FailureReceived(m[2], m[3])
    raise ValueError(f"no {side} event for message {m}")


def _past_end(t: float) -> float:
    return _PAST_END if t <= 0 else _t(t)


def _past_claim(t: float) -> float:
    return _PAST_CLAIM if t + _LEASE * (1 - LEASE_SKEW) <= 0 else _t(t)


def _shift(deadlines: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    return tuple((n, max(0.0, _t(d - 1))) for n, d in deadlines)


class PullModel:
    """Successors of a state, with notes: ``!name`` an ``always`` property this transition
    breaks, ``~name`` a ``sometimes`` property it witnesses."""

    def __init__(self, cfg: PullConfig, protocol: Protocol) -> None:
        self.cfg = cfg
        self.protocol = protocol
        self.prefill = protocol.prefill_pull
        self.decode = protocol.decode_pull
        # (side, rank, frozen room, event) -> (actions or None if refused, the room after)
        self._memo: dict[tuple[Any, ...], tuple[list[Any] | None, Any]] = {}
        self.epoch_cap = cfg.max_epoch + cfg.loss + cfg.dup + 2  # beyond the environment bound: none

    # ------------------------------------------------------------------ states

    def initial(self) -> State:
        slots = []
        for p in range(self.cfg.prefill_ranks):
            room: Any = PullSource(ROOM, p, source_pages(p), TOKENS)
            acts = self.prefill.create(room, 0.0)
            slots.append((freeze_source(room), self._timers((), acts)))
        budgets = (self.cfg.loss, self.cfg.dup, self.cfg.crash, self.cfg.aborts)
        return (budgets, tuple(slots), (None,) * self.cfg.decode_ranks, (), (), (), (), ())

    @staticmethod
    def _timers(deadlines: tuple[tuple[str, float], ...], actions: list[Any]) -> tuple[tuple[str, float], ...]:
        d = dict(deadlines)
        for a in actions:
            if isinstance(a, SetTimer):
                d[a.timer] = max(0.0, _t(a.deadline))
            elif isinstance(a, CancelTimer):
                d.pop(a.timer, None)
        return tuple(sorted(d.items()))

    def tick(self, s: State) -> State:
        budgets, ps, ds, net, reads, reports, notices, landed = s
        ps = tuple((f, _shift(dl)) for f, dl in ps)
        new_ds: list[Any] = []
        for slot in ds:
            if isinstance(slot, tuple):
                f, dl, alloc = slot
                claims = tuple((e, _past_claim(t - 1)) for e, t in f[5])
                end = f[7] if f[7] == -math.inf else _past_end(f[7] - 1)
                slot = ((*f[:5], claims, f[6], end, *f[8:]), _shift(dl), alloc)
            new_ds.append(slot)
        reads = tuple(sorted((d, p, dl if dl == math.inf else max(0.0, _t(dl - 1))) for d, p, dl in reads))
        return (budgets, ps, tuple(new_ds), net, reads, reports, notices, landed)

    # ------------------------------------------------------------------ successors

    def successors(self, s: State) -> Iterator[tuple[Label, State, frozenset[str]]]:
        """Every transition of ``s``. Items for a room that is gone (cleared, crashed) are
        dropped as soon as it goes: delivered they would be dropped, and losing or duplicating
        them only spends a budget."""
        for label, t, notes in self._successors(s):
            yield label, self._gc(t), notes

    @staticmethod
    def _gc(s: State) -> State:
        gone_p = {p for p, (f, _) in enumerate(s[1]) if f[0] == "Cleared"}
        gone_d = {d for d, slot in enumerate(s[2]) if slot == "X" or (slot is not None and slot[0][0] == "Cleared")}
        if not gone_p and not gone_d:
            return s
        net = tuple(i for i in s[3] if i[1] not in (gone_p if i[0] == "P" else gone_d))
        reports = tuple(r for r in s[5] if r[0] not in gone_d)
        notices = tuple(n for n in s[6] if n[0] not in gone_p)
        return (s[0], s[1], s[2], net, s[4], reports, notices, s[7])

    def _successors(self, s: State) -> Iterator[tuple[Label, State, frozenset[str]]]:
        budgets, ps, ds, net, reads, reports, notices, landed = s
        cfg = self.cfg
        yield ("tick",), self.tick(s), frozenset()
        for p, (f, dl) in enumerate(ps):
            for name, when in dl:
                if when <= cfg.early:
                    yield self._step(s, "P", p, TimerFired(name), ("timer", f"P{p}", name))
            if budgets[ABORTS] and f[0] != "Cleared":
                yield self._step(s, "P", p, Abort(), ("abort", f"P{p}"), spend=ABORTS)
        for d, slot in enumerate(ds):
            if slot is None:
                yield self._create(s, d)
                continue
            if slot == "X":
                continue
            f, dl, alloc = slot
            cleared = f[0] == "Cleared"
            for name, when in dl:
                if when <= 0 and (name != "renew" or self._may_renew(s, d, f, alloc)):
                    yield self._step(s, "D", d, TimerFired(name), ("timer", f"D{d}", name))
            if not alloc and not cleared:
                pages = PagesAllocated(DECODE_PAGES, -1, TOKENS)
                yield self._step(s, "D", d, pages, ("allocate", f"D{d}"), allocate=True)
            if budgets[ABORTS] and not cleared:
                yield self._step(s, "D", d, Abort(), ("abort", f"D{d}"), spend=ABORTS)
            if budgets[CRASH] and not cleared:
                yield self._crash(s, d)
        for i, item in enumerate(net):
            if i and net[i - 1] == item:
                continue
            rest = net[:i] + net[i + 1 :]
            yield self._deliver(s, rest, item)
            if budgets[LOSS]:
                yield ("lose", item), self._with(s, budgets=_spend(budgets, LOSS), net=rest), frozenset()
            if budgets[DUP]:
                yield ("duplicate", item), self._with(s, budgets=_spend(budgets, DUP), net=_add(net, item)), frozenset()
        for i, (d, p, when) in enumerate(reads):
            rest = reads[:i] + reads[i + 1 :]
            if when > 0:
                yield self._land(s, rest, d, p)
            else:
                yield self._cancel(s, rest, d, p)
        for i, (d, p, ok) in enumerate(reports):
            if i and reports[i - 1] == (d, p, ok):
                continue
            ev = ReadCompleted(p) if ok else ReadFailed(p, "read cancelled at its deadline")
            base = self._with(s, reports=reports[:i] + reports[i + 1 :])
            if ds[d] == "X" or ds[d][0][0] == "Cleared":
                yield ("drop", ("report", f"D{d}", ev.trigger, f"P{p}")), base, frozenset()
                continue
            yield self._step(base, "D", d, ev, ("report", f"D{d}", ev.trigger, f"P{p}"))
        for i, (p, d) in enumerate(notices):
            base = self._with(s, notices=notices[:i] + notices[i + 1 :])
            if ps[p][0][0] == "Cleared":
                yield ("drop", ("peer_lost", f"P{p}", f"D{d}")), base, frozenset()
                continue
            yield self._step(base, "P", p, PeerLost(d, "decode rank crashed"), ("peer_lost", f"P{p}", f"D{d}"))

    def _may_renew(self, s: State, d: int, f: tuple[Any, ...], alloc: bool) -> bool:
        """The environment bound on heartbeats (see the module docstring)."""
        epoch = f[4]
        if epoch < self.cfg.max_epoch:
            return True
        if not alloc or epoch >= self.epoch_cap:
            return False
        return not any(
            (side == "P" and m[0] == "lease_claim" and m[2] == d) or (side == "D" and r == d and m[0] == "lease_grant")
            for side, r, m in s[3]
        )

    @staticmethod
    def _with(s: State, **parts: Any) -> State:
        names = ("budgets", "ps", "ds", "net", "reads", "reports", "notices", "landed")
        return tuple(parts.get(n, s[i]) for i, n in enumerate(names))

    # ------------------------------------------------------------------ transitions

    def _create(self, s: State, d: int) -> tuple[Label, State, frozenset[str]]:
        room: Any = new_sink(d, self.cfg)
        # created with its links up (the handshake is the link machines', checked on their own):
        # Linking is left at once (L1)
        acts = self.decode.create(room, 0.0)
        acts += self.decode.step(room, PeersReady(), 0.0)
        ds = list(s[2])
        ds[d] = (freeze_sink(room), self._timers((), acts), False)
        out = self._with(s, ds=tuple(ds))
        notes: set[str] = set()
        out = self._apply(out, "D", d, acts, notes)
        return ("create", f"D{d}"), out, frozenset(notes)

    def _step(self, s: State, side: str, rank: int, ev: Any, label: Label, *, spend: int = -1,
              optional: bool = False, allocate: bool = False) -> tuple[Label, State, frozenset[str]]:  # fmt: skip
        notes: set[str] = set()
        out = self._event(s, side, rank, ev, notes, optional=optional)
        if out is None:
            return label, s, frozenset({"refused"})
        if spend >= 0:
            out = self._with(out, budgets=_spend(out[0], spend))
        if allocate:
            ds = list(out[2])
            f, dl, _ = ds[rank]
            ds[rank] = (f, dl, True)
            out = self._with(out, ds=tuple(ds))
        return label, out, frozenset(notes)

    def _event(
        self, s: State, side: str, rank: int, ev: Any, notes: set[str], *, optional: bool = False
    ) -> State | None:
        """Step ``rank``'s room with ``ev`` and carry out the actions; None if a local event
        (a clear) is refused and ``optional``."""
        if side == "P":
            f, dl = s[1][rank]
            machine = self.prefill
        else:
            f, dl, alloc = s[2][rank]
            machine = self.decode
        if isinstance(ev, TimerFired):
            dl = tuple((n, w) for n, w in dl if n != ev.timer)
        before_state = f[0]
        key = (side, rank, f, ev)
        hit = self._memo.get(key)
        if hit is None:
            room: Any = thaw_source(f, rank) if side == "P" else thaw_sink(f, rank, self.cfg)
            try:
                hit = (machine.step(room, ev, 0.0), room)
            except LocalProtocolError:
                hit = (None, room)
            self._memo[key] = hit
        acts, room = hit
        if acts is None:
            if optional:
                return None
            notes.add("!pull_events_accepted")
            return s
        if any(isinstance(a, RecordProtocolError) for a in acts):
            notes.add("!pull_events_accepted")
        new_dl = self._timers(dl, acts)
        if side == "P":
            if room.last_row == "Q3" and dict(new_dl).get("lease", 0) > dict(dl).get("lease", 0):
                notes.add("~lease_extended")
            ps = list(s[1])
            ps[rank] = (freeze_source(room), new_dl)
            s = self._with(s, ps=tuple(ps))
        else:
            if room.state == "Success" and before_state != "Success":
                notes.add("~pull_room_succeeds")
                if not all((p, rank) in s[7] for p in room.sources):
                    notes.add("!no_false_pull_success")
            ds = list(s[2])
            ds[rank] = (freeze_sink(room), new_dl, alloc)
            s = self._with(s, ds=tuple(ds))
        s = self._apply(s, side, rank, acts, notes)
        if room.state in ("Success", "Failed") and not isinstance(ev, Clear):
            # the engine clears as soon as the concluded room accepts it
            cleared = self._event(s, side, rank, Clear(), notes, optional=True)
            if cleared is not None:
                notes.add("cleared")
                s = cleared
        return s

    def _apply(self, s: State, side: str, rank: int, acts: list[Any], notes: set[str]) -> State:
        """Carry out a step's messages and reads (timers were taken into the slot)."""
        net = s[3]
        refused: list[int] = []
        for a in acts:
            if isinstance(a, SendMessage):
                net = _add(net, ("D" if side == "P" else "P", a.peer_rank, _msg(a.message)))
            elif isinstance(a, PostRead):
                if a.deadline <= 0:
                    refused.append(a.src_rank)  # the runtime refuses a read that cannot end in time
                else:
                    reads = tuple(sorted((*s[4], (rank, a.src_rank, _t(a.deadline)))))
                    s = self._with(s, reads=reads)
        s = self._with(s, net=net)
        for p in refused:
            out = self._event(s, "D", rank, ReadFailed(p, "deadline passed before posting"), notes)
            assert out is not None
            s = out
        return s

    def _deliver(self, s: State, rest: tuple[Any, ...], item: tuple[Any, ...]) -> tuple[Label, State, frozenset[str]]:
        side, rank, m = item
        s = self._with(s, net=rest)
        if side == "P":
            alive = s[1][rank][0][0] != "Cleared"
        else:
            slot = s[2][rank]
            alive = isinstance(slot, tuple) and slot[0][0] != "Cleared"
        if not alive:
            return ("drop", item), s, frozenset()
        notes: set[str] = set()
        out = self._event(s, side, rank, _event(side, m), notes)
        assert out is not None
        return ("deliver", item), out, frozenset(notes)

    def _land(self, s: State, rest: tuple[Any, ...], d: int, p: int) -> tuple[Label, State, frozenset[str]]:
        notes: set[str] = set()
        if s[1][p][0][0] == "Cleared":
            notes.add("!no_read_of_freed_blocks")
        slot = s[2][d]
        if slot != "X":
            f = slot[0]
            if f[0] == "Cleared" or f[3] != DECODE_PAGES:
                notes.add("!no_read_into_released_pages")
        landed = tuple(sorted({*s[7], (p, d)}))
        out = self._with(s, reads=rest, landed=landed)
        if slot != "X":
            out = self._with(out, net=_add(out[3], ("P", p, ("reads_done", ROOM, d))),
                             reports=tuple(sorted((*out[5], (d, p, True)))))  # fmt: skip
        return ("land", f"P{p}", f"D{d}"), out, frozenset(notes)

    def _cancel(self, s: State, rest: tuple[Any, ...], d: int, p: int) -> tuple[Label, State, frozenset[str]]:
        out = self._with(s, reads=rest)
        if s[2][d] != "X":
            out = self._with(out, reports=tuple(sorted((*out[5], (d, p, False)))))
        return ("cancel", f"P{p}", f"D{d}"), out, frozenset()

    def _crash(self, s: State, d: int) -> tuple[Label, State, frozenset[str]]:
        ds = list(s[2])
        ds[d] = "X"
        reports = tuple(r for r in s[5] if r[0] != d)
        notices = tuple(sorted((*s[6], *((p, d) for p in range(self.cfg.prefill_ranks)))))
        out = self._with(s, budgets=_spend(s[0], CRASH), ds=tuple(ds), reports=reports, notices=notices)
        return ("crash", f"D{d}"), out, frozenset()

    # ------------------------------------------------------------------ liveness

    def leaked(self, s: State) -> list[str]:
        """liveness.no_leaked_blocks, on a quiescent state: what is not cleared or still in flight."""
        out = [f"P{p}: {f[0]}" for p, (f, _) in enumerate(s[1]) if f[0] != "Cleared"]
        out += [
            f"D{d}: {slot[0][0]}" for d, slot in enumerate(s[2]) if isinstance(slot, tuple) and slot[0][0] != "Cleared"
        ]
        if s[3] or s[4] or s[5] or s[6]:
            out.append("items in flight")
        return out


def _spend(budgets: tuple[int, ...], i: int) -> tuple[int, ...]:
    return (*budgets[:i], budgets[i] - 1, *budgets[i + 1 :])


def _add(items: tuple[Any, ...], item: Any) -> tuple[Any, ...]:
    return tuple(sorted((*items, item), key=repr))


def _leaked_predicate(model: PullModel, s: State) -> list[str]:
    return model.leaked(s)


def _edge(*_: Any) -> bool:  # checked on the transitions PullModel._event / _land note
    return True


PULL_PREDICATES: dict[str, Callable[..., Any]] = {
    "no_read_of_freed_blocks": PullModel._land,
    "no_read_into_released_pages": PullModel._land,
    "no_false_pull_success": PullModel._event,
    "pull_events_accepted": PullModel._event,
    "pull_room_succeeds": PullModel._event,
    "lease_extended": PullModel._event,
    "no_leaked_blocks": _leaked_predicate,
}
