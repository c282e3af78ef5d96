"""Events, actions, wire messages and the transport's segments and inbound items built by ``fast_init`` behave as the frozen dataclasses they
are: same signature and defaults, immutable, equal and hashable by value."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import get_type_hints

import pytest

from kvfsm.protocol import actions
from kvfsm.protocol.events import EVENT_CLASSES, Abort, ChunkReady
from kvfsm.protocol.wire import MESSAGE_CLASSES, ChunkWritten
from kvfsm.records import fast_init
from kvfsm.transport.base import Inbound, Segment

RECORDS = [
    *EVENT_CLASSES.values(),
    *MESSAGE_CLASSES.values(),
    *(c for c in vars(actions).values() if isinstance(c, type) and c.__module__ == actions.__name__),
    Segment,
    Inbound,
]


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_every_record_has_the_fast_init_and_the_dataclass_signature(cls: type) -> None:
    assert "__setattr__" not in cls.__init__.__code__.co_names, "not built by fast_init"
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params] == [f.name for f in dataclasses.fields(cls)]
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    assert {p.name: p.default for p in params if p.default is not inspect.Parameter.empty} == defaults
    get_type_hints(cls.__init__)  # annotations resolve in the class's module


def test_a_record_is_immutable_equal_and_hashable_by_value() -> None:
    a, b = ChunkReady((1, 2), True, 3), ChunkReady(pages=(1, 2), is_last=True, aux_slot=3)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert ChunkReady((1, 2), False).aux_slot is None
    assert Abort().reason == "aborted by engine"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.pages = ()  # type: ignore[misc]
    assert dataclasses.replace(a, is_last=False) == ChunkReady((1, 2), False, 3)
    assert repr(ChunkWritten(1, 2, 3, False, 4, 5)).startswith("ChunkWritten(room=1, src=2")
    with pytest.raises(TypeError):
        ChunkReady((1,))  # type: ignore[call-arg]


def test_fast_init_refuses_what_it_cannot_build() -> None:
    @dataclass(slots=True)
    class Mutable:
        x: int

    @dataclass(frozen=True, slots=True)
    class Factory:
        x: list[int] = field(default_factory=list)

    @dataclass(frozen=True, slots=True)
    class PostInit:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class KeywordOnly:
        x: int
        y: int = field(default=0, kw_only=True)

    for cls in (Mutable, Factory, PostInit, KeywordOnly):
        with pytest.raises(TypeError):
            fast_init(cls)
