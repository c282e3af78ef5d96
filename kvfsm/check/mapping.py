"""The rank mapping as the checker's model uses it: whom each decode rank waits for, whom each
prefill rank writes, and which KV heads each write carries.

Theory of operation
-------------------
``kvfsm.layout.mapping.RankMap`` decides, for a prefill TP group and a decode TP group, which
prefill rank sends which KV heads to which decode rank. The model reads three things from it:

* ``expected[d]``: the prefill ranks decode rank ``d`` waits for (its rooms' ``sources``);
* ``pairs``: (prefill rank, decode rank) -> the heads that prefill rank writes there. A prefill
  rank with no pair takes no part in a room: its engine does not create it;
* ``held[d]``: the heads decode rank ``d`` holds, each to be written by exactly one source per
  chunk (``spec/invariants.toml``: ``head_written_once``).

In the correct mapping a decode rank waits for exactly the ranks that write to it. A *mapping
mutant* (``MAPPING_MUTANTS``, selected by ``CheckConfig.mutant`` like the routing mutants of
``kvfsm.protocol.routing``) replaces the mapping with a historical SGLang variant: the protocol
is unchanged, what the model's ranks believe about each other is not.

``shape`` is what the model's behaviour depends on (who waits for whom, who writes whom, which
writes share a head), up to a renaming of ranks: symmetry reduction and the split into
independent components compare shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import lcm
from typing import Any

from kvfsm.layout.mapping import RankMap, heads_of

Shape = tuple[Any, ...]


@dataclass(frozen=True)
class ModelMapping:
    prefill_ranks: int
    decode_ranks: int
    expected: tuple[tuple[int, ...], ...]  # per decode rank: the prefill ranks it waits for
    pairs: dict[tuple[int, int], tuple[int, ...]]  # (prefill, decode) -> heads written
    held: tuple[tuple[int, ...], ...]  # per decode rank: the heads it holds

    def dests_of(self, p: int) -> tuple[int, ...]:
        """The decode ranks prefill rank ``p`` writes (empty: it takes no part in a room)."""
        return tuple(sorted(d for q, d in self.pairs if q == p))

    def senders_of(self, d: int) -> tuple[int, ...]:
        """The prefill ranks that write to decode rank ``d`` (whatever ``d`` waits for)."""
        return tuple(sorted(p for p, e in self.pairs if e == d))

    def heads(self, p: int, d: int) -> tuple[int, ...]:
        return self.pairs.get((p, d), ())

    def required_dests(self, d: int) -> int:
        """How many decode ranks each of ``d``'s sources writes (decode tells them in room_pages)."""
        return max((len(self.dests_of(p)) for p in self.expected[d]), default=1) or 1

    def peers_of(self, side: str, rank: int) -> tuple[int, ...]:
        """Ranks of the other side linked to ``rank``: it waits for them, or they write to it."""
        if side == "P":
            return tuple(sorted({*self.dests_of(rank), *(d for d, e in enumerate(self.expected) if rank in e)}))
        return tuple(sorted({*self.expected[rank], *self.senders_of(rank)}))

    def covers(self, d: int) -> list[tuple[int, ...]]:
        """Per head that decode rank ``d`` holds: the prefill ranks that write it there."""
        return [tuple(sorted(p for p, e in self.pairs if e == d and g in self.pairs[(p, e)])) for g in self.held[d]]

    def shape(self, prefill: Sequence[int] | None = None, decode: Sequence[int] | None = None) -> Shape:
        """Everything the model's behaviour depends on, after renaming prefill rank ``p`` to
        ``prefill[p]`` and decode rank ``d`` to ``decode[d]`` (identity by default)."""
        pp = list(prefill) if prefill is not None else list(range(self.prefill_ranks))
        dp = list(decode) if decode is not None else list(range(self.decode_ranks))
        expected: list[Any] = [None] * self.decode_ranks
        covers: list[Any] = [None] * self.decode_ranks
        for d in range(self.decode_ranks):
            expected[dp[d]] = tuple(sorted(pp[p] for p in self.expected[d]))
            covers[dp[d]] = tuple(sorted({tuple(sorted(pp[p] for p in c)) for c in self.covers(d)}))
        pairs = tuple(sorted((pp[p], dp[d]) for p, d in self.pairs))
        return (self.prefill_ranks, self.decode_ranks, tuple(expected), pairs, tuple(covers))

    def restrict(self, prefill: Sequence[int], decode: Sequence[int]) -> ModelMapping:
        """The mapping among ``prefill`` x ``decode`` ranks only, renumbered in ascending order."""
        pi = {p: i for i, p in enumerate(sorted(prefill))}
        di = {d: i for i, d in enumerate(sorted(decode))}
        return ModelMapping(
            len(pi),
            len(di),
            tuple(tuple(pi[p] for p in self.expected[d] if p in pi) for d in sorted(di)),
            {(pi[p], di[d]): hs for (p, d), hs in self.pairs.items() if p in pi and d in di},
            tuple(self.held[d] for d in sorted(di)),
        )


Build = Callable[[int, int, int, bool], ModelMapping]


def _effective(num_heads: int, mla: bool) -> int:
    return 1 if mla else num_heads


def _held(num_heads: int, decode_tp: int, mla: bool) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(heads_of(_effective(num_heads, mla), decode_tp, d)) for d in range(decode_tp))


def rank_map(num_heads: int, prefill_tp: int, decode_tp: int, mla: bool) -> ModelMapping:
    """The correct mapping: ``kvfsm.layout.mapping.RankMap``."""
    m = RankMap(num_heads, prefill_tp, decode_tp, mla)
    pairs = {(p, d): tuple(m.heads(p, d)) for p, d in m.pairs()}
    expected = tuple(m.sources_of(d) for d in range(decode_tp))
    return ModelMapping(prefill_tp, decode_tp, expected, pairs, _held(num_heads, decode_tp, mla))


def _every_holder_sends(num_heads: int, prefill_tp: int, decode_tp: int, mla: bool) -> ModelMapping:
    """SGLang with prefill TP > KV heads: every prefill rank that holds a replicated head sends it,
    and decode waits for them all (sglang.md §3.1)."""
    rank_map(num_heads, prefill_tp, decode_tp, mla)  # the same sizes must map
    h = _effective(num_heads, mla)
    pairs: dict[tuple[int, int], tuple[int, ...]] = {}
    for d in range(decode_tp):
        mine = set(heads_of(h, decode_tp, d))
        for p in range(prefill_tp):
            common = tuple(sorted(mine & set(heads_of(h, prefill_tp, p))))
            if common:
                pairs[(p, d)] = common
    expected = tuple(tuple(sorted(p for p, e in pairs if e == d)) for d in range(decode_tp))
    return ModelMapping(prefill_tp, decode_tp, expected, pairs, _held(num_heads, decode_tp, mla))


def _mla_waits_for_every_rank(num_heads: int, prefill_tp: int, decode_tp: int, mla: bool) -> ModelMapping:
    """SGLang's non-MLA source count applied to MLA: with Tp > Td one prefill rank sends the
    latent, decode waits for all Tp/Td of ``[d·Tp/Td, (d+1)·Tp/Td)`` (sglang.md §3.1, where
    ``required_prefill_response_num`` is 1 for MLA)."""
    correct = rank_map(num_heads, prefill_tp, decode_tp, mla)
    if not mla or prefill_tp <= decode_tp:
        return correct
    k = prefill_tp // decode_tp
    expected = tuple(tuple(range(d * k, (d + 1) * k)) for d in range(decode_tp))
    return ModelMapping(prefill_tp, decode_tp, expected, correct.pairs, correct.held)


MAPPING_MUTANTS: dict[str, Build] = {
    "replicated_heads_written_twice": _every_holder_sends,
    "mla_decode_waits_for_every_rank": _mla_waits_for_every_rank,
}


def default_heads(prefill_tp: int, decode_tp: int) -> int:
    """KV heads when a configuration names none: every rank holds heads of its own (none replicated)."""
    return lcm(prefill_tp, decode_tp)


def model_mapping(
    prefill_tp: int, decode_tp: int, num_heads: int, mla: bool, mutant: str | None = None
) -> ModelMapping:
    """The mapping the model runs: ``RankMap``'s, or a mapping mutant's."""
    build = MAPPING_MUTANTS.get(mutant or "", rank_map)
    return build(num_heads, prefill_tp, decode_tp, mla)


__all__ = ["MAPPING_MUTANTS", "ModelMapping", "default_heads", "model_mapping", "rank_map"]
