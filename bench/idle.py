"""bench/idle.py: the CPU an idle kvfsm rank pair spends over NIXL (JSON), with baselines measured
in the same run.

One process, a PrefillManager and a DecodeManager over ZMQ control + NIXL data planes, connected
and idle; the process's CPU time over ``--seconds`` of wall time, as % of one core, in phases:

  hinted      no room anywhere: each manager has told its data plane that no peer is expected to
              write into it (``expect_traffic(False)``), so its poller waits up to
              ``quiet_poll_s`` between polls
  waiting     decode has a room whose pages it announced, no chunk sent yet: decode expects
              writes and polls every ``idle_poll_s`` (prefill stays quiet)
  unhinted    baseline, no room: both data planes told to expect traffic, so that they poll as
              a data plane without the hint would (every ``idle_poll_s``)
  nixl_progress_thread
              baseline: one bare NIXL agent with NIXL's own progress thread (the Python API's
              default), after the managers are closed

Writes JSON (default bench/results/idle.json); ``goal``: hinted ≤ 1 % of a core for the pair, and
at most a fifth of unhinted.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from transfer import _kvfsm_endpoint  # noqa: E402  (the bench's own endpoint factory)


def _cpu_percent(seconds: float) -> float:
    """This process's CPU over ``seconds`` of wall time, as % of one core."""
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - t0) * 100


def measure(seconds: float) -> dict[str, Any]:
    from kvfsm.protocol import KVPoll
    from kvfsm.runtime import DecodeManager, PrefillManager, RuntimeConfig
    from kvfsm.transport.nixl import load_nixl
    from kvfsm.transport.zmq import BootstrapServer

    server = BootstrapServer()
    eps = {side: _kvfsm_endpoint(f"idle-{side}", side, server.address, {}) for side in ("prefill", "decode")}
    regions = {"kv": bytearray(1 << 20), "aux": bytearray(1024), "page_bytes": 4096, "aux_slot_bytes": 64}
    cfg = RuntimeConfig(workers=0)
    p = PrefillManager(0, eps["prefill"], **regions, config=cfg)  # type: ignore[arg-type]
    regions = {**regions, "kv": bytearray(1 << 20)}
    d = DecodeManager(0, eps["decode"], prefill_peers={0: "idle-prefill"}, **regions, config=cfg)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    try:
        d.connect()
        deadline = time.monotonic() + 30
        while d.link_state(0) != "ready":
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench/idle.py: decode's link to prefill is {d.link_state(0)}")
            time.sleep(0.01)
        time.sleep(0.2)  # the hot window after the handshake's traffic passes
        out["hinted"] = _cpu_percent(seconds)
        room = d.create_receiver(1)
        p.create_sender(1)
        room.init([0, 1], 0)
        if d.wait([1], KVPoll.WaitingForInput, timeout=30) != [KVPoll.WaitingForInput]:
            raise RuntimeError("bench/idle.py: decode did not announce its pages")
        time.sleep(0.2)
        out["waiting"] = _cpu_percent(seconds)
        room.abort("bench over")
        for ep in eps.values():
            ep.expect_traffic(True)  # as before the hint: poll every idle_poll_s
        time.sleep(0.2)
        out["unhinted"] = _cpu_percent(seconds)
    finally:
        p.close()
        d.close()
        for ep in eps.values():
            ep.close()
        server.close()
    agent_cls, config_cls, _ = load_nixl()
    agent = agent_cls("idle-nixl", config_cls(enable_prog_thread=True, backends=["UCX"]))
    time.sleep(0.2)
    out["nixl_progress_thread"] = _cpu_percent(seconds)
    del agent
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", default="bench/results/idle.json")
    ap.add_argument("--seconds", type=float, default=3.0, help="wall time per phase")
    args = ap.parse_args(argv)
    cpu = measure(args.seconds)
    result = {
        "bench": "idle",
        "cpu_percent_of_a_core": cpu,
        "goal": {
            "hinted_le_1_percent": cpu["hinted"] <= 1.0,
            "hinted_le_a_fifth_of_unhinted": cpu["hinted"] <= cpu["unhinted"] / 5,
        },
        "seconds_per_phase": args.seconds,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
