"""One rank's KV cache as the engine holds it: shape, memory order, and addressing both ways.

Theory of operation
-------------------
A ``KVLayout`` names what a plan needs to know about one rank's cache and nothing else: the
model's shape (layers, total KV heads, head_dim, element size), the rank's place in its TP group
(from which its heads follow, ``heads_of``), the page (block) size in tokens, the number of pages
the rank holds, and the memory order. The unit of everything is the *head vector*: the
``head_dim`` elements of one (layer, K/V, slot, head); every run of a plan is a whole number of
them (``vector_bytes``). MLA keeps one latent vector per token and layer, no V, the same on every
rank: one head, one component.

Every order keeps one buffer (or a K and a V buffer) per layer, and inside a buffer the head
vectors are a mixed-radix array over some of the axes ``kv`` (K/V), ``page``, ``off`` (the token's
offset in its page) and ``head`` (the local head), major to minor:

===========  ===========================  ===========================  ==========================
order        engine shape (per layer)     buffer id                    axes in a buffer
===========  ===========================  ===========================  ==========================
sglang       K and V ``[slots, h, d]``    ``kv * layers + layer``      page, off, head
vllm_nhd     ``[2, blocks, bs, h, d]``    ``layer``                    kv, page, off, head
vllm_hnd     ``[2, blocks, h, bs, d]``    ``layer``                    kv, page, head, off
vllm_cpu     ``[blocks, h, bs, 2*d]``     ``layer``                    page, head, off, kv
===========  ===========================  ===========================  ==========================

(SGLang's slots are ``page * page_size + off``; with MLA the K/V axis has size 1, so SGLang keeps
one ``[slots, d]`` buffer per layer and vLLM NHD one ``[blocks, bs, d]``.) ``address`` maps a head
vector to (buffer, byte offset); ``identify`` is its exact inverse, vectorised with numpy, which
is what ``verify_plan`` reads plans with.

An engine may arrange the tokens inside each (page, head) cell its own way: vLLM's CPU kernels
keep K transposed there (``[head_dim, block_size]``, then V ``[block_size, head_dim]``), which
no head-vector run can address. Such a layout is declared ``opaque``: it is described by one of
the orders above (``vllm_cpu``: a cell is the ``block_size x 2 x head_dim`` elements of one page
and head), plans copy whole cells (the last page of a request whole, its unused slots with it,
which the engine never reads before it writes them), and it exchanges KV only with a rank of
the same order and page size (``compatible``); a different TP is fine. Between two vLLM CPU
caches of different page sizes, whose cells kvfsm knows, plans move element runs inside the
cells instead (``kvfsm.layout.cells``).

Pure: stdlib and numpy, no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from kvfsm.layout.mapping import MappingError, RankMap, heads_of
from kvfsm.protocol.errors import LocalProtocolError
from kvfsm.protocol.wire import LayoutFields

IntArray = npt.NDArray[np.int64]


class LayoutError(LocalProtocolError):
    """A layout that cannot exist, or two layouts that cannot exchange KV; the message says why."""


class KVOrder(StrEnum):
    """The memory order of one rank's KV cache (see the module's table)."""

    SGLANG = "sglang"
    VLLM_NHD = "vllm_nhd"
    VLLM_HND = "vllm_hnd"
    VLLM_CPU = "vllm_cpu"


# axes of a buffer, major to minor; "kv" absent: K and V are separate buffers
_AXES: dict[KVOrder, tuple[str, ...]] = {
    KVOrder.SGLANG: ("page", "off", "head"),
    KVOrder.VLLM_NHD: ("kv", "page", "off", "head"),
    KVOrder.VLLM_HND: ("kv", "page", "head", "off"),
    KVOrder.VLLM_CPU: ("page", "head", "off", "kv"),
}
# orders whose MLA form the engines have (one latent per token: no head or K/V axis to speak of)
_MLA_ORDERS = frozenset({KVOrder.SGLANG, KVOrder.VLLM_NHD})


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One rank's KV cache. ``num_kv_heads`` is the model's total; the rank holds ``local_heads``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    tp_size: int
    tp_rank: int
    page_size: int
    num_pages: int
    order: KVOrder = KVOrder.SGLANG
    mla: bool = False
    # the engine arranges the tokens inside each (page, head) cell its own way (vLLM's CPU
    # kernels keep K transposed there): only whole cells move, between equal layouts
    opaque: bool = False
    # derived once: the rank's global heads, the axes' sizes and strides (in head vectors)
    local_heads: range = field(init=False, repr=False, compare=False)
    _sizes: dict[str, int] = field(init=False, repr=False, compare=False)
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "tp_size", "page_size", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"KVLayout.{name} must be a positive int, got {value!r}")
        for name in ("mla", "opaque"):
            if not isinstance(getattr(self, name), bool):
                raise LayoutError(f"KVLayout.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"KVLayout.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        try:
            order = KVOrder(self.order)
        except ValueError:
            raise LayoutError(
                f"KVLayout.order must be one of {', '.join(o.value for o in KVOrder)}, got {self.order!r}"
            ) from None
        object.__setattr__(self, "order", order)
        if self.mla:
            if self.num_kv_heads != 1:
                raise LayoutError(f"an MLA layout has one latent head (num_kv_heads=1), got {self.num_kv_heads}")
            if order not in _MLA_ORDERS:
                raise LayoutError(f"order {order.value} has no MLA form; use one of {sorted(_MLA_ORDERS)}")
        try:
            local = heads_of(self.num_kv_heads, self.tp_size, self.tp_rank)
        except MappingError as exc:
            raise LayoutError(f"KVLayout heads: {exc}") from None
        object.__setattr__(self, "local_heads", local)
        sizes = {"kv": self.num_kv, "page": self.num_pages, "off": self.page_size, "head": len(local)}
        strides: dict[str, int] = {"kv": 0}  # kv stays 0 where K and V are separate buffers
        step = 1
        for axis in reversed(_AXES[order]):
            strides[axis] = step
            step *= sizes[axis]
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_strides", strides)

    # -- shape ------------------------------------------------------------------------------

    @property
    def num_kv(self) -> int:
        """Components per token and layer: 2 (K and V), 1 with MLA (the latent)."""
        return 1 if self.mla else 2

    @property
    def vector_bytes(self) -> int:
        """Bytes of one head vector (``head_dim`` elements): every run is a multiple of it."""
        return self.head_dim * self.dtype_bytes

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes of a buffer (``kv``, ``page``, ``off``, ``head``), major to minor."""
        return _AXES[self.order]

    @property
    def kv_in_buffer(self) -> bool:
        """True when K and V share a buffer (vLLM); False when each has its own (SGLang)."""
        return "kv" in _AXES[self.order]

    @property
    def num_buffers(self) -> int:
        return self.num_layers * (1 if self.kv_in_buffer else self.num_kv)

    @property
    def buffer_vectors(self) -> int:
        """Head vectors in each buffer."""
        return math.prod(self._sizes[a] for a in _AXES[self.order])

    def buffers(self) -> tuple[int, ...]:
        """The byte size of each buffer; the index is the buffer id."""
        return (self.buffer_vectors * self.vector_bytes,) * self.num_buffers

    def stride(self, axis: str) -> int:
        """Head vectors between neighbours along ``axis`` (kv, page, off, head) inside a buffer
        (0 for kv where K and V are separate buffers)."""
        return self._strides[axis]

    def buffer_of(self, layer: int, kv: int) -> int:
        """The buffer that holds component ``kv`` of ``layer``."""
        return layer if self.kv_in_buffer else kv * self.num_layers + layer

    # -- addressing -------------------------------------------------------------------------

    def address(self, layer: int, kv: int, page: int, offset_in_page: int, local_head: int) -> tuple[int, int]:
        """(buffer, byte offset) of one head vector; ``local_head`` counts from the rank's first head."""
        for name, value, bound in (
            ("layer", layer, self.num_layers),
            ("kv", kv, self.num_kv),
            ("page", page, self.num_pages),
            ("offset_in_page", offset_in_page, self.page_size),
            ("local_head", local_head, len(self.local_heads)),
        ):
            if not 0 <= value < bound:
                raise LayoutError(f"{name} {value} is outside [0, {bound}) of this layout")
        s = self._strides
        vector = kv * s["kv"] + page * s["page"] + offset_in_page * s["off"] + local_head * s["head"]
        return self.buffer_of(layer, kv), vector * self.vector_bytes

    def identify(
        self, buffer: npt.ArrayLike, byte_offset: npt.ArrayLike
    ) -> tuple[IntArray, IntArray, IntArray, IntArray]:
        """The exact inverse of ``address``, vectorised: (layer, kv, slot, local_head) of the head
        vector at each (buffer, byte offset), where ``slot = page * page_size + offset_in_page``.
        The caller checks that offsets are whole vectors inside the buffer."""
        buf = np.asarray(buffer, dtype=np.int64)
        vec = np.asarray(byte_offset, dtype=np.int64) // self.vector_bytes
        axes = self.axes
        coords = np.unravel_index(vec, tuple(self._sizes[a] for a in axes))
        got = {a: c.astype(np.int64, copy=False) for a, c in zip(axes, coords, strict=True)}
        if self.kv_in_buffer:
            layer, kv = buf, got["kv"]
        else:
            kv, layer = np.divmod(buf, self.num_layers)
        slot = got["page"] * self.page_size
        slot += got["off"]
        return layer, kv, slot, got["head"]

    # -- the wire ------------------------------------------------------------------------------

    def to_wire(self) -> LayoutFields:
        """This layout as a registration carries it."""
        return LayoutFields(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes, self.tp_size, self.tp_rank,
            self.page_size, self.num_pages, self.order.value, self.mla, self.opaque,
        )  # fmt: skip

    @classmethod
    def from_wire(cls, f: LayoutFields) -> KVLayout:
        """The layout a peer's registration describes; ``LayoutError`` (saying why) if it cannot exist."""
        return cls(
            f.num_layers, f.num_kv_heads, f.head_dim, f.dtype_bytes, f.tp_size, f.tp_rank, f.page_size,
            f.num_pages, f.order, f.mla, f.opaque,  # type: ignore[arg-type] # (an unknown order is a LayoutError)
        )  # fmt: skip

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all buffers: what a registration states as its page size."""
        return sum(self.buffers()) // self.num_pages

    def vectors_of(self, buffer: int) -> tuple[IntArray, IntArray, IntArray, IntArray]:
        """(layer, kv, slot, local_head) of every head vector of ``buffer``, in memory order."""
        if not 0 <= buffer < self.num_buffers:
            raise LayoutError(f"buffer {buffer} is outside [0, {self.num_buffers})")
        n = self.buffer_vectors
        return self.identify(np.full(n, buffer, dtype=np.int64), np.arange(n, dtype=np.int64) * self.vector_bytes)


def compatible(src: KVLayout, dst: KVLayout) -> str | None:
    """None when ``src`` (prefill) can send KV to ``dst`` (decode); else the reason it cannot."""
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            return f"model shape differs: {name} {a} at prefill, {b} at decode"
    if src.mla != dst.mla:
        return f"MLA on one side only (prefill mla={src.mla}, decode mla={dst.mla})"
    # vLLM's CPU cells are known (kvfsm.layout.cells): another page size is planned inside them
    cells = src.order == dst.order == KVOrder.VLLM_CPU
    if (src.opaque or dst.opaque) and (
        (src.opaque, src.order) != (dst.opaque, dst.order) or (src.page_size != dst.page_size and not cells)
    ):
        return (
            "a cache whose pages are opaque exchanges KV only with a rank of the same order, and of the "
            f"same page size unless both are vLLM CPU caches (prefill {src.order.value}/{src.page_size}/"
            f"opaque={src.opaque}, decode {dst.order.value}/{dst.page_size}/opaque={dst.opaque})"
        )
    try:
        RankMap(src.num_kv_heads, src.tp_size, dst.tp_size, src.mla)
    except MappingError as exc:
        return f"no rank mapping from TP {src.tp_size} to TP {dst.tp_size}: {exc}"
    return None
