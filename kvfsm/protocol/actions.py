"""Actions: what the runtime must do next (imperative). The machine only computes them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfsm.protocol.pages import Pages
from kvfsm.protocol.wire import AuxWritten, ChunkWritten, Message, ReadsDone
from kvfsm.records import fast_init


@fast_init
@dataclass(frozen=True, slots=True)
class SendMessage:
    """Send ``message`` on the control plane to rank ``peer_rank`` of the other side."""

    peer_rank: int
    message: Message


@fast_init
@dataclass(frozen=True, slots=True)
class PostWrite:
    """Write the KV of ``src_pages`` (local) into ``dst_pages`` of ``dest_rank``, then deliver
    ``notification`` to it. Report WriteCompleted(dest_rank, chunk_id) or WriteFailed."""

    room: int
    dest_rank: int
    chunk_id: int
    src_pages: Pages
    dst_pages: Pages
    notification: ChunkWritten
    # derived: both page lists are one ascending run each, so the write is one segment
    contiguous: bool = field(default=False, compare=False)


@fast_init
@dataclass(frozen=True, slots=True)
class PostAuxWrite:
    """Write local aux slot ``src_slot`` into aux slot ``dst_slot`` of ``dest_rank``, then
    deliver ``notification``. Report WriteCompleted(dest_rank, AUX_WRITE) or WriteFailed."""

    room: int
    dest_rank: int
    src_slot: int
    dst_slot: int
    notification: AuxWritten


@fast_init
@dataclass(frozen=True, slots=True)
class PostRead:
    """Read the room's tokens from ``src_pages`` of prefill rank ``src_rank`` into the local
    ``dst_pages``, then deliver ``notification`` to it. The read must end by ``deadline`` (same
    clock as ``now``): the runtime refuses it if it cannot, and the transport cancels it there.
    Report ReadCompleted(src_rank) or ReadFailed."""

    room: int
    src_rank: int
    src_pages: Pages
    dst_pages: Pages
    tokens: int
    deadline: float
    notification: ReadsDone


@fast_init
@dataclass(frozen=True, slots=True)
class SetTimer:
    """(Re-)arm timer ``timer`` of this room to fire at ``deadline`` (same clock as ``now``)."""

    timer: str
    deadline: float


@fast_init
@dataclass(frozen=True, slots=True)
class CancelTimer:
    timer: str


@fast_init
@dataclass(frozen=True, slots=True)
class RecordIgnored:
    """An event was accepted and dropped on purpose (duplicate, late); count and log it."""

    reason: str


@fast_init
@dataclass(frozen=True, slots=True)
class RecordProtocolError:
    """A remote event no row accepted: the room failed; count and log it."""

    reason: str


Action = (
    SendMessage | PostWrite | PostAuxWrite | PostRead | SetTimer | CancelTimer | RecordIgnored | RecordProtocolError
)
