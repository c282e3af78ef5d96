"""bench/transfer.py: kvfsm over NIXL against raw NIXL, two processes, the same bytes and descriptors.

Two processes (spawned): an initiator (prefill) and a target (decode), each with one buffer of
the same size, on DRAM (``--device cpu``) or VRAM (``--device cuda:0 --target-device cuda:1``).
The run measures, in the same processes, first raw NIXL for every case (chunk size x layout)
with nothing else running, then kvfsm for every case (``--order blocks``, the default; with
``--order interleaved``, round after round per case, one repetition of raw NIXL, of the floor's
and of each engine API, both sides' agents and kvfsm's threads alive throughout: the fields
``ratio_paired`` / ``ratio_many_paired`` then give the median of the rounds' ratios. A
diagnostic, not the goal's measure: between two H200 GPUs raw NIXL's repetitions ran 6-29 % slower
taken in turn, in four paired runs, which flatters kvfsm):

  raw    one NIXL agent per process (UCX, no progress thread, as the kvfsm data plane sets it
         up), metadata exchanged over a pipe. Before the clock starts, each chunk's descriptors
         are built exactly as kvfsm's data plane would post them (one byte range per contiguous
         run, or block indices into page-granular lists prepared once for scattered pages), and
         each room's aux slot (64 B of host memory) goes with its last chunk as kvfsm writes it:
         in the chunk's transfer where both are byte ranges of host memory, else as a transfer
         of its own (``raw_transfers``, ``raw_descriptors_per_chunk``); timed per transfer: make
         it, post it with a notification, poll until DONE, release. The target polls
         notifications meanwhile, and checks every byte after a case's last repetition.
  kvfsm  the full stack: PrefillManager / DecodeManager over ZMQ control + NIXL data planes
         (one manager pair per page size), rooms announced by decode first, no runtime
         transfer workers; timed from the first chunk handed over (page lists built
         beforehand, as an engine holds them) until every prefill room reports Success (every
         write completed, aux included), waiting with ``Manager.wait`` (woken as rooms change
         state). Decode then checks every byte of every room. Measured once per engine API
         (``--api``): ``send()`` per room and chunk (fields ``kvfsm_*``, ratio ``ratio``), and
         ``send_many()`` with every room's next chunk at once, as an engine has them after a
         forward step (fields ``kvfsm_many_*``, ratio ``ratio_many``).

Before every repetition, raw NIXL's and kvfsm's alike, the target zeroes the part of its buffer
that the repetition writes (so that decode's byte check sees only that repetition's bytes) and,
on a GPU, waits for the zeroing.

Page indices are handed over as Python lists (``--pages list``, the default; vLLM holds block
ids so) or numpy int64 arrays (``--pages numpy``; SGLang holds ``kv_indices`` so), built before
the clock starts.

Layouts: ``contig`` (a chunk is adjacent 64 KiB pages on both sides: one descriptor per chunk)
and ``scattered`` (4 KiB pages, destination pages in reverse order: one descriptor per page).
Figures are GB/s (1e9 bytes moved once per second), the median of ``--reps`` (9) repetitions
(each repetition's seconds are in ``raw_reps_seconds`` / ``kvfsm_reps_seconds``); ratio = kvfsm /
raw. ``*_post_seconds`` is the time spent inside NIXL's post over all
repetitions (on CPU memory UCX copies the bytes there); ``kvfsm_send_seconds`` the median time
the engine spent handing chunks over, ``kvfsm_send_cpu_seconds`` its thread's CPU time meanwhile
(equal: the engine thread is CPU-bound; less: it waited for locks or the GIL);
``kvfsm_descriptors_per_chunk`` the descriptors of the writes handed over per chunk, and
``kvfsm_posted_descriptors_per_chunk`` those NIXL was given (fewer: a folded transfer's adjacent
writes go as one descriptor).
``--profile`` adds, per case, the CPU seconds of every thread of both processes over the timed
windows (decode's: from its announcement to Success) and the calls and wall seconds of each
initiator NIXL method per thread (the wrapper costs ~1 µs per call: compare profiles with
profiles only).

``--floor 0,8,16`` also times, per contiguous case and per value, the leanest pipelined Python
on NIXL's API with no protocol (``floor_pass``: each chunk checked and described as one byte
range with a notification, plus that many µs of spinning, posted as kvfsm's data plane posts a
GPU's writes: folded Nagle-style, the oldest transfers completed after each post), in the raw
NIXL processes after raw NIXL's own repetitions (fields ``floor.<µs>``: GB/s, ratio to raw NIXL,
engine CPU and transfers per chunk). With no spinning it is the most any Python runtime gets
from NIXL's Python API here; the spinning maps how much per-chunk work a runtime may add
before it falls below raw NIXL.

Writes JSON (default bench/results/transfer.json); ``goal`` is per engine API. ``--check``
exits 1 if kvfsm falls below 0.9x raw NIXL for any contiguous case with chunks >= 1 MiB, with
any API measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 4096  # scattered layouts: one descriptor per 4 KiB page
CONTIG_PAGE = 64 << 10  # contiguous layouts: a KV page of 64 KiB (e.g. 64 tokens x 8 heads x 128 x bf16)
AUX = 64  # bytes of a room's aux slot (host memory at both ends)
MiB = 1 << 20
SIZES = [4 << 10, 64 << 10, 1 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [64 << 10, 1 * MiB, 4 * MiB]


def plan(size: int, budget: int) -> tuple[int, int]:
    """(rooms, chunks per room) moving about ``budget`` bytes in chunks of ``size`` (at least 4)."""
    n = max(4, min(256, budget // size))
    rooms = min(n, 16)
    return rooms, max(1, n // rooms)


def cases(sizes: list[int], budget: int, layouts: tuple[str, ...] = ("contig", "scattered")) -> list[dict[str, Any]]:
    out = []
    if "contig" in layouts:
        for s in sizes:
            out.append({"size": s, "layout": "contig", "page": min(s, CONTIG_PAGE), "plan": plan(s, budget)})
    if "scattered" in layouts:
        for s in sizes:
            if 64 << 10 <= s <= 16 * MiB:
                out.append({"size": s, "layout": "scattered", "page": PAGE, "plan": plan(s, budget)})
    return out


def pages_of(case: dict[str, Any], room: int, chunk: int, side: str) -> list[int]:
    size, layout = case["size"], case["layout"]
    rooms, chunks = case["plan"]
    per = size // case["page"]
    base = (room * chunks + chunk) * per
    pages = list(range(base, base + per))
    return pages[::-1] if side == "decode" and layout == "scattered" else pages


def _held(case: dict[str, Any], pages: list[int]) -> Any:
    """Page indices as the engine holds them (``--pages``): a list (vLLM's block ids) or a numpy
    int64 array (SGLang's ``kv_indices``)."""
    return np.asarray(pages, dtype=np.int64) if case.get("pages") == "numpy" else pages


def _buffer(nbytes: int, device: str, seed: int | None) -> Any:
    import torch

    # torch's CPU ops (the buffers' set-up, decode's zeroing and byte check) on one thread: its
    # intra-op pool's threads keep spinning for a while after an op, beside the timed copies
    torch.set_num_threads(1)

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if seed is None:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)


def _extent(case: dict[str, Any]) -> int:
    """The bytes of the target's buffer that a repetition of ``case`` writes: its first ones."""
    rooms, chunks = case["plan"]
    return int(case["size"] * rooms * chunks)


def _clear(dst: Any, nbytes: int) -> None:
    """Zero the first ``nbytes`` of the target's buffer (what a repetition writes) before a
    repetition, and wait for it on a GPU (the zeroing is asynchronous there: it must not run
    into the repetition's copies). Raw NIXL and kvfsm both get it before every repetition, so
    that both copy into memory in the same state (decode's byte check needs it before kvfsm's).
    Zeroing with torch's intra-op threads, which keep spinning after the op, slowed the next
    copies: raw NIXL's 16 MiB repetitions took 55 ms after such a zeroing and 48 ms without
    (hence one torch thread, see ``_buffer``); on one thread, within noise of not zeroing."""
    dst[:nbytes].zero_()
    if dst.is_cuda:
        import torch

        torch.cuda.synchronize(dst.device)


# ------------------------------------------------------------------------------------- raw NIXL


def _raw_agent(name: str, params: dict[str, str]) -> Any:
    from kvfsm.transport.nixl import load_nixl

    agent_cls, config_cls, _ = load_nixl()
    agent = agent_cls(name, config_cls(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", _split_params(params)[0])
    return agent


def _prep(agent: Any, who: str, addr: int, nbytes: int, mem: str, dev: int) -> Any:
    """A page-granular prepared list over ``nbytes`` at ``addr``."""
    rows = np.array([[addr, PAGE, dev, PAGE, nbytes // PAGE]], dtype=np.uint64)
    return agent.prep_xfer_dlist(who, rows, mem)


def _placement(buf: Any) -> tuple[str, int]:
    return ("VRAM", buf.device.index or 0) if buf.is_cuda else ("DRAM", 0)


def raw_descriptors(
    agent: Any, src: Any, dst: tuple[int, str, int], case: dict[str, Any], aux: tuple[int, int]
) -> list[tuple[str, Any, Any, int]]:
    """The transfers raw NIXL posts, in order, with the descriptors kvfsm's data plane would post
    for the same writes (made before the clock starts: a hand-written NIXL user prepares what it
    can): per chunk, block indices into the prepared page lists for many short runs, else
    descriptor lists of the exact byte ranges; and with each room's last chunk its aux slot
    (``AUX`` bytes of host memory at both ends, slot = the room's index, as kvfsm writes it), in
    the chunk's own transfer where the chunk is byte ranges of host memory too (kvfsm's data
    plane folds the two writes there: the same memory kinds and kind of descriptor), else as a
    transfer of its own. ``aux``: the initiator's and the target's aux buffer addresses. Each item
    is (kind, local, remote, descriptors)."""
    from kvfsm.runtime.pages import coalesce
    from kvfsm.transport.nixl import use_prepped
    from kvfsm.transport.nixl.plan import HOST_TO_HOST as HOST

    rooms, chunks = case["plan"]
    page = case["page"]
    mem, dev = _placement(src)
    dst_addr, dst_mem, dst_dev = dst
    out: list[tuple[str, Any, Any, int]] = []

    def ranges(lrows: list[tuple[int, int, int]], rrows: list[tuple[int, int, int]], mems: tuple[str, str]) -> None:
        out.append(("ranges", agent.get_xfer_descs(lrows, mems[0]), agent.get_xfer_descs(rrows, mems[1]), len(lrows)))

    for r in range(rooms):
        aux_l, aux_r = [(aux[0] + r * AUX, AUX, 0)], [(aux[1] + r * AUX, AUX, 0)]
        for c in range(chunks):
            last = c == chunks - 1
            sp, dp = pages_of(case, r, c, "prefill"), pages_of(case, r, c, "decode")
            segs = coalesce(sp, dp, page)
            if page == PAGE and use_prepped(len(segs), len(sp)):
                out.append(("prepped", np.asarray(sp, dtype=np.int32), np.asarray(dp, dtype=np.int32), len(sp)))
                if last:
                    ranges(aux_l, aux_r, HOST)
                continue
            lrows = [(src.data_ptr() + s.src, s.length, dev) for s in segs]
            rrows = [(dst_addr + s.dst, s.length, dst_dev) for s in segs]
            if last and (mem, dst_mem) == HOST:
                ranges(lrows + aux_l, rrows + aux_r, HOST)  # folded into the chunk's transfer
                continue
            ranges(lrows, rrows, (mem, dst_mem))
            if last:
                ranges(aux_l, aux_r, HOST)
    return out


class RawInitiator:
    """Raw NIXL on the initiator's side: one agent (set up with the target's over the pipe),
    and per case the transfers ``raw_descriptors`` makes, posted one at a time."""

    def __init__(self, conn: Any, src: Any, params: dict[str, str]) -> None:
        self.conn, self.src = conn, src
        self.agent = agent = _raw_agent("raw-p", params)
        agent.register_memory(src)
        self.aux = _buffer(16 * AUX, "cpu", 1)  # as kvfsm's prefill side has it
        agent.register_memory(self.aux)
        conn.send(agent.get_agent_metadata())
        md, self.dst, self.dst_aux = conn.recv()
        agent.add_remote_agent(md)
        self.lp = _prep(agent, "NIXL_INIT_AGENT", src.data_ptr(), src.numel(), *_placement(src))
        self.rp = _prep(agent, "raw-d", self.dst[0], src.numel(), self.dst[1], self.dst[2])

    def contestants(self, ci: int, case: dict[str, Any], floor: tuple[float, ...], reps: int) -> list[Any]:
        """Raw NIXL's ``reps`` + 1 repetitions of case ``ci``, and (``--floor``, contiguous
        cases) the floor's for each amount of spinning."""
        out: list[Any] = [_RawCase(self, ci, case, reps)]
        if floor and case["layout"] == "contig":
            case["floor"] = {}
            out += [_FloorCase(self, ci, case, reps, work) for work in floor]
        return out


class _RawCase:
    """Raw NIXL's repetitions of one case: make, post and wait for each transfer in turn."""

    def __init__(self, raw: RawInitiator, ci: int, case: dict[str, Any], reps: int) -> None:
        self.raw, self.ci, self.case, self.reps = raw, ci, case, reps
        self.descs = raw_descriptors(raw.agent, raw.src, raw.dst, case, (raw.aux.data_ptr(), raw.dst_aux))
        self.post = 0.0
        self.times: list[float] = []

    def one(self) -> int:
        agent, lp, rp = self.raw.agent, self.raw.lp, self.raw.rp
        for kind, a, b, _ in self.descs:
            if kind == "prepped":
                h = agent.make_prepped_xfer("WRITE", lp, a, rp, b, b"raw")
            else:
                h = agent.initialize_xfer("WRITE", a, b, "raw-d", b"raw")
            t_post = time.perf_counter()
            agent.transfer(h)
            self.post += time.perf_counter() - t_post
            while agent.check_xfer_state(h) != "DONE":
                pass
            agent.release_xfer_handle(h)
        return len(self.descs)

    def rep(self) -> None:
        last = len(self.times) == self.reps  # its bytes checked, after the clock stopped
        self.times.append(_served(self.raw.conn, self.ci, self.one, last)[0])

    def finish(self) -> None:
        case, times = self.case, self.times
        rooms, chunks = case["plan"]
        case["raw_reps_seconds"] = times[1:]  # every measured repetition (the spread within a run)
        case["raw_seconds"] = statistics.median(times[1:])
        case["raw_post_seconds"] = self.post  # inside NIXL's post, over every repetition
        case["raw_transfers"] = len(self.descs)  # per repetition (kvfsm_transfers: over all of them)
        case["raw_descriptors_per_chunk"] = sum(d[3] for d in self.descs) / (rooms * chunks)


def _busy(seconds: float) -> None:
    """``--floor``: spin ``seconds`` of CPU in Python (stands for a runtime's work per chunk)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def floor_pass(
    agent: Any, src: Any, dst: tuple[int, str, int], case: dict[str, Any], aux: tuple[int, int], work_s: float
) -> tuple[int, float]:
    """``--floor``: one repetition of a contiguous case as the leanest pipelined Python on NIXL's
    API would move it, with no protocol: chunks handed over as ``send()`` hands them (every
    room's chunk c, then c + 1), each checked against the buffer and described as one byte range
    (a tuple per side) with a notification of its own, plus ``work_s`` of spinning; posted as
    kvfsm's data plane posts a GPU's writes with its default ``NixlConfig`` (at once while nothing
    is in flight or for a chunk of ``hold_below`` or more, else held until ``hold_writes`` writes or
    ``hold_bytes``, then one folded transfer; the aux slots, another memory kind on a GPU, as one transfer at the
    end), the oldest transfers completed after each post, until the first still in progress.
    Returns (transfers, engine CPU seconds)."""
    from kvfsm.transport.nixl import NixlConfig, pack_notifications

    cfg = NixlConfig()

    rooms, chunks = case["plan"]
    page = case["page"]
    mem, dev = _placement(src)
    dst_addr, dst_mem, dst_dev = dst
    base, pages_total = src.data_ptr(), src.numel() // page
    kv_mems, aux_mems = (mem, dst_mem), ("DRAM", "DRAM")
    inflight: deque[Any] = deque()
    held: dict[tuple[str, str], tuple[list[Any], list[Any], list[bytes]]] = {}
    posted = held_bytes = 0

    def post(mems: tuple[str, str]) -> None:
        nonlocal posted
        lrows, rrows, notes = held.pop(mems)
        note = notes[0] if len(notes) == 1 else pack_notifications(notes)
        h = agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(lrows, mems[0]), agent.get_xfer_descs(rrows, mems[1]), "raw-d", note
        )
        agent.transfer(h)
        inflight.append(h)
        posted += 1
        while inflight and agent.check_xfer_state(inflight[0]) == "DONE":
            agent.release_xfer_handle(inflight.popleft())

    def hold(mems: tuple[str, str], lrow: tuple[int, int, int], rrow: tuple[int, int, int], note: bytes) -> None:
        lrows, rrows, notes = held.setdefault(mems, ([], [], []))
        lrows.append(lrow)
        rrows.append(rrow)
        notes.append(note)

    work = [[pages_of(case, r, c, "prefill") for r in range(rooms)] for c in range(chunks)]
    cpu = time.thread_time()
    for c in range(chunks):
        last = c == chunks - 1
        for r in range(rooms):
            pages = work[c][r]
            lo, hi = pages[0], pages[-1]
            if lo < 0 or hi >= pages_total or hi - lo + 1 != len(pages):
                raise ValueError(f"floor: chunk {c} of room {r} is not one run inside the buffer")
            if work_s:
                _busy(work_s)
            n = len(pages) * page
            hold(kv_mems, (base + lo * page, n, dev), (dst_addr + lo * page, n, dst_dev), b"%d:%d" % (r, c))
            held_bytes += n
            if last:
                hold(aux_mems, (aux[0] + r * AUX, AUX, 0), (aux[1] + r * AUX, AUX, 0), b"%d:aux" % r)
            if (
                not inflight
                or n >= cfg.hold_below
                or len(held[kv_mems][0]) >= cfg.hold_writes
                or held_bytes >= cfg.hold_bytes
            ):
                post(kv_mems)
                held_bytes = 0
    for mems in list(held):
        post(mems)
    cpu = time.thread_time() - cpu
    while inflight:
        if agent.check_xfer_state(inflight[0]) == "DONE":
            agent.release_xfer_handle(inflight.popleft())
    return posted, cpu


class _FloorCase:
    """``--floor``: the repetitions of ``floor_pass`` for one case and amount of spinning,
    served by the raw target as raw NIXL's are."""

    def __init__(self, raw: RawInitiator, ci: int, case: dict[str, Any], reps: int, work_us: float) -> None:
        self.raw, self.ci, self.case, self.reps, self.work_us = raw, ci, case, reps, work_us
        self.timed: list[tuple[float, int]] = []
        self.cpus: list[float] = []

    def one(self) -> int:
        raw = self.raw
        n, cpu = floor_pass(
            raw.agent, raw.src, raw.dst, self.case, (raw.aux.data_ptr(), raw.dst_aux), self.work_us * 1e-6
        )
        self.cpus.append(cpu)
        return n

    def rep(self) -> None:
        self.timed.append(_served(self.raw.conn, self.ci, self.one, len(self.timed) == self.reps))

    def finish(self) -> None:
        timed = self.timed[1:]
        self.case["floor"][str(self.work_us)] = {
            "seconds": statistics.median(t for t, _ in timed),
            "reps_seconds": [t for t, _ in timed],
            "cpu_seconds": statistics.median(self.cpus[1:]),
            "transfers": statistics.median(n for _, n in timed),
        }


def _served(conn: Any, ci: int, one: Any, check: bool = False) -> tuple[float, int]:
    """One repetition of ``one`` (case ``ci``) after the target has zeroed what the case writes,
    timed, and checked: ``one`` returns the transfers it posted and the target must count as
    many notifications; with ``check`` (a case's last repetition) the target then checks every
    byte written as it checks kvfsm's. Only then: a check between repetitions slowed raw NIXL's
    next ones (two H200 GPUs, 16 MiB: 2-11 % in three paired runs), as kvfsm's do not (pipelined,
    it waits less on each copy). (seconds, transfers)."""
    conn.send(("go", ci, check))
    conn.recv()
    t0 = time.perf_counter()
    n = one()
    seconds = time.perf_counter() - t0
    conn.send(n)  # one notification per transfer
    got, ok = conn.recv()
    if got != n:
        raise RuntimeError("bench: the target counted a different number of notifications")
    if ok is False:
        raise RuntimeError(f"bench: the target found mismatched bytes after raw NIXL's repetitions of case {ci}")
    return seconds, n


class RawTarget:
    """Raw NIXL on the target's side: its agent, and each repetition served (``rep``)."""

    def __init__(self, conn: Any, dst: Any, expected: Any, params: dict[str, str]) -> None:
        self.conn, self.dst, self.expected = conn, dst, expected
        self.agent = agent = _raw_agent("raw-d", params)
        agent.register_memory(dst)
        self.aux = _buffer(16 * AUX, "cpu", None)  # as kvfsm's decode side has it
        agent.register_memory(self.aux)
        md = conn.recv()
        agent.add_remote_agent(md)
        conn.send((agent.get_agent_metadata(), (dst.data_ptr(), *_placement(dst)), self.aux.data_ptr()))

    def rep(self, case: dict[str, Any], check: bool) -> None:
        """Zero what the repetition writes; count notifications until the initiator says how
        many transfers it posted and that many have come; with ``check``, check every byte
        written (None: not checked)."""
        conn, agent = self.conn, self.agent
        _clear(self.dst, _extent(case))
        conn.send("ready")
        got = 0
        while not conn.poll():
            got += sum(len(v) for v in agent.get_new_notifs().values())
        n = conn.recv()
        while got < n:
            got += sum(len(v) for v in agent.get_new_notifs().values())
        conn.send((got, _check(self.dst, self.expected, case) if check else None))


def _check(dst: Any, expected: Any, case: dict[str, Any]) -> bool:
    """Does the target's buffer hold every page the case writes (raw NIXL's and kvfsm's
    repetitions write the same)?"""
    rooms, chunks = case["plan"]
    return all(
        _same_pages(dst, expected, pages_of(case, r, c, "prefill"), pages_of(case, r, c, "decode"), case["page"])
        for r in range(rooms)
        for c in range(chunks)
    )


# ------------------------------------------------------------------------------------- kvfsm


def _kvfsm_endpoint(name: str, side: str, bootstrap: str, params: dict[str, str]) -> Any:
    from kvfsm.transport.base import SplitEndpoint
    from kvfsm.transport.nixl import NixlConfig, NixlDataPlane
    from kvfsm.transport.zmq import ZmqControlPlane

    ucx, knobs = _split_params(params)
    return SplitEndpoint(
        ZmqControlPlane(name, bootstrap=bootstrap, side=side, rank=0),
        NixlDataPlane(name, config=NixlConfig(backend_params=ucx, **knobs)),
    )


def _split_params(params: dict[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """UCX backend parameters, and ``--plane`` fields of kvfsm's ``NixlConfig`` (``plane.`` keys)."""
    ucx = {k: v for k, v in params.items() if not k.startswith("plane.")}
    knobs = {k[len("plane.") :]: _number(v) for k, v in params.items() if k.startswith("plane.")}
    return ucx, knobs


def _number(v: str) -> Any:
    """A ``--plane`` value: an int, a float, or else the text (caller_posts=never)."""
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def _wait_all(mgr: Any, rooms: list[int], code: int, limit: float = 120.0) -> None:
    """Block until every room reports KVPoll ``code`` (``Manager.wait``: woken by the transport
    threads as rooms change state, so no polling interval is added and no CPU is spent)."""
    codes = mgr.wait(rooms, code, timeout=limit)
    if any(c != code for c in codes):
        why = {r: str(mgr.failure_exception(r)) for r, c in zip(rooms, codes, strict=True) if c == 0}
        raise TimeoutError(f"bench: rooms did not all reach KVPoll {code}: {codes} {why}")


API_PREFIX = {"send": "kvfsm", "send_many": "kvfsm_many"}  # JSON field prefix of each engine API
TIMED_CALLS = ("transfer", "initialize_xfer", "make_prepped_xfer", "get_xfer_descs", "check_xfer_state",
               "release_xfer_handle", "get_new_notifs")  # fmt: skip


class _TimedAgent:
    """``--profile``: wraps a NIXL agent, and counts calls, wall seconds and the calling thread's
    CPU seconds per (thread, method) (the wall time includes taking the GIL back after NIXL
    dropped it; the CPU time is what NIXL, UCX and the driver spent on that thread)."""

    def __init__(self, agent: Any, table: dict[str, list[float]]) -> None:
        self._agent = agent
        self._table = table

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._agent, name)
        if name not in TIMED_CALLS:
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            c = time.thread_time()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:  # one key per thread: only that thread updates it
                e = self._table.setdefault(f"{threading.current_thread().name}/{name}", [0, 0.0, 0.0])
                e[0] += 1
                e[1] += time.perf_counter() - t
                e[2] += time.thread_time() - c

        return timed


class _GcClock:
    """Collections of the cyclic garbage collector and the seconds they paused the process."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._t = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t

    def snapshot(self) -> tuple[list[int], float]:
        return list(self.count), self.seconds

    def since(self, snap: tuple[list[int], float]) -> dict[str, Any]:
        return {
            "collections": [a - b for a, b in zip(self.count, snap[0], strict=True)],
            "seconds": self.seconds - snap[1],
        }


GC = _GcClock()


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of every live thread of this process, by name."""
    out = {}
    for t in threading.enumerate():
        try:
            out[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
        except (OSError, TypeError):
            pass
    return out


def _add_thread_cpu(threads: dict[str, float], since: dict[str, float]) -> None:
    """--profile: add each thread's CPU seconds since ``since`` (a ``_thread_cpu()``; empty when
    not profiling: nothing is added) to ``threads``."""
    if since:
        for k, v in _thread_cpu().items():
            threads[k] = threads.get(k, 0.0) + v - since.get(k, 0.0)


class KvfsmInitiator:
    """kvfsm on the initiator's side (prefill): one manager per page size, made when a case
    first needs it. No transfer workers: the NIXL data plane validates a write and posts it (or
    queues it for its posting thread), so a runtime worker would only add a thread hop (and GIL
    hand-offs)."""

    def __init__(self, conn: Any, src: Any, params: dict[str, str], boot: str, profile: bool) -> None:
        from kvfsm.runtime import RuntimeConfig

        self.conn, self.src, self.params, self.boot, self.profile = conn, src, params, boot, profile
        self.aux = _buffer(16 * AUX, "cpu", 1)
        self.cfg = RuntimeConfig(workers=0, timeouts={"transfer": 60.0, "hold": 60.0, "bootstrap": 60.0, "input": 60.0})
        self.managers: dict[int, tuple[Any, Any]] = {}
        self.calls: dict[str, list[float]] = {}  # --profile: (thread/method) -> [calls, wall s, CPU s]
        self.room_id = 0

    def manager(self, page: int) -> tuple[Any, Any]:
        if page not in self.managers:
            from kvfsm.runtime import PrefillManager

            ep = _kvfsm_endpoint(f"bench-p-{page}", "prefill", self.boot, self.params)
            mgr = PrefillManager(0, ep, kv=self.src, aux=self.aux, page_bytes=page, aux_slot_bytes=AUX, config=self.cfg)
            if self.profile:
                ep.data.agent = _TimedAgent(ep.data.agent, self.calls)
            self.managers[page] = (mgr, ep)
        return self.managers[page]

    def contestants(self, ci: int, case: dict[str, Any], apis: list[str]) -> list[Any]:
        """kvfsm's repetitions of case ``ci``, one per engine API (the same manager for both)."""
        return [_KvfsmCase(self, ci, case, api) for api in apis]

    def close(self) -> None:
        for mgr, ep in self.managers.values():
            mgr.close()
            ep.close()


class _KvfsmCase:
    """kvfsm's repetitions of one case with one engine API: per repetition, rooms announced by
    decode first, then every chunk handed over (``send()`` per room and chunk, or
    ``send_many()`` per chunk of every room: an engine's batch; page lists built before the
    clock starts, as an engine holds them), timed until every room reports Success. Counters
    shared with the other API's repetitions (the manager's, the data plane's, NIXL call times)
    are taken as each repetition's difference."""

    def __init__(self, kv: KvfsmInitiator, ci: int, case: dict[str, Any], api: str) -> None:
        self.kv, self.ci, self.case, self.api = kv, ci, case, api
        self.mgr, self.ep = kv.manager(case["page"])
        rooms, chunks = case["plan"]
        self.chunk_pages = [[_held(case, pages_of(case, r, c, "prefill")) for r in range(rooms)] for c in range(chunks)]
        self.times: list[float] = []
        self.handing: list[float] = []
        self.cpu: list[float] = []
        self.descriptors = self.post_ns = self.transfers = self.posted = 0
        self.gc_collections = [0, 0, 0]
        self.gc_seconds = 0.0
        self.calls: dict[str, list[float]] = {}
        self.threads: dict[str, float] = {}  # --profile: CPU seconds per thread in the timed windows

    def _counters(self) -> tuple[int, int, int, int]:
        stats = self.ep.data.stats
        descriptors = self.mgr.stats()["counters"].get("descriptors", 0)
        return descriptors, stats["post_ns"], stats["transfers"], stats["descriptors"]

    def rep(self) -> None:
        from kvfsm.protocol import KVPoll

        kv, mgr, api, conn = self.kv, self.mgr, self.api, self.kv.conn
        rooms, chunks = self.case["plan"]
        before = self._counters()
        gc0 = GC.snapshot()
        calls0 = {k: list(v) for k, v in kv.calls.items()}
        ids = list(range(kv.room_id, kv.room_id + rooms))
        kv.room_id += rooms
        senders = [mgr.create_sender(rid) for rid in ids]
        conn.send(("kvfsm", self.ci, api, ids))
        _wait_all(mgr, ids, KVPoll.WaitingForInput)  # decode announced
        cpu0 = _thread_cpu() if kv.profile else {}
        chunk_pages = self.chunk_pages
        c0 = time.thread_time()
        t0 = time.perf_counter()
        for c in range(chunks):
            last = c == chunks - 1
            if api == "send_many":
                mgr.send_many([(s, chunk_pages[c][r], last, r if last else None) for r, s in enumerate(senders)])
            else:
                for r, s in enumerate(senders):
                    s.send(chunk_pages[c][r], is_last=last, aux_slot=r if last else None)
        self.handing.append(time.perf_counter() - t0)
        self.cpu.append(time.thread_time() - c0)
        _wait_all(mgr, ids, KVPoll.Success)
        self.times.append(time.perf_counter() - t0)
        _add_thread_cpu(self.threads, cpu0)
        for s in senders:
            s.clear()
        if not conn.recv():
            raise RuntimeError(f"decode found mismatched bytes in case {self.case} ({api})")
        after = self._counters()
        self.descriptors += after[0] - before[0]
        self.post_ns += after[1] - before[1]
        self.transfers += after[2] - before[2]
        self.posted += after[3] - before[3]
        # the interpreter's garbage collections meanwhile (the untimed parts too)
        gc = GC.since(gc0)
        self.gc_collections = [a + b for a, b in zip(self.gc_collections, gc["collections"], strict=True)]
        self.gc_seconds += gc["seconds"]
        for k, v in kv.calls.items():
            old = calls0.get(k, [0, 0.0, 0.0])
            mine = self.calls.setdefault(k, [0, 0.0, 0.0])
            for i in range(3):
                mine[i] += v[i] - old[i]

    def finish(self) -> None:
        case, pre = self.case, API_PREFIX[self.api]
        rooms, chunks = case["plan"]
        reps = len(self.times)
        case[f"{pre}_reps_seconds"] = self.times[1:]
        case[f"{pre}_seconds"] = statistics.median(self.times[1:])
        case[f"{pre}_send_seconds"] = statistics.median(self.handing[1:])  # the engine's hand-over calls alone
        case[f"{pre}_send_cpu_seconds"] = statistics.median(self.cpu[1:])  # ... and its thread's CPU meanwhile
        case[f"{pre}_post_seconds"] = self.post_ns / 1e9
        case[f"{pre}_descriptors_per_chunk"] = self.descriptors / (reps * rooms * chunks)
        case[f"{pre}_transfers"] = self.transfers  # NIXL transfers, all repetitions
        # ... and their descriptors per chunk (adjacent byte ranges of one transfer merged)
        case[f"{pre}_posted_descriptors_per_chunk"] = self.posted / (reps * rooms * chunks)
        # all repetitions, the untimed parts too
        case[f"{pre}_gc"] = {"collections": self.gc_collections, "seconds": self.gc_seconds}
        if self.kv.profile:
            self.kv.conn.send(("threads", self.ci, self.api))
            case[f"{pre}_profile"] = {
                "thread_cpu_seconds": self.threads,  # timed windows only (every repetition)
                "decode_thread_cpu_seconds": self.kv.conn.recv(),  # the target's, announcement to Success
                "nixl_calls": {
                    k: {"calls": int(n), "seconds": t, "cpu_seconds": c} for k, (n, t, c) in sorted(self.calls.items())
                },
            }


def _same_pages(dst: Any, src: Any, sp: list[int], dp: list[int], page: int) -> bool:
    """Do ``dst``'s pages ``dp`` hold ``src``'s pages ``sp``? Run by run (pages adjacent on both
    sides), compared in place. Gathering each chunk's pages into temporaries instead (2 x 256 MiB
    for a 256 MiB chunk, ~1 s on DRAM) churned the target's memory: raw NIXL run right after such
    checks (repetitions taken in turn) moved 10-20 % less on a 2-vCPU host."""
    import torch

    from kvfsm.runtime.pages import coalesce

    segs = coalesce(sp, dp, page)
    if len(segs) > 64:  # scattered pages: gathered, one chunk (at most 16 MiB here) at a time
        s = torch.as_tensor(sp, device=src.device)
        d = torch.as_tensor(dp, device=dst.device)
        return bool(torch.equal(dst.view(-1, page)[d], src.view(-1, page)[s]))
    return all(torch.equal(dst[g.dst : g.dst + g.length], src[g.src : g.src + g.length]) for g in segs)


# ------------------------------------------------------------------------------------- processes


def _measure(contestants: list[Any], reps: int, interleaved: bool) -> None:
    """``reps`` + 1 repetitions (the first warms up) of each contestant: each one's back to
    back, or (``interleaved``) round after round, one repetition of each per round."""
    order = (
        [x for _ in range(reps + 1) for x in contestants]
        if interleaved
        else [x for x in contestants for _ in range(reps + 1)]
    )
    for x in order:
        x.rep()
    for x in contestants:
        x.finish()


def _initiator(parent: Any, conn: Any, nbytes: int, device: str, params: dict[str, str], all_cases: Any,
               reps: int, boot: str, apis: list[str], profile: bool, floor: tuple[float, ...],
               order: str) -> None:  # fmt: skip
    src = _buffer(nbytes, device, 7)
    raw = RawInitiator(conn, src, params)
    kv = KvfsmInitiator(conn, src, params, boot, profile)
    if order == "interleaved":
        for ci, case in enumerate(all_cases):
            _measure([*raw.contestants(ci, case, floor, reps), *kv.contestants(ci, case, apis)], reps, True)
    else:  # raw NIXL's cases first, before any kvfsm thread exists; then kvfsm's
        for ci, case in enumerate(all_cases):
            _measure(raw.contestants(ci, case, floor, reps), reps, False)
        for ci, case in enumerate(all_cases):  # both APIs per case, one after the other
            _measure(kv.contestants(ci, case, apis), reps, False)
    conn.send("done")
    conn.recv()
    kv.close()
    parent.send(all_cases)


def _target(conn: Any, nbytes: int, device: str, params: dict[str, str], all_cases: Any, boot: str,
            profile: bool) -> None:  # fmt: skip
    """The target process: serves the initiator's repetitions, raw NIXL's and kvfsm's, in the
    order they come."""
    dst = _buffer(nbytes, device, None)
    expected = _buffer(nbytes, device, 7)  # the initiator's bytes, to check what repetitions wrote
    raw = RawTarget(conn, dst, expected, params)
    kv: KvfsmTarget | None = None
    while True:
        msg = conn.recv()
        if msg == "done":
            conn.send("bye")
            if kv is not None:
                kv.close()
            return
        if msg[0] == "go":
            raw.rep(all_cases[msg[1]], msg[2])
            continue
        if kv is None:  # kvfsm's first repetition
            kv = KvfsmTarget(conn, dst, expected, params, boot, profile)
        if msg[0] == "kvfsm":
            _, ci, api, ids = msg
            kv.rep(all_cases[ci], (ci, api), ids)
        else:  # ("threads", case index, api): --profile
            conn.send(kv.threads.pop((msg[1], msg[2]), {}))


class KvfsmTarget:
    """kvfsm on the target's side (decode): per repetition, zero what it writes, announce the
    pages of the rooms the initiator names, wait for Success and verify every byte."""

    def __init__(
        self, conn: Any, dst: Any, expected: Any, params: dict[str, str], boot: str, profile: bool = False
    ) -> None:
        from kvfsm.runtime import RuntimeConfig
        from kvfsm.transport.zmq import BootstrapClient

        self.conn, self.dst, self.expected, self.params, self.boot = conn, dst, expected, params, boot
        self.profile = profile
        self.aux = _buffer(16 * AUX, "cpu", None)
        self.cfg = RuntimeConfig(workers=0, timeouts={"transfer": 60.0, "bootstrap": 60.0, "fence": 60.0})
        self.client = BootstrapClient(boot)
        self.managers: dict[int, tuple[Any, Any]] = {}
        self.pages: dict[int, list[Any]] = {}  # case index -> each room's decode pages
        # --profile: (case index, api) -> this process's CPU seconds per thread, announcement to Success
        self.threads: dict[tuple[int, str], dict[str, float]] = {}

    def manager(self, page: int) -> Any:
        if page not in self.managers:
            from kvfsm.runtime import DecodeManager

            peer = f"bench-p-{page}"
            ep = _kvfsm_endpoint(f"bench-d-{page}", "decode", self.boot, self.params)
            mgr = DecodeManager(
                0, ep, prefill_peers={0: peer}, kv=self.dst, aux=self.aux, page_bytes=page, aux_slot_bytes=AUX,
                config=self.cfg,
            )  # fmt: skip
            self.managers[page] = (mgr, ep)
            self.client.wait_for([peer], timeout_s=60)  # the initiator registered it before this case
            mgr.connect()
        return self.managers[page][0]

    def rep(self, case: dict[str, Any], key: tuple[int, str], ids: list[int]) -> None:
        from kvfsm.protocol import KVPoll

        rooms, chunks = case["plan"]
        page = case["page"]
        mgr = self.manager(page)
        if key[0] not in self.pages:
            self.pages[key[0]] = [
                _held(case, [p for c in range(chunks) for p in pages_of(case, r, c, "decode")]) for r in range(rooms)
            ]
        dst_pages = self.pages[key[0]]
        # zeroed first, so that the check sees only this repetition's bytes (and none of raw NIXL's)
        _clear(self.dst, _extent(case))
        recv = [mgr.create_receiver(rid) for rid in ids]
        _wait_all(mgr, ids, KVPoll.WaitingForInput)
        cpu0 = _thread_cpu() if self.profile else {}
        for r, rc in enumerate(recv):
            rc.init(dst_pages[r], r)
        _wait_all(mgr, ids, KVPoll.Success)
        _add_thread_cpu(self.threads.setdefault(key, {}), cpu0)
        ok = _check(self.dst, self.expected, case)
        for rc in recv:
            rc.clear()
        self.conn.send(ok)

    def close(self) -> None:
        self.client.close()
        for mgr, ep in self.managers.values():
            mgr.close()
            ep.close()


def run(
    sizes: list[int],
    budget: int,
    reps: int,
    device: str,
    target_device: str,
    params: dict[str, str],
    layouts: tuple[str, ...] = ("contig", "scattered"),
    apis: tuple[str, ...] = tuple(API_PREFIX),
    profile: bool = False,
    pages: str = "list",
    floor: tuple[float, ...] = (),
    order: str = "blocks",
) -> list[dict[str, Any]]:
    from kvfsm.transport.zmq import BootstrapServer

    if order not in ORDERS:
        raise ValueError(f"order {order!r}: one of {', '.join(ORDERS)}")
    all_cases = cases(sizes, budget, layouts)
    for c in all_cases:
        c["pages"] = pages
    nbytes = max(c["size"] * c["plan"][0] * c["plan"][1] for c in all_cases)
    server = BootstrapServer()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    a, b = ctx.Pipe()
    procs = [
        ctx.Process(
            target=_initiator,
            args=(
                child,
                a,
                nbytes,
                device,
                params,
                all_cases,
                reps,
                server.address,
                list(apis),
                profile,
                floor,
                order,
            ),
        ),
        ctx.Process(
            target=_target,
            args=(b, nbytes, target_device, params, all_cases, server.address, profile),
        ),
    ]
    for p in procs:
        p.start()
    reported = False
    try:
        measured = _report(parent, procs, REPORT_LIMIT_S)
        reported = True
    finally:
        for p in procs:
            if reported:  # a process that failed leaves the other waiting for it: no joining then
                p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        server.close()
    for c in measured:
        moved = c["size"] * c["plan"][0] * c["plan"][1]
        c["bytes"] = moved
        c["transfers"] = c["plan"][0] * c["plan"][1]
        c["descriptors_per_transfer"] = 1 if c["layout"] == "contig" else c["size"] // c["page"]
        c["raw_gbps"] = moved / c["raw_seconds"] / 1e9
        for api in apis:
            pre = API_PREFIX[api]
            c[f"{pre}_gbps"] = moved / c[f"{pre}_seconds"] / 1e9
            c[RATIO[api]] = c[f"{pre}_gbps"] / c["raw_gbps"]
            if order == "interleaved":  # each round's raw NIXL time over kvfsm's, the median
                pairs = zip(c["raw_reps_seconds"], c[f"{pre}_reps_seconds"], strict=True)
                c[RATIO[api] + "_paired"] = statistics.median(r / k for r, k in pairs)
        for f in c.get("floor", {}).values():
            f["gbps"] = moved / f["seconds"] / 1e9
            f["ratio"] = f["gbps"] / c["raw_gbps"]  # against raw NIXL, as kvfsm's
            f["cpu_us_per_chunk"] = f["cpu_seconds"] / c["transfers"] * 1e6
            f["transfers_per_chunk"] = f["transfers"] / c["transfers"]
    return measured


REPORT_LIMIT_S = 600.0  # the longest the driver waits for the initiator's cases


def _report(parent: Any, procs: list[Any], limit: float) -> list[dict[str, Any]]:
    """The initiator's measured cases, once it sends them. A process that exits first (its
    traceback on stderr: a device that does not exist, a kvfsm that fails to start) ends the
    wait at once, not after ``limit`` seconds; so does the target exiting with an error code
    (it exits with 0 after the initiator's last repetition, before the initiator reports)."""
    deadline = time.monotonic() + limit
    while not parent.poll(0.2):
        for name, p in zip(("initiator", "target"), procs, strict=True):
            failed = p.exitcode is not None and (name == "initiator" or p.exitcode != 0)
            if failed and not parent.poll(0):
                raise RuntimeError(
                    f"bench/transfer.py: the {name} process exited with code {p.exitcode} before the "
                    "initiator reported its cases (its traceback is above)"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench/transfer.py: the initiator reported nothing within {limit:.0f} s")
    cases_: list[dict[str, Any]] = parent.recv()
    return cases_


RATIO = {"send": "ratio", "send_many": "ratio_many"}  # kvfsm / raw, per engine API
ORDERS = ("blocks", "interleaved")  # --order


def table(measured: list[dict[str, Any]], apis: tuple[str, ...] = tuple(API_PREFIX)) -> str:
    head = "| chunk | layout | descriptors/chunk | chunks | raw NIXL GB/s |"
    rule = "|---|---|---|---|---|"
    for api in apis:
        head += f" kvfsm {api}() GB/s | {api}() / raw |"
        rule += "---|---|"
    rows = [head, rule]
    for c in measured:
        size = f"{c['size'] >> 20} MiB" if c["size"] >= MiB else f"{c['size'] >> 10} KiB"
        row = f"| {size} | {c['layout']} | {c['descriptors_per_transfer']} | {c['transfers']} | {c['raw_gbps']:.2f} |"
        for api in apis:
            row += f" {c[API_PREFIX[api] + '_gbps']:.2f} | {c[RATIO[api]]:.2f} |"
        rows.append(row)
    return "\n".join(rows)


def floor_table(measured: list[dict[str, Any]]) -> str:
    """``--floor``: per contiguous case and µs of spinning, the floor's GB/s, its ratio to raw
    NIXL, its engine CPU and transfers per chunk, beside kvfsm's engine CPU per chunk."""
    rows = ["| chunk | spin µs/chunk | floor GB/s | floor / raw | floor CPU µs/chunk | transfers/chunk |"
            " kvfsm send() CPU µs/chunk |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in measured:
        kvfsm = c.get("kvfsm_send_cpu_seconds")
        mine = f"{kvfsm / c['transfers'] * 1e6:.1f}" if kvfsm is not None else "-"
        for work, f in c.get("floor", {}).items():
            size = f"{c['size'] >> 20} MiB" if c["size"] >= MiB else f"{c['size'] >> 10} KiB"
            rows.append(f"| {size} | {float(work):g} | {f['gbps']:.2f} | {f['ratio']:.2f} | "
                        f"{f['cpu_us_per_chunk']:.1f} | {f['transfers_per_chunk']:.2f} | {mine} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", default="bench/results/transfer.json")
    ap.add_argument("--quick", action="store_true", help="a few small sizes (tests)")
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help="repetitions per case (after one warm-up; default 9, --quick 1); the median counts",
    )
    ap.add_argument("--budget-mib", type=int, default=256, help="bytes per case, roughly")
    ap.add_argument("--device", default="cpu", help="initiator's buffer: cpu (DRAM) or cuda[:N] (VRAM)")
    ap.add_argument("--target-device", default=None, help="target's buffer (default: the same as --device)")
    ap.add_argument("--ucx", action="append", default=[], help="UCX backend parameter KEY=VALUE")
    ap.add_argument(
        "--plane",
        action="append",
        default=[],
        help="a field of kvfsm's NixlConfig KEY=VALUE: caller_posts=auto|always|never, hold_writes, hold_bytes, "
        "hold_below, large_write, busy_poll_s, tail_poll_s, idle_poll_s, hot_window_s, quiet_poll_s, poller_sched",
    )
    ap.add_argument("--sizes", help="comma-separated chunk sizes in KiB (default: 4 KiB ... 256 MiB)")
    ap.add_argument("--layouts", default="contig,scattered", help="contig, scattered or both")
    ap.add_argument("--api", default="send,send_many", help="engine APIs to measure: send, send_many or both")
    ap.add_argument("--profile", action="store_true", help="per case: thread CPU and NIXL call times (initiator)")
    ap.add_argument(
        "--pages",
        choices=("list", "numpy"),
        default="list",
        help="page indices as the engine holds them: Python lists (vLLM) or numpy int64 arrays (SGLang)",
    )
    ap.add_argument(
        "--floor",
        default="",
        help="comma-separated µs of spinning per chunk: also time, per value, the leanest pipelined Python on NIXL "
        "with no protocol (contiguous cases; fields floor.<µs>)",
    )
    ap.add_argument(
        "--order",
        choices=ORDERS,
        default="blocks",
        help="blocks: raw NIXL's repetitions first (no kvfsm thread alive yet), then kvfsm's; interleaved: round "
        "after round, one repetition of each (both sides' agents alive throughout)",
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if kvfsm < 0.9x raw for contiguous chunks >= 1 MiB")
    args = ap.parse_args(argv)
    apis = tuple(args.api.split(","))
    if not apis or set(apis) - set(API_PREFIX):
        ap.error(f"--api: a comma-separated subset of {', '.join(API_PREFIX)}")
    params = dict(kv.split("=", 1) for kv in args.ucx)
    params.update(("plane." + k, v) for k, v in (kv.split("=", 1) for kv in args.plane))
    sizes = QUICK_SIZES if args.quick else SIZES
    if args.sizes:
        sizes = [int(k) << 10 for k in args.sizes.split(",")]
    budget = (16 if args.quick else args.budget_mib) * MiB
    target = args.target_device or args.device
    layouts = tuple(args.layouts.split(","))
    reps = args.reps if args.reps is not None else 1 if args.quick else 9
    floor = tuple(float(w) for w in args.floor.split(",") if w)
    measured = run(
        sizes,
        budget,
        reps,
        args.device,
        target,
        params,
        layouts,
        apis,
        args.profile,
        args.pages,
        floor,
        args.order,
    )
    goal = [c for c in measured if c["layout"] == "contig" and c["size"] >= MiB]
    worst = {api: min((c[RATIO[api]] for c in goal), default=None) for api in apis}
    result = {
        "bench": "transfer",
        "device": args.device,
        "target_device": target,
        "ucx_params": params,
        "cases": measured,
        "apis": list(apis),
        "pages": args.pages,
        "order": args.order,
        "goal": {  # per engine API
            "kvfsm_ge_0.9x_raw_for_chunks_ge_1MiB": {api: w is None or w >= 0.9 for api, w in worst.items()},
            "worst_ratio_ge_1MiB": worst,
        },
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(table(measured, apis))
    if floor:
        print(floor_table(measured))
    print(json.dumps(result["goal"]))
    return 1 if args.check and not all(result["goal"]["kvfsm_ge_0.9x_raw_for_chunks_ge_1MiB"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
