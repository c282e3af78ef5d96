"""The write plan each KV write of the model carries, made by ``kvfsm.layout`` and proved by ``verify_plan``.

Theory of operation
-------------------
A model write is (room, source rank ``p``, chunk, destination rank ``d``). ``WritePlans`` gives it
the bytes it would move: ``kvfsm.layout.Planner`` for a small per-rank layout derived from the
``CheckConfig`` (one layer, ``head_dim`` 1, one-byte elements, SGLang's order, the model's KV
heads or MLA, the rank's TP size and rank, one page of the layout per model page), and
``kvfsm.layout.verify_plan`` checks it at the write's landing (``always.write_plan_exact``).

A model chunk is one page. A layout page holds ``_TOKENS_PER_PAGE`` tokens, and the request's
last chunk fills one token of its page only (a prompt whose length is no multiple of the page
size; sglang.md §6.3 names such a non-aligned chunk end as what exposed the multi-chunk
overwrite): chunk ``k`` is the tokens ``[first, first + n)`` with ``first`` the running total of
the earlier chunks' tokens. The page lists on both sides are the room's pages as the model knows
them (``Model.pages``). With chunks of one size the overwrite would show from the third chunk on;
the short last chunk shows it on the second, within the presets' two chunks.

The correct planner passes ``verify_plan`` for every layout pair (``tests/layout`` prove it over
every TP, head count, page size and order); here the check runs on every configuration anyway,
memoised per (p, d, chunk, first token, tokens, page lists): a plan is built and verified once per
key, and a landing effect is computed once per (control, item), so it costs the exploration
nothing measurable. A *plan mutant* (``PLAN_MUTANTS``, selected by ``CheckConfig.mutant``) plans
with one of ``kvfsm.layout.MUTANTS`` instead. The runtime does not execute plans yet, so plan
mutants are found by the checker only (no replay).

``head_offset_from_global_rank`` depends on the ranks' global numbers, which the split into
independent components renumbers and the symmetry reduction renames (``RANK_SENSITIVE``): under
it both keep every rank as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfsm.layout import KVLayout, KVOrder, Mutant, PlanError, Planner, RankMap, verify_plan

if TYPE_CHECKING:
    from kvfsm.check.model import CheckConfig

# checker mutant name -> kvfsm.layout planner mutant
PLAN_MUTANTS: dict[str, Mutant] = {
    "head_offset_from_global_rank": "head_offset_from_global_rank",
    "multi_chunk_overwrite": "chunk_offset_from_chunk_length",
}
# plan mutants whose verdict depends on which global rank a rank is (no renumbering, no renaming)
RANK_SENSITIVE = frozenset({"head_offset_from_global_rank"})

_TOKENS_PER_PAGE = 2


class WritePlans:
    """Whether the plan of a model write writes exactly its chunk's head vectors (memoised)."""

    def __init__(self, cfg: CheckConfig, num_pages: int) -> None:
        self.cfg = cfg
        self.num_pages = num_pages
        self.mutant: Mutant | None = PLAN_MUTANTS.get(cfg.mutant or "")
        self.mapping = RankMap(cfg.heads, cfg.prefill_ranks, cfg.decode_ranks, cfg.mla)
        self._planners: dict[tuple[int, int], Planner] = {}
        self._exact: dict[tuple[int, int, int, int, int, tuple[int, ...], tuple[int, ...]], bool] = {}

    def layout(self, tp_size: int, tp_rank: int) -> KVLayout:
        """The layout of rank ``tp_rank`` of a TP group of ``tp_size`` in the model."""
        return KVLayout(
            num_layers=1,
            num_kv_heads=1 if self.cfg.mla else self.cfg.heads,
            head_dim=1,
            dtype_bytes=1,
            tp_size=tp_size,
            tp_rank=tp_rank,
            page_size=_TOKENS_PER_PAGE,
            num_pages=self.num_pages,
            order=KVOrder.SGLANG,
            mla=self.cfg.mla,
        )

    def tokens(self, chunk_id: int) -> tuple[int, int]:
        """(first token, tokens) of chunk ``chunk_id``: a full page each, the last chunk one token."""
        first = chunk_id * _TOKENS_PER_PAGE
        return first, 1 if chunk_id == self.cfg.chunks - 1 else _TOKENS_PER_PAGE

    def exact(self, p: int, d: int, chunk_id: int, pages: tuple[int, ...]) -> bool:
        """The plan of (``p``, chunk ``chunk_id``, ``d``) between the room's ``pages`` passes ``verify_plan``."""
        first, n = self.tokens(chunk_id)
        key = (p, d, chunk_id, first, n, pages, pages)
        hit = self._exact.get(key)
        if hit is None:
            planner = self._planners.get((p, d))
            if planner is None:
                src = self.layout(self.cfg.prefill_ranks, p)
                dst = self.layout(self.cfg.decode_ranks, d)
                planner = self._planners[(p, d)] = Planner(src, dst, self.mapping, mutant=self.mutant)
            plan = planner.plan(pages, pages, first, n)
            try:
                verify_plan(plan, planner.src, planner.dst, pages, pages, first, n, self.mapping)
            except PlanError:
                hit = False
            else:
                hit = True
            self._exact[key] = hit
        return hit


__all__ = ["PLAN_MUTANTS", "RANK_SENSITIVE", "WritePlans"]
