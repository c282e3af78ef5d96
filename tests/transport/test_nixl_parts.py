"""The NIXL data plane's KV region of several buffers: the descriptor that lists them (version 2,
an older peer refused with a reason), and writes whose rows must stay apart where two buffers
happen to be adjacent in memory (two registrations to NIXL)."""

from __future__ import annotations

import json
import struct
import threading
from typing import Any

import numpy as np
import pytest

from kvfsm.transport.base import Inbound, Segment, TransportError
from kvfsm.transport.nixl import NixlConfig, nixl_available
from kvfsm.transport.nixl.descriptors import MAGIC, RemoteRegion, decode_descriptor, encode_descriptor

NIXL_MISSING = nixl_available()


def _raw(header: dict[str, Any]) -> bytes:
    h = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(h)) + h + b"metadata"


def _region(**over: Any) -> dict[str, Any]:
    r = {"addr": 4096, "len": 300, "dev": 0, "mem": "DRAM", "block": 0, "parts": [[4096, 100], [1 << 20, 200]]}
    r.update(over)
    return r


def test_a_descriptor_lists_a_regions_buffers_and_reads_back() -> None:
    regions = {
        "kv": RemoteRegion(4096, 300, 0, "DRAM", 0, ((4096, 100), (1 << 20, 200))),
        "aux": RemoteRegion(8192, 64, 0, "DRAM", 64),
    }
    agent, back, meta = decode_descriptor(encode_descriptor("x", regions, b"md"))
    assert (agent, meta) == ("x", b"md")
    assert back == regions
    assert back["kv"].buffers() == ((4096, 100), (1 << 20, 200)) and back["aux"].buffers() == ((8192, 64),)


@pytest.mark.parametrize(
    ("header", "words"),
    [
        ({"v": 1, "agent": "x", "regions": {"kv": _region(), "aux": _region()}}, "another kvfsm"),
        ({"v": 2, "agent": "x", "regions": {"kv": _region(parts=[[4096, 100]]), "aux": _region()}}, "add up"),
        ({"v": 2, "agent": "x", "regions": {"kv": _region(parts=[[8, 100], [0, 200]]), "aux": _region()}}, "start"),
        ({"v": 2, "agent": "x", "regions": {"kv": _region(parts=[]), "aux": _region()}}, "parts must be"),
        ({"v": 2, "agent": "x", "regions": {"kv": _region(parts=[[4096, -1], [0, 301]]), "aux": _region()}}, "part"),
        ({"v": 2, "agent": "x", "regions": {"kv": _region(block=100), "aux": _region()}}, "no block list"),
    ],
    ids=["old-version", "sum", "first-address", "none", "negative", "block-list"],
)
def test_a_bad_or_old_descriptor_is_refused_with_its_reason(header: dict[str, Any], words: str) -> None:
    with pytest.raises(TransportError, match=words):
        decode_descriptor(_raw(header))


def test_a_descriptor_of_the_old_format_is_refused() -> None:
    old = {k: v for k, v in _region().items() if k != "parts"}
    with pytest.raises(TransportError, match="version 1 is not supported"):
        decode_descriptor(_raw({"v": 1, "agent": "x", "regions": {"kv": old, "aux": old}}))


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")
def test_rows_of_two_adjacent_buffers_stay_two_descriptors() -> None:
    """KV registered as two buffers carved back to back out of one array on both sides; a write
    of the last page of buffer 0 and the first of buffer 1 continues on both sides, yet the
    buffers are two registrations (a descriptor spanning both would fail the transfer): the
    write lands, as two descriptors."""
    from kvfsm.transport.nixl import NixlDataPlane

    block = 4096
    a, b = NixlDataPlane("parts-a", config=NixlConfig(caller_posts="never")), NixlDataPlane("parts-b")
    src = np.random.default_rng(5).integers(0, 256, 8 * block, dtype=np.uint8)
    dst = np.zeros(8 * block, dtype=np.uint8)
    done = threading.Event()
    got: list[Inbound] = []

    def on_a(item: Inbound) -> None:
        got.append(item)
        done.set()

    try:
        a.set_handler(on_a)
        b.set_handler(lambda item: None)
        a.register_memory([src[: 4 * block], src[4 * block :]], np.zeros(64, np.uint8), kv_block=block)
        b.register_memory([dst[: 4 * block], dst[4 * block :]], np.zeros(64, np.uint8), kv_block=block)
        a.add_peer(b.name, b.descriptor())
        b.add_peer(a.name, a.descriptor())
        segs = [Segment(3 * block, 3 * block, block), Segment(4 * block, 4 * block, block)]
        assert a.write(b.name, "kv", segs, b"kv", "kv") == 2 * block
        assert done.wait(20)
        assert [(c.kind, c.tag, c.ok) for c in got] == [("completion", "kv", True)], got
        assert (dst[3 * block : 5 * block] == src[3 * block : 5 * block]).all()
        assert not dst[: 3 * block].any() and not dst[5 * block :].any()
        assert a.stats["descriptors"] == 2
    finally:
        a.close()
        b.close()
