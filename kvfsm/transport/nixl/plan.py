"""Transfer planning: how a write is described, which writes share a transfer, which rows merge.

A write or read becomes a ``_Job``: exact byte ranges (``lrows``/``rrows``, one row per run, for
``initialize_xfer``) or, for many short runs, block indices into the regions' prepared lists
(``prepped``, for ``make_prepped_xfer``; see ``use_prepped``). ``run_job`` describes the usual
write, one run along a peer's cached ``_Route``, and is the only place that does; ``describe``
describes any other. Jobs queued or held together are folded (``fold``) into as few transfers as
the limits allow, their notifications packed into one (``kvfsm.transport.nixl.notes``), and
within a transfer the byte ranges that continue each other on both sides merge into one
descriptor (``merge_rows``). Pure functions: no agent, no lock, no thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from kvfsm.transport.base import MemoryRegion, Parts, Segment, SegmentArray, TransportError, check_parts, check_segments
from kvfsm.transport.nixl.descriptors import RemoteRegion
from kvfsm.transport.nixl.notes import MAX_BATCH

HOST_TO_HOST = ("DRAM", "DRAM")
_MAX_BATCH_BYTES = 64 << 20  # bytes per folded transfer at most (bounds the first write's delay)
_PREPPED_MIN_RUNS = 16  # runs in a write from which block indices into the prepared lists may pay

Rows = Sequence[tuple[int, int, int]]  # (addr, bytes, device) per run


class _Route(NamedTuple):
    """Where a one-run write to one peer's region goes: what ``run_job`` needs, in one lookup."""

    laddr: int  # our region: address, bytes, device
    lsize: int
    ldev: int
    raddr: int  # the peer's region: address, bytes, device
    rsize: int
    rdev: int
    mems: tuple[str, str]  # memory kinds: ours, the peer's


class Spread(NamedTuple):
    """A registered region of several buffers: each buffer's address (``addrs``, int64, in the
    order of the region's virtual space) and where it lies in that space (``parts``)."""

    addrs: np.ndarray
    parts: Parts

    @classmethod
    def of(cls, buffers: Sequence[tuple[int, int]]) -> Spread:
        """From each buffer's (address, bytes), in order."""
        return cls(np.array([a for a, _ in buffers], dtype=np.int64), Parts([n for _, n in buffers]))


@dataclass(slots=True)
class _Job:
    """A validated write or read, described, waiting to be posted."""

    op: str
    peer: str
    note: bytes
    tag: object
    total: int
    mems: tuple[str, str]  # local and remote memory kinds
    lrows: Rows  # exact byte ranges (addr, len, dev); empty: notification only
    rrows: Rows
    prepped: tuple[np.ndarray, np.ndarray] | None = None  # (local, remote) block indices into the prepared lists
    # the region written or read ("kv", "aux"): merge_rows never joins two. "": rows in a region
    # of several buffers, which merge_rows must not join either (two buffers adjacent in memory
    # are two registrations to NIXL)
    region: str = ""
    within_s: float | None = None  # a read with a deadline: cancelled if still in flight this long after its post


@dataclass(slots=True)
class _Xfer:
    """A posted transfer, in flight."""

    tags: list[object]  # one per write folded into this transfer, in posting order
    peer: str
    op: str
    posted: float
    nbytes: int
    expires: float = float("inf")  # still in flight then: cancelled, its tags complete as failed


def run_job(route: _Route, peer: str, region: str, src: int, dst: int, n: int, note: bytes, tag: object) -> _Job | None:
    """The usual write described: one run of ``n`` > 0 bytes from ``src`` in our region to ``dst``
    in the peer's, both within bounds; None otherwise (the caller then checks and describes it in
    full, with ``describe``, which raises the right error)."""
    laddr, lsize, ldev, raddr, rsize, rdev, mems = route
    if n > 0 and 0 <= src <= lsize - n and 0 <= dst <= rsize - n:
        return _Job(
            "WRITE", peer, note, tag, n, mems, ((laddr + src, n, ldev),), ((raddr + dst, n, rdev),), None, region
        )
    return None


def describe(
    me: str,
    op: str,
    peer: str,
    region: str,
    segments: Sequence[Segment],
    note: bytes,
    tag: object,
    local: MemoryRegion,
    remote: RemoteRegion,
    lblk: int,
    prepared: bool,
) -> _Job:
    """Any write or read (by data plane ``me``) described: ``segments`` checked against both regions (TransportError if
    they do not fit, naming the transfer), then as block indices into the prepared lists where
    those pay (``use_prepped``: our block size ``lblk`` equal to the peer's, the peer's list
    ``prepared``, every segment block-aligned on both sides), else as exact byte ranges."""
    # src is always the side the bytes come from: local for WRITE, remote for READ.
    src_len, dst_len = (local.nbytes, remote.nbytes) if op == "WRITE" else (remote.nbytes, local.nbytes)
    try:
        total = check_segments(segments, src_len, dst_len, "")
    except TransportError as exc:  # (the message is built only for a refused write)
        raise TransportError(f"{op.lower()} {me}->{peer} {region}{exc}") from None
    if op == "READ" and local.readonly:
        raise TransportError(f"{op.lower()} {me}->{peer}: our {region} region is read-only")
    segs: Sequence[Segment]
    segs = segments.nonempty() if type(segments) is SegmentArray else [s for s in segments if s.length]
    lrows: list[tuple[int, int, int]] = []
    rrows: list[tuple[int, int, int]] = []
    job = _Job(op, peer, note, tag, total, (local.mem, remote.mem), lrows, rrows, None, region)
    if len(segs) and lblk and lblk == remote.block and prepared:
        job.prepped = _block_indices(op, lblk, segs)
        if job.prepped is not None:
            return job
    if type(segs) is SegmentArray:  # the rows built from the arrays, no Segment per run
        loffs, roffs = (segs.src, segs.dst) if op == "WRITE" else (segs.dst, segs.src)
        lengths = segs.length.tolist()
        lrows += zip((loffs + local.addr).tolist(), lengths, repeat(local.device), strict=False)
        rrows += zip((roffs + remote.addr).tolist(), lengths, repeat(remote.device), strict=False)
    else:
        for s in segs:
            loff, roff = (s.src, s.dst) if op == "WRITE" else (s.dst, s.src)
            lrows.append((local.addr + loff, s.length, local.device))
            rrows.append((remote.addr + roff, s.length, remote.device))
    return job


def describe_spread(
    me: str,
    op: str,
    peer: str,
    region: str,
    segments: Sequence[Segment],
    note: bytes,
    tag: object,
    local: MemoryRegion,
    remote: RemoteRegion,
    lspread: Spread | None,
    rspread: Spread | None,
) -> _Job:
    """``describe`` where our region or the peer's is of several buffers (``lspread``,
    ``rspread``; None: one buffer): segments checked against both regions and refused if one
    crosses a buffer boundary on either side (TransportError), then exact byte ranges, each
    segment's virtual offsets mapped to its buffer's address. No prepared block lists."""
    src_len, dst_len = (local.nbytes, remote.nbytes) if op == "WRITE" else (remote.nbytes, local.nbytes)
    src_spread, dst_spread = (lspread, rspread) if op == "WRITE" else (rspread, lspread)
    what = f"{op.lower()} {me}->{peer} {region}"
    total = check_segments(segments, src_len, dst_len, what)
    check_parts(
        segments,
        None if src_spread is None else src_spread.parts,
        None if dst_spread is None else dst_spread.parts,
        what,
    )
    if op == "READ" and local.readonly:
        raise TransportError(f"{op.lower()} {me}->{peer}: our {region} region is read-only")
    arr = (segments if type(segments) is SegmentArray else SegmentArray.of(segments)).nonempty()
    loffs, roffs = (arr.src, arr.dst) if op == "WRITE" else (arr.dst, arr.src)
    lengths = arr.length.tolist()

    def addrs(offs: np.ndarray, base: int, spread: Spread | None) -> list[int]:
        if spread is None:
            return (offs + base).tolist()  # type: ignore[no-any-return]
        part, within, _ = spread.parts.locate(offs, arr.length)
        return (spread.addrs[part] + within).tolist()  # type: ignore[no-any-return]

    lrows = list(zip(addrs(loffs, local.addr, lspread), lengths, repeat(local.device), strict=False))
    rrows = list(zip(addrs(roffs, remote.addr, rspread), lengths, repeat(remote.device), strict=False))
    return _Job(op, peer, note, tag, total, (local.mem, remote.mem), lrows, rrows, None, "")


def use_prepped(segments: int, blocks: int) -> bool:
    """Post from the prepared block lists (block indices) or from exact byte ranges?

    Measured on CPU (UCX CMA): a transfer made from a prepared list of a long contiguous run
    costs far more to post than the same bytes as one range (1,024 adjacent 4 KiB blocks: 6.2 ms
    from a strided prepared list, 0.5 ms as one range), while for many short runs the prepared
    list saves building descriptor lists per transfer. So: prepared lists for many short runs only.
    """
    return segments >= _PREPPED_MIN_RUNS and blocks <= 4 * segments


def _block_indices(op: str, lblk: int, segs: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray] | None:
    """Block indices of both sides if every segment is block-aligned on both and block indices
    pay (``use_prepped``), else None (a SegmentArray's computed on its arrays, a long scattered
    chunk having a segment per page; a list's in Python)."""
    if len(segs) < _PREPPED_MIN_RUNS:  # (use_prepped's first test, before summing lengths)
        return None
    if type(segs) is not SegmentArray:  # a list (fewer than COALESCE_ARRAY_MIN pages): numpy costs more
        return _list_block_indices(op, lblk, segs)
    if not use_prepped(len(segs), int(segs.length.sum()) // lblk):
        return None
    lengths = segs.length
    loffs, roffs = (segs.src, segs.dst) if op == "WRITE" else (segs.dst, segs.src)
    if bool(((loffs % lblk) | (roffs % lblk) | (lengths % lblk)).any()):
        return None
    counts = lengths // lblk
    lfirst, rfirst = loffs // lblk, roffs // lblk
    if bool((counts == 1).all()):  # a block per segment (scattered pages): the starts themselves
        return lfirst.astype(np.int32), rfirst.astype(np.int32)
    # each segment's blocks, all at once: its first block plus 0 .. count - 1
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return (np.repeat(lfirst, counts) + within).astype(np.int32), (np.repeat(rfirst, counts) + within).astype(np.int32)


def _list_block_indices(op: str, lblk: int, segs: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray] | None:
    """``_block_indices`` of a list of segments, in Python: for a few dozen segments ~4x
    cheaper than numpy's calls (16 segments: 2.9 µs against 11 µs)."""
    if not use_prepped(len(segs), sum(s.length for s in segs) // lblk):
        return None
    lidx: list[int] = []
    ridx: list[int] = []
    for s in segs:
        loff, roff = (s.src, s.dst) if op == "WRITE" else (s.dst, s.src)
        n = s.length
        if loff % lblk or roff % lblk or n % lblk:
            return None
        if n == lblk:  # a block per segment (scattered pages)
            lidx.append(loff // lblk)
            ridx.append(roff // lblk)
        else:
            lidx += range(loff // lblk, (loff + n) // lblk)
            ridx += range(roff // lblk, (roff + n) // lblk)
    return np.array(lidx, dtype=np.int32), np.array(ridx, dtype=np.int32)


def fold_key(job: _Job) -> tuple[Any, ...]:
    """What jobs must share to be folded into one transfer (``fold``)."""
    return (job.op, job.peer, job.mems, None if job.prepped is None else job.region)


def fold(jobs: Sequence[_Job]) -> list[list[_Job]]:
    """Group queued jobs into transfers. Jobs with the same key (op, peer, memory kinds, and the
    prepared region for block-index jobs or exact byte ranges otherwise) share a transfer, while
    it holds at most ``MAX_BATCH`` jobs and ``_MAX_BATCH_BYTES``, whether they were queued next to
    each other or not: a room's KV writes (VRAM) and aux writes (DRAM) interleave in the queue
    but fold apart. Within a key the queue's order is kept; groups come in the order of their
    first job. Across keys the order may change: the protocol never relies on the order of two
    writes' notifications (the model checker delivers them in any order). A notification-only
    job (nothing to move) stays alone."""
    if len(jobs) == 1:  # (a large write the caller posts at once: one group, no key built)
        return [list(jobs)]
    groups: list[list[_Job]] = []
    open_: dict[tuple[Any, ...], tuple[list[_Job], list[int]]] = {}  # key -> (group, [its bytes])
    for job in jobs:
        if job.prepped is None and not job.lrows:
            groups.append([job])
            continue
        key = fold_key(job)
        entry = open_.get(key)
        if entry is not None and len(entry[0]) < MAX_BATCH and entry[1][0] + job.total <= _MAX_BATCH_BYTES:
            entry[0].append(job)
            entry[1][0] += job.total
            continue
        group = [job]
        open_[key] = (group, [job.total])
        groups.append(group)
    return groups


def merge_rows(
    lrows: Sequence[tuple[int, int, int]], rrows: Sequence[tuple[int, int, int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """One transfer's byte ranges (local and remote rows, pairwise, all of one region) with every
    pair that starts, on both sides and on the same devices, where an earlier pair ends merged
    into that one: one descriptor instead of two (NIXL's post costs per descriptor: ~4 µs between
    two GPUs over NVLink). A room's consecutive chunks are often adjacent in both KV caches, and
    folding puts them into one transfer when they are handed over faster than they move. The
    first pair of a run keeps its place; the bytes each descriptor covers are the same, so the
    data moved are the same (a transfer's descriptors have no order). ~0.2 µs per row on CPU.
    Rows of two regions must not be given together: adjacent in memory or not, NIXL refuses a
    descriptor that spans two registrations."""
    out_l: list[tuple[int, int, int]] = []
    out_r: list[tuple[int, int, int]] = []
    ends: dict[int, int] = {}  # local end -> its row (the remote side checked on a match)
    for (la, n, ld), (ra, _, rd) in zip(lrows, rrows, strict=True):
        i = ends.pop(la, None)
        if i is not None:
            a, m, d = out_l[i]
            b, _, e = out_r[i]
            if b + m == ra and d == ld and e == rd:
                m += n
                out_l[i] = (a, m, d)
                out_r[i] = (b, m, e)
                ends[la + n] = i
                continue
        ends[la + n] = len(out_l)
        out_l.append((la, n, ld))
        out_r.append((ra, n, rd))
    return out_l, out_r
