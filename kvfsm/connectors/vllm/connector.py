"""``KvfsmConnector``: vLLM's ``KVConnectorBase_V1`` over kvfsm rooms.

vLLM builds the connector once in its scheduler (``SchedulerSide``) and once in each worker
(``WorkerSide``); this class only adapts vLLM's calls and objects to them. The two halves talk
through the per-step metadata (``KvfsmMetadata``: a ``StepPlan``) and the workers' reports
(finished sends and receives, receive failures and their blocks); the scheduler learns where the
prefill ranks are from the workers' handshake metadata (``KvfsmHandshake``), which vLLM gathers
after the KV caches are registered. Nothing in vLLM is patched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from kvfsm.connectors.vllm.config import VllmConnectorConfig
from kvfsm.connectors.vllm.scheduler import SchedulerSide, StepPlan
from kvfsm.connectors.vllm.worker import ModelShape, WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_FINISHED_NORMALLY = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class KvfsmMetadata(KVConnectorMetadata):
    """One step's sends, receives and aborts, scheduler to workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class KvfsmHandshake(KVConnectorHandshakeMetadata):
    """A prefill worker's bootstrap service and control plane name, worker to scheduler."""

    bootstrap: str
    name: str


class KvfsmConnector(KVConnectorBase_V1):
    """kvfsm rooms as vLLM's KV connector (push or pull per request); settings: ``VllmConnectorConfig``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = VllmConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        engine_id = str(ktc.engine_id or "vllm")
        block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._failed: set[str] = set()
        self._bad_blocks: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, block_size, engine_id)
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

        model = vllm_config.model_config
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        shape = ModelShape(
            model.get_total_num_kv_heads(),
            model.get_head_size(),
            tp_size,
            get_tensor_model_parallel_rank() if tp_size > 1 else 0,
            block_size,
            bool(getattr(model, "use_mla", False)),
        )

        def share(value: str | None) -> str:
            if tp_size == 1:
                return value or ""
            return str(get_tp_group().broadcast_object(value, src=0))

        self._worker = WorkerSide(
            self.config, engine_id, shape, produces=ktc.is_kv_producer, consumes=ktc.is_kv_consumer, share=share
        )

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfsmMetadata)
        self._worker.start(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the whole prompt's KV lands before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # prefill sends a finished request's blocks, not layer by layer

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        done = self._worker.finished()
        self._bad_blocks |= done.bad_blocks
        return KVConnectorTransferResults(done.sending, done.recving, done.failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        assert self._worker is not None
        hs = self._worker.handshake()
        return None if hs is None else KvfsmHandshake(*hs)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        if num_external_tokens > 0:
            self._scheduler.allocated(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KvfsmMetadata(self._scheduler.take_plan())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, list(block_ids), request.status in _FINISHED_NORMALLY)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.finished_transfers(connector_output.finished_sending, connector_output.finished_recving)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._scheduler is not None
        self._scheduler.set_workers(
            {rank: (m.bootstrap, m.name) for rank, m in metadata.items() if isinstance(m, KvfsmHandshake)}
        )
