"""Progress: the poller thread, which completes transfers and collects notifications.

NIXL's own progress thread spins a core even when idle, so it is off and one poller thread per
data plane drives the agent: it checks the in-flight transfers (the oldest few each round, all
of them every ``_FULL_SCAN_S``), turns DONE or an error into "completion" items (for a batch
handler, the writes a transfer completed into one "completions" item), collects notifications
(which also progresses UCX for peers writing into us: their writes complete only once we did)
and hands everything to the handler. It polls every ``busy_poll_s`` while transfers are in
flight; after traffic, within ``hot_window_s``, every eighth of the quiet so far (from
``busy_poll_s`` up to ``idle_poll_s``); else it waits up to ``idle_poll_s`` (a post wakes it), or
up to ``quiet_poll_s`` while the owner says no peer is expected to write into us
(``expect_traffic(False)``: a prefill rank in push mode, a decode rank with no room); its rounds
then collect notifications only with each full scan (a prefill rank's poller otherwise called
``get_new_notifs`` ~50 times per 256 chunks for nothing, ~10 µs each on an H200 host). When the
owner waits for its writes (``flush``) the held writes are posted at once and, until the next
write, the poller checks the in-flight transfers every ``tail_poll_s`` (an eighth of the wait
since the last completion, up to ``busy_poll_s``): nobody else completes them then, and no
engine thread needs the GIL. While a post waits for the agent or is inside it, the poller stands
back (up to ``_MAX_DEFER_S``), woken when the post ends: a timed wake-up costs tens of µs of CPU
on a VM. The poller runs under Linux's SCHED_BATCH (``poller_sched``) when KV is in host memory
(see ``_schedule_poller``). One lock guards every call into the agent, taken per call.

A transfer still in flight after ``xfer_timeout_s`` is cancelled and completed as failed, so no
handle leaks when a peer vanishes silently. Every NIXL exception becomes a failed completion or
a log line; nothing raises out of the poller.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvfsm.transport.base import Inbound
from kvfsm.transport.nixl.notes import unpack_notifications
from kvfsm.transport.nixl.plan import _Xfer
from kvfsm.transport.nixl.state import _PlaneState, log

_SCAN_AHEAD = 4  # in-flight transfers still in progress after which a round stops checking
_FULL_SCAN_S = 0.01  # every in-flight transfer is checked at least this often
_MAX_DEFER_S = 0.002  # the longest the poller stands back for posts before it takes its turn
_KICK_EVERY = 8  # host copies: the poller lets the posting thread in between this many items (see _hand_over)


class _Poller(_PlaneState):
    """The poller thread of a ``NixlDataPlane``."""

    def _poll_loop(self) -> None:
        cfg = self.config
        busy_poll_s = cfg.busy_poll_s
        idle_since = last_round = time.monotonic()
        full_scan = 0.0
        tail_since: float | None = None  # the owner waits (flush): since the last completion seen
        while True:
            items: list[Inbound] = []
            if self._closed:
                return
            now = time.monotonic()
            if self._posting and now - last_round < _MAX_DEFER_S:
                # a post waits for the agent or is inside it (on host memory: copying): let it
                # go first, woken when it ends rather than every busy_poll_s (a wake-up costs
                # ~30 µs of CPU on a VM, which a long copy would pay every 200 µs)
                self._wake.wait(_MAX_DEFER_S - (now - last_round))
                self._wake.clear()
                continue
            last_round = now
            try:
                # a full scan of the in-flight transfers now and then (timeouts, out-of-order
                # completions); otherwise only the oldest ones: transfers complete roughly in order
                full = now >= full_scan
                if full:
                    full_scan = now + _FULL_SCAN_S
                # While the owner hands writes over and a posting caller checked the transfers
                # within busy_poll_s, it completes them at its next post: the round leaves them
                # alone (on a GPU a check of a transfer in progress costs CPU, ~25 µs for a 64 MiB
                # one on an H200 host, and slows the caller's own NIXL calls meanwhile); it still
                # posts what callers held and collects notifications.
                checks = full or self._handed == self._flushed or now - self._checked_at >= busy_poll_s
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
                    interval = busy_poll_s
                else:
                    # the owner waits for these transfers (flush): poll every tail_poll_s at
                    # first, slower as the wait lasts (an eighth of it since the last
                    # completion seen, up to busy_poll_s)
                    if tail_since is None or items:
                        tail_since = now
                    interval = min(busy_poll_s, max(cfg.tail_poll_s, (now - tail_since) / 8))
            elif now - idle_since < cfg.hot_window_s:
                # traffic seen lately: poll often at first, less as the quiet lasts (a notification
                # waits at most an eighth of the quiet so far, up to idle_poll_s)
                interval = min(cfg.idle_poll_s, max(busy_poll_s, (now - idle_since) / 8))
            else:
                self._wake.wait(cfg.idle_poll_s if self._expecting else cfg.quiet_poll_s)
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
        preempted that copy (64 MiB copies on a 2-vCPU VM took up to 17 ms instead of 12,
        interrupted ~25 times each; worst kvfsm / raw NIXL from 1 MiB up, three pairs of runs:
        0.847-0.920 with ``send()`` and 0.896-0.941 with ``send_many()`` as before, 0.936-0.982
        and 0.928-0.959 so). With KV in device memory the copy engines move the bytes and the
        poller's prompt rounds take completions off the engine's thread: there it stays as it is
        (between two H200 GPUs, under SCHED_BATCH the engine's CPU per 64 MiB chunk with
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
        of _KICK_EVERY while the posting thread copies host memory (it gets the GIL in between)."""
        handler, batch = self._handler, self._batch_handler
        step = _KICK_EVERY if self._host_post else len(items)
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
        default ``_SCAN_AHEAD``) are still in progress (all if ``full``); completions of the
        finished ones go to ``items``."""
        now = time.monotonic()
        still = 0
        ahead = ahead or _SCAN_AHEAD
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
                else:  # at most _KICK_EVERY writes an item (_hand_over lets the posting thread in every _KICK_EVERY items)
                    tags = x.tags
                    items += [
                        Inbound("completions", peer, b"", tuple(tags[i : i + _KICK_EVERY]))
                        for i in range(0, len(tags), _KICK_EVERY)
                    ]
            elif state != "GONE":
                why = reason or f"state {state}"
                items += [Inbound("completion", x.peer, tag=t, ok=False, reason=why) for t in x.tags]

    def _check(self, handle: Any, x: _Xfer, now: float) -> tuple[str, str]:
        """(state, reason) of one in-flight transfer: "GONE" if another round took it already;
        a finished or timed-out one leaves ``_inflight`` and is released."""
        if self._closed or handle not in self._inflight:
            return "GONE", ""
        try:
            state, reason = self.agent.check_xfer_state(handle), ""
        except self._nixl_errors as exc:
            state, reason = "ERR", f"{type(exc).__name__}: {exc}"
        if state == "PROC" and now > x.expires:
            state, reason = "ERR", f"no completion within {x.expires - x.posted:.3f}s (cancelled)"
            self.stats["timeouts"] += 1
        if state != "PROC":
            del self._inflight[handle]
            self._release(handle)
        return state, reason
