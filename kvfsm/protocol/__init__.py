"""The pure protocol core: spec loading, room machines, events, actions, wire messages.

No I/O, no clocks, no threads: time comes in as ``now``; effects go out as actions.
"""

from __future__ import annotations

from kvfsm.protocol.actions import (
    Action,
    CancelTimer,
    PostAuxWrite,
    PostWrite,
    RecordIgnored,
    RecordProtocolError,
    SendMessage,
    SetTimer,
)
from kvfsm.protocol.errors import (
    KvfsmError,
    KVTransferError,
    LocalProtocolError,
    MalformedMessage,
    RemoteProtocolError,
    SpecError,
    UnsupportedVersion,
)
from kvfsm.protocol.events import *  # noqa: F403
from kvfsm.protocol.events import AUX_WRITE, EVENT_CLASSES, Event
from kvfsm.protocol.machine import Protocol, RoomMachine
from kvfsm.protocol.rooms import Announcement, DecodeRoom, PrefillRoom
from kvfsm.protocol.spec import ProtocolSpec, load_spec

KVPOLL_NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


class KVPoll:
    """SGLang's public status codes (base/conn.py)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


__all__ = [
    "AUX_WRITE",
    "EVENT_CLASSES",
    "KVPOLL_NAMES",
    "Action",
    "Announcement",
    "CancelTimer",
    "DecodeRoom",
    "Event",
    "KVPoll",
    "KVTransferError",
    "KvfsmError",
    "LocalProtocolError",
    "MalformedMessage",
    "PostAuxWrite",
    "PostWrite",
    "PrefillRoom",
    "Protocol",
    "ProtocolSpec",
    "RecordIgnored",
    "RecordProtocolError",
    "RemoteProtocolError",
    "RoomMachine",
    "SendMessage",
    "SetTimer",
    "SpecError",
    "UnsupportedVersion",
    "load_spec",
]
