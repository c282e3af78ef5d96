"""The wire codecs ``bench/core.py``'s ``codec`` section measures ``kvfsm.protocol.wire.Codec``
against, equally strict (tests/protocol/test_wire.py holds them to the same cases):

  StdlibJsonCodec  control messages through the standard library's ``json`` and a check per
                   field written by hand (exact field set, types, bounds, version first).
  MsgpackCodec     the notifications (the messages with a ``binary_id``) as msgspec msgpack
                   arrays (``[binary_id, version, *fields]``, typed ``Struct``s with the spec's
                   bounds) instead of the fixed ``struct`` layout.

Both keep everything else of ``Codec``: the JSON forms of ``StdlibJsonCodec`` and the binary
forms of ``MsgpackCodec`` are the only code here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvfsm.protocol.errors import MalformedMessage, UnsupportedVersion
from kvfsm.protocol.pages import PageRun, Pages, run_of
from kvfsm.protocol.wire import (
    BINARY_MAGIC,
    MAX_LIST,
    MAX_MESSAGE,
    MAX_STR,
    MESSAGE_CLASSES,
    U32,
    U64,
    Codec,
    LayoutFields,
    Message,
)

_BINARY = bytes((BINARY_MAGIC,))


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


def _check_run(v: dict[str, Any]) -> Pages:
    run = v.get("run")
    if len(v) != 1 or type(run) is not list or len(run) != 2 or any(type(x) is not int for x in run):
        raise ValueError('expected a page run {"run": [first, count]} of two integers')
    first, count = run
    if not (0 <= first and 1 <= count <= MAX_LIST and first + count <= U32):
        raise ValueError(f"page run {run}: first >= 0, 1 <= count <= {MAX_LIST}, pages below {U32}")
    return run_of(first, count)


def _check_u32_list(v: Any) -> Any:
    if type(v) is dict:
        return _check_run(v)
    if type(v) is not list or len(v) > MAX_LIST:
        raise ValueError(f'expected a list of at most {MAX_LIST} u32, or {{"run": [first, count]}}')
    for x in v:
        if type(x) is not int or not 0 <= x < U32:
            raise ValueError("expected a list of u32")
    return tuple(v)


def _check_layout(v: Any) -> Any:
    if v is None:
        return None
    try:
        return msgspec.convert(v, LayoutFields, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(f"expected null or a layout: {e}") from None


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "u32": _check_uint(U32),
    "u64": _check_uint(U64),
    "bool": _check_bool,
    "str": _check_str,
    "list[u32]": _check_u32_list,
    "layout?": _check_layout,
}


class StdlibJsonCodec(Codec):
    """``Codec`` with its JSON form through ``json`` and hand-written checks (see module doc)."""

    def __init__(
        self, version: int, message_fields: dict[str, dict[str, str]], binary_ids: dict[str, int] | None = None
    ) -> None:
        super().__init__(version, message_fields, binary_ids)
        self._checks = {
            name: (MESSAGE_CLASSES[name], tuple((f, _CHECKS[t]) for f, t in message_fields[name].items()))
            for name in MESSAGE_CLASSES
        }

    def encode(self, msg: Message) -> bytes:
        if msg.TYPE in self._bin_out:
            return super().encode(msg)
        body: dict[str, Any] = {"v": self.version, "t": msg.TYPE}
        for fname, _ in self._checks[msg.TYPE][1]:
            value = getattr(msg, fname)
            if type(value) is PageRun:
                value = {"run": [value[0], len(value)]} if value else []
            elif type(value) is LayoutFields:
                value = msgspec.structs.asdict(value)
            body[fname] = value
        return json.dumps(body, separators=(",", ":")).encode()

    def decode(self, data: bytes) -> Message:
        if len(data) > MAX_MESSAGE:
            raise MalformedMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
        if data[:1] == _BINARY:
            return super().decode(data)
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


_MSGPACK_TYPES: dict[str, Any] = {
    "u32": Annotated[int, Meta(ge=0, lt=U32)],
    "u64": Annotated[int, Meta(ge=0, le=U64 - 1)],
    "bool": bool,
}


class MsgpackCodec(Codec):
    """``Codec`` with its notifications as msgspec msgpack arrays (see module doc)."""

    def __init__(
        self, version: int, message_fields: dict[str, dict[str, str]], binary_ids: dict[str, int] | None = None
    ) -> None:
        super().__init__(version, message_fields)  # every message has its JSON form
        self._packed: dict[str, type[Any]] = {}
        self._unpacked: dict[type[Any], type[Any]] = {}
        for name, bid in (binary_ids or {}).items():
            declared = message_fields[name]
            struct_type = msgspec.defstruct(
                f"{MESSAGE_CLASSES[name].__name__}Msgpack",
                [("v", int), *((f, _MSGPACK_TYPES[t]) for f, t in declared.items())],
                tag=bid,
                array_like=True,
                forbid_unknown_fields=True,  # (for an array: no trailing elements)
                frozen=True,
            )
            self._packed[name] = struct_type
            self._unpacked[struct_type] = MESSAGE_CLASSES[name]
        union: Any = None
        for struct_type in self._unpacked:
            union = struct_type if union is None else union | struct_type
        self._msgpack_decode = msgspec.msgpack.Decoder(union).decode
        self._msgpack_encode = msgspec.msgpack.Encoder().encode

    def packer(self, name: str) -> Callable[..., bytes]:
        struct_type = self._packed.get(name)
        if struct_type is None:
            return super().packer(name)
        encode, version = self._msgpack_encode, self.version
        return lambda *values: encode(struct_type(version, *values))

    def encode(self, msg: Message) -> bytes:
        struct_type = self._packed.get(msg.TYPE)
        if struct_type is None:
            return super().encode(msg)
        return self._msgpack_encode(struct_type(self.version, *self._json_out[msg.TYPE][1](msg)))

    def decode(self, data: bytes) -> Message:
        if data[:1] == b"{":
            return super().decode(data)
        try:
            decoded = self._msgpack_decode(data)
        except msgspec.MsgspecError as e:
            raise MalformedMessage(f"not a notification: {e}") from None
        if decoded.v != self.version:
            raise UnsupportedVersion(f"protocol version {decoded.v!r}; this build speaks {self.version}")
        msg: Message = self._unpacked[type(decoded)](*msgspec.structs.astuple(decoded)[1:])
        return msg
