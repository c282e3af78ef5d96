"""Wire messages and their codec (declared in spec/messages.toml).

A control message travels as a JSON envelope ``{"v": version, "t": name, **fields}`` encoded
UTF-8. A message the spec gives a ``binary_id`` (the per-chunk notifications) travels in a fixed
little-endian layout instead: ``0xB1``, version (u16), binary_id (u8), then its fields in declared
order (u32, u64, bool as one byte 0/1): 0.5 µs to encode and 1 µs to decode against 3.6 and 5 µs
for JSON, on the data path once per chunk on each side. No pickle, ever: a peer's bytes are data.
``decode`` tells the two apart by the first byte (JSON starts with ``{``), validates the exact
field set (or length), the declared types and ranges, and raises ``MalformedMessage`` /
``UnsupportedVersion``; callers drop and count.

A page list (``list[u32]``) travels as a JSON array of its pages, or, when it is one ascending run
held as a ``PageRun`` (the runtime makes one of an engine's run of pages), as ``{"run": [first,
count]}``: a decode rank announcing 8,192 pages cost ~0.45 ms to encode and ~0.65 ms to decode
as an array here (the decode inside the prefill rank's lock), and costs a few µs so. The decoder
accepts both forms for any page list, and gives a run of ``RUN_MIN`` pages or more back as a
``PageRun`` (shorter ones as a tuple, as the array form).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from operator import attrgetter
from typing import Any, ClassVar

from kvfsm.protocol.errors import MalformedMessage, SpecError, UnsupportedVersion
from kvfsm.protocol.pages import PageRun, Pages, run_of
from kvfsm.records import fast_init

MAX_STR = 1024
MAX_LIST = 1 << 20
MAX_MESSAGE = 16 << 20  # bytes; a room_pages of MAX_LIST pages fits
U32 = 1 << 32
U64 = 1 << 63
BINARY_MAGIC = 0xB1  # first byte of a binary message (a JSON message starts with "{")
_MAGIC_BYTE = bytes((BINARY_MAGIC,))
_HEADER = "<BHB"  # magic, version, binary_id
_BINARY_FORMATS = {"u32": "I", "u64": "Q", "bool": "B"}


@fast_init
@dataclass(frozen=True, slots=True)
class Register:
    decode_rank: int
    region: str
    kv_pages: int
    page_bytes: int
    aux_slots: int
    aux_slot_bytes: int
    TYPE: ClassVar[str] = "register"


@fast_init
@dataclass(frozen=True, slots=True)
class RegisterAck:
    prefill_rank: int
    page_bytes: int
    aux_slot_bytes: int
    accepted: bool
    reason: str
    TYPE: ClassVar[str] = "register_ack"


@fast_init
@dataclass(frozen=True, slots=True)
class RoomPages:
    room: int
    decode_rank: int
    pages: Pages
    aux_slot: int
    required_dests: int
    TYPE: ClassVar[str] = "room_pages"


@fast_init
@dataclass(frozen=True, slots=True)
class AbortNotice:
    room: int
    rank: int
    side: str
    reason: str
    TYPE: ClassVar[str] = "abort"


@fast_init
@dataclass(frozen=True, slots=True)
class RoomFailed:
    room: int
    prefill_rank: int
    reason: str
    TYPE: ClassVar[str] = "room_failed"


@fast_init
@dataclass(frozen=True, slots=True)
class Drained:
    room: int
    prefill_rank: int
    TYPE: ClassVar[str] = "drained"


@fast_init
@dataclass(frozen=True, slots=True)
class ChunkWritten:
    room: int
    src: int
    chunk_id: int
    is_last: bool
    page_start: int
    num_pages: int
    TYPE: ClassVar[str] = "chunk_written"


@fast_init
@dataclass(frozen=True, slots=True)
class AuxWritten:
    room: int
    src: int
    TYPE: ClassVar[str] = "aux_written"


Message = Register | RegisterAck | RoomPages | AbortNotice | RoomFailed | Drained | ChunkWritten | AuxWritten

MESSAGE_CLASSES: dict[str, type[Any]] = {
    cls.TYPE: cls
    for cls in (Register, RegisterAck, RoomPages, AbortNotice, RoomFailed, Drained, ChunkWritten, AuxWritten)
}


def _check_uint(limit: int) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not int or not 0 <= v < limit:
            raise ValueError(f"expected an integer in [0, {limit})")
        return v

    return check


def _check_bool(v: Any) -> Any:
    if type(v) is not bool:
        raise ValueError("expected a boolean")
    return v


def _check_str(v: Any) -> Any:
    if type(v) is not str or len(v) > MAX_STR:
        raise ValueError(f"expected a string of at most {MAX_STR} characters")
    return v


def _check_u32_list(v: Any) -> Any:
    if type(v) is dict:
        return _check_run(v)
    if type(v) is not list or len(v) > MAX_LIST:
        raise ValueError(f'expected a list of at most {MAX_LIST} u32, or {{"run": [first, count]}}')
    for x in v:
        if type(x) is not int or not 0 <= x < U32:
            raise ValueError("expected a list of u32")
    return tuple(v)


def _check_run(v: dict[str, Any]) -> Pages:
    """The run form of a page list: ``{"run": [first, count]}``, 1 <= count <= MAX_LIST, every
    page a u32."""
    run = v.get("run")
    if len(v) != 1 or type(run) is not list or len(run) != 2 or any(type(x) is not int for x in run):
        raise ValueError('expected a page run {"run": [first, count]} of two integers')
    first, count = run
    if not (0 <= first and 1 <= count <= MAX_LIST and first + count <= U32):
        raise ValueError(f"page run {run}: first >= 0, 1 <= count <= {MAX_LIST}, pages below {U32}")
    return run_of(first, count)


FIELD_CHECKS: dict[str, Callable[[Any], Any]] = {
    "u32": _check_uint(U32),
    "u64": _check_uint(U64),
    "bool": _check_bool,
    "str": _check_str,
    "list[u32]": _check_u32_list,
}


def _field_values(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """``msg -> (values of names, in order)``. ``attrgetter`` does it in C, half the cost of a
    comprehension (binary messages are encoded once per chunk), but returns a bare value, not a
    1-tuple, for one name (and takes no zero names): those fall back to a comprehension."""
    if len(names) >= 2:
        return attrgetter(*names)

    def values(msg: Any) -> tuple[Any, ...]:
        return tuple(getattr(msg, n) for n in names)

    return values


class Codec:
    """Encodes and validates messages of one protocol version against spec/messages.toml."""

    def __init__(
        self, version: int, message_fields: dict[str, dict[str, str]], binary_ids: dict[str, int] | None = None
    ) -> None:
        self.version = version
        self._checks: dict[str, tuple[type[Any], tuple[tuple[str, Callable[[Any], Any]], ...]]] = {}
        # binary messages: name -> (layout, id, msg -> its field values in order); binary_id ->
        # (class, layout, positions of its bool and u64 values in the unpacked tuple, which need
        # checks beyond the layout's)
        self._bin_out: dict[str, tuple[struct.Struct, int, Callable[[Any], tuple[Any, ...]]]] = {}
        self._bin_in: dict[int, tuple[type[Any], struct.Struct, tuple[int, ...], tuple[int, ...]]] = {}
        for name, cls in MESSAGE_CLASSES.items():
            declared = message_fields.get(name)
            if declared is None:
                raise SpecError(f"message {name!r} has a class but is not declared in spec/messages.toml")
            names = [f.name for f in fields(cls)]
            if names != list(declared):
                raise SpecError(f"message {name!r}: class fields {names} != spec fields {list(declared)}")
            try:
                checks = tuple((fname, FIELD_CHECKS[ftype]) for fname, ftype in declared.items())
            except KeyError as e:
                raise SpecError(f"message {name!r}: unknown field type {e}") from None
            self._checks[name] = (cls, checks)
        extra = set(message_fields) - set(MESSAGE_CLASSES)
        if extra:
            raise SpecError(f"messages declared in spec without a class: {sorted(extra)}")
        if binary_ids and not 0 < version < 1 << 16:
            raise SpecError(f"protocol version {version} does not fit the binary header (u16)")
        for name, bid in (binary_ids or {}).items():
            declared = message_fields[name]
            wide = [t for t in declared.values() if t not in _BINARY_FORMATS]
            if wide:
                raise SpecError(f"message {name!r}: binary_id needs fixed-width fields, not {wide}")
            layout = struct.Struct(_HEADER + "".join(_BINARY_FORMATS[t] for t in declared.values()))
            self._bin_out[name] = (layout, bid, _field_values(tuple(declared)))
            types = list(declared.values())
            bools = tuple(3 + i for i, t in enumerate(types) if t == "bool")
            u64s = tuple(3 + i for i, t in enumerate(types) if t == "u64")
            self._bin_in[bid] = (MESSAGE_CLASSES[name], layout, bools, u64s)

    def packer(self, name: str) -> Callable[..., bytes]:
        """For message ``name`` (as spec/messages.toml names it), ``f(*values) == encode(cls(*values))``
        (values in field order: the class's and the spec's are the same), without the message
        object where it is a binary message (a chunk's notification is encoded once per chunk;
        the runtime's leanest path packs its fields directly). Values the layout cannot hold
        raise ``struct.error``, as ``encode``."""
        cls = self._checks[name][0]
        binary = self._bin_out.get(name)
        if binary is not None:
            layout, bid, _ = binary
            return partial(layout.pack, BINARY_MAGIC, self.version, bid)
        return lambda *values: self.encode(cls(*values))

    def encode(self, msg: Message) -> bytes:
        binary = self._bin_out.get(msg.TYPE)
        if binary is not None:
            layout, bid, values = binary
            return layout.pack(BINARY_MAGIC, self.version, bid, *values(msg))
        # Field by field (dataclasses.asdict deep-copies page lists: 0.3 ms for 256 pages).
        body: dict[str, Any] = {"v": self.version, "t": msg.TYPE}
        for fname, _ in self._checks[msg.TYPE][1]:
            value = getattr(msg, fname)
            if type(value) is PageRun:  # one run: its first page and length, whatever the length
                value = {"run": [value[0], len(value)]} if value else []
            body[fname] = value
        return json.dumps(body, separators=(",", ":")).encode()

    def decode(self, data: bytes) -> Message:
        """Decode and validate; raises MalformedMessage or UnsupportedVersion (drop and count)."""
        if len(data) > MAX_MESSAGE:
            raise MalformedMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
        if data[:1] == _MAGIC_BYTE:
            return self._decode_binary(data)
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise MalformedMessage(f"not a JSON message: {type(e).__name__}") from None
        if type(obj) is not dict:
            raise MalformedMessage("message is not an object")
        version = obj.pop("v", None)
        if type(version) is not int or version != self.version:
            raise UnsupportedVersion(f"protocol version {version!r}; this build speaks {self.version}")
        mtype = obj.pop("t", None)
        entry = self._checks.get(mtype) if type(mtype) is str else None
        if entry is None:
            raise MalformedMessage(f"unknown message type {mtype!r}")
        cls, checks = entry
        if len(obj) != len(checks):
            missing = [n for n, _ in checks if n not in obj]
            extra = sorted(set(obj) - {n for n, _ in checks})
            raise MalformedMessage(f"{mtype}: missing fields {missing}, unknown fields {extra}")
        values = {}
        for fname, check in checks:
            if fname not in obj:
                raise MalformedMessage(f"{mtype}: missing field {fname!r}")
            try:
                values[fname] = check(obj[fname])
            except ValueError as e:
                raise MalformedMessage(f"{mtype}.{fname}: {e}") from None
        msg: Message = cls(**values)
        return msg

    def _decode_binary(self, data: bytes) -> Message:
        if len(data) < 4:
            raise MalformedMessage(f"binary message of {len(data)} bytes has no header")
        _, version, bid = struct.unpack_from(_HEADER, data)
        if version != self.version:
            raise UnsupportedVersion(f"protocol version {version}; this build speaks {self.version}")
        entry = self._bin_in.get(bid)
        if entry is None:
            raise MalformedMessage(f"unknown binary message id {bid}")
        cls, layout, bools, u64s = entry
        if len(data) != layout.size:
            raise MalformedMessage(f"{cls.TYPE}: {len(data)} bytes, the binary layout has {layout.size}")
        values = list(layout.unpack(data))
        for i in bools:
            if values[i] > 1:
                raise MalformedMessage(f"{cls.TYPE}: field {i - 3}: expected a boolean (0 or 1), got {values[i]}")
            values[i] = values[i] == 1
        for i in u64s:
            if values[i] >= U64:
                raise MalformedMessage(f"{cls.TYPE}: field {i - 3}: expected an integer in [0, {U64})")
        msg: Message = cls(*values[3:])
        return msg
