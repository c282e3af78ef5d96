"""vLLM's NixlConnector with every connector method logged: which process (pid) and role calls
what, and the KV cache tensors ``register_kv_caches`` receives (names, shapes, dtypes, strides).

Loaded by vLLM with ``kv_connector="ProbeConnector", kv_connector_module_path=
"vllm_probe_connector"`` (this directory on ``PYTHONPATH``); it appends JSON lines to the file
named by ``KVFSM_PROBE_LOG``. Only the first call of each method per process is logged.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

_LOCK = threading.Lock()
_SEEN: set[tuple[int, str, str]] = set()


def _log(record: dict[str, Any]) -> None:
    path = os.environ.get("KVFSM_PROBE_LOG")
    if not path:
        return
    with _LOCK, open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


_METHODS = [
    "register_kv_caches",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_handshake_metadata",
    "bind_connector_metadata",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "on_new_request",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "set_xfer_handshake_metadata",
    "shutdown",
]


def _wrap(name: str) -> Any:
    inner = getattr(NixlPullConnector, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.getpid(), str(getattr(self, "_role", None)), name)
        if key not in _SEEN:
            _SEEN.add(key)
            _log(
                {
                    "pid": os.getpid(),
                    "thread": threading.current_thread().name,
                    "role": str(getattr(self, "_role", None)),
                    "method": name,
                }
            )
        if name == "register_kv_caches":
            caches = args[0] if args else kwargs["kv_caches"]
            _log(
                {
                    "pid": os.getpid(),
                    "kv_caches": {
                        k: {
                            "shape": list(t.shape),
                            "dtype": str(t.dtype),
                            "stride": list(t.stride()),
                            "device": str(t.device),
                            "data_ptr": t.data_ptr(),
                            "nbytes": t.numel() * t.element_size(),
                            "contiguous": t.is_contiguous(),
                            "storage_offset": t.storage_offset(),
                            "untyped_storage_nbytes": t.untyped_storage().nbytes(),
                            "storage_ptr": t.untyped_storage().data_ptr(),
                        }
                        for k, t in caches.items()
                    },
                }
            )
        if name in ("request_finished", "request_finished_all_groups"):
            out = inner(self, *args, **kwargs)
            _log({"pid": os.getpid(), "method": name, "block_ids": args[1] if len(args) > 1 else None, "returned": out})
            return out
        return inner(self, *args, **kwargs)

    method.__name__ = name
    return method


class ProbeConnector(NixlPullConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._role = role
        _log(
            {
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "role": str(role),
                "method": "__init__",
                "kv_role": vllm_config.kv_transfer_config.kv_role,
                "engine_id": vllm_config.kv_transfer_config.engine_id,
            }
        )


for _name in _METHODS:
    if hasattr(NixlPullConnector, _name):
        setattr(ProbeConnector, _name, _wrap(_name))
