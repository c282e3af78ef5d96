"""NIXL data plane specifics (the shared contract is in test_conformance.py): writes queued faster
than they are copied are folded into fewer transfers, and every write still gets its own
notification, after its data and in order, and its own completion."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvfsm.transport.base import Inbound, Segment
from kvfsm.transport.nixl import BATCH_MAGIC, nixl_available, pack_notifications, unpack_notifications

NIXL_MISSING = nixl_available()


@pytest.mark.parametrize("notes", [[b"a"], [b"", b'{"v":1}', b"x" * 1000], [bytes([i]) * i for i in range(40)]])
def test_notification_batches_round_trip(notes: list[bytes]) -> None:
    packed = pack_notifications(notes)
    assert packed.startswith(BATCH_MAGIC)
    assert unpack_notifications(packed) == notes


@pytest.mark.parametrize(
    "data",
    [
        b'{"v":1,"t":"chunk_written"}',  # a plain protocol notification
        BATCH_MAGIC,  # no count
        BATCH_MAGIC + b"\x02\x00\x00\x00" + b"\x01\x00\x00\x00a",  # one part missing
        BATCH_MAGIC + b"\x01\x00\x00\x00" + b"\x05\x00\x00\x00ab",  # a part longer than the data
        pack_notifications([b"a"]) + b"trailing",
    ],
    ids=["plain", "no-count", "missing-part", "short-part", "trailing-bytes"],
)
def test_anything_but_a_well_formed_batch_is_one_notification(data: bytes) -> None:
    assert unpack_notifications(data) == [data]


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_queued_writes_fold_into_fewer_transfers_yet_notify_and_complete_one_by_one() -> None:
    from kvfsm.transport.nixl import NixlDataPlane

    block, n = 4096, 64
    a, b = NixlDataPlane("fold-a"), NixlDataPlane("fold-b")
    src = np.random.default_rng(1).integers(0, 256, n * block, dtype=np.uint8)
    dst = np.zeros(n * block, dtype=np.uint8)
    got: list[Inbound] = []
    in_place: list[bool] = []
    done = threading.Event()

    def on_b(item: Inbound) -> None:
        i = int(item.data)
        in_place.append(bool((dst[i * block : (i + 1) * block] == src[i * block : (i + 1) * block]).all()))
        got.append(item)

    completions: list[Inbound] = []

    def on_a(item: Inbound) -> None:
        completions.append(item)
        if len(completions) == n:
            done.set()

    try:
        a.set_handler(on_a)
        b.set_handler(on_b)
        a.register_memory(src, np.zeros(64, np.uint8), kv_block=block, aux_block=64)
        b.register_memory(dst, np.zeros(64, np.uint8), kv_block=block, aux_block=64)
        a.add_peer("fold-b", b.descriptor())
        b.add_peer("fold-a", a.descriptor())
        for i in range(n):  # faster than they can be copied one by one
            a.write("fold-b", "kv", [Segment(i * block, i * block, block)], str(i).encode(), ("t", i))
        assert done.wait(20)
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        assert [int(x.data) for x in got] == list(range(n))  # one each, in order
        assert all(in_place), "a notification arrived before its data"
        assert sorted(c.tag for c in completions) == [("t", i) for i in range(n)]
        assert all(c.ok for c in completions)
        assert (dst == src).all()
        assert a.stats["writes"] == n and a.stats["transfers"] < n  # folded
    finally:
        a.close()
        b.close()
