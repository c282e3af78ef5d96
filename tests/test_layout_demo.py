"""The heterogeneous-layout demo: rooms between TP groups of different sizes, page sizes and orders,
every element at decode checked against the cache a single engine would hold."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvfsm import layout_demo
from kvfsm.layout.engine import EngineCache
from kvfsm.layout_demo import LayoutDemoConfig, run_layout_demo
from kvfsm.transport.nixl import nixl_available

NIXL_MISSING = nixl_available()


def run(**kw: Any) -> dict[str, Any]:
    cfg = LayoutDemoConfig(**{"rooms": 6, "concurrency": 3, "tokens_min": 90, "tokens_max": 300, **kw})
    res = run_layout_demo(cfg)
    assert res["ok"], res["problems"]
    assert res["succeeded"] == cfg.rooms and res["failed"] == res["stuck"] == res["leftover_rooms"] == 0
    # what decode holds: every decode rank its own heads (the latent on every rank with MLA)
    heads = cfg.decode_tp if cfg.mla else max(cfg.kv_heads, cfg.decode_tp)
    per_token = cfg.layers * (1 if cfg.mla else 2) * heads * cfg.head_dim
    assert res["elements_checked"] == res["tokens"] * per_token
    assert res["aux_bytes_checked"] == cfg.rooms * cfg.decode_tp * cfg.aux_bytes
    dpr = res["descriptors_per_room"]
    assert 0 < dpr["min"] <= dpr["mean"] <= dpr["max"]
    assert dpr["mean"] * cfg.rooms == pytest.approx(res["descriptors"])  # per room as the counters say
    return res


@pytest.mark.parametrize(
    ("tp", "td", "ps", "pd"),
    [(2, 4, 16, 64), (4, 2, 64, 16)],
    ids=["tp2-tp4-16-64", "tp4-tp2-64-16"],
)
def test_loopback_moves_every_element_between_tp_groups_and_page_sizes(tp: int, td: int, ps: int, pd: int) -> None:
    res = run(prefill_tp=tp, decode_tp=td, prefill_page=ps, decode_page=pd)
    assert res["mapping"]["sending_prefill_ranks"] == list(range(tp))
    assert res["mapping"]["sources_per_decode_rank"] == [1 if tp < td else tp // td] * td
    # SGLang's order between different TP sizes: one run per (layer, K/V, token, pair), no two
    # tokens adjacent on both sides; and each pair's aux write, once per room
    pairs = len(res["mapping"]["pairs"])
    assert res["descriptors"] == 4 * 2 * res["tokens"] * pairs + 6 * pairs


def test_loopback_mla_every_decode_rank_gets_the_latent() -> None:
    res = run(prefill_tp=2, decode_tp=4, prefill_page=16, decode_page=64, mla=True, kv_heads=1, head_dim=576)
    assert res["mapping"]["sources_per_decode_rank"] == [1] * 4


def test_loopback_mla_a_prefill_rank_that_sends_nothing_takes_no_part() -> None:
    res = run(prefill_tp=4, decode_tp=2, prefill_page=64, decode_page=16, mla=True, kv_heads=1, head_dim=64)
    assert res["mapping"]["sending_prefill_ranks"] == [0, 1]


@pytest.mark.parametrize("order", ["vllm_hnd", "vllm_cpu"])
def test_loopback_vllm_orders_with_replicated_heads(order: str) -> None:
    run(prefill_tp=2, decode_tp=4, prefill_page=32, decode_page=16, kv_order=order, kv_heads=2, order="prefill-first",
        verify_plans=True)  # fmt: skip


def test_the_demo_catches_a_prefill_rank_that_holds_the_wrong_values(monkeypatch: pytest.MonkeyPatch) -> None:
    fill = EngineCache.fill

    def wrong_on_rank_1(self: EngineCache, pages: Any, num_tokens: int, seed: int) -> None:
        fill(self, pages, num_tokens, seed + (self.layout.tp_rank == 1 and self.layout.tp_size == 2))

    monkeypatch.setattr(EngineCache, "fill", wrong_on_rank_1)
    res = run_layout_demo(LayoutDemoConfig(rooms=2, prefill_tp=2, decode_tp=4, tokens_min=50, tokens_max=90))
    assert not res["ok"]
    # prefill rank 1 holds heads 4..7 and feeds decode ranks 2 and 3
    assert any("sglang rank 2/4: layer 0 K token 0 head 4 dim" in p for p in res["problems"]), res["problems"]


def test_the_demo_catches_a_byte_left_outside_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    fill = EngineCache.fill

    def one_token_too_many(self: EngineCache, pages: Any, num_tokens: int, seed: int) -> None:
        # prompts end inside a page: the extra token lands in the request's last page, never erased
        fill(self, pages, num_tokens + (self.layout.page_size == 16), seed)

    monkeypatch.setattr(EngineCache, "fill", one_token_too_many)
    res = run_layout_demo(LayoutDemoConfig(rooms=2, prefill_page=16, decode_page=64, tokens_min=50, tokens_max=90))
    assert not res["ok"] and res["succeeded"] == 2 and res["elements_checked"] > 0
    assert [p.split(":")[0] for p in res["problems"]] == [
        "after wave 0, prefill rank 0",
        "after wave 0, prefill rank 1",
    ]
    assert "is outside every request" in res["problems"][0]


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
@pytest.mark.parametrize(
    ("tp", "td", "ps", "pd"),
    [(2, 4, 16, 64), (4, 2, 64, 16)],
    ids=["tp2-tp4-16-64", "tp4-tp2-64-16"],
)
def test_nixl_moves_every_element_between_tp_groups_and_page_sizes(tp: int, td: int, ps: int, pd: int) -> None:
    res = run(prefill_tp=tp, decode_tp=td, prefill_page=ps, decode_page=pd, transport="nixl", rooms=4, concurrency=2)
    assert res["transport"] == "zmq+nixl"
    assert res["bytes_written_by_prefill"] >= res["elements_checked"] * 2


def _kvfsm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfsm.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_runs_the_layout_demo_and_reports_json() -> None:
    out = _kvfsm("demo", "--prefill-tp", "4", "--decode-tp", "2", "--prefill-page", "64", "--decode-page", "16",
                 "--rooms", "3", "--tokens-max", "200", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["ok"] and res["rooms"] == 3 and res["elements_checked"] == res["tokens"] * 4 * 2 * 8 * 64
    assert set(res["descriptors_per_room"]) == {"min", "mean", "max"}


def test_cli_refuses_ranks_with_tp_flags_and_impossible_layouts() -> None:
    out = _kvfsm("demo", "--ranks", "2", "--prefill-tp", "2")
    assert out.returncode == 2 and "--ranks" in out.stderr and "conflicts" in out.stderr
    out = _kvfsm("demo", "--prefill-tp", "3", "--decode-tp", "2")
    assert out.returncode == 2 and "do not split evenly over TP 3" in out.stderr


def test_only_the_layout_flags_select_the_layout_demo() -> None:
    import argparse

    from kvfsm import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert not layout_demo.requested(p.parse_args(["--ranks", "4", "--kv-order", "vllm_hnd"]))
    for flags in (["--mla"], ["--decode-page", "32"], ["--prefill-tp", "1"]):
        assert layout_demo.requested(p.parse_args(flags))
