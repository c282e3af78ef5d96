"""``SplitEndpoint`` passes the data plane's optional hints on (``expect_traffic``, ``flush``,
``set_batch_handler``) to a data plane that offers them and leaves one without them alone."""

from __future__ import annotations

from typing import Any

from kvfsm.transport.base import SplitEndpoint


class _Control:
    name = "p0"

    def set_handler(self, handler: Any) -> None:
        self.handler = handler


class _BareData:
    """A data plane with only the required port (no optional hints)."""

    name = "p0"

    def set_handler(self, handler: Any) -> None:
        self.handler = handler


class _HintedData(_BareData):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def expect_traffic(self, on: bool) -> None:
        self.calls.append(("expect_traffic", on))

    def flush(self) -> None:
        self.calls.append(("flush", None))

    def set_batch_handler(self, batch: Any) -> None:
        self.calls.append(("set_batch_handler", batch))


def test_the_optional_hints_reach_a_data_plane_that_offers_them() -> None:
    data = _HintedData()
    ep = SplitEndpoint(_Control(), data)  # type: ignore[arg-type]
    ep.expect_traffic(False)
    ep.flush()
    ep.set_batch_handler(print)
    ep.flush()
    assert data.calls == [("expect_traffic", False), ("flush", None), ("set_batch_handler", print), ("flush", None)]


def test_a_data_plane_without_the_hints_is_left_alone() -> None:
    ep = SplitEndpoint(_Control(), _BareData())  # type: ignore[arg-type]
    ep.expect_traffic(True)
    ep.flush()
    ep.set_batch_handler(print)  # none of them raises
