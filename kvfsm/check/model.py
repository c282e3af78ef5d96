"""The system model that ``kvfsm check`` explores.

Theory of operation
-------------------
One system state composes every room machine of every rank on both sides, the engines that
drive them, the runtime's routing, and the network, as one hashable tuple:

    (slots, fifo, bag, landed, budgets, crashed)

* ``slots``: one per (room, side, rank): ``None`` (the engine has not created it), ``("E", events)``
  (prefill: messages that arrived before the engine created the room, kept as the runtime keeps
  them), or the room's frozen fields (``freeze``), whose first element is its machine state.
* ``fifo``: per (sender, receiver) FIFO queues of control messages (``ordered=True``; else they
  live in the bag). ``bag``: a multiset of everything unordered: notifications, writes in flight
  (data not yet landed), completions, peer-loss notices.
* ``landed``: which (room, source, chunk, destination) writes have landed (ghost state for the
  invariants). ``budgets``: faults and engine aborts still allowed. ``crashed``: dead nodes.

Rooms are stepped with the *same* compiled protocol the runtime runs (``RoomMachine.step``);
each (frozen room, event) result is memoised, so a step in the inner loop is a dict lookup.
Every action the runtime can take is a model action: engine calls (create, send a chunk, init,
abort, clear), message delivery, loss and duplication (bounded), crash (bounded), and every armed
timer firing (nondeterministically, at any time: a timeout may race anything).

Timing assumption: the decode ``fence`` timer (release pages without every source's drain
confirmation) fires only when no write to that room's pages is in flight and every source room
has concluded or crashed — the real timeout is chosen longer than any source's own timers.

Successors come with notes: ``!name`` for a violated ``always`` property, ``~name`` for a
``sometimes`` property that the transition witnesses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from kvfsm.check.properties import edge_notes, landing_notes
from kvfsm.protocol import (
    AUX_WRITE,
    LocalProtocolError,
    PostAuxWrite,
    PostWrite,
    Protocol,
    SendMessage,
)
from kvfsm.protocol.events import (
    Abort,
    AbortReceived,
    AuxArrived,
    ChunkArrived,
    ChunkReady,
    Clear,
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
from kvfsm.protocol.machine import RoomMachine
from kvfsm.protocol.rooms import Announcement, DecodeRoom, PrefillRoom
from kvfsm.protocol.wire import MESSAGE_CLASSES, Message

FAILED, SUCCESS = 0, 4
Item = tuple[Any, ...]
State = tuple[Any, ...]
Label = tuple[Any, ...]


@dataclass(frozen=True)
class CheckConfig:
    prefill_ranks: int = 2
    decode_ranks: int = 2
    rooms: int = 2
    chunks: int = 2
    loss: int = 0  # messages, notifications or writes (a hung transfer) that may be lost
    dup: int = 0  # messages or notifications that may be delivered twice
    crash: int = 0  # ranks that may crash
    aborts: int = 0  # engine abort() calls
    ordered: bool = True  # per-pair FIFO for control messages (ZMQ); notifications never ordered
    order: str = "any"  # any | decode-first (scenario 1 only) | prefill-first (scenario 2 only)
    mutant: str | None = None

    def __post_init__(self) -> None:
        if min(self.prefill_ranks, self.decode_ranks, self.rooms, self.chunks) < 1:
            raise ValueError("ranks, rooms and chunks must be at least 1")
        if self.order not in ("any", "decode-first", "prefill-first"):
            raise ValueError(f"order must be any, decode-first or prefill-first, not {self.order!r}")


def sources_of(cfg: CheckConfig, d: int) -> tuple[int, ...]:
    """Prefill ranks a decode rank receives from (SGLang's rank mapping, §3.1)."""
    if cfg.prefill_ranks >= cfg.decode_ranks:
        return tuple(p for p in range(cfg.prefill_ranks) if p % cfg.decode_ranks == d)
    return (d % cfg.prefill_ranks,)


def dests_of(cfg: CheckConfig, p: int) -> tuple[int, ...]:
    return tuple(d for d in range(cfg.decode_ranks) if p in sources_of(cfg, d))


# ----------------------------------------------------------------------------- freezing rooms


def _code(failure: str | None) -> str:
    return "" if failure is None else failure.split(":", 1)[0]


def freeze_prefill(r: PrefillRoom) -> tuple[Any, ...]:
    return (
        r.state,
        _code(r.failure),
        tuple(sorted(r.timers)),
        tuple(sorted((k, a.pages, a.aux_slot) for k, a in r.dests.items())),
        r.required_dests,
        tuple((c.pages, c.is_last, -1 if c.aux_slot is None else c.aux_slot) for c in r.held),
        r.last_seen,
        r.next_chunk,
        r.cursor,
        tuple(sorted(r.inflight)),
    )


def thaw_prefill(t: tuple[Any, ...], room: int, rank: int, kv_pages: int, aux_slots: int) -> PrefillRoom:
    state, code, timers, dests, req, held, last_seen, next_chunk, cursor, inflight = t
    return PrefillRoom(
        room, rank, kv_pages, aux_slots, state=state, failure=code or None, timers=set(timers),
        dests={k: Announcement(pages, aux) for k, pages, aux in dests}, required_dests=req,
        held=[ChunkReady(pages, last, None if aux < 0 else aux) for pages, last, aux in held],
        last_seen=last_seen, next_chunk=next_chunk, cursor=cursor, inflight=set(inflight),
    )  # fmt: skip


def freeze_decode(r: DecodeRoom) -> tuple[Any, ...]:
    return (
        r.state,
        _code(r.failure),
        tuple(sorted(r.timers)),
        r.pages,
        r.aux_slot,
        tuple(sorted((src, tuple(sorted((cid, *v) for cid, v in got.items()))) for src, got in r.received.items())),
        tuple(sorted(r.last_count.items())),
        tuple(sorted(r.aux_done)),
        tuple(sorted(getattr(r, "undrained", ()))),
    )


def thaw_decode(
    t: tuple[Any, ...], room: int, rank: int, kv_pages: int, aux_slots: int, sources: tuple[int, ...], req: int
) -> DecodeRoom:
    state, code, timers, pages, aux, received, last_count, aux_done, undrained = t
    r = DecodeRoom(
        room, rank, kv_pages, aux_slots, sources, req, state=state, failure=code or None, timers=set(timers),
        pages=pages, aux_slot=aux,
        received={src: {cid: (start, n, last) for cid, start, n, last in got} for src, got in received},
        last_count=dict(last_count), aux_done=set(aux_done),
    )  # fmt: skip
    if hasattr(r, "undrained"):
        r.undrained = set(undrained)
    return r


def _msg_tuple(msg: Message) -> tuple[Any, ...]:
    """A message as a sortable tuple, with free-text reasons blanked (they do not change behaviour)."""
    return (msg.TYPE, *("" if f.name == "reason" else getattr(msg, f.name) for f in fields(msg)))


def _msg(t: tuple[Any, ...]) -> Message:
    cls: Any = MESSAGE_CLASSES[t[0]]
    msg: Message = cls(*t[1:])
    return msg


@dataclass
class _Builder:
    """A mutable copy of a state while one successor is computed."""

    slots: list[Any]
    fifo: dict[tuple[str, str], list[Item]]
    bag: list[Item]
    landed: set[tuple[int, int, int, int]]
    budgets: list[int]
    crashed: set[str]
    lost: set[tuple[str, str]]  # (node, dead peer) once the node received the peer-loss notice
    notes: set[str] = field(default_factory=set)

    def freeze(self) -> State:
        return (
            tuple(self.slots),
            tuple(sorted((k, tuple(q)) for k, q in self.fifo.items() if q)),
            tuple(sorted(self.bag)),
            tuple(sorted(self.landed)),
            tuple(self.budgets),
            tuple(sorted(self.crashed)),
            tuple(sorted(self.lost)),
        )


class Model:
    """Successor function of the composed system (see the module docstring)."""

    def __init__(self, cfg: CheckConfig, protocol: Protocol | None = None) -> None:
        from kvfsm.check.mutants import mutated_protocol

        self.cfg = cfg
        self.protocol = protocol or mutated_protocol(cfg.mutant)
        self.pm: RoomMachine = self.protocol.prefill
        self.dm: RoomMachine = self.protocol.decode
        P, D, R, C = cfg.prefill_ranks, cfg.decode_ranks, cfg.rooms, cfg.chunks
        self.kv_pages = R * C
        self.aux_slots = R
        self.sources = [sources_of(cfg, d) for d in range(D)]
        self.dests = [dests_of(cfg, p) for p in range(P)]
        # slot index -> (side, room, rank)
        self.slot_info: list[tuple[str, int, int]] = [("P", r, p) for r in range(R) for p in range(P)]
        self.slot_info += [("D", r, d) for r in range(R) for d in range(D)]
        self.slot_index = {info: i for i, info in enumerate(self.slot_info)}
        self._cache: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # (side, state) pairs where some row accepts clear (its guards may still refuse it)
        self._clearable = {("P", st) for st in self.pm.spec.states if self.pm.accepts(st, "clear")}
        self._clearable |= {("D", st) for st in self.dm.spec.states if self.dm.accepts(st, "clear")}
        self._polls: dict[tuple[str, str], int] = {}
        for side, m in (("P", self.pm), ("D", self.dm)):
            for name, st in m.spec.states.items():
                if st.kvpoll is not None:
                    self._polls[(side, name)] = self.protocol.spec.kvpoll[st.kvpoll]
        self.cache_misses = 0

    # ------------------------------------------------------------------ helpers

    def pages(self, room: int) -> tuple[int, ...]:
        return tuple(room * self.cfg.chunks + k for k in range(self.cfg.chunks))

    def node(self, side: str, rank: int) -> str:
        return f"{side}{rank}"

    def kvpoll(self, side: str, frozen: Any) -> int | None:
        """KVPoll code of a slot (None: not created, early, expired or cleared)."""
        if frozen is None:
            return None
        return self._polls.get((side, frozen[0]))

    def initial(self) -> State:
        c = self.cfg
        return _Builder(
            [None] * len(self.slot_info), {}, [], set(), [c.loss, c.dup, c.crash, c.aborts], set(), set()
        ).freeze()

    # ------------------------------------------------------------------ stepping one room

    def _step(self, side: str, room: int, rank: int, frozen: Any, event: Any) -> tuple[Any, ...]:
        """(frozen', outputs, row) of one machine step, memoised. outputs are network items."""
        key = (side, room, rank, frozen, event)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        self.cache_misses += 1
        if side == "P":
            obj: Any = thaw_prefill(frozen, room, rank, self.kv_pages, self.aux_slots)
            actions = self.pm.step(obj, event, 0.0)
            new = freeze_prefill(obj)
        else:
            src = self.sources[rank]
            req = len(self.dests[src[0]])
            obj = thaw_decode(frozen, room, rank, self.kv_pages, self.aux_slots, src, req)
            actions = self.dm.step(obj, event, 0.0)
            new = freeze_decode(obj)
        me = self.node(side, rank)
        out: list[Item] = []
        for a in actions:
            if isinstance(a, SendMessage):
                other = "D" if side == "P" else "P"
                out.append(("m", me, self.node(other, a.peer_rank), _msg_tuple(a.message)))
            elif isinstance(a, PostWrite):
                out.append(("w", me, self.node("D", a.dest_rank), room, a.chunk_id, _msg_tuple(a.notification)))
            elif isinstance(a, PostAuxWrite):
                out.append(("w", me, self.node("D", a.dest_rank), room, AUX_WRITE, _msg_tuple(a.notification)))
        result = (new, tuple(out), obj.last_row)
        self._cache[key] = result
        return result

    def _create(self, side: str, room: int, rank: int) -> Any:
        key = ("create", side, room, rank)
        hit = self._cache.get(key)
        if hit is None:
            if side == "P":
                obj: Any = PrefillRoom(room, rank, self.kv_pages, self.aux_slots)
                self.pm.create(obj, 0.0)
                hit = freeze_prefill(obj)
            else:
                src = self.sources[rank]
                obj = DecodeRoom(room, rank, self.kv_pages, self.aux_slots, src, len(self.dests[src[0]]))
                self.dm.create(obj, 0.0)
                hit = freeze_decode(obj)
            self._cache[key] = hit
        return hit

    def _apply(self, b: _Builder, idx: int, event: Any) -> None:
        """Step slot ``idx`` with ``event``; enqueue its outputs; check edge properties."""
        side, room, rank = self.slot_info[idx]
        before = b.slots[idx]
        new, outputs, row = self._step(side, room, rank, before, event)
        b.slots[idx] = new
        unroutable = []
        for item in outputs:
            if item[0] == "w" and (item[1], item[2]) in b.lost:
                unroutable.append(item)  # runtime: no route to a peer known dead; the job fails at once
            else:
                self._enqueue(b, item)
        self._edge_notes(b, idx, side, room, rank, before, new, outputs, row, event)
        for item in unroutable:
            self._apply(b, idx, WriteFailed(int(item[2][1:]), item[4], ""))

    def _enqueue(self, b: _Builder, item: Item) -> None:
        dst = item[1] if item[0] in ("c", "l") else item[2]
        if dst in b.crashed:
            if item[0] == "w":  # a write into a dead node fails at once
                self._enqueue(b, ("c", item[1], item[3], int(dst[1:]), item[4], False))
            return  # anything else to a dead node is lost with it
        if item[0] == "m" and self.cfg.ordered:
            b.fifo.setdefault((item[1], item[2]), []).append(item)
        else:
            b.bag.append(item)

    # ------------------------------------------------------------------ properties on edges

    def _edge_notes(
        self, b: _Builder, idx: int, side: str, room: int, rank: int, before: Any, new: Any,
        outputs: tuple[Item, ...], row: str, event: Any,
    ) -> None:  # fmt: skip
        edge_notes(self, b, idx, side, room, rank, before, new, outputs, row, event)

    # ------------------------------------------------------------------ successors

    def successors(self, state: State) -> Iterator[tuple[Label, State, frozenset[str]]]:
        slots, fifo, bag, landed, budgets, crashed, lost = state
        cfg = self.cfg
        dead = set(crashed)

        def fresh() -> _Builder:
            return _Builder(
                list(slots), {k: list(q) for k, q in fifo}, list(bag), set(landed), list(budgets), set(crashed),
                set(lost),
            )  # fmt: skip

        def emit(label: Label, b: _Builder) -> tuple[Label, State, frozenset[str]]:
            return label, b.freeze(), frozenset(b.notes)

        # --- engine calls
        for idx, (side, room, rank) in enumerate(self.slot_info):
            if self.node(side, rank) in dead:
                continue
            cur = slots[idx]
            if cur is None or (isinstance(cur, tuple) and cur[0] in ("E", "X")):
                if self._may_create(slots, side, room, rank):
                    b = fresh()
                    self._do_create(b, idx, side, room, rank)
                    yield emit(("create", side, rank, room), b)
                if cur is not None and cur[0] == "E":
                    # the runtime forgets early messages after early_ttl_s (< the fence timer)
                    b = fresh()
                    self._expire_stash(b, idx, rank, room)
                    yield emit(("expire", rank, room), b)
                continue
            state_name = cur[0]
            if state_name == "Cleared":
                continue
            if side == "P" and self._may_send(slots, cur, room):
                b = fresh()
                handed = cur[7] + len(cur[5])
                last = handed == cfg.chunks - 1
                src_page = self.pages(room)[handed]
                ev = ChunkReady((src_page,), last, room if last else None)
                self._apply(b, idx, ev)
                yield emit(("send", rank, room, handed), b)
            if side == "D" and state_name == "WaitingForInput.Allocating":
                b = fresh()
                self._apply(b, idx, PagesAllocated(self.pages(room), room))
                yield emit(("init", rank, room), b)
            if budgets[3] > 0:  # an AbortReq may arrive in any state, even after Success
                b = fresh()
                b.budgets[3] -= 1
                self._apply(b, idx, Abort(""))
                yield emit(("abort", side, rank, room), b)
            if (side, state_name) in self._clearable:
                b = fresh()
                try:
                    self._apply(b, idx, Clear())
                except LocalProtocolError:
                    pass  # refused (e.g. writes still read the pages): the engine waits
                else:
                    yield emit(("clear", side, rank, room), b)
            # --- timers
            for timer in cur[2]:
                if timer == "fence" and not self._fence_may_fire(state, room, rank):
                    continue
                b = fresh()
                self._apply(b, idx, TimerFired(timer))
                yield emit(("timer", side, rank, room, timer), b)

        # --- deliveries, losses, duplications
        heads: list[tuple[Item, str, int]] = [(q[0], "fifo", i) for i, (_, q) in enumerate(fifo)]
        seen: set[Item] = set()
        for i, item in enumerate(bag):
            if item not in seen:
                seen.add(item)
                heads.append((item, "bag", i))
        for item, where, _ in heads:
            b = fresh()
            self._take(b, item, where)
            self._deliver(b, item)
            yield emit(("deliver", item), b)
            lossy = item[0] in ("m", "n", "w")
            if lossy and budgets[0] > 0:
                b = fresh()
                self._take(b, item, where)
                b.budgets[0] -= 1
                if item[0] == "w":
                    # the data plane reports every posted write's fate: a lost write fails
                    self._enqueue(b, ("c", item[1], item[3], int(item[2][1:]), item[4], False))
                yield emit(("lose", item), b)
            if item[0] in ("m", "n") and budgets[1] > 0:
                b = fresh()
                b.budgets[1] -= 1
                self._enqueue(b, item)
                yield emit(("duplicate", item), b)

        # --- crashes
        if budgets[2] > 0:
            for side, n in (("P", cfg.prefill_ranks), ("D", cfg.decode_ranks)):
                for rank in range(n):
                    name = self.node(side, rank)
                    if name in dead:
                        continue
                    b = fresh()
                    b.budgets[2] -= 1
                    self._crash(b, name)
                    yield emit(("crash", side, rank), b)

    def _may_create(self, slots: tuple[Any, ...], side: str, room: int, rank: int) -> bool:
        order = self.cfg.order
        if order == "any":
            return True
        if order == "decode-first" and side == "P":
            # scenario 1: prefill's engine starts only after its decode ranks announced
            return all(
                isinstance(slots[self.slot_index[("D", room, d)]], tuple)
                and slots[self.slot_index[("D", room, d)]][0] not in ("Bootstrapping", "WaitingForInput.Allocating")
                for d in self.dests[rank]
            )
        if order == "prefill-first" and side == "D":
            # scenario 2: decode's engine starts only after its sources handed over every chunk
            for p in self.sources[rank]:
                s = slots[self.slot_index[("P", room, p)]]
                if not (isinstance(s, tuple) and s[0] not in ("E", "X") and s[6]):
                    return False
            return True
        return True

    def _may_send(self, slots: tuple[Any, ...], cur: Any, room: int) -> bool:
        state_name = cur[0]
        if state_name not in (
            "Bootstrapping.Waiting",
            "Bootstrapping.Holding",
            "WaitingForInput",
            "Transferring.Sending",
        ):
            return False
        return bool(cur[7] + len(cur[5]) < self.cfg.chunks)

    def _fence_may_fire(self, state: State, room: int, rank: int) -> bool:
        """Timing assumption of the fence timer: it is longer than any write or message can stay
        in flight, than prefill keeps early messages, and than any source room can live."""
        slots, fifo, bag, *_ = state
        me = self.node("D", rank)
        if any(item[0] in ("w", "m") and me in (item[1], item[2]) and self._item_room(item) == room for item in bag):
            return False
        for (a, c), q in fifo:
            if me in (a, c) and any(self._item_room(item) == room for item in q):
                return False
        for p in self.sources[rank]:
            if self.node("P", p) in state[5]:
                continue
            s = slots[self.slot_index[("P", room, p)]]
            if isinstance(s, tuple) and s[0] not in ("Success", "Failed", "Cleared", "X"):
                return False  # live, or holding our early room_pages
        return True

    @staticmethod
    def _item_room(item: Item) -> int:
        if item[0] == "w":
            return int(item[3])
        if item[0] in ("m", "n"):
            return int(item[3][1])
        return -1

    def _expire_stash(self, b: _Builder, idx: int, rank: int, room: int) -> None:
        from kvfsm.protocol.wire import Drained, RoomFailed

        stash = b.slots[idx][1]
        # runtime tombstone "Expired": a late create_sender fails the room, late room_pages are refused
        b.slots[idx] = None if self.cfg.mutant == "early_expiry_forgotten" else ("X",)
        for ev in stash:
            if isinstance(ev, PagesAnnounced):  # runtime: tell the announcer, nothing was written
                for msg in (RoomFailed(room, rank, ""), Drained(room, rank)):
                    self._enqueue(b, ("m", self.node("P", rank), self.node("D", ev.dest_rank), _msg_tuple(msg)))

    def _do_create(self, b: _Builder, idx: int, side: str, room: int, rank: int) -> None:
        prior = b.slots[idx]
        stash = prior[1] if isinstance(prior, tuple) and prior[0] == "E" else ()
        b.slots[idx] = self._create(side, room, rank)
        if prior == ("X",):
            self._apply(b, idx, Abort(""))  # runtime: the announcement expired; decode was told
        if side == "D":
            me = self.node("D", rank)
            broken = [p for p in self.sources[rank] if (me, self.node("P", p)) in b.lost]
            # runtime create_receiver: a source known dead fails the room at once; otherwise the
            # links are up (registration is modelled as done before the run)
            self._apply(b, idx, PeerLost(broken[0], "") if broken else PeersReady())
        for ev in stash:
            self._apply(b, idx, ev)

    def _take(self, b: _Builder, item: Item, where: str) -> None:
        if where == "fifo":
            q = b.fifo[(item[1], item[2])]
            q.pop(0)
        else:
            b.bag.remove(item)

    # ------------------------------------------------------------------ the runtime's routing

    def _deliver(self, b: _Builder, item: Item) -> None:
        kind = item[0]
        if kind == "m":
            self._route_message(b, item[1], item[2], _msg(item[3]))
        elif kind == "n":
            msg = _msg(item[3])
            d = int(item[2][1:])
            idx = self.slot_index[("D", msg.room, d)]  # type: ignore[union-attr]
            if self._created(b, idx):  # a cleared room's machine must ignore it (no resurrection)
                if msg.TYPE == "chunk_written":
                    ev: Any = ChunkArrived(msg.src, msg.chunk_id, msg.is_last, msg.page_start, msg.num_pages)  # type: ignore[union-attr]
                else:
                    ev = AuxArrived(msg.src)  # type: ignore[union-attr]
                self._apply(b, idx, ev)
        elif kind == "w":
            self._land(b, item)
        elif kind == "c":
            _, dst, room, dest_rank, chunk_id, ok = item
            idx = self.slot_index[("P", room, int(dst[1:]))]
            if self._created(b, idx):
                ev = WriteCompleted(dest_rank, chunk_id) if ok else WriteFailed(dest_rank, chunk_id, "")
                self._apply(b, idx, ev)
        elif kind == "l":
            _, dst, lost = item
            side, rank = dst[0], int(dst[1:])
            lost_rank = int(lost[1:])
            b.lost.add((dst, lost))
            for r in range(self.cfg.rooms):
                idx = self.slot_index[(side, r, rank)]
                if not self._live(b, idx):
                    continue
                # runtime: decode fails rooms of that source; prefill rooms the dead rank announced to
                if side == "D":
                    involved = lost_rank in self.sources[rank]
                else:
                    involved = lost_rank in {d for d, *_ in b.slots[idx][3]}
                if involved:
                    self._apply(b, idx, PeerLost(lost_rank, ""))

    def _created(self, b: _Builder, idx: int) -> bool:
        s = b.slots[idx]
        return isinstance(s, tuple) and s[0] not in ("E", "X")

    def _live(self, b: _Builder, idx: int) -> bool:
        s = b.slots[idx]
        return isinstance(s, tuple) and s[0] not in ("E", "X", "Cleared")

    def _route_message(self, b: _Builder, src: str, dst: str, msg: Any) -> None:
        side, rank = dst[0], int(dst[1:])
        src_rank = int(src[1:])
        idx = self.slot_index[(side, msg.room, rank)]
        cur = b.slots[idx]
        if side == "P":
            if msg.TYPE == "room_pages":
                ev: Any = PagesAnnounced(
                    msg.decode_rank, msg.pages, msg.aux_slot, msg.required_dests, self.kv_pages, self.aux_slots
                )
            elif msg.TYPE == "abort":
                ev = AbortReceived(msg.rank, msg.side, "")
            else:
                return
        else:
            if msg.TYPE == "abort":
                ev = AbortReceived(msg.rank, msg.side, "")
            elif msg.TYPE == "room_failed":
                ev = FailureReceived(msg.prefill_rank, "")
            elif msg.TYPE == "drained":
                ev = WritesDrained(msg.prefill_rank)
            else:
                return
        if cur == ("X",):
            if side == "P" and msg.TYPE == "room_pages":
                self._tombstone_reply(b, rank, msg.room, src_rank)
            elif side == "P" and msg.TYPE == "abort":
                self._drained_reply(b, rank, msg.room, src_rank)
            return
        if cur is None or (isinstance(cur, tuple) and cur[0] == "E"):
            if side == "P":  # kept until the engine creates the room (runtime: early messages)
                stash = cur[1] if cur else ()
                b.slots[idx] = ("E", (*stash, ev))
            return  # decode: a message for a room it never created is dropped
        if cur[0] == "Cleared":
            if side == "P" and msg.TYPE == "abort":
                self._drained_reply(b, rank, msg.room, src_rank)  # runtime: nothing is outstanding
            if side == "P" and msg.TYPE == "room_pages" and cur[1]:
                # tombstone of a failed room: tell the announcer at once (runtime behaviour)
                self._tombstone_reply(b, rank, msg.room, src_rank)
            self._apply(b, idx, ev)  # the machine must ignore it (no resurrection)
            return
        self._apply(b, idx, ev)

    def _drained_reply(self, b: _Builder, p: int, room: int, d: int) -> None:
        from kvfsm.protocol.wire import Drained

        self._enqueue(b, ("m", self.node("P", p), self.node("D", d), _msg_tuple(Drained(room, p))))

    def _tombstone_reply(self, b: _Builder, p: int, room: int, d: int) -> None:
        from kvfsm.protocol.wire import Drained, RoomFailed

        for msg in (RoomFailed(room, p, ""), Drained(room, p)):
            self._enqueue(b, ("m", self.node("P", p), self.node("D", d), _msg_tuple(msg)))

    def _land(self, b: _Builder, item: Item) -> None:
        _, src, dst, room, chunk_id, note = item
        p = int(src[1:])
        d = int(dst[1:])
        if dst in b.crashed:
            self._enqueue(b, ("c", src, room, d, chunk_id, False))
            return
        landing_notes(self, b, room, p, d, chunk_id)
        b.landed.add((room, p, chunk_id, d))
        self._enqueue(b, ("n", src, dst, note))
        self._enqueue(b, ("c", src, room, d, chunk_id, True))

    def _crash(self, b: _Builder, name: str) -> None:
        b.crashed.add(name)
        for key in list(b.fifo):
            if name in key:
                del b.fifo[key]
        kept: list[Item] = []
        for item in b.bag:
            if item[0] == "w" and item[2] == name:
                kept.append(("c", item[1], item[3], int(name[1:]), item[4], False))  # write into a dead node fails
            elif item[1] == name or item[2] == name:
                continue
            else:
                kept.append(item)
        b.bag = kept
        side = name[0]
        rank = int(name[1:])
        others = self.dests[rank] if side == "P" else self.sources[rank]
        other_side = "D" if side == "P" else "P"
        for o in others:
            other = self.node(other_side, o)
            if other not in b.crashed:
                b.bag.append(("l", other, name))


__all__ = ["CheckConfig", "Model", "LocalProtocolError", "State", "Label"]
