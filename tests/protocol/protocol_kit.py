"""Shared helpers for the protocol tests (imported by the test modules; not collected itself).

* ``new_room`` and short event constructors (``announce``, ``ready``, ``arrived`` ...);
* ``reachable(kind, state)``: hypothesis strategies that drive a fresh room into one leaf state
  along a path the protocol allows, with varied contents (one or two decode ranks or sources,
  page counts, chunking, interleaving, which writes or notifications already arrived);
* ``event_for(trigger, room)``: arbitrary payloads of one trigger, mixed with payloads taken from
  the room itself (repeats, pending writes) so that guards are seen both ways;
* ``checked_step``: one step plus the invariants every step must keep, whatever the state and the
  event (h2's "every state x every input");
* ``Wire``: prefill and decode rooms over a fake control plane (messages go through the codec),
  data plane (writes land in a page map, then notify, then complete) and clock (aioquic timers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from kvfsm.protocol import (
    AUX_WRITE,
    Action,
    CancelTimer,
    DecodeRoom,
    LocalProtocolError,
    PostAuxWrite,
    PostWrite,
    PrefillRoom,
    Protocol,
    RecordIgnored,
    RecordProtocolError,
    RoomMachine,
    SendMessage,
    SetTimer,
    load_spec,
)
from kvfsm.protocol.events import (
    Abort,
    AbortReceived,
    AuxArrived,
    ChunkArrived,
    ChunkReady,
    Clear,
    Event,
    FailureReceived,
    PagesAllocated,
    PagesAnnounced,
    PeerLost,
    PeersReady,
    TimerFired,
    WriteCompleted,
    WriteFailed,
    WritesDrained,
)
from kvfsm.protocol.routing import message_event
from kvfsm.protocol.wire import AbortNotice, AuxWritten, ChunkWritten, Codec, Drained, RoomFailed, RoomPages

SPEC = load_spec()
PROTOCOL = Protocol(SPEC)
MACHINES: dict[str, RoomMachine] = {"prefill": PROTOCOL.prefill, "decode": PROTOCOL.decode}
KINDS = tuple(MACHINES)
CODEC = Codec(SPEC.version, {n: m.fields for n, m in SPEC.messages.items()})
ACTION_TYPES = (SendMessage, PostWrite, PostAuxWrite, SetTimer, CancelTimer, RecordIgnored, RecordProtocolError)

ROOM_ID = 7
KV_PAGES = 64  # every rank's registered KV region, in pages
AUX_SLOTS = 8
DECODE_PAGES = (10, 11, 12, 13)  # what decode rank 0 allocates in hand-written tests
DECODE_AUX = 2

# trigger -> cause, for every trigger of either room machine (timer triggers are local)
_ROOMS = ("prefill_room", "decode_room")
TIMER_OF_TRIGGER = {t.trigger: t.name for name in _ROOMS for t in SPEC.machines[name].timers.values()}
# (the link and pull machines' own triggers are not push room events: tests/protocol/test_links.py
# and tests/protocol/test_pull.py cover them)
_ROOM_TRIGGERS = {t for name in _ROOMS for t in SPEC.machines[name].triggers}
_OTHER_TRIGGERS = {t for name, m in SPEC.machines.items() if name not in _ROOMS for t in m.triggers} - _ROOM_TRIGGERS
CAUSE = {
    e.key: e.cause for e in SPEC.events.values() if e.key != "timeout" and e.key not in _OTHER_TRIGGERS
} | dict.fromkeys(TIMER_OF_TRIGGER, "local")
ALL_TRIGGERS = tuple(sorted(CAUSE))
FAILED = SPEC.kvpoll["Failed"]  # KVPoll code of Failed and of Fenced (failed, pages still fenced)
ANNOUNCED = ("WaitingForInput.Announced", "Transferring")  # decode states whose pages a source may write


def kvpoll_of(kind: str, state: str) -> int | None:
    """The KVPoll code ``state`` projects to (None for Cleared), read from spec/."""
    name = machine_spec(kind).states[state].kvpoll
    return None if name is None else SPEC.kvpoll[name]


def machine_spec(kind: str) -> Any:
    return MACHINES[kind].spec


def rows_by_id(kind: str) -> dict[str, Any]:
    return {r.id: r for r in machine_spec(kind).rows}


# ====================================================================== rooms and events


def new_room(
    kind: str, *, rank: int = 0, sources: Sequence[int] = (0,), required_dests: int = 1, now: float = 0.0
) -> Any:
    """A fresh room of ``kind`` in its initial state (its on_create actions already applied)."""
    room: PrefillRoom | DecodeRoom
    if kind == "prefill":
        room = PrefillRoom(ROOM_ID, rank, KV_PAGES, AUX_SLOTS)
    else:
        room = DecodeRoom(ROOM_ID, rank, KV_PAGES, AUX_SLOTS, tuple(sources), required_dests)
    MACHINES[kind].create(room, now)
    return room


def announce(
    pages: Sequence[int] = DECODE_PAGES,
    *,
    dest: int = 0,
    aux: int = DECODE_AUX,
    required: int = 1,
    peer_kv_pages: int = KV_PAGES,
    peer_aux_slots: int = AUX_SLOTS,
) -> PagesAnnounced:
    """room_pages from decode rank ``dest`` as the prefill runtime hands it over."""
    return PagesAnnounced(dest, tuple(pages), aux, required, peer_kv_pages, peer_aux_slots)


def ready(pages: Iterable[int], *, last: bool = False, aux: int = 0) -> ChunkReady:
    """The engine's next chunk of local pages; the last chunk carries the aux slot."""
    return ChunkReady(tuple(pages), last, aux if last else None)


def arrived(chunk_id: int, token_start: int, num_tokens: int, *, src: int = 0, last: bool = False) -> ChunkArrived:
    return ChunkArrived(src, chunk_id, last, token_start, num_tokens)


def allocated(pages: Sequence[int] = DECODE_PAGES, aux: int = DECODE_AUX) -> PagesAllocated:
    return PagesAllocated(tuple(pages), aux)


def fired(timer: str) -> TimerFired:
    return TimerFired(timer)


def run(kind: str, room: Any, events: Iterable[Event], *, reference: bool = False, t0: float = 1.0) -> list[Action]:
    """Apply ``events`` in order (each checked); returns the actions of the last one."""
    actions: list[Action] = []
    for i, ev in enumerate(events):
        actions = checked_step(kind, room, ev, t0 + i, reference=reference)
    return actions


def snapshot(room: Any) -> dict[str, Any]:
    """Every field of a (slotted) room, deep-copied: equal snapshots mean an unchanged room."""
    return {f.name: _copy(getattr(room, f.name)) for f in dataclasses.fields(room)}


def _copy(v: Any) -> Any:
    # Room fields nest dicts, lists and sets around immutable values (ints, str, tuples, frozen
    # dataclasses); copying just the containers is a deep copy, ~5x cheaper than copy.deepcopy.
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy(x) for x in v]
    if isinstance(v, set):
        return set(v)
    assert v is None or isinstance(v, int | float | str | tuple) or dataclasses.is_dataclass(v), type(v)
    return v


def of_type(actions: Iterable[Action], cls: type) -> list[Any]:
    return [a for a in actions if isinstance(a, cls)]


def messages(actions: Iterable[Action], cls: type) -> list[tuple[int, Any]]:
    """(peer_rank, message) of every SendMessage carrying a ``cls`` message."""
    return [(a.peer_rank, a.message) for a in of_type(actions, SendMessage) if isinstance(a.message, cls)]


# ====================================================================== the checked step


def checked_step(
    kind: str, room: Any, event: Event, now: float, *, reference: bool = False, machine: RoomMachine | None = None
) -> list[Action]:
    """One step (compiled table, or the transitions machine with ``reference``) and its invariants.

    Raises LocalProtocolError as the machine does, after checking that it left the room unchanged
    and that the event was of a local cause (a peer's event never raises).
    """
    machine = machine or MACHINES[kind]
    room.last_row = ""  # a trace field: cleared so that we see which row this step fires
    before = snapshot(room)
    old = room.state
    step = machine.step_reference if reference else machine.step
    try:
        actions = step(room, event, now)
    except LocalProtocolError:
        assert event.cause == "local", f"remote {event} raised LocalProtocolError in {old}"
        assert snapshot(room) == before, f"LocalProtocolError for {event} changed the room"
        raise
    check_step(kind, machine, before, room, event, actions, now)
    return actions


def check_step(
    kind: str, machine: RoomMachine, before: dict[str, Any], room: Any, event: Event, actions: list[Action], now: float
) -> None:
    spec = machine.spec
    old, new = before["state"], room.state
    assert new in spec.states, f"{event} left the room in unknown state {new!r}"
    assert all(isinstance(a, ACTION_TYPES) for a in actions), actions
    assert room.last_row, f"{event} in {old}: a step that returns must record its row"

    # Which row fired, and whether the state change is that row's.
    if room.last_row == "on_remote_error":
        assert event.cause == "remote", f"local {event} went through on_remote_error"
        assert actions and isinstance(actions[-1], RecordProtocolError)
        if spec.states[old].terminal:  # a concluded room only reports a peer's fault
            assert len(actions) == 1
            assert snapshot(room) == before | {"last_row": "on_remote_error"}
        else:
            assert new == spec.error_dest
            assert room.failure, "a room failed by a protocol error must say why"
    else:
        row = rows_by_id(kind)[room.last_row]
        assert old in row.sources, f"row {row.id} fired in {old}, not one of its sources {row.sources}"
        assert event.trigger in row.triggers, f"row {row.id} fired for {event.trigger}"
        assert new == (row.dest or old), f"row {row.id} moved {old} -> {new}, spec says {row.dest or old}"
        assert not of_type(actions, RecordProtocolError)

    # Failed is sticky; Success never turns into Failed; only clear leaves them.
    if old in ("Failed", "Success"):
        assert new in (old, "Cleared"), f"{event} moved a {old} room to {new}"
        assert new == old or event.trigger == "clear"
    # KVPoll Failed is sticky too: Fenced (failed, pages still reserved) only ever moves on to Failed,
    # and clear is refused there (the pages may still be written).
    if kvpoll_of(kind, old) == FAILED:
        assert kvpoll_of(kind, new) == FAILED or (old, new, event.trigger) == ("Failed", "Cleared", "clear"), (
            f"{event} moved a failed {old} room to {new}"
        )
    if old == "Fenced":
        assert new in ("Fenced", "Failed"), f"{event} moved a Fenced room to {new}"
    if kvpoll_of(kind, new) == FAILED:
        assert room.failure, "a failed room must carry a reason"

    # Timer bookkeeping: the actions replayed on the armed set give the room's armed set.
    armed = set(before["timers"])
    for a in actions:
        if isinstance(a, SetTimer):
            assert a.timer in machine.timeouts, f"{spec.name} has no timer {a.timer!r}"
            assert a.deadline == now + machine.timeouts[a.timer]
            armed.add(a.timer)
        elif isinstance(a, CancelTimer):
            assert a.timer in armed, f"cancelled timer {a.timer!r} that was not armed"
            armed.discard(a.timer)
    assert armed == room.timers
    check_timers_armed(machine, room)

    if kind == "prefill":
        check_writes(room, actions)
        check_prefill_tells(before, room, event, actions)
    else:
        check_fence(machine, before, room, event, actions, now)


def check_timers_armed(machine: RoomMachine, room: Any) -> None:
    """A concluded room arms no timer; a live one has at least one armed, and every armed timer
    is one its state accepts (firing it can never be a LocalProtocolError)."""
    if room.state == "Cleared" or machine.is_terminal(room.state):
        assert not room.timers, f"{room.state} room still arms {room.timers}"
        return
    assert room.timers, f"{room.state} has no armed timer: the room could wait forever"
    for t in room.timers:
        trigger = machine.spec.timers[t].trigger
        assert machine.accepts(room.state, trigger), f"timer {t} is armed in {room.state}, which has no row for it"


def check_writes(room: PrefillRoom, actions: list[Action]) -> None:
    """No byte is written before every expected decode rank announced, nor outside its pages."""
    for a in actions:
        if isinstance(a, PostWrite):
            assert len(room.dests) == room.required_dests >= 1
            ann = room.dests[a.dest_rank]
            n = a.notification
            assert (n.room, n.src, n.chunk_id) == (room.room, room.rank, a.chunk_id)
            # the chunk's tokens: its source pages hold them from the first; the destination
            # pages are exactly those that hold them (a page a token without layouts)
            ps, dp, first, end = room.page_size, ann.page_size, n.token_start, n.token_start + n.num_tokens
            assert first % ps == 0 and end <= ann.tokens
            assert -(-n.num_tokens // ps) == len(a.src_pages) or (a.notification.is_last and n.num_tokens == 0)
            lo, hi = first // dp, (-(-end // dp) if end > first else first // dp)
            assert a.dst_pages == ann.pages[lo:hi]
            assert all(0 <= p < room.kv_pages for p in a.src_pages)
            assert (a.dest_rank, a.chunk_id) in room.inflight
        elif isinstance(a, PostAuxWrite):
            assert len(room.dests) == room.required_dests >= 1
            assert a.dst_slot == room.dests[a.dest_rank].aux_slot
            assert 0 <= a.src_slot < room.aux_slots
            assert (a.notification.room, a.notification.src) == (room.room, room.rank)
            assert (a.dest_rank, AUX_WRITE) in room.inflight


def _notified(actions: list[Action]) -> list[int]:
    """Ranks that got an abort or room_failed notice in ``actions``, in order."""
    return [r for r, _ in messages(actions, AbortNotice) + messages(actions, RoomFailed)]


def check_prefill_tells(before: dict[str, Any], room: PrefillRoom, event: Event, actions: list[Action]) -> None:
    """What a prefill room tells decode ranks about a failure and about its writes.

    * A room entering Failed tells every decode rank that announced, and one whose room_pages it
      rejects without recording (P2, on_remote_error): that rank holds pages for the room too.
    * ``drained`` goes from a concluded room only: from Failed, or from Success when it answers a
      decode rank's abort or loss (P21, a retransmission of a drained that may have been lost).
    * It never goes to a decode rank a write of this room may still land in, only to a decode rank
      that announced (recorded, or announcing in this very step), at most once per rank and step,
      and after the reason when both go in one step.
    * It goes to every recorded decode rank the moment nothing is in flight any more (entering
      Failed, the last pending write concluding, or answering an abort or loss in P21), and at once
      to an announcer that was never recorded: nothing was ever written to it.
    """
    old, new = before["state"], room.state
    announcer = event.dest_rank if isinstance(event, PagesAnnounced) else None
    unrecorded = announcer is not None and new == "Failed" and announcer not in room.dests
    told = set(room.dests) | ({announcer} if unrecorded else set())
    if new == "Failed" and old != "Failed":
        assert set(_notified(actions)) >= told, "a failure must be told to every decode rank holding pages"

    sent = messages(actions, Drained)
    drained = [d for d, _ in sent]
    assert all(msg == Drained(room.room, room.rank) for _, msg in sent), sent
    if sent:
        assert new in ("Failed", "Success"), f"drained sent by a room in {new}"
        if new == "Success":
            assert old == "Success" and event.trigger in ("abort_received", "peer_lost"), (
                f"drained from Success for {event.trigger} (row {room.last_row})"
            )
        assert len(set(drained)) == len(drained), f"drained twice in one step: {drained}"
        # an aborting decode rank that was never recorded is answered too: nothing was written to it
        aborter = event.rank if isinstance(event, AbortReceived) and event.side == "decode" else None
        allowed = set(room.dests) | {announcer, aborter}
        assert set(drained) <= allowed, f"drained to a rank that neither announced nor aborted: {drained}"
        busy = {d for d, _ in room.inflight}
        assert not set(drained) & busy, f"drained to {sorted(set(drained) & busy)} while a write to it is in flight"
        sends = [a for a in actions if isinstance(a, SendMessage)]
        for dest in drained:
            notices = [
                i
                for i, a in enumerate(sends)
                if a.peer_rank == dest and isinstance(a.message, AbortNotice | RoomFailed)
            ]
            first_drained = next(
                i for i, a in enumerate(sends) if a.peer_rank == dest and isinstance(a.message, Drained)
            )
            assert all(i < first_drained for i in notices), "a decode rank hears why the room failed before drained"

    if unrecorded:
        assert announcer in drained, f"rejected announcer {announcer} must be told drained at once ({room.last_row})"
    # a decode rank that aborts without being recorded is answered at once: nothing was written to it
    aborter = event.rank if isinstance(event, AbortReceived) and event.side == "decode" else None
    answered = (
        {aborter} if aborter is not None and aborter not in room.dests and new in ("Failed", "Success") else set()
    )
    if new == "Failed" and not room.inflight and (old != "Failed" or before["inflight"]):
        # entered Failed with nothing in flight, or the last write in flight just concluded
        assert sorted(drained) == sorted(told | answered), (room.last_row, drained, told)
    if old == new and new in ("Failed", "Success") and event.trigger in ("abort_received", "peer_lost"):
        # P21: a decode rank that aborts is fenced; answer again once nothing is in flight
        assert room.last_row == "P21"
        want = sorted(answered | (set() if room.inflight else set(room.dests)))
        assert sorted(drained) == want, f"P21 answers drained to {want} (in flight: {room.inflight}), sent {drained}"


def check_fence(
    machine: RoomMachine, before: dict[str, Any], room: DecodeRoom, event: Event, actions: list[Action], now: float
) -> None:
    """Decode pages a source may write into are fenced until every such source drained or died,
    or the fence timer fired; a failure is told to every source."""
    old, new = before["state"], room.state
    if new == "Fenced":
        assert room.timers == {"fence"}, room.timers
        assert room.undrained <= set(room.sources)
        assert room.undrained or not room.sources, "a fence nobody can release early"
        if old != "Fenced" or room.last_row == "on_remote_error":  # (re)entered: fence every writer
            lost = event.peer_rank if isinstance(event, PeerLost) else None
            assert room.undrained == set(room.sources) - {lost}
            assert SetTimer("fence", now + machine.timeouts["fence"]) in actions
        else:  # the fence only shrinks, one source at a time
            assert room.undrained <= before["undrained"] and len(before["undrained"] - room.undrained) <= 1
    if old == "Fenced" and new == "Failed":
        assert event.trigger == "fence_timeout" or not room.undrained, "pages released while a source may write"
        assert not room.timers
    if old in ANNOUNCED and new == "Failed":  # pages announced: released at once only if no source can write
        assert isinstance(event, PeerLost) and set(room.sources) <= {event.peer_rank}, room.last_row
    if kvpoll_of("decode", new) == FAILED and kvpoll_of("decode", old) != FAILED:
        sent = messages(actions, AbortNotice)
        assert [r for r, _ in sent] == list(room.sources), "a decode failure must be told to every source"
        assert all(m.side == "decode" and m.reason == room.failure for _, m in sent)


# ====================================================================== reachable rooms


@dataclass(frozen=True)
class Path:
    """A fresh room of ``kind`` built with ``kwargs``, then ``events`` applied in order."""

    kind: str
    kwargs: tuple[tuple[str, Any], ...]
    events: tuple[Event, ...]

    def build(self, *, reference: bool = False) -> Any:
        room = new_room(self.kind, **dict(self.kwargs))
        run(self.kind, room, self.events, reference=reference)
        return room


class _Driver:
    """Steps a scratch room while a path is drawn, so that later draws can look at it."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        self.kind = kind
        self.kwargs = tuple(sorted(kwargs.items()))
        self.room = new_room(kind, **kwargs)
        self.events: list[Event] = []

    def push(self, *events: Event) -> None:
        for ev in events:
            checked_step(self.kind, self.room, ev, float(len(self.events) + 1))
            self.events.append(ev)

    def path(self, want: str) -> Path:
        assert self.room.state == want, f"path built {self.room.state}, wanted {want}"
        return Path(self.kind, self.kwargs, tuple(self.events))

    @classmethod
    def replay(cls, path: Path) -> _Driver:
        d = cls(path.kind, **dict(path.kwargs))
        d.push(*path.events)
        return d


def _segments(draw: Any, pages: Sequence[int], min_chunks: int = 1) -> list[tuple[int, ...]]:
    """Split ``pages`` into consecutive chunks; every chunk but the last is non-empty."""
    n = len(pages)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3)) if n > 1 else set())
    bounds = [0, *cuts, n]
    chunks = [tuple(pages[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    if len(chunks) < min_chunks or draw(st.booleans()):
        chunks.append(())  # an empty last chunk is legal: everything was in the earlier ones
    return chunks


def _interleave(draw: Any, a: Sequence[Event], b: Sequence[Event]) -> list[Event]:
    """Merge two sequences, each keeping its own order."""
    slots = draw(st.permutations([0] * len(a) + [1] * len(b)))
    ia, ib = iter(a), iter(b)
    return [next(ia) if s == 0 else next(ib) for s in slots]


_LIVE = {
    "prefill": ("Bootstrapping.Waiting", "Bootstrapping.Holding", "WaitingForInput", "Transferring.Sending",
                "Transferring.Draining"),
    "decode": ("Bootstrapping", "WaitingForInput.Allocating", "WaitingForInput.Announced", "Transferring"),
}  # fmt: skip


@st.composite
def _prefill(draw: Any, want: str) -> Path:
    if want in ("Failed", "Cleared"):
        return draw(_concluded("prefill", want))
    n_pages = draw(st.integers(1, 6))
    dests = draw(st.lists(st.integers(0, 3), unique=True, min_size=1, max_size=2))
    local = draw(st.lists(st.integers(0, KV_PAGES - 1), unique=True, min_size=n_pages, max_size=n_pages))
    announcements = []
    for d in dests:
        pages = draw(st.lists(st.integers(0, KV_PAGES - 1), unique=True, min_size=n_pages, max_size=n_pages))
        aux = draw(st.integers(0, AUX_SLOTS - 1))
        announcements.append(announce(pages, dest=d, aux=aux, required=len(dests)))
    sending = want == "Transferring.Sending"
    segs = _segments(draw, local, min_chunks=2 if sending else 1)
    aux_slot = draw(st.integers(0, AUX_SLOTS - 1))
    chunks = [ready(s, last=i == len(segs) - 1, aux=aux_slot) for i, s in enumerate(segs)]

    d = _Driver("prefill")
    if want == "Bootstrapping.Waiting":
        d.push(*announcements[: draw(st.integers(0, len(dests) - 1))])
    elif want == "Bootstrapping.Holding":
        some = announcements[: draw(st.integers(0, len(dests) - 1))]
        d.push(*_interleave(draw, some, chunks[: draw(st.integers(1, len(chunks)))]))
    elif want == "WaitingForInput":
        d.push(*announcements)
    else:
        posted = chunks[: draw(st.integers(1, len(chunks) - 1))] if sending else chunks
        # any interleaving: chunks before the last announcement are held and posted by it (P6/P7)
        d.push(*_interleave(draw, announcements, posted))
        pending = sorted(d.room.inflight)
        if want == "Success":
            done = draw(st.permutations(pending))
        else:
            done = draw(st.permutations(pending))[: draw(st.integers(0, len(pending) - (0 if sending else 1)))]
        d.push(*(WriteCompleted(dest, cid) for dest, cid in done))
    return d.path(want)


@st.composite
def _decode(draw: Any, want: str) -> Path:
    if want in ("Failed", "Cleared"):
        return draw(_concluded("decode", want))
    if want == "Fenced":
        return draw(_fenced()).path(want)
    sources = tuple(draw(st.lists(st.integers(0, 3), unique=True, min_size=1, max_size=2)))
    required = draw(st.integers(1, 2))
    n_pages = draw(st.integers(0, 6))
    pages = draw(st.lists(st.integers(0, KV_PAGES - 1), unique=True, min_size=n_pages, max_size=n_pages))
    aux = draw(st.integers(0, AUX_SLOTS - 1))
    notes: list[Event] = []
    for src in sources:
        segs = _segments(draw, range(n_pages))
        for i, s in enumerate(segs):
            start = s[0] if s else n_pages
            notes.append(arrived(i, start, len(s), src=src, last=i == len(segs) - 1))
        notes.append(AuxArrived(src))

    d = _Driver("decode", sources=sources, required_dests=required)
    if want == "Bootstrapping":
        return d.path(want)
    d.push(PeersReady())
    if want == "WaitingForInput.Allocating":
        return d.path(want)
    d.push(allocated(pages, aux))
    if want == "WaitingForInput.Announced":
        return d.path(want)
    order = draw(st.permutations(notes))
    if want == "Transferring":
        order = order[: draw(st.integers(1, len(order) - 1))]
    d.push(*order)
    if order and draw(st.booleans()):
        d.push(draw(st.sampled_from(order)))  # a duplicated notification changes nothing
    return d.path(want)


@st.composite
def _concluded(draw: Any, kind: str, want: str) -> Path:
    """Failed: a live room plus an event that fails it (decode: failed before it announced, every
    source lost, or a fence released), then late news; Cleared: a concluded room plus clear."""
    if want == "Cleared":
        base = draw(reachable(kind, draw(st.sampled_from(["Failed", "Success"]))))
        if kind == "prefill":  # clear waits until no posted write still reads the source pages (P27)
            inflight = sorted(base.build().inflight)
            base = Path(kind, base.kwargs, (*base.events, *(WriteCompleted(*w) for w in inflight)))
        return Path(kind, base.kwargs, (*base.events, Clear()))
    d = draw(_prefill_failed() if kind == "prefill" else _decode_failed())
    assert d.room.state == "Failed", d.room.state
    # late news for a failed room: ignored, whatever it is
    late: list[Event] = [Abort(), PeerLost(1, "late")]
    if kind == "prefill":
        late += [AbortReceived(0, "decode", "late")]
        late += [WriteCompleted(*w) for w in sorted(d.room.inflight)]  # writes still draining (P28b)
    else:
        late += [AbortReceived(0, "prefill", "late"), WritesDrained(0), arrived(0, 0, 1)]
    d.push(*draw(st.lists(st.sampled_from(late), max_size=2)))
    return d.path(want)


@st.composite
def _prefill_failed(draw: Any) -> _Driver:
    d = _Driver.replay(draw(reachable("prefill", draw(st.sampled_from(_LIVE["prefill"])))))
    room = d.room
    failing = [
        Abort("engine gave up"),
        PeerLost(0, "link down"),
        AbortReceived(0, "decode", "peer aborted"),
        AuxArrived(0),  # no prefill row: on_remote_error
        *(fired(t) for t in sorted(room.timers)),
    ]
    if room.state.startswith("Transferring") and room.inflight:  # a failure of an unknown write is ignored
        failing.append(WriteFailed(*sorted(room.inflight)[0], "nic error"))
    d.push(draw(st.sampled_from(failing)))
    return d


@st.composite
def _decode_failed(draw: Any) -> _Driver:
    route = draw(st.sampled_from(["fence released", "before announcing", "every source lost"]))
    if route == "fence released":
        d = draw(_fenced())
        if draw(st.booleans()):
            d.push(fired("fence"))  # no confirmation came (D27)
        else:  # every source the fence waits for confirms or dies, in any order (D26 ... D25)
            for src in draw(st.permutations(sorted(d.room.undrained))):
                d.push(draw(st.sampled_from([WritesDrained(src), PeerLost(src, "crash")])))
        return d
    if route == "before announcing":  # nothing announced, nothing can be written (D14, D16, D18)
        d = _Driver.replay(draw(reachable("decode", draw(st.sampled_from(_LIVE["decode"][:2])))))
        src = draw(st.sampled_from(d.room.sources))
        failing = [Abort("engine gave up"), fired("bootstrap"), PeerLost(src, "link down"),
                   AbortReceived(src, "prefill", "peer aborted"), FailureReceived(src, "prefill failed")]  # fmt: skip
        d.push(draw(st.sampled_from(failing)))
        return d
    # pages announced, and every source dies: the last loss releases them (D23, or D24 then D25)
    d = _Driver.replay(draw(reachable("decode", draw(st.sampled_from(ANNOUNCED)))))
    for src in draw(st.permutations(d.room.sources)):
        d.push(PeerLost(src, "crash"))
    return d


@st.composite
def _fenced(draw: Any) -> _Driver:
    """A decode room whose pages are fenced: a live room, an event that fails it while a source may
    still write, then events that keep it fenced (late news, some sources confirming)."""
    live = draw(st.sampled_from([*ANNOUNCED, *ANNOUNCED, *_LIVE["decode"][:2]]))  # mostly announced
    d = _Driver.replay(draw(reachable("decode", live)))
    room = d.room
    src = draw(st.sampled_from(room.sources))
    foreign = [WriteCompleted(0, 0)]  # no row in a live state: on_remote_error
    if live in ANNOUNCED:
        failing = [Abort("engine gave up"), fired("transfer"), AbortReceived(src, "prefill", "aborted"),
                   FailureReceived(src, "prefill failed"), arrived(0, 0, 1, src=9), AuxArrived(9), *foreign]  # fmt: skip
        if len(room.sources) > 1:
            failing.append(PeerLost(src, "crash"))  # another source may still write
    else:
        # a foreign event before we announced fences too (on_remote_error is the same in every
        # state); a premature notification fails without a fence (D29)
        failing = [*foreign]
    d.push(draw(st.sampled_from(failing)))
    assert room.state == "Fenced", (room.state, room.last_row)
    for _ in range(draw(st.integers(0, 3))):
        keep = [Abort(), PeersReady(), allocated(), PeerLost(9, "other link"), WritesDrained(9),
                AbortReceived(src, "prefill", "late"), FailureReceived(src, "late"), AuxArrived(src),
                arrived(0, 0, 1, src=src)]  # fmt: skip
        if len(room.undrained) > 1:
            s = draw(st.sampled_from(sorted(room.undrained)))
            keep += [WritesDrained(s), PeerLost(s, "crash")]  # one of several confirms (D26)
        d.push(draw(st.sampled_from(keep)))
        assert room.state == "Fenced", (room.state, room.last_row)
    return d


def reachable(kind: str, state: str) -> st.SearchStrategy[Path]:
    """Paths from a fresh room of ``kind`` to leaf ``state`` that the protocol allows."""
    return (_prefill if kind == "prefill" else _decode)(state)


def any_reachable(kind: str) -> st.SearchStrategy[Path]:
    return st.sampled_from(list(machine_spec(kind).states)).flatmap(lambda s: reachable(kind, s))


# ====================================================================== arbitrary events

_rank = st.integers(0, 3)
_text = st.text(max_size=12)
_pages = st.lists(st.integers(0, KV_PAGES + 4), max_size=6).map(tuple)  # may repeat or overflow
_good_pages = st.lists(st.integers(0, KV_PAGES - 1), unique=True, max_size=6).map(tuple)
_slot = st.integers(0, AUX_SLOTS + 1)


def event_for(trigger: str, room: Any) -> st.SearchStrategy[Event]:
    """Payloads of ``trigger``: arbitrary ones, and ones made from the room's own contents."""
    if trigger in TIMER_OF_TRIGGER:
        return st.just(TimerFired(TIMER_OF_TRIGGER[trigger]))
    options: list[st.SearchStrategy[Any]] = []
    if trigger == "pages_announced":
        options.append(st.builds(PagesAnnounced, _rank, _pages | _good_pages, _slot, st.integers(0, 3),
                                 st.sampled_from([0, 8, KV_PAGES]), st.sampled_from([0, 4, AUX_SLOTS])))  # fmt: skip
        dests = getattr(room, "dests", {})
        if dests:
            n = len(next(iter(dests.values())).pages)
            same = [announce(a.pages, dest=d, aux=a.aux_slot, required=room.required_dests) for d, a in dests.items()]
            options.append(st.sampled_from(same))  # a duplicated room_pages
            fresh = st.lists(st.integers(0, KV_PAGES - 1), unique=True, min_size=n, max_size=n)
            options.append(st.builds(lambda p, d: announce(p, dest=d, required=room.required_dests), fresh, _rank))
    elif trigger == "chunk_ready":
        options.append(st.builds(ChunkReady, _pages | _good_pages, st.booleans(), st.none() | _slot))
        options.append(st.builds(lambda p, last: ready(p, last=last), _good_pages, st.booleans()))
    elif trigger in ("write_completed", "write_failed"):
        ids = st.tuples(_rank, st.integers(-1, 4))
        inflight = sorted(getattr(room, "inflight", ()))
        if inflight:
            ids = ids | st.sampled_from(inflight)
        if trigger == "write_completed":
            options.append(ids.map(lambda i: WriteCompleted(*i)))
        else:
            options.append(st.builds(lambda i, r: WriteFailed(i[0], i[1], r), ids, _text))
    elif trigger == "chunk_arrived":
        small = st.integers(0, 8)
        options.append(st.builds(ChunkArrived, _rank, st.integers(0, 5), st.booleans(), small, small))
        got = [(s, c, v) for s, cs in getattr(room, "received", {}).items() for c, v in cs.items()]
        if got:
            options.append(st.sampled_from([ChunkArrived(s, c, v[2], v[0], v[1]) for s, c, v in got]))
    elif trigger == "aux_arrived":
        options.append(st.builds(AuxArrived, _rank))
    elif trigger == "abort":
        options.append(st.builds(Abort, _text))
    elif trigger == "clear":
        options.append(st.just(Clear()))
    elif trigger == "peers_ready":
        options.append(st.just(PeersReady()))
    elif trigger == "pages_allocated":
        options.append(st.builds(PagesAllocated, _pages | _good_pages, _slot))
    elif trigger == "abort_received":
        options.append(st.builds(AbortReceived, _rank, st.sampled_from(["prefill", "decode"]), _text))
    elif trigger == "failure_received":
        options.append(st.builds(FailureReceived, _rank, _text))
    elif trigger == "peer_lost":
        options.append(st.builds(PeerLost, _rank, _text))
        if getattr(room, "undrained", None):
            options.append(st.builds(PeerLost, st.sampled_from(sorted(room.undrained)), _text))
    elif trigger == "writes_drained":
        options.append(st.builds(WritesDrained, _rank))
        known = sorted({*getattr(room, "undrained", ()), *getattr(room, "sources", ())})
        if known:
            options.append(st.builds(WritesDrained, st.sampled_from(known)))  # a source the fence may wait for
    else:
        raise AssertionError(f"no strategy for trigger {trigger!r}")
    return st.one_of(options)


# ====================================================================== the fake wire


def notified(write: PostWrite | PostAuxWrite) -> Event:
    """The decode room's event for a write's notification, after a trip through the codec."""
    note = CODEC.decode(CODEC.encode(write.notification))
    if isinstance(note, ChunkWritten):
        return ChunkArrived(note.src, note.chunk_id, note.is_last, note.token_start, note.num_tokens)
    assert isinstance(note, AuxWritten)
    return AuxArrived(note.src)


def completion_id(write: PostWrite | PostAuxWrite) -> int:
    """The chunk_id of a write's WriteCompleted / WriteFailed (AUX_WRITE for the aux write)."""
    return write.chunk_id if isinstance(write, PostWrite) else AUX_WRITE


@dataclass
class Wire:
    """Prefill ranks and decode ranks of one room, connected by hand.

    Control messages are encoded and decoded by the codec and delivered by ``deliver``; posted
    writes wait in ``writes`` until ``land`` copies their pages into ``memory``, then delivers the
    notification to the decode rank and the completion to the prefill rank (data before
    notification, as the spec requires). ``advance`` moves the clock and fires due timers.
    """

    prefill_ranks: Sequence[int] = (0,)
    decode_ranks: Sequence[int] = (0,)
    sources: Sequence[int] | None = None  # what each decode rank expects; default: every prefill rank
    required_dests: int | None = None  # decode ranks per prefill rank; default: every decode rank
    registered: dict[int, tuple[int, int]] = field(default_factory=dict)  # decode rank -> (kv, aux)
    timeouts: dict[str, dict[str, float]] = field(default_factory=dict)  # Protocol(timeouts=...)
    now: float = 0.0

    def __post_init__(self) -> None:
        protocol = Protocol(SPEC, self.timeouts)
        self.machines = {"prefill": protocol.prefill, "decode": protocol.decode}
        required = self.required_dests or len(self.decode_ranks)
        sources = tuple(self.sources if self.sources is not None else self.prefill_ranks)
        self.rooms: dict[tuple[str, int], Any] = {}
        for r in self.prefill_ranks:
            self.rooms["prefill", r] = PrefillRoom(ROOM_ID, r, KV_PAGES, AUX_SLOTS)
        for r in self.decode_ranks:
            self.rooms["decode", r] = DecodeRoom(ROOM_ID, r, KV_PAGES, AUX_SLOTS, sources, required)
            self.registered.setdefault(r, (KV_PAGES, AUX_SLOTS))
        self.deadlines: dict[tuple[str, int], dict[str, float]] = {k: {} for k in self.rooms}
        self.outbox: list[tuple[str, int, bytes]] = []  # (to side, to rank, encoded message)
        self.writes: list[tuple[int, PostWrite | PostAuxWrite]] = []  # (prefill rank, write)
        # decode rank -> its page (aux slot) -> prefill rank -> the local page (slot) written there
        self.memory: dict[int, dict[int, dict[int, int]]] = {r: {} for r in self.decode_ranks}
        self.aux_memory: dict[int, dict[int, dict[int, int]]] = {r: {} for r in self.decode_ranks}
        self.log: list[tuple[str, int, Event, list[Action]]] = []
        for (side, rank), room in self.rooms.items():
            self._route(side, rank, self.machines[side].create(room, self.now))

    # ------------------------------------------------------------------ access

    def p(self, rank: int = 0) -> PrefillRoom:
        return self.rooms["prefill", rank]

    def d(self, rank: int = 0) -> DecodeRoom:
        return self.rooms["decode", rank]

    def kvpoll(self, side: str, rank: int = 0) -> int:
        return self.machines[side].kvpoll(self.rooms[side, rank])

    def actions(self, side: str | None = None, rank: int | None = None) -> list[Action]:
        return [a for s, r, _, acts in self.log if side in (None, s) and rank in (None, r) for a in acts]

    # ------------------------------------------------------------------ driving

    def prefill(self, event: Event, rank: int = 0) -> list[Action]:
        return self.step("prefill", rank, event)

    def decode(self, event: Event, rank: int = 0) -> list[Action]:
        return self.step("decode", rank, event)

    def step(self, side: str, rank: int, event: Event) -> list[Action]:
        room = self.rooms[side, rank]
        actions = checked_step(side, room, event, self.now, machine=self.machines[side])
        self.log.append((side, rank, event, actions))
        self._route(side, rank, actions)
        return actions

    def decode_announces(self, pages: Sequence[int] = DECODE_PAGES, aux: int = DECODE_AUX, rank: int = 0) -> None:
        """Decode rank ``rank``: handshake done, pages allocated; its room_pages are in the outbox."""
        self.decode(PeersReady(), rank)
        self.decode(allocated(pages, aux), rank)

    def deliver(self) -> int:
        """Deliver every pending control message (and those sent in reaction), in order.

        A message for a cleared room is dropped, as the runtime forgets cleared rooms."""
        n = 0
        while self.outbox:
            side, rank, data = self.outbox.pop(0)
            room = self.rooms.get((side, rank))
            if room is None or room.state == "Cleared":
                continue
            self.step(side, rank, self._event_of(side, CODEC.decode(data)))
            n += 1
        return n

    def land(self, index: int = 0, *, notify: bool = True, complete: bool = True) -> None:
        """Write ``index`` lands: its data, then its notification, then its completion."""
        src, w = self.writes.pop(index)
        decode = self.rooms.get(("decode", w.dest_rank))
        if isinstance(w, PostWrite):
            for s, d in zip(w.src_pages, w.dst_pages, strict=True):
                self.memory[w.dest_rank].setdefault(d, {})[src] = s
        else:
            self.aux_memory[w.dest_rank].setdefault(w.dst_slot, {})[src] = w.src_slot
        event, chunk_id = notified(w), completion_id(w)
        if notify and decode is not None and decode.state != "Cleared":
            self.decode(event, w.dest_rank)
        if complete and self.p(src).state != "Cleared":
            self.prefill(WriteCompleted(w.dest_rank, chunk_id), src)

    def land_all(self) -> None:
        while self.writes:
            self.land(0)

    def advance(self, seconds: float) -> None:
        """Move the clock by ``seconds``, firing every timer that falls due, earliest first."""
        end = self.now + seconds
        while True:
            due = [(dl, side, rank, t) for (side, rank), ts in self.deadlines.items() for t, dl in ts.items()]
            due = [d for d in due if d[0] <= end]
            if not due:
                break
            dl, side, rank, t = min(due)
            self.now = dl
            self.step(side, rank, TimerFired(t))  # the room still counts it armed: it may cancel it
            if self.deadlines[side, rank].get(t) == dl:
                del self.deadlines[side, rank][t]  # fired and neither cancelled nor re-armed
        self.now = end

    # ------------------------------------------------------------------ plumbing

    def _route(self, side: str, rank: int, actions: list[Action]) -> None:
        other = "decode" if side == "prefill" else "prefill"
        for a in actions:
            if isinstance(a, SetTimer):
                self.deadlines[side, rank][a.timer] = a.deadline
            elif isinstance(a, CancelTimer):
                del self.deadlines[side, rank][a.timer]
            elif isinstance(a, SendMessage):
                self.outbox.append((other, a.peer_rank, CODEC.encode(a.message)))
            elif isinstance(a, PostWrite | PostAuxWrite):
                assert side == "prefill", a
                self.writes.append((rank, a))

    def _event_of(self, side: str, msg: Any) -> Event:
        """The room event of ``msg`` on ``side``, as the runtime's routing makes it."""
        kv, aux = self.registered.get(msg.decode_rank, (0, 0)) if isinstance(msg, RoomPages) else (0, 0)
        event = message_event(side, msg, kv, aux)
        assert event is not None, f"no room event for {msg} on {side}"
        return event
