"""The loopback's registered memory: host views of a region's buffers, and copies between
regions of one or several buffers (``kvfsm.transport.base.Parts``), each within its parts."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvfsm.transport.base import Parts, Segment, SegmentArray, TransportError, as_region, check_parts, check_segments


class Pieces(NamedTuple):
    """A registered region's parts: their views, their addresses (0: copy through the view) and
    where they lie in the region's virtual space."""

    views: list[memoryview]
    addrs: list[int]
    parts: Parts


def check_pieces(src: Pieces | None, dst: Pieces | None, segments: Sequence[Segment], what: str) -> int | None:
    """The bytes of a copy from ``src`` to ``dst``, checked (bounds, buffer boundaries, a
    writable destination: TransportError naming ``what``); None if either is not registered."""
    if src is None or dst is None:
        return None
    if any(v.readonly for v in dst.views):
        raise TransportError(f"{what}: the destination region is read-only")
    moved = check_segments(segments, src.parts.nbytes, dst.parts.nbytes, what)
    check_parts(segments, src.parts, dst.parts, what)
    return moved


def copy_pieces(src: Pieces | None, dst: Pieces | None, segments: Sequence[Segment]) -> int:
    """Copy segments checked by ``check_pieces``, each from its source part to its destination part."""
    assert src is not None and dst is not None  # checked by check_pieces
    arr = segments if type(segments) is SegmentArray else SegmentArray.of(segments)
    spart, soff, _ = src.parts.locate(arr.src, arr.length)
    dpart, doff, _ = dst.parts.locate(arr.dst, arr.length)
    sv, sa, dv, da = src.views, src.addrs, dst.views, dst.addrs
    rows = zip(spart.tolist(), soff.tolist(), dpart.tolist(), doff.tolist(), arr.length.tolist(), strict=True)
    for i, so, j, do, n in rows:
        if not n:
            continue
        if sa[i] and da[j]:
            ctypes.memmove(da[j] + do, sa[i] + so, n)  # (releases the GIL, as any loopback copy)
        else:
            dv[j][do : do + n] = sv[i][so : so + n]
    return arr.total()


def host_view(buf: Any) -> memoryview:
    """Bytes of a host buffer: anything with the buffer protocol, or a CPU tensor."""
    if hasattr(buf, "data_ptr"):
        region = as_region(buf)
        if region.mem != "DRAM":
            raise TransportError(f"loopback moves host memory only, not {region.mem}")
        return region.view()
    return memoryview(buf).cast("B")


def address_of(mv: memoryview) -> int:
    """Address of a writable contiguous buffer, or 0 if it cannot be taken (read-only, empty)."""
    if mv.readonly or not mv.contiguous or not len(mv):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError):
        return 0
