"""``NixlDataPlane``: the data plane on one NIXL agent (UCX backend), DRAM on CPU and VRAM on GPU.

Theory of operation
-------------------
One ``NixlDataPlane`` owns one NIXL agent named like its endpoint, one poller thread and one
posting thread. It is assembled from one part per responsibility, each in its own module and all
sharing one object (``state``):

* ``peers``: memory registration, our descriptor (wire format in ``descriptors``), peers added
  and removed, and a write validated and described against them (``plan``);
* ``posting``: who posts a write (the caller or the posting thread), Nagle-style holding of
  caller-posted writes, folding into few transfers (``plan.fold``, notifications packed by
  ``notes``), and the post itself;
* ``poller``: progress, completions, notifications, timeouts, hand-over to the runtime.

A write (or read) is validated (bounds, peer, region) in the caller's thread and raises
``TransportError`` before anything moves; every NIXL exception afterwards becomes a failed
completion; nothing raises out of the threads. Settings: ``NixlConfig``.
"""

from __future__ import annotations

import threading
from collections import deque

from kvfsm.transport.base import BatchHandler, Handler, TransportError
from kvfsm.transport.nixl.agent import load_nixl
from kvfsm.transport.nixl.config import NixlConfig
from kvfsm.transport.nixl.peers import _Peers
from kvfsm.transport.nixl.poller import _Poller
from kvfsm.transport.nixl.posting import _Posting


class NixlDataPlane(_Peers, _Posting, _Poller):
    """A ``DataPlane`` on one NIXL agent (see the module docstring); ``config`` its settings."""

    def __init__(self, name: str, *, config: NixlConfig | None = None) -> None:
        cfg = NixlConfig() if config is None else config
        if not isinstance(cfg, NixlConfig):
            raise TypeError(f"config must be a NixlConfig, not {type(cfg).__name__}")
        agent_cls, config_cls, self._nixl_errors = load_nixl()
        self.name = name
        self.config = cfg
        self._mode = cfg.caller_posts
        self._hold_writes = cfg.hold_writes
        self._hold_bytes = cfg.hold_bytes
        self._hold_below = cfg.hold_below
        self._large_write = cfg.large_write
        self._xfer_timeout_s = cfg.xfer_timeout_s
        # NIXL's progress thread off: it spins a core even when idle; the poller drives the agent
        nixl_cfg = config_cls(enable_prog_thread=False, backends=[])
        startup_errors: tuple[type[BaseException], ...] = (RuntimeError, *self._nixl_errors)
        self._post_errors = (TransportError, *self._nixl_errors)
        try:
            self.agent = agent_cls(name, nixl_cfg)
            self.agent.create_backend("UCX", dict(cfg.backend_params))
        except startup_errors as exc:
            raise TransportError(f"cannot create NIXL agent {name!r} with a UCX backend: {exc!r}") from exc
        self._lock = threading.Lock()
        self._handler: Handler | None = None
        self._batch_handler: BatchHandler | None = None
        self._expecting = True
        self._local = {}
        self._blocks = {}
        self._spread = {}
        self._reg = []
        self._prepped = {}
        self._peers = {}
        self._routes = {}
        self._removed = set()
        self._inflight = {}
        self._ready = []
        self._wake = threading.Event()
        self._closed = False
        self._posting = 0
        self._posting_lock = threading.Lock()
        self._no_guard = threading.Lock()
        self.stats = {
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
        self._jobs = deque()
        self._queued = threading.Condition()
        self._queued_bytes = 0
        self._poster_idle = False
        self._unkicked = 0
        self._host_post = False
        self._copying = False
        self._held = []
        self._held_bytes = 0
        self._held_lock = threading.Lock()
        self._handed = 0
        self._flushed = -1
        self._checked_at = 0.0
        self._hurry = threading.Lock()
        self._hurry.acquire()
        self._poller = threading.Thread(target=self._poll_loop, name=f"nixl-{name}", daemon=True)
        self._poster = threading.Thread(target=self._post_loop, name=f"nixl-{name}-post", daemon=True)
        self._poller.start()
        self._poster.start()
        if cfg.poller_sched == "batch":
            self._schedule_poller()

    # ------------------------------------------------------------------ ports

    def set_handler(self, handler: Handler) -> None:
        self._handler = handler

    def set_batch_handler(self, batch: BatchHandler) -> None:
        """Hand each poll round's items over in one call (see ``BatchHandler``), the writes that
        one transfer completed as one "completions" item (in slices while the posting thread
        copies host memory: see ``_hand_over``)."""
        self._batch_handler = batch

    def expect_traffic(self, on: bool) -> None:
        """The owner's hint (see ``kvfsm.transport.base``): with no peer expected to write into us
        and nothing of ours in flight, the poller waits up to ``quiet_poll_s`` instead of
        ``idle_poll_s`` (each timed wake-up costs CPU and takes the GIL from the engine). Turned
        on, it wakes the poller, so that it polls often again before the first write arrives."""
        self._expecting = bool(on)
        if on:
            self._wake.set()

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
