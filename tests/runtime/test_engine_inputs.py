"""What engines hand the runtime: page indices as numpy arrays or tensors (SGLang passes
``kv_indices`` as numpy), numpy integer slots and ranks. They work like Python ints; anything that
is not an integer is refused with LocalProtocolError before the room changes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvfsm.protocol import KVPoll, LocalProtocolError
from kvfsm.testing import LoopbackCluster


@pytest.mark.parametrize(
    "kind",
    ["list", "numpy-int32", "numpy-int64", "numpy-uint32", "torch-int64", "range", "numpy-scalars"],
)
def test_pages_and_slots_from_numpy_and_torch_move_the_same_bytes(kind: str) -> None:
    def pages(xs: list[int]) -> Any:
        return {
            "list": lambda: xs,
            "numpy-int32": lambda: np.array(xs, dtype=np.int32),
            "numpy-int64": lambda: np.array(xs, dtype=np.int64),
            "numpy-uint32": lambda: np.array(xs, dtype=np.uint32),
            "torch-int64": lambda: torch.tensor(xs, dtype=torch.int64),
            "range": lambda: range(xs[0], xs[-1] + 1),
            "numpy-scalars": lambda: [np.int64(x) for x in xs],  # list(np_array), as engines do
        }[kind]()

    c = LoopbackCluster()
    recv = c.decode[0].create_receiver(7, sources=np.array([0]), required_dests=np.int64(1))
    recv.init(pages([10, 11, 12, 13]), np.int32(2))
    sender = c.prefill[0].create_sender(7)
    c.settle()
    sender.send(pages([4, 5]))
    sender.send(pages([6, 7]), is_last=np.True_, aux_slot=np.int64(1))
    c.settle()
    assert recv.poll() == KVPoll.Success and sender.poll() == KVPoll.Success
    assert c.kv_equal(0, [4, 5, 6, 7], 0, [10, 11, 12, 13])
    assert c.aux_equal(0, 1, 0, 2)


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1.0, 2.0]),
        [1.0, 2.0],
        [True, False],
        np.array([True, False]),
        [[1, 2]],
        np.array([[1, 2]]),
        "12",
        [1, "2"],
        None,
    ],
    ids=["numpy-float", "floats", "bools", "numpy-bools", "nested", "2-d", "str", "mixed", "none"],
)
def test_pages_that_are_not_integers_are_refused_and_change_nothing(bad: Any) -> None:
    c = LoopbackCluster()
    recv = c.decode[0].create_receiver(7)
    sender = c.prefill[0].create_sender(7)
    with pytest.raises(LocalProtocolError, match="integer"):
        recv.init(bad, 0)
    assert recv.poll() == KVPoll.WaitingForInput and c.settle() == 0  # nothing announced
    recv.init([1, 2], 0)
    c.settle()
    with pytest.raises(LocalProtocolError, match="integer"):
        sender.send(bad)
    for slot in (1.0, True, "1"):
        with pytest.raises(LocalProtocolError, match="aux_slot must be an integer"):
            sender.send([3, 4], is_last=True, aux_slot=slot)
    with pytest.raises(LocalProtocolError, match="aux_slot must be an integer"):
        c.decode[0].create_receiver(8).init([5], 0.5)
    assert sender.poll() == KVPoll.WaitingForInput  # every refused call left the room as it was
    sender.send([3, 4], is_last=True, aux_slot=1)
    c.settle()
    assert recv.poll() == KVPoll.Success and c.kv_equal(0, [3, 4], 0, [1, 2])


@pytest.mark.parametrize(
    "given",
    [
        range(5, 9),
        range(0, 0),
        range(9, 5, -1),
        range(-2, 2),
        np.arange(5, 9, dtype=np.int32),
        np.arange(5, 9, dtype=np.uint64),
        np.array([5, 7, 6, 8]),
        np.array([-1, 0, 1]),
        np.array([], dtype=np.int64),
        np.array([7]),
        np.arange(4090, 4200),  # past the preset int template: grown on demand
    ],
    ids=[
        "range",
        "empty-range",
        "descending-range",
        "negative-range",
        "np-int32",
        "np-uint64",
        "np-not-a-run",
        "np-negative",
        "np-empty",
        "np-one",
        "np-long",
    ],  # fmt: skip
)
def test_runs_given_as_range_or_numpy_become_the_same_exact_int_tuples(given: Any) -> None:
    """A range or an integer numpy array that is one ascending run skips the per-page checks
    (it is one by construction, or checked vectorised); anything else takes the general path.
    Either way the result is the tuple of exact ints a list would give, and its summary is right."""
    from kvfsm.protocol.pages import page_summary
    from kvfsm.runtime.pages import as_pages

    want = tuple(int(p) for p in given)
    got = as_pages(given)
    assert got == want and all(type(p) is int for p in got)
    run = want == tuple(range(want[0], want[0] + len(want))) if want else True
    expected = (min(want), max(want), len(set(want)) == len(want), run) if want else (0, -1, True, True)
    assert page_summary(got) == expected


@pytest.mark.parametrize(
    "bad", [float, np.float64, bool, str, lambda _: None], ids=["float", "numpy-float", "bool", "str", "none"]
)
@pytest.mark.parametrize("where", [2, 20, 63])
def test_a_long_run_with_one_item_that_is_not_an_integer_is_refused(bad: Any, where: int) -> None:
    """A list that is one ascending run but for one item past the first two: the runs' checks in
    C (decode's announcement, and prefill's leanest send path) must refuse it as the general path
    does, not take it for the run it resembles."""
    c = LoopbackCluster(pages=256)
    recv = c.decode[0].create_receiver(7)
    sender = c.prefill[0].create_sender(7)
    good = list(range(38, 38 + 64))
    bad_pages = [*good[:where], bad(good[where]), *good[where + 1 :]]  # equal to the page it stands for
    with pytest.raises(LocalProtocolError, match="integer"):
        recv.init(bad_pages, 0)
    assert recv.poll() == KVPoll.WaitingForInput and c.settle() == 0  # nothing announced
    recv.init(good, 0)
    c.settle()
    with pytest.raises(LocalProtocolError, match="integer"):
        sender.send(bad_pages)
    with pytest.raises(LocalProtocolError, match="integer"):
        c.prefill[0].send_many([(sender, bad_pages)])
    assert sender.poll() == KVPoll.WaitingForInput and not sender.pages_in_use()  # nothing posted
    sender.send(good, is_last=True, aux_slot=1)
    c.settle()
    assert recv.poll() == KVPoll.Success and c.kv_equal(0, good, 0, good)
