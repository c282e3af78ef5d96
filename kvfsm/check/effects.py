"""The checker's flat state and its effect tables: how ``Model`` computes successors fast.

Theory of operation
-------------------
A system state is a flat tuple of small ints:

    (control, budgets, landed, queue of each FIFO pair..., bag)

* ``control``: an interned id of (slots, crashed nodes, lost peers). ``slots`` has one entry per
  (room, side, rank): ``None`` (the engine has not created it), ``("E", events)`` (prefill:
  messages that arrived before the engine created the room, kept as the runtime keeps them),
  ``("X",)`` (their expiry tombstone), or the room's frozen fields (``kvfsm.check.encoding``),
  whose first element is its machine state. ``lost`` holds (node, dead peer) once the node got
  the notice.
* ``budgets``: faults and engine aborts still allowed (loss, dup, crash, aborts) in one mixed-radix int.
* ``landed``: bit mask of the (room, source, chunk, destination) writes that have landed (ghost
  state for the invariants).
* one interned item sequence per (sender, receiver) pair of control messages (``ordered=True``;
  else they live in the bag), and the bag: the sorted multiset of everything unordered
  (notifications, writes in flight whose data has not landed, completions, peer-loss notices).
  Items are interned too; a sequence is a tuple of item ids.

What an action does depends on the control part only (the network is the source of the item it
consumes, and a sink), so the model computes an **effect** once per (control, action) from its
readable code: the next control id, the budget it spends, the network deltas (take this item,
put those) as interned ids, a landing and landed-set checks for the ghost invariants, and notes.
A successor is then the state with its control replaced and a few (sequence, delta) -> sequence
look-ups. ``Model(cfg, memo=False)`` recomputes every effect and delta instead (a test checks
both explore the same graph; the benchmark uses it as baseline).

``FlatStates`` holds the tables and the fast path; ``Model`` supplies the system: its
``_engine_effects``, ``_item_effects``, ``_crash_effects`` and ``_crash_network``.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any

from kvfsm.check.encoding import (
    ALL,
    ANY,
    CRASH,
    EMPTY_BAG,
    EMPTY_QUEUE,
    NO_NOTES,
    Ctrl,
    Effect,
    Item,
    Label,
    State,
    _Builder,
)

if TYPE_CHECKING:
    from kvfsm.check.model import CheckConfig


class FlatStates:
    """Interned flat states, effects and their fast application (see the module docstring)."""

    cfg: CheckConfig
    memo: bool
    slot_info: list[tuple[str, int, int]]

    def _init_flat(self, pairs: list[tuple[str, str]], writes: list[tuple[int, int, int, int]]) -> None:
        """The tables: ``pairs``, the (sender, receiver) FIFO queues in delivery order; ``writes``,
        the (room, source, chunk, destination) keys of the landed set."""
        cfg = self.cfg
        self.pairs = pairs
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
        self._bits = {key: 1 << i for i, key in enumerate(writes)}
        limits = (cfg.loss, cfg.dup, cfg.crash, cfg.aborts)
        self._units = tuple(prod(x + 1 for x in limits[:i]) for i in range(4))
        self._budget_left = [
            tuple(code // u % (x + 1) > 0 for u, x in zip(self._units, limits, strict=True))
            for code in range(prod(x + 1 for x in limits))
        ]
        self._full_budget = sum(u * x for u, x in zip(self._units, limits, strict=True))

    # ------------------------------------------------------------------ supplied by the model

    def _engine_effects(self, ctrl: int) -> tuple[Effect, ...]:
        raise NotImplementedError

    def _item_effects(self, ctrl: int, iid: int) -> tuple[Effect, ...]:
        raise NotImplementedError

    def _crash_effects(self, ctrl: int) -> tuple[Effect, ...]:
        raise NotImplementedError

    @staticmethod
    def _crash_network(fifo: dict[tuple[str, str], list[Item]], bag: list[Item], name: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ states and interning

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
        landed: int, landing: tuple[int, str] | None, required: tuple[tuple[int, str, int], ...], notes: tuple[str, ...]
    ) -> tuple[str, ...]:
        extra = [
            note
            for mask, note, mode in required
            if (landed & mask != mask if mode == ALL else not landed & mask if mode == ANY else landed & mask)
        ]
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

    def _builder(self, ctrl: int) -> _Builder:
        slots, crashed, lost = self._ctrls[ctrl]
        return _Builder(list(slots), set(crashed), set(lost))

    def _compile(self, label: Label, b: _Builder, fence: tuple[str, int] | None = None) -> Effect:
        ctrl = self._ctrl((tuple(b.slots), tuple(sorted(b.crashed)), tuple(sorted(b.lost))))
        landing = None if b.landing is None else (self._bits[b.landing[0]], b.landing[1])
        # checks of one note and mode ALL (or NONE) merge into one mask; ANY checks stay apart
        masks: dict[tuple[str, int], int] = {}
        anys: set[tuple[int, str, int]] = set()
        for keys, note, mode in b.required:
            mask = sum(self._bits[key] for key in set(keys))
            if mode == ANY:
                anys.add((mask, note, mode))
            else:
                masks[(note, mode)] = masks.get((note, mode), 0) | mask
        required = tuple(sorted({*((mask, note, mode) for (note, mode), mask in masks.items()), *anys}))
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

    @staticmethod
    def _item_room(item: Item) -> int:
        if item[0] == "w":
            return int(item[3])
        if item[0] in ("m", "n"):
            return int(item[3][1])
        return -1
