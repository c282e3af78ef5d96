"""The conformance suite (``kvfsm.testing.conformance``) for kvfsm's own transports.

Data planes: loopback, and NIXL twice (writes posted by the data plane's posting thread, and by
the caller, Nagle-style, as for device memory), real agents over UCX on DRAM. Control planes:
loopback, and ZMQ over real sockets on 127.0.0.1 with a bootstrap service. Each transport is a
factory; each check is one test per transport.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvfsm.testing.conformance import CONTROL_PLANE_CHECKS, DATA_PLANE_CHECKS, Planes
from kvfsm.transport.base import Inbound
from kvfsm.transport.loopback import Fabric
from kvfsm.transport.nixl import nixl_available

NIXL_MISSING = nixl_available()


def loopback_data_planes(names: tuple[str, ...]) -> Planes[Any]:
    fabric = Fabric(0)
    return Planes({n: fabric.endpoint(n) for n in names}, settle=fabric.pump, crash=fabric.crash)


def nixl_data_planes(caller_posts: str) -> Callable[[tuple[str, ...]], Planes[Any]]:
    def make(names: tuple[str, ...]) -> Planes[Any]:
        from kvfsm.transport.nixl import NixlConfig, NixlDataPlane

        return Planes({n: NixlDataPlane(n, config=NixlConfig(caller_posts=caller_posts)) for n in names})

    return make


def loopback_control_planes(names: tuple[str, ...]) -> Planes[Any]:
    fabric = Fabric(0)
    planes = {}
    for n in names:
        planes[n] = ep = fabric.endpoint(n)
        ep.register_memory(bytearray(8), bytearray(8))
    return Planes(planes, settle=fabric.pump, crash=fabric.crash)


def zmq_control_planes(names: tuple[str, ...]) -> Planes[Any]:
    from kvfsm.transport.zmq import BootstrapServer, ZmqControlPlane

    server = BootstrapServer()
    # a crash is a close: the process-kill case is in test_zmq.py and the cluster tests
    return Planes({n: ZmqControlPlane(n, bootstrap=server.address) for n in names}, cleanup=server.close)


_no_nixl = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
DATA_PLANES = [
    pytest.param(loopback_data_planes, id="loopback"),
    pytest.param(nixl_data_planes("never"), id="nixl", marks=_no_nixl),
    pytest.param(nixl_data_planes("always"), id="nixl-caller", marks=_no_nixl),
]
CONTROL_PLANES = [
    pytest.param(loopback_control_planes, id="loopback"),
    pytest.param(zmq_control_planes, id="zmq"),
]


def _name(check: Callable[..., None]) -> str:
    return check.__name__.removeprefix("check_")


@pytest.mark.parametrize("check", DATA_PLANE_CHECKS, ids=_name)
@pytest.mark.parametrize("make", DATA_PLANES)
def test_data_plane(make: Callable[[tuple[str, ...]], Planes[Any]], check: Callable[..., None]) -> None:
    check(make)


@pytest.mark.parametrize("check", CONTROL_PLANE_CHECKS, ids=_name)
@pytest.mark.parametrize("make", CONTROL_PLANES)
def test_control_plane(make: Callable[[tuple[str, ...]], Planes[Any]], check: Callable[..., None]) -> None:
    check(make)


def test_a_violation_is_an_assertion_error_naming_the_check_and_case() -> None:
    """A data plane that notifies but never completes fails the suite with a message that says
    which check and case, and what was not reached."""

    def no_completions(names: tuple[str, ...]) -> Planes[Any]:
        made = loopback_data_planes(names)
        for ep in made.planes.values():
            handler_setter = ep.set_handler

            def set_handler(h: Callable[[Inbound], None], setter: Callable[..., None] = handler_setter) -> None:
                def drop_completions(item: Inbound) -> None:
                    if item.kind != "completion":
                        h(item)

                setter(drop_completions)

            ep.set_handler = set_handler
        return made

    with pytest.raises(AssertionError, match=r"read: not reached within 0.2 s: the read's completion"):
        DATA_PLANE_CHECKS[1](no_completions, timeout=0.2)
