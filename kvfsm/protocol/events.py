"""Events: what happened to a room (past tense). Declared in spec/events.toml.

Each class carries ``trigger`` (the spec trigger name) and ``cause`` (local or remote). A test
checks that these classes and spec/events.toml agree field for field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvfsm.protocol.pages import Pages
from kvfsm.protocol.wire import Register, RegisterAck
from kvfsm.records import fast_init

Cause = Literal["local", "remote"]


@fast_init
@dataclass(frozen=True, slots=True)
class ChunkReady:
    pages: Pages
    is_last: bool
    aux_slot: int | None = None
    trigger: ClassVar[str] = "chunk_ready"
    cause: ClassVar[Cause] = "local"


@fast_init
@dataclass(frozen=True, slots=True)
class PagesAllocated:
    pages: Pages
    aux_slot: int
    tokens: int = 0  # 0: every token of the pages
    trigger: ClassVar[str] = "pages_allocated"
    cause: ClassVar[Cause] = "local"


@fast_init
@dataclass(frozen=True, slots=True)
class PeersReady:
    trigger: ClassVar[str] = "peers_ready"
    cause: ClassVar[Cause] = "local"


@fast_init
@dataclass(frozen=True, slots=True)
class Abort:
    reason: str = "aborted by engine"
    trigger: ClassVar[str] = "abort"
    cause: ClassVar[Cause] = "local"


@fast_init
@dataclass(frozen=True, slots=True)
class Clear:
    trigger: ClassVar[str] = "clear"
    cause: ClassVar[Cause] = "local"


@fast_init
@dataclass(frozen=True, slots=True)
class TimerFired:
    """A timer reached its deadline. Its trigger is the timer's own (spec ``[timers.X].trigger``)."""

    timer: str
    cause: ClassVar[Cause] = "local"

    @property
    def trigger(self) -> str:
        return f"{self.timer}_timeout"


@fast_init
@dataclass(frozen=True, slots=True)
class PagesAnnounced:
    dest_rank: int
    pages: Pages
    aux_slot: int
    required_dests: int
    peer_kv_pages: int
    peer_aux_slots: int
    tokens: int = 0  # 0: every token of the pages
    peer_page_size: int = 1
    trigger: ClassVar[str] = "pages_announced"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class WriteCompleted:
    dest_rank: int
    chunk_id: int  # -1: the aux write
    trigger: ClassVar[str] = "write_completed"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class WriteFailed:
    dest_rank: int
    chunk_id: int
    reason: str
    trigger: ClassVar[str] = "write_failed"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class ChunkArrived:
    src: int
    chunk_id: int
    is_last: bool
    token_start: int
    num_tokens: int
    trigger: ClassVar[str] = "chunk_arrived"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class AuxArrived:
    src: int
    trigger: ClassVar[str] = "aux_arrived"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class AbortReceived:
    rank: int
    side: str
    reason: str
    trigger: ClassVar[str] = "abort_received"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class FailureReceived:
    prefill_rank: int
    reason: str
    trigger: ClassVar[str] = "failure_received"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class PeerLost:
    peer_rank: int
    reason: str
    trigger: ClassVar[str] = "peer_lost"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class WritesDrained:
    prefill_rank: int
    trigger: ClassVar[str] = "writes_drained"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class RegistrationReceived:
    registration: Register
    trigger: ClassVar[str] = "registration_received"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class AckReceived:
    ack: RegisterAck
    trigger: ClassVar[str] = "ack_received"
    cause: ClassVar[Cause] = "remote"


# ---------------------------------------------------------------- pull mode


@fast_init
@dataclass(frozen=True, slots=True)
class LeaseClaimed:
    decode_rank: int
    epoch: int
    readers: int
    tokens: int = 0
    trigger: ClassVar[str] = "lease_claimed"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class LeaseGranted:
    prefill_rank: int
    epoch: int
    lease_ms: int
    pages: Pages
    tokens: int
    page_size: int = 1
    trigger: ClassVar[str] = "lease_granted"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class ReadsNotified:
    decode_rank: int
    trigger: ClassVar[str] = "reads_notified"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class LeaseReleased:
    decode_rank: int
    reason: str
    trigger: ClassVar[str] = "lease_released"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class ReadCompleted:
    prefill_rank: int
    trigger: ClassVar[str] = "read_completed"
    cause: ClassVar[Cause] = "remote"


@fast_init
@dataclass(frozen=True, slots=True)
class ReadFailed:
    prefill_rank: int
    reason: str
    trigger: ClassVar[str] = "read_failed"
    cause: ClassVar[Cause] = "remote"


Event = (
    ChunkReady
    | PagesAllocated
    | PeersReady
    | Abort
    | Clear
    | TimerFired
    | PagesAnnounced
    | WriteCompleted
    | WriteFailed
    | ChunkArrived
    | AuxArrived
    | AbortReceived
    | FailureReceived
    | PeerLost
    | WritesDrained
    | RegistrationReceived
    | AckReceived
    | LeaseClaimed
    | LeaseGranted
    | ReadsNotified
    | LeaseReleased
    | ReadCompleted
    | ReadFailed
)

EVENT_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ChunkReady,
        PagesAllocated,
        PeersReady,
        Abort,
        Clear,
        TimerFired,
        PagesAnnounced,
        WriteCompleted,
        WriteFailed,
        ChunkArrived,
        AuxArrived,
        AbortReceived,
        FailureReceived,
        PeerLost,
        WritesDrained,
        RegistrationReceived,
        AckReceived,
        LeaseClaimed,
        LeaseGranted,
        ReadsNotified,
        LeaseReleased,
        ReadCompleted,
        ReadFailed,
    )
}

AUX_WRITE = -1
"""chunk_id of the aux write in WriteCompleted / WriteFailed."""
