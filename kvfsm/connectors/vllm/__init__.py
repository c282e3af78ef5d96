"""kvfsm inside vLLM: ``KvfsmConnector``, a ``KVConnectorBase_V1``.

Load it with ``KVTransferConfig(kv_connector="KvfsmConnector",
kv_connector_module_path="kvfsm.connectors.vllm", kv_role=...)``. The class is imported on first
use (``__getattr__``), so that ``kvfsm.connectors.vllm.config`` and the engine-independent parts
import without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvfsmConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvfsmConnector":
        from kvfsm.connectors.vllm.connector import KvfsmConnector

        return KvfsmConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
