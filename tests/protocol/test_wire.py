"""Wire messages: every type round-trips; decode refuses anything that is not exactly a message.

``CODEC`` speaks JSON only (every message has a JSON form); ``BINARY`` is the runtime's codec,
which writes the notifications in their fixed binary layout and reads both forms. The codecs
bench/core.py measures ``Codec`` against (bench/wire_baselines.py) are held to the same
strictness at the end: the hand-written JSON codec refuses and accepts exactly what ``Codec``
does, and the msgpack form of the notifications refuses what the binary layout refuses.

Everything refused is a MalformedMessage (UnsupportedVersion for another protocol version), which
the runtime drops and counts: a peer's bytes never raise anything else.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_kit import MACHINES, Wire

from kvfsm.protocol import MalformedMessage, Protocol, SpecError, UnsupportedVersion, load_spec
from kvfsm.protocol.events import WritesDrained
from kvfsm.protocol.pages import RUN_MIN, PageRun
from kvfsm.protocol.wire import (
    BINARY_MAGIC,
    MAX_LIST,
    MAX_STR,
    MESSAGE_CLASSES,
    ChunkWritten,
    Codec,
    Drained,
    LayoutFields,
    RoomPages,
)

SPEC = load_spec()
CODEC = Codec(SPEC.version, {n: m.fields for n, m in SPEC.messages.items()})

FIELD = {
    "u32": st.integers(0, 2**32 - 1),
    "u64": st.integers(0, 2**63 - 1),
    "bool": st.booleans(),
    "str": st.text(max_size=40) | st.text(min_size=MAX_STR, max_size=MAX_STR),
    "list[u32]": st.lists(st.integers(0, 2**32 - 1), max_size=20).map(tuple)
    # a run held as a PageRun (the engine's pages, mostly): it travels as {"run": [first, count]}
    | st.integers(0, 2**32 - 1).flatmap(lambda f: st.integers(0, min(5000, 2**32 - f)).map(lambda n: PageRun(f, n))),
    "layout?": st.none()
    | st.builds(
        LayoutFields,
        *[st.integers(0, 2**32 - 1)] * 8,
        st.sampled_from(["sglang", "vllm_nhd", "vllm_hnd", "vllm_cpu", "other"]),
        st.booleans(),
        st.booleans(),
    ),
}
_LAYOUT = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "dtype_bytes": 2, "tp_size": 2, "tp_rank": 1,
           "page_size": 16, "num_pages": 8, "order": "sglang", "mla": False, "opaque": False}  # fmt: skip
# One valid value of each field type, to build messages by hand
SAMPLE = {"u32": 3, "u64": 2**40, "bool": True, "str": "ok", "list[u32]": [1, 2, 3], "layout?": _LAYOUT}


def message_of(name: str) -> st.SearchStrategy:
    spec = SPEC.messages[name]
    return st.fixed_dictionaries({f: FIELD[t] for f, t in spec.fields.items()}).map(
        lambda d: MESSAGE_CLASSES[name](**d)
    )


ANY_MESSAGE = st.sampled_from(sorted(SPEC.messages)).flatmap(message_of)


def envelope(name: str, **override) -> dict:
    """A valid envelope of message ``name`` as a JSON object, with fields overridden."""
    body = {"v": SPEC.version, "t": name}
    body |= {f: SAMPLE[t] for f, t in SPEC.messages[name].fields.items()}
    body |= override
    return body


def raw(obj) -> bytes:
    return json.dumps(obj).encode()


def fields_of_type(ftype: str) -> list[tuple[str, str]]:
    """(message, field) for every field of ``ftype`` in the spec."""
    return [(n, f) for n, m in sorted(SPEC.messages.items()) for f, t in m.fields.items() if t == ftype]


@pytest.mark.parametrize("name", sorted(SPEC.messages))
def test_valid_envelope_decodes_to_its_class(name):
    msg = CODEC.decode(raw(envelope(name)))
    assert type(msg) is MESSAGE_CLASSES[name]


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe\x00", b"room_pages", b'{"v": 1,}', b"NaN NaN"])
def test_decode_rejects_bytes_that_are_not_json(data):
    with pytest.raises(MalformedMessage, match="not a JSON message"):
        CODEC.decode(data)


@pytest.mark.parametrize("data", [b"[]", b"1", b"null", b'"room_pages"', b"true", b'[{"v": 1}]'])
def test_decode_rejects_json_that_is_not_an_object(data):
    with pytest.raises(MalformedMessage, match="not an object"):
        CODEC.decode(data)


@pytest.mark.parametrize("version", [0, SPEC.version - 1, SPEC.version + 1, "1", None, [1]])
def test_decode_rejects_another_protocol_version(version):
    with pytest.raises(UnsupportedVersion):
        CODEC.decode(raw(envelope("abort", v=version)))


def test_decode_rejects_an_envelope_without_version():
    body = envelope("abort")
    del body["v"]
    with pytest.raises(UnsupportedVersion):
        CODEC.decode(raw(body))


@pytest.mark.parametrize("version", [True, 1.0], ids=["true", "float"])
def test_decode_rejects_a_version_of_the_wrong_type(version):
    with pytest.raises(UnsupportedVersion):
        CODEC.decode(raw(envelope("abort", v=version)))


@pytest.mark.parametrize("mtype", ["gossip", "", "Room_Pages", 5, None, ["abort"]])
def test_decode_rejects_an_unknown_message_type(mtype):
    with pytest.raises(MalformedMessage, match="unknown message type"):
        CODEC.decode(raw(envelope("abort", t=mtype)))


def test_decode_rejects_an_envelope_without_type():
    body = envelope("abort")
    del body["t"]
    with pytest.raises(MalformedMessage, match="unknown message type"):
        CODEC.decode(raw(body))


@pytest.mark.parametrize(("name", "field"), [(n, f) for n in sorted(SPEC.messages) for f in SPEC.messages[n].fields])
def test_decode_rejects_a_missing_field(name, field):
    body = envelope(name)
    del body[field]
    with pytest.raises(MalformedMessage, match=f"missing field.*{field}"):
        CODEC.decode(raw(body))


@pytest.mark.parametrize("name", sorted(SPEC.messages))
def test_decode_rejects_an_extra_field(name):
    with pytest.raises(MalformedMessage, match="unknown fields.*'priority'"):
        CODEC.decode(raw(envelope(name, priority=1)))


def test_decode_rejects_a_renamed_field():  # as many fields as declared, one of them unknown
    body = envelope("aux_written")
    body["source"] = body.pop("src")
    with pytest.raises(MalformedMessage, match="src"):
        CODEC.decode(raw(body))


BAD_VALUES = {
    "u32": [True, False, -1, 2**32, 2**40, 1.0, "3", None, [3]],
    "u64": [True, -1, 2**63, 2**64, 0.5, "7", None],
    "bool": [1, 0, "true", None, []],
    "str": [1, None, ["x"], "x" * (MAX_STR + 1)],
    "list[u32]": ["1,2", 3, None, {"0": 1}, [True], [-1], [2**32], [1.0], [[1]], ["1"]]
    + [{"run": r} for r in ([1], [1, 0], [-1, 5], [2**32 - 1, 2], [0, MAX_LIST + 1], [True, 3], [1.0, 2], "1,2")]
    + [{"run": [1, 2], "x": 1}, {"runs": [1, 2]}, {}],
    "layout?": [1, "sglang", [], {}, _LAYOUT | {"extra": 1}, _LAYOUT | {"page_size": -1}, _LAYOUT | {"mla": 1}]
    + [{k: v for k, v in _LAYOUT.items() if k != "order"}, _LAYOUT | {"order": 3}, _LAYOUT | {"num_pages": 2**32}],
}
BAD_CASES = [
    pytest.param(name, field, value, id=f"{name}.{field}={str(value)[:12]}")
    for ftype, values in BAD_VALUES.items()
    for name, field in fields_of_type(ftype)
    for value in values
]


@pytest.mark.parametrize(("name", "field", "value"), BAD_CASES)
def test_decode_rejects_a_value_of_the_wrong_type_or_range(name, field, value):
    with pytest.raises(MalformedMessage, match=f"{name}.{field}"):
        CODEC.decode(raw(envelope(name, **{field: value})))


def test_decode_accepts_the_bounds_of_each_type():
    msg = CODEC.decode(raw(envelope("register", decode_rank=2**32 - 1, page_bytes=2**63 - 1, region="r" * MAX_STR)))
    assert (msg.decode_rank, msg.page_bytes, len(msg.region)) == (2**32 - 1, 2**63 - 1, MAX_STR)
    msg = CODEC.decode(raw(envelope("room_pages", pages=[], room=0)))
    assert msg.pages == () and msg.room == 0


def test_a_page_run_travels_as_its_first_page_and_length_and_comes_back_as_one():
    pages = PageRun(1000, 8192)
    wire = CODEC.encode(RoomPages(7, 1, pages, 3, 2))
    assert json.loads(wire)["pages"] == {"run": [1000, 8192]} and len(wire) < 200
    back = CODEC.decode(wire)
    assert type(back.pages) is PageRun and back.pages == tuple(range(1000, 9192))
    # the array form of the same pages decodes to an equal message
    assert CODEC.decode(raw(envelope("room_pages", room=7, decode_rank=1, pages=list(pages), aux_slot=3,
                                     required_dests=2, tokens=0))) == back  # fmt: skip


@pytest.mark.parametrize(("first", "count"), [(0, 1), (5, RUN_MIN - 1), (2**32 - RUN_MIN, RUN_MIN), (0, MAX_LIST)])
def test_a_run_decodes_to_its_pages_a_short_one_as_a_tuple(first, count):
    msg = CODEC.decode(raw(envelope("room_pages", pages={"run": [first, count]})))
    assert type(msg.pages) is (PageRun if count >= RUN_MIN else tuple)
    assert len(msg.pages) == count and msg.pages[0] == first and msg.pages[-1] == first + count - 1


def test_an_empty_page_run_travels_as_an_empty_list():
    wire = CODEC.encode(RoomPages(7, 1, PageRun(9, 0), 3, 2))
    assert json.loads(wire)["pages"] == [] and CODEC.decode(wire).pages == ()


def test_decode_rejects_a_page_list_over_the_limit():
    body = envelope("room_pages", pages=[0] * (MAX_LIST + 1))
    with pytest.raises(MalformedMessage, match="room_pages.pages"):
        CODEC.decode(raw(body))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | ANY_MESSAGE.map(lambda m: CODEC.encode(m)[: len(CODEC.encode(m)) // 2]))
def test_arbitrary_bytes_decode_or_raise_malformed_message_only(data):
    try:
        CODEC.decode(data)
    except MalformedMessage:
        pass


@settings(max_examples=200, deadline=None)
@given(ANY_MESSAGE, st.data())
def test_any_single_field_replaced_by_an_arbitrary_json_value_is_validated(msg, data):
    body = json.loads(CODEC.encode(msg))
    field = data.draw(st.sampled_from(sorted(k for k in body if k not in ("v", "t"))))
    body[field] = data.draw(
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
            max_leaves=6,
        )
    )
    try:
        decoded = CODEC.decode(raw(body))
    except MalformedMessage:
        accepted = False
    else:
        accepted = True
        assert type(decoded) is type(msg)
    declared = SPEC.messages[msg.TYPE].fields[field]
    assert accepted == _valid(declared, body[field]), f"{msg.TYPE}.{field}: {declared} vs {body[field]!r}"


def _valid(ftype: str, value) -> bool:
    """The spec's field types (messages.toml header), written out independently of wire.py."""

    def uint(v, bits):
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**bits

    if ftype == "u32":
        return uint(value, 32)
    if ftype == "u64":
        return uint(value, 63)
    if ftype == "bool":
        return isinstance(value, bool)
    if ftype == "str":
        return isinstance(value, str) and len(value) <= MAX_STR
    if ftype == "list[u32]":
        if isinstance(value, dict):  # the run form: {"run": [first, count]}, count >= 1
            run = value.get("run")
            if set(value) != {"run"} or not isinstance(run, list) or len(run) != 2 or not all(uint(x, 64) for x in run):
                return False
            return 1 <= run[1] <= MAX_LIST and run[0] + run[1] <= 2**32
        return isinstance(value, list) and len(value) <= MAX_LIST and all(uint(x, 32) for x in value)
    if ftype == "layout?":
        if value is None:
            return True
        if not isinstance(value, dict) or set(value) != set(_LAYOUT):
            return False
        return all(
            (isinstance(v, str) and len(v) <= 32)
            if k == "order"
            else isinstance(v, bool)
            if k == "mla"
            else uint(v, 32)
            for k, v in value.items()
        )
    raise AssertionError(ftype)


def test_deeply_nested_json_is_malformed_not_a_recursion_error():
    with pytest.raises(MalformedMessage):
        CODEC.decode(b"[" * 100_000)


def test_drained_round_trips_with_exactly_its_two_fields():
    msg = Drained(room=2**40, prefill_rank=2**32 - 1)
    wire = CODEC.encode(msg)
    assert json.loads(wire) == {"v": SPEC.version, "t": "drained", "room": 2**40, "prefill_rank": 2**32 - 1}
    assert CODEC.decode(wire) == msg
    with pytest.raises(MalformedMessage, match="unknown fields.*'reason'"):
        CODEC.decode(raw(envelope("drained", reason="why")))  # not a room_failed
    with pytest.raises(MalformedMessage, match="drained.prefill_rank"):
        CODEC.decode(raw(envelope("drained", prefill_rank=-1)))


WIRE = Wire(prefill_ranks=(), decode_ranks=())  # only its message -> room event mapping is used


@settings(max_examples=50, deadline=None)
@given(message_of("drained"))
def test_a_drained_message_becomes_the_decode_rooms_writes_drained_event(msg):
    event = WIRE._event_of("decode", CODEC.decode(CODEC.encode(msg)))
    assert event == WritesDrained(msg.prefill_rank)
    assert event.trigger in MACHINES["decode"].spec.triggers and event.cause == "remote"
    assert not MACHINES["prefill"].accepts("Failed", event.trigger), "drained only ever goes to decode"


# ---------------------------------------------------------------------- binary notifications

BINARY = Protocol().codec  # the codec the runtime uses: notifications in their binary layout
BINARY_NAMES = sorted(n for n, m in SPEC.messages.items() if m.binary_id is not None)


def test_the_notifications_and_only_they_have_a_binary_layout():
    assert BINARY_NAMES == sorted(n for n, m in SPEC.messages.items() if m.plane == "notification")
    assert BINARY_NAMES == ["aux_written", "chunk_written", "reads_done"]


@pytest.mark.parametrize("name", sorted(SPEC.messages))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_message_type_round_trips(data, name):
    msg = data.draw(message_of(name))
    as_json = CODEC.encode(msg)
    assert json.loads(as_json)["t"] == name and json.loads(as_json)["v"] == SPEC.version
    assert CODEC.decode(as_json) == msg
    wire = BINARY.encode(msg)
    if name in BINARY_NAMES:
        widths = {"u32": 4, "u64": 8, "bool": 1}
        assert wire[0] == BINARY_MAGIC and int.from_bytes(wire[1:3], "little") == SPEC.version
        assert wire[3] == SPEC.messages[name].binary_id
        assert len(wire) == 4 + sum(widths[t] for t in SPEC.messages[name].fields.values())
    else:
        assert json.loads(wire)["t"] == name
    assert BINARY.decode(wire) == msg
    assert BINARY.decode(as_json) == msg  # the JSON form of a notification is still accepted


def _chunk_written() -> bytes:
    return BINARY.encode(ChunkWritten(room=7, src=1, chunk_id=2, is_last=True, token_start=8, num_tokens=4))


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda b: b[:-1], MalformedMessage, "bytes, the binary layout has"),
        (lambda b: b + b"\x00", MalformedMessage, "bytes, the binary layout has"),
        (lambda b: b[:3], MalformedMessage, "no header"),
        (lambda b: b[:3] + b"\x63" + b[4:], MalformedMessage, "unknown binary message id 99"),
        (lambda b: b[:1] + (SPEC.version + 1).to_bytes(2, "little") + b[3:], UnsupportedVersion, "version"),
        (lambda b: b[:20] + b"\x02" + b[21:], MalformedMessage, "expected a boolean"),  # is_last = 2
        (lambda b: b[:4] + (2**63).to_bytes(8, "little") + b[12:], MalformedMessage, r"\[0, 2\*\*63\)|in \[0, "),
    ],
    ids=["short", "long", "header-only", "unknown-id", "other-version", "bool-2", "u64-overflow"],
)
def test_a_binary_message_is_refused_unless_exactly_valid(mutate, error, match):
    good = _chunk_written()
    assert BINARY.decode(good).is_last is True
    with pytest.raises(error, match=match):
        BINARY.decode(mutate(good))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40).map(lambda b: b"\xb1" + b) | st.binary(min_size=29, max_size=29))
def test_arbitrary_binary_bytes_decode_or_raise_malformed_message_only(data):
    try:
        msg = BINARY.decode(data)
    except MalformedMessage:
        return
    assert BINARY.decode(BINARY.encode(msg)) == msg  # whatever decodes is a valid message


def test_a_binary_layout_needs_fixed_width_fields_and_a_version_that_fits():
    fields = {n: m.fields for n, m in SPEC.messages.items()}
    with pytest.raises(SpecError, match="fixed-width"):
        Codec(SPEC.version, fields, {"abort": 3})  # abort carries strings
    with pytest.raises(SpecError, match="u16"):
        Codec(1 << 16, fields, {"drained": 3})


@settings(max_examples=200, deadline=None)
@given(msg=ANY_MESSAGE)
def test_a_packer_encodes_the_fields_as_encode_encodes_the_message(msg):
    """``Codec.packer`` (the runtime packs a chunk's notification from its fields) gives the
    same bytes as ``encode``: binary messages with the shipped codec, JSON ones without binary
    ids; a value the binary layout cannot hold raises there as in ``encode``."""
    for codec in (BINARY, CODEC):
        values = [getattr(msg, f) for f in SPEC.messages[msg.TYPE].fields]
        try:
            want = codec.encode(msg)
        except Exception as exc:  # noqa: BLE001 - the packer must refuse it too
            with pytest.raises(type(exc)):
                codec.packer(msg.TYPE)(*values)
            continue
        assert codec.packer(msg.TYPE)(*values) == want


# ---------------------------------------------------------------------- the measured baselines

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from wire_baselines import MsgpackCodec, StdlibJsonCodec  # noqa: E402

_ARGS = (
    SPEC.version,
    {n: m.fields for n, m in SPEC.messages.items()},
    {n: m.binary_id for n, m in SPEC.messages.items() if m.binary_id is not None},
)
STDLIB = StdlibJsonCodec(*_ARGS)
MSGPACK = MsgpackCodec(*_ARGS)


def _outcome(codec, data: bytes):
    """What ``codec`` makes of ``data``: the message, or the class of its refusal."""
    try:
        return codec.decode(data)
    except (MalformedMessage, UnsupportedVersion) as e:
        return type(e)


# (no infinities: ``Infinity`` is not JSON; json.loads takes it, msgspec refuses it as malformed)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(ANY_MESSAGE, st.data())
def test_the_hand_written_json_codec_accepts_and_refuses_exactly_as_the_codec(msg, data):
    """The baseline of bench/core.py's ``codec`` section is as strict as ``Codec``: over valid
    envelopes with a key replaced, added or removed, both decode the same message or refuse
    with the same error class."""
    body = json.loads(CODEC.encode(msg))
    key = data.draw(st.sampled_from(sorted(body)) | st.text(max_size=4))
    if data.draw(st.booleans()):
        body.pop(key, None)
    else:
        body[key] = data.draw(ANY_JSON | st.sampled_from([SPEC.version, msg.TYPE, 2**32, 2**63, [1, 2]]))
    wire = raw(body)
    assert _outcome(STDLIB, wire) == _outcome(CODEC, wire)
    if msg.TYPE not in BINARY_NAMES:  # (those STDLIB writes in their binary layout, as BINARY)
        assert json.loads(STDLIB.encode(msg)) == json.loads(CODEC.encode(msg))


@pytest.mark.parametrize("codec", [STDLIB, MSGPACK], ids=["stdlib-json", "msgpack"])
@pytest.mark.parametrize(("name", "field", "value"), BAD_CASES[::7])
def test_the_baselines_refuse_a_bad_json_value_as_the_codec(codec, name, field, value):
    with pytest.raises(MalformedMessage, match=f"{name}.{field}"):
        codec.decode(raw(envelope(name, **{field: value})))


@pytest.mark.parametrize("name", BINARY_NAMES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_msgpack_notifications_round_trip_and_pack_as_they_encode(data, name):
    msg = data.draw(message_of(name))
    wire = MSGPACK.encode(msg)
    assert wire[:1] not in (b"{", bytes((BINARY_MAGIC,))) and MSGPACK.decode(wire) == msg
    assert MSGPACK.packer(name)(*(getattr(msg, f) for f in SPEC.messages[name].fields)) == wire


def _msgpack_note(*fields) -> bytes:
    import msgspec

    return msgspec.msgpack.encode([SPEC.messages["chunk_written"].binary_id, *fields])


@pytest.mark.parametrize(
    ("wire", "error"),
    [
        (_msgpack_note(SPEC.version, 7, 1, 2, True, 8, 4), None),  # the valid one, as a control
        (_msgpack_note(SPEC.version + 1, 7, 1, 2, True, 8, 4), UnsupportedVersion),
        (_msgpack_note(SPEC.version, 7, 1, 2, True, 8), MalformedMessage),  # a field short
        (_msgpack_note(SPEC.version, 7, 1, 2, True, 8, 4, 0), MalformedMessage),  # a field long
        (_msgpack_note(SPEC.version, 7, 1, 2, 2, 8, 4), MalformedMessage),  # is_last = 2
        (_msgpack_note(SPEC.version, 2**63, 1, 2, True, 8, 4), MalformedMessage),  # room past u64
        (_msgpack_note(SPEC.version, 7, 2**32, 2, True, 8, 4), MalformedMessage),  # src past u32
        (_msgpack_note(SPEC.version, 7, True, 2, True, 8, 4), MalformedMessage),  # a bool for a u32
        (b"\x97\x63" + _msgpack_note(SPEC.version, 7, 1, 2, True, 8, 4)[2:], MalformedMessage),  # unknown id
        (b"\x80", MalformedMessage),  # a map, not an array
    ],
    ids=["valid", "other-version", "short", "long", "bool-2", "u64-overflow", "u32-overflow", "bool-for-int",
         "unknown-id", "map"],
)  # fmt: skip
def test_the_msgpack_notification_is_refused_unless_exactly_valid(wire, error):
    if error is None:
        assert MSGPACK.decode(wire) == ChunkWritten(7, 1, 2, True, 8, 4)
    else:
        with pytest.raises(error):
            MSGPACK.decode(wire)
