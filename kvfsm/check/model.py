"""The system model that ``kvfsm check`` explores.

Theory of operation
-------------------
One system state composes every room machine of every rank on both sides, the engines that
drive them, the runtime's routing, and the network, as a flat tuple of small ints
(``kvfsm.check.effects``; rooms, messages and network items are written as in
``kvfsm.check.encoding``).

Rooms are stepped with the *same* compiled protocol the runtime runs (``RoomMachine.step``),
memoised per (frozen room, event). Every action the runtime can take is a model action: engine
calls (create, send a chunk, init, abort, clear), message delivery, loss and duplication
(bounded), crash (bounded), and every armed timer firing (nondeterministically, at any time: a
timeout may race anything).

How a step is fast: the successors of a state are computed once per control part as effects
(``kvfsm.check.effects``), from the readable code below.

Routing is the runtime's own: which room an inbound item goes to, early-message stashing,
tombstones, their replies and expiry are the pure functions of ``kvfsm.protocol.routing``, with
``routing_for(cfg.mutant)`` selecting a routing mutant.

Timing assumption: the decode ``fence`` timer (release pages without every source's drain
confirmation) fires only when no write to that room's pages is in flight and every source room
has concluded or crashed — the real timeout is chosen longer than any source's own timers.

Successors come with notes: ``!name`` for a violated ``always`` property, ``~name`` for a
``sometimes`` property that the transition witnesses. ``symmetries`` lists the renamings of
rooms and ranks under which the model is invariant (see ``explore``'s symmetry reduction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfsm.check.encoding import (
    ABORTS,
    CRASH,
    DUP,
    LOSS,
    Effect,
    Item,
    Label,
    State,
    _Builder,
    _msg,
    _msg_tuple,
    freeze_decode,
    freeze_prefill,
    thaw_decode,
    thaw_prefill,
)
from kvfsm.check.mapping import ModelMapping, default_heads, model_mapping, rank_map
from kvfsm.check.plans import WritePlans
from kvfsm.check.properties import edge_notes, landing_notes
from kvfsm.check.symmetry import Symmetric
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
from kvfsm.protocol.rooms import DecodeRoom, PrefillRoom
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

FAILED, SUCCESS = 0, 4


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
    # the model's KV heads (0: lcm(prefill_ranks, decode_ranks), so that no head is replicated);
    # with them, kvfsm.layout.mapping.RankMap decides who sends which heads to whom
    kv_heads: int = 0
    mla: bool = False  # one latent vector held by every rank: one prefill rank sends it

    def __post_init__(self) -> None:
        if min(self.prefill_ranks, self.decode_ranks, self.rooms, self.chunks) < 1:
            raise ValueError("ranks, rooms and chunks must be at least 1")
        if self.order not in ("any", "decode-first", "prefill-first"):
            raise ValueError(f"order must be any, decode-first or prefill-first, not {self.order!r}")
        if self.kv_heads < 0:
            raise ValueError("kv_heads must be at least 0 (0: one per rank of the larger group)")
        rank_map(self.heads, self.prefill_ranks, self.decode_ranks, self.mla)  # MappingError if none

    @property
    def heads(self) -> int:
        """The KV heads of the model (``kv_heads``, or its default)."""
        return self.kv_heads or default_heads(self.prefill_ranks, self.decode_ranks)

    def mapping(self) -> ModelMapping:
        """Who waits for whom and who writes which heads where (a mapping mutant's, if named)."""
        return model_mapping(self.prefill_ranks, self.decode_ranks, self.heads, self.mla, self.mutant)


def sources_of(cfg: CheckConfig, d: int) -> tuple[int, ...]:
    """Prefill ranks decode rank ``d`` waits for (``kvfsm.layout.mapping.RankMap``, or a mapping mutant)."""
    return cfg.mapping().expected[d]


def dests_of(cfg: CheckConfig, p: int) -> tuple[int, ...]:
    """Decode ranks prefill rank ``p`` writes (empty: it takes no part in a room)."""
    return cfg.mapping().dests_of(p)


class Model(Symmetric):
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
        self.mapping = cfg.mapping()
        self.sources = [self.mapping.expected[d] for d in range(D)]
        self.dests = [self.mapping.dests_of(p) for p in range(P)]
        self.required = [self.mapping.required_dests(d) for d in range(D)]
        self.plans = WritePlans(cfg, self.kv_pages)  # the bytes each KV write moves (write_plan_exact)
        # per (source, destination): the other sources whose writes carry one of the same heads
        self.head_conflicts = {
            (p, d): tuple(
                q for q in range(P) if q != p and set(self.mapping.heads(q, d)) & set(self.mapping.heads(p, d))
            )
            for p, d in self.mapping.pairs
        }
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
        # --- the flat state (kvfsm.check.effects)
        pairs = {(self.node("P", p), self.node("D", d)) for p in range(P) for d in self.mapping.peers_of("P", p)}
        pairs |= {(b, a) for a, b in pairs}
        writes = [(r, p, c, d) for r in range(R) for p in range(P) for c in range(-1, C) for d in range(D)]
        self._init_flat(sorted(pairs) if cfg.ordered else [], writes)  # (the order control messages are delivered in)

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
            obj = thaw_decode(frozen, room, rank, self.kv_pages, self.aux_slots, src, self.required[rank])
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
                obj = DecodeRoom(room, rank, self.kv_pages, self.aux_slots, src, self.required[rank])
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

    # ------------------------------------------------------------------ effects (memoised per control state)

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
            if not create(known).refuse:  # not created yet (as the shared routing allows)
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

    # ------------------------------------------------------------------ engine and timing conditions

    def _may_create(self, slots: tuple[Any, ...], side: str, room: int, rank: int) -> bool:
        if side == "P" and not self.dests[rank]:
            return False  # a prefill rank that writes nobody takes no part in the room
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
        others = self.mapping.peers_of(side, rank)
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


__all__ = ["CheckConfig", "Label", "LocalProtocolError", "Model", "State", "_msg_tuple"]
