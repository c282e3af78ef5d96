"""Prefill and decode ranks as real processes over ZMQ + NIXL (kvfsm/node.py, ``kvfsm demo --transport nixl``).

Every byte of every room that succeeds is checked at decode against what prefill computed; a
prefill process killed with SIGKILL mid-transfer must fail only the rooms of the decode rank it
fed, within their timeout, with every other rank finishing and no process left behind. The
multi-host case puts the two sides in two network namespaces joined by a veth pair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvfsm.node import ClusterConfig, run_cluster
from kvfsm.transport.nixl import nixl_available

NIXL_MISSING = nixl_available()
pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")


def _explain(res: dict[str, Any]) -> str:
    tails: dict[str, str] = res.get("stderr_tail") or {}
    return json.dumps(res.get("problems"), indent=1) + "".join(f"\n--- {k} ---\n{v}" for k, v in tails.items())


@pytest.mark.parametrize(
    ("caller_posts", "batched"),
    [("auto", False), ("always", False), ("always", True)],
    ids=["auto", "always", "send_many"],
)
def test_two_processes_move_every_byte(caller_posts: str, batched: bool) -> None:
    """``always``: every write posted by the engine's thread, its completions handed to the
    runtime from inside write() (as on GPUs), not only by the poller. ``send_many``: each chunk
    round of a wave handed over in one send_many() (write_many across the worker shards)."""
    cfg = ClusterConfig(rooms=12, chunks=3, ranks=1, pages_per_chunk=4, page_bytes=8192, concurrency=4, seed=3)
    cfg.caller_posts = caller_posts
    cfg.batched = batched
    res = run_cluster(cfg)
    assert res["ok"], _explain(res)
    assert res["succeeded"] == 12 and res["failed"] == 0
    per_room = cfg.pages_per_room * cfg.page_bytes + cfg.aux_bytes
    assert res["bytes_verified"] == 12 * per_room
    assert res["mismatched_rooms"] == []
    assert set(res["exit_codes"].values()) == {0}


def test_killed_prefill_fails_only_its_rooms_within_the_timeout() -> None:
    cfg = ClusterConfig(
        rooms=9,
        chunks=4,
        ranks=2,
        pages_per_chunk=2,
        page_bytes=4096,
        concurrency=3,
        transfer_timeout=3.0,
        chunk_interval=0.4,
        seed=5,
    )
    res = run_cluster(cfg, kill_prefill=0, kill_at_wave=1)
    assert res["ok"], _explain(res)
    assert res["exit_codes"]["prefill-0"] == -9
    assert all(code == 0 for label, code in res["exit_codes"].items() if label != "prefill-0")
    # decode rank 1 (fed by the surviving prefill rank) finished every room; decode rank 0 lost
    # the rooms from the second wave on, and had finished the first one before the kill
    assert res["succeeded"] >= cfg.rooms + cfg.concurrency
    assert res["failed"] >= cfg.rooms - 2 * cfg.concurrency
    assert res["succeeded"] + res["failed"] == 2 * cfg.rooms
    assert 0 <= res["seconds_kill_to_decode_concluded"] <= cfg.transfer_timeout + 2.0


def test_demo_command_runs_over_nixl() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "demo", "--transport", "nixl", "--rooms", "6", "--ranks", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["ok"] and res["succeeded"] == 6 and res["bytes_verified"] > 0


# --------------------------------------------------------------------------------- two hosts


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str, str, str]]:
    """Two network namespaces joined by a veth pair: (prefill ns, its address, decode ns, its
    address, decode's veth device)."""
    tag = uuid.uuid4().hex[:6]
    p_ns, d_ns = f"kvfsm-p-{tag}", f"kvfsm-d-{tag}"
    p_if, d_if = f"kvp{tag}", f"kvd{tag}"
    octet = 16 + os.getpid() % 200
    p_ip, d_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
    try:
        made = _ip("netns", "add", p_ns)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", d_ns),
            ("link", "add", p_if, "type", "veth", "peer", "name", d_if),
            ("link", "set", p_if, "netns", p_ns),
            ("link", "set", d_if, "netns", d_ns),
            ("-n", p_ns, "addr", "add", f"{p_ip}/24", "dev", p_if),
            ("-n", d_ns, "addr", "add", f"{d_ip}/24", "dev", d_if),
            ("-n", p_ns, "link", "set", p_if, "up"),
            ("-n", d_ns, "link", "set", d_if, "up"),
            ("-n", p_ns, "link", "set", "lo", "up"),
            ("-n", d_ns, "link", "set", "lo", "up"),
        ]
        for step in steps:
            out = _ip(*step)
            if out.returncode != 0:
                pytest.skip(f"cannot set up the veth pair (ip {' '.join(step)}): {out.stderr.strip()}")
        yield p_ns, p_ip, d_ns, d_ip, d_if
    finally:
        _ip("netns", "del", d_ns)
        _ip("netns", "del", p_ns)


def _rx_bytes(netns: str, dev: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def test_demo_across_two_network_namespaces(two_hosts: tuple[str, str, str, str, str]) -> None:
    p_ns, p_ip, d_ns, d_ip, d_if = two_hosts
    rx_before = _rx_bytes(d_ns, d_if)
    cfg = ClusterConfig(
        rooms=8,
        chunks=2,
        ranks=1,
        pages_per_chunk=4,
        page_bytes=8192,
        concurrency=4,
        seed=11,
        prefill_netns=p_ns,
        decode_netns=d_ns,
        prefill_host=p_ip,
        decode_host=d_ip,
        # the data must cross the veth pair too: UCX over TCP only, on the veth devices
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "all"},
    )
    res = run_cluster(cfg)
    assert res["ok"], _explain(res)
    assert res["succeeded"] == 8 and res["mismatched_rooms"] == []
    # the KV really crossed the "network": decode's veth received at least every verified byte
    assert _rx_bytes(d_ns, d_if) - rx_before >= res["bytes_verified"]
