"""The worker half of ``KvfsmConnector``: one vLLM worker (a TP rank) running kvfsm rooms over
the ZMQ control plane and the NIXL data plane, its KV cache tensors registered as they are.

No vLLM import: the connector hands over the KV tensors, the model's shape and each step's
``StepPlan``. A prefill worker has one ``PrefillManager``; TP rank 0 also runs the engine's
bootstrap service, where every rank's control plane registers. A decode worker has one
``DecodeManager`` per prefill engine it receives from (found through that engine's bootstrap
service, named in the request's params), created on the first request that names it.

Each step (``start``) takes the plan's sends (a room created and its one chunk handed over: the
whole prompt, held until decode announces its blocks), receives (a room created, its blocks
announced as soon as the link to every source is up) and aborts; ``finished`` polls the rooms
(timers fire there) and reports those that concluded. A failed receive is reported finished
too, with its blocks as load errors, and only once nothing can still be written into them.
The aux slot carries the prompt's token count, which decode checks. In pull mode (``Send.mode``,
``Recv.mode``) prefill offers the blocks instead (no aux slot: the lease's grant carries the
token count) and decode reads them into its blocks; a send is reported finished once no read
can still target its blocks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfsm.connectors.vllm.config import VllmConnectorConfig
from kvfsm.connectors.vllm.scheduler import PrefillAddress, Recv, Send, StepPlan
from kvfsm.layout import KVLayout, KVOrder
from kvfsm.protocol import KVPoll, LocalProtocolError
from kvfsm.runtime import DecodeManager, KVReceiver, KVSender, PrefillManager, RuntimeConfig
from kvfsm.runtime.pull import KVOffer, KVPuller

log = logging.getLogger("kvfsm.connectors.vllm")

AUX_BYTES = 8  # one slot: the prompt's token count (uint64), which decode checks


@dataclass(frozen=True)
class ModelShape:
    """What the layout needs of the model and this rank."""

    num_kv_heads: int  # the model's total
    head_dim: int
    tp_size: int
    tp_rank: int
    block_size: int
    mla: bool = False


def layout_of(kv_caches: dict[str, Any], shape: ModelShape) -> tuple[KVLayout, list[Any]]:
    """The rank's ``KVLayout`` and its buffers (one tensor per layer, in layer order) from vLLM's
    ``register_kv_caches`` dict. Recognised: the CPU backend's ``[blocks, heads, block_size,
    2*head_dim]`` (vllm_cpu), ``[2, blocks, block_size, heads, head_dim]`` (vllm_nhd) and ``[2,
    blocks, heads, block_size, head_dim]`` (vllm_hnd); ``LayoutError`` otherwise, or where the
    shape cannot tell NHD from HND (as many local heads as tokens per block)."""
    from kvfsm.layout import LayoutError, heads_of

    names = sorted(kv_caches, key=_layer_index)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        raise LayoutError("KvfsmConnector: every layer's KV cache must have one shape and dtype")
    if any(not t.is_contiguous() for t in tensors):
        raise LayoutError("KvfsmConnector: a layer's KV cache is not contiguous")
    local = len(heads_of(shape.num_kv_heads, shape.tp_size, shape.tp_rank))
    bs, d, dims = shape.block_size, shape.head_dim, tuple(first.shape)
    opaque = False
    if len(dims) == 4 and dims[1:] == (local, bs, 2 * d):
        # the CPU kernels keep each block's K transposed: whole (block, head) cells only
        order, pages, opaque = KVOrder.VLLM_CPU, dims[0], True
    elif len(dims) == 5 and dims[0] == 2 and local != bs and dims[2:] == (bs, local, d):
        order, pages = KVOrder.VLLM_NHD, dims[1]
    elif len(dims) == 5 and dims[0] == 2 and local != bs and dims[2:] == (local, bs, d):
        order, pages = KVOrder.VLLM_HND, dims[1]
    else:
        raise LayoutError(
            f"KvfsmConnector: KV cache of shape {list(dims)} is none of the layouts it knows "
            f"({local} local heads, block size {bs}, head_dim {d})"
        )
    layout = KVLayout(
        len(tensors), shape.num_kv_heads, d, first.element_size(), shape.tp_size, shape.tp_rank, bs, pages, order,
        shape.mla, opaque,
    )  # fmt: skip
    return layout, tensors


def _layer_index(name: str) -> tuple[int, str]:
    digits = [int(p) for p in name.replace("_", ".").split(".") if p.isdigit()]
    return (digits[0] if digits else -1, name)


class _Slots:
    def __init__(self, n: int) -> None:
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int:
        if not self._free:
            raise LocalProtocolError("KvfsmConnector: every aux slot is in use (raise aux_slots)")
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)


@dataclass
class _Sending:
    sender: KVSender | KVOffer
    slot: int  # -1: none (pull)


@dataclass
class _Decoder:
    """A decode worker's manager for one prefill engine, its aux slots and what closes it."""

    manager: DecodeManager
    aux: np.ndarray
    slots: _Slots
    closers: list[Callable[[], None]]


@dataclass
class _Receiving:
    recv: Recv
    receiver: KVReceiver | KVPuller
    slot: int  # -1: none (pull)
    decoder: _Decoder | None = None
    inited: bool = False
    aborted: bool = False


@dataclass
class Finished:
    """What a worker reports in one step."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)  # among recving: the KV did not arrive
    bad_blocks: set[int] = field(default_factory=set)


class WorkerSide:
    """One worker's rooms (see the module docstring)."""

    def __init__(
        self,
        config: VllmConnectorConfig,
        engine_id: str,
        shape: ModelShape,
        *,
        produces: bool,
        consumes: bool,
        share: Callable[[str | None], str] | None = None,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.shape = shape
        self.produces, self.consumes = produces, consumes
        self._share = share or (lambda value: value or "")  # TP rank 0's value to every rank
        self._nonce = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.layout: KVLayout | None = None
        self._tensors: list[Any] = []
        self._bootstrap_server: Any = None
        self.bootstrap: str | None = None
        self.name: str | None = None
        self._prefill: PrefillManager | None = None
        self._decode: dict[PrefillAddress, _Decoder] = {}
        self._retiring: list[_Decoder] = []  # replaced after a lost link; closed once it has no room
        self._links = 0  # decode managers created (each a name of its own)
        self._sends: dict[str, _Sending] = {}
        self._recvs: dict[str, _Receiving] = {}
        self._unreachable: list[Recv] = []  # receives that could not even start: failed at the next report
        self._unsent: list[str] = []  # sends that could not even start: their blocks freed at the next report
        self._closers: list[Callable[[], None]] = []
        self._paux = np.zeros(config.aux_slots * AUX_BYTES, np.uint8)
        self._pslots = _Slots(config.aux_slots)

    # -- set-up ---------------------------------------------------------------------------------

    def runtime_config(self) -> RuntimeConfig:
        cfg = self.config
        bootstrap = max(cfg.bootstrap_timeout_s, cfg.hold_timeout_s)
        return RuntimeConfig(
            workers=1,
            timeouts={"hold": cfg.hold_timeout_s, "bootstrap": bootstrap, "transfer": cfg.transfer_timeout_s},
            pull_timeouts={
                "claim": cfg.hold_timeout_s,
                "lease": cfg.lease_s,
                "bootstrap": bootstrap,
                "renew": cfg.lease_s / 6,
                "window": cfg.lease_s / 3,
            },
        )

    def register(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's ``register_kv_caches``: the layout, and on a producer its manager and (rank 0)
        the bootstrap service."""
        self.layout, self._tensors = layout_of(kv_caches, self.shape)
        if not self.produces:
            return
        from kvfsm.transport.zmq import BootstrapServer

        address = None
        if self.shape.tp_rank == 0:
            self._bootstrap_server = BootstrapServer(self.config.host, self.config.bootstrap_port)
            self._closers.append(self._bootstrap_server.close)
            address = self._bootstrap_server.address
        self.bootstrap = self._share(address)
        self.name = f"kvfsm-{self.engine_id}/prefill/{self.shape.tp_rank}/{self._nonce}"
        endpoint = self._endpoint(self.name, self.bootstrap, "prefill")
        self._prefill = PrefillManager(
            self.shape.tp_rank, endpoint, kv=self._tensors, aux=self._paux, aux_slot_bytes=AUX_BYTES,
            layout=self.layout, config=self.runtime_config(),
        )  # fmt: skip
        self._closers.insert(0, self._prefill.close)

    def _endpoint(self, name: str, bootstrap: str, side: str, closers: list[Callable[[], None]] | None = None) -> Any:
        from kvfsm.transport.base import SplitEndpoint
        from kvfsm.transport.nixl import NixlDataPlane
        from kvfsm.transport.zmq import ZmqControlPlane
        from kvfsm.transport.zmq_config import ZmqConfig

        data = NixlDataPlane(name)
        timeout = self.config.peer_timeout_s
        control = ZmqControlPlane(
            name, bootstrap=bootstrap, side=side, rank=self.shape.tp_rank, bind=f"tcp://{self.config.host}:*",
            config=ZmqConfig(heartbeat_s=min(1.0, timeout / 4), peer_timeout_s=timeout),
        )  # fmt: skip
        endpoint = SplitEndpoint(control, data)
        (closers if closers is not None else self._closers).append(endpoint.close)
        return endpoint

    def handshake(self) -> tuple[str, str] | None:
        """(bootstrap service, this rank's control plane name) for the scheduler (a producer)."""
        if self.bootstrap is None or self.name is None:
            return None
        return self.bootstrap, self.name

    def _decoder(self, prefill: PrefillAddress) -> _Decoder:
        d = self._decode.get(prefill)
        if d is not None and any(d.manager.link_state(r) in ("lost", "refused") for r in range(len(prefill.names))):
            # a link once lost stays lost on its plane: a fresh manager (a fresh name) links again;
            # the old one retires once its rooms are gone
            self._retiring.append(self._decode.pop(prefill))
            d = None
        if d is None:
            if self.layout is None:
                raise LocalProtocolError("KvfsmConnector: KV caches are not registered yet")
            self._links += 1
            name = f"kvfsm-{self.engine_id}/decode/{self.shape.tp_rank}/{self._nonce}/{self._links}"
            closers: list[Callable[[], None]] = []
            endpoint = self._endpoint(name, prefill.bootstrap, "decode", closers)
            aux = np.zeros(self.config.aux_slots * AUX_BYTES, np.uint8)
            # the id prefill ranks know this rank by: its own, not its TP rank, so that several
            # decode engines can receive from one prefill engine at once
            rank = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little") >> 1
            dm = DecodeManager(
                rank, endpoint, prefill_peers=dict(enumerate(prefill.names)), kv=self._tensors,
                aux=aux, aux_slot_bytes=AUX_BYTES, layout=self.layout, config=self.runtime_config(),
            )  # fmt: skip
            closers.insert(0, dm.close)
            dm.connect()
            d = self._decode[prefill] = _Decoder(dm, aux, _Slots(self.config.aux_slots), closers)
        return d

    # -- every step -----------------------------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        """This step's sends, receives and aborts."""
        for send in plan.sends:
            try:
                self._send(send)
            except Exception as exc:  # noqa: BLE001 - this request's blocks are freed; the engine goes on
                log.warning("KvfsmConnector: cannot send %s: %r", send.req_id, exc)
                self._unsent.append(send.req_id)
        for recv in plan.recvs:
            self._recv(recv)
        for rid in plan.aborts:
            r = self._recvs.get(rid)
            if r is not None and not r.aborted:
                r.aborted = True
                if r.receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
                    r.receiver.abort("the decode request was aborted")

    def _send(self, send: Send) -> None:
        if self._prefill is None:
            raise LocalProtocolError("KvfsmConnector: a send on a worker that does not produce KV")
        if send.mode == "pull":
            self._sends[send.req_id] = _Sending(
                self._prefill.create_offer(send.room, list(send.pages), send.tokens), -1
            )
            return
        slot = self._pslots.take()
        try:
            self._paux[slot * AUX_BYTES : (slot + 1) * AUX_BYTES] = np.frombuffer(
                np.uint64(send.tokens).tobytes(), np.uint8
            )
            sender = self._prefill.create_sender(send.room)
        except BaseException:
            self._pslots.give(slot)
            raise
        self._sends[send.req_id] = _Sending(sender, slot)
        sender.send(list(send.pages), is_last=True, aux_slot=slot)

    def _recv(self, recv: Recv) -> None:
        try:
            d = self._decoder(recv.prefill)
            if recv.mode == "pull":
                puller = d.manager.create_puller(recv.room, tokens=recv.tokens)
                r = _Receiving(recv, puller, -1, d, inited=True)
                puller.init(list(recv.pages), recv.tokens)
            else:
                slot = d.slots.take()
                try:
                    r = _Receiving(recv, d.manager.create_receiver(recv.room), slot, d)
                except BaseException:
                    d.slots.give(slot)
                    raise
        except Exception as exc:  # noqa: BLE001 - an unreachable prefill engine fails this request only
            log.warning("KvfsmConnector: cannot receive %s from %s: %r", recv.req_id, recv.prefill.bootstrap, exc)
            self._unreachable.append(recv)
            return
        self._recvs[recv.req_id] = r
        self._try_init(r)

    def _try_init(self, r: _Receiving) -> None:
        if not r.inited and not r.aborted and r.receiver.poll() == KVPoll.WaitingForInput:
            assert isinstance(r.receiver, KVReceiver)  # (a puller is given its pages at once)
            r.receiver.init(list(r.recv.pages), r.slot, tokens=r.recv.tokens)
            r.inited = True

    def finished(self) -> Finished:
        """Poll every room (timers fire here) and report those that concluded."""
        out = Finished()
        out.sending.update(self._unsent)
        self._unsent.clear()
        for recv in self._unreachable:
            out.recving.add(recv.req_id)
            out.failed.add(recv.req_id)
            out.bad_blocks.update(recv.pages)
        self._unreachable.clear()
        for rid, s in list(self._sends.items()):
            code = s.sender.poll()
            if code in (KVPoll.Success, KVPoll.Failed) and not s.sender.pages_in_use():
                if code == KVPoll.Failed:
                    log.warning("KvfsmConnector: send of %s failed: %s", rid, s.sender.failure_exception().reason)
                s.sender.clear()
                if s.slot >= 0:
                    self._pslots.give(s.slot)
                del self._sends[rid]
                out.sending.add(rid)
        for rid, r in list(self._recvs.items()):
            self._try_init(r)
            code = r.receiver.poll()
            if code == KVPoll.Failed and self._blocks_busy(r):
                continue  # a source may still write, or a read still land, into the blocks
            if code not in (KVPoll.Success, KVPoll.Failed):
                continue
            ok = code == KVPoll.Success and (r.slot < 0 or self._aux_tokens(r) == r.recv.tokens)
            if not ok:
                why = r.receiver.failure_exception().reason if code == KVPoll.Failed else "aux token count differs"
                log.warning("KvfsmConnector: receive of %s failed: %s", rid, why)
                out.failed.add(rid)
                out.bad_blocks.update(r.recv.pages)
            r.receiver.clear()
            if r.slot >= 0 and r.decoder is not None:
                r.decoder.slots.give(r.slot)
            del self._recvs[rid]
            out.recving.add(rid)
        self._retire()
        return out

    @staticmethod
    def _blocks_busy(r: _Receiving) -> bool:
        rc = r.receiver
        return rc.pages_fenced() if isinstance(rc, KVReceiver) else rc.pages_in_use()

    def _aux_tokens(self, r: _Receiving) -> int:
        assert r.decoder is not None
        raw = r.decoder.aux[r.slot * AUX_BYTES : (r.slot + 1) * AUX_BYTES]
        return int(np.frombuffer(raw.tobytes(), np.uint64)[0])

    def _retire(self) -> None:
        """Close the replaced managers whose rooms are all gone."""
        for d in [d for d in self._retiring if d.manager.live_rooms() == 0]:
            self._retiring.remove(d)
            for close in d.closers:
                try:
                    close()
                except Exception:  # noqa: BLE001 - a retired link: close the rest
                    log.exception("KvfsmConnector: close failed")

    def close(self) -> None:
        self._retiring += self._decode.values()
        self._decode.clear()
        for d in self._retiring:
            self._closers[:0] = d.closers
        self._retiring.clear()
        for close in self._closers:
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down: close the rest
                log.exception("KvfsmConnector: close failed")
        self._closers.clear()
