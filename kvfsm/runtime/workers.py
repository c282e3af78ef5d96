"""Transfer worker pool: queues sharded by room (SGLang PR 23967's async transfer).

Every job of one room lands on the same worker, so a room's writes stay ordered and one slow
destination only delays its own shard. A job that raises never kills its worker: the exception
is handed to the job's ``on_error`` (the runtime turns it into a WriteFailed event for that room).
``workers=0`` runs jobs inline in the caller: deterministic, for tests and trace replay.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("kvfsm.runtime")

Job = tuple[Callable[[], None], Callable[[BaseException], None]]


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

    def submit(self, shard: int, job: Callable[[], None], on_error: Callable[[BaseException], None]) -> None:
        if not self._queues:
            self._execute(job, on_error)
            return
        with self._idle:
            self._outstanding += 1
        self._queues[shard % len(self._queues)].put((job, on_error))

    @staticmethod
    def _execute(job: Callable[[], None], on_error: Callable[[BaseException], None]) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - a worker must survive anything a job raises
            try:
                on_error(exc)
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
