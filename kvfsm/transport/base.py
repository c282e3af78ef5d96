"""The two ports a transport implements, as one ``Endpoint`` per (side, rank).

Control plane: ``send(peer, data)`` best effort, small messages. Data plane: memory registered
once (a KV region and an aux region), ``write`` copies segments into a peer's registered region
and then delivers a notification to that peer; the writer later receives a completion.
Everything inbound (messages, notifications, completions, peer loss) reaches the owner through
the handler it installed with ``set_handler``; the runtime turns each into protocol events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Region = Literal["kv", "aux"]


class TransportError(Exception):
    """A data-plane operation failed (peer dead, region not registered, out of bounds)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One contiguous copy: ``length`` bytes from local offset ``src`` to remote offset ``dst``."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True, slots=True)
class Inbound:
    """Something that arrived for an endpoint.

    kind: "message" (control plane bytes from ``peer``), "notification" (after the data of a
    write from ``peer``), "completion" (of our own write ``tag``; ``ok`` and ``reason``),
    "peer_lost" (``peer`` crashed or its link broke).
    """

    kind: Literal["message", "notification", "completion", "peer_lost"]
    peer: str
    data: bytes = b""
    tag: object = None
    ok: bool = True
    reason: str = ""


Handler = Callable[[Inbound], None]


class Endpoint(Protocol):
    name: str

    def set_handler(self, handler: Handler) -> None: ...

    def register_memory(self, kv: memoryview, aux: memoryview) -> None: ...

    def send(self, peer: str, data: bytes) -> None:
        """Best effort; a dead or unknown peer drops the message (the protocol's timers cover it)."""
        ...

    def write(self, peer: str, region: Region, segments: Sequence[Segment], notification: bytes, tag: object) -> int:
        """Copy ``segments`` into ``peer``'s ``region``; then deliver ``notification`` to it and a
        completion for ``tag`` to us. Returns the bytes moved. Raises TransportError *before any
        byte is written* if a segment lies outside either registered region or the peer is dead."""
        ...
