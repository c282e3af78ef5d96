"""The cache a single engine would hold: the reference a heterogeneous transfer is checked against.

Theory of operation
-------------------
``EngineCache(layout)`` keeps one rank's KV cache the way the engine allocates it: one flat
``uint8`` buffer per buffer id (``layout.buffers()`` sizes, what a data plane registers), each
viewed with the engine's own tensor shape (the table of ``kv.py``):

===========  =====================================================  ==============================
order        tensor per buffer                                      buffer id
===========  =====================================================  ==============================
sglang       K and V ``[slots, h, d]`` (MLA: one ``[slots, d]``)    ``kv * layers + layer``
vllm_nhd     ``[2, blocks, bs, h, d]`` (MLA: ``[blocks, bs, d]``)   ``layer``
vllm_hnd     ``[2, blocks, h, bs, d]``                              ``layer``
vllm_cpu     ``[blocks, h, bs, 2*d]`` (K then V per token)          ``layer``
===========  =====================================================  ==============================

Every element of a request is ``value(layer, token, head, dim, kv, seed=...)``: a hash of its
coordinates (the token's index within the request, the *global* KV head) and the request's seed,
so that a wrong layer, token, head, dim, K/V or request shows up as a wrong element. ``fill``
writes a request's tokens the way the prefill engine computed them; ``check`` compares every
element of a request against what a single engine with this layout would hold; ``untouched``
proves that nothing outside the requests' (pages, tokens, heads) was written: every other byte
keeps the sentinel the cache was allocated with.

Independent of the planner and of ``KVLayout.address``/``identify`` on purpose: it is written
from the engines' tensor shapes (numpy views and transposes) only, so that a test or the demo
that moves bytes with a plan and checks them here compares two separate descriptions of memory.

Pure: stdlib and numpy, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from kvfsm.layout.kv import KVLayout, KVOrder, LayoutError

SENTINEL = 0xA5  # every byte of a fresh cache: anything else outside a request was written by someone
Bytes = npt.NDArray[np.uint8]
Pages = npt.ArrayLike | Sequence[int]

_DTYPES: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# odd 64-bit multipliers: each coordinate moves the hash by a different large step, then the
# splitmix64 finaliser spreads every input bit over every output bit
_MIX = tuple(
    np.uint64(m)
    for m in (
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xA0761D6478BD642F,
        0xE7037ED1A0B428DB,
    )
)
_FIN1, _FIN2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class CacheMismatch(LayoutError):
    """An engine cache holds something other than what a single engine would hold; the message
    names the first wrong element (or byte) and how many differ."""


def dtype_of(dtype_bytes: int) -> type[np.unsignedinteger]:
    """The unsigned int type ``value`` produces for elements of ``dtype_bytes`` bytes."""
    try:
        return _DTYPES[dtype_bytes]
    except KeyError:
        raise LayoutError(f"an engine cache has elements of 1, 2, 4 or 8 bytes, not {dtype_bytes}") from None


def value(
    layer: npt.ArrayLike,
    token: npt.ArrayLike,
    head: npt.ArrayLike,
    dim: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seed: int = 0,
    dtype_bytes: int = 2,
) -> npt.NDArray[np.unsignedinteger]:
    """The element an engine computed for (layer, token of the request, global KV head, dim,
    K/V) of the request ``seed``, as an unsigned int of ``dtype_bytes`` bytes (broadcasting)."""
    dtype = dtype_of(dtype_bytes)
    coords = (seed, layer, token, head, dim, kv)
    with np.errstate(over="ignore"):
        x = np.zeros((), dtype=np.uint64)
        for c, m in zip(coords, _MIX, strict=True):
            x = x + np.asarray(c, dtype=np.int64).astype(np.uint64) * m
        x = x ^ (x >> np.uint64(30))
        x = x * _FIN1
        x = x ^ (x >> np.uint64(27))
        x = x * _FIN2
        x = x ^ (x >> np.uint64(31))
    return np.asarray(x).astype(dtype)


class EngineCache:
    """One rank's KV cache as its engine holds it, every byte ``SENTINEL`` until written."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.dtype = dtype_of(layout.dtype_bytes)
        self._flat: list[Bytes] = [np.full(size, SENTINEL, dtype=np.uint8) for size in layout.buffers()]
        self.tensors = [self._shaped(b) for b in self._flat]

    @property
    def buffers(self) -> list[Bytes]:
        """The flat byte buffers in buffer-id order: what a data plane registers."""
        return self._flat

    def elements(self, num_tokens: int) -> int:
        """Elements of a request of ``num_tokens`` tokens on this rank (what ``check`` counts)."""
        lay = self.layout
        return lay.num_layers * lay.num_kv * num_tokens * len(lay.local_heads) * lay.head_dim

    # -- the engine's shapes ----------------------------------------------------------------

    def _shaped(self, flat: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
        """``flat`` (bytes, or one flag per element) viewed as the engine's tensor of one buffer."""
        lay = self.layout
        blocks, bs, h, d = lay.num_pages, lay.page_size, len(lay.local_heads), lay.head_dim
        arr = flat.view(self.dtype) if flat.dtype == np.uint8 else flat
        if lay.order == KVOrder.SGLANG:
            return arr.reshape((blocks * bs, d) if lay.mla else (blocks * bs, h, d))
        if lay.order == KVOrder.VLLM_NHD:
            return arr.reshape((blocks, bs, d) if lay.mla else (2, blocks, bs, h, d))
        if lay.order == KVOrder.VLLM_HND:
            return arr.reshape(2, blocks, h, bs, d)
        return arr.reshape(blocks, h, bs, 2 * d)  # vllm_cpu

    def _component(self, tensors: Sequence[npt.NDArray[np.generic]], layer: int, kv: int) -> npt.NDArray[np.generic]:
        """A view ``[blocks, bs, local head, dim]`` of (layer, K/V) in ``tensors`` (writes go through)."""
        lay = self.layout
        blocks, bs, h, d = lay.num_pages, lay.page_size, len(lay.local_heads), lay.head_dim
        if lay.order == KVOrder.SGLANG:
            return tensors[kv * lay.num_layers + layer].reshape(blocks, bs, h, d)
        t = tensors[layer]
        if lay.order == KVOrder.VLLM_NHD:
            return t.reshape(blocks, bs, 1, d) if lay.mla else t[kv, ...]
        if lay.order == KVOrder.VLLM_HND:
            return t[kv, ...].transpose(0, 2, 1, 3)
        return t[..., kv * d : (kv + 1) * d].transpose(0, 2, 1, 3)  # vllm_cpu: [blocks, h, bs, 2d]

    def _slots(self, pages: Pages, num_tokens: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(page, offset in page) of each token ``[0, num_tokens)`` of a request held in ``pages``."""
        lay = self.layout
        arr = np.asarray(pages, dtype=np.int64).reshape(-1)
        need = -(-num_tokens // lay.page_size)
        if arr.size < need:
            raise LayoutError(f"{num_tokens} tokens need {need} pages of {lay.page_size}; the page list has {arr.size}")
        if arr.size and (arr.min() < 0 or arr.max() >= lay.num_pages):
            raise LayoutError(f"page list has pages outside [0, {lay.num_pages})")
        t = np.arange(num_tokens, dtype=np.int64)
        return arr[t // lay.page_size], t % lay.page_size

    def _expected(self, layer: int, kv: int, num_tokens: int, seed: int) -> npt.NDArray[np.unsignedinteger]:
        lay = self.layout
        heads = np.arange(lay.local_heads.start, lay.local_heads.stop, dtype=np.int64)
        return value(
            layer,
            np.arange(num_tokens, dtype=np.int64)[:, None, None],
            heads[None, :, None],
            np.arange(lay.head_dim, dtype=np.int64)[None, None, :],
            kv,
            seed=seed,
            dtype_bytes=lay.dtype_bytes,
        )

    # -- a request ----------------------------------------------------------------------------

    def fill(self, pages: Pages, num_tokens: int, seed: int) -> None:
        """Write the request ``seed``'s tokens ``[0, num_tokens)``, token ``t`` in page
        ``pages[t // page_size]`` at offset ``t % page_size``, for this rank's heads."""
        page, off = self._slots(pages, num_tokens)
        for layer in range(self.layout.num_layers):
            for kv in range(self.layout.num_kv):
                self._component(self.tensors, layer, kv)[page, off] = self._expected(layer, kv, num_tokens, seed)

    def expected(self, layer: int, kv: int, num_tokens: int, seed: int) -> npt.NDArray[np.unsignedinteger]:
        """What a single engine holds for (layer, K/V) of the request: ``[token, local head, dim]``."""
        return self._expected(layer, kv, num_tokens, seed)

    def check(self, pages: Pages, num_tokens: int, seed: int) -> int:
        """The number of elements checked; raises ``CacheMismatch`` naming the first wrong
        (layer, token, head, K/V, dim) unless every element of the request is what a single
        engine with this layout would hold."""
        lay = self.layout
        page, off = self._slots(pages, num_tokens)
        checked = 0
        for layer in range(lay.num_layers):
            for kv in range(lay.num_kv):
                got = self._component(self.tensors, layer, kv)[page, off]
                want = self._expected(layer, kv, num_tokens, seed)
                wrong = got != want
                if wrong.any():
                    t, h, i = (int(x) for x in np.argwhere(wrong)[0])
                    part = "latent" if lay.mla else "KV"[kv]
                    raise CacheMismatch(
                        f"{lay.order.value} rank {lay.tp_rank}/{lay.tp_size}: layer {layer} {part} token {t} "
                        f"head {lay.local_heads.start + h} dim {i} (page {int(page[t])} offset {int(off[t])}) "
                        f"holds {int(got[t, h, i]):#x}, a single engine holds {int(want[t, h, i]):#x} "
                        f"({int(wrong.sum())} of {wrong.size} elements of this layer and component differ)"
                    )
                checked += want.size
        return checked

    def erase(self, pages: Pages, num_tokens: int) -> None:
        """Put the sentinel back over the request's tokens (its pages go back to a free list)."""
        page, off = self._slots(pages, num_tokens)
        fill = self.dtype(int.from_bytes(bytes([SENTINEL]) * self.layout.dtype_bytes, "little"))
        for layer in range(self.layout.num_layers):
            for kv in range(self.layout.num_kv):
                self._component(self.tensors, layer, kv)[page, off] = fill

    def untouched(self, requests: Iterable[tuple[Pages, int]] = ()) -> int:
        """The number of bytes checked; raises ``CacheMismatch`` unless every byte outside the
        given requests' (pages, number of tokens) still holds the sentinel."""
        lay = self.layout
        masks = [np.zeros(b.size // lay.dtype_bytes, dtype=np.bool_) for b in self._flat]
        shaped = [self._shaped(m) for m in masks]
        for pages, num_tokens in requests:
            page, off = self._slots(pages, num_tokens)
            for layer in range(lay.num_layers):
                for kv in range(lay.num_kv):
                    self._component(shaped, layer, kv)[page, off] = True
        checked = 0
        for buf, (flat, mask) in enumerate(zip(self._flat, masks, strict=True)):
            free = ~np.repeat(mask, lay.dtype_bytes)
            bad = np.flatnonzero(free & (flat != SENTINEL))
            if bad.size:
                byte = int(bad[0])
                where = np.unravel_index(byte // lay.dtype_bytes, self.tensors[buf].shape)
                raise CacheMismatch(
                    f"{lay.order.value} rank {lay.tp_rank}/{lay.tp_size}: buffer {buf} byte {byte} "
                    f"(element {tuple(int(x) for x in where)} of the engine tensor {self.tensors[buf].shape}) "
                    f"is outside every request and holds {int(flat[byte]):#04x}, not the sentinel "
                    f"({bad.size} such bytes in this buffer)"
                )
            checked += int(free.sum())
        return checked
