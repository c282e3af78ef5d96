"""NIXL: the data plane on real NIXL agents (UCX backend), DRAM on CPU and VRAM on GPU.

Theory of operation
-------------------
One ``NixlDataPlane`` owns one NIXL agent named like its endpoint. ``register_memory`` registers
the KV and aux regions (torch tensors, numpy arrays or host buffers) and, when their page and slot
sizes are known, prepares a *local* descriptor list per region at that block granularity (one
strided row, so preparing 10^5 pages costs microseconds). ``descriptor()`` describes us to peers:
a magic, a JSON header (version, agent name, each region's address, length, device, memory kind
and block size) and NIXL's own agent metadata — never pickle. ``add_peer`` validates a peer's
descriptor strictly, loads its agent metadata, checks that NIXL names the agent as the peer
claims, and prepares the peer's regions as *remote* lists.

A write (or read) is validated (bounds, peer, region) in the caller's thread and raises
``TransportError`` before anything moves. Who then posts it depends on where the bytes are
(``caller_posts``, "auto" by default):

* host to host (DRAM both sides): UCX copies inside the post, which takes as long as the copy,
  so the write is queued for the data plane's posting thread, the copy engine;
* many short runs (block indices), wherever they are: UCX spends CPU per descriptor inside the
  post, which the posting thread overlaps with the caller's work;
* otherwise device memory, and host writes of at most ``SMALL_HOST_BYTES``: the post only
  queues the copy, so the caller posts it itself (``_post_now``), Nagle-style: at once if no
  transfer is in flight, else, if smaller than ``hold_below``, held back until ``flush_jobs``
  writes or ``flush_bytes`` are held or the poller's round ends (the poller then posts them,
  its NIXL calls overlapping the caller's Python); a caller that finds the agent busy holds
  rather than waits (up to ``HOLD_LIMIT`` times ``flush_jobs``; a ``BIG_WRITE_BYTES`` write it
  posts at once), and when it posts it also completes the transfers it finds done. Handing
  each write to a thread costs more than posting it: each NIXL call drops the GIL, and the
  thread that dropped it then waits for the busy caller to give it back;
* except a lone write (``write``, ``write_run``) of ``thread_posts_from`` bytes or more while
  a transfer is in flight or queued: its post costs NIXL tens of µs of CPU, which the posting
  thread overlaps with the caller's Python, and the busy link hides the hand-off (see
  ``_to_thread``). A ``write_many`` batch the caller posts in one turn whatever its sizes.

Many short runs (scattered pages) become a ``make_prepped_xfer`` over block indices of the
prepared lists; anything else an ``initialize_xfer`` over exact byte ranges. Writes queued or
held together with the same peer, op, memory kinds and kind of descriptor are folded
(``fold``: at most ``MAX_BATCH`` writes and ``MAX_BATCH_BYTES``) into one transfer whose
notification carries each write's own (``pack_notifications``; the receiving data plane splits
them again): fewer, larger transfers, and every write still completes and notifies on its own,
after its data. A post that NIXL refuses completes its writes as failed.

Progress: NIXL's own progress thread spins a core even when idle, so by default it is off and one
poller thread per data plane drives the agent: it checks the in-flight transfers (the oldest few
each round, all of them every ``FULL_SCAN_S``), turns DONE or an error into "completion" items
(for a batch handler, the writes a transfer completed into one "completions" item),
collects notifications (which also progresses UCX for peers writing into us: their writes complete
only once we did) and hands everything to the handler. It polls every ``busy_poll_s`` while
transfers are in flight; after traffic, within ``hot_window_s``, every eighth of the quiet so far
(from ``busy_poll_s`` up to ``idle_poll_s``); else it waits up to ``idle_poll_s`` (a post wakes
it), or up to ``quiet_poll_s`` while the owner says no peer is expected to write into us
(``expect_traffic(False)``: a prefill rank in push mode, a decode rank with no room); its rounds
then collect notifications only with each full scan (a prefill rank's poller called
``get_new_notifs`` ~50 times per 256 chunks for nothing, ~10 µs each on the H200 host). When the
owner waits for its writes (``flush``, from ``Manager.wait``) the held writes are posted at once
and, until the next write, the poller checks the in-flight transfers every ``tail_poll_s`` (an
eighth of the wait since the last completion, up to ``busy_poll_s``): nobody else completes them
then, and no engine thread needs the GIL. While a
post waits for the agent or is inside it, it stands back (up to ``MAX_DEFER_S``), woken when the
post ends: a timed wake-up costs tens of µs of CPU on a VM. The posting thread, back from a host
copy, posts what callers held back meanwhile before it lets go of the agent, and ``flush`` leaves
those writes to it instead of waiting out the copy. The poller runs under Linux's SCHED_BATCH
(``poller_sched``) when KV is in host memory: its timed wake-ups take a free CPU or wait for the
running thread's slice, rather than preempt a copy (see ``_schedule_poller``). One
lock guards every call into the agent (the agent's default sync mode takes none), taken per call.

A transfer still in flight after ``xfer_timeout_s`` is cancelled and completed as failed, so no
handle leaks when a peer vanishes silently; ``remove_peer`` drops the peer's agent (NIXL then
refuses its handles, which fail their transfers). Every NIXL exception becomes a
``TransportError`` or a failed completion; nothing raises out of the poller.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from kvfsm.transport.base import (
    BatchHandler,
    Handler,
    Inbound,
    MemoryRegion,
    Region,
    Segment,
    SegmentArray,
    TransportError,
    Write,
    as_region,
    check_segments,
)

log = logging.getLogger("kvfsm.transport.nixl")

MAGIC = b"KVFSMNX1"
DESCRIPTOR_VERSION = 1
MAX_HEADER = 64 << 10
MAX_METADATA = 16 << 20
REGIONS: tuple[Region, ...] = ("kv", "aux")
_LOCAL = "NIXL_INIT_AGENT"
BATCH_MAGIC = b"\x00KVB"  # a protocol notification starts with "{" (JSON) or 0xB1, never NUL
MAX_BATCH = 64  # writes folded into one transfer at most
MAX_BATCH_BYTES = 64 << 20  # bytes per folded transfer at most (bounds the first write's delay)
HOST_TO_HOST = ("DRAM", "DRAM")
KICK_BYTES = 8 << 20  # host-memory writes: the GIL goes to the posting thread at least this often (see _post)
KICK_EVERY = 8  # ... and the poller lets it in between this many items it hands over (see _hand_over)
SCAN_AHEAD = 4  # in-flight transfers still in progress after which a round stops checking
CALLER_SCAN_AHEAD = 1  # ... and after which a posting caller stops (see _post_locked)
FULL_SCAN_S = 0.01  # every in-flight transfer is checked at least this often
MAX_DEFER_S = 0.002  # the longest the poller stands back for posts before it takes its turn
CALLER_POSTS = ("auto", "always", "never")
POLLER_SCHED = ("auto", "batch", "normal")  # the poller thread's Linux scheduling policy (see _schedule_poller)
PREPPED_MIN_RUNS = 16  # runs in a write from which block indices into the prepared lists may pay (use_prepped)
SMALL_HOST_BYTES = 4096  # auto: host-to-host writes up to this size are posted by the caller too
FLUSH_JOBS = 64  # writes the caller holds back, at most, while a transfer is in flight (see _post_now)
FLUSH_BYTES = 32 << 20  # ... and bytes (16 MiB before session 23: see docs/transports.md)
HOLD_BELOW_BYTES = 8 << 20  # ... each smaller than this: a larger one is posted at once (see _post_now)
HOLD_LIMIT = 1  # a caller that finds the poller in a NIXL call holds up to this many times flush_jobs
BIG_WRITE_BYTES = 32 << 20  # ... but a write this big it posts at once (it waits for the agent)
THREAD_POSTS_FROM = 32 << 20  # auto: a lone write this big goes to the posting thread, the link busy (_to_thread)


def use_prepped(segments: int, blocks: int) -> bool:
    """Post from the prepared block lists (block indices) or from exact byte ranges?

    Measured here (CPU, UCX CMA): a transfer made from a prepared list of a long contiguous run
    costs far more to post than the same bytes as one range (1,024 adjacent 4 KiB blocks: 6.2 ms
    from a strided prepared list, 0.5 ms as one range), while for many short runs the prepared
    list saves building descriptor lists per transfer. So: prepared lists for many short runs only.
    """
    return segments >= PREPPED_MIN_RUNS and blocks <= 4 * segments


def load_nixl() -> tuple[Any, Any, tuple[type[BaseException], ...]]:
    """(nixl_agent, nixl_agent_config, NIXL's exception classes) from whichever wheel is installed.
    Raises ImportError with the reason when none is."""
    errors: list[str] = []
    for mod in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            api = __import__(f"{mod}._api", fromlist=["nixl_agent"])
            bindings = __import__(f"{mod}._bindings", fromlist=["nixlNotFoundError"])
        except Exception as exc:  # noqa: BLE001 - a broken wheel is as absent as a missing one
            errors.append(f"{mod}: {exc}")
            continue
        excs = tuple(
            v for k, v in vars(bindings).items() if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type)
        )
        return api.nixl_agent, api.nixl_agent_config, excs
    raise ImportError("no NIXL Python package is importable (" + "; ".join(errors) + ")")


def nixl_available() -> str | None:
    """None if NIXL can be used here, else why not."""
    try:
        load_nixl()
    except ImportError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    addr: int
    nbytes: int
    device: int
    mem: str
    block: int


@dataclass(slots=True)
class _Peer:
    name: str
    regions: dict[str, RemoteRegion]
    prepped: dict[str, Any] = field(default_factory=dict)  # region -> remote prepped dlist handle
    fingerprint: bytes = b""


class _Route(NamedTuple):
    """Where a one-run write to one peer's region goes (``NixlDataPlane._routes``)."""

    laddr: int  # our region: address, bytes, device
    lsize: int
    ldev: int
    raddr: int  # the peer's region: address, bytes, device
    rsize: int
    rdev: int
    mems: tuple[str, str]  # memory kinds: ours, the peer's


@dataclass(slots=True)
class _Xfer:
    tags: list[object]  # one per write folded into this transfer, in posting order
    peer: str
    op: str
    posted: float
    nbytes: int


@dataclass(slots=True)
class _Job:
    """A validated write or read waiting for the posting thread."""

    op: str
    peer: str
    note: bytes
    tag: object
    total: int
    mems: tuple[str, str]  # local and remote memory kinds
    lrows: Sequence[tuple[int, int, int]]  # exact byte ranges (addr, len, dev); empty: notification only
    rrows: Sequence[tuple[int, int, int]]
    prepped: tuple[np.ndarray, np.ndarray] | None = None  # (local, remote) block indices into the prepared lists
    region: str = ""  # the region written or read ("kv", "aux"): merge_rows never joins two


def pack_notifications(notes: Sequence[bytes]) -> bytes:
    """Several writes' notifications as one NIXL notification (they ride one transfer)."""
    parts = [BATCH_MAGIC, struct.pack("<I", len(notes))]
    for n in notes:
        parts += [struct.pack("<I", len(n)), n]
    return b"".join(parts)


def unpack_notifications(data: bytes) -> list[bytes]:
    """The notifications in ``data``: a batch is split, anything else is one notification (a
    malformed batch too: the runtime counts it as malformed)."""
    if not data.startswith(BATCH_MAGIC):
        return [data]
    try:
        (count,) = struct.unpack_from("<I", data, len(BATCH_MAGIC))
        pos, out = len(BATCH_MAGIC) + 4, []
        for _ in range(count):
            (n,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if pos + n > len(data):
                return [data]
            out.append(data[pos : pos + n])
            pos += n
    except struct.error:
        return [data]
    return out if pos == len(data) and count <= MAX_BATCH else [data]


def encode_descriptor(agent: str, regions: dict[str, RemoteRegion], metadata: bytes) -> bytes:
    header = json.dumps(
        {
            "v": DESCRIPTOR_VERSION,
            "agent": agent,
            "regions": {
                k: {"addr": r.addr, "len": r.nbytes, "dev": r.device, "mem": r.mem, "block": r.block}
                for k, r in regions.items()
            },
        },
        separators=(",", ":"),
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + metadata


def decode_descriptor(data: bytes) -> tuple[str, dict[str, RemoteRegion], bytes]:
    """Parse and validate a peer's descriptor. Raises TransportError on anything unexpected."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TransportError("descriptor must be bytes")
    data = bytes(data)
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise TransportError("not a kvfsm NIXL descriptor (bad magic)")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER or start + hlen > len(data):
        raise TransportError(f"descriptor header length {hlen} out of bounds")
    metadata = data[start + hlen :]
    if not metadata or len(metadata) > MAX_METADATA:
        raise TransportError(f"descriptor carries {len(metadata)} bytes of agent metadata")
    try:
        header = json.loads(data[start : start + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(f"descriptor header is not JSON: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"v", "agent", "regions"}:
        raise TransportError("descriptor header must have exactly v, agent, regions")
    if header["v"] != DESCRIPTOR_VERSION or type(header["v"]) is not int:
        raise TransportError(f"descriptor version {header['v']!r} is not supported (want {DESCRIPTOR_VERSION})")
    agent = header["agent"]
    if not isinstance(agent, str) or not agent or len(agent) > 256:
        raise TransportError("descriptor agent name must be a non-empty string")
    raw = header["regions"]
    if not isinstance(raw, dict) or set(raw) != set(REGIONS):
        raise TransportError(f"descriptor regions must be exactly {list(REGIONS)}")
    regions: dict[str, RemoteRegion] = {}
    for name, r in raw.items():
        if not isinstance(r, dict) or set(r) != {"addr", "len", "dev", "mem", "block"}:
            raise TransportError(f"descriptor region {name!r} must have addr, len, dev, mem, block")
        ints = [r[k] for k in ("addr", "len", "dev", "block")]
        if any(type(v) is not int or v < 0 or v >= 1 << 64 for v in ints):
            raise TransportError(f"descriptor region {name!r}: addr, len, dev, block must be unsigned 64-bit ints")
        if r["mem"] not in ("DRAM", "VRAM"):
            raise TransportError(f"descriptor region {name!r}: memory kind {r['mem']!r} is not DRAM or VRAM")
        if r["block"] and r["len"] % r["block"]:
            raise TransportError(f"descriptor region {name!r}: {r['len']} bytes are not whole {r['block']}-byte blocks")
        regions[name] = RemoteRegion(r["addr"], r["len"], r["dev"], r["mem"], r["block"])
    return agent, regions, metadata


def _fold_key(job: _Job) -> tuple[Any, ...]:
    """What jobs must share to be folded into one transfer (``fold``)."""
    return (job.op, job.peer, job.mems, None if job.prepped is None else job.region)


def fold(jobs: Sequence[_Job]) -> list[list[_Job]]:
    """Group queued jobs into transfers. Jobs with the same key (op, peer, memory kinds, and the
    prepared region for block-index jobs or exact byte ranges otherwise) share a transfer, while
    it holds at most ``MAX_BATCH`` jobs and ``MAX_BATCH_BYTES``, whether they were queued next to
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
        key = _fold_key(job)
        entry = open_.get(key)
        if entry is not None and len(entry[0]) < MAX_BATCH and entry[1][0] + job.total <= MAX_BATCH_BYTES:
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
    into that one: one descriptor instead of two (NIXL's post costs per descriptor: ~4 µs on the
    H200 pair's GPUs). A room's consecutive chunks are often adjacent in both KV caches, and
    folding puts them into one transfer when they are handed over faster than they move. The
    first pair of a run keeps its place; the bytes each descriptor covers are the same, so the
    data moved are the same (a transfer's descriptors have no order). ~0.2 µs per row here.
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


class NixlDataPlane:
    """A ``DataPlane`` on one NIXL agent (see the module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        backend_params: dict[str, str] | None = None,
        progress_thread: bool = False,
        idle_poll_s: float = 0.0005,
        quiet_poll_s: float = 0.1,
        busy_poll_s: float = 0.0002,
        tail_poll_s: float = 0.00002,
        hot_window_s: float = 0.05,
        xfer_timeout_s: float = 60.0,
        telemetry: bool = False,
        caller_posts: str = "auto",
        flush_jobs: int = FLUSH_JOBS,
        flush_bytes: int = FLUSH_BYTES,
        hold_below: int = HOLD_BELOW_BYTES,
        thread_posts_from: int = THREAD_POSTS_FROM,
        poller_sched: str = "auto",
        scan_ahead: int = SCAN_AHEAD,
    ) -> None:
        if caller_posts not in CALLER_POSTS:
            raise ValueError(f"caller_posts must be one of {CALLER_POSTS}, not {caller_posts!r}")
        if poller_sched not in POLLER_SCHED:
            raise ValueError(f"poller_sched must be one of {POLLER_SCHED}, not {poller_sched!r}")
        self.poller_sched = poller_sched
        agent_cls, config_cls, self._nixl_errors = load_nixl()
        self.name = name
        self.caller_posts = caller_posts
        self.flush_jobs = max(1, int(flush_jobs))
        self.flush_bytes = max(1, int(flush_bytes))
        self.hold_below = int(hold_below)
        self.thread_posts_from = int(thread_posts_from)
        self.idle_poll_s = idle_poll_s
        self.quiet_poll_s = quiet_poll_s
        self._expecting = True  # a peer may write into us (expect_traffic): poll every idle_poll_s
        self.busy_poll_s = busy_poll_s
        self.tail_poll_s = tail_poll_s
        self.hot_window_s = hot_window_s
        self.xfer_timeout_s = xfer_timeout_s
        self.scan_ahead = max(1, int(scan_ahead))
        config = config_cls(enable_prog_thread=progress_thread, backends=[], capture_telemetry=telemetry)
        startup_errors: tuple[type[BaseException], ...] = (RuntimeError, *self._nixl_errors)
        self._post_errors: tuple[type[BaseException], ...] = (TransportError, *self._nixl_errors)
        try:
            self.agent = agent_cls(name, config)
            self.agent.create_backend("UCX", dict(backend_params or {}))
        except startup_errors as exc:
            raise TransportError(f"cannot create NIXL agent {name!r} with a UCX backend: {exc!r}") from exc
        self._lock = threading.Lock()
        self._handler: Handler | None = None
        self._batch_handler: BatchHandler | None = None
        self._local: dict[str, MemoryRegion] = {}
        self._blocks: dict[str, int] = {}
        self._reg: list[Any] = []
        self._prepped: dict[str, Any] = {}
        self._peers: dict[str, _Peer] = {}
        # (peer, region) -> _Route of a peer whose descriptor and our memory are both known: what
        # a one-run write needs, in one lookup (``_job``); kept in step with both under the lock
        self._routes: dict[tuple[str, str], _Route] = {}
        self._removed: set[str] = set()
        self._inflight: dict[Any, _Xfer] = {}
        self._ready: list[Inbound] = []  # completions owed without a transfer (empty writes)
        self._wake = threading.Event()
        self._closed = False
        self._posting = 0  # posts waiting for or holding the agent (read by the poller without a lock)
        self._posting_lock = threading.Lock()
        # The guard of a posting caller's completion checks (it holds the agent's lock already):
        # a lock only that caller takes, so never contended, and cheaper than a nullcontext.
        self._no_guard = threading.Lock()
        self.stats: dict[str, int] = {
            "writes": 0,
            "reads": 0,
            "bytes_posted": 0,
            "descriptors": 0,
            "completed": 0,
            "failed": 0,
            "notifications": 0,
            "timeouts": 0,
            "transfers": 0,  # NIXL transfers posted (several writes may share one)
            "post_ns": 0,  # time spent inside NIXL's post (on CPU memory UCX copies the bytes there)
        }
        self._jobs: deque[_Job] = deque()
        self._queued = threading.Condition()
        self._queued_bytes = 0  # bytes of the queued jobs
        self._poster_idle = False  # the posting thread waits for jobs
        self._unkicked = 0  # bytes queued since a writer last handed the GIL over
        self._host_post = False  # the posting thread's latest transfer copies host to host (in the post)
        self._copying = False  # ... and it is posting that transfer now (see flush)
        self._held: list[_Job] = []  # writes their callers hold back to post together (see _post_now)
        self._held_bytes = 0
        self._held_lock = threading.Lock()
        self._handed = 0  # writes and reads handed over (write_many: once), counted by _post
        self._flushed = -1  # _handed at the owner's last flush(): while equal, the owner waits (see flush)
        self._checked_at = 0.0  # when a posting caller last checked the in-flight transfers (see _poll_loop)
        # flush() wakes a poller sleeping between rounds by releasing this lock, which the poller's
        # sleep tries to take (a bare lock: an Event's wait costs the poller more Python per round)
        self._hurry = threading.Lock()
        self._hurry.acquire()
        self._poller = threading.Thread(target=self._poll_loop, name=f"nixl-{name}", daemon=True)
        self._poster = threading.Thread(target=self._post_loop, name=f"nixl-{name}-post", daemon=True)
        self._poller.start()
        self._poster.start()
        if poller_sched == "batch":
            self._schedule_poller()

    # ------------------------------------------------------------------ ports

    def set_handler(self, handler: Handler) -> None:
        self._handler = handler

    def set_batch_handler(self, batch: BatchHandler) -> None:
        """Hand each poll round's items over in one call (see ``BatchHandler``), the writes that
        one transfer completed as one "completions" item (in slices of KICK_EVERY while the
        posting thread copies host memory: see ``_hand_over``)."""
        self._batch_handler = batch

    def expect_traffic(self, on: bool) -> None:
        """The owner's hint (see ``kvfsm.transport.base``): with no peer expected to write into us
        and nothing of ours in flight, the poller waits up to ``quiet_poll_s`` instead of
        ``idle_poll_s`` (each timed wake-up costs CPU and takes the GIL from the engine). Turned
        on, it wakes the poller, so that it polls often again before the first write arrives."""
        self._expecting = bool(on)
        if on:
            self._wake.set()

    def flush(self) -> None:
        """The owner's hint (see ``kvfsm.transport.base``) that it hands nothing more over for
        now and waits for its writes: the writes held back (``_post_now``) are posted at once,
        and until a write is handed over again the poller checks the in-flight transfers every
        ``tail_poll_s`` rather than every ``busy_poll_s`` (slower as the wait lasts), since no
        posting caller completes them meanwhile nor needs the GIL."""
        with self._held_lock:
            self._flushed = self._handed
            jobs = None
            # While the posting thread copies host memory (the whole copy, inside the post) the
            # writes stay held: it posts them itself when that post ends (``_submit``), before
            # its next one. The owner does not wait out the copy for the agent: Manager.wait
            # flushes first, and a wait(rooms, timeout=0) would otherwise block for the copy
            # (12 ms per 64 MiB chunk on a 2-vCPU VM).
            if self._held and self._lock.acquire(blocking=not self._copying):
                jobs = self._take_held()
        if jobs:
            self._post_locked(jobs)
        self._hurry_poller()

    def _hurry_poller(self) -> None:
        """End the poller's sleep between rounds now (or its next one, if it is not asleep)."""
        try:
            self._hurry.release()
        except RuntimeError:  # released already: the poller's next sleep ends at once
            pass

    def register_memory(self, kv: Any, aux: Any, *, kv_block: int = 0, aux_block: int = 0) -> None:
        regions = {"kv": as_region(kv), "aux": as_region(aux)}
        blocks = {"kv": kv_block, "aux": aux_block}
        with self._lock:
            if self._local:
                raise TransportError(f"{self.name}: memory is already registered")
            for key, r in regions.items():
                if not r.nbytes:
                    continue
                try:
                    self._reg.append(self.agent.register_memory([(r.addr, r.nbytes, r.device, "")], r.mem))
                except self._nixl_errors as exc:
                    raise TransportError(f"{self.name}: cannot register {key} ({r.nbytes} B {r.mem}): {exc!r}") from exc
                blk = blocks[key]
                if blk > 0 and r.nbytes % blk == 0:
                    rows = np.array([[r.addr, blk, r.device, blk, r.nbytes // blk]], dtype=np.uint64)
                    self._prepped[key] = self.agent.prep_xfer_dlist(_LOCAL, rows, r.mem)
                    self._blocks[key] = blk
            self._local = regions
            for p in self._peers.values():
                self._add_routes(p)
        kv = regions.get("kv")
        if self.poller_sched == "auto" and kv is not None and kv.nbytes and kv.mem == "DRAM":
            self._schedule_poller()  # KV in host memory: CPUs copy it

    def descriptor(self) -> bytes:
        with self._lock:
            if not self._local:
                raise TransportError(f"{self.name}: register memory before describing it")
            regions = {
                k: RemoteRegion(r.addr, r.nbytes, r.device, r.mem, self._blocks.get(k, 0))
                for k, r in self._local.items()
            }
            return encode_descriptor(self.name, regions, bytes(self.agent.get_agent_metadata()))

    def add_peer(self, peer: str, descriptor: bytes) -> None:
        agent, regions, metadata = decode_descriptor(descriptor)
        if agent != peer:
            raise TransportError(f"descriptor of agent {agent!r} offered by peer {peer!r}")
        if peer == self.name:
            raise TransportError(f"peer {peer!r} has our own name")
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.name}: closed")
            old = self._peers.get(peer)
            if old is not None:
                if old.fingerprint == descriptor:
                    return  # the same peer said hello again
                self._drop_peer(old)
            try:
                loaded = self.agent.add_remote_agent(metadata)
            except self._nixl_errors as exc:
                raise TransportError(f"NIXL refused the agent metadata of {peer!r}: {exc!r}") from exc
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            p = _Peer(peer, dict(regions), fingerprint=bytes(descriptor))
            if loaded != peer:
                self._peers[loaded] = p  # so that _drop_peer removes what NIXL loaded
                p.name = loaded
                self._drop_peer(p)
                raise TransportError(f"peer {peer!r} sent the agent metadata of {loaded!r}")
            for key, r in regions.items():
                if r.block and r.nbytes:
                    rows = np.array([[r.addr, r.block, r.device, r.block, r.nbytes // r.block]], dtype=np.uint64)
                    try:
                        p.prepped[key] = self.agent.prep_xfer_dlist(peer, rows, r.mem)
                    except self._nixl_errors as exc:
                        self._peers[peer] = p
                        self._drop_peer(p)
                        raise TransportError(f"cannot prepare {peer!r}'s {key} region: {exc!r}") from exc
            self._peers[peer] = p
            self._removed.discard(peer)
            self._add_routes(p)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            p = self._peers.get(peer)
            if p is not None:
                self._drop_peer(p)
            self._removed.add(peer)

    def write(self, peer: str, region: Region, segments: Sequence[Segment], notification: bytes, tag: object) -> int:
        return self._post(self._job("WRITE", peer, region, segments, notification, tag))

    def write_run(
        self, peer: str, region: Region, src: int, dst: int, length: int, notification: bytes, tag: object
    ) -> int:
        """``write`` of one segment (``DataPlane``'s optional ``write_run``): to a peer whose
        route is known, within both regions, described without a segment list; anything else
        goes through ``write`` (and its checks and errors). The engine's leanest path: the write
        described as ``_run_job`` describes it and handed on as ``_post`` hands it, inline."""
        route = self._routes.get((peer, region))
        if route is None or not (length > 0 and 0 <= src <= route[1] - length and 0 <= dst <= route[4] - length):
            return self.write(peer, region, [Segment(src, dst, length)], notification, tag)
        laddr, _, ldev, raddr, _, rdev, mems = route
        lrow, rrow = ((laddr + src, length, ldev),), ((raddr + dst, length, rdev),)
        job = _Job("WRITE", peer, notification, tag, length, mems, lrow, rrow, None, region)
        self._handed += 1  # (as _post)
        if (
            (length <= SMALL_HOST_BYTES or (mems != HOST_TO_HOST and not self._to_thread(length)))
            if self.caller_posts == "auto"
            else self._caller_posts(job)
        ):
            self._post_now(job)
        else:
            self._queue([job])
        return length

    def read(self, peer: str, region: Region, segments: Sequence[Segment], notification: bytes, tag: object) -> int:
        return self._post(self._job("READ", peer, region, segments, notification, tag))

    def write_many(self, writes: Sequence[Write]) -> list[int | Exception]:
        """Several writes at once (``DataPlane.write_many``): each is validated as ``write``
        validates it (a refused one gets its exception in the result, nothing of it moves, the
        others go on); the rest are queued for the posting thread in one go, and those the caller
        posts are held as ``write`` holds them (a transfer in flight, each write smaller than
        ``hold_below``, the held writes below ``flush_jobs`` and ``flush_bytes``) or else posted
        now, folded, in one turn on the agent. A caller that finds the agent busy holds writes
        below ``hold_below`` rather than wait, as ``write`` does (see ``_post_now``), up to
        ``HOLD_LIMIT`` x ``flush_jobs``; a batch with a larger write it holds only while a post is
        under way (the posting thread copying host memory, say, which takes as long as the copy):
        they are posted when that post ends."""
        self._handed += 1
        out: list[int | Exception] = []
        mine: list[_Job] = []
        queued: list[_Job] = []
        largest = mine_bytes = 0
        caller_posts = self._caller_posts
        routes = self._routes
        auto = self.caller_posts == "auto"
        for peer, region, segments, note, tag in writes:
            job = posts = None
            if len(segments) == 1:  # the usual write, described as _run_job describes it (inline)
                s = segments[0]
                route = routes.get((peer, region))
                n = s.length
                if route is not None and n > 0 and 0 <= s.src <= route[1] - n and 0 <= s.dst <= route[4] - n:
                    laddr, _, ldev, raddr, _, rdev, mems = route
                    lrow, rrow = ((laddr + s.src, n, ldev),), ((raddr + s.dst, n, rdev),)
                    job = _Job("WRITE", peer, note, tag, n, mems, lrow, rrow, None, region)
                    if auto:  # (as _caller_posts decides it for a one-run write)
                        posts = mems != HOST_TO_HOST or n <= SMALL_HOST_BYTES
            if job is None:
                try:
                    job = self._job("WRITE", peer, region, segments, note, tag)
                except Exception as exc:  # noqa: BLE001 - as write() would raise it, for this write alone
                    out.append(exc)
                    continue
            total = job.total
            out.append(total)
            if caller_posts(job) if posts is None else posts:
                mine.append(job)
                mine_bytes += total
                if total > largest:
                    largest = total
            else:
                queued.append(job)
        if queued:
            self._queue(queued)
        if mine:
            with self._held_lock:
                self._held += mine
                self._held_bytes += mine_bytes
                if self._nagle_holds(len(self._held), largest):
                    return out  # held as write() holds them: the poller's round posts them
                # The agent busy, writes below hold_below stay held as write() holds them (the
                # poller's round posts them: on the H200 pair, send_many() of 1 MiB chunks, 0.98-1.53
                # of raw NIXL against 0.66-1.17 waiting, in five pairs). A batch with a larger write
                # is held only while a post is under way (on host memory it lasts the whole copy):
                # a poller's status check ends soon, and until the waiter takes the lock the poller,
                # back from NIXL, waits for the GIL with the agent's lock in hand, so holding would
                # leave it unposted until the engine's hand-over ends (64 MiB chunks: ~2 ms of idle
                # link per repetition, 0.75 of raw NIXL against 0.84-0.99 waiting).
                big = largest >= self.hold_below and not self._posting
                wait = big or len(self._held) >= HOLD_LIMIT * self.flush_jobs
                if not self._lock.acquire(blocking=wait):
                    return out
                jobs = self._take_held()
            self._post_locked(jobs)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._routes.clear()
        self._wake.set()
        self._hurry_poller()  # a poller asleep between busy rounds (busy_poll_s) ends its sleep too
        with self._queued:
            self._queued.notify_all()
        self._poster.join(timeout=10)
        self._poller.join(timeout=10)
        with self._lock:
            for h in list(self._inflight):
                self._release(h)
            self._inflight.clear()
            for p in list(self._peers.values()):
                self._drop_peer(p)
            for h in self._prepped.values():
                self._quietly(self.agent.release_dlist_handle, h)
            self._prepped.clear()
            for reg in self._reg:
                self._quietly(self.agent.deregister_memory, reg)
            self._reg.clear()

    # ------------------------------------------------------------------ posting

    def _job(self, op: str, peer: str, region: Region, segments: Sequence[Segment], note: bytes, tag: object) -> _Job:
        """Validate a write or read (raises TransportError before anything moves) and describe it."""
        if op == "WRITE" and len(segments) == 1:  # the usual write: one run, to a known peer
            s = segments[0]
            job = self._run_job(peer, region, s.src, s.dst, s.length, note, tag)
            if job is not None:
                return job
        if region not in REGIONS:
            raise TransportError(f"unknown region {region!r}: 'kv' or 'aux'")
        if self._closed:
            raise TransportError(f"{op.lower()} {self.name}->{peer}: data plane is closed")
        p = self._peers.get(peer)
        if p is None:
            gone = "was removed (lost)" if peer in self._removed else "is unknown (no descriptor)"
            raise TransportError(f"{op.lower()} {self.name}->{peer} {region}: peer {gone}")
        local = self._local.get(region)
        remote = p.regions[region]
        if local is None:
            raise TransportError(f"{op.lower()} {self.name}->{peer}: no local {region} region registered")
        # src is always the side the bytes come from: local for WRITE, remote for READ.
        src_len, dst_len = (local.nbytes, remote.nbytes) if op == "WRITE" else (remote.nbytes, local.nbytes)
        try:
            total = check_segments(segments, src_len, dst_len, "")
        except TransportError as exc:  # (the message is built only for a refused write)
            raise TransportError(f"{op.lower()} {self.name}->{peer} {region}{exc}") from None
        if op == "READ" and local.readonly:
            raise TransportError(f"{op.lower()} {self.name}->{peer}: our {region} region is read-only")
        segs: Sequence[Segment]
        segs = segments.nonempty() if type(segments) is SegmentArray else [s for s in segments if s.length]
        lrows: list[tuple[int, int, int]] = []
        rrows: list[tuple[int, int, int]] = []
        job = _Job(op, peer, note, tag, total, (local.mem, remote.mem), lrows, rrows, region=region)
        indices = self._block_indices(op, region, p, segs) if len(segs) else None
        if indices is not None:
            job.prepped = indices
        elif type(segs) is SegmentArray:  # the rows built from the arrays, no Segment per run
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

    def _run_job(self, peer: str, region: str, src: int, dst: int, n: int, note: bytes, tag: object) -> _Job | None:
        """The usual write described (one run of ``n`` > 0 bytes, within both regions, to a peer
        whose route is known), else None: ``_job`` checks and describes it in full."""
        route = self._routes.get((peer, region))
        if route is None:
            return None
        laddr, lsize, ldev, raddr, rsize, rdev, mems = route
        if n > 0 and 0 <= src <= lsize - n and 0 <= dst <= rsize - n:
            return _Job(
                "WRITE", peer, note, tag, n, mems, ((laddr + src, n, ldev),), ((raddr + dst, n, rdev),), region=region
            )
        return None

    def _post(self, job: _Job) -> int:
        """Post a validated write or read, or queue it for the posting thread; returns its bytes."""
        self._handed += 1  # (unlocked: a lost increment still changes it, which is all flush needs)
        if self._caller_posts(job) and not self._to_thread(job.total):
            self._post_now(job)
        else:
            self._queue([job])
        return job.total

    def _to_thread(self, total: int) -> bool:
        """In "auto" mode, does a lone write of ``total`` bytes that the caller would post
        (``write``, ``write_run``) go to the posting thread instead? Yes from ``thread_posts_from``
        bytes while a transfer is in flight or queued: NIXL's calls to post it (~40 µs of CPU for a
        64 MiB write on the H200 pair, twice that in the host's slow phases) then overlap the
        engine's Python, since each drops the GIL, and the link, busy, hides the hand-off. With
        nothing in flight the caller posts it at once: the link waits for no hand-off (256 MiB
        chunks posted by the thread even then: 0.95-0.99 of raw NIXL against 0.99-1.01). Not
        from 16 MiB: such a chunk crosses NVLink in ~45 µs, less than the thread's turn (0.83-0.92
        against 1.11-1.27). A ``write_many`` batch's writes the caller posts in one turn."""
        return total >= self.thread_posts_from and self.caller_posts == "auto" and bool(self._inflight or self._jobs)

    def _queue(self, jobs: list[_Job]) -> None:
        """Queue jobs for the posting thread."""
        with self._queued:
            self._jobs += jobs
            for job in jobs:
                self._queued_bytes += job.total
                self._unkicked += job.total
            kick = (
                self._poster_idle
                or (self._unkicked >= KICK_BYTES and jobs[-1].mems == HOST_TO_HOST)
                or len(self._jobs) >= MAX_BATCH
                or self._queued_bytes >= MAX_BATCH_BYTES
                # (not at each write of thread_posts_from or more: two 32 MiB writes then fold
                # into one transfer; handing the GIL over at each, 32 MiB chunks with send()
                # reached 0.82-0.90 of raw NIXL on the H200 pair against 0.94-1.13)
            )
            if kick:
                self._unkicked = 0
            if self._poster_idle:  # a busy posting thread looks at the queue before it waits again
                self._queued.notify()
        if kick:
            # Hand the GIL to the posting thread now rather than when the interpreter's switch
            # interval (5 ms) takes it from a caller still busy handing over chunks: the first
            # write of a burst starts moving at once and a full batch goes as soon as it is full.
            # Between host memories UCX copies inside the post, so the posting thread is the
            # copy engine: back from a post (which drops the GIL) it waits for the GIL while at
            # most KICK_BYTES are queued, not 5 ms. Small writes copy in microseconds: for them
            # a hand-off costs more than it saves, and so it does on GPUs, whose copies are
            # asynchronous (measured there: 0.52x raw at 1 MiB without, 0.38x with one every
            # 8 writes, 0.26x every 2).
            time.sleep(0)

    def _caller_posts(self, job: _Job) -> bool:
        """Does the caller post this write itself (``_post_now``) rather than the posting thread?"""
        if self.caller_posts != "auto":
            return self.caller_posts == "always"
        if job.prepped is not None:
            # Many short runs: UCX spends ~3 µs of CPU per descriptor inside the post, GPU or
            # not, with the GIL dropped; on the posting thread that overlaps the engine's work
            # (H200 pair, 256 writes of 256 scattered 4 KiB pages: 323 ms posted by the thread,
            # 495 ms by the caller, in two runs where raw NIXL took 213 and 211 ms).
            return False
        return job.mems != HOST_TO_HOST or job.total <= SMALL_HOST_BYTES

    def _post_now(self, job: _Job) -> None:
        """The caller posts (see the module docstring for when and why), Nagle-style: at once
        when no transfer is in flight, otherwise a write smaller than ``hold_below`` is held
        until ``flush_jobs`` writes or ``flush_bytes`` are held, and the held writes go as one
        folded transfer; meanwhile the poller's round posts them, its NIXL calls (which drop the
        GIL) overlapping the caller's Python (on the H200 pair, 1 MiB chunks with ``send()``:
        22-26 µs of the engine's CPU per chunk against 27-37 in three paired runs, when this hold
        grew from 16 writes and 8 MiB to 64 and 16 MiB). A larger write goes at once: holding it
        saves little CPU per byte and leaves the link idle until the round (16 MiB chunks held:
        11.2 ms per repetition in one run, raw NIXL 8.4), with the held writes that fold into
        its transfer (the others stay held). Nor does the
        caller wait while the poller is inside a NIXL call: the writes stay held and the poller
        posts them when its round ends (or a later write does), unless ``HOLD_LIMIT`` times
        ``flush_jobs`` are held or the write is ``BIG_WRITE_BYTES`` or more (holding it would
        only delay a long copy)."""
        with self._held_lock:
            self._held.append(job)
            self._held_bytes += job.total
            held = len(self._held)
            if self._nagle_holds(held, job.total):
                return
            wait = job.total >= BIG_WRITE_BYTES or held >= HOLD_LIMIT * self.flush_jobs
            if not self._lock.acquire(blocking=wait):
                return
            jobs = self._take_held()
            if 1 < held < self.flush_jobs and job.total >= self.hold_below:
                # A large write goes at once with the held writes it folds with; those that
                # would make transfers of their own (a room's aux slot in host memory beside its
                # KV in VRAM, another peer) stay held for the poller's round: the caller posts
                # one transfer, not two (on the H200 pair, rooms of one 64 MiB chunk with
                # send(): the engine's CPU per chunk 132-140 µs against 153-229, 1.07-1.08 of
                # raw NIXL against 0.75-1.03, three pairs).
                key = _fold_key(job)
                apart = [j for j in jobs if _fold_key(j) != key]
                if apart:
                    jobs = [j for j in jobs if _fold_key(j) == key]
                    self._held = apart
                    self._held_bytes = sum(j.total for j in apart)
        self._post_locked(jobs)

    def _post_locked(self, jobs: list[_Job]) -> None:
        """The caller posts ``jobs`` (the agent's lock taken, released here), completes the
        transfers it finds done and hands those completions over."""
        done: list[Inbound] = []
        try:
            for group in fold(jobs):
                self._submit_locked(group)
            # The caller also completes what it finds done (the oldest transfers, up to the first
            # still in progress): a busy caller holds the runtime's lock and the GIL most of the
            # time, so the poller would otherwise hand completions over in bursts, late (the
            # runtime queues what arrives while it steps a room and applies it after the step).
            # Only up to the first in progress: transfers end roughly in order, and on a GPU a
            # check of one in progress costs the engine ~25 µs for 64 MiB (H200 pair, 64 MiB
            # chunks with send(): scanning on to the fourth, 0.71, 1.12 and 0.84 of raw NIXL,
            # the engine's CPU per chunk 130-225 µs; stopping at the first, 1.08-1.11 and 114-124
            # µs; three pairs). The poller's rounds scan further (SCAN_AHEAD, and everything
            # every FULL_SCAN_S).
            self._completions(list(self._inflight.items()), done, False, self._no_guard, CALLER_SCAN_AHEAD)
            self._take_ready(done)
            self._checked_at = time.monotonic()
        finally:
            self._lock.release()
            self._kick_poller()
        if done:
            self._hand_over(done)

    def _nagle_holds(self, held: int, largest: int) -> bool:
        """Do the ``held`` writes (``_held_bytes`` in all, the largest just added ``largest``
        bytes) stay held, Nagle-style (``_post_now``)? (Under ``_held_lock``.)"""
        return bool(
            self._inflight
            and held < self.flush_jobs
            and self._held_bytes < self.flush_bytes
            and largest < self.hold_below
        )

    def _kick_poller(self) -> None:
        """Wake the poller (a transfer is in flight now). Set already, the event is left alone:
        ``Event.set`` takes its condition's lock and notifies, even when it changes nothing."""
        if not self._wake.is_set():
            self._wake.set()

    def _take_held(self) -> list[_Job]:
        jobs, self._held, self._held_bytes = self._held, [], 0
        return jobs

    def _flush_held(self) -> None:
        """Post what callers held back (the poller, once per round)."""
        if not self._held:
            return
        with self._held_lock:
            jobs = self._take_held()
        for group in fold(jobs):
            self._submit(group)

    def _block_indices(
        self, op: str, region: str, p: _Peer, segs: Sequence[Segment]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Block indices of both sides if every segment is block-aligned on both, else None
        (a SegmentArray's computed on its arrays, a long scattered chunk having a segment per
        page; a list's in Python)."""
        if len(segs) < PREPPED_MIN_RUNS:  # (use_prepped's first test, before summing lengths)
            return None
        lblk = self._blocks.get(region, 0)
        rblk = p.regions[region].block
        if not lblk or lblk != rblk or region not in p.prepped:
            return None
        if type(segs) is not SegmentArray:  # a list (fewer than COALESCE_ARRAY_MIN pages): numpy costs more
            return self._list_block_indices(op, lblk, segs)
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
        return (np.repeat(lfirst, counts) + within).astype(np.int32), (np.repeat(rfirst, counts) + within).astype(
            np.int32
        )

    @staticmethod
    def _list_block_indices(op: str, lblk: int, segs: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray] | None:
        """``_block_indices`` of a list of segments, in Python: for a few dozen segments ~4x
        cheaper than numpy's calls (16 segments: 2.9 µs against 11 µs here)."""
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

    def _post_loop(self) -> None:
        """The posting thread: takes every queued job and posts them, folded (``fold``) into as
        few transfers as the limits allow: fewer, larger transfers when the runtime hands over
        chunks faster than they are copied."""
        while True:
            with self._queued:
                while not self._jobs and not self._closed:
                    self._poster_idle = True
                    self._queued.wait()
                self._poster_idle = False
                if self._closed:
                    return
                jobs = list(self._jobs)
                self._jobs.clear()
                self._queued_bytes = 0
            for group in fold(jobs):
                self._host_post = self._copying = group[0].mems == HOST_TO_HOST
                try:
                    self._submit(group, drain=self._copying)
                finally:
                    self._copying = False

    def _submit(self, group: list[_Job], drain: bool = False) -> None:
        """Post one transfer for ``group`` (one job, or several folded ones); a failure completes
        every job in it as failed. ``drain`` (the posting thread, after a host copy): then post
        what callers held back meanwhile too, the agent's lock still in hand (see ``flush``)."""
        with self._posting_lock:
            self._posting += 1  # the poller stands back while a post waits (see _poll_loop)
        try:
            with self._lock:
                self._submit_locked(group)
                if drain and self._held and self._held_lock.acquire(blocking=False):
                    # (not blocking: a caller holding _held_lock may wait for _lock, see flush)
                    try:
                        held = self._take_held()
                    finally:
                        self._held_lock.release()
                    for g in fold(held):
                        self._submit_locked(g)
        finally:
            with self._posting_lock:
                self._posting -= 1
            self._kick_poller()

    def _submit_locked(self, group: list[_Job]) -> None:
        """``_submit`` with the lock held."""
        if self._closed:
            return
        first = group[0]
        one = len(group) == 1
        tags = [first.tag] if one else [j.tag for j in group]
        note = first.note if one else pack_notifications([j.note for j in group])
        try:
            if first.prepped is None and not first.lrows:
                self.agent.send_notif(first.peer, note)  # nothing to move
                self._ready.append(Inbound("completion", first.peer, tag=first.tag))
                return
            if first.prepped is not None:
                region = first.region
                peer = self._peers.get(first.peer)
                if peer is None or region not in peer.prepped:
                    raise TransportError(f"{first.peer} was removed")
                if len(group) == 1:
                    lidx, ridx = first.prepped
                else:
                    lidx = np.concatenate([j.prepped[0] for j in group])  # type: ignore[index]
                    ridx = np.concatenate([j.prepped[1] for j in group])  # type: ignore[index]
                handle = self.agent.make_prepped_xfer(
                    first.op, self._prepped[region], lidx, peer.prepped[region], ridx, note
                )
                ndesc = len(lidx)
            else:
                if one:
                    lrows, rrows = list(first.lrows), list(first.rrows)
                else:
                    lrows = [r for j in group for r in j.lrows]
                    rrows = [r for j in group for r in j.rrows]
                if len(lrows) > 1 and all(j.region == first.region for j in group):
                    # (not across regions: two registrations, however adjacent in memory, are
                    # two to NIXL, and a descriptor spanning both fails the whole transfer)
                    lrows, rrows = merge_rows(lrows, rrows)
                ldescs = self.agent.get_xfer_descs(lrows, first.mems[0])
                rdescs = self.agent.get_xfer_descs(rrows, first.mems[1])
                if ldescs is None or rdescs is None:  # NIXL logs and returns None on bad input
                    raise TransportError("NIXL rejected the descriptor list")
                handle = self.agent.initialize_xfer(first.op, ldescs, rdescs, first.peer, note)
                ndesc = len(lrows)
            t_post = time.perf_counter()
            state = self.agent.transfer(handle)
            self.stats["post_ns"] += int((time.perf_counter() - t_post) * 1e9)
            if state not in ("DONE", "PROC"):
                self._release(handle)
                raise TransportError(f"transfer state {state!r}")
        except self._post_errors as exc:
            reason = f"{first.op.lower()} {self.name}->{first.peer} not posted: {exc!r}"
            self.stats["failed"] += len(group)
            self._ready += [Inbound("completion", first.peer, tag=t, ok=False, reason=reason) for t in tags]
            return
        total = first.total if one else sum(j.total for j in group)
        self._inflight[handle] = _Xfer(tags, first.peer, first.op, time.monotonic(), total)
        self.stats["writes" if first.op == "WRITE" else "reads"] += len(group)
        self.stats["transfers"] += 1
        self.stats["bytes_posted"] += total
        self.stats["descriptors"] += ndesc

    # ------------------------------------------------------------------ progress

    def _poll_loop(self) -> None:
        idle_since = last_round = time.monotonic()
        full_scan = 0.0
        tail_since: float | None = None  # the owner waits (flush): since the last completion seen
        while True:
            items: list[Inbound] = []
            if self._closed:
                return
            now = time.monotonic()
            if self._posting and now - last_round < MAX_DEFER_S:
                # a post waits for the agent or is inside it (on host memory: copying): let it
                # go first, woken when it ends rather than every busy_poll_s (a wake-up costs
                # ~30 µs of CPU on a VM, which a long copy would pay every 200 µs)
                self._wake.wait(MAX_DEFER_S - (now - last_round))
                self._wake.clear()
                continue
            last_round = now
            try:
                # a full scan of the in-flight transfers now and then (timeouts, out-of-order
                # completions); otherwise only the oldest ones: transfers complete roughly in order
                full = now >= full_scan
                if full:
                    full_scan = now + FULL_SCAN_S
                # While the owner hands writes over and a posting caller checked the transfers
                # within busy_poll_s, it completes them at its next post: the round leaves them
                # alone (on a GPU a check of a transfer in progress costs CPU, ~25 µs for a 64 MiB
                # one on the H200 pair, and slows the caller's own NIXL calls meanwhile); it still
                # posts what callers held and collects notifications.
                checks = full or self._handed == self._flushed or now - self._checked_at >= self.busy_poll_s
                self._progress(items, full, checks)
                self._flush_held()  # what callers held back, also while this round had the agent
            except Exception:  # noqa: BLE001 - the poller must survive anything
                log.exception("%s: NIXL progress failed", self.name)
            busy = bool(self._inflight)
            self._hand_over(items)
            if items:
                idle_since = now
            if busy:
                if self._handed != self._flushed or self._jobs or self._posting:
                    # the owner hands writes over: a posting caller completes transfers itself
                    # and a round takes the GIL from it, so poll every busy_poll_s; so too while
                    # the posting thread has work (host copies: each transfer is done when its
                    # post returns, and a round would only take a CPU from the copy)
                    tail_since = None
                    interval = self.busy_poll_s
                else:
                    # the owner waits for these transfers (flush): poll every tail_poll_s at
                    # first, slower as the wait lasts (an eighth of it since the last
                    # completion seen, up to busy_poll_s)
                    if tail_since is None or items:
                        tail_since = now
                    interval = min(self.busy_poll_s, max(self.tail_poll_s, (now - tail_since) / 8))
            elif now - idle_since < self.hot_window_s:
                # traffic seen lately: poll often at first, less as the quiet lasts (a notification
                # waits at most an eighth of the quiet so far, up to idle_poll_s)
                interval = min(self.idle_poll_s, max(self.busy_poll_s, (now - idle_since) / 8))
            else:
                self._wake.wait(self.idle_poll_s if self._expecting else self.quiet_poll_s)
                self._wake.clear()
                continue
            # Rounds start every interval: after a long hand-over (the runtime stepping a burst
            # of completions or notifications) the next round is due at once, since UCX was not
            # progressed meanwhile (a peer's write into us completes only when we progress).
            pause = interval - (time.monotonic() - now)
            if pause > 0:
                self._hurry.acquire(True, pause)  # (taken by a flush's release or not: locked again)

    def _schedule_poller(self) -> None:
        """Put the poller thread under Linux's SCHED_BATCH, as the kernel's documentation puts
        it "mildly disfavored in scheduling decisions" at wake-up: it does not preempt the thread
        running where it wakes, but takes a CPU that is free or waits for the running thread's
        slice to end.
        ``poller_sched="auto"`` (the default) does it once KV is registered in host memory, where
        CPUs move the bytes: UCX copies inside a post, the writer's posting thread on one side,
        and the poller's timed wake-ups (every ``idle_poll_s`` on a decode rank expecting writes)
        preempted that copy (64 MiB copies on this 2-vCPU machine took up to 17 ms instead of 12,
        interrupted ~25 times each; worst kvfsm / raw NIXL from 1 MiB up, three pairs of runs:
        0.847-0.920 with ``send()`` and 0.896-0.941 with ``send_many()`` as before, 0.936-0.982
        and 0.928-0.959 so). With KV in device memory the copy engines move the bytes and the
        poller's prompt rounds take completions off the engine's thread: there it stays as it is
        (on the H200 pair, under SCHED_BATCH the engine's CPU per 64 MiB chunk with
        ``send_many()`` rose from 93-94 to 144-165 µs, three pairs). ``"batch"`` and ``"normal"``
        force either. The policy is the poller's own: the engine's threads and the posting thread
        keep theirs. It needs no privilege; where it cannot be taken (not Linux, a sandbox) the
        poller runs as it is."""
        tid = self._poller.native_id
        if not hasattr(os, "SCHED_BATCH") or tid is None:
            return
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except OSError as exc:
            log.debug("%s: the poller keeps its scheduling policy: %r", self.name, exc)

    def _hand_over(self, items: list[Inbound]) -> None:
        """Give a round's items to the handler: in one call if a batch handler is set, in slices
        of KICK_EVERY while the posting thread copies host memory (it gets the GIL in between)."""
        handler, batch = self._handler, self._batch_handler
        step = KICK_EVERY if self._host_post else len(items)
        for start in range(0, len(items), max(step, 1)):
            part = items[start : start + step]
            if start and not self._poster_idle:
                time.sleep(0)  # let the posting thread (copying host memory) back in between
            if batch is not None:
                try:
                    batch(part)
                except Exception:  # noqa: BLE001 - a handler's bug must not stop progress
                    log.exception("%s: batch handler raised on %d items", self.name, len(part))
                continue
            for item in part:
                if handler is None:
                    return
                try:
                    handler(item)
                except Exception:  # noqa: BLE001 - a handler's bug must not stop progress
                    log.exception("%s: handler raised on %s", self.name, item.kind)

    def _progress(self, items: list[Inbound], full: bool, checks: bool = True) -> None:
        """One round of progress: the in-flight transfers (the oldest few, or all if ``full``;
        none unless ``checks``) and the notifications (in a full round only while no peer is
        expected to write into us: see ``expect_traffic``). The lock is taken per agent call,
        not for the round, so that a post can go between two status checks."""
        with self._lock:
            self._take_ready(items)
            pending = list(self._inflight.items()) if checks else []
        self._completions(pending, items, full, self._lock)
        if not (full or self._expecting):
            return
        with self._lock:
            if self._closed:
                return
            try:
                notifs = self.agent.get_new_notifs()
            except self._nixl_errors as exc:
                log.warning("%s: get_new_notifs failed: %r", self.name, exc)
                return
        for peer, msgs in notifs.items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            for m in msgs:
                for note in unpack_notifications(bytes(m)):
                    self.stats["notifications"] += 1
                    items.append(Inbound("notification", peer, data=note))

    def _completions(
        self, pending: list[tuple[Any, _Xfer]], items: list[Inbound], full: bool, guard: Any, ahead: int = 0
    ) -> None:
        """Check ``pending`` transfers in order (under ``guard`` per check) until ``ahead`` (by
        default ``scan_ahead``) are still in progress (all if ``full``); completions of the
        finished ones go to ``items``."""
        now = time.monotonic()
        still = 0
        ahead = ahead or self.scan_ahead
        for handle, x in pending:
            with guard:  # (the counters too: the poller and a posting caller both complete)
                state, reason = self._check(handle, x, now)
                if state not in ("PROC", "GONE"):
                    self.stats["completed" if state == "DONE" else "failed"] += len(x.tags)
            if state == "PROC":
                still += 1
                if not full and still >= ahead:
                    break
            elif state == "DONE":
                peer = x.peer
                if self._batch_handler is None:
                    items += [Inbound("completion", peer, b"", t) for t in x.tags]
                elif not self._host_post:
                    items.append(Inbound("completions", peer, b"", tuple(x.tags)))
                else:  # at most KICK_EVERY writes an item (_hand_over lets the posting thread in every KICK_EVERY items)
                    tags = x.tags
                    items += [
                        Inbound("completions", peer, b"", tuple(tags[i : i + KICK_EVERY]))
                        for i in range(0, len(tags), KICK_EVERY)
                    ]
            elif state != "GONE":
                why = reason or f"state {state}"
                items += [Inbound("completion", x.peer, tag=t, ok=False, reason=why) for t in x.tags]

    # ------------------------------------------------------------------ helpers (lock held)

    def _take_ready(self, items: list[Inbound]) -> None:
        """Move the completions owed without a transfer (empty or refused writes) to ``items``."""
        if self._ready:
            items += self._ready
            self._ready.clear()

    def _check(self, handle: Any, x: _Xfer, now: float) -> tuple[str, str]:
        """(state, reason) of one in-flight transfer: "GONE" if another round took it already;
        a finished or timed-out one leaves ``_inflight`` and is released."""
        if self._closed or handle not in self._inflight:
            return "GONE", ""
        try:
            state, reason = self.agent.check_xfer_state(handle), ""
        except self._nixl_errors as exc:
            state, reason = "ERR", f"{type(exc).__name__}: {exc}"
        if state == "PROC" and now - x.posted > self.xfer_timeout_s:
            state, reason = "ERR", f"no completion within {self.xfer_timeout_s}s"
            self.stats["timeouts"] += 1
        if state != "PROC":
            del self._inflight[handle]
            self._release(handle)
        return state, reason

    def _release(self, handle: Any) -> None:
        self._quietly(self.agent.release_xfer_handle, handle)

    def _add_routes(self, p: _Peer) -> None:
        """Routes to ``p``'s regions (see ``_routes``), once our memory is registered."""
        for key, local in self._local.items():
            remote = p.regions.get(key)
            if remote is not None and local.nbytes and remote.nbytes:
                route = _Route(
                    local.addr,
                    local.nbytes,
                    local.device,
                    remote.addr,
                    remote.nbytes,
                    remote.device,
                    (local.mem, remote.mem),
                )
                self._routes[(p.name, key)] = route

    def _drop_peer(self, p: _Peer) -> None:
        for key in REGIONS:
            self._routes.pop((p.name, key), None)
        for h in p.prepped.values():
            self._quietly(self.agent.release_dlist_handle, h)
        p.prepped.clear()
        self._quietly(self.agent.remove_remote_agent, p.name)
        self._peers.pop(p.name, None)

    def _quietly(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except self._nixl_errors as exc:
            log.debug("%s: %s%r: %r", self.name, getattr(fn, "__name__", fn), args, exc)
