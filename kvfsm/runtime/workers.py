"""Transfer worker pool: queues sharded by room (SGLang PR 23967's async transfer).

Every job of one room lands on the same worker, so a room's writes stay ordered and one slow
destination only delays its own shard. A job that raises never kills its worker: the exception
is handed to the job's ``on_error`` (the runtime turns it into a WriteFailed event for that room).
``workers=0`` runs jobs inline in the caller: deterministic, for tests and trace replay.
A job is a function and its arguments, not a closure over them: the runtime submits one per
write, and so builds no closures (nor cells for their variables) on the per-chunk path.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvfsm.runtime")

# (job, its arguments, on_error): job(*args); if it raises, on_error(exc, *args)
Job = tuple[Callable[..., None], tuple[Any, ...], Callable[..., None]]


class WorkerPool:
    def __init__(self, workers: int, name: str = "kvfsm") -> None:
        self.size = workers
        self._queues: list[queue.SimpleQueue[Job | None]] = [queue.SimpleQueue() for _ in range(workers)]
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"{name}-xfer-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        self._idle = threading.Condition()
        self._outstanding = 0
        for t in self._threads:
            t.start()

    def submit(
        self, shard: int, job: Callable[..., None], args: tuple[Any, ...], on_error: Callable[..., None]
    ) -> None:
        """Run ``job(*args)`` on the worker of ``shard`` (inline with workers=0); if it raises,
        ``on_error(exc, *args)`` runs there instead."""
        if not self._queues:  # inline: as _execute, without its call (one per chunk)
            try:
                job(*args)
            except BaseException as exc:  # noqa: BLE001 - as in _execute
                self._failed(exc, args, on_error)
            return
        with self._idle:
            self._outstanding += 1
        self._queues[shard % len(self._queues)].put((job, args, on_error))

    @staticmethod
    def _execute(job: Callable[..., None], args: tuple[Any, ...], on_error: Callable[..., None]) -> None:
        try:
            job(*args)
        except BaseException as exc:  # noqa: BLE001 - a worker must survive anything a job raises
            WorkerPool._failed(exc, args, on_error)

    @staticmethod
    def _failed(exc: BaseException, args: tuple[Any, ...], on_error: Callable[..., None]) -> None:
        try:
            on_error(exc, *args)
        except BaseException:  # noqa: BLE001
            log.exception("error handler of a transfer job raised")

    def _run(self, q: queue.SimpleQueue[Job | None]) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            self._execute(*item)
            with self._idle:
                self._outstanding -= 1
                if not self._outstanding:
                    self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted job finished. Returns False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)

    @property
    def alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)
