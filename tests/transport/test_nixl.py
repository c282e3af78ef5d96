"""NIXL data plane specifics (the shared contract is in test_conformance.py): writes queued faster
than they are copied are folded into fewer transfers, and every write still gets its own
notification, after its data, and its own completion; writes the caller posts itself go at once
when nothing is in flight and are otherwise held back and folded."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvfsm.transport.base import Inbound, Segment
from kvfsm.transport.nixl import BATCH_MAGIC, NixlConfig, nixl_available, pack_notifications, unpack_notifications

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


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("caller_posts", "sometimes"),
        ("poller_sched", "idle"),
        ("hold_writes", 0),
        ("hold_bytes", -1),
        ("hold_below", -1),
        ("hold_below", 1.5),
        ("large_write", 0),
        ("busy_poll_s", 0),
        ("tail_poll_s", -1e-6),
        ("idle_poll_s", "fast"),
        ("quiet_poll_s", 0.0),
        ("hot_window_s", -0.1),
        ("xfer_timeout_s", -1.0),
        ("backend_params", {"ucx_error_handling_mode": 1}),
    ],
)
def test_nixl_config_refuses_an_out_of_range_value_naming_its_field(field: str, value: object) -> None:
    from kvfsm.config import ConfigError

    with pytest.raises(ConfigError, match=rf"NixlConfig\.{field} = "):
        NixlConfig(**{field: value})  # type: ignore[arg-type]


def test_nixl_config_documents_every_field_and_its_defaults_pass_their_checks() -> None:
    from kvfsm.config import reference

    rows = reference(NixlConfig)
    assert [r.name for r in rows] == [f.name for f in dataclasses.fields(NixlConfig)]
    assert all(r.doc and r.when and r.must for r in rows), [r.name for r in rows if not (r.doc and r.when and r.must)]
    cfg = NixlConfig()
    assert cfg.caller_posts == "auto" and cfg.hold_below < cfg.large_write


def _job(op: str, peer: str, mems: tuple[str, str], total: int, tag: object, region: str | None = None) -> Any:
    from kvfsm.transport.nixl.plan import _Job

    job = _Job(op, peer, b"n", tag, total, mems, [], [])
    if region is not None:
        job.region, job.prepped = region, (np.array([tag], np.int32), np.array([tag], np.int32))
    elif total:
        job.lrows, job.rrows = [(0, total, 0)], [(0, total, 0)]
    return job


def test_fold_groups_by_key_keeps_each_keys_order_and_respects_the_limits() -> None:
    from kvfsm.transport.nixl import MAX_BATCH, fold
    from kvfsm.transport.nixl.plan import _MAX_BATCH_BYTES as MAX_BATCH_BYTES

    kv, aux = ("VRAM", "VRAM"), ("DRAM", "DRAM")
    # a room's KV writes (VRAM) and aux writes (DRAM) interleave in the queue, then two peers,
    # block-index jobs of two regions, a read and a notification-only job
    jobs = [_job("WRITE", "d0", kv if i % 2 == 0 else aux, 100, i) for i in range(6)]
    jobs += [_job("WRITE", "d1", kv, 100, 6), _job("WRITE", "d0", kv, 0, 7), _job("READ", "d0", kv, 100, 8)]
    jobs += [_job("WRITE", "d0", kv, 4096, t, "kv") for t in (9, 10)] + [_job("WRITE", "d0", kv, 64, 11, "aux")]
    groups = [[j.tag for j in g] for g in fold(jobs)]
    assert groups == [[0, 2, 4], [1, 3, 5], [6], [7], [8], [9, 10], [11]]
    # limits: a group holds at most MAX_BATCH jobs and MAX_BATCH_BYTES
    many = [_job("WRITE", "d0", kv, 1, i) for i in range(MAX_BATCH + 3)]
    assert [len(g) for g in fold(many)] == [MAX_BATCH, 3]
    big = [_job("WRITE", "d0", kv, MAX_BATCH_BYTES // 2 + 1, i) for i in range(3)]
    assert [[j.tag for j in g] for g in fold(big)] == [[0], [1], [2]]
    small = [_job("WRITE", "d0", kv, 1, t) for t in ("s1", "s2")]
    assert [[j.tag for j in g] for g in fold([big[0], *small, big[1]])] == [[0, "s1", "s2"], [1]]


def _byte_map(lrows: list[tuple[int, int, int]], rrows: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Every (local device, local byte, remote device, remote byte) the rows move, sorted."""
    return sorted(
        (ld, la + k, rd, ra + k) for (la, n, ld), (ra, _, rd) in zip(lrows, rrows, strict=True) for k in range(n)
    )


def test_merge_rows_joins_each_pair_that_continues_an_earlier_one_on_both_sides() -> None:
    from kvfsm.transport.nixl import merge_rows

    # 16 rooms x 4 chunks handed over chunk after chunk (every room's chunk 0, then every room's
    # chunk 1 ...), a room's chunks adjacent at both ends: one descriptor per room
    rooms, chunks, size = 16, 4, 1 << 20
    order = [(r, c) for c in range(chunks) for r in range(rooms)]
    lrows = [(0x1000 + (r * chunks + c) * size, size, 0) for r, c in order]
    rrows = [(0x9000 + (r * chunks + c) * size, size, 1) for r, c in order]
    ml, mr = merge_rows(lrows, rrows)
    assert ml == [(0x1000 + r * chunks * size, chunks * size, 0) for r in range(rooms)]
    assert mr == [(0x9000 + r * chunks * size, chunks * size, 1) for r in range(rooms)]
    # left apart: adjacent on one side only, on another device, a pair before the one it continues
    lrows = [(0, 4, 0), (4, 4, 0), (8, 4, 0), (12, 4, 1), (20, 4, 0), (16, 4, 0)]
    rrows = [(100, 4, 0), (104, 4, 0), (200, 4, 0), (112, 4, 0), (124, 4, 0), (120, 4, 0)]
    ml, mr = merge_rows(lrows, rrows)
    assert ml == [(0, 8, 0), (8, 4, 0), (12, 4, 1), (20, 4, 0), (16, 4, 0)]
    assert mr == [(100, 8, 0), (200, 4, 0), (112, 4, 0), (124, 4, 0), (120, 4, 0)]
    # random disjoint pairs: the same bytes move between the same places, and no pair is left
    # that starts where an earlier one ends on both sides
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 24))
        lblocks = rng.permutation(32)[:n].tolist()
        rblocks = rng.permutation(32)[:n].tolist()
        devs = rng.integers(0, 2, size=(n, 2)).tolist()
        lrows = [(b * 4, 4, d[0]) for b, d in zip(lblocks, devs, strict=True)]
        rrows = [(b * 4, 4, d[1]) for b, d in zip(rblocks, devs, strict=True)]
        ml, mr = merge_rows(lrows, rrows)
        assert _byte_map(ml, mr) == _byte_map(lrows, rrows)
        assert len(ml) <= n
        for i in range(len(ml)):
            for j in range(i + 1, len(ml)):
                joins = ml[j][0] == ml[i][0] + ml[i][1] and mr[j][0] == mr[i][0] + mr[i][1]
                assert not (joins and ml[j][2] == ml[i][2] and mr[j][2] == mr[i][2]), (lrows, rrows)


def _connect(a: Any, b: Any, src: np.ndarray, dst: np.ndarray, block: int, on_a: Any, on_b: Any) -> None:
    """Two NIXL data planes that know each other: ``src`` registered on ``a``, ``dst`` on ``b``."""
    a.set_handler(on_a)
    b.set_handler(on_b)
    a.register_memory(src, np.zeros(64, np.uint8), kv_block=block, aux_block=64)
    b.register_memory(dst, np.zeros(64, np.uint8), kv_block=block, aux_block=64)
    a.add_peer(b.name, b.descriptor())
    b.add_peer(a.name, a.descriptor())


def _landed(dst: np.ndarray, src: np.ndarray, timeout: float = 10.0) -> bool:
    """Does ``dst`` come to equal ``src`` within ``timeout`` (a peer's writes land in it)?"""
    deadline = time.monotonic() + timeout
    while not (dst == src).all() and time.monotonic() < deadline:
        time.sleep(0.001)
    return bool((dst == src).all())


def _counting(n: int) -> tuple[list[Inbound], threading.Event, Any]:
    """A handler that collects completions and sets the event at the ``n``-th."""
    got: list[Inbound] = []
    done = threading.Event()

    def on(item: Inbound) -> None:
        got.append(item)
        if len(got) == n:
            done.set()

    return got, done, on


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_queued_writes_fold_into_fewer_transfers_yet_notify_and_complete_one_by_one() -> None:
    from kvfsm.transport.nixl import NixlDataPlane

    block, n = 4096, 64
    a, b = NixlDataPlane("fold-a", config=NixlConfig(caller_posts="never")), NixlDataPlane("fold-b")
    src = np.random.default_rng(1).integers(0, 256, n * block, dtype=np.uint8)
    dst = np.zeros(n * block, dtype=np.uint8)
    got: list[Inbound] = []
    in_place: list[bool] = []

    def on_b(item: Inbound) -> None:
        i = int(item.data)
        in_place.append(bool((dst[i * block : (i + 1) * block] == src[i * block : (i + 1) * block]).all()))
        got.append(item)

    completions, done, on_a = _counting(n)
    try:
        _connect(a, b, src, dst, block, on_a, on_b)
        for i in range(n):  # faster than they can be copied one by one
            a.write("fold-b", "kv", [Segment(i * block, i * block, block)], str(i).encode(), ("t", i))
        assert done.wait(20)
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        # one each (two transfers' notifications may arrive in either order: the protocol
        # never relies on it), each after its own data
        assert sorted(int(x.data) for x in got) == list(range(n))
        assert all(in_place), "a notification arrived before its data"
        assert sorted(c.tag for c in completions) == [("t", i) for i in range(n)]
        assert all(c.ok for c in completions)
        assert (dst == src).all()
        assert a.stats["writes"] == n and a.stats["transfers"] < n  # folded
        # adjacent at both ends, a transfer's writes are one descriptor (merge_rows)
        assert a.stats["descriptors"] == a.stats["transfers"]
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_a_fold_never_merges_writes_of_two_regions_that_are_adjacent_in_memory() -> None:
    """KV and aux carved back to back out of one buffer on both sides, the last KV page and aux
    slot 0 written in one folded transfer: their byte ranges continue each other on both sides,
    yet they are two registrations, and NIXL refuses a descriptor that spans two. Both writes
    complete and land, as two descriptors of one transfer."""
    from kvfsm.transport.nixl import NixlDataPlane

    block, slot = 4096, 64
    a, b = NixlDataPlane("xreg-a", config=NixlConfig(caller_posts="never")), NixlDataPlane("xreg-b")
    src = np.random.default_rng(5).integers(0, 256, 4 * block + 4 * slot, dtype=np.uint8)
    dst = np.zeros(4 * block + 4 * slot, dtype=np.uint8)
    completions, done, on_a = _counting(2)
    try:
        a.set_handler(on_a)
        b.set_handler(lambda item: None)
        a.register_memory(src[: 4 * block], src[4 * block :], kv_block=block, aux_block=slot)
        b.register_memory(dst[: 4 * block], dst[4 * block :], kv_block=block, aux_block=slot)
        a.add_peer(b.name, b.descriptor())
        b.add_peer(a.name, a.descriptor())
        with a._queued:  # hold the posting thread back: the two writes fold into one transfer
            a.write(b.name, "kv", [Segment(3 * block, 3 * block, block)], b"kv", "kv")
            a.write(b.name, "aux", [Segment(0, 0, slot)], b"aux", "aux")
        assert done.wait(20)
        assert sorted((c.tag, c.ok) for c in completions) == [("aux", True), ("kv", True)], completions
        assert (dst[3 * block : 4 * block + slot] == src[3 * block : 4 * block + slot]).all()
        assert a.stats["transfers"] == 1 and a.stats["descriptors"] == 2
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_a_batch_handler_gets_each_poll_rounds_items_in_one_call() -> None:
    """With ``set_batch_handler`` the poller hands a round over in one call (the runtime takes
    its lock once for it): the completions of a folded transfer arrive together, as
    "completions" items (at most KICK_EVERY writes each while the posting thread copies host
    memory), each write's exactly once, and the per-item handler sees none of them."""
    from kvfsm.transport.nixl import NixlDataPlane
    from kvfsm.transport.nixl.poller import _KICK_EVERY as KICK_EVERY

    block, n = 4096, 48
    a, b = NixlDataPlane("batch-a", config=NixlConfig(caller_posts="never")), NixlDataPlane("batch-b")
    src = np.random.default_rng(2).integers(0, 256, n * block, dtype=np.uint8)
    dst = np.zeros(n * block, dtype=np.uint8)
    single: list[Inbound] = []
    calls: list[list[Inbound]] = []
    done = threading.Event()

    def on_batch(items: list[Inbound]) -> None:
        calls.append(list(items))
        if sum(len(item.tag) for c in calls for item in c) >= n:  # type: ignore[arg-type]
            done.set()

    try:
        _connect(a, b, src, dst, block, single.append, lambda item: None)
        a.set_batch_handler(on_batch)
        with a._queued:  # hold the posting thread back so that all n fold into few transfers
            for i in range(n):
                a.write("batch-b", "kv", [Segment(i * block, i * block, block)], b"n", ("t", i))
        assert done.wait(20)
        items = [item for call in calls for item in call]
        assert all(item.kind == "completions" and item.ok for item in items)
        tags = [t for item in items for t in item.tag]  # type: ignore[attr-defined]
        assert sorted(tags) == [("t", i) for i in range(n)] and len(tags) == n
        sizes = [len(item.tag) for item in items]  # type: ignore[arg-type]
        assert max(sizes) > 1 and max(sizes) <= KICK_EVERY  # a transfer's writes, in host-copy slices
        assert len(calls) < n and max(sum(len(i.tag) for i in c) for c in calls) > 1  # type: ignore[arg-type]
        assert single == []
        assert a.stats["transfers"] < n
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_scattered_writes_fold_into_one_block_index_transfer() -> None:
    """Writes of many short runs go through the prepared block lists; queued together, their
    block indices are concatenated into one transfer, and each write still lands and notifies."""
    from kvfsm.transport.nixl import NixlDataPlane

    block, per, n = 4096, 16, 24
    a, b = NixlDataPlane("sfold-a", config=NixlConfig(caller_posts="never")), NixlDataPlane("sfold-b")
    src = np.random.default_rng(2).integers(0, 256, n * per * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    notes: list[bytes] = []
    completions, done, on_a = _counting(n)
    try:
        _connect(a, b, src, dst, block, on_a, lambda item: notes.append(item.data))
        last = n * per - 1
        with a._queued:  # hold the posting thread back so that the writes queue together and fold
            for i in range(n):  # destination pages in reverse order: one descriptor per page
                segs = [Segment((i * per + k) * block, (last - i * per - k) * block, block) for k in range(per)]
                a.write("sfold-b", "kv", segs, str(i).encode(), ("s", i))
        assert done.wait(20)
        deadline = time.monotonic() + 10
        while len(notes) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sorted(int(x) for x in notes) == list(range(n))
        assert all(c.ok for c in completions)
        assert (dst.reshape(-1, block)[::-1] == src.reshape(-1, block)).all()
        assert a.stats["writes"] == n and a.stats["transfers"] < n  # folded
        assert a.stats["descriptors"] == n * per
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
@pytest.mark.parametrize("via", ["write", "write_run"])
@pytest.mark.parametrize("hold_writes", [4, 10_000], ids=["caller-flushes", "poller-flushes"])
def test_caller_posted_writes_go_at_once_when_idle_else_are_held_and_folded(hold_writes: int, via: str) -> None:
    """``caller_posts`` (device memory by default): the first write is posted before write()
    returns; writes made while a transfer is in flight are held back and go folded, posted by the
    caller once ``hold_writes`` are held or else by the poller's next round. Every write still
    lands, notifies after its data and completes exactly once. ``write_run`` (the engine's
    leanest path) holds exactly as ``write`` does."""
    from kvfsm.transport.nixl import NixlDataPlane

    block, n = 4096, 40
    a = NixlDataPlane("held-a", config=NixlConfig(caller_posts="always", hold_writes=hold_writes, hold_bytes=1 << 30))
    b = NixlDataPlane("held-b")
    src = np.random.default_rng(3).integers(0, 256, n * block, dtype=np.uint8)
    dst = np.zeros(n * block, dtype=np.uint8)
    in_place: list[int] = []

    def on_b(item: Inbound) -> None:
        i = int(item.data)
        if (dst[i * block : (i + 1) * block] == src[i * block : (i + 1) * block]).all():
            in_place.append(i)

    completions, done, on_a = _counting(n)
    try:
        _connect(a, b, src, dst, block, on_a, on_b)
        # pause progress (the poller's and the caller's): the first transfer is not seen complete
        # (so the next writes are held) and the poller posts nothing held, until the originals
        # are back; a round that had begun before is over after the sleep
        pause = {"_progress": lambda *args: None, "_completions": lambda *args: None, "_flush_held": lambda: None}
        vars(a).update(pause)
        time.sleep(0.05)
        a.write("held-b", "kv", [Segment(0, 0, block)], b"0", ("h", 0))
        assert a.stats["transfers"] == 1  # nothing was in flight: posted by the caller, at once
        for i in range(1, n):
            if via == "write_run":
                a.write_run("held-b", "kv", i * block, i * block, block, str(i).encode(), ("h", i))
            else:
                a.write("held-b", "kv", [Segment(i * block, i * block, block)], str(i).encode(), ("h", i))
        held = len(a._held)
        for name in pause:
            delattr(a, name)  # the class's methods again
        assert held == (n - 1) % hold_writes if hold_writes < n else held == n - 1
        assert done.wait(20)
        deadline = time.monotonic() + 10
        while len(in_place) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sorted(in_place) == list(range(n)), "a notification arrived before its data, or never"
        assert sorted(c.tag for c in completions) == [("h", i) for i in range(n)]
        assert all(c.ok for c in completions) and (dst == src).all()
        assert a.stats["writes"] == n and 2 <= a.stats["transfers"] <= 1 + -(-(n - 1) // min(hold_writes, n))
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
@pytest.mark.parametrize("via", ["write", "write_run"])
def test_while_a_transfer_is_in_flight_small_writes_are_held_and_a_large_one_goes_at_once(via: str) -> None:
    """Caller-posted writes smaller than ``hold_below`` are held while a transfer is in flight,
    from ``write`` (or ``write_run``) and from ``write_many`` alike (the poller's round or a
    later post takes them); a write of ``hold_below`` bytes or more is posted at once, with
    whatever is held, from either. Every write lands and completes once."""
    from kvfsm.transport.nixl import NixlDataPlane

    block = 4096
    sizes = [1, 1, 1, 1, 2, 1, 2]  # blocks per write, in order: 2 blocks is "large" here
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    a = NixlDataPlane("hold-a", config=NixlConfig(caller_posts="always", hold_below=2 * block))
    b = NixlDataPlane("hold-b")
    src = np.random.default_rng(8).integers(0, 256, sum(sizes) * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    completions, done, on_a = _counting(len(sizes))

    def w(i: int) -> Any:
        seg = Segment(starts[i] * block, starts[i] * block, sizes[i] * block)
        return (b.name, "kv", [seg], str(i).encode(), ("s", i))

    def write(i: int) -> None:
        if via == "write_run":
            at = starts[i] * block
            assert a.write_run(b.name, "kv", at, at, sizes[i] * block, str(i).encode(), ("s", i)) == sizes[i] * block
        else:
            a.write(*w(i))

    try:
        _connect(a, b, src, dst, block, on_a, lambda item: None)
        pause = {"_progress": lambda *args: None, "_completions": lambda *args: None, "_flush_held": lambda: None}
        vars(a).update(pause)  # the first transfer stays in flight, as far as a knows
        time.sleep(0.05)
        write(0)
        assert a.stats["transfers"] == 1 and not a._held, "nothing in flight: posted at once"
        write(1)
        assert a.write_many([w(2), w(3)]) == [block, block]
        assert a.stats["transfers"] == 1 and len(a._held) == 3, "small writes are held, write_many's too"
        write(4)
        assert a.stats["transfers"] == 2 and not a._held, "a large write goes at once, the held ones with it"
        assert a.write_many([w(5), w(6)]) == [block, 2 * block]
        assert a.stats["transfers"] == 3 and not a._held, "a batch with a large write goes at once"
        for name in pause:
            delattr(a, name)  # the class's methods again
        assert done.wait(20)
        assert sorted(c.tag for c in completions) == [("s", i) for i in range(len(sizes))]
        assert all(c.ok for c in completions)
        assert _landed(dst, src)
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_a_large_write_takes_only_the_held_writes_that_fold_with_it() -> None:
    """A write of ``hold_below`` bytes or more goes at once with the held writes that share its
    transfer (same peer, op, memory kinds, kind of descriptor); held writes that would make
    transfers of their own (here: to another peer; on a GPU, a room's aux slot in host memory
    beside its KV in VRAM) stay held for the poller's round or a flush. Every write lands,
    notifies and completes once."""
    from kvfsm.transport.nixl import NixlDataPlane

    block = 4096
    a = NixlDataPlane("apart-a", config=NixlConfig(caller_posts="always", hold_below=2 * block))
    b, c = NixlDataPlane("apart-b"), NixlDataPlane("apart-c")
    src = np.random.default_rng(12).integers(0, 256, 8 * block, dtype=np.uint8)
    to_b, to_c = np.zeros_like(src), np.zeros_like(src)
    completions, done, on_a = _counting(6)
    notes: list[tuple[str, bytes]] = []
    try:
        _connect(a, b, src, to_b, block, on_a, lambda item: notes.append(("b", item.data)))
        c.set_handler(lambda item: notes.append(("c", item.data)))
        c.register_memory(to_c, np.zeros(64, np.uint8), kv_block=block, aux_block=64)
        a.add_peer(c.name, c.descriptor())
        c.add_peer(a.name, a.descriptor())
        pause = {"_progress": lambda *args: None, "_completions": lambda *args: None, "_flush_held": lambda: None}
        vars(a).update(pause)  # the first transfer stays in flight, as far as a knows
        time.sleep(0.05)

        def w(peer: str, first: int, n: int, tag: int) -> None:
            a.write(peer, "kv", [Segment(first * block, first * block, n * block)], str(tag).encode(), ("p", tag))

        w(b.name, 0, 1, 0)
        assert a.stats["transfers"] == 1 and not a._held, "nothing in flight: posted at once"
        w(c.name, 0, 1, 1)
        w(b.name, 1, 1, 2)
        w(c.name, 1, 1, 3)
        assert len(a._held) == 3, "small writes are held while a transfer is in flight"
        w(b.name, 2, 2, 4)  # large
        assert a.stats["transfers"] == 2, "the large write went at once, in one transfer"
        assert sorted(j.tag for j in a._held) == [("p", 1), ("p", 3)], "the writes to c stay held"
        assert all(j.peer == c.name for j in a._held) and a._held_bytes == 2 * block
        w(b.name, 4, 4, 5)  # large, and nothing held folds with it
        assert a.stats["transfers"] == 3 and len(a._held) == 2
        for name in pause:
            delattr(a, name)  # the class's methods again: the poller's round posts what is held
        assert done.wait(20), "the held writes were not posted, or did not complete"
        assert sorted(x.tag for x in completions) == [("p", i) for i in range(6)] and all(x.ok for x in completions)
        assert _landed(to_b[: 8 * block], src) and _landed(to_c[: 2 * block], src[: 2 * block])
        deadline = time.monotonic() + 10
        while len(notes) < 6 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sorted(notes) == sorted([("b", b"0"), ("c", b"1"), ("b", b"2"), ("c", b"3"), ("b", b"4"), ("b", b"5")])
    finally:
        a.close()
        b.close()
        c.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_flush_posts_the_held_writes_at_once_and_their_completions_follow() -> None:
    """``flush()`` (the owner waits: ``Manager.wait``) posts the writes a caller held back in
    the caller's own thread, with no poller round, and their completions follow soon (the
    caller's own check or the poller's close watch after a flush); every write lands and
    completes once. The poller's busy rounds are a minute apart here, so without the flush
    nothing held would move, nor complete, within the test."""
    from kvfsm.transport.nixl import NixlDataPlane

    block, n = 4096, 6
    a = NixlDataPlane("flush-a", config=NixlConfig(caller_posts="always", busy_poll_s=60.0, hold_writes=1000))
    b = NixlDataPlane("flush-b")
    src = np.random.default_rng(5).integers(0, 256, n * block, dtype=np.uint8)
    dst = np.zeros(n * block, dtype=np.uint8)
    completions, done, on_a = _counting(n)
    try:
        _connect(a, b, src, dst, block, on_a, lambda item: None)
        # hold the second and later writes: the first transfer is not seen complete meanwhile
        vars(a).update({"_progress": lambda *args: None, "_completions": lambda *args: None})
        time.sleep(0.05)  # a round that had begun is over
        for i in range(n):
            a.write(b.name, "kv", [Segment(i * block, i * block, block)], str(i).encode(), ("f", i))
        del a._progress, a._completions  # the class's methods again
        assert len(a._held) == n - 1 and a.stats["transfers"] == 1
        a.flush()
        assert not a._held and a.stats["transfers"] == 2, "flush posts every held write, folded, at once"
        assert done.wait(20), "the flushed writes did not complete"
        assert sorted(c.tag for c in completions) == [("f", i) for i in range(n)] and all(c.ok for c in completions)
        assert _landed(dst, src)
    finally:
        a.close()
        b.close()


class _SlowAgent:
    """An agent whose transfers stay in flight ``latency_s`` after their post (a GPU's copy or a
    remote write does; UCX copies host memory inside the post, so a real agent's DRAM transfer
    is done at once): the poller's schedule is what is under test, not NIXL."""

    def __init__(self, agent: Any, latency_s: float) -> None:
        self._agent, self.latency_s, self.posted = agent, latency_s, {}
        self.checks = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def initialize_xfer(self, *args: Any) -> int:
        return len(self.posted) + 1

    def transfer(self, handle: int) -> str:
        self.posted[handle] = time.monotonic()
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        self.checks += 1
        return "DONE" if time.monotonic() - self.posted[handle] >= self.latency_s else "PROC"

    def release_xfer_handle(self, handle: int) -> None:
        pass


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_after_a_flush_the_poller_watches_the_transfers_closely_until_the_next_write() -> None:
    """While transfers are in flight the poller's rounds are ``busy_poll_s`` apart (a minute
    here): the posting caller completes transfers itself. After ``flush()`` nobody else will, so
    the poller polls every ``tail_poll_s`` at first (slower as the wait lasts) and delivers the
    completion soon after the transfer ends; a write handed over again restores the busy pace."""
    from kvfsm.transport.nixl import NixlDataPlane

    block = 4096
    a = NixlDataPlane("tail-a", config=NixlConfig(caller_posts="always", busy_poll_s=60.0, tail_poll_s=0.001))
    b = NixlDataPlane("tail-b")
    src = np.random.default_rng(6).integers(0, 256, 4 * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    completions, done, on_a = _counting(1)
    try:
        _connect(a, b, src, dst, block, on_a, lambda item: None)
        slow = _SlowAgent(a.agent, 1.0)
        a.agent = slow
        time.sleep(0.05)
        a.write(b.name, "kv", [Segment(0, 0, block)], b"0", ("t", 0))
        assert not done.wait(0.6), "the transfer is still in flight"
        checks = slow.checks
        assert checks <= 2, "the poller polled between busy rounds"
        a.flush()
        assert done.wait(5), "after flush the poller should deliver the completion soon"
        assert completions[0].ok and completions[0].tag == ("t", 0)
        # a write handed over again: busy pace (the caller completes what it posts)
        vars(a).update({"_completions": lambda *args: None})
        a.write(b.name, "kv", [Segment(block, block, block)], b"1", ("t", 1))
        del a._completions
        time.sleep(0.1)  # the round the write's kick starts (a poller idle since the completion)
        checks = slow.checks
        time.sleep(1.2)  # the transfer ends meanwhile
        assert slow.checks == checks, "the poller still polled closely after a write was handed over"
        assert len(completions) == 1
    finally:
        a.close()
        b.close()


class _CheckedBy(_SlowAgent):
    """A ``_SlowAgent`` that records which thread made each transfer check."""

    def __init__(self, agent: Any, latency_s: float) -> None:
        super().__init__(agent, latency_s)
        self.checked_by: list[str] = []

    def check_xfer_state(self, handle: int) -> str:
        self.checked_by.append(threading.current_thread().name)
        return super().check_xfer_state(handle)


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_the_poller_leaves_the_transfers_to_a_caller_that_posts_and_checks_them_and_takes_over_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the owner hands writes over and a posting caller checked the in-flight transfers
    within ``busy_poll_s`` (it does at every post, up to the first still in progress: one check
    per post here, every transfer in flight), the poller's rounds do not check them (the caller
    completes them at its next post); ``busy_poll_s`` after the caller's last check they do
    again, so a transfer whose caller went quiet is still completed."""
    from kvfsm.transport.nixl import NixlDataPlane, poller

    monkeypatch.setattr(poller, "_FULL_SCAN_S", 60.0)  # (full scans check everything: none here)
    block = 4096
    a = NixlDataPlane("defer-a", config=NixlConfig(caller_posts="always", hold_below=0, busy_poll_s=0.02))
    b = NixlDataPlane("defer-b")
    src = np.random.default_rng(11).integers(0, 256, 64 * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        _connect(a, b, src, dst, block, lambda item: None, lambda item: None)
        slow = _CheckedBy(a.agent, 60.0)  # in flight throughout
        checked = slow.checked_by
        a.agent = slow
        me, poller = threading.current_thread().name, a._poller.name
        for i in range(30):  # a post every 5 ms (each posts at once: hold_below=0), for 0.15 s
            a.write(b.name, "kv", [Segment(i * block, i * block, block)], b"%d" % i, ("p", i))
            time.sleep(0.005)
        assert poller not in checked, "the poller checked while the caller did"
        assert 29 <= checked.count(me) <= 30, "a posting caller checks up to the first transfer in progress"
        deadline = time.monotonic() + 5
        while poller not in checked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert poller in checked, "the poller never took over from the quiet caller"
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_close_wakes_a_poller_asleep_between_busy_rounds() -> None:
    """A transfer in flight puts the poller to sleep for ``busy_poll_s`` between rounds (a minute
    here); ``close()`` ends that sleep: the poller thread is gone when close returns, well before
    its joining gives up (10 s)."""
    from kvfsm.transport.nixl import NixlDataPlane

    block = 4096
    a = NixlDataPlane("close-a", config=NixlConfig(caller_posts="always", busy_poll_s=60.0))
    b = NixlDataPlane("close-b")
    src = np.random.default_rng(8).integers(0, 256, 2 * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        _connect(a, b, src, dst, block, lambda item: None, lambda item: None)
        a.agent = _SlowAgent(a.agent, 60.0)
        a.write(b.name, "kv", [Segment(0, 0, block)], b"0", ("c", 0))
        time.sleep(0.2)  # the write's round has run: the poller sleeps until the next busy round
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < 5 and not a._poller.is_alive()
    finally:
        a.close()
        b.close()


def _hold_then_wait(plane: Any, first: Any, last: Any, posting: bool = False) -> tuple[bool, int, bool]:
    """Run ``first`` and then ``last`` on threads while ``plane``'s agent lock is taken (and, if
    ``posting``, a post counted as under way); returns (``first`` returned, writes held then,
    ``last`` waited for the agent). Once the lock is free ``last`` must return too. (On threads: a
    caller that wrongly waits fails the test, not hangs it.)"""
    t_first, t_last = threading.Thread(target=first), threading.Thread(target=last)
    with plane._lock:
        plane._posting += int(posting)
        t_first.start()
        t_first.join(5)
        returned = not t_first.is_alive()
        held = len(plane._held)
        t_last.start()
        t_last.join(0.2)
        waited = t_last.is_alive()
        plane._posting -= int(posting)
    t_first.join(5)
    t_last.join(5)
    assert not t_last.is_alive(), "the caller still waits for a free agent"
    return returned, held, waited


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_a_posting_caller_does_not_wait_for_the_agent_but_holds_its_writes_up_to_a_limit() -> None:
    """While another thread is inside a NIXL call (the agent's lock taken), a caller that would
    post holds its writes instead of waiting; at ``hold_writes`` held it waits. The held
    writes are posted once the agent is free, and each completes once."""
    from kvfsm.transport.nixl import NixlDataPlane

    block, flush = 4096, 2
    n = flush
    a = NixlDataPlane("busy-a", config=NixlConfig(caller_posts="always", hold_writes=flush))
    b = NixlDataPlane("busy-b")
    src = np.random.default_rng(4).integers(0, 256, n * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    completions, done, on_a = _counting(n)

    def write(i: int) -> None:
        a.write("busy-b", "kv", [Segment(i * block, i * block, block)], str(i).encode(), ("b", i))

    try:
        _connect(a, b, src, dst, block, on_a, lambda item: None)
        # as if the poller were inside a NIXL call
        returned, held, waited = _hold_then_wait(a, lambda: [write(i) for i in range(n - 1)], lambda: write(n - 1))
        assert returned and held == n - 1, "below the limit a caller holds its writes"
        assert waited, "at the limit the caller should wait for the agent"
        assert done.wait(20)
        assert sorted(c.tag for c in completions) == [("b", i) for i in range(n)]
        assert all(c.ok for c in completions) and (dst == src).all()
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_write_many_holds_its_batch_during_a_post_up_to_a_limit_and_else_waits_for_the_agent() -> None:
    """While a post is under way (on host memory the posting thread copies for as long as the copy
    takes), a caller's ``write_many`` holds its caller-posted writes rather than waiting for the
    agent, as ``write`` does; a batch that brings the held writes to ``hold_writes`` waits,
    whatever keeps the agent busy (here the poller's status check, with no post under way). Once
    the agent is free every held write is posted and completes once."""
    from kvfsm.transport.nixl import NixlDataPlane

    block, flush = 4096, 2
    n = flush
    a = NixlDataPlane("busymany-a", config=NixlConfig(caller_posts="always", hold_writes=flush))
    b = NixlDataPlane("busymany-b")
    src = np.random.default_rng(6).integers(0, 256, (n + flush) * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    completions, done, on_a = _counting(n + flush)

    def batch(lo: int, hi: int) -> list[Any]:
        return [("busymany-b", "kv", [Segment(i * block, i * block, block)], str(i).encode(), ("w", i))
                for i in range(lo, hi)]  # fmt: skip

    results: list[Any] = []
    try:
        _connect(a, b, src, dst, block, on_a, lambda item: None)
        pause = {"_progress": lambda *args: None, "_flush_held": lambda: None}
        vars(a).update(pause)  # the poller stays out of it (it would post held writes itself)
        time.sleep(0.05)
        returned, held, waited = _hold_then_wait(  # as if the posting thread were inside a long copy
            a,
            lambda: results.append(a.write_many(batch(0, n - 1))),
            lambda: results.append(a.write_many(batch(n - 1, n))),
            posting=True,
        )
        assert returned and held == n - 1, "below the limit write_many holds its writes"
        assert waited, "at the limit write_many should wait for the agent"
        # (a batch of hold_writes writes: a smaller one would be held while a transfer is in flight)
        other = threading.Thread(target=lambda: results.append(a.write_many(batch(n, n + flush))))
        with a._lock:  # as if the poller were inside a status check: no post under way
            other.start()
            other.join(0.2)
            waited_for_check = other.is_alive()
        other.join(5)
        for name in pause:
            delattr(a, name)  # the class's methods again: the poller completes what is in flight
        assert waited_for_check and not other.is_alive(), "at the limit write_many waits for a status check too"
        assert [r for batch_result in results for r in batch_result] == [block] * (n + flush)
        assert done.wait(20)
        assert sorted(c.tag for c in completions) == [("w", i) for i in range(n + flush)]
        assert all(c.ok for c in completions) and (dst == src).all()
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_write_many_holds_small_writes_while_the_agent_is_busy_and_waits_with_a_large_one() -> None:
    """The agent busy with a status check (no post under way), a ``write_many`` batch past the
    Nagle limit (here ``hold_bytes``) whose writes are all below ``hold_below`` is held, as
    ``write`` holds such writes, until ``hold_writes`` writes are held; a batch
    with a write of ``hold_below`` or more waits for the agent (holding it would leave the link
    idle). Once the agent is free every write is posted and completes once."""
    from kvfsm.transport.nixl import NixlDataPlane

    block, flush = 4096, 4
    limit = flush
    a = NixlDataPlane(
        "smallmany-a",
        config=NixlConfig(caller_posts="always", hold_writes=flush, hold_bytes=block, hold_below=4 * block),
    )
    b = NixlDataPlane("smallmany-b")
    total = limit + 4
    src = np.random.default_rng(9).integers(0, 256, total * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    completions, done, on_a = _counting(limit + 1)

    def batch(lo: int, hi: int, size: int = block) -> list[Any]:
        return [("smallmany-b", "kv", [Segment(i * block, i * block, size)], str(i).encode(), ("w", i))
                for i in range(lo, hi)]  # fmt: skip

    def runs(fn: Any) -> bool:
        """Does ``fn`` return while the agent's lock is taken (as by a poller's status check)?"""
        t = threading.Thread(target=fn)
        with a._lock:
            t.start()
            t.join(0.2)
            returned = not t.is_alive()
        t.join(5)
        assert not t.is_alive(), "the caller still waits for a free agent"
        return returned

    try:
        _connect(a, b, src, dst, block, on_a, lambda item: None)
        vars(a).update({"_progress": lambda *args: None, "_flush_held": lambda: None})  # the poller stays out
        time.sleep(0.05)
        assert runs(lambda: a.write_many(batch(0, limit - 1))), "small writes past hold_bytes: held"
        assert len(a._held) == limit - 1
        assert not runs(lambda: a.write_many(batch(limit - 1, limit))), "at hold_writes: it waits"
        assert not a._held
        assert not runs(lambda: a.write_many(batch(limit, limit + 1, 4 * block))), "a large write waits"
        for name in ("_progress", "_flush_held"):
            delattr(a, name)
        assert done.wait(20)
        assert sorted(c.tag for c in completions) == [("w", i) for i in range(limit + 1)]
        assert all(c.ok for c in completions) and (dst == src).all()
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_a_plane_told_to_expect_no_traffic_polls_rarely_until_told_otherwise() -> None:
    """``expect_traffic(False)``: with nothing of its own in flight the poller waits up to
    ``quiet_poll_s`` (here a minute), so a peer's write into it is not noticed (its notification
    not delivered); ``expect_traffic(True)`` wakes the poller, which then delivers it at once."""
    from kvfsm.transport.nixl import NixlDataPlane

    block = 4096
    a, b = NixlDataPlane("quiet-a"), NixlDataPlane("quiet-b", config=NixlConfig(quiet_poll_s=60.0))
    src = np.random.default_rng(7).integers(0, 256, 2 * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    arrived = threading.Event()
    completions, done, on_a = _counting(1)
    try:
        _connect(a, b, src, dst, block, on_a, lambda item: arrived.set())
        b.expect_traffic(False)
        time.sleep(0.05)  # b's poller ends its current (short) wait and starts a quiet one
        a.write(b.name, "kv", [Segment(0, 0, block)], b"quiet", ("q", 0))
        assert not arrived.wait(0.5), "a quiet plane should not have polled within half a second"
        b.expect_traffic(True)
        assert arrived.wait(10), "expect_traffic(True) should wake the poller"
        assert done.wait(20) and completions[0].ok and (dst[:block] == src[:block]).all()
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_a_plane_expecting_no_traffic_collects_notifications_only_in_full_rounds() -> None:
    """A prefill rank's poller, busy with its own transfers, skips ``get_new_notifs`` in its
    short rounds while the owner expects no peer to write into it; a full round still collects
    them, and so does every round once the owner expects traffic. A notification that arrived
    meanwhile is delivered by the next full round."""
    from kvfsm.transport.nixl import NixlDataPlane

    block = 4096
    a, b = NixlDataPlane("notif-a", config=NixlConfig(quiet_poll_s=60.0)), NixlDataPlane("notif-b")
    src = np.random.default_rng(3).integers(0, 256, 2 * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        _connect(a, b, src, dst, block, lambda item: None, lambda item: None)
        a.expect_traffic(False)
        time.sleep(0.05)  # a's poller starts its quiet wait (a minute): only this test's calls progress a
        calls: list[int] = []
        fetch = a.agent.get_new_notifs
        a.agent.get_new_notifs = lambda: calls.append(1) or fetch()  # type: ignore[method-assign]
        assert src[:block].any()
        b.write(a.name, "kv", [Segment(0, 0, block)], b"late", ("w", 0))  # b writes (zeros) into a
        deadline = time.monotonic() + 0.3
        items: list[Inbound] = []
        while time.monotonic() < deadline:  # short rounds: the status of a's own transfers only
            a._progress(items, False)
        assert calls == [] and items == [], "a short round of a quiet plane fetched notifications"
        a._progress(items, True)  # a full round fetches them (and UCX delivers b's write to a)
        deadline = time.monotonic() + 10
        while not any(i.kind == "notification" for i in items) and time.monotonic() < deadline:
            a._progress(items, True)
        assert calls and [i.data for i in items if i.kind == "notification"] == [b"late"]
        a.expect_traffic(True)
        before = len(calls)
        a._progress([], False)
        assert len(calls) == before + 1, "a plane expecting traffic fetches notifications every round"
        assert not src[:block].any(), "b's write did not land in a's memory"
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_auto_lets_the_caller_post_device_and_tiny_host_writes_and_the_thread_the_rest() -> None:
    from kvfsm.transport.nixl import NixlDataPlane
    from kvfsm.transport.nixl.posting import _SMALL_HOST_BYTES as SMALL_HOST_BYTES

    dram, vram = ("DRAM", "DRAM"), ("VRAM", "VRAM")
    planes = {
        mode: NixlDataPlane(f"route-{mode}", config=NixlConfig(caller_posts=mode))
        for mode in ("auto", "always", "never")
    }
    try:
        cases = {
            "device range": _job("WRITE", "d", vram, 1 << 20, 0),
            "device to host": _job("WRITE", "d", ("VRAM", "DRAM"), 1 << 20, 1),
            "tiny host": _job("WRITE", "d", dram, SMALL_HOST_BYTES, 2),
            "host copy": _job("WRITE", "d", dram, SMALL_HOST_BYTES + 1, 3),
            "device block indices": _job("WRITE", "d", vram, 4096, 4, region="kv"),
        }
        routed = {name: planes["auto"]._caller_posts(job, True) for name, job in cases.items()}
        assert routed == {
            "device range": True,
            "device to host": True,
            "tiny host": True,
            "host copy": False,  # UCX copies inside the post: the posting thread is the copy engine
            "device block indices": False,  # per-descriptor CPU in the post: overlapped on the thread
        }
        assert all(planes["always"]._caller_posts(j, True) for j in cases.values())
        assert not any(planes["never"]._caller_posts(j, True) for j in cases.values())
        with pytest.raises(ValueError, match="caller_posts"):
            NixlConfig(caller_posts="sometimes")
    finally:
        for p in planes.values():
            p.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_auto_hands_a_lone_large_device_write_to_the_thread_only_while_the_link_is_busy() -> None:
    """ "auto": a lone device write of ``large_write`` bytes or more (``write``,
    ``write_run``) goes to the posting thread while a transfer is in flight or queued (its NIXL
    calls then overlap the engine's Python), the caller posts it when nothing is (the link waits
    for no hand-off), and smaller ones the caller posts either way; ``write_many``'s and
    ``caller_posts="always"``'s stay with the caller. (Device memory cannot be registered here:
    the route and the transfer in flight are set by hand, and the poller finds it in progress.)"""
    from kvfsm.transport.nixl import NixlDataPlane
    from kvfsm.transport.nixl.plan import _Route

    large = NixlConfig().large_write

    vram = ("VRAM", "VRAM")
    planes = [NixlDataPlane("lone-auto"), NixlDataPlane("lone-always", config=NixlConfig(caller_posts="always"))]
    try:
        seen: list[tuple[str, int]] = []
        for p in planes:
            p.agent = _SlowAgent(p.agent, 3600.0)
            p.agent.posted[1] = time.monotonic()  # the transfer put in flight below: in progress
            p._post_now = lambda job: seen.append(("caller", job.total))  # type: ignore[method-assign]
            p._queue = lambda jobs: seen.extend(("thread", j.total) for j in jobs)  # type: ignore[method-assign]
            p._post_locked = lambda jobs, p=p: (  # type: ignore[method-assign]
                seen.extend(("caller", j.total) for j in jobs),
                p._lock.release(),
            )
            p._routes[("d", "kv")] = _Route(0, 1 << 40, 0, 0, 1 << 40, 1, vram)
        auto, always = planes
        big, small = large, large - 1

        def lone(p: NixlDataPlane) -> list[str]:
            seen.clear()
            p._post(_job("WRITE", "d", vram, big, 0))
            p._post(_job("WRITE", "d", vram, small, 1))
            p.write_run("d", "kv", 0, 0, big, b"n", 2)
            p.write_run("d", "kv", 0, 0, small, b"n", 3)
            return [who for who, _ in seen]

        assert lone(auto) == ["caller"] * 4  # nothing in flight: the link waits for no hand-off
        auto._inflight[1] = None  # type: ignore[assignment]
        assert lone(auto) == ["thread", "caller", "thread", "caller"]
        seen.clear()
        auto.write_many([("d", "kv", [Segment(0, 0, big)], b"n", 4)])  # a batch: the caller posts it
        assert seen == [("caller", big)]
        del auto._inflight[1]
        auto._jobs.append(_job("WRITE", "d", vram, small, 5))  # queued, not yet posted: behind it
        assert lone(auto) == ["thread", "caller", "thread", "caller"]
        auto._jobs.clear()
        always._inflight[1] = None  # type: ignore[assignment]
        assert lone(always) == ["caller"] * 4
        always._inflight.clear()
    finally:
        for p in planes:
            p.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
@pytest.mark.parametrize("caller_posts", ["always", "never"])
def test_write_many_posts_a_batch_together_and_refuses_only_its_bad_writes(caller_posts: str) -> None:
    """``write_many``: each write is validated on its own (a bad one gets its TransportError in the
    result and moves nothing; the others go on). Posted by the caller, a batch of ``hold_writes``
    writes or more goes at once and folded into one transfer, although a transfer is in flight;
    either way every good write lands, notifies after its data and completes once."""
    from kvfsm.transport.base import TransportError
    from kvfsm.transport.nixl import NixlDataPlane

    block, n = 4096, 24
    a = NixlDataPlane(f"many-a-{caller_posts}", config=NixlConfig(caller_posts=caller_posts, hold_writes=8))
    b = NixlDataPlane(f"many-b-{caller_posts}")
    peer = b.name
    src = np.random.default_rng(5).integers(0, 256, n * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    bad = {3: "outside", 7: "unknown"}
    in_place: list[int] = []

    def on_b(item: Inbound) -> None:
        i = int(item.data)
        if (dst[i * block : (i + 1) * block] == src[i * block : (i + 1) * block]).all():
            in_place.append(i)

    completions, done, on_a = _counting(n - len(bad))
    try:
        _connect(a, b, src, dst, block, on_a, on_b)
        pause = {"_progress": lambda *args: None, "_completions": lambda *args: None, "_flush_held": lambda: None}
        vars(a).update(pause)  # the first transfer stays in flight, as far as a knows
        time.sleep(0.05)
        a.write(peer, "kv", [Segment(0, 0, block)], b"0", ("m", 0))
        writes: list[Any] = [
            (peer, "kv", [Segment(i * block, i * block, block)], str(i).encode(), ("m", i)) for i in range(1, n)
        ]
        writes[3 - 1] = (peer, "kv", [Segment(0, n * block, block)], b"3", ("m", 3))  # beyond b's region
        writes[7 - 1] = ("nobody", "kv", [Segment(7 * block, 7 * block, block)], b"7", ("m", 7))
        results = a.write_many(writes)
        posted = a.stats["transfers"]
        for name in pause:
            delattr(a, name)
        assert [type(r) for r in results] == [TransportError if i in bad else int for i in range(1, n)]
        assert "outside" in str(results[3 - 1]) and "unknown" in str(results[7 - 1])
        assert all(r == block for i, r in enumerate(results, 1) if i not in bad)
        if caller_posts == "always":
            assert posted == 2 and not a._held  # the first write, then the whole batch as one transfer
        assert done.wait(20)
        deadline = time.monotonic() + 10
        while len(in_place) < n - len(bad) and time.monotonic() < deadline:
            time.sleep(0.001)
        good = [i for i in range(n) if i not in bad]
        assert sorted(in_place) == good, "a notification arrived before its data, or never"
        assert sorted(c.tag for c in completions) == [("m", i) for i in good] and all(c.ok for c in completions)
        for i in range(n):
            moved = (dst[i * block : (i + 1) * block] == src[i * block : (i + 1) * block]).all()
            assert moved == (i not in bad)
        assert a.stats["writes"] == n - len(bad)
    finally:
        a.close()
        b.close()


class _GatedAgent:
    """An agent whose posting thread's first transfer waits for ``gate`` before it copies (a long
    host copy, which UCX makes inside the post, for as long as the test likes); every post
    records the thread that made it."""

    def __init__(self, agent: Any, poster: str) -> None:
        self._agent, self._poster = agent, poster
        self.gate, self.inside = threading.Event(), threading.Event()
        self.posted_by: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def transfer(self, handle: Any) -> Any:
        me = threading.current_thread().name
        if me == self._poster and not self.inside.is_set():
            self.inside.set()
            assert self.gate.wait(20), "the test never opened the gate"
        self.posted_by.append(me)
        return self._agent.transfer(handle)


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_flush_during_a_host_copy_returns_and_the_posting_thread_posts_the_held_writes_after_it() -> None:
    """While the posting thread copies host memory (inside its post, the agent's lock taken), a
    small write the caller would post is held, and ``flush()`` (the owner about to wait) returns
    at once rather than wait out the copy for the agent; the posting thread posts the held write
    as soon as its copy ends, before anyone else takes the agent. Both writes land, notify and
    complete once."""
    from kvfsm.transport.nixl import NixlDataPlane
    from kvfsm.transport.nixl.posting import _SMALL_HOST_BYTES as SMALL_HOST_BYTES

    block = 4096
    big, small = 64 * block, SMALL_HOST_BYTES  # auto: the posting thread copies one, the caller posts the other
    a, b = NixlDataPlane("copyflush-a"), NixlDataPlane("copyflush-b")
    src = np.random.default_rng(11).integers(0, 256, big + small, dtype=np.uint8)
    dst = np.zeros_like(src)
    completions, done, on_a = _counting(2)
    notes: list[bytes] = []
    try:
        _connect(a, b, src, dst, block, on_a, lambda item: notes.append(item.data))
        gated = _GatedAgent(a.agent, a._poster.name)
        a.agent = gated
        a.write(b.name, "kv", [Segment(0, 0, big)], b"big", ("c", 0))
        assert gated.inside.wait(10), "the large host write should go to the posting thread"
        a.write(b.name, "kv", [Segment(big, big, small)], b"small", ("c", 1))
        assert len(a._held) == 1, "with the agent busy copying, the small write is held"
        flusher = threading.Thread(target=a.flush)
        flusher.start()
        flusher.join(1.0)
        returned = not flusher.is_alive()
        gated.gate.set()
        flusher.join(10)
        assert returned, "flush() waited for the copy to end"
        assert done.wait(20), "the writes did not complete"
        assert gated.posted_by == [a._poster.name] * 2, "the posting thread posts the held write after its copy"
        assert sorted(c.tag for c in completions) == [("c", 0), ("c", 1)] and all(c.ok for c in completions)
        assert _landed(dst, src)
        deadline = time.monotonic() + 10
        while len(notes) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sorted(notes) == [b"big", b"small"]
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
@pytest.mark.parametrize(
    ("sched", "kv_on", "batch"),
    [
        ("auto", "cpu", True),
        ("auto", None, False),
        ("auto", "cuda", False),
        ("batch", None, True),
        ("normal", "cpu", False),
    ],
)
def test_the_poller_takes_sched_batch_where_cpus_copy_the_kv_and_no_other_thread_changes(
    sched: str, kv_on: str | None, batch: bool
) -> None:
    """By default (``auto``) the poller runs under SCHED_BATCH (it does not preempt, at its timed
    wake-ups, a thread copying on its CPU) once KV is registered in host memory, and keeps its
    policy with KV in device memory or none registered; ``batch`` and ``normal`` force either.
    The posting thread and the caller's thread keep the policy they had. An unknown policy is
    refused."""
    import os

    from kvfsm.transport.nixl import NixlDataPlane

    if not hasattr(os, "SCHED_BATCH"):
        pytest.skip("no SCHED_BATCH on this system")
    probe: list[BaseException] = []

    def try_batch() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError as exc:
            probe.append(exc)

    t = threading.Thread(target=try_batch)
    t.start()
    t.join()
    if probe:
        pytest.skip(f"this sandbox refuses SCHED_BATCH: {probe[0]!r}")
    kv: Any = None
    if kv_on == "cuda":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("no GPU")
        kv = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    elif kv_on == "cpu":
        kv = np.zeros(1 << 16, np.uint8)
    with pytest.raises(ValueError, match="poller_sched"):
        NixlConfig(poller_sched="idle")
    mine = os.sched_getscheduler(0)
    a = NixlDataPlane(f"sched-{sched}-{kv_on}", config=NixlConfig(poller_sched=sched))
    try:
        if kv is not None:
            a.register_memory(kv, np.zeros(64, np.uint8), kv_block=4096, aux_block=64)
        want = os.SCHED_BATCH if batch else mine
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(a._poller.native_id) != want and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # (a poller that took SCHED_BATCH late, wrongly, would show it now)
        assert os.sched_getscheduler(a._poller.native_id) == want
        assert os.sched_getscheduler(a._poster.native_id) == mine
        assert os.sched_getscheduler(0) == mine
    finally:
        a.close()
