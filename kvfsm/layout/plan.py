"""Transfer plans: the byte runs that move one chunk of a request from a prefill rank to a decode rank.

Theory of operation
-------------------
A chunk is the tokens ``[first_token, first_token + num_tokens)`` of a request. On each side token
``t`` lives in page ``pages[t // page_size]`` at offset ``t % page_size``, each side with its own
page size and page list. The pair (prefill rank ``p``, decode rank ``d``) moves the heads
``RankMap.heads(p, d)`` (one contiguous range of global heads; each side indexes it from its own
first head), for every layer and for K and V (or the MLA latent).

The planner lists the head vectors to move in the destination's memory order (so that what is
contiguous at the destination comes out adjacent), computes both addresses with numpy, and
coalesces neighbours that are contiguous on both sides into one run. Every order keeps a buffer
per layer, and the offsets inside a layer's buffer do not depend on the layer, so the runs of
layer 0 are computed once and repeated with the buffer ids shifted: planning costs
O(tokens x heads) per chunk, not O(layers x tokens x heads).

A plan is ``direct`` when both sides hold the same heads in the same order and page size and the
pair moves all of them: every run is then a whole page per buffer component (or several adjacent
pages), cut only where the chunk starts or ends inside a page. Otherwise it is ``sliced``: runs per
(layer, K/V, token, head range), coalesced wherever consecutive on both sides.

The chunk's destination position is ``first_token`` (the running total of the request's tokens),
never the chunk's own length, and the destination head index is counted from the destination
rank's first head, never from a global rank: two bugs of SGLang's head-slice math (the
multi-chunk overwrite fixed in SGLang PR 18968, and head offsets from the global rank). Both
survive here only as named mutants (``MUTANTS``) that tests feed to ``verify_plan`` to show it
catches them.

Pure: stdlib and numpy, no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvfsm.layout.cells import cell_runs, cells_apply
from kvfsm.layout.kv import IntArray, KVLayout, LayoutError, compatible
from kvfsm.layout.mapping import RankMap

PlanKind = Literal["direct", "sliced"]
Mutant = Literal["head_offset_from_global_rank", "chunk_offset_from_chunk_length"]
MUTANTS: tuple[Mutant, ...] = ("head_offset_from_global_rank", "chunk_offset_from_chunk_length")

# columns of Plan.runs
SRC_BUFFER, SRC_OFFSET, DST_BUFFER, DST_OFFSET, LENGTH = range(5)


@dataclass(frozen=True, eq=False)
class Plan:
    """The writes of one (chunk, source rank, destination rank): ``runs[i]`` copies ``LENGTH``
    bytes from (``SRC_BUFFER``, ``SRC_OFFSET``) to (``DST_BUFFER``, ``DST_OFFSET``)."""

    kind: PlanKind
    runs: IntArray  # int64, shape (n, 5), layer-major

    @property
    def descriptors(self) -> int:
        """Number of runs: the descriptors a transport posts for this plan."""
        return int(self.runs.shape[0])

    @property
    def bytes(self) -> int:
        return int(self.runs[:, LENGTH].sum())

    def segments(self, src: KVLayout, dst: KVLayout) -> tuple[IntArray, IntArray, IntArray]:
        """The runs as (source offsets, destination offsets, lengths) in each side's virtual KV
        region: its buffers one after another, buffer ``i`` at the sum of the sizes of the
        buffers before it (``KVLayout.buffers``), as a data plane addresses a KV region
        registered as a list of buffers. ``SegmentArray(*plan.segments(src, dst))`` is the write."""
        runs = self.runs
        sbases, dbases = (np.concatenate(([0], np.cumsum(lay.buffers(), dtype=np.int64)[:-1])) for lay in (src, dst))
        if runs.shape[0] and (
            int(runs[:, SRC_BUFFER].max()) >= len(sbases) or int(runs[:, DST_BUFFER].max()) >= len(dbases)
        ):
            raise LayoutError("the plan names a buffer its layouts do not have")
        return (
            sbases[runs[:, SRC_BUFFER]] + runs[:, SRC_OFFSET],
            dbases[runs[:, DST_BUFFER]] + runs[:, DST_OFFSET],
            runs[:, LENGTH].copy(),
        )


def _pages(pages: npt.ArrayLike, layout: KVLayout, side: str, end_token: int, first_page: int) -> IntArray:
    arr = np.asarray(pages, dtype=np.int64).reshape(-1)
    need = -(-end_token // layout.page_size) - first_page
    if first_page < 0 or arr.size < need:
        raise LayoutError(
            f"{side} page list holds {arr.size} pages from the request's page {first_page}; "
            f"tokens up to {end_token} need {need}"
        )
    if arr.size and (arr.min() < 0 or arr.max() >= layout.num_pages):
        raise LayoutError(f"{side} page list has pages outside [0, {layout.num_pages})")
    return arr


class Planner:
    """Plans for one (source layout, destination layout, mapping): the per-pair head offsets and the
    per-(K/V, offset in page, head) address tables are built once; ``plan`` is then a few numpy
    operations per chunk. Raises ``LayoutError`` when the layouts cannot exchange KV."""

    def __init__(self, src: KVLayout, dst: KVLayout, mapping: RankMap, *, mutant: Mutant | None = None) -> None:
        reason = compatible(src, dst)
        if reason is not None:
            raise LayoutError(f"prefill rank {src.tp_rank} cannot send to decode rank {dst.tp_rank}: {reason}")
        if (mapping.prefill_tp, mapping.decode_tp, mapping.mla) != (src.tp_size, dst.tp_size, src.mla) or (
            not src.mla and mapping.num_heads != src.num_kv_heads
        ):
            raise LayoutError(f"{mapping!r} does not describe prefill TP {src.tp_size} -> decode TP {dst.tp_size}")
        if mutant is not None and mutant not in MUTANTS:
            raise LayoutError(f"unknown mutant {mutant!r}; one of {MUTANTS}")
        self.src, self.dst, self.mapping, self.mutant = src, dst, mapping, mutant
        heads = mapping.heads(src.tp_rank, dst.tp_rank)
        self.heads = heads
        n = len(heads)
        src_first = heads.start - src.local_heads.start
        dst_first = heads.start - dst.local_heads.start
        if mutant == "head_offset_from_global_rank":
            dst_first = src.tp_rank * n  # SGLang's slip: the sender's global rank, not its place in the group
        # opaque: whole cells between equal page sizes, element runs inside CPU cells otherwise
        self.cells = cells_apply(src, dst)
        self.whole_pages = src.opaque and not self.cells
        self._src_first, self._dst_first = src_first, dst_first
        self.kind: PlanKind = (
            "direct"
            if n
            and src.order == dst.order
            and src.page_size == dst.page_size
            and src.local_heads == dst.local_heads
            and n == len(src.local_heads)
            else "sliced"
        )
        # The enumeration grid: the destination's axes in its memory order (K/V outermost where it
        # picks the buffer), each a broadcastable arange; "page" is the chunk's page index.
        axes = dst.axes if dst.kv_in_buffer else ("kv", *dst.axes)
        self._axes = axes
        self._page_axis = axes.index("page")

        def grid(axis: str, size: int) -> IntArray:
            shape = [1] * len(axes)
            shape[axes.index(axis)] = size
            return np.arange(size, dtype=np.int64).reshape(shape)

        kv = grid("kv", src.num_kv)
        head = grid("head", n)
        self._off = grid("off", dst.page_size)
        self._dst_inpage = (
            kv * dst.stride("kv") + self._off * dst.stride("off") + (dst_first + head) * dst.stride("head")
        )
        self._src_kvhead = kv * src.stride("kv") + (src_first + head) * src.stride("head")
        self._dst_buffer = kv * (0 if dst.kv_in_buffer else dst.num_layers)  # buffer_of(0, kv)
        self._src_buffer = kv * (0 if src.kv_in_buffer else src.num_layers)
        self._shape = [src.num_kv if a == "kv" else n if a == "head" else dst.page_size for a in axes]

    def span(self, first_token: int, num_tokens: int) -> tuple[int, int]:
        """The tokens a chunk's plan moves: the chunk's own, or, between opaque layouts, every
        token of the pages it touches (``KVLayout.opaque``: whole cells only)."""
        if not self.whole_pages or not num_tokens:
            return first_token, num_tokens
        ps = self.src.page_size
        start = first_token // ps * ps
        return start, -(-(first_token + num_tokens) // ps) * ps - start

    def plan(
        self,
        src_pages: npt.ArrayLike,
        dst_pages: npt.ArrayLike,
        first_token: int,
        num_tokens: int,
        *,
        src_first_page: int = 0,
        dst_first_page: int = 0,
    ) -> Plan:
        """The plan that moves tokens ``[first_token, first_token + num_tokens)`` from the source
        rank to the destination rank; empty when the pair moves no heads. A page list starts at
        the request's page ``*_first_page`` (0: its first): token ``t`` lives in
        ``pages[t // page_size - first_page]``, so a chunk can pass only the pages it touches."""
        src, dst = self.src, self.dst
        if first_token < 0 or num_tokens < 0:
            raise LayoutError(f"a chunk needs first_token >= 0 and num_tokens >= 0, got {first_token}, {num_tokens}")
        first_token, num_tokens = self.span(first_token, num_tokens)
        end = first_token + num_tokens
        spages = _pages(src_pages, src, "prefill", end, src_first_page)
        dpages = _pages(dst_pages, dst, "decode", end, dst_first_page)
        if not self.heads or num_tokens == 0:
            return Plan(self.kind, np.zeros((0, 5), dtype=np.int64))
        if self.cells:
            n = len(self.heads)
            sh = np.arange(self._src_first, self._src_first + n, dtype=np.int64)
            dh = np.arange(self._dst_first, self._dst_first + n, dtype=np.int64)
            runs = cell_runs(src, dst, spages, dpages, first_token, num_tokens, sh, dh, src_first_page, dst_first_page)
            runs.setflags(write=False)
            return Plan("sliced", runs)
        # where the destination believes the chunk starts (only a mutant gets it wrong)
        dst_start = first_token
        if self.mutant == "chunk_offset_from_chunk_length":
            dst_start = num_tokens if first_token else 0
        shift = first_token - dst_start
        ps = dst.page_size
        p0, p1 = dst_start // ps, (dst_start + num_tokens - 1) // ps + 1
        shape = list(self._shape)
        shape[self._page_axis] = p1 - p0
        page_shape = [1] * len(shape)
        page_shape[self._page_axis] = p1 - p0
        page_idx = np.arange(p0, p1, dtype=np.int64).reshape(page_shape)
        token = page_idx * ps + self._off  # destination token of each (page, off)
        mask = np.broadcast_to((token >= dst_start) & (token < dst_start + num_tokens), shape)
        dvec = self._dst_inpage + dpages[np.clip(page_idx - dst_first_page, 0, dpages.size - 1)] * dst.stride("page")
        stok = np.clip(token + shift, first_token, end - 1)
        sp, so = np.divmod(stok, src.page_size)
        svec = self._src_kvhead + spages[sp - src_first_page] * src.stride("page") + so * src.stride("off")
        dbuf = np.broadcast_to(self._dst_buffer, shape)[mask]
        sbuf = np.broadcast_to(self._src_buffer, shape)[mask]
        dvec = np.broadcast_to(dvec, shape)[mask]
        svec = np.broadcast_to(svec, shape)[mask]
        # a run continues while both sides stay in their buffer and advance by one vector
        cont = (np.diff(dvec) == 1) & (np.diff(svec) == 1) & (np.diff(dbuf) == 0) & (np.diff(sbuf) == 0)
        starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
        counts = np.diff(np.append(starts, dvec.size))
        vb = dst.vector_bytes
        base = np.stack((sbuf[starts], svec[starts] * vb, dbuf[starts], dvec[starts] * vb, counts * vb), axis=1)
        layers = np.arange(src.num_layers, dtype=np.int64)[:, None]
        runs = np.broadcast_to(base, (src.num_layers, *base.shape)).copy()
        runs[:, :, SRC_BUFFER] += layers  # every order: buffer_of(layer, kv) == buffer_of(0, kv) + layer
        runs[:, :, DST_BUFFER] += layers
        runs = runs.reshape(-1, 5)
        runs.setflags(write=False)  # a plan is a value: transports and verify_plan only read it
        return Plan(self.kind, runs)


def plan_chunk(
    src: KVLayout,
    dst: KVLayout,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    first_token: int,
    num_tokens: int,
    mapping: RankMap,
    *,
    mutant: Mutant | None = None,
) -> Plan:
    """The plan for one chunk from ``src.tp_rank`` to ``dst.tp_rank`` (a ``Planner`` used once;
    keep a ``Planner`` per peer and layout to plan many chunks)."""
    return Planner(src, dst, mapping, mutant=mutant).plan(src_pages, dst_pages, first_token, num_tokens)
