"""NIXL: the data plane on real NIXL agents (UCX backend), DRAM on CPU and VRAM on GPU.

``NixlDataPlane(name, config=NixlConfig(...))`` (``plane``) is the data plane; the modules beside
it hold one responsibility each: ``config`` (settings), ``descriptors`` (the descriptor's wire
format), ``notes`` (notification batching), ``plan`` (describing, folding and merging writes),
``peers`` (memory and peer lifecycle), ``posting`` (the posting policy and the posting thread),
``poller`` (progress) and ``agent`` (finding NIXL).
"""

from __future__ import annotations

from kvfsm.transport.nixl.agent import load_nixl, nixl_available
from kvfsm.transport.nixl.config import NixlConfig
from kvfsm.transport.nixl.descriptors import (
    DESCRIPTOR_VERSION,
    MAGIC,
    REGIONS,
    RemoteRegion,
    decode_descriptor,
    encode_descriptor,
)
from kvfsm.transport.nixl.notes import BATCH_MAGIC, MAX_BATCH, pack_notifications, unpack_notifications
from kvfsm.transport.nixl.plan import fold, merge_rows, use_prepped
from kvfsm.transport.nixl.plane import NixlDataPlane

__all__ = [
    "BATCH_MAGIC",
    "DESCRIPTOR_VERSION",
    "MAGIC",
    "MAX_BATCH",
    "REGIONS",
    "NixlConfig",
    "NixlDataPlane",
    "RemoteRegion",
    "decode_descriptor",
    "encode_descriptor",
    "fold",
    "load_nixl",
    "merge_rows",
    "nixl_available",
    "pack_notifications",
    "unpack_notifications",
    "use_prepped",
]
