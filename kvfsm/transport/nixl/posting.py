"""The posting policy: who posts a write, when it is held back, and how a transfer is posted.

A write (or read) is validated and described in the caller's thread (``peers._job``,
``plan.run_job``). Then one decision, ``_caller_posts``, says who posts it (``caller_posts``,
"auto" by default):

* host to host (DRAM both sides): UCX copies inside the post, which takes as long as the copy,
  so the write is queued for the data plane's posting thread, the copy engine;
* many short runs (block indices), wherever they are: UCX spends CPU per descriptor inside the
  post, which the posting thread overlaps with the caller's work;
* otherwise device memory, and host writes of at most ``_SMALL_HOST_BYTES``: the post only
  queues the copy, so the caller posts it itself (``_post_now``), Nagle-style: at once if no
  transfer is in flight, else, if smaller than ``hold_below``, held back until ``hold_writes``
  writes or ``hold_bytes`` are held or the poller's round ends (the poller then posts them, its
  NIXL calls overlapping the caller's Python); a caller that finds the agent busy holds rather
  than waits (up to ``hold_writes``; a ``large_write`` it posts at once), and when it posts it
  also completes the transfers it finds done. Handing each write to a thread costs more than
  posting it: each NIXL call drops the GIL, and the thread that dropped it then waits for the
  busy caller to give it back;
* except a lone write (``write``, ``write_run``) of ``large_write`` bytes or more while a
  transfer is in flight or queued: its post costs NIXL tens of µs of CPU, which the posting
  thread overlaps with the caller's Python, and the busy link hides the hand-off. A
  ``write_many`` batch the caller posts in one turn whatever its sizes.

Writes queued or held together are folded (``plan.fold``) into one transfer whose notification
carries each write's own (``notes.pack_notifications``). A post that NIXL refuses completes its
writes as failed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvfsm.transport.base import Inbound, Region, Segment, TransportError, Write
from kvfsm.transport.nixl.notes import MAX_BATCH, pack_notifications
from kvfsm.transport.nixl.plan import _MAX_BATCH_BYTES, HOST_TO_HOST, _Job, _Xfer, fold, fold_key, merge_rows, run_job
from kvfsm.transport.nixl.state import _PlaneState

_SMALL_HOST_BYTES = 4096  # auto: host-to-host writes up to this size are posted by the caller too
_KICK_BYTES = 8 << 20  # host-memory writes: the GIL goes to the posting thread at least this often (see _queue)
_CALLER_SCAN_AHEAD = 1  # in-flight transfers still in progress after which a posting caller stops checking


class _Posting(_PlaneState):
    """Writes, reads and their posting, for a ``NixlDataPlane``."""

    def write(self, peer: str, region: Region, segments: Sequence[Segment], notification: bytes, tag: object) -> int:
        return self._post(self._job("WRITE", peer, region, segments, notification, tag))

    def read(
        self,
        peer: str,
        region: Region,
        segments: Sequence[Segment],
        notification: bytes,
        tag: object,
        within_s: float | None = None,
    ) -> int:
        job = self._job("READ", peer, region, segments, notification, tag)
        job.within_s = within_s
        return self._post(job)

    def write_run(
        self, peer: str, region: Region, src: int, dst: int, length: int, notification: bytes, tag: object
    ) -> int:
        """``write`` of one segment (``DataPlane``'s optional ``write_run``): to a peer whose
        route is known, within both regions, described without a segment list; anything else
        goes through ``write`` (and its checks and errors). The engine's leanest path: ``_post``
        inline."""
        route = self._routes.get((peer, region))
        job = None if route is None else run_job(route, peer, region, src, dst, length, notification, tag)
        if job is None:
            return self.write(peer, region, [Segment(src, dst, length)], notification, tag)
        self._handed += 1  # (as _post)
        if self._caller_posts(job, True):
            self._post_now(job)
        else:
            self._queue([job])
        return length

    def write_many(self, writes: Sequence[Write]) -> list[int | Exception]:
        """Several writes at once (``DataPlane.write_many``): each is validated as ``write``
        validates it (a refused one gets its exception in the result, nothing of it moves, the
        others go on); the rest are queued for the posting thread in one go, and those the caller
        posts are held as ``write`` holds them (a transfer in flight, each write smaller than
        ``hold_below``, the held writes below ``hold_writes`` and ``hold_bytes``) or else posted
        now, folded, in one turn on the agent. A caller that finds the agent busy holds writes
        below ``hold_below`` rather than wait, as ``write`` does (see ``_post_now``), up to
        ``hold_writes``; a batch with a larger write it holds only while a post is under way (the
        posting thread copying host memory, say, which takes as long as the copy): they are
        posted when that post ends."""
        self._handed += 1
        out: list[int | Exception] = []
        mine: list[_Job] = []
        queued: list[_Job] = []
        largest = mine_bytes = 0
        caller_posts = self._caller_posts
        routes = self._routes
        for peer, region, segments, note, tag in writes:
            job = None
            if len(segments) == 1:  # the usual write: one run, to a known peer
                route = routes.get((peer, region))
                if route is not None:
                    s = segments[0]
                    job = run_job(route, peer, region, s.src, s.dst, s.length, note, tag)
            if job is None:
                try:
                    job = self._job("WRITE", peer, region, segments, note, tag)
                except Exception as exc:  # noqa: BLE001 - as write() would raise it, for this write alone
                    out.append(exc)
                    continue
            total = job.total
            out.append(total)
            if caller_posts(job, False):
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
                # poller's round posts them: on two H200 GPUs, send_many() of 1 MiB chunks reached
                # 0.98-1.53 of raw NIXL so, 0.66-1.17 waiting). A batch with a larger write is
                # held only while a post is under way (on host memory it lasts the whole copy): a
                # poller's status check ends soon, and until the waiter takes the lock the poller,
                # back from NIXL, waits for the GIL with the agent's lock in hand, so holding would
                # leave it unposted until the engine's hand-over ends (64 MiB chunks: ~2 ms of idle
                # link per repetition, 0.75 of raw NIXL against 0.84-0.99 waiting).
                big = largest >= self._hold_below and not self._posting
                wait = big or len(self._held) >= self._hold_writes
                if not self._lock.acquire(blocking=wait):
                    return out
                jobs = self._take_held()
            self._post_locked(jobs)
        return out

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

    # ------------------------------------------------------------------ who posts

    def _caller_posts(self, job: _Job, lone: bool) -> bool:
        """The posting decision: does the caller post ``job`` itself (``_post_now``) rather than
        the posting thread? ``lone``: handed over alone (``write``, ``write_run``, ``read``), not
        in a ``write_many`` batch, whose writes the caller posts in one turn."""
        mode = self._mode
        if mode != "auto":
            return mode == "always"
        if job.prepped is not None:
            # Many short runs: UCX spends ~3 µs of CPU per descriptor inside the post, GPU or
            # not, with the GIL dropped; on the posting thread that overlaps the engine's work
            # (two H200 GPUs, 256 writes of 256 scattered 4 KiB pages: 323 ms posted by the
            # thread, 495 ms by the caller, where raw NIXL took 213 and 211 ms).
            return False
        if job.mems == HOST_TO_HOST:
            return job.total <= _SMALL_HOST_BYTES  # UCX copies inside the post: the thread copies
        # Device memory: the post only queues the copy, so the caller posts it; except a lone
        # large write while a transfer is in flight or queued. NIXL's calls to post it (~40 µs of
        # CPU for 64 MiB on an H200 host, twice that in the host's slow phases) then overlap the
        # engine's Python on the posting thread, since each drops the GIL, and the busy link
        # hides the hand-off. With nothing in flight the caller posts it at once: the link waits
        # for no hand-off (256 MiB chunks posted by the thread even then: 0.95-0.99 of raw NIXL
        # against 0.99-1.01). Not from 16 MiB: such a chunk crosses NVLink in ~45 µs, less than
        # the thread's turn (0.83-0.92 against 1.11-1.27).
        return not (lone and job.total >= self._large_write and (self._inflight or self._jobs))

    def _post(self, job: _Job) -> int:
        """Post a validated write or read, or queue it for the posting thread; returns its bytes."""
        self._handed += 1  # (unlocked: a lost increment still changes it, which is all flush needs)
        if self._caller_posts(job, True):
            self._post_now(job)
        else:
            self._queue([job])
        return job.total

    def _queue(self, jobs: list[_Job]) -> None:
        """Queue jobs for the posting thread."""
        with self._queued:
            self._jobs += jobs
            for job in jobs:
                self._queued_bytes += job.total
                self._unkicked += job.total
            kick = (
                self._poster_idle
                or (self._unkicked >= _KICK_BYTES and jobs[-1].mems == HOST_TO_HOST)
                or len(self._jobs) >= MAX_BATCH
                or self._queued_bytes >= _MAX_BATCH_BYTES
                # (not at each large write: two 32 MiB writes then fold into one transfer;
                # handing the GIL over at each, 32 MiB chunks with send() reached 0.82-0.90 of
                # raw NIXL on two H200 GPUs, against 0.94-1.13)
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
            # most _KICK_BYTES are queued, not 5 ms (2 MiB instead: within noise). Small writes
            # copy in microseconds: for them a hand-off costs more than it saves, and so it does
            # on GPUs, whose copies are asynchronous (measured there: 0.52x raw at 1 MiB without,
            # 0.38x with one every 8 writes, 0.26x every 2).
            time.sleep(0)

    # ------------------------------------------------------------------ the caller posts

    def _post_now(self, job: _Job) -> None:
        """The caller posts (see the module docstring for when and why), Nagle-style: at once
        when no transfer is in flight, otherwise a write smaller than ``hold_below`` is held
        until ``hold_writes`` writes or ``hold_bytes`` are held, and the held writes go as one
        folded transfer; meanwhile the poller's round posts them, its NIXL calls (which drop the
        GIL) overlapping the caller's Python (on two H200 GPUs, 1 MiB chunks with ``send()``:
        22-26 µs of the engine's CPU per chunk against 27-37 holding 16 writes and 8 MiB). A
        larger write goes at once: holding it saves little CPU per byte and leaves the link idle
        until the round (16 MiB chunks held: 11.2 ms per repetition, raw NIXL 8.4), with the held
        writes that fold into its transfer (the others stay held). Nor does the caller wait
        while the poller is inside a NIXL call: the writes stay held and the poller posts them
        when its round ends (or a later write does), unless ``hold_writes`` are held or the write
        is a ``large_write`` (holding it would only delay a long copy)."""
        with self._held_lock:
            self._held.append(job)
            self._held_bytes += job.total
            held = len(self._held)
            if self._nagle_holds(held, job.total):
                return
            wait = job.total >= self._large_write or held >= self._hold_writes
            if not self._lock.acquire(blocking=wait):
                return
            jobs = self._take_held()
            if 1 < held < self._hold_writes and job.total >= self._hold_below:
                # A large write goes at once with the held writes it folds with; those that
                # would make transfers of their own (a room's aux slot in host memory beside its
                # KV in VRAM, another peer) stay held for the poller's round: the caller posts
                # one transfer, not two (on two H200 GPUs, rooms of one 64 MiB chunk with
                # send(): the engine's CPU per chunk 132-140 µs against 153-229, 1.07-1.08 of
                # raw NIXL against 0.75-1.03).
                key = fold_key(job)
                apart = [j for j in jobs if fold_key(j) != key]
                if apart:
                    jobs = [j for j in jobs if fold_key(j) == key]
                    self._held = apart
                    self._held_bytes = sum(j.total for j in apart)
        self._post_locked(jobs)

    def _nagle_holds(self, held: int, largest: int) -> bool:
        """Do the ``held`` writes (``_held_bytes`` in all, the largest just added ``largest``
        bytes) stay held, Nagle-style (``_post_now``)? (Under ``_held_lock``.)"""
        return bool(
            self._inflight
            and held < self._hold_writes
            and self._held_bytes < self._hold_bytes
            and largest < self._hold_below
        )

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
            # check of one in progress costs the engine ~25 µs for 64 MiB (two H200 GPUs, 64 MiB
            # chunks with send(): scanning on to the fourth, 0.71-1.12 of raw NIXL and 130-225 µs
            # of engine CPU per chunk; stopping at the first, 1.08-1.11 and 114-124 µs). The
            # poller's rounds scan further (see ``poller``).
            self._completions(list(self._inflight.items()), done, False, self._no_guard, _CALLER_SCAN_AHEAD)
            self._take_ready(done)
            self._checked_at = time.monotonic()
        finally:
            self._lock.release()
            self._kick_poller()
        if done:
            self._hand_over(done)

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

    # ------------------------------------------------------------------ the posting thread

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

    # ------------------------------------------------------------------ one transfer

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
                if len(lrows) > 1 and first.region and all(j.region == first.region for j in group):
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
        posted = time.monotonic()
        limits = [j.within_s for j in group if j.within_s is not None]
        expires = posted + min([self._xfer_timeout_s, *limits])
        self._inflight[handle] = _Xfer(tags, first.peer, first.op, posted, total, expires)
        self.stats["writes" if first.op == "WRITE" else "reads"] += len(group)
        self.stats["transfers"] += 1
        self.stats["bytes_posted"] += total
        self.stats["descriptors"] += ndesc
