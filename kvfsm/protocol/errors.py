"""Typed errors of the protocol core.

Split as h11 does: ``LocalProtocolError`` is our own misuse (the engine or runtime asked for
something the spec does not allow); ``RemoteProtocolError`` is a peer's fault and is never
raised out of the runtime: it becomes a failed room with a reason.
"""

from __future__ import annotations


class KvfsmError(Exception):
    """Base of every kvfsm error."""


class SpecError(KvfsmError):
    """spec/ is inconsistent (unknown guard or action name, unknown state, bad field type)."""


class LocalProtocolError(KvfsmError):
    """Our own misuse: an event no spec row accepts, from a local cause. The room is unchanged."""


class RemoteProtocolError(KvfsmError):
    """A peer sent something the spec does not accept; the room it concerns fails."""


class MalformedMessage(RemoteProtocolError):
    """Bytes from a peer that do not decode into a valid message of this protocol version."""


class UnsupportedVersion(MalformedMessage):
    """A message of a protocol version this build does not speak."""


class KVTransferError(KvfsmError):
    """Raised to the engine by ``failure_exception()`` for a failed room; carries the reason."""

    def __init__(self, room: int, reason: str, *, side: str, rank: int) -> None:
        super().__init__(f"room {room} failed on {side} rank {rank}: {reason}")
        self.room = room
        self.reason = reason
        self.side = side
        self.rank = rank
