"""Symmetry of the checker's model: renamings of rooms and ranks under which it is invariant.

``Symmetric.symmetries()`` lists the renamings (``_Renaming``) that map the model onto itself and
``canonical(state)`` picks one representative per orbit, which ``explore`` uses to visit one
state of each class (its symmetry reduction).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from itertools import permutations
from typing import Any

from kvfsm.check.effects import FlatStates
from kvfsm.check.encoding import Item, State
from kvfsm.check.mapping import ModelMapping
from kvfsm.check.plans import RANK_SENSITIVE
from kvfsm.protocol.wire import MESSAGE_CLASSES

_KEPT_FIELDS = {"required_dests", "reason", "side", "chunk_id", "is_last", "token_start", "num_tokens",
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


class Symmetric(FlatStates):
    """The model's symmetries (needs ``mapping``, ``slot_index``; see ``symmetries``)."""

    mapping: ModelMapping
    slot_index: dict[tuple[str, int, int], int]
    _symmetries: list[_Renaming] | None = None

    def symmetries(self) -> list[_Renaming]:
        """Renamings of rooms and ranks (not the identity) that map the model onto itself.

        Rooms are interchangeable (their pages and aux slot are renamed with them). Ranks are
        renamed by pairs of permutations that keep the rank mapping (``ModelMapping.shape``: whom
        each rank waits for or writes, and which writes share a head); that is exact
        only while one crash at most is allowed (a decode room created with several sources
        already dead reports the lowest one), so rank renamings need ``crash <= 1``, and a plan
        mutant that depends on the ranks' global numbers (``plans.RANK_SENSITIVE``) has none.
        """
        if self._symmetries is None:
            cfg = self.cfg
            rank_perms: list[tuple[tuple[int, ...], tuple[int, ...]]] = [
                (tuple(range(cfg.prefill_ranks)), tuple(range(cfg.decode_ranks)))
            ]
            if cfg.crash <= 1 and cfg.mutant not in RANK_SENSITIVE:
                shape = self.mapping.shape()
                rank_perms = [
                    (pp, dp)
                    for pp in permutations(range(cfg.prefill_ranks))
                    for dp in permutations(range(cfg.decode_ranks))
                    if self.mapping.shape(pp, dp) == shape
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
