"""Wire messages and their codec (declared in spec/messages.toml).

A control message travels as a JSON object ``{"v": version, "t": name, **fields}`` encoded UTF-8
(key order is free). A message the spec gives a ``binary_id`` (the per-chunk notifications)
travels in a fixed little-endian layout instead: ``0xB1``, version (u16), binary_id (u8), then its
fields in declared order (u32, u64, bool as one byte 0/1); it is encoded once per chunk on the
data path, so ``Codec.packer`` packs it straight from its fields. No pickle, ever: a peer's bytes
are data. ``decode`` tells the two forms apart by the first byte (JSON starts with ``{``),
validates the exact field set (or length), the declared types and ranges, and raises
``MalformedMessage`` / ``UnsupportedVersion``; callers drop and count.

JSON is decoded by msgspec into one typed ``Struct`` per message, tagged by ``t``, with unknown
fields forbidden and the spec's bounds as constraints (strict: no bool or float for an integer,
no coercion); the struct becomes the message's dataclass. A refused message is looked at again,
off the hot path, so that the error says what a peer got wrong in the codec's own words (version
first, then the type, then missing and unknown fields, then the first bad value). The binary
layout stays on ``struct``: ``bench/core.py``'s ``codec`` section measures both against
msgspec's msgpack form, which packs a notification at about twice the cost.

A page list (``list[u32]``) travels as a JSON array of its pages, or, when it is one ascending run
held as a ``PageRun`` (the runtime makes one of an engine's run of pages), as ``{"run": [first,
count]}``: a few bytes and µs whatever the length, where a decode rank's 8,192 pages as an array
cost a large share of a millisecond (``bench/core.py``'s ``announce``). The decoder accepts both
forms for any page list, and gives a run of ``RUN_MIN`` pages or more back as a ``PageRun``
(shorter ones as a tuple, as the array form).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from operator import attrgetter
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

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
_U32 = Annotated[int, Meta(ge=0, lt=U32)]


class LayoutFields(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A rank's KV layout as a registration carries it: the fields of ``kvfsm.layout.KVLayout``
    (``KVLayout.to_wire`` / ``KVLayout.from_wire``). Only the types are checked here; whether the
    values make a layout, and whether two layouts can exchange KV, the handshake decides (a peer
    whose layout is wrong is refused with the reason, never dropped unanswered)."""

    num_layers: _U32
    num_kv_heads: _U32
    head_dim: _U32
    dtype_bytes: _U32
    tp_size: _U32
    tp_rank: _U32
    page_size: _U32
    num_pages: _U32
    order: Annotated[str, Meta(max_length=32)]
    mla: bool
    opaque: bool


@fast_init
@dataclass(frozen=True, slots=True)
class Register:
    decode_rank: int
    region: str
    kv_pages: int
    page_bytes: int
    aux_slots: int
    aux_slot_bytes: int
    layout: LayoutFields | None = None
    TYPE: ClassVar[str] = "register"


@fast_init
@dataclass(frozen=True, slots=True)
class RegisterAck:
    prefill_rank: int
    page_bytes: int
    aux_slot_bytes: int
    accepted: bool
    reason: str
    layout: LayoutFields | None = None
    TYPE: ClassVar[str] = "register_ack"


@fast_init
@dataclass(frozen=True, slots=True)
class RoomPages:
    room: int
    decode_rank: int
    pages: Pages
    aux_slot: int
    required_dests: int
    tokens: int = 0
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
    token_start: int
    num_tokens: int
    TYPE: ClassVar[str] = "chunk_written"


@fast_init
@dataclass(frozen=True, slots=True)
class AuxWritten:
    room: int
    src: int
    TYPE: ClassVar[str] = "aux_written"


@fast_init
@dataclass(frozen=True, slots=True)
class LeaseClaim:
    room: int
    decode_rank: int
    epoch: int
    readers: int
    tokens: int
    TYPE: ClassVar[str] = "lease_claim"


@fast_init
@dataclass(frozen=True, slots=True)
class LeaseGrant:
    room: int
    prefill_rank: int
    epoch: int
    lease_ms: int
    pages: Pages
    tokens: int
    page_size: int
    TYPE: ClassVar[str] = "lease_grant"


@fast_init
@dataclass(frozen=True, slots=True)
class LeaseRelease:
    room: int
    decode_rank: int
    reason: str
    TYPE: ClassVar[str] = "lease_release"


@fast_init
@dataclass(frozen=True, slots=True)
class ReadsDone:
    room: int
    dst: int
    TYPE: ClassVar[str] = "reads_done"


Message = (
    Register
    | RegisterAck
    | RoomPages
    | AbortNotice
    | RoomFailed
    | Drained
    | ChunkWritten
    | AuxWritten
    | LeaseClaim
    | LeaseGrant
    | LeaseRelease
    | ReadsDone
)

MESSAGE_CLASSES: dict[str, type[Any]] = {
    cls.TYPE: cls
    for cls in (
        Register,
        RegisterAck,
        RoomPages,
        AbortNotice,
        RoomFailed,
        Drained,
        ChunkWritten,
        AuxWritten,
        LeaseClaim,
        LeaseGrant,
        LeaseRelease,
        ReadsDone,
    )
}


class _Run(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The run form of a page list: ``{"run": [first, count]}``, 1 <= count <= MAX_LIST, every
    page a u32."""

    run: tuple[Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=1, le=MAX_LIST)]]

    def __post_init__(self) -> None:
        first, count = self.run
        if first + count > U32:  # (msgspec turns a ValueError here into a ValidationError)
            raise ValueError(f"page run [{first}, {count}]: every page must be below {U32}")


# The spec's field types as msgspec types (its decoder is strict: a bool is not an integer, nor is
# 1.0, and nothing is coerced). u64 stops below 2**63, as the binary layout's checks.
_FIELD_TYPES: dict[str, Any] = {
    "u32": Annotated[int, Meta(ge=0, lt=U32)],
    "u64": Annotated[int, Meta(ge=0, le=U64 - 1)],
    "bool": bool,
    "str": Annotated[str, Meta(max_length=MAX_STR)],
    "list[u32]": Annotated[list[Annotated[int, Meta(ge=0, lt=U32)]], Meta(max_length=MAX_LIST)] | _Run,
    "layout?": LayoutFields | None,
}
_AT_FIELD = re.compile(r" - at `\$\.(\w+)")  # where a msgspec ValidationError says it failed


def _field_values(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """``msg -> (values of names, in order)``. ``attrgetter`` does it in C, half the cost of a
    comprehension, but returns a bare value, not a 1-tuple, for one name (and takes no zero
    names): those fall back to a comprehension."""
    if len(names) >= 2:
        return attrgetter(*names)

    def values(msg: Any) -> tuple[Any, ...]:
        return tuple(getattr(msg, n) for n in names)

    return values


def _page_list_out(value: Any) -> Any:
    """A page list as msgspec encodes it: a non-empty PageRun as its run, anything else as the
    array of its pages."""
    if type(value) is PageRun:
        return _Run((value[0], len(value))) if value else ()
    return value


def _page_list_in(value: Any) -> Any:
    return run_of(*value.run) if type(value) is _Run else tuple(value)


class Codec:
    """Encodes and validates messages of one protocol version against spec/messages.toml."""

    def __init__(
        self, version: int, message_fields: dict[str, dict[str, str]], binary_ids: dict[str, int] | None = None
    ) -> None:
        self.version = version
        self._declared: dict[str, tuple[str, ...]] = {}
        # JSON: name -> (struct, msg -> its field values, positions of page lists among them);
        # struct -> (class, positions of page lists among the struct's values, after "v")
        self._json_out: dict[str, tuple[type[Any], Callable[[Any], tuple[Any, ...]], tuple[int, ...]]] = {}
        self._json_in: dict[type[Any], tuple[type[Any], tuple[int, ...]]] = {}
        # binary messages: name -> (layout, id, msg -> its field values in order); the 4 bytes of a
        # header (magic, this version, binary_id) -> the reader of the message it starts
        self._bin_out: dict[str, tuple[struct.Struct, int, Callable[[Any], tuple[Any, ...]]]] = {}
        self._bin_in: dict[bytes, Callable[[bytes], Message]] = {}
        self._bin_ids: dict[int, str] = {}
        structs: list[type[Any]] = []
        for name, cls in MESSAGE_CLASSES.items():
            declared = message_fields.get(name)
            if declared is None:
                raise SpecError(f"message {name!r} has a class but is not declared in spec/messages.toml")
            names = [f.name for f in fields(cls)]
            if names != list(declared):
                raise SpecError(f"message {name!r}: class fields {names} != spec fields {list(declared)}")
            unknown = sorted(set(declared.values()) - set(_FIELD_TYPES))
            if unknown:
                raise SpecError(f"message {name!r}: unknown field type {unknown[0]!r}")
            self._declared[name] = tuple(declared)
            struct_type = msgspec.defstruct(
                f"{cls.__name__}Json",
                [("v", int), *((f, _FIELD_TYPES[t]) for f, t in declared.items())],
                tag_field="t",
                tag=name,
                forbid_unknown_fields=True,
                frozen=True,
            )
            structs.append(struct_type)
            page_lists = tuple(i for i, t in enumerate(declared.values()) if t == "list[u32]")
            self._json_out[name] = (struct_type, _field_values(tuple(declared)), page_lists)
            self._json_in[struct_type] = (cls, page_lists)
        extra = set(message_fields) - set(MESSAGE_CLASSES)
        if extra:
            raise SpecError(f"messages declared in spec without a class: {sorted(extra)}")
        union: Any = structs[0]
        for struct_type in structs[1:]:
            union = union | struct_type
        self._json_decode = msgspec.json.Decoder(union).decode
        self._json_encode = msgspec.json.Encoder().encode
        if binary_ids and not 0 < version < 1 << 16:
            raise SpecError(f"protocol version {version} does not fit the binary header (u16)")
        for name, bid in (binary_ids or {}).items():
            declared = message_fields[name]
            wide = [t for t in declared.values() if t not in _BINARY_FORMATS]
            if wide:
                raise SpecError(f"message {name!r}: binary_id needs fixed-width fields, not {wide}")
            layout = struct.Struct(_HEADER + "".join(_BINARY_FORMATS[t] for t in declared.values()))
            self._bin_out[name] = (layout, bid, _field_values(tuple(declared)))
            header = struct.pack(_HEADER, BINARY_MAGIC, version, bid)
            self._bin_in[header] = _binary_reader(MESSAGE_CLASSES[name], layout, list(declared.values()))
            self._bin_ids[bid] = name

    def packer(self, name: str) -> Callable[..., bytes]:
        """For message ``name`` (as spec/messages.toml names it), ``f(*values) == encode(cls(*values))``
        (values in field order: the class's and the spec's are the same), without the message
        object where it is a binary message (a chunk's notification is encoded once per chunk;
        the runtime's leanest path packs its fields directly). Values the layout cannot hold
        raise ``struct.error``, as ``encode``."""
        cls = MESSAGE_CLASSES[name]
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
        struct_type, json_values, page_lists = self._json_out[msg.TYPE]
        out = json_values(msg)
        if page_lists:
            out = tuple(_page_list_out(v) if i in page_lists else v for i, v in enumerate(out))
        return self._json_encode(struct_type(self.version, *out))

    def decode(self, data: bytes) -> Message:
        """Decode and validate; raises MalformedMessage or UnsupportedVersion (drop and count)."""
        if len(data) > MAX_MESSAGE:
            raise MalformedMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
        if data[:1] == _MAGIC_BYTE:
            read = self._bin_in.get(data[:4])
            if read is None:
                raise self._binary_refusal(data)
            return read(data)
        try:
            decoded = self._json_decode(data)
        except msgspec.ValidationError as e:
            raise self._refusal(data, e) from None
        except (msgspec.DecodeError, RecursionError) as e:
            raise MalformedMessage(f"not a JSON message: {type(e).__name__}") from None
        if decoded.v != self.version:
            raise UnsupportedVersion(f"protocol version {decoded.v!r}; this build speaks {self.version}")
        cls, page_lists = self._json_in[type(decoded)]
        values = msgspec.structs.astuple(decoded)[1:]
        if page_lists:
            values = tuple(_page_list_in(v) if i in page_lists else v for i, v in enumerate(values))
        msg: Message = cls(*values)
        return msg

    def _refusal(self, data: bytes, error: msgspec.ValidationError) -> MalformedMessage:
        """The error for JSON the typed decoder refused, in the order a reader checks it: an
        object, its version, its type, its field set, then the value msgspec refused."""
        try:
            obj = msgspec.json.decode(data)
        except (msgspec.DecodeError, RecursionError) as e:
            return MalformedMessage(f"not a JSON message: {type(e).__name__}")
        if type(obj) is not dict:
            return MalformedMessage("message is not an object")
        version = obj.pop("v", None)
        if type(version) is not int or version != self.version:
            return UnsupportedVersion(f"protocol version {version!r}; this build speaks {self.version}")
        mtype = obj.pop("t", None)
        declared = self._declared.get(mtype) if type(mtype) is str else None
        if declared is None:
            return MalformedMessage(f"unknown message type {mtype!r}")
        missing = [n for n in declared if n not in obj]
        extra = sorted(set(obj) - set(declared))
        if missing or extra:
            return MalformedMessage(f"{mtype}: missing fields {missing}, unknown fields {extra}")
        at = _AT_FIELD.search(str(error))
        where = f"{mtype}.{at.group(1)}" if at else mtype
        return MalformedMessage(f"{where}: {error}")

    def _binary_refusal(self, data: bytes) -> MalformedMessage:
        """The error for a binary message whose header is not one of this codec's."""
        if len(data) < 4:
            return MalformedMessage(f"binary message of {len(data)} bytes has no header")
        _, version, bid = struct.unpack_from(_HEADER, data)
        if version != self.version:
            return UnsupportedVersion(f"protocol version {version}; this build speaks {self.version}")
        return MalformedMessage(f"unknown binary message id {bid}")


def _binary_reader(cls: type[Any], layout: struct.Struct, types: list[str]) -> Callable[[bytes], Message]:
    """``data -> message`` for the binary layout of ``cls`` (its header already matched): the
    exact length, then the checks beyond the layout's: a u64 below 2**63, and a bool's byte 0 or
    1, looked at in the bytes, so that the fields unpack with ``?`` straight into bools (no list
    to convert them in: chunk_written is decoded once per chunk)."""
    size, name = layout.size, cls.TYPE
    unpack_body = struct.Struct("<" + "".join("?" if t == "bool" else _BINARY_FORMATS[t] for t in types)).unpack_from
    offsets = [struct.calcsize(_HEADER + "".join(_BINARY_FORMATS[t] for t in types[:i])) for i in range(len(types))]
    bool_bytes = tuple((offsets[i], i) for i, t in enumerate(types) if t == "bool")
    u64s = tuple(i for i, t in enumerate(types) if t == "u64")

    def read(data: bytes) -> Message:
        if len(data) != size:
            raise MalformedMessage(f"{name}: {len(data)} bytes, the binary layout has {size}")
        for at, i in bool_bytes:
            if data[at] > 1:
                raise MalformedMessage(f"{name}: field {i}: expected a boolean (0 or 1), got {data[at]}")
        values = unpack_body(data, 4)
        for i in u64s:
            if values[i] >= U64:
                raise MalformedMessage(f"{name}: field {i}: expected an integer in [0, {U64})")
        msg: Message = cls(*values)
        return msg

    return read
