"""The system model that ``kvfsm check`` explores.

Theory of operation
-------------------
One system state composes every room machine of every rank on both sides, the engines that
drive them, the runtime's routing, and the network. It is a flat tuple of small ints:

    (control, budgets, landed, queue of each FIFO pair..., bag)

* ``control``: an interned id of (slots, crashed nodes, lost peers). ``slots`` has one entry per
  (room, side, rank): ``None`` (the engine has not created it), ``("E", events)`` (prefill:
  messages that arrived before the engine created the room, kept as the runtime keeps them),
  ``("X",)`` (their expiry tombstone), or the room's frozen fields (``freeze``), whose first
  element is its machine state. ``lost`` holds (node, dead peer) once the node got the notice.
* ``budgets``: faults and engine aborts still allowed (loss, dup, crash, aborts) in one mixed-radix int.
* ``landed``: bit mask of the (room, source, chunk, destination) writes that have landed (ghost
  state for the invariants).
* one interned item sequence per (sender, receiver) pair of control messages (``ordered=True``;
  else they live in the bag), and the bag: the sorted multiset of everything unordered
  (notifications, writes in flight whose data has not landed, completions, peer-loss notices).
  Items are interned too; a sequence is a tuple of item ids.

Rooms are stepped with the *same* compiled protocol the runtime runs (``RoomMachine.step``),
memoised per (frozen room, event). Every action the runtime can take is a model action: engine
calls (create, send a chunk, init, abort, clear), message delivery, loss and duplication
(bounded), crash (bounded), and every armed timer firing (nondeterministically, at any time: a
timeout may race anything).

How a step is fast: what an action does depends on the control part only (the network is the
source of the item it consumes, and a sink), so the slow path computes an **effect** once per
(control, action) from the readable code below: the next control id, the budget it spends, the
network deltas (take this item, put those) as interned ids, a landing and landed-set checks for
the ghost invariants, and notes. A successor is then the state with its control replaced and a
few (sequence, delta) -> sequence look-ups. ``Model(cfg, memo=False)`` recomputes every effect
and delta instead (a test checks both explore the same graph; the benchmark uses it as baseline).

Timing assumption: the decode ``fence`` timer (release pages without every source's drain
confirmation) fires only when no write to that room's pages is in flight and every source room
has concluded or crashed — the real timeout is chosen longer than any source's own timers.

Successors come with notes: ``!name`` for a violated ``always`` property, ``~name`` for a
``sometimes`` property that the transition witnesses. ``symmetries`` lists the renamings of
rooms and ranks under which the model is invariant (see ``explore``'s symmetry reduction).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from itertools import permutations
from math import prod
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
    ChunkReady,
    Clear,
    PagesAllocated,
    PeerLost,
    PeersReady,
    TimerFired,
    WriteCompleted,
    WriteFailed,
)
from kvfsm.protocol.machine import RoomMachine
from kvfsm.protocol.rooms import Announcement, DecodeRoom, PrefillRoom
from kvfsm.protocol.routing import (
    DISPATCH,
    EARLY,
    EXPIRED,
    LIVE,
    STASH,
    UNKNOWN,
    cleared,
    create,
    expire,
    message_event,
    replies,
    route_completion,
    route_message,
    routing_for,
)
from kvfsm.protocol.wire import MESSAGE_CLASSES, Message

FAILED, SUCCESS = 0, 4
Item = tuple[Any, ...]
State = tuple[int, ...]
Label = tuple[Any, ...]
Ctrl = tuple[tuple[Any, ...], tuple[str, ...], tuple[tuple[str, str], ...]]  # slots, crashed, lost
# (label, control', budget index or -1, its unit, network deltas, notes, None or the rare parts:
#  (fence condition, landing, landed checks, ops applied item by item))
Effect = tuple[Any, ...]


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
        dests={k: Announcement.of(pages, aux) for k, pages, aux in dests}, required_dests=req,
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
    """One successor's effect while it is computed from the control part of a state.

    ``slots``, ``crashed`` and ``lost`` are copies that the action mutates; the network is not
    read (except by the fence timer's condition, see ``_fence_may_fire``) but written through
    ``ops``: ``("take", item)`` first, then ``("put", item)`` in order, or ``("crash", node)``.
    The ghost set of landed writes is read through deferred checks (``land``, ``require_landed``),
    evaluated against the state the effect is applied to.
    """

    slots: list[Any]
    crashed: set[str]
    lost: set[tuple[str, str]]  # (node, dead peer) once the node received the peer-loss notice
    ops: list[tuple[str, Any]] = field(default_factory=list)
    budget: int = -1  # index of the fault budget this action spends (LOSS, DUP, CRASH, ABORTS)
    landing: tuple[tuple[int, int, int, int], str] | None = None
    required: list[tuple[tuple[int, int, int, int], str]] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)

    def land(self, key: tuple[int, int, int, int], note_if_landed: str) -> None:
        """The write ``key`` (room, source, chunk, destination) lands; ``note_if_landed`` if it already had."""
        self.landing = (key, note_if_landed)

    def require_landed(self, key: tuple[int, int, int, int], note_if_missing: str) -> None:
        self.required.append((key, note_if_missing))


LOSS, DUP, CRASH, ABORTS = range(4)
EMPTY_QUEUE, EMPTY_BAG = 0, 1  # ids of the empty sequences
NO_NOTES: tuple[str, ...] = ()


class Model:
    """Successor function of the composed system (see the module docstring)."""

    def __init__(self, cfg: CheckConfig, protocol: Protocol | None = None, *, memo: bool = True) -> None:
        from kvfsm.check.mutants import mutated_protocol

        self.cfg = cfg
        self.memo = memo
        self.protocol = protocol or mutated_protocol(cfg.mutant)
        self.routing = routing_for(cfg.mutant)  # kvfsm.protocol.routing, as the runtime runs it
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
        self._cache: dict[tuple[Any, ...], Any] = {}
        # (side, state) pairs where some row accepts clear (its guards may still refuse it)
        self._clearable = {("P", st) for st in self.pm.spec.states if self.pm.accepts(st, "clear")}
        self._clearable |= {("D", st) for st in self.dm.spec.states if self.dm.accepts(st, "clear")}
        self._polls: dict[tuple[str, str], int] = {}
        for side, m in (("P", self.pm), ("D", self.dm)):
            for name, st in m.spec.states.items():
                if st.kvpoll is not None:
                    self._polls[(side, name)] = self.protocol.spec.kvpoll[st.kvpoll]
        self.cache_misses = 0
        # --- the flat state: (control, budgets, landed, queue per FIFO pair..., bag)
        pairs = {(self.node("P", p), self.node("D", d)) for p in range(P) for d in self.dests[p]}
        pairs |= {(b, a) for a, b in pairs}
        self.pairs = sorted(pairs) if cfg.ordered else []  # the order control messages are delivered in
        self.pair_pos = {pair: 3 + i for i, pair in enumerate(self.pairs)}
        self.bag_pos = 3 + len(self.pairs)
        self._ctrls: list[Ctrl] = []
        self._ctrl_ids: dict[Ctrl, int] = {}
        self._items: list[Item] = []
        self._item_ids: dict[Item, int] = {}
        self._seqs: list[tuple[int, ...]] = []
        self._seq_ids: dict[tuple[bool, tuple[int, ...]], int] = {}  # queues and bags apart
        self._touched: list[frozenset[tuple[str, int]]] = []  # per sequence: (node, room) with data in flight
        self._heads: list[tuple[int, ...]] = []  # per sequence: items that may be delivered next
        self._seq((), False)  # EMPTY_QUEUE
        self._seq((), True)  # EMPTY_BAG
        self._deltas: list[tuple[Any, ...]] = []
        self._delta_ids: dict[tuple[Any, ...], int] = {}
        self._net_memo: list[dict[int, int]] = []  # per delta: sequence id -> sequence id
        self._slow_ops: list[tuple[tuple[str, Any], ...]] = []  # interned ops that crash a node
        self._slow_ids: dict[tuple[tuple[str, Any], ...], int] = {}
        self._slow_memo: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
        self._engine: dict[int, tuple[Effect, ...]] = {}
        self._per_item: dict[int, dict[int, tuple[Effect, ...]]] = {}  # control -> item -> effects
        self._crashes: dict[int, tuple[Effect, ...]] = {}
        self._bits = {
            (r, p, c, d): 1 << i
            for i, (r, p, c, d) in enumerate(
                (r, p, c, d) for r in range(R) for p in range(P) for c in range(-1, C) for d in range(D)
            )
        }
        limits = (cfg.loss, cfg.dup, cfg.crash, cfg.aborts)
        self._units = tuple(prod(x + 1 for x in limits[:i]) for i in range(4))
        self._budget_left = [
            tuple(code // u % (x + 1) > 0 for u, x in zip(self._units, limits, strict=True))
            for code in range(prod(x + 1 for x in limits))
        ]
        self._full_budget = sum(u * x for u, x in zip(self._units, limits, strict=True))
        self._symmetries: list[_Renaming] | None = None

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
        ctrl = self._ctrl(((None,) * len(self.slot_info), (), ()))
        return (ctrl, self._full_budget, 0, *[EMPTY_QUEUE] * len(self.pairs), EMPTY_BAG)

    def slots(self, state: State) -> tuple[Any, ...]:
        """The frozen room of every slot (see ``slot_info``)."""
        return self._ctrls[state[0]][0]

    def crashed(self, state: State) -> tuple[str, ...]:
        return self._ctrls[state[0]][1]

    def budgets(self, state: State) -> tuple[int, ...]:
        """Faults and engine aborts left: (loss, dup, crash, aborts)."""
        limits = (self.cfg.loss, self.cfg.dup, self.cfg.crash, self.cfg.aborts)
        return tuple(state[1] // u % (x + 1) for u, x in zip(self._units, limits, strict=True))

    def network(self, state: State) -> tuple[dict[tuple[str, str], list[Item]], list[Item]]:
        """The FIFO queues (by (sender, receiver)) and the bag of unordered items, as items."""
        fifo = {pair: [self._items[i] for i in self._seqs[state[pos]]] for pair, pos in self.pair_pos.items()}
        return fifo, [self._items[i] for i in self._seqs[state[self.bag_pos]]]

    # ------------------------------------------------------------------ interning

    def _ctrl(self, ctrl: Ctrl) -> int:
        cid = self._ctrl_ids.get(ctrl)
        if cid is None:
            cid = self._ctrl_ids[ctrl] = len(self._ctrls)
            self._ctrls.append(ctrl)
        return cid

    def _item(self, item: Item) -> int:
        iid = self._item_ids.get(item)
        if iid is None:
            iid = self._item_ids[item] = len(self._items)
            self._items.append(item)
        return iid

    def _seq(self, seq: tuple[int, ...], is_bag: bool) -> int:
        sid = self._seq_ids.get((is_bag, seq))
        if sid is None:
            sid = self._seq_ids[(is_bag, seq)] = len(self._seqs)
            self._seqs.append(seq)
            items = [self._items[i] for i in seq]
            # (node, room) pairs with a write or message in flight (the fence timer waits for them)
            self._touched.append(
                frozenset((n, self._item_room(it)) for it in items if it[0] in ("w", "m") for n in it[1:3])
            )
            # a queue's head; a bag's distinct items, in the order deliveries are tried
            self._heads.append(tuple(self._item_ids[it] for it in sorted(set(items))) if is_bag else seq[:1])
        return sid

    def _delta(self, delta: tuple[Any, ...]) -> int:
        did = self._delta_ids.get(delta)
        if did is None:
            did = self._delta_ids[delta] = len(self._deltas)
            self._deltas.append(delta)
            self._net_memo.append({})
        return did

    def _apply_delta(self, sid: int, did: int) -> int:
        kind, take, put = self._deltas[did]
        seq = self._seqs[sid]
        if kind == "fifo":
            return self._seq(seq[take:] + put, False)
        rest = list(seq)
        for iid in take:
            rest.remove(iid)
        return self._seq(tuple(sorted(rest + list(put))), True)

    # ------------------------------------------------------------------ stepping one room

    def _step(self, side: str, room: int, rank: int, frozen: Any, event: Any) -> tuple[Any, ...]:
        """(frozen', outputs, row) of one machine step, memoised. outputs are network items."""
        key = (side, room, rank, frozen, event)
        hit = self._cache.get(key)
        if hit is not None:
            return hit  # type: ignore[no-any-return]
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
        edge_notes(self, b, idx, side, room, rank, before, new, outputs, row, event)
        for item in unroutable:
            self._apply(b, idx, WriteFailed(int(item[2][1:]), item[4], ""))

    def _enqueue(self, b: _Builder, item: Item) -> None:
        dst = item[1] if item[0] in ("c", "l") else item[2]
        if dst in b.crashed:
            if item[0] == "w":  # a write into a dead node fails at once
                self._enqueue(b, ("c", item[1], item[3], int(dst[1:]), item[4], False))
            return  # anything else to a dead node is lost with it
        b.ops.append(("put", item))

    # ------------------------------------------------------------------ successors

    def successors(self, state: State) -> list[tuple[Label, State, tuple[str, ...]]]:
        """Every transition from ``state``: (label, next state, notes), in a fixed order."""
        labels: list[Label] = []
        states, noted = self.expand(state, labels)
        notes_at = dict(noted)
        return [(labels[i], nxt, notes_at.get(i, ())) for i, nxt in enumerate(states)]

    def expand(
        self, state: State, labels: list[Label] | None = None
    ) -> tuple[list[State], list[tuple[int, tuple[str, ...]]]]:
        """The next states of ``state`` in ``successors``' order, and (index, notes) for those edges
        that carry notes; with ``labels``, each edge's label is appended to it.

        The fast path: the effects of the state's control part (memoised), applied with a few
        table look-ups per successor. The explorer calls this directly: no label or note tuple
        is built per edge."""
        ctrl = state[0]
        memo = self.memo
        if memo:
            engine = self._engine.get(ctrl)
            groups = [self._engine_effects(ctrl) if engine is None else engine]
            per_item = self._per_item.get(ctrl)
            if per_item is None:
                per_item = self._per_item[ctrl] = {}
            heads = self._heads
            for pos in range(3, len(state)):
                for iid in heads[state[pos]]:
                    eff = per_item.get(iid)
                    groups.append(self._item_effects(ctrl, iid) if eff is None else eff)
        else:
            groups = [self._engine_effects(ctrl)]
            groups += [self._item_effects(ctrl, iid) for pos in range(3, len(state)) for iid in self._heads[state[pos]]]
        left = self._budget_left[state[1]]
        if left[CRASH]:
            crash = self._crashes.get(ctrl) if memo else None
            groups.append(self._crash_effects(ctrl) if crash is None else crash)
        states: list[State] = []
        noted: list[tuple[int, tuple[str, ...]]] = []
        append = states.append
        rest = state[2:]
        for effects in groups:
            for label, nctrl, budget, cost, net, notes, rare in effects:
                if budget >= 0 and not left[budget]:
                    continue
                if not net and rare is None:  # the common case: only the control part changes
                    if notes:
                        noted.append((len(states), notes))
                    if labels is not None:
                        labels.append(label)
                    append((nctrl, state[1] - cost) + rest)
                    continue
                nxt = list(state)
                nxt[0] = nctrl
                nxt[1] -= cost
                if rare is not None:
                    notes = self._rare(state, nxt, rare, notes)
                    if notes is None:
                        continue
                for pos, did, table in net:
                    sid = table.get(nxt[pos]) if memo else None
                    if sid is None:
                        sid = table[nxt[pos]] = self._apply_delta(nxt[pos], did)
                    nxt[pos] = sid
                if notes:
                    noted.append((len(states), notes))
                if labels is not None:
                    labels.append(label)
                append(tuple(nxt))
        return states, noted

    def _rare(
        self, state: State, nxt: list[int], rare: tuple[Any, ...], notes: tuple[str, ...]
    ) -> tuple[str, ...] | None:
        """The parts of an effect that read the network or the landed set, or crash a node; None:
        the effect is not enabled here (a fence timer while data of the room is in flight)."""
        fence, landing, required, slow = rare
        if fence is not None:
            touched = self._touched
            for sid in state[3:]:
                if fence in touched[sid]:
                    return None
        if landing is not None or required:
            notes = self._landed_notes(state[2], landing, required, notes)
            if landing is not None:
                nxt[2] = state[2] | landing[0]
        if slow is not None:
            nxt[3:] = self._apply_slow(state[3:], slow)
        return notes

    @staticmethod
    def _landed_notes(
        landed: int, landing: tuple[int, str] | None, required: tuple[tuple[int, str], ...], notes: tuple[str, ...]
    ) -> tuple[str, ...]:
        extra = [note for mask, note in required if landed & mask != mask]
        if landing is not None and landed & landing[0]:
            extra.append(landing[1])
        return tuple(sorted({*notes, *extra})) if extra else notes

    def _apply_slow(self, net: tuple[int, ...], ops_id: int) -> tuple[int, ...]:
        """Apply ops (a crash among them) to the whole network, item by item."""
        key = (net, ops_id)
        hit = self._slow_memo.get(key) if self.memo else None
        if hit is not None:
            return hit
        fifo = {pair: [self._items[i] for i in self._seqs[net[pos - 3]]] for pair, pos in self.pair_pos.items()}
        bag = [self._items[i] for i in self._seqs[net[-1]]]
        for op, arg in self._slow_ops[ops_id]:
            if op == "crash":
                self._crash_network(fifo, bag, arg)
            elif arg[0] == "m" and self.cfg.ordered:
                fifo[(arg[1], arg[2])].append(arg)
            else:
                bag.append(arg)
        out = [self._seq(tuple(self._item(it) for it in fifo[pair]), False) for pair in self.pairs]
        out.append(self._seq(tuple(sorted(self._item(it) for it in bag)), True))
        self._slow_memo[key] = tuple(out)
        return tuple(out)

    # ------------------------------------------------------------------ effects (memoised per control state)

    def _builder(self, ctrl: int) -> _Builder:
        slots, crashed, lost = self._ctrls[ctrl]
        return _Builder(list(slots), set(crashed), set(lost))

    def _compile(self, label: Label, b: _Builder, fence: tuple[str, int] | None = None) -> Effect:
        ctrl = self._ctrl((tuple(b.slots), tuple(sorted(b.crashed)), tuple(sorted(b.lost))))
        landing = None if b.landing is None else (self._bits[b.landing[0]], b.landing[1])
        masks: dict[str, int] = {}
        for key, note in b.required:
            masks[note] = masks.get(note, 0) | self._bits[key]
        required = tuple((mask, note) for note, mask in sorted(masks.items()))
        slow = None
        deltas: dict[int, tuple[list[int], list[int]]] = {}
        if any(op == "crash" for op, _ in b.ops):
            slow = self._slow_ids.setdefault(tuple(b.ops), len(self._slow_ops))
            if slow == len(self._slow_ops):
                self._slow_ops.append(tuple(b.ops))
        else:
            for op, item in b.ops:  # every take precedes every put (see _Builder)
                pos = self.pair_pos[(item[1], item[2])] if item[0] == "m" and self.cfg.ordered else self.bag_pos
                take, put = deltas.setdefault(pos, ([], []))
                (take if op == "take" else put).append(self._item(item))
        net = []
        for pos, (take, put) in sorted(deltas.items()):
            if pos == self.bag_pos:
                did = self._delta(("bag", tuple(sorted(take)), tuple(sorted(put))))
            else:
                did = self._delta(("fifo", len(take), tuple(put)))
            net.append((pos, did, self._net_memo[did]))
        notes = tuple(sorted(b.notes)) if b.notes else NO_NOTES
        cost = self._units[b.budget] if b.budget >= 0 else 0
        rare = (fence, landing, required, slow) if fence or landing or required or slow is not None else None
        return (label, ctrl, b.budget, cost, tuple(net), notes, rare)

    def _engine_effects(self, ctrl: int) -> tuple[Effect, ...]:
        """Engine calls and timers of every room (the network is only read by fence conditions)."""
        slots, crashed, _ = self._ctrls[ctrl]
        cfg = self.cfg
        out: list[Effect] = []
        for idx, (side, room, rank) in enumerate(self.slot_info):
            if self.node(side, rank) in crashed:
                continue
            cur = slots[idx]
            known = self.known(cur)
            if known in (UNKNOWN, EARLY, EXPIRED):  # not created (routing.create allows it)
                if self._may_create(slots, side, room, rank):
                    b = self._builder(ctrl)
                    self._do_create(b, idx, side, room, rank)
                    out.append(self._compile(("create", side, rank, room), b))
                if known == EARLY:
                    # the runtime forgets early messages after early_ttl_s (< the fence timer)
                    b = self._builder(ctrl)
                    self._expire_stash(b, idx, rank, room)
                    out.append(self._compile(("expire", rank, room), b))
                continue
            state_name = cur[0]
            if state_name == "Cleared":
                continue
            if side == "P" and self._may_send(cur):
                b = self._builder(ctrl)
                handed = cur[7] + len(cur[5])
                last = handed == cfg.chunks - 1
                src_page = self.pages(room)[handed]
                self._apply(b, idx, ChunkReady((src_page,), last, room if last else None))
                out.append(self._compile(("send", rank, room, handed), b))
            if side == "D" and state_name == "WaitingForInput.Allocating":
                b = self._builder(ctrl)
                self._apply(b, idx, PagesAllocated(self.pages(room), room))
                out.append(self._compile(("init", rank, room), b))
            # an AbortReq may arrive in any state, even after Success (while the budget lasts)
            b = self._builder(ctrl)
            b.budget = ABORTS
            self._apply(b, idx, Abort(""))
            out.append(self._compile(("abort", side, rank, room), b))
            if (side, state_name) in self._clearable:
                b = self._builder(ctrl)
                try:
                    self._apply(b, idx, Clear())
                except LocalProtocolError:
                    pass  # refused (e.g. writes still read the pages): the engine waits
                else:
                    out.append(self._compile(("clear", side, rank, room), b))
            # --- timers
            for timer in cur[2]:
                fence = None
                if timer == "fence":
                    if not self._fence_may_fire(slots, crashed, room, rank):
                        continue
                    fence = (self.node("D", rank), room)  # and no write or message of the room in flight
                b = self._builder(ctrl)
                self._apply(b, idx, TimerFired(timer))
                out.append(self._compile(("timer", side, rank, room, timer), b, fence))
        effects = tuple(out)
        if self.memo:
            self._engine[ctrl] = effects
        return effects

    def _item_effects(self, ctrl: int, iid: int) -> tuple[Effect, ...]:
        """Delivery, loss and duplication of one item at the head of its queue (or in the bag)."""
        item = self._items[iid]
        out: list[Effect] = []
        b = self._builder(ctrl)
        b.ops.append(("take", item))
        self._deliver(b, item)
        out.append(self._compile(("deliver", item), b))
        if item[0] in ("m", "n", "w"):
            b = self._builder(ctrl)
            b.ops.append(("take", item))
            b.budget = LOSS
            if item[0] == "w":
                # the data plane reports every posted write's fate: a lost write fails
                self._enqueue(b, ("c", item[1], item[3], int(item[2][1:]), item[4], False))
            out.append(self._compile(("lose", item), b))
        if item[0] in ("m", "n"):
            b = self._builder(ctrl)
            b.budget = DUP
            self._enqueue(b, item)
            out.append(self._compile(("duplicate", item), b))
        effects = tuple(out)
        if self.memo:
            self._per_item[ctrl][iid] = effects
        return effects

    def _crash_effects(self, ctrl: int) -> tuple[Effect, ...]:
        crashed = self._ctrls[ctrl][1]
        out: list[Effect] = []
        for side, n in (("P", self.cfg.prefill_ranks), ("D", self.cfg.decode_ranks)):
            for rank in range(n):
                name = self.node(side, rank)
                if name in crashed:
                    continue
                b = self._builder(ctrl)
                b.budget = CRASH
                self._crash(b, name)
                out.append(self._compile(("crash", side, rank), b))
        effects = tuple(out)
        if self.memo:
            self._crashes[ctrl] = effects
        return effects

    # ------------------------------------------------------------------ symmetry

    def symmetries(self) -> list[_Renaming]:
        """Renamings of rooms and ranks (not the identity) that map the model onto itself.

        Rooms are interchangeable (their pages and aux slot are renamed with them). Ranks are
        renamed by pairs of permutations that keep the prefill -> decode mapping; that is exact
        only while one crash at most is allowed (a decode room created with several sources
        already dead reports the lowest one), so rank renamings need ``crash <= 1``.
        """
        if self._symmetries is None:
            cfg = self.cfg
            rank_perms: list[tuple[tuple[int, ...], tuple[int, ...]]] = [
                (tuple(range(cfg.prefill_ranks)), tuple(range(cfg.decode_ranks)))
            ]
            if cfg.crash <= 1:
                rank_perms = [
                    (pp, dp)
                    for pp in permutations(range(cfg.prefill_ranks))
                    for dp in permutations(range(cfg.decode_ranks))
                    if all(
                        set(self.sources[dp[d]]) == {pp[p] for p in self.sources[d]} for d in range(cfg.decode_ranks)
                    )
                ]
            group = [
                _Renaming(rooms, pp, dp, cfg.chunks)
                for rooms in permutations(range(cfg.rooms))
                for pp, dp in rank_perms
            ]
            self._symmetries = [g for g in group if not g.identity]
        return self._symmetries

    def canonical(self, state: State) -> State:
        """The least of ``state``'s images under ``symmetries()``: one representative per orbit."""
        best = state
        for g in self.symmetries():
            image = self._rename_state(g, state)
            if image < best:
                best = image
        return best

    def _rename_state(self, g: _Renaming, state: State) -> State:
        memo = g.memo
        ctrl = memo.get(("c", state[0]))
        if ctrl is None:
            ctrl = memo[("c", state[0])] = self._rename_ctrl(g, state[0])
        landed = memo.get(("l", state[2]))
        if landed is None:
            landed = memo[("l", state[2])] = sum(
                self._bits[g.landing(key)] for key, bit in self._bits.items() if state[2] & bit
            )
        out = [ctrl, state[1], landed, *state[3:]]
        for pair, pos in self.pair_pos.items():
            sid = memo.get(("q", state[pos]))
            if sid is None:
                renamed = tuple(self._item(g.item(self._items[i])) for i in self._seqs[state[pos]])
                sid = memo[("q", state[pos])] = self._seq(renamed, False)
            out[self.pair_pos[(g.node(pair[0]), g.node(pair[1]))]] = sid
        bag = memo.get(("b", state[-1]))
        if bag is None:
            renamed = tuple(sorted(self._item(g.item(self._items[i])) for i in self._seqs[state[-1]]))
            bag = memo[("b", state[-1])] = self._seq(renamed, True)
        out[-1] = bag
        return tuple(out)

    def _rename_ctrl(self, g: _Renaming, ctrl: int) -> int:
        slots, crashed, lost = self._ctrls[ctrl]
        new: list[Any] = [None] * len(slots)
        for idx, (side, room, rank) in enumerate(self.slot_info):
            to = (side, g.rooms[room], (g.prefill if side == "P" else g.decode)[rank])
            new[self.slot_index[to]] = g.slot(side, slots[idx])
        return self._ctrl(
            (
                tuple(new),
                tuple(sorted(g.node(n) for n in crashed)),
                tuple(sorted((g.node(a), g.node(b)) for a, b in lost)),
            )
        )

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

    def _may_send(self, cur: Any) -> bool:
        state_name = cur[0]
        if state_name not in (
            "Bootstrapping.Waiting",
            "Bootstrapping.Holding",
            "WaitingForInput",
            "Transferring.Sending",
        ):
            return False
        return bool(cur[7] + len(cur[5]) < self.cfg.chunks)

    def _fence_may_fire(self, slots: tuple[Any, ...], crashed: tuple[str, ...], room: int, rank: int) -> bool:
        """Timing assumption of the fence timer: it is longer than any write or message can stay
        in flight (checked on the network by the effect's ``fence`` condition), than prefill keeps
        early messages, and than any source room can live."""
        for p in self.sources[rank]:
            if self.node("P", p) in crashed:
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
        """The runtime forgets a not-yet-created room's early messages (``routing.expire``)."""
        done = expire(self.routing, room, rank, b.slots[idx][1], "")
        b.slots[idx] = ("X",) if done.known == EXPIRED else None
        for dest, msg in done.sends:
            self._enqueue(b, ("m", self.node("P", rank), self.node("D", dest), _msg_tuple(msg)))

    def _do_create(self, b: _Builder, idx: int, side: str, room: int, rank: int) -> None:
        prior = b.slots[idx]
        decision = create(self.known(prior))
        b.slots[idx] = self._create(side, room, rank)
        if decision.abort:
            self._apply(b, idx, Abort(""))  # the announcement expired; decode was told
        if side == "D":
            me = self.node("D", rank)
            broken = [p for p in self.sources[rank] if (me, self.node("P", p)) in b.lost]
            # runtime create_receiver: a source known dead fails the room at once; otherwise the
            # links are up (registration is modelled as done before the run)
            self._apply(b, idx, PeerLost(broken[0], "") if broken else PeersReady())
        if decision.replay:
            for ev in prior[1]:
                self._apply(b, idx, ev)

    # ------------------------------------------------------------------ the runtime's routing (kvfsm.protocol.routing)

    def known(self, slot: Any) -> str:
        """What a rank knows of a slot's room, as ``kvfsm.protocol.routing`` names it."""
        if slot is None:
            return UNKNOWN
        tag = slot[0]
        if tag == "E":
            return EARLY
        if tag == "X":
            return EXPIRED
        if tag == "Cleared":  # the frozen machine stands for the tombstone (its failure code: from Failed)
            return cleared(self.routing, bool(slot[1]))
        return LIVE

    def _deliver(self, b: _Builder, item: Item) -> None:
        kind = item[0]
        if kind == "m":
            self._route_message(b, item[1], item[2], _msg(item[3]))
        elif kind == "n":
            msg = _msg(item[3])
            idx = self.slot_index[("D", msg.room, int(item[2][1:]))]  # type: ignore[union-attr]
            if route_message(self.known(b.slots[idx]), "decode", msg.TYPE) is DISPATCH:
                self._apply(b, idx, message_event("decode", msg))
        elif kind == "w":
            self._land(b, item)
        elif kind == "c":
            _, dst, room, dest_rank, chunk_id, ok = item
            idx = self.slot_index[("P", room, int(dst[1:]))]
            if route_completion(self.known(b.slots[idx])) is DISPATCH:
                ev: Any = WriteCompleted(dest_rank, chunk_id) if ok else WriteFailed(dest_rank, chunk_id, "")
                self._apply(b, idx, ev)
        elif kind == "l":
            _, dst, lost = item
            side, rank = dst[0], int(dst[1:])
            lost_rank = int(lost[1:])
            b.lost.add((dst, lost))
            for r in range(self.cfg.rooms):
                idx = self.slot_index[(side, r, rank)]
                if self.known(b.slots[idx]) != LIVE:
                    continue  # the runtime tells the rooms it routes to
                # runtime: decode fails rooms of that source; prefill rooms the dead rank announced to
                if side == "D":
                    involved = lost_rank in self.sources[rank]
                else:
                    involved = lost_rank in {d for d, *_ in b.slots[idx][3]}
                if involved:
                    self._apply(b, idx, PeerLost(lost_rank, ""))

    def _route_message(self, b: _Builder, src: str, dst: str, msg: Any) -> None:
        side = "prefill" if dst[0] == "P" else "decode"
        rank = int(dst[1:])
        ev = message_event(side, msg, self.kv_pages, self.aux_slots)
        if ev is None:
            return
        idx = self.slot_index[(dst[0], msg.room, rank)]
        cur = b.slots[idx]
        route = route_message(self.known(cur), side, msg.TYPE)
        if route is DISPATCH:
            self._apply(b, idx, ev)
        elif route is STASH:  # kept until the engine creates the room
            b.slots[idx] = ("E", (*(cur[1] if cur else ()), ev))
        else:
            for reply in replies(route, msg.room, rank, ""):
                self._enqueue(b, ("m", dst, src, _msg_tuple(reply)))

    def _land(self, b: _Builder, item: Item) -> None:
        _, src, dst, room, chunk_id, note = item
        p = int(src[1:])
        d = int(dst[1:])
        if dst in b.crashed:
            self._enqueue(b, ("c", src, room, d, chunk_id, False))
            return
        landing_notes(self, b, room, p, d, chunk_id)
        self._enqueue(b, ("n", src, dst, note))
        self._enqueue(b, ("c", src, room, d, chunk_id, True))

    def _crash(self, b: _Builder, name: str) -> None:
        b.crashed.add(name)
        b.ops.append(("crash", name))
        side = name[0]
        rank = int(name[1:])
        others = self.dests[rank] if side == "P" else self.sources[rank]
        other_side = "D" if side == "P" else "P"
        for o in others:
            other = self.node(other_side, o)
            if other not in b.crashed:
                b.ops.append(("put", ("l", other, name)))

    @staticmethod
    def _crash_network(fifo: dict[tuple[str, str], list[Item]], bag: list[Item], name: str) -> None:
        """What a crash does to the network: its queues go; writes into it fail; the rest to or from it is lost."""
        for key in fifo:
            if name in key:
                fifo[key].clear()
        kept: list[Item] = []
        for item in bag:
            if item[0] == "w" and item[2] == name:
                kept.append(("c", item[1], item[3], int(name[1:]), item[4], False))  # write into a dead node fails
            elif item[1] == name or item[2] == name:
                continue
            else:
                kept.append(item)
        bag[:] = kept


_KEPT_FIELDS = {"required_dests", "reason", "side", "chunk_id", "is_last", "page_start", "num_pages",
                "peer_kv_pages", "peer_aux_slots"}  # fmt: skip


@dataclass(eq=False)
class _Renaming:
    """A renaming of rooms (with their pages and aux slot) and of prefill and decode ranks."""

    rooms: tuple[int, ...]
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    chunks: int
    memo: dict[tuple[str, int], int] = field(default_factory=dict)  # interned id -> renamed id

    @property
    def identity(self) -> bool:
        return all(v == i for perm in (self.rooms, self.prefill, self.decode) for i, v in enumerate(perm))

    def node(self, name: str) -> str:
        return name[0] + str((self.prefill if name[0] == "P" else self.decode)[int(name[1:])])

    def pages(self, pages: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.rooms[p // self.chunks] * self.chunks + p % self.chunks for p in pages)

    def aux(self, slot: int | None) -> int | None:
        return slot if slot is None or slot < 0 else self.rooms[slot]  # the aux slot of a room is its id

    def landing(self, key: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        room, p, chunk, d = key
        return self.rooms[room], self.prefill[p], chunk, self.decode[d]

    def fields(self, names: list[str], values: tuple[Any, ...]) -> tuple[Any, ...]:
        """Message or event fields, renamed by field name (an unknown field is an error)."""
        side = values[names.index("side")] if "side" in names else None
        out = []
        for name, v in zip(names, values, strict=True):
            if name == "room":
                v = self.rooms[v]
            elif name in ("decode_rank", "dest_rank") or (name == "rank" and side == "decode"):
                v = self.decode[v]
            elif name in ("prefill_rank", "src") or (name == "rank" and side == "prefill"):
                v = self.prefill[v]
            elif name == "pages":
                v = self.pages(v)
            elif name == "aux_slot":
                v = self.aux(v)
            elif name not in _KEPT_FIELDS:
                raise ValueError(f"no renaming rule for field {name!r}")
            out.append(v)
        return tuple(out)

    def msg(self, t: tuple[Any, ...]) -> tuple[Any, ...]:
        return (t[0], *self.fields([f.name for f in fields(MESSAGE_CLASSES[t[0]])], t[1:]))

    def item(self, item: Item) -> Item:
        kind = item[0]
        if kind in ("m", "n"):
            return (kind, self.node(item[1]), self.node(item[2]), self.msg(item[3]))
        if kind == "w":
            return (kind, self.node(item[1]), self.node(item[2]), self.rooms[item[3]], item[4], self.msg(item[5]))
        if kind == "c":
            return (kind, self.node(item[1]), self.rooms[item[2]], self.decode[item[3]], item[4], item[5])
        return (kind, self.node(item[1]), self.node(item[2]))

    def slot(self, side: str, s: Any) -> Any:
        if s is None or s[0] == "X":
            return s
        if s[0] == "E":
            return ("E", tuple(type(ev)(*self.fields([f.name for f in fields(ev)], astuple(ev))) for ev in s[1]))
        if side == "P":
            state, code, timers, dests, req, held, last_seen, next_chunk, cursor, inflight = s
            dests = tuple(sorted((self.decode[k], self.pages(pages), self.aux(aux)) for k, pages, aux in dests))
            held = tuple((self.pages(pages), last, self.aux(aux)) for pages, last, aux in held)
            inflight = tuple(sorted((self.decode[d], c) for d, c in inflight))
            return (state, code, timers, dests, req, held, last_seen, next_chunk, cursor, inflight)
        state, code, timers, pages, aux, received, last_count, aux_done, undrained = s
        return (
            state, code, timers, self.pages(pages), self.aux(aux),
            tuple(sorted((self.prefill[src], got) for src, got in received)),
            tuple(sorted((self.prefill[src], n) for src, n in last_count)),
            tuple(sorted(self.prefill[src] for src in aux_done)),
            tuple(sorted(self.prefill[src] for src in undrained)),
        )  # fmt: skip


__all__ = ["CheckConfig", "Model", "LocalProtocolError", "State", "Label"]
