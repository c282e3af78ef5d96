"""bench/transfer.py: kvfsm over NIXL against raw NIXL, two processes, the same bytes and descriptors.

Two processes (spawned): an initiator (prefill) and a target (decode), each with one buffer of
the same size, on DRAM (``--device cpu``) or VRAM (``--device cuda:0 --target-device cuda:1``).
The run measures, in the same processes, first raw NIXL for every case (chunk size x layout)
with nothing else running, then kvfsm for every case:

  raw    one NIXL agent per process (UCX, no progress thread, as the kvfsm data plane sets it
         up), metadata exchanged over a pipe. Before the clock starts, each chunk's descriptors
         are built exactly as kvfsm's data plane would post them (one byte range per contiguous
         run, or block indices into page-granular lists prepared once for scattered pages), and
         each room's aux slot (64 B of host memory) goes with its last chunk as kvfsm writes it:
         in the chunk's transfer where both are byte ranges of host memory, else as a transfer
         of its own (``raw_transfers``, ``raw_descriptors_per_chunk``); timed per transfer: make
         it, post it with a notification, poll until DONE, release. The target polls
         notifications meanwhile.
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
(equal: the engine thread is CPU-bound; less: it waited for locks or the GIL).
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
SIZES = [4 << 10, 64 << 10, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
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
    from kvfsm.runtime.manager import coalesce
    from kvfsm.transport.nixl import HOST_TO_HOST as HOST
    from kvfsm.transport.nixl import use_prepped

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


def raw_initiator(
    conn: Any, src: Any, params: dict[str, str], all_cases: list[dict[str, Any]], reps: int,
    floor: tuple[float, ...] = (),
) -> None:  # fmt: skip
    agent = _raw_agent("raw-p", params)
    agent.register_memory(src)
    aux = _buffer(16 * AUX, "cpu", 1)  # as kvfsm's prefill side has it
    agent.register_memory(aux)
    conn.send(agent.get_agent_metadata())
    md, dst, dst_aux = conn.recv()
    agent.add_remote_agent(md)
    lp = _prep(agent, "NIXL_INIT_AGENT", src.data_ptr(), src.numel(), *_placement(src))
    rp = _prep(agent, "raw-d", dst[0], src.numel(), dst[1], dst[2])
    for case in all_cases:
        rooms, chunks = case["plan"]
        descs = raw_descriptors(agent, src, dst, case, (aux.data_ptr(), dst_aux))
        post = 0.0

        def one(descs: list[tuple[str, Any, Any, int]] = descs) -> int:
            nonlocal post
            for kind, a, b, _ in descs:
                if kind == "prepped":
                    h = agent.make_prepped_xfer("WRITE", lp, a, rp, b, b"raw")
                else:
                    h = agent.initialize_xfer("WRITE", a, b, "raw-d", b"raw")
                t_post = time.perf_counter()
                agent.transfer(h)
                post += time.perf_counter() - t_post
                while agent.check_xfer_state(h) != "DONE":
                    pass
                agent.release_xfer_handle(h)
            return len(descs)

        times = [t for t, _ in _target_served(conn, case, reps, one)]
        case["raw_reps_seconds"] = times[1:]  # every measured repetition (the spread within a run)
        case["raw_seconds"] = statistics.median(times[1:])
        case["raw_post_seconds"] = post  # inside NIXL's post, over every repetition
        case["raw_transfers"] = len(descs)  # per repetition (kvfsm_transfers: over all of them)
        case["raw_descriptors_per_chunk"] = sum(d[3] for d in descs) / (rooms * chunks)
        if floor and case["layout"] == "contig":
            case["floor"] = {
                str(work): _floor_case(conn, agent, src, dst, case, (aux.data_ptr(), dst_aux), reps, work)
                for work in floor
            }
    conn.send("done")


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
    kvfsm's data plane posts a GPU's writes (at once while nothing is in flight or for a chunk of
    ``HOLD_BELOW_BYTES`` or more, else held until ``FLUSH_JOBS`` writes or ``FLUSH_BYTES``, then
    one folded transfer; the aux slots, another memory kind on a GPU, as one transfer at the
    end), the oldest transfers completed after each post, until the first still in progress.
    Returns (transfers, engine CPU seconds)."""
    from kvfsm.transport.nixl import FLUSH_BYTES, FLUSH_JOBS, HOLD_BELOW_BYTES, pack_notifications

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
                or n >= HOLD_BELOW_BYTES
                or len(held[kv_mems][0]) >= FLUSH_JOBS
                or held_bytes >= FLUSH_BYTES
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


def _floor_case(
    conn: Any, agent: Any, src: Any, dst: tuple[int, str, int], case: dict[str, Any], aux: tuple[int, int],
    reps: int, work_us: float,
) -> dict[str, Any]:  # fmt: skip
    """``--floor``: ``reps`` timed repetitions of ``floor_pass`` (after a warm-up), served by
    ``raw_target`` as raw NIXL's are."""
    cpus: list[float] = []

    def one() -> int:
        n, cpu = floor_pass(agent, src, dst, case, aux, work_us * 1e-6)
        cpus.append(cpu)
        return n

    timed = _target_served(conn, case, reps, one)[1:]
    return {
        "seconds": statistics.median(t for t, _ in timed),
        "reps_seconds": [t for t, _ in timed],
        "cpu_seconds": statistics.median(cpus[1:]),
        "transfers": statistics.median(n for _, n in timed),
    }


def _target_served(conn: Any, case: dict[str, Any], reps: int, one: Any) -> list[tuple[float, int]]:
    """``reps`` + 1 repetitions of ``one`` (the first warms up), each after ``raw_target`` has
    zeroed what the case writes, timed, and checked: ``one`` returns the transfers it posted and
    the target must count as many notifications. (seconds, transfers) per repetition."""
    out = []
    for _ in range(reps + 1):
        conn.send(("go", _extent(case)))
        conn.recv()
        t0 = time.perf_counter()
        n = one()
        out.append((time.perf_counter() - t0, n))
        conn.send(n)  # one notification per transfer
        if conn.recv() != n:
            raise RuntimeError("bench: the target counted a different number of notifications")
    return out


def raw_target(conn: Any, dst: Any, params: dict[str, str], all_cases: list[dict[str, Any]], reps: int) -> None:
    agent = _raw_agent("raw-d", params)
    agent.register_memory(dst)
    aux = _buffer(16 * AUX, "cpu", None)  # as kvfsm's decode side has it
    agent.register_memory(aux)
    md = conn.recv()
    agent.add_remote_agent(md)
    conn.send((agent.get_agent_metadata(), (dst.data_ptr(), *_placement(dst)), aux.data_ptr()))
    got = 0
    while True:
        if conn.poll():
            msg = conn.recv()
            if msg == "done":
                return
            if isinstance(msg, tuple):  # ("go", bytes the repetition writes)
                got = 0
                _clear(dst, msg[1])  # as before each of kvfsm's repetitions
                conn.send("ready")
            else:  # the initiator finished posting `msg` transfers: wait for their notifications
                while got < msg:
                    got += sum(len(v) for v in agent.get_new_notifs().values())
                conn.send(got)
        got += sum(len(v) for v in agent.get_new_notifs().values())


# ------------------------------------------------------------------------------------- kvfsm


def _kvfsm_endpoint(name: str, side: str, bootstrap: str, params: dict[str, str]) -> Any:
    from kvfsm.transport.base import SplitEndpoint
    from kvfsm.transport.nixl import NixlDataPlane
    from kvfsm.transport.zmq import ZmqControlPlane

    ucx, knobs = _split_params(params)
    return SplitEndpoint(
        ZmqControlPlane(name, bootstrap=bootstrap, side=side, rank=0),
        NixlDataPlane(name, backend_params=ucx, **knobs),
    )


def _split_params(params: dict[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """UCX backend parameters, and ``--plane`` options of kvfsm's data plane (``plane.`` keys)."""
    ucx = {k: v for k, v in params.items() if not k.startswith("plane.")}
    knobs: dict[str, Any] = {}
    for k, v in params.items():
        if k == "plane.progress_thread":
            knobs["progress_thread"] = v.lower() in ("1", "y", "yes", "true")
        elif k.startswith("plane."):
            knobs[k[len("plane.") :]] = _number(v)
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


def kvfsm_initiator(
    conn: Any, src: Any, params: dict[str, str], all_cases: list[dict[str, Any]], reps: int, boot: str,
    apis: list[str], profile: bool,
) -> None:  # fmt: skip
    """Prefill side: one manager per page size; per API and case, per repetition: rooms announced
    by decode first, then every chunk handed over (``send()`` per room and chunk, or
    ``send_many()`` per chunk of every room: an engine's batch; page lists built before the clock
    starts, as an engine holds them), timed until every room reports Success."""
    from kvfsm.protocol import KVPoll
    from kvfsm.runtime import PrefillManager, RuntimeConfig

    aux = _buffer(16 * AUX, "cpu", 1)
    # no transfer workers: the NIXL data plane validates a write and posts it (or queues it for
    # its posting thread), so a runtime worker would only add a thread hop (and GIL hand-offs)
    cfg = RuntimeConfig(workers=0, timeouts={"transfer": 60.0, "hold": 60.0, "bootstrap": 60.0, "input": 60.0})
    managers: dict[int, tuple[Any, Any]] = {}
    calls: dict[str, list[float]] = {}
    conn.send("ready")
    room_id = 0
    for case in all_cases:  # both APIs per case, one after the other: the same process state for both
        for api in apis:
            pre = API_PREFIX[api]
            rooms, chunks = case["plan"]
            page = case["page"]
            if page not in managers:
                ep = _kvfsm_endpoint(f"bench-p-{page}", "prefill", boot, params)
                mgr = PrefillManager(0, ep, kv=src, aux=aux, page_bytes=page, aux_slot_bytes=AUX, config=cfg)
                if profile:
                    ep.data.agent = _TimedAgent(ep.data.agent, calls)
                managers[page] = (mgr, ep)
            mgr, ep = managers[page]
            chunk_pages = [[_held(case, pages_of(case, r, c, "prefill")) for r in range(rooms)] for c in range(chunks)]
            descriptors = mgr.stats()["counters"].get("descriptors", 0)
            posted = ep.data.stats["post_ns"]
            transfers = ep.data.stats["transfers"]
            times, handing, cpu = [], [], []
            gc0 = GC.snapshot()
            calls.clear()
            threads: dict[str, float] = {}  # --profile: CPU seconds per thread in the timed windows
            for _ in range(reps + 1):
                ids = list(range(room_id, room_id + rooms))
                room_id += rooms
                senders = [mgr.create_sender(rid) for rid in ids]
                conn.send(ids)
                _wait_all(mgr, ids, KVPoll.WaitingForInput)  # decode announced
                cpu0 = _thread_cpu() if profile else {}
                c0 = time.thread_time()
                t0 = time.perf_counter()
                for c in range(chunks):
                    last = c == chunks - 1
                    if api == "send_many":
                        mgr.send_many(
                            [(s, chunk_pages[c][r], last, r if last else None) for r, s in enumerate(senders)]
                        )
                    else:
                        for r, s in enumerate(senders):
                            s.send(chunk_pages[c][r], is_last=last, aux_slot=r if last else None)
                handing.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                _wait_all(mgr, ids, KVPoll.Success)
                times.append(time.perf_counter() - t0)
                _add_thread_cpu(threads, cpu0)
                for s in senders:
                    s.clear()
                if not conn.recv():
                    raise RuntimeError(f"decode found mismatched bytes in case {case} ({api})")
            case[f"{pre}_reps_seconds"] = times[1:]
            case[f"{pre}_seconds"] = statistics.median(times[1:])
            case[f"{pre}_send_seconds"] = statistics.median(handing[1:])  # the engine's hand-over calls alone
            case[f"{pre}_send_cpu_seconds"] = statistics.median(cpu[1:])  # ... and its thread's CPU meanwhile
            case[f"{pre}_post_seconds"] = (ep.data.stats["post_ns"] - posted) / 1e9
            total = mgr.stats()["counters"].get("descriptors", 0)
            case[f"{pre}_descriptors_per_chunk"] = (total - descriptors) / ((reps + 1) * rooms * chunks)
            case[f"{pre}_transfers"] = ep.data.stats["transfers"] - transfers  # NIXL transfers, all repetitions
            # the interpreter's garbage collections meanwhile (all repetitions, the untimed parts too)
            case[f"{pre}_gc"] = GC.since(gc0)
            if profile:
                case[f"{pre}_profile"] = {
                    "thread_cpu_seconds": threads,  # timed windows only (every repetition)
                    "decode_thread_cpu_seconds": conn.recv(),  # the target's, announcement to Success
                    "nixl_calls": {
                        k: {"calls": int(n), "seconds": t, "cpu_seconds": c} for k, (n, t, c) in sorted(calls.items())
                    },
                }
    conn.send(None)
    conn.recv()
    for mgr, ep in managers.values():
        mgr.close()
        ep.close()


def _same_pages(dst: Any, src: Any, sp: list[int], dp: list[int], page: int) -> bool:
    """Do ``dst``'s pages ``dp`` hold ``src``'s pages ``sp``? Run by run (pages adjacent on both
    sides), compared in place. Gathering each chunk's pages into temporaries instead (2 x 256 MiB
    for a 256 MiB chunk, ~1 s on DRAM here) churned the target's memory: raw NIXL run right after
    such checks (repetitions taken in turn, tried this way) moved 10-20 % less here."""
    import torch

    from kvfsm.runtime.manager import coalesce

    segs = coalesce(sp, dp, page)
    if len(segs) > 64:  # scattered pages: gathered, one chunk (at most 16 MiB here) at a time
        s = torch.as_tensor(sp, device=src.device)
        d = torch.as_tensor(dp, device=dst.device)
        return bool(torch.equal(dst.view(-1, page)[d], src.view(-1, page)[s]))
    return all(torch.equal(dst[g.dst : g.dst + g.length], src[g.src : g.src + g.length]) for g in segs)


# ------------------------------------------------------------------------------------- processes


def _initiator(parent: Any, conn: Any, nbytes: int, device: str, params: dict[str, str], all_cases: Any,
               reps: int, boot: str, apis: list[str], profile: bool, floor: tuple[float, ...]) -> None:  # fmt: skip
    src = _buffer(nbytes, device, 7)
    raw_initiator(conn, src, params, all_cases, reps, floor)
    kvfsm_initiator(conn, src, params, all_cases, reps, boot, apis, profile)
    parent.send(all_cases)


def _target(conn: Any, nbytes: int, device: str, params: dict[str, str], all_cases: Any, reps: int,
            boot: str, apis: list[str], profile: bool) -> None:  # fmt: skip
    dst = _buffer(nbytes, device, None)
    raw_target(conn, dst, params, all_cases, reps)
    expected = _buffer(nbytes, device, 7)
    _clear(dst, nbytes)
    kvfsm_target(conn, dst, expected, params, [c for c in all_cases for _ in apis], reps, boot, profile)


def kvfsm_target(
    conn: Any, dst: Any, expected: Any, params: dict[str, str], all_cases: Any, reps: int, boot: str,
    profile: bool = False,
) -> None:  # fmt: skip
    """Decode side: announce pages for each batch of rooms the initiator names, verify, clear.
    ``profile``: after each case, send the initiator this process's CPU seconds per thread from
    the announcement to Success (every repetition)."""
    from kvfsm.protocol import KVPoll
    from kvfsm.runtime import DecodeManager, RuntimeConfig
    from kvfsm.transport.zmq import BootstrapClient

    aux = _buffer(16 * AUX, "cpu", None)
    cfg = RuntimeConfig(workers=0, timeouts={"transfer": 60.0, "bootstrap": 60.0, "fence": 60.0})
    client = BootstrapClient(boot)
    managers: dict[int, tuple[Any, Any]] = {}
    conn.recv()  # the initiator is ready
    for case in all_cases:
        rooms, chunks = case["plan"]
        page = case["page"]
        if page not in managers:
            peer = f"bench-p-{page}"
            ep = _kvfsm_endpoint(f"bench-d-{page}", "decode", boot, params)
            mgr = DecodeManager(
                0, ep, prefill_peers={0: peer}, kv=dst, aux=aux, page_bytes=page, aux_slot_bytes=AUX, config=cfg
            )
            managers[page] = (mgr, ep)
            client.wait_for([peer], timeout_s=60)  # the initiator registered it before this case
            mgr.connect()
        mgr, _ = managers[page]
        dst_pages = [
            _held(case, [p for c in range(chunks) for p in pages_of(case, r, c, "decode")]) for r in range(rooms)
        ]
        threads: dict[str, float] = {}
        for _ in range(reps + 1):
            ids = conn.recv()
            recv = [mgr.create_receiver(rid) for rid in ids]
            _wait_all(mgr, ids, KVPoll.WaitingForInput)
            cpu0 = _thread_cpu() if profile else {}
            for r, rc in enumerate(recv):
                rc.init(dst_pages[r], r)
            _wait_all(mgr, ids, KVPoll.Success)
            _add_thread_cpu(threads, cpu0)
            ok = all(
                _same_pages(dst, expected, pages_of(case, r, c, "prefill"), pages_of(case, r, c, "decode"), page)
                for r in range(rooms)
                for c in range(chunks)
            )
            for rc in recv:
                rc.clear()
            _clear(dst, _extent(case))  # the next repetition's check sees only its own bytes
            conn.send(ok)
        if profile:
            conn.send(threads)
    conn.recv()  # None: the initiator is done
    conn.send("bye")
    client.close()
    for mgr, ep in managers.values():
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
) -> list[dict[str, Any]]:
    from kvfsm.transport.zmq import BootstrapServer

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
            args=(child, a, nbytes, device, params, all_cases, reps, server.address, list(apis), profile, floor),
        ),
        ctx.Process(
            target=_target,
            args=(b, nbytes, target_device, params, all_cases, reps, server.address, list(apis), profile),
        ),
    ]
    for p in procs:
        p.start()
    try:
        if not parent.poll(600):
            raise TimeoutError("bench/transfer.py: the initiator reported nothing within 600 s")
        measured: list[dict[str, Any]] = parent.recv()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
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
        for f in c.get("floor", {}).values():
            f["gbps"] = moved / f["seconds"] / 1e9
            f["ratio"] = f["gbps"] / c["raw_gbps"]  # against raw NIXL, as kvfsm's
            f["cpu_us_per_chunk"] = f["cpu_seconds"] / c["transfers"] * 1e6
            f["transfers_per_chunk"] = f["transfers"] / c["transfers"]
    return measured


RATIO = {"send": "ratio", "send_many": "ratio_many"}  # kvfsm / raw, per engine API


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
    ap.add_argument("--reps", type=int, default=9, help="repetitions per case (after one warm-up); the median counts")
    ap.add_argument("--budget-mib", type=int, default=256, help="bytes per case, roughly")
    ap.add_argument("--device", default="cpu", help="initiator's buffer: cpu (DRAM) or cuda[:N] (VRAM)")
    ap.add_argument("--target-device", default=None, help="target's buffer (default: the same as --device)")
    ap.add_argument("--ucx", action="append", default=[], help="UCX backend parameter KEY=VALUE")
    ap.add_argument(
        "--plane",
        action="append",
        default=[],
        help="kvfsm NixlDataPlane option KEY=VALUE: caller_posts=auto|always|never, flush_jobs, flush_bytes, hold_below, "
        "progress_thread=1, busy_poll_s, idle_poll_s, hot_window_s",
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
    reps = 1 if args.quick else args.reps
    floor = tuple(float(w) for w in args.floor.split(",") if w)
    measured = run(sizes, budget, reps, args.device, target, params, layouts, apis, args.profile, args.pages, floor)
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
