"""Runtime + loopback scenarios, reading like the protocol.

Every test drives real managers over the loopback fabric (real bytes, real copies) with a manual
clock; every successful room's bytes at decode are compared with prefill's.
"""

from __future__ import annotations

import pytest

from kvfsm.protocol import KVPoll, LocalProtocolError
from kvfsm.protocol.wire import ChunkWritten, RoomPages
from kvfsm.testing import LoopbackCluster
from kvfsm.transport.base import Inbound
from kvfsm.transport.loopback import Faults


@pytest.fixture
def cluster() -> LoopbackCluster:
    c = LoopbackCluster(prefill_ranks=2, decode_ranks=2)
    yield c
    c.close()


def _run_room(
    c: LoopbackCluster,
    rid: int,
    chunks: list[list[list[int]]],
    dst: list[list[int]],
    *,
    decode_first: bool = True,
    aux: tuple[int, int] = (1, 2),
) -> tuple[list, list]:
    """Room ``rid`` on every rank r: prefill rank r sends chunks[r], decode rank r receives into dst[r]."""
    ranks = range(len(c.prefill))

    def start_decode() -> list:
        recv = [c.decode[r].create_receiver(rid) for r in ranks]
        for r, rc in enumerate(recv):
            assert rc.poll() == KVPoll.WaitingForInput
            rc.init(dst[r], aux[1])
        return recv

    def start_prefill() -> list:
        senders = [c.prefill[r].create_sender(rid) for r in ranks]
        for r, s in enumerate(senders):
            for i, pages in enumerate(chunks[r]):
                last = i == len(chunks[r]) - 1
                s.send(pages, is_last=last, aux_slot=aux[0] if last else None)
        return senders

    if decode_first:
        recv = start_decode()
        c.settle()
        senders = start_prefill()
    else:
        senders = start_prefill()
        c.settle()
        recv = start_decode()
    c.settle()
    return senders, recv


def test_happy_path_multi_rank_multi_chunk_every_byte_arrives(cluster: LoopbackCluster) -> None:
    chunks = [[[0, 1], [2, 3, 4], [9]], [[10], [11, 12], [20, 21]]]
    dst = [[30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44]]
    senders, recv = _run_room(cluster, 77, chunks, dst)
    assert [s.poll() for s in senders] == [KVPoll.Success] * 2
    assert [r.poll() for r in recv] == [KVPoll.Success] * 2
    for r in range(2):
        src = [p for ch in chunks[r] for p in ch]
        assert cluster.kv_equal(r, src, r, dst[r])
        assert cluster.aux_equal(r, 1, r, 2)
    for x in (*senders, *recv):
        x.clear()
    assert all(m.live_rooms() == 0 for m in cluster.managers)


def test_scenario_1_decode_announces_before_prefill_kv_is_ready(cluster: LoopbackCluster) -> None:
    recv = cluster.decode[0].create_receiver(5)
    recv.init([3, 4], 0)
    cluster.settle()
    sender = cluster.prefill[0].create_sender(5)
    assert cluster.prefill[0].state(5) == "WaitingForInput"
    sender.send([7, 8], is_last=True, aux_slot=0)
    cluster.settle()
    assert sender.poll() == recv.poll() == KVPoll.Success
    assert cluster.kv_equal(0, [7, 8], 0, [3, 4])


def test_scenario_2_prefill_chunks_are_held_until_decode_announces(cluster: LoopbackCluster) -> None:
    sender = cluster.prefill[0].create_sender(6)
    sender.send([1], is_last=False)
    sender.send([2], is_last=True, aux_slot=3)
    assert cluster.prefill[0].state(6) == "Bootstrapping.Holding"
    assert cluster.fabric.stats.writes == 0  # nothing written before decode announced
    recv = cluster.decode[0].create_receiver(6)
    recv.init([10, 11], 4)
    cluster.settle()
    assert sender.poll() == recv.poll() == KVPoll.Success
    assert cluster.kv_equal(0, [1, 2], 0, [10, 11]) and cluster.aux_equal(0, 3, 0, 4)


def test_pages_announced_before_the_prefill_room_exists_are_applied_on_create(cluster: LoopbackCluster) -> None:
    recv = cluster.decode[1].create_receiver(9)
    recv.init([0, 1, 2], 1)
    cluster.settle()
    assert cluster.prefill[1].stats()["counters"]["early_messages"] == 1
    sender = cluster.prefill[1].create_sender(9)
    assert cluster.prefill[1].state(9) == "WaitingForInput"
    sender.send([5, 6, 7], is_last=True, aux_slot=0)
    cluster.settle()
    assert recv.poll() == KVPoll.Success and cluster.kv_equal(1, [5, 6, 7], 1, [0, 1, 2])


def test_decode_times_out_when_prefill_never_writes_and_tells_prefill() -> None:
    c = LoopbackCluster(timeouts={"transfer": 5.0})
    recv = c.decode[0].create_receiver(1)
    recv.init([0], 0)
    c.settle()
    sender = c.prefill[0].create_sender(1)  # never sends
    c.advance(4.9)
    assert recv.poll() == KVPoll.WaitingForInput
    c.advance(0.2)
    assert recv.poll() == KVPoll.Failed
    assert "timeout" in recv.failure_exception().reason
    assert sender.poll() == KVPoll.Failed  # the abort reached prefill: it stops, no 300 s wait
    assert "aborted" in c.prefill[0].failure_exception(1).reason or "peer" in c.prefill[0].failure_exception(1).reason


def test_prefill_hold_timeout_releases_held_kv_when_decode_never_announces() -> None:
    c = LoopbackCluster(timeouts={"hold": 2.0})
    sender = c.prefill[0].create_sender(3)
    sender.send([1], is_last=True, aux_slot=0)
    c.advance(2.5)
    assert sender.poll() == KVPoll.Failed
    assert "hold timer" in sender.failure_exception().reason


def test_prefill_bootstrap_timeout_when_nobody_announces() -> None:
    c = LoopbackCluster(timeouts={"bootstrap": 3.0})
    sender = c.prefill[0].create_sender(3)
    c.advance(3.5)
    assert sender.poll() == KVPoll.Failed and "bootstrap timer" in sender.failure_exception().reason


def test_decode_bootstrap_timeout_when_prefill_never_answers_the_handshake() -> None:
    c = LoopbackCluster(connect=False, timeouts={"bootstrap": 3.0})
    c.fabric.crash("prefill/0")  # nobody will ever ack (crash before any contact: no peer_lost)
    c.decode[0].connect()
    recv = c.decode[0].create_receiver(4)
    assert recv.poll() == KVPoll.Bootstrapping
    c.advance(3.5)
    assert recv.poll() == KVPoll.Failed and "bootstrap timer" in recv.failure_exception().reason


def test_prefill_input_timeout_when_engine_never_sends() -> None:
    c = LoopbackCluster(timeouts={"input": 4.0})
    recv = c.decode[0].create_receiver(8)
    sender = c.prefill[0].create_sender(8)
    recv.init([1], 0)
    c.settle()
    c.advance(4.5)
    assert sender.poll() == KVPoll.Failed
    assert recv.poll() == KVPoll.Failed  # told by room_failed, not by its own timeout
    assert "room_failed" in recv.failure_exception().reason or "failure_received" in recv.failure_exception().reason


def test_prefill_transfer_timeout_when_a_write_never_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    c = LoopbackCluster(timeouts={"transfer": 2.0})
    # A data plane whose write is accepted but never completes (a hung RDMA handle):
    monkeypatch.setattr(c.prefill[0].endpoint, "write", lambda *a, **k: 0)
    recv = c.decode[0].create_receiver(2)
    recv.init([1], 0)
    c.settle()
    sender = c.prefill[0].create_sender(2)
    sender.send([1], is_last=True, aux_slot=0)
    c.settle()
    assert sender.poll() == KVPoll.Transferring
    c.advance(2.5)
    assert sender.poll() == KVPoll.Failed and "transfer timer" in sender.failure_exception().reason
    assert recv.poll() == KVPoll.Failed  # told at once, not after its own 300 s


def test_progress_re_arms_the_transfer_timers_and_they_fire_after_the_last_progress() -> None:
    # Every chunk (and every completion, every arrival) re-arms the inactivity timers a little
    # later: the rooms live on past the first deadlines, and time out only 2 s after the last.
    c = LoopbackCluster(timeouts={"transfer": 2.0})
    recv = c.decode[0].create_receiver(6)
    recv.init([10, 11, 12], 0)  # decode's transfer timer: armed, due at 2.0
    c.settle()
    sender = c.prefill[0].create_sender(6)
    c.advance(1.5)
    sender.send([1])  # at 1.5: both sides' timers re-armed to 3.5
    c.settle()
    c.advance(1.5)  # 3.0: past the first deadlines, not past the re-armed ones
    assert sender.poll() == KVPoll.Transferring and recv.poll() == KVPoll.Transferring
    sender.send([2])  # at 3.0: due at 5.0
    c.settle()
    c.advance(1.9)  # 4.9
    assert sender.poll() == KVPoll.Transferring and recv.poll() == KVPoll.Transferring
    assert c.decode[0].next_deadline() == pytest.approx(c.clock() + 0.1)  # the deadline re-armed last
    c.advance(0.2)  # 5.1: no progress for 2 s
    assert sender.poll() == KVPoll.Failed and recv.poll() == KVPoll.Failed
    assert "transfer" in sender.failure_exception().reason + recv.failure_exception().reason


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_from_either_side_fails_both(cluster: LoopbackCluster, side: str) -> None:
    recv = cluster.decode[0].create_receiver(11)
    recv.init([0, 1], 0)
    sender = cluster.prefill[0].create_sender(11)
    cluster.settle()
    sender.send([4], is_last=False)
    cluster.settle()
    (recv if side == "decode" else sender).abort("user cancelled")
    cluster.settle()
    assert sender.poll() == recv.poll() == KVPoll.Failed
    other = sender if side == "decode" else recv
    assert "user cancelled" in other.failure_exception().reason
    # Failed is sticky: further engine calls do not revive it.
    sender.send([5], is_last=True, aux_slot=0)
    assert sender.poll() == KVPoll.Failed


def test_prefill_crash_mid_transfer_fails_its_rooms_and_other_ranks_finish() -> None:
    c = LoopbackCluster(prefill_ranks=2, decode_ranks=2)
    recv = [c.decode[r].create_receiver(1) for r in range(2)]
    for rc in recv:
        rc.init([0, 1, 2], 0)
    senders = [c.prefill[r].create_sender(1) for r in range(2)]
    c.settle()
    for s in senders:
        s.send([0], is_last=False)
    c.settle()
    assert recv[0].poll() == KVPoll.Transferring
    c.fabric.crash("prefill/0")
    c.settle()
    senders[1].send([1, 2], is_last=True, aux_slot=0)
    c.settle()
    assert recv[0].poll() == KVPoll.Failed and "crashed" in recv[0].failure_exception().reason
    assert recv[1].poll() == KVPoll.Success and c.kv_equal(1, [0, 1, 2], 1, [0, 1, 2])
    # new rooms on the dead link fail at once instead of waiting for a timeout
    assert c.decode[0].create_receiver(2).poll() == KVPoll.Failed


def test_decode_crash_fails_prefill_rooms_that_write_to_it() -> None:
    c = LoopbackCluster()
    recv = c.decode[0].create_receiver(1)
    recv.init([0, 1], 0)
    sender = c.prefill[0].create_sender(1)
    c.settle()
    sender.send([0], is_last=False)
    c.fabric.crash("decode/0")
    c.settle()
    assert sender.poll() == KVPoll.Failed


def test_duplicated_messages_and_notifications_change_nothing() -> None:
    c = LoopbackCluster(faults=Faults(dup=1.0))
    senders, recv = _run_room(c, 3, [[[0, 1], [2]]], [[5, 6, 7]])
    assert senders[0].poll() == recv[0].poll() == KVPoll.Success
    assert c.kv_equal(0, [0, 1, 2], 0, [5, 6, 7])
    assert c.fabric.stats.duplicated > 0
    assert c.decode[0].stats()["counters"]["ignored"] >= 3  # chunk, chunk, aux notified twice


def test_late_notification_for_a_cleared_room_is_dropped_and_never_recreates_it(cluster: LoopbackCluster) -> None:
    senders, recv = _run_room(cluster, 4, [[[0]], [[0]]], [[1], [1]])
    for x in (*senders, *recv):
        x.clear()
    late = cluster.protocol.codec.encode(ChunkWritten(4, 0, 0, True, 0, 1))
    cluster.decode[0].endpoint.inject("prefill/0", Inbound("notification", "prefill/0", data=late))
    cluster.settle()
    d = cluster.decode[0]
    assert d.live_rooms() == 0
    assert d.stats()["counters"]["dropped.late_for_cleared_room"] == 1
    with pytest.raises(LocalProtocolError, match="cleared"):
        d.poll(4)


def test_malformed_and_unknown_version_messages_are_dropped_and_counted(cluster: LoopbackCluster) -> None:
    p = cluster.prefill[0]
    v = cluster.protocol.codec.version
    for raw in (b"\xff\x00", b"[]", b'{"v":99,"t":"abort"}', b'{"v":%d,"t":"room_pages","room":-1}' % v):
        p.endpoint.inject("decode/0", Inbound("message", "decode/0", data=raw))
    cluster.settle()
    counters = p.stats()["counters"]
    assert counters["dropped.malformed"] == 3
    assert counters["dropped.unsupported_version"] == 1
    assert p.live_rooms() == 0


def test_a_batch_of_completions_applies_each_write_and_drops_only_the_bad_tags(cluster: LoopbackCluster) -> None:
    """A data plane's "completions" item (the writes one transfer completed): each tag is
    applied as its own "completion" would be, and a malformed tag, one of a room that is gone or
    one whose handling raises (a bug) is dropped and counted without losing the tags after it."""
    p, d = cluster.prefill[0], cluster.decode[0]
    sender = p.create_sender(14)
    d.create_receiver(14).init([3, 4], 0)
    cluster.settle()
    delivered: list[Inbound] = []
    real = p._on_inbound

    def hold_completions(item: Inbound) -> None:  # the room's writes complete only through the batch below
        if item.kind == "completion":
            delivered.append(item)
        else:
            real(item)

    p.endpoint.set_handler(hold_completions)
    sender.send([0, 1], is_last=True, aux_slot=0)
    cluster.settle()
    tags = sorted(item.tag for item in delivered)  # type: ignore[type-var]
    assert len(tags) == 2 and sender.poll() == KVPoll.Transferring  # the chunk and the aux slot
    on_completion = p._on_completion

    def buggy(tag: object, ok: bool, reason: str) -> None:
        if tag == "boom":
            raise RuntimeError("a bug while completing one write")
        on_completion(tag, ok, reason)

    p._on_completion = buggy  # type: ignore[method-assign]
    p._on_inbound_batch([Inbound("completions", "decode/0", tag=("bad", tags[0], "boom", (999, 0, 0), tags[1]))])
    counters = p.stats()["counters"]
    assert counters["dropped.unexpected_completion"] == 1 and counters["dropped.completion_for_gone_room"] == 1
    assert counters["internal_errors"] == 1
    assert sender.poll() == KVPoll.Success


def test_a_message_claiming_another_decode_rank_is_dropped(cluster: LoopbackCluster) -> None:
    sender = cluster.prefill[0].create_sender(12)
    forged = cluster.protocol.codec.encode(RoomPages(12, 0, (1,), 0, 1))  # claims decode rank 0
    cluster.prefill[0].endpoint.inject("decode/1", Inbound("message", "decode/1", data=forged))
    cluster.settle()
    assert cluster.prefill[0].stats()["counters"]["dropped.wrong_sender"] == 1
    assert sender.poll() == KVPoll.Bootstrapping


def test_pages_outside_the_registered_region_are_rejected_before_any_byte_is_written(cluster: LoopbackCluster) -> None:
    sender = cluster.prefill[0].create_sender(13)
    sender.send([1, 2], is_last=True, aux_slot=0)
    bad = cluster.protocol.codec.encode(RoomPages(13, 0, (cluster.pages - 1, cluster.pages), 0, 1))
    cluster.prefill[0].endpoint.inject("decode/0", Inbound("message", "decode/0", data=bad))
    cluster.settle()
    assert sender.poll() == KVPoll.Failed
    assert "outside" in sender.failure_exception().reason
    assert cluster.fabric.stats.writes == 0 and not any(cluster.dkv[0])


def test_a_worker_exception_fails_only_that_room_and_the_worker_survives(monkeypatch: pytest.MonkeyPatch) -> None:
    c = LoopbackCluster(workers=2)
    p = c.prefill[0]
    real_write = p.endpoint.write
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated bug in the data plane")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(p.endpoint, "write", flaky)
    results = []
    for rid in (1, 3, 5):  # same shard on 2 workers
        recv = c.decode[0].create_receiver(rid)
        recv.init([rid], 0)
        sender = p.create_sender(rid)
        c.settle()
        sender.send([rid], is_last=True, aux_slot=0)
        c.settle()
        results.append((sender.poll(), recv.poll()))
    assert results[0] == (KVPoll.Failed, KVPoll.Failed)
    assert "simulated bug" in p.failure_exception(1).reason
    assert results[1:] == [(KVPoll.Success, KVPoll.Success)] * 2
    assert p.pool.alive == 2
    c.close()


def test_a_write_that_cannot_be_prepared_fails_its_room_and_the_step_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while a step's write is prepared (after the room moved on) fails that write:
    the room fails through its write_failed row and tells decode, the engine's send() does not
    raise, and the next room is unaffected."""
    c = LoopbackCluster()
    p = c.prefill[0]
    real_encode = p.codec.encode
    calls = {"n": 0}

    def flaky(msg: object) -> bytes:
        if isinstance(msg, ChunkWritten):
            calls["n"] += 1
            if calls["n"] == 1:
                raise ValueError("simulated bug while encoding a notification")
        return real_encode(msg)  # type: ignore[arg-type]

    monkeypatch.setattr(p.codec, "encode", flaky)
    results = []
    for rid in (1, 2):
        recv = c.decode[0].create_receiver(rid)
        recv.init([rid], 0)
        sender = p.create_sender(rid)
        c.settle()
        sender.send([rid], is_last=True, aux_slot=0)  # must not raise
        c.settle()
        results.append((sender.poll(), recv.poll()))
    assert results == [(KVPoll.Failed, KVPoll.Failed), (KVPoll.Success, KVPoll.Success)]
    assert "simulated bug" in p.failure_exception(1).reason
    assert p.stats()["counters"]["write_errors"] == 1
    assert c.kv_equal(0, [2], 0, [2])
    c.close()


def test_a_send_that_raises_loses_the_message_and_timers_still_conclude_the_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A control plane that raises in send() (a best-effort port) loses that message; the step's
    other actions still run, so the room's timers conclude it instead of leaving it hanging."""
    c = LoopbackCluster(timeouts={"transfer": 5.0})
    d = c.decode[0]
    real_send = d.endpoint.send

    def broken(peer: str, data: bytes) -> None:
        if b"room_pages" in data:
            raise RuntimeError("simulated control-plane bug")
        real_send(peer, data)

    monkeypatch.setattr(d.endpoint, "send", broken)
    recv = d.create_receiver(1)
    recv.init([0], 0)  # must not raise: room_pages is lost
    sender = c.prefill[0].create_sender(1)
    c.settle()
    assert recv.poll() == KVPoll.WaitingForInput
    assert d.stats()["counters"]["dropped.send_error"] == 1
    c.advance(5.1)
    assert recv.poll() == KVPoll.Failed and "timeout" in recv.failure_exception().reason
    c.advance(600)
    assert sender.poll() == KVPoll.Failed
    c.close()


def test_registration_refused_on_page_size_mismatch_fails_decode_rooms_fast() -> None:
    from kvfsm.runtime import DecodeManager
    from kvfsm.transport.loopback import Fabric

    c = LoopbackCluster()
    d = DecodeManager(
        5,
        c.fabric.endpoint("decode/5"),
        c.protocol,
        prefill_peers={0: "prefill/0"},
        kv=bytearray(64 * 128),
        aux=bytearray(64),
        page_bytes=128,
        aux_slot_bytes=32,
        clock=c.clock,
    )
    d.connect()
    c.settle()
    assert d.link_state(0) == "refused"
    recv = d.create_receiver(1, sources=(0,))
    assert (
        recv.poll() == KVPoll.Failed
        and "page of 128 bytes at decode, 256 at prefill" in recv.failure_exception().reason
    )
    assert isinstance(c.fabric, Fabric)


def test_lost_registration_is_retried_until_acknowledged() -> None:
    c = LoopbackCluster(connect=False, faults=Faults(drop=1.0))
    d = c.decode[0]
    d.connect()
    c.settle()
    assert d.link_state(0) == "pending"
    c.fabric.faults = Faults()
    c.advance(1.5)  # register_retry_s = 1.0
    assert d.link_state(0) == "ready"


def test_engine_misuse_raises_local_protocol_error_and_changes_nothing(cluster: LoopbackCluster) -> None:
    p, d = cluster.prefill[0], cluster.decode[0]
    sender = p.create_sender(20)
    with pytest.raises(LocalProtocolError, match="already exists"):
        p.create_sender(20)
    with pytest.raises(LocalProtocolError, match="aux_slot"):
        sender.send([1], is_last=True)  # the last chunk must carry the aux slot
    with pytest.raises(LocalProtocolError, match="registered pages"):
        sender.send([cluster.pages], is_last=False)
    with pytest.raises(LocalProtocolError, match="clear"):
        sender.clear()  # not concluded yet: abort() first
    assert p.state(20) == "Bootstrapping.Waiting"
    recv = d.create_receiver(20)
    with pytest.raises(LocalProtocolError):
        recv.init([cluster.pages + 3], 0)
    with pytest.raises(LocalProtocolError, match="does not exist"):
        d.poll(999)
    with pytest.raises(LocalProtocolError, match="room id"):
        p.create_sender(-1)


def test_stats_report_state_times_latency_bytes_and_failures(cluster: LoopbackCluster) -> None:
    _run_room(cluster, 30, [[[0, 1]], [[0, 1]]], [[2, 3], [2, 3]])
    s = cluster.prefill[0].create_sender(31)
    s.abort("boom")
    st = cluster.prefill[0].stats()
    assert st["counters"]["rooms_succeeded"] == 1 and st["counters"]["rooms_failed"] == 1
    assert st["counters"]["failure.aborted"] == 1
    h = st["histograms"]
    assert h["room_bytes"]["p50"] == 2 * cluster.page_bytes + cluster.aux_bytes
    assert {"p50", "p95", "p99"} <= set(h["transfer_seconds"])
    assert "state_seconds.WaitingForInput" in h


def test_chunks_that_do_not_cover_decode_pages_exactly_fail_both_sides(cluster: LoopbackCluster) -> None:
    senders, recv = _run_room(cluster, 40, [[[0, 1]], [[0, 1]]], [[5, 6, 7], [5, 6]])
    assert senders[0].poll() == recv[0].poll() == KVPoll.Failed  # 2 pages sent, 3 announced
    assert "page count mismatch" in senders[0].failure_exception().reason
    assert senders[1].poll() == recv[1].poll() == KVPoll.Success


def test_decode_abort_with_a_write_in_flight_keeps_pages_fenced_until_prefill_drains() -> None:
    c = LoopbackCluster()
    recv = c.decode[0].create_receiver(50)
    recv.init([4, 5], 0)
    sender = c.prefill[0].create_sender(50)
    c.settle()
    # Hold the data plane: the first write is accepted but its completion is not yet delivered.
    sender.send([1], is_last=False)
    recv.abort("user cancelled")
    assert recv.poll() == KVPoll.Failed and recv.pages_fenced()
    with pytest.raises(LocalProtocolError, match="Fenced"):
        recv.clear()  # the engine must not reuse pages a write may still land in
    c.settle()  # abort reaches prefill; its write completes; it tells decode the writes drained
    assert sender.poll() == KVPoll.Failed
    assert not recv.pages_fenced() and recv.poll() == KVPoll.Failed
    recv.clear()
    sender.clear()
    assert c.decode[0].stats()["counters"]["rooms_cleared"] == 1


def test_fence_timer_releases_pages_when_the_drain_confirmation_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    c = LoopbackCluster(timeouts={"fence": 30.0})
    recv = c.decode[0].create_receiver(51)
    recv.init([4, 5], 0)
    sender = c.prefill[0].create_sender(51)
    c.settle()
    sender.send([1], is_last=False)
    real_send = c.prefill[0].endpoint.send
    # the network loses prefill's drained message
    monkeypatch.setattr(
        c.prefill[0].endpoint, "send", lambda peer, data: None if b'"t":"drained"' in data else real_send(peer, data)
    )
    recv.abort()
    c.settle()
    assert sender.poll() == KVPoll.Failed and recv.pages_fenced()
    c.advance(29.0)
    assert recv.pages_fenced()
    c.advance(2.0)
    assert not recv.pages_fenced()
    recv.clear()


def test_a_decode_rank_expects_traffic_while_it_has_rooms_and_a_prefill_rank_never() -> None:
    """``expect_traffic`` hints to the endpoint (push mode: prefill writes into decode's pages):
    decode says off when created, on with its first room, off again once its last room is
    cleared; prefill says off once and never on. Each change is said once."""
    from kvfsm.runtime import DecodeManager, PrefillManager, RuntimeConfig
    from kvfsm.transport.loopback import Fabric

    fab = Fabric(0)
    hints: dict[str, list[bool]] = {"p0": [], "d0": []}
    eps = {name: fab.endpoint(name) for name in hints}
    for name, ep in eps.items():
        ep.expect_traffic = hints[name].append  # type: ignore[attr-defined]
    kv = {"kv": bytearray(4 * 64), "aux": bytearray(64), "page_bytes": 64, "aux_slot_bytes": 64}
    p = PrefillManager(0, eps["p0"], **kv, config=RuntimeConfig(workers=0))  # type: ignore[arg-type]
    d = DecodeManager(0, eps["d0"], prefill_peers={0: "p0"}, **kv, config=RuntimeConfig(workers=0))  # type: ignore[arg-type]
    try:
        d.connect()
        fab.pump()
        assert hints == {"p0": [False], "d0": [False]}
        rooms = [d.create_receiver(r) for r in (1, 2)]
        senders = [p.create_sender(r) for r in (1, 2)]
        assert hints == {"p0": [False], "d0": [False, True]}
        for i, (s, rc) in enumerate(zip(senders, rooms, strict=True)):
            rc.init([2 * i, 2 * i + 1], 0)
            fab.pump()
            s.send([2 * i, 2 * i + 1], is_last=True, aux_slot=0)
            fab.pump()
        assert [rc.poll() for rc in rooms] == [KVPoll.Success] * 2
        rooms[0].clear()
        assert hints["d0"] == [False, True], "one room is left"
        rooms[1].clear()
        for s in senders:
            s.clear()
        assert hints == {"p0": [False], "d0": [False, True, False]}
    finally:
        p.close()
        d.close()
