"""The descriptor a NIXL data plane gives its peers: who it is and where its memory is.

Wire format: ``MAGIC``, a little-endian u32 header length, a JSON header (``v``, ``agent``, and
per region ``addr``, ``len``, ``dev``, ``mem``, ``block`` and ``parts``: the ``[addr, len]`` of
each buffer of the region, in the order of the region's virtual space, ``addr`` the first's and
``len`` their sum), then NIXL's own agent metadata, opaque to us. Never pickle. A descriptor of
another version (another kvfsm) is refused: both ends must run the same kvfsm. ``decode_descriptor`` checks every field strictly: a peer's bad descriptor is
refused with ``TransportError`` before any of it is used.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from kvfsm.transport.base import Region, TransportError

MAGIC = b"KVFSMNX1"
DESCRIPTOR_VERSION = 2  # 2: regions of several buffers ("parts")
_MAX_PARTS = 4096
_MAX_HEADER = 64 << 10
_MAX_METADATA = 16 << 20
REGIONS: tuple[Region, ...] = ("kv", "aux")


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """One registered region as a descriptor tells it: address, bytes, device, memory kind
    ("DRAM" or "VRAM"), block size (0: no prepared block list) and its buffers' (address,
    bytes), in order (empty: one buffer at ``addr``)."""

    addr: int
    nbytes: int
    device: int
    mem: str
    block: int
    parts: tuple[tuple[int, int], ...] = ()

    def buffers(self) -> tuple[tuple[int, int], ...]:
        """(address, bytes) of each buffer of the region, in order."""
        return self.parts or ((self.addr, self.nbytes),)


def encode_descriptor(agent: str, regions: dict[str, RemoteRegion], metadata: bytes) -> bytes:
    header = json.dumps(
        {
            "v": DESCRIPTOR_VERSION,
            "agent": agent,
            "regions": {
                k: {
                    "addr": r.addr,
                    "len": r.nbytes,
                    "dev": r.device,
                    "mem": r.mem,
                    "block": r.block,
                    "parts": [list(b) for b in r.buffers()],
                }
                for k, r in regions.items()
            },
        },
        separators=(",", ":"),
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + metadata


def decode_descriptor(data: bytes) -> tuple[str, dict[str, RemoteRegion], bytes]:
    """Parse and validate a peer's descriptor. Raises TransportError on anything unexpected."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TransportError("descriptor must be bytes")
    data = bytes(data)
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise TransportError("not a kvfsm NIXL descriptor (bad magic)")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if hlen > _MAX_HEADER or start + hlen > len(data):
        raise TransportError(f"descriptor header length {hlen} out of bounds")
    metadata = data[start + hlen :]
    if not metadata or len(metadata) > _MAX_METADATA:
        raise TransportError(f"descriptor carries {len(metadata)} bytes of agent metadata")
    try:
        header = json.loads(data[start : start + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(f"descriptor header is not JSON: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"v", "agent", "regions"}:
        raise TransportError("descriptor header must have exactly v, agent, regions")
    if header["v"] != DESCRIPTOR_VERSION or type(header["v"]) is not int:
        raise TransportError(
            f"descriptor version {header['v']!r} is not supported (want {DESCRIPTOR_VERSION}): "
            "the peer runs another kvfsm; both ends must run the same one"
        )
    agent = header["agent"]
    if not isinstance(agent, str) or not agent or len(agent) > 256:
        raise TransportError("descriptor agent name must be a non-empty string")
    raw = header["regions"]
    if not isinstance(raw, dict) or set(raw) != set(REGIONS):
        raise TransportError(f"descriptor regions must be exactly {list(REGIONS)}")
    regions: dict[str, RemoteRegion] = {}
    for name, r in raw.items():
        if not isinstance(r, dict) or set(r) != {"addr", "len", "dev", "mem", "block", "parts"}:
            raise TransportError(f"descriptor region {name!r} must have addr, len, dev, mem, block, parts")
        ints = [r[k] for k in ("addr", "len", "dev", "block")]
        if any(type(v) is not int or v < 0 or v >= 1 << 64 for v in ints):
            raise TransportError(f"descriptor region {name!r}: addr, len, dev, block must be unsigned 64-bit ints")
        if r["mem"] not in ("DRAM", "VRAM"):
            raise TransportError(f"descriptor region {name!r}: memory kind {r['mem']!r} is not DRAM or VRAM")
        if r["block"] and r["len"] % r["block"]:
            raise TransportError(f"descriptor region {name!r}: {r['len']} bytes are not whole {r['block']}-byte blocks")
        parts = _parts(name, r["parts"], r["addr"], r["len"])
        if r["block"] and len(parts) > 1:
            raise TransportError(f"descriptor region {name!r}: a region of several buffers has no block list")
        many = parts if len(parts) > 1 else ()
        regions[name] = RemoteRegion(r["addr"], r["len"], r["dev"], r["mem"], r["block"], many)
    return agent, regions, metadata


def _parts(name: str, raw: object, addr: int, nbytes: int) -> tuple[tuple[int, int], ...]:
    """A region's ``parts`` validated: [address, bytes] pairs of unsigned 64-bit ints, the first
    at ``addr``, ``nbytes`` in all."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= _MAX_PARTS:
        raise TransportError(f"descriptor region {name!r}: parts must be a list of 1 to {_MAX_PARTS} buffers")
    out: list[tuple[int, int]] = []
    for p in raw:
        if (
            not isinstance(p, list)
            or len(p) != 2
            or any(type(v) is not int or v < 0 or v >= 1 << 64 for v in p)
            or p[0] + p[1] >= 1 << 63
        ):
            raise TransportError(f"descriptor region {name!r}: a part must be [address, bytes], ints in [0, 2^63)")
        out.append((p[0], p[1]))
    if out[0][0] != addr or sum(n for _, n in out) != nbytes:
        raise TransportError(f"descriptor region {name!r}: its parts do not start at addr and add up to len")
    return tuple(out)
