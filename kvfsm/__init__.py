"""kvfsm: the protocol core for moving KV cache from prefill to decode workers."""

from __future__ import annotations

__version__ = "0.1.0"
