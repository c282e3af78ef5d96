"""The worker half of KvfsmConnector without vLLM: a prefill and a decode ``WorkerSide`` with CPU
KV caches shaped as vLLM's CPU backend shapes them, over a real ZMQ control plane and a real NIXL
data plane, driven by the plans the scheduler half would hand them."""

from __future__ import annotations

import time

import pytest
import torch

from kvfsm.connectors.vllm.config import VllmConnectorConfig
from kvfsm.connectors.vllm.scheduler import PrefillAddress, Recv, Send, StepPlan
from kvfsm.connectors.vllm.worker import ModelShape, WorkerSide
from kvfsm.transport.nixl import nixl_available

if (_why := nixl_available()) is not None:
    pytest.skip(f"NIXL: {_why}", allow_module_level=True)

LAYERS, HEADS, D, BS, BLOCKS = 2, 2, 8, 32, 16
SHAPE = ModelShape(HEADS, D, 1, 0, BS)


def caches(fill: float | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.rand(BLOCKS, HEADS, BS, 2 * D, generator=g)
            if fill is None
            else torch.full((BLOCKS, HEADS, BS, 2 * D), fill)
        )
        for i in range(LAYERS)
    }


@pytest.fixture
def workers():
    config = VllmConnectorConfig(host="127.0.0.1", hold_timeout_s=10.0, bootstrap_timeout_s=10.0)
    p = WorkerSide(config, "P", SHAPE, produces=True, consumes=False)
    d = WorkerSide(config, "D", SHAPE, produces=False, consumes=True)
    pk, dk = caches(None), caches(-1.0)
    p.register(pk)
    d.register(dk)
    try:
        yield p, d, pk, dk
    finally:
        d.close()
        p.close()


def transfer(
    p: WorkerSide, d: WorkerSide, req: str, room: int, mode: str, pages: tuple[int, ...], dst: tuple[int, ...]
):
    bootstrap, name = p.handshake() or ("", "")
    tokens = len(pages) * BS - 5  # a partly used last block
    p.start(StepPlan(sends=[Send(req, room, pages, tokens, mode)]))
    d.start(StepPlan(recvs=[Recv(req, room, dst, tokens, PrefillAddress(bootstrap, (name,)), mode)]))
    sent = recvd = None
    deadline = time.monotonic() + 30
    while (sent is None or recvd is None) and time.monotonic() < deadline:
        fp, fd = p.finished(), d.finished()
        if req in fp.sending:
            sent = fp
        if req in fd.recving:
            recvd = fd
        time.sleep(0.01)
    assert sent is not None and recvd is not None, "the transfer did not conclude"
    return recvd


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_request_moves_between_the_workers_and_a_lost_link_is_replaced(workers, mode):
    p, d, pk, dk = workers
    got = transfer(p, d, "r1", 11, mode, (3, 4, 5), (9, 1, 7))
    assert not got.failed
    for name in pk:
        assert torch.equal(dk[name][[9, 1, 7]], pk[name][[3, 4, 5]])  # whole cells of the three blocks
    assert (dk[name][[0, 2, 3]] == -1.0).all()
    # the control link to the prefill rank is lost (a missed heartbeat): that manager keeps its
    # name lost; the next request links again through a fresh one, and the old one is closed
    (first,) = d._decode.values()
    _, pname = p.handshake() or ("", "")
    first.manager._on_peer_lost(pname, "heartbeat missed")
    assert first.manager.link_state(0) == "lost"
    got = transfer(p, d, "r2", 12, mode, (6, 7), (2, 3))
    assert not got.failed
    (second,) = d._decode.values()
    assert second is not first and d._retiring == []
    for name in pk:
        assert torch.equal(dk[name][[2, 3]], pk[name][[6, 7]])
