"""Runs room machines for real: managers per (side, rank), workers, timers, telemetry."""

from __future__ import annotations

from kvfsm.runtime.config import RuntimeConfig
from kvfsm.runtime.decode import DecodeManager, KVReceiver
from kvfsm.runtime.pages import coalesce
from kvfsm.runtime.prefill import KVSender, PrefillManager
from kvfsm.runtime.pull import KVOffer, KVPuller

__all__ = [
    "DecodeManager",
    "KVOffer",
    "KVPuller",
    "KVReceiver",
    "KVSender",
    "PrefillManager",
    "RuntimeConfig",
    "coalesce",
]
