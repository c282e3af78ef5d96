"""Transports carry out the machines' actions. ``loopback`` is the embedded default."""

from __future__ import annotations

from kvfsm.transport.base import Endpoint, Inbound, Segment, TransportError

__all__ = ["Endpoint", "Inbound", "Segment", "TransportError"]
