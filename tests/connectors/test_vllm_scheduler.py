"""The scheduler half of KvfsmConnector without vLLM: requests are plain objects with the
attributes vLLM's Request has that it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvfsm.config import ConfigError
from kvfsm.connectors.vllm.config import VllmConnectorConfig
from kvfsm.connectors.vllm.scheduler import PrefillAddress, SchedulerSide, room_of

BS = 32


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = field(default=None)


def prefill() -> SchedulerSide:
    s = SchedulerSide(VllmConnectorConfig(), BS, "P")
    s.set_workers({0: ("tcp://127.0.0.1:5555", "kvfsm-P/prefill/0/x")})
    return s


def test_a_finished_prefill_request_keeps_its_blocks_and_returns_the_params_decode_needs():
    s = prefill()
    r = Req("r1", list(range(70)), {"do_remote_decode": True})
    delay, params = s.finished(r, [4, 9, 2, 7], normally=True)
    assert delay and params is not None
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["kvfsm_room"] == room_of("P/r1") and params["remote_num_tokens"] == 70
    assert params["kvfsm_bootstrap"] == "tcp://127.0.0.1:5555" and params["kvfsm_prefill_names"] == [
        "kvfsm-P/prefill/0/x"
    ]
    (send,) = s.take_plan().sends
    assert send.pages == (4, 9, 2) and send.tokens == 70  # 70 tokens: three blocks of 32
    assert s.pending()
    s.finished_transfers({"r1"}, None)
    assert not s.pending() and not s.take_plan().sends


@pytest.mark.parametrize(
    ("params", "normally", "blocks"),
    [(None, True, [1]), ({"do_remote_decode": False}, True, [1]), ({"do_remote_decode": True}, False, [1]),
     ({"do_remote_decode": True}, True, [])],
)  # fmt: skip
def test_other_requests_free_their_blocks_at_once(params, normally, blocks):
    s = prefill()
    assert s.finished(Req("r", [1, 2, 3], params), blocks, normally) == (False, None)
    assert not s.take_plan().sends and not s.pending()


def decode_params(**change: Any) -> dict[str, Any]:
    s = prefill()
    _, params = s.finished(Req("p1", list(range(40)), {"do_remote_decode": True}), [1, 2], True)
    assert params is not None
    return params | change


def test_a_decode_request_loads_the_whole_prompt_into_the_blocks_vllm_allocates():
    s = SchedulerSide(VllmConnectorConfig(), BS, "D")
    r = Req("d1", list(range(40)), decode_params())
    assert s.matched_tokens(r, 0) == (40, True)
    s.allocated(r, [7, 3, 11], 40)
    (recv,) = s.take_plan().recvs
    assert recv.pages == (7, 3) and recv.tokens == 40 and recv.room == room_of("P/p1")
    assert recv.prefill == PrefillAddress("tcp://127.0.0.1:5555", ("kvfsm-P/prefill/0/x",))
    assert r.kv_transfer_params is not None and r.kv_transfer_params["do_remote_prefill"] is False
    assert s.matched_tokens(r, 0) == (0, False)  # one transfer per request
    assert s.pending()
    s.finished_transfers(None, {"d1"})
    assert not s.pending()


def test_a_decode_request_with_a_local_prefix_hit_computes_its_prompt_itself():
    s = SchedulerSide(VllmConnectorConfig(), BS, "D")
    assert s.matched_tokens(Req("d1", list(range(40)), decode_params()), 32) == (0, False)


def test_an_abort_while_receiving_aborts_the_room_and_vllm_keeps_the_blocks():
    s = SchedulerSide(VllmConnectorConfig(), BS, "D")
    r = Req("d1", list(range(40)), decode_params())
    s.matched_tokens(r, 0)
    s.allocated(r, [7, 3], 40)
    s.take_plan()
    assert s.finished(r, [7, 3], normally=False) == (False, None)
    assert s.take_plan().aborts == ["d1"]


@pytest.mark.parametrize(
    ("change", "words"),
    [({"kvfsm": 9}, "version 9"), ({"kvfsm_prefill_names": []}, "non-empty"), ({"kvfsm_bootstrap": 5}, "string"),
     ({"transfer_mode": "teleport"}, "teleport")],
)  # fmt: skip
def test_malformed_params_leave_the_prompt_to_decode_with_the_reason_logged(change, words, caplog):
    s = SchedulerSide(VllmConnectorConfig(), BS, "D")
    assert s.matched_tokens(Req("d1", [1, 2], decode_params(**change)), 0) == (0, False)
    assert words in caplog.text
    assert not s.pending()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_transfer_mode_is_chosen_per_request_and_travels_in_the_params(mode):
    s = prefill()  # its default: push
    _, params = s.finished(Req("p", list(range(40)), {"do_remote_decode": True, "transfer_mode": mode}), [1, 2], True)
    assert params is not None and params["transfer_mode"] == mode
    assert s.take_plan().sends[0].mode == mode
    d = SchedulerSide(VllmConnectorConfig(), BS, "D")
    r = Req("d", list(range(40)), params)
    d.matched_tokens(r, 0)
    d.allocated(r, [5, 6], 40)
    assert d.take_plan().recvs[0].mode == mode


def test_the_configured_mode_is_the_default_and_a_bad_one_keeps_no_kv(caplog):
    s = SchedulerSide(VllmConnectorConfig(transfer_mode="pull"), BS, "P")
    s.set_workers({0: ("tcp://127.0.0.1:5555", "n")})
    _, params = s.finished(Req("p", [1, 2, 3], {"do_remote_decode": True}), [1], True)
    assert params is not None and params["transfer_mode"] == "pull"
    delay, params = s.finished(Req("q", [1, 2, 3], {"do_remote_decode": True, "transfer_mode": "x"}), [2], True)
    assert not delay and params is not None and "'x'" in params["kvfsm_error"]
    assert [send.req_id for send in s.take_plan().sends] == ["p"]


def test_the_extra_config_is_validated_and_unknown_keys_refused():
    assert VllmConnectorConfig.from_extra(None) == VllmConnectorConfig()
    assert VllmConnectorConfig.from_extra({"hold_timeout_s": 5}).hold_timeout_s == 5
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config keys"):
        VllmConnectorConfig.from_extra({"holdtimeout": 5})
    with pytest.raises(ConfigError, match="host"):
        VllmConnectorConfig(host="0.0.0.0")
