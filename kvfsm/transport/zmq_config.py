"""``ZmqConfig``: the tuning of a ZeroMQ control plane (``kvfsm.transport.zmq``).

Who a plane is and where it listens (``name``, ``side``, ``rank``, ``bind``, ``bootstrap``,
``peers``) are the plane's constructor arguments; how it behaves on the wire is this
configuration, one object that every plane of a process can share. The wire-format limits that
both ends must agree on (HELLO header and bootstrap request sizes, name and address lengths, the
protocol version) are fixed by ``kvfsm.transport.zmq_bootstrap``, not configured.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfsm.config import ConfigError, non_negative, positive, positive_int, setting, validate

# Defaults for a GPU server: peers on one rack's network, a room's messages small but a room
# listing of a million pages (kvfsm.protocol.wire.MAX_MESSAGE) still fitting in one message.
_HEARTBEAT_S = 0.5
_PEER_TIMEOUT_S = 3.0
_MAX_MESSAGE = 16 << 20
_MAX_DESCRIPTOR = 16 << 20
_QUEUE_LIMIT = 10_000
_LINGER_S = 0.1


@dataclass(frozen=True, slots=True)
class ZmqConfig:
    """How a ``ZmqControlPlane`` detects peer loss, bounds what it accepts and queues, and closes.

    Validated at construction (``ConfigError`` names the field and what it must be)."""

    heartbeat_s: float = setting(
        _HEARTBEAT_S,
        doc="Interval of the ZMTP heartbeats on every connection to a peer.",
        when="Lower it (with peer_timeout_s) to tell a frozen peer's loss sooner; each is a few bytes per peer.",
        check=positive,
        must="a positive number of seconds, below peer_timeout_s",
    )
    peer_timeout_s: float = setting(
        _PEER_TIMEOUT_S,
        doc=(
            "A peer that answers no heartbeat for this long, or whose connection does not complete its "
            "handshake within it, is lost (a crashed process is told at once, by its closed socket). Also "
            "how long a lookup at the bootstrap service may take; construction waits max(1 s, this) for the "
            "service to take the plane's registration."
        ),
        when=(
            "Keep it below the runtime's transfer timeout, so that rooms fail as peer loss rather than by "
            "timeout; raise it on a congested or lossy network."
        ),
        check=positive,
        must="a positive number of seconds, above heartbeat_s",
    )
    max_message: int = setting(
        _MAX_MESSAGE,
        doc=(
            "Largest message payload in bytes, sent or received: a larger send is dropped (counted "
            "dropped.oversize_local), a larger inbound message dropped (dropped.oversize)."
        ),
        when="Raise it only with kvfsm.protocol.wire.MAX_MESSAGE, for room listings over a million pages.",
        check=positive_int,
        must="a positive int",
    )
    max_descriptor: int = setting(
        _MAX_DESCRIPTOR,
        doc="Largest data-plane descriptor in bytes carried in a HELLO (ours, or a peer's).",
        when="Raise it if the data plane describes very many registered regions.",
        check=positive_int,
        must="a positive int",
    )
    queue_limit: int = setting(
        _QUEUE_LIMIT,
        doc=(
            "Messages queued per peer (while connecting, waiting for a lookup, or in the socket) before "
            "more sends to it are dropped (counted dropped.hwm); also the inbound queue of the plane."
        ),
        when="Raise it if a burst of rooms toward one peer before it connects shows dropped.hwm.",
        check=positive_int,
        must="a positive int",
    )
    linger_s: float = setting(
        _LINGER_S,
        doc="How long close() lets queued messages and the BYEs to peers drain before it drops them.",
        when="Raise it if peers should learn of a close by BYE over a slow link rather than by timeout.",
        check=non_negative,
        must="a number of seconds >= 0",
    )

    def __post_init__(self) -> None:
        validate(self)
        if not self.heartbeat_s < self.peer_timeout_s:
            raise ConfigError(
                f"ZmqConfig.heartbeat_s = {self.heartbeat_s!r}: it must be below "
                f"peer_timeout_s = {self.peer_timeout_s!r} (a peer is lost only after missing heartbeats)"
            )
