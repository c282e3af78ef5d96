"""Conformance checks for a transport: one suite every control plane and data plane must pass.

Theory of operation
-------------------
kvfsm's runtime talks to a transport through two ports (``kvfsm.transport.base``): a
``ControlPlane`` (small messages, peer loss) and a ``DataPlane`` (registered memory, one-sided
writes and reads with notifications and completions). Every implementation must behave alike:
bytes land exactly, a notification is seen only after its data, every posted transfer completes
exactly once, bad input is refused before a byte moves, a peer's descriptor is installed before
its first message, peer loss is told once. The checks here drive an implementation through its
port only and raise ``AssertionError`` saying what went wrong; they need no test framework (trio's
``trio.testing.check_two_way_stream`` is the model).

A check builds its planes with a *factory* that the implementation provides: called with the
names the check wants (``("a", "b", "c")``), it returns a ``Planes`` holding a fresh, unconnected
plane of that name for each, on one network of their own. The check registers memory, installs
handlers, exchanges descriptors (data planes) or attaches descriptors (control planes) itself. A
factory also says how to deliver what is queued (``settle``: an in-process transport pumps, a
threaded one needs nothing), how to lose a peer (``crash``) and what else to release at the end
(``cleanup``). A check calls the factory once per case and closes what it made.

Running it for a third-party transport::

    from kvfsm.testing.conformance import DATA_PLANE_CHECKS, Planes, check_control_plane, check_data_plane

    def my_data_planes(names):
        return Planes({n: MyDataPlane(n) for n in names})

    def my_control_planes(names):
        registry = MyRegistry()
        planes = {n: MyControlPlane(n, registry=registry.address) for n in names}
        return Planes(planes, cleanup=registry.close)

    check_data_plane(my_data_planes)        # every data-plane check in turn
    check_control_plane(my_control_planes)  # every control-plane check in turn

    # or one check at a time, for a report each (pytest, say):
    @pytest.mark.parametrize("check", DATA_PLANE_CHECKS, ids=lambda c: c.__name__)
    def test_my_data_plane(check):
        check(my_data_planes)

kvfsm's own tests run the suite this way for the loopback, ZMQ and NIXL transports
(``tests/transport/test_conformance.py`` has their factories).

An ``Endpoint`` that is both ports in one object (``kvfsm.transport.loopback``) passes both suites
with the same kind of factory; a ``SplitEndpoint`` is checked through its two parts. The optional
data-plane methods (``write_run``, ``write_many``) are checked when the plane has them (a plane
without ``write_many`` is checked through ``base.write_many``'s one-write-at-a-time fallback).
"""

from __future__ import annotations

from kvfsm.testing.conformance.control import CONTROL_PLANE_CHECKS, check_control_plane
from kvfsm.testing.conformance.data import DATA_PLANE_CHECKS, check_data_plane
from kvfsm.testing.conformance.harness import Planes, PlanesFactory

__all__ = [
    "CONTROL_PLANE_CHECKS",
    "DATA_PLANE_CHECKS",
    "Planes",
    "PlanesFactory",
    "check_control_plane",
    "check_data_plane",
]
