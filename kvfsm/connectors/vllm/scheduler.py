"""The scheduler half of ``KvfsmConnector``: which requests send or receive KV, and what the
workers are told each step. No vLLM import: it reads a request's ``request_id``,
``prompt_token_ids``, ``kv_transfer_params`` and ``status``, and takes block ids as lists.

Theory of operation (push mode, as vLLM PR 35264 orders it; pull below)
-----------------------------------------------------------------------
Prefill engine, request r with ``{"do_remote_decode": true}``: r runs its prompt and one token.
At ``request_finished`` the connector keeps r's blocks (``delay_free``), names a room (a 63-bit
id from r's id), tells the workers to send the blocks that hold the prompt's tokens in that room
(``Send``), and returns the params the decode request needs: the room, the prompt's token
count, and where the prefill ranks are (their bootstrap service and names, from the workers'
handshake metadata). The workers' rooms hold the KV (prefill_room's Holding) until decode
announces its blocks, write it, and report r finished sending: then vLLM frees its blocks. A
decode request that never comes lets the hold timer free them.

Decode engine, request r' carrying those params: ``get_num_new_matched_tokens`` says the whole
prompt comes from outside, asynchronously; vLLM allocates blocks for it and calls
``update_state_after_alloc``, and the workers are told to receive the room into those blocks
(``Recv``): they announce the blocks to the prefill ranks, which write. When the room concludes
the workers report r' finished receiving (a failure too, with its blocks as load errors, so that
vLLM's ``kv_load_failure_policy`` applies); vLLM then computes the last prompt token itself and
decodes. An abort of r' while it waits aborts the room (``aborts``); its blocks stay vLLM's until
the room has concluded and nothing more can be written into them.

Pull mode (``transfer_mode`` "pull", per request): the same params and steps, but the prefill
workers offer the blocks (``Send.mode``) instead of sending them, and the decode workers claim a
lease on them and read them into their own blocks (``Recv.mode``). vLLM frees the prefill
request's blocks once every reader notified its read, or the lease ended.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from kvfsm.connectors.vllm.config import VllmConnectorConfig

log = logging.getLogger("kvfsm.connectors.vllm")

PARAMS_VERSION = 1  # of the kvfsm keys in kv_transfer_params
MODES = ("push", "pull")


def room_of(request_id: str) -> int:
    """A room id for a prefill request: 63 bits of a hash of its (engine-unique) id."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 1


def pages_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class PrefillAddress:
    """Where a decode rank finds the prefill engine's ranks: its bootstrap service and, per TP
    rank, the name its control plane registered."""

    bootstrap: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Send:
    """Prefill workers: send room ``room`` (the first ``tokens`` tokens, in ``pages``)."""

    req_id: str
    room: int
    pages: tuple[int, ...]
    tokens: int
    mode: str = "push"


@dataclass(frozen=True)
class Recv:
    """Decode workers: receive room ``room`` from ``prefill`` into ``pages`` (``tokens`` tokens)."""

    req_id: str
    room: int
    pages: tuple[int, ...]
    tokens: int
    prefill: PrefillAddress
    mode: str = "push"


@dataclass
class StepPlan:
    """What the scheduler tells the workers in one step (the connector metadata's contents)."""

    sends: list[Send] = field(default_factory=list)
    recvs: list[Recv] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # decode request ids whose rooms to abort


class ParamsError(ValueError):
    """A decode request's kv_transfer_params that do not describe a kvfsm transfer."""


def prefill_address(params: dict[str, Any]) -> PrefillAddress:
    """The prefill engine a decode request's params point at; ``ParamsError`` if malformed."""
    try:
        if params["kvfsm"] != PARAMS_VERSION:
            raise ParamsError(f"kvfsm params version {params['kvfsm']!r}; this build speaks {PARAMS_VERSION}")
        names = params["kvfsm_prefill_names"]
        bootstrap = params["kvfsm_bootstrap"]
        if not isinstance(bootstrap, str) or not isinstance(names, list) or not names:
            raise ParamsError("kvfsm_bootstrap must be a string and kvfsm_prefill_names a non-empty list")
        if not all(isinstance(n, str) for n in names):
            raise ParamsError("kvfsm_prefill_names must be strings")
        return PrefillAddress(bootstrap, tuple(names))
    except KeyError as exc:
        raise ParamsError(f"kv_transfer_params lack {exc.args[0]!r}") from None


def transfer_mode(params: dict[str, Any], default: str) -> str:
    """The request's ``transfer_mode`` ("push" or "pull"; absent: ``default``); ``ParamsError``
    for another value."""
    mode = params.get("transfer_mode", default)
    if mode not in MODES:
        raise ParamsError(f"transfer_mode {mode!r}: KvfsmConnector moves KV by 'push' or 'pull'")
    return str(mode)


class SchedulerSide:
    """The scheduler half's state (see the module docstring)."""

    def __init__(self, config: VllmConnectorConfig, block_size: int, engine_id: str) -> None:
        self.config = config
        self.block_size = block_size
        self.engine_id = engine_id
        self.address: PrefillAddress | None = None  # prefill: from the workers' handshake metadata
        self._plan = StepPlan()
        self._sending: set[str] = set()  # prefill requests whose blocks the workers still hold
        self._receiving: dict[str, int] = {}  # decode request -> its room, until finished_recving
        self._loads: dict[str, tuple[int, PrefillAddress, str]] = {}  # decode: matched, not yet allocated

    # -- handshake ------------------------------------------------------------------------------

    def set_workers(self, by_rank: dict[int, tuple[str, str]]) -> None:
        """The workers' (bootstrap address, control plane name) by TP rank."""
        if not by_rank:
            return
        ranks = sorted(by_rank)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"handshake metadata from TP ranks {ranks}, not 0..{len(ranks) - 1}")
        bootstraps = {by_rank[r][0] for r in ranks}
        if len(bootstraps) != 1:
            raise ValueError(f"the workers advertise several bootstrap services: {sorted(bootstraps)}")
        self.address = PrefillAddress(bootstraps.pop(), tuple(by_rank[r][1] for r in ranks))

    # -- decode ---------------------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: the whole prompt, asynchronously, for a decode request
        that carries a prefill engine's kvfsm params (none of it computed here yet)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or "kvfsm_room" not in params:
            return 0, False
        if request.request_id in self._receiving:
            return 0, False
        try:
            address = prefill_address(params)
            mode = transfer_mode(params, "push")
        except ParamsError as exc:  # a client's bad params: this engine computes the prompt itself
            log.warning("KvfsmConnector: request %s: %s; computing its prompt here", request.request_id, exc)
            return 0, False
        if num_computed_tokens:
            # the prompt's head is cached here already; rooms move a prompt from its first token
            return 0, False
        self._loads[request.request_id] = (int(params["kvfsm_room"]), address, mode)
        return len(request.prompt_token_ids) - num_computed_tokens, True

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """``update_state_after_alloc``: blocks for a matched request: receive into them."""
        load = self._loads.pop(request.request_id, None)
        if load is None or num_external_tokens <= 0:
            return
        room, address, mode = load
        tokens = num_external_tokens
        pages = tuple(block_ids[: pages_for(tokens, self.block_size)])
        self._plan.recvs.append(Recv(request.request_id, room, pages, tokens, address, mode))
        self._receiving[request.request_id] = room
        request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request

    # -- prefill --------------------------------------------------------------------------------

    def finished(self, request: Any, block_ids: list[int], normally: bool) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: (delay the free, params for the decode request)."""
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if rid in self._receiving:  # decode: aborted or failed while its KV may still arrive
            self._plan.aborts.append(rid)
            return False, None
        self._loads.pop(rid, None)
        if not params.get("do_remote_decode") or not normally or not block_ids:
            return False, None
        if self.address is None:
            raise RuntimeError("KvfsmConnector: no handshake metadata from the workers (prefill role?)")
        try:
            mode = transfer_mode(params, self.config.transfer_mode)
        except ParamsError as exc:  # a client's bad params: no transfer (its decode request computes)
            log.warning("KvfsmConnector: request %s: %s; its KV is not kept", rid, exc)
            return False, {"kvfsm_error": str(exc)}
        tokens = len(request.prompt_token_ids)
        room = room_of(f"{self.engine_id}/{rid}")
        pages = tuple(block_ids[: pages_for(tokens, self.block_size)])
        self._plan.sends.append(Send(rid, room, pages, tokens, mode))
        self._sending.add(rid)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_mode": mode,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_num_tokens": tokens,
            "tp_size": len(self.address.names),
            "kvfsm": PARAMS_VERSION,
            "kvfsm_room": room,
            "kvfsm_bootstrap": self.address.bootstrap,
            "kvfsm_prefill_names": list(self.address.names),
        }

    # -- every step -----------------------------------------------------------------------------

    def take_plan(self) -> StepPlan:
        """``build_connector_meta``: this step's sends, receives and aborts (then forgotten)."""
        plan, self._plan = self._plan, StepPlan()
        return plan

    def finished_transfers(self, sending: set[str] | None, recving: set[str] | None) -> None:
        """``update_connector_output``: requests every worker has finished with."""
        for rid in sending or ():
            self._sending.discard(rid)
        for rid in recving or ():
            self._receiving.pop(rid, None)

    def pending(self) -> bool:
        """Work that needs the engine to keep stepping: held sends, receives in flight, and
        anything not yet told to the workers (an idle engine would not step to tell them)."""
        plan = self._plan
        return bool(self._sending or self._receiving or plan.sends or plan.recvs or plan.aborts)
