"""The harness of the conformance checks: what a factory returns, and a net of planes under test."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvfsm.transport.base import Inbound

P = TypeVar("P")


def _nothing() -> None:
    pass


@dataclass
class Planes(Generic[P]):
    """What a factory returns: one fresh plane per name asked for, on a network of their own.

    ``planes``: name -> plane, each plane's ``name`` being its key. ``settle()``: deliver what is
    queued (an in-process transport pumps its queue; a transport with its own threads needs
    nothing). ``crash(name)``: make ``name`` gone for the others as a dead process would be; by
    default every other data plane ``remove_peer``s it, and a control plane is closed.
    ``cleanup()``: release what the factory made besides the planes (a registry, a server); runs
    after every plane was closed."""

    planes: dict[str, P]
    settle: Callable[[], object] = _nothing
    crash: Callable[[str], object] | None = None
    cleanup: Callable[[], object] = _nothing

    def close(self) -> None:
        """Close every plane, then ``cleanup()``; the first error (if any) is raised after."""
        errors: list[Exception] = []
        for p in self.planes.values():
            try:
                p.close()  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - the other planes still close
                errors.append(exc)
        self.cleanup()
        if errors:
            raise errors[0]


PlanesFactory = Callable[[tuple[str, ...]], Planes[Any]]


class Recorder:
    """A handler per plane that logs every inbound item, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, Inbound]] = []
        self.hooks: list[Callable[[str, Inbound], None]] = []

    def handler(self, name: str) -> Callable[[Inbound], None]:
        def handle(item: Inbound) -> None:
            for hook in self.hooks:
                hook(name, item)
            with self.lock:
                self.items.append((name, item))

        return handle

    def got(self, name: str, kind: str) -> list[Inbound]:
        with self.lock:
            return [ib for dst, ib in self.items if dst == name and ib.kind == kind]


class Net:
    """The planes of one case, their recorder, and waiting with a deadline."""

    def __init__(self, made: Planes[Any], names: tuple[str, ...], timeout: float) -> None:
        self.made = made
        self.planes: dict[str, Any] = made.planes
        self.timeout = timeout
        self.rec = Recorder()
        if set(self.planes) != set(names):
            made.close()
            raise AssertionError(f"the factory made planes {sorted(self.planes)}, not the ones asked for {list(names)}")
        for n, p in self.planes.items():
            if p.name != n:
                made.close()
                raise AssertionError(f"the factory's plane for {n!r} is named {p.name!r}: a plane's name is its key")
            p.set_handler(self.rec.handler(n))

    def settle(self) -> None:
        self.made.settle()

    def wait(self, pred: Callable[[], object], what: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            self.settle()
            if pred():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached within {self.timeout if timeout is None else timeout} s: {what}")
            time.sleep(0.0005)

    def wait_count(self, name: str, kind: str, n: int, what: str) -> None:
        """Wait until ``name`` got ``n`` items of ``kind``."""
        self.wait(lambda: len(self.rec.got(name, kind)) == n, what)

    def quiet(self) -> None:
        """Let anything that should not happen have its chance to happen."""
        time.sleep(0.02)
        self.settle()


N = TypeVar("N", bound=Net)


@contextmanager
def case(
    make: PlanesFactory, label: str, names: tuple[str, ...], timeout: float, kind: Callable[..., N]
) -> Iterator[N]:
    """A fresh net (of ``kind``) for one case, closed after it; an AssertionError names the case."""
    net = kind(make(names), names, timeout)
    try:
        yield net
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from exc
    finally:
        net.made.close()


@contextmanager
def raises(exc_type: type[BaseException], what: str, match: str = "") -> Iterator[list[BaseException]]:
    """Like ``pytest.raises``: the block must raise ``exc_type`` (whose message matches ``match``)."""
    caught: list[BaseException] = []
    try:
        yield caught
    except exc_type as exc:
        if match and not re.search(match, str(exc)):
            raise AssertionError(f"{what}: raised {exc!r}, whose message does not say {match!r}") from exc
        caught.append(exc)
        return
    raise AssertionError(f"{what}: did not raise {exc_type.__name__}")
