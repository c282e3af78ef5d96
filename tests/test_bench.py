"""bench/core.py runs end to end and writes the JSON it promises (figures are not judged here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_core_bench_quick_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "core.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "core.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["step"]["us_per_step"] > 0 and res["step"]["us_per_step_transitions"] > res["step"]["us_per_step"]
    assert set(res["churn"]) >= {"100", "1000", "ratio_high_to_low"}
    assert {"stream", "single", "scattered"} <= set(res["bandwidth"])
    hot = res["hot_path"]  # (the runtime's fast rows may cost less than the bare generic step: no order)
    assert min(hot["send_us"], hot["core_send_step_us"], hot["completion_us"], hot["core_completion_step_us"]) > 0
    long_chunks = res["long_chunks"]  # send() of long chunks, pages held three ways, against 16 pages
    assert set(long_chunks) == {"list", "numpy", "range"}
    for row in long_chunks.values():
        assert row["16"] > 0 and row["256"] > 0 and "extra_us_per_1k_pages_at_256" in row
    assert set(res["goals"]) == {"step_us_le_10", "churn_10k_within_1.5x_of_100", "bandwidth_16MiB_ge_0.8x_memcpy"}
    for row in res["announce"].values():  # a page run's room_pages, as the run and as an array
        assert row["run_us"] > 0 and row["array_us"] > 0 and row["run_bytes"] < row["array_bytes"]
    for name, row in res["codec"].items():  # every wire message, Codec beside its baseline
        base = row["baseline"]
        assert min(row["encode_us"], row["decode_us"], row[f"{base}_encode_us"], row[f"{base}_decode_us"]) > 0, name
    assert {"chunk_written", "aux_written"} <= set(res["codec"]) and res["codec"]["chunk_written"]["pack_us"] > 0
    for rooms in res["rooms"].values():
        assert rooms["rooms_per_second"] > 0
    dec = res["decode_path"]  # decode's CPU per chunk notification, fast rows and generic
    assert dec["notification_us"] > 0 and dec["generic_notification_us"] > 0
    nixl = res["nixl_path"]  # the runtime + NIXL data plane's Python per chunk (a stub agent)
    if "skipped" not in nixl:
        assert nixl["baseline_null_plane_us"] > 0
        for case in ("16_send", "16_send_many", "256_send", "256_send_many"):
            row = nixl[case]  # more than the null plane's; the engine's writes folded into few transfers
            assert row["process_us"] >= row["engine_us"] > 0
            assert 0 < row["transfers_per_chunk"] < 0.5 and row["tail_us"] > 0
        assert nixl["16_send"]["tail_no_flush_us"] > 0
        assert nixl["16_send"]["generic_engine_us"] > 0 and nixl["16_send_many"]["generic_engine_us"] > 0
        scattered = nixl["256_scattered_send"]  # a segment per page: arrays, and Segments as the baseline
        assert scattered["segments_engine_us"] > 0 and scattered["engine_us"] > 0


def test_check_bench_quick_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "check.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    (smoke,) = res["runs"]
    assert smoke["complete"] and smoke["violations"] == [] and smoke["states_per_second"] > 0
    assert smoke["bytes_per_state"] > 0 and res["transitions_steps_per_second"] > 0


def test_transfer_bench_quick_run_writes_json(tmp_path: Path) -> None:
    from kvfsm.transport.nixl import nixl_available

    if (why := nixl_available()) is not None:
        pytest.skip(f"NIXL: {why}")
    out = tmp_path / "transfer.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    layouts = {(c["size"], c["layout"]) for c in res["cases"]}
    assert {(1 << 20, "contig"), (1 << 20, "scattered")} <= layouts
    assert res["apis"] == ["send", "send_many"]  # both engine APIs by default
    for c in res["cases"]:
        assert c["raw_gbps"] > 0 and c["raw_reps_seconds"] == [c["raw_seconds"]]
        for pre, ratio in (("kvfsm", "ratio"), ("kvfsm_many", "ratio_many")):
            assert c[f"{pre}_gbps"] > 0 and c[ratio] == c[f"{pre}_gbps"] / c["raw_gbps"]
            # --quick: one measured repetition, after the warm-up
            assert c[f"{pre}_reps_seconds"] == [c[f"{pre}_seconds"]]
            assert 0 < c[f"{pre}_send_cpu_seconds"] and 0 < c[f"{pre}_send_seconds"] < c[f"{pre}_seconds"]
            # kvfsm posted what the layout asks for: one descriptor per contiguous chunk (plus the
            # aux write of each room's last chunk), one per page when scattered
            per_chunk = c["descriptors_per_transfer"]
            assert per_chunk <= c[f"{pre}_descriptors_per_chunk"] <= per_chunk + 1
            # raw NIXL posts the same descriptors, the aux slots included
            assert c["raw_descriptors_per_chunk"] == c[f"{pre}_descriptors_per_chunk"]
            # NIXL got at most those (a folded transfer's adjacent writes merged)
            assert 0 < c[f"{pre}_posted_descriptors_per_chunk"] <= c[f"{pre}_descriptors_per_chunk"]
        rooms, chunks = c["plan"]
        # host memory: each room's aux slot rides in its last chunk's transfer; scattered chunks
        # (block indices) cannot share one with it
        assert c["raw_transfers"] == rooms * chunks + (rooms if c["layout"] == "scattered" else 0)
    goal = res["goal"]
    assert set(goal) == {"kvfsm_ge_0.9x_raw_for_chunks_ge_1MiB", "worst_ratio_ge_1MiB"}
    assert set(goal["worst_ratio_ge_1MiB"]) == {"send", "send_many"}


def test_transfer_bench_stops_at_once_when_a_process_fails(tmp_path: Path) -> None:
    """A process that dies (here the initiator, on a device that does not exist) ends the run
    with an error naming it, rather than leaving the driver and the other process waiting for
    the report (up to 600 s)."""
    from kvfsm.transport.nixl import nixl_available

    if (why := nixl_available()) is not None:
        pytest.skip(f"NIXL: {why}")
    argv = ["--quick", "--sizes", "64", "--layouts", "contig", "--device", "nope", "--target-device", "cpu"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer.py"), *argv, "--out", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "the initiator process exited with code 1 before the initiator reported" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "t.json").exists()


def test_transfer_bench_profile_reports_threads_and_nixl_calls(tmp_path: Path) -> None:
    from kvfsm.transport.nixl import nixl_available

    if (why := nixl_available()) is not None:
        pytest.skip(f"NIXL: {why}")
    out = tmp_path / "transfer.json"
    argv = ["--quick", "--sizes", "1024", "--layouts", "contig", "--api", "send", "--profile", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer.py"), *argv],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    prof = case["kvfsm_profile"]
    assert prof["thread_cpu_seconds"]["MainThread"] > 0 and prof["decode_thread_cpu_seconds"]["MainThread"] > 0
    calls = prof["nixl_calls"]
    # the engine posts its writes itself or queues them for the data plane's threads: either
    # way some thread made transfers, and every timed method has calls, wall and CPU seconds
    assert sum(v["calls"] for k, v in calls.items() if k.endswith("/transfer")) >= 1
    for row in calls.values():
        assert row["calls"] >= 1 and row["seconds"] >= 0 and row["cpu_seconds"] >= 0


def test_transfer_bench_floor_times_the_leanest_pipelined_loop(tmp_path: Path) -> None:
    """``--floor``: the leanest pipelined Python on NIXL (no protocol), for each µs of spinning per
    chunk, served by the raw target (which counts every transfer's notification)."""
    from kvfsm.transport.nixl import nixl_available

    if (why := nixl_available()) is not None:
        pytest.skip(f"NIXL: {why}")
    out = tmp_path / "transfer.json"
    argv = ["--quick", "--sizes", "64", "--layouts", "contig", "--api", "send", "--floor", "0,50", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer.py"), *argv],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    floor = case["floor"]
    assert set(floor) == {"0.0", "50.0"}
    rooms, chunks = case["plan"]
    for row in floor.values():
        assert row["gbps"] > 0 and row["ratio"] == row["gbps"] / case["raw_gbps"]
        assert row["reps_seconds"] == [row["seconds"]]  # --quick: one measured repetition
        # every chunk posted (folded or not), the aux slots in the KV's transfers on host memory
        assert 0 < row["transfers"] <= rooms * chunks and row["transfers_per_chunk"] <= 1
    # the spinning shows in the engine's CPU per chunk (a 64 KiB copy costs ~15 µs here)
    assert floor["50.0"]["cpu_us_per_chunk"] - floor["0.0"]["cpu_us_per_chunk"] >= 30
    assert "floor / raw" in proc.stdout


def _transfer_module() -> Any:
    """bench/transfer.py imported as a module (its helpers, not a run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_transfer", ROOT / "bench" / "transfer.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_transfer_bench_takes_repetitions_in_blocks_or_round_after_round() -> None:
    """``_measure``: one warm-up and ``reps`` repetitions of every contestant, each one's back
    to back (``--order blocks``) or one of each per round (``interleaved``), then each
    contestant's figures once."""
    bench = _transfer_module()
    log: list[str] = []

    class Contestant:
        def __init__(self, name: str) -> None:
            self.name = name

        def rep(self) -> None:
            log.append(self.name)

        def finish(self) -> None:
            log.append(self.name + ".finish")

    bench._measure([Contestant("raw"), Contestant("send")], 2, False)
    assert log == ["raw"] * 3 + ["send"] * 3 + ["raw.finish", "send.finish"]
    log.clear()
    bench._measure([Contestant("raw"), Contestant("send")], 2, True)
    assert log == ["raw", "send"] * 3 + ["raw.finish", "send.finish"]


def test_transfer_bench_check_finds_a_page_that_was_not_written_right() -> None:
    """The target checks every page a repetition writes, raw NIXL's as kvfsm's: one wrong byte
    in any page of any room fails the check (both layouts)."""
    import torch

    bench = _transfer_module()
    for case in bench.cases([64 << 10], 1 << 20):
        rooms, chunks = case["plan"]
        page = case["page"]
        expected = bench._buffer(bench._extent(case), "cpu", 7)
        dst = torch.zeros_like(expected)
        assert not bench._check(dst, expected, case)  # nothing written
        for r in range(rooms):
            for c in range(chunks):
                for sp, dp in zip(
                    bench.pages_of(case, r, c, "prefill"), bench.pages_of(case, r, c, "decode"), strict=True
                ):
                    dst[dp * page : (dp + 1) * page] = expected[sp * page : (sp + 1) * page]
        assert bench._check(dst, expected, case), case["layout"]
        last = bench.pages_of(case, rooms - 1, chunks - 1, "decode")[-1]
        dst[last * page + page - 1] ^= 1  # the last byte of the last page written
        assert not bench._check(dst, expected, case), case["layout"]


def test_transfer_bench_interleaved_order_pairs_every_round(tmp_path: Path) -> None:
    """``--order interleaved``: raw NIXL's and kvfsm's repetitions round after round in the same
    processes (raw NIXL's bytes checked by the target too), each API's ratio also as the median
    of its rounds' ratios."""
    from kvfsm.transport.nixl import nixl_available

    if (why := nixl_available()) is not None:
        pytest.skip(f"NIXL: {why}")
    out = tmp_path / "transfer.json"
    argv = ["--quick", "--reps", "3", "--sizes", "1024", "--layouts", "contig", "--order", "interleaved",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer.py"), *argv],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["order"] == "interleaved"
    (case,) = res["cases"]
    for pre, ratio in (("kvfsm", "ratio"), ("kvfsm_many", "ratio_many")):
        assert len(case[f"{pre}_reps_seconds"]) == len(case["raw_reps_seconds"])
        rounds = sorted(r / k for r, k in zip(case["raw_reps_seconds"], case[f"{pre}_reps_seconds"], strict=True))
        assert case[ratio + "_paired"] == rounds[len(rounds) // 2]


def test_cpus_bench_quick_run_times_each_cpu_alone_and_beside_a_busy_one(tmp_path: Path) -> None:
    """bench/cpus.py: the loop's speed on every CPU alone, its slowdown on every other CPU beside
    each busy one (``--slowed 0`` lists them all), and its rounds pinned to one CPU over time."""
    import os

    out = tmp_path / "cpus.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cpus.py"), "--quick", "--slowed", "0",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    cpus = sorted(os.sched_getaffinity(0))
    assert res["cpus"] == cpus and set(res["alone_us_per_iteration"]) == {str(c) for c in cpus}
    assert all(v > 0 for v in res["alone_us_per_iteration"].values()) and res["alone_slowest_over_fastest"] >= 1
    assert set(res["beside"]) == {str(c) for c in {cpus[0], cpus[len(cpus) // 2], cpus[-1]}}
    for busy, row in res["beside"].items():
        others = [c for c in cpus if str(c) != busy]
        assert row["slowed"] == others and set(row["slowdown"]) == {str(c) for c in others}
    t = res["over_time"]
    assert t["rounds"] > 0 and 0 < t["round_ms_median"] <= t["round_ms_p95"] and t["second_medians_ms"]
