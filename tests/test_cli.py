"""The README's commands, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys


def _kvfsm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfsm.cli", *args], capture_output=True, text=True, timeout=120)


def test_demo_moves_every_room_and_verifies_bytes() -> None:
    out = _kvfsm("demo", "--rooms", "24", "--chunks", "3", "--ranks", "2", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["succeeded"] == 24 and res["failed"] == 0 and res["mismatched_rooms"] == []
    assert res["bytes_verified"] == 24 * 2 * (3 * 4 * 4096 + 64)
    assert res["leftover_rooms"] == 0 and res["rooms_per_second"] > 0


def test_demo_summary_is_human_readable() -> None:
    out = _kvfsm("demo", "--rooms", "8", "--order", "prefill-first")
    assert out.returncode == 0, out.stderr
    assert "bytes verified" in out.stdout and "rooms/s" in out.stdout and out.stdout.rstrip().endswith("OK")


def test_demo_under_loss_duplication_and_reordering_concludes_every_room() -> None:
    out = _kvfsm(
        "demo",
        "--rooms",
        "60",
        "--drop",
        "0.03",
        "--dup",
        "0.05",
        "--delay",
        "0.2",
        "--unordered",
        "--seed",
        "3",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["succeeded"] + res["failed"] == 60
    assert res["failed"] > 0 and res["succeeded"] > 0  # the faults really bit, and not everything died
    assert res["mismatched_rooms"] == [] and res["leftover_rooms"] == 0
    assert res["fabric"]["dropped"] > 0 and res["fabric"]["duplicated"] > 0


def test_docs_check_passes_on_the_committed_docs() -> None:
    out = _kvfsm("docs", "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_kill_prefill_without_a_chunk_interval_pauses_between_chunk_rounds() -> None:
    """``--kill-prefill`` alone gets pauses between chunk rounds (a wave of the defaults moves in
    milliseconds, so the kill used to land after the rooms were over); an explicit
    ``--chunk-interval``, 0 included, is kept, and no kill means no pause."""
    import argparse

    from kvfsm import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    interval = demo._chunk_interval
    assert interval(p.parse_args(["--kill-prefill", "0"])) == demo.KILL_CHUNK_INTERVAL_S > 0
    assert interval(p.parse_args(["--kill-prefill", "0", "--chunk-interval", "0"])) == 0.0
    assert interval(p.parse_args(["--kill-prefill", "1", "--chunk-interval", "0.25"])) == 0.25
    assert interval(p.parse_args([])) == 0.0
