"""Rank mapping between a prefill TP group and a decode TP group: who sends which KV heads to whom.

Theory of operation
-------------------
A rank of a TP group of size ``T`` holds a slice of the model's ``H`` KV heads (``heads_of``):
``H / T`` heads when ``H >= T`` (``T`` divides ``H``), else one head shared by ``T / H`` ranks
(replicated heads: ``H`` divides ``T``). MLA keeps one latent vector per token, the same on every
rank: for the mapping it is one head that every rank holds (``RankMap(..., mla=True)``).

For every decode rank ``d`` and every head ``g`` it holds, exactly one prefill rank sends ``g``:
among the prefill ranks that hold ``g`` (one, or several where prefill replicates heads), the one
at index ``d mod (number of holders)``, so that the decode ranks that need a replicated head read
it from different holders. From that follow, per room, a decode rank's sources, a prefill rank's
destinations (empty: the rank does not take part in the room, and nobody waits for it) and the
heads each (source, destination) pair moves (``heads``: one contiguous range).

This fixes by construction the mapping bugs of SGLang's disaggregation (its rank mapping and
head-slice math; replicated GQA heads: SGLang #30997): a destination head offset computed from the
global rank instead of the rank within its group, head slices starting at the absolute decode
rank, replicated heads written by every holder, and decode waiting for MLA ranks that never send.

Pure: no I/O, no clocks, no threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfsm.protocol.errors import LocalProtocolError


class MappingError(LocalProtocolError):
    """The two TP groups cannot be mapped onto each other (sizes that do not divide)."""


def heads_of(num_heads: int, tp_size: int, tp_rank: int) -> range:
    """The global KV heads that rank ``tp_rank`` of a TP group of ``tp_size`` holds."""
    if num_heads < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise MappingError(f"no rank {tp_rank} of TP {tp_size} with {num_heads} KV heads")
    if num_heads >= tp_size:
        if num_heads % tp_size:
            raise MappingError(f"{num_heads} KV heads do not split evenly over TP {tp_size}")
        per = num_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % num_heads:
        raise MappingError(f"TP {tp_size} is not a multiple of {num_heads} KV heads (replicated heads)")
    head = tp_rank // (tp_size // num_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class RankMap:
    """Who sends what between prefill TP ``prefill_tp`` and decode TP ``decode_tp`` for a model
    with ``num_heads`` KV heads (ignored with ``mla``: one latent, held by every rank)."""

    num_heads: int
    prefill_tp: int
    decode_tp: int
    mla: bool = False
    # (source, destination) -> the global heads moved, built once
    _pairs: dict[tuple[int, int], range] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        heads = 1 if self.mla else self.num_heads
        pairs: dict[tuple[int, int], list[int]] = {}
        holders: dict[int, list[int]] = {}
        for p in range(self.prefill_tp):
            for g in heads_of(heads, self.prefill_tp, p):
                holders.setdefault(g, []).append(p)
        for d in range(self.decode_tp):
            for g in heads_of(heads, self.decode_tp, d):
                ranks = holders[g]
                pairs.setdefault((ranks[d % len(ranks)], d), []).append(g)
        built = {}
        for key, gs in pairs.items():
            assert gs == list(range(gs[0], gs[-1] + 1)), (key, gs)  # contiguous by construction
            built[key] = range(gs[0], gs[-1] + 1)
        object.__setattr__(self, "_pairs", built)

    @property
    def effective_heads(self) -> int:
        """Heads as the mapping counts them (1 with MLA)."""
        return 1 if self.mla else self.num_heads

    def sources_of(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks that send to ``decode_rank``, ascending."""
        return tuple(sorted(p for p, d in self._pairs if d == decode_rank))

    def dests_of(self, prefill_rank: int) -> tuple[int, ...]:
        """The decode ranks that ``prefill_rank`` sends to, ascending (empty: it takes no part)."""
        return tuple(sorted(d for p, d in self._pairs if p == prefill_rank))

    def heads(self, prefill_rank: int, decode_rank: int) -> range:
        """The global heads ``prefill_rank`` sends to ``decode_rank`` (empty: none)."""
        return self._pairs.get((prefill_rank, decode_rank), range(0))

    def pairs(self) -> list[tuple[int, int]]:
        """Every (prefill rank, decode rank) that moves KV, sorted."""
        return sorted(self._pairs)
