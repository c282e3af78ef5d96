"""The state every part of a ``NixlDataPlane`` shares, declared once.

``NixlDataPlane`` is assembled from one class per responsibility (``peers``, ``posting``,
``poller``), each a mixin over this base: they share one object, so the hot path pays no extra
indirection. The attributes are created in ``NixlDataPlane.__init__``; this class only declares
them (and, for the type checker, the methods one part calls on another).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from kvfsm.transport.base import BatchHandler, Handler, Inbound, MemoryRegion

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvfsm.transport.base import Region, Segment
    from kvfsm.transport.nixl.config import NixlConfig
    from kvfsm.transport.nixl.peers import _Peer
    from kvfsm.transport.nixl.plan import Spread, _Job, _Route, _Xfer

log = logging.getLogger("kvfsm.transport.nixl")


class _PlaneState:
    name: str
    config: NixlConfig
    agent: Any
    _nixl_errors: tuple[type[BaseException], ...]
    _post_errors: tuple[type[BaseException], ...]  # NIXL's and TransportError: a post that fails its writes
    # settings read on the hot path, copied from the config (one attribute lookup, not two)
    _mode: str  # config.caller_posts
    _hold_writes: int
    _hold_bytes: int
    _hold_below: int
    _large_write: int
    _xfer_timeout_s: float
    # the agent, its memory and its peers (``peers``)
    _lock: threading.Lock  # guards every call into the agent (its default sync mode takes none)
    _local: dict[str, MemoryRegion]
    _blocks: dict[str, int]  # region -> block size of its prepared local list
    _spread: dict[str, Spread]  # region -> its buffers, for a region of several (absent: one)
    _reg: list[Any]
    _prepped: dict[str, Any]  # region -> local prepared dlist handle
    _peers: dict[str, _Peer]
    # (peer, region) -> _Route of a peer whose descriptor and our memory are both known: what a
    # one-run write needs, in one lookup (``run_job``); kept in step with both under the lock
    _routes: dict[tuple[str, str], _Route]
    _removed: set[str]
    _closed: bool
    # posting (``posting``)
    _inflight: dict[Any, _Xfer]
    _ready: list[Inbound]  # completions owed without a transfer (empty or refused writes)
    _posting: int  # posts waiting for or holding the agent (read by the poller without a lock)
    _posting_lock: threading.Lock
    # The guard of a posting caller's completion checks (it holds the agent's lock already): a
    # lock only that caller takes, so never contended, and cheaper than a nullcontext.
    _no_guard: threading.Lock
    _jobs: deque[_Job]  # queued for the posting thread
    _queued: threading.Condition
    _queued_bytes: int  # bytes of the queued jobs
    _poster_idle: bool  # the posting thread waits for jobs
    _unkicked: int  # bytes queued since a writer last handed the GIL over
    _host_post: bool  # the posting thread's latest transfer copies host to host (in the post)
    _copying: bool  # ... and it is posting that transfer now (see flush)
    _held: list[_Job]  # writes their callers hold back to post together (see _post_now)
    _held_bytes: int
    _held_lock: threading.Lock
    _handed: int  # writes and reads handed over (write_many: once), counted by _post
    _flushed: int  # _handed at the owner's last flush(): while equal, the owner waits (see flush)
    _checked_at: float  # when a posting caller last checked the in-flight transfers (see _poll_loop)
    # the poller (``poller``)
    _handler: Handler | None
    _batch_handler: BatchHandler | None
    _expecting: bool  # a peer may write into us (expect_traffic): poll every idle_poll_s
    _wake: threading.Event
    # flush() wakes a poller sleeping between rounds by releasing this lock, which the poller's
    # sleep tries to take (a bare lock: an Event's wait costs the poller more Python per round)
    _hurry: threading.Lock
    _poller: threading.Thread
    _poster: threading.Thread
    stats: dict[str, int]

    if TYPE_CHECKING:  # what one part calls on another

        def _schedule_poller(self) -> None: ...
        def _completions(
            self, pending: list[tuple[Any, _Xfer]], items: list[Inbound], full: bool, guard: Any, ahead: int = 0
        ) -> None: ...
        def _hand_over(self, items: list[Inbound]) -> None: ...
        def _flush_held(self) -> None: ...
        def _job(
            self, op: str, peer: str, region: Region, segments: Sequence[Segment], note: bytes, tag: object
        ) -> _Job: ...

    def _take_ready(self, items: list[Inbound]) -> None:
        """Move the completions owed without a transfer (empty or refused writes) to ``items``."""
        if self._ready:
            items += self._ready
            self._ready.clear()

    def _kick_poller(self) -> None:
        """Wake the poller (a transfer is in flight now). Set already, the event is left alone:
        ``Event.set`` takes its condition's lock and notifies, even when it changes nothing."""
        if not self._wake.is_set():
            self._wake.set()

    def _hurry_poller(self) -> None:
        """End the poller's sleep between rounds now (or its next one, if it is not asleep)."""
        try:
            self._hurry.release()
        except RuntimeError:  # released already: the poller's next sleep ends at once
            pass

    def _release(self, handle: Any) -> None:
        self._quietly(self.agent.release_xfer_handle, handle)

    def _quietly(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except self._nixl_errors as exc:
            log.debug("%s: %s%r: %r", self.name, getattr(fn, "__name__", fn), args, exc)
