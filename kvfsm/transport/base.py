"""The two ports a transport implements, and the ``Endpoint`` the runtime talks to.

Control plane (``ControlPlane``): ``send(peer, data)`` best effort, small messages; inbound
messages and peer loss. Data plane (``DataPlane``): memory registered once (a KV region and an aux
region), ``write`` copies segments into a peer's registered region and then delivers a
notification to that peer (``read`` copies the other way and notifies the peer it read from);
the initiator later receives a completion. A data plane describes its registered memory as an
opaque ``descriptor()``; the control plane carries it to peers at handshake and hands the peer's
to ``add_peer`` before any message of that peer is delivered, so a peer that can talk to us can
also be written to.

An ``Endpoint`` is both ports for one (side, rank). ``loopback`` implements both in one object;
``SplitEndpoint`` joins a separate control plane (``zmq``) and data plane (``nixl``). Everything
inbound (messages, notifications, completions, peer loss) reaches the owner through the handler it
installed with ``set_handler``, possibly from a transport thread or from inside a ``write`` call
(the NIXL data plane hands over the completions a posting caller finds done), so a handler must
accept being called re-entrantly; the runtime turns each into protocol events (it queues those
that arrive while it steps a room and applies them after the step). A transport that collects items in rounds may also offer ``set_batch_handler``
and hand a round over in one call (``BatchHandler``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, overload

import numpy as np

from kvfsm.records import fast_init

Region = Literal["kv", "aux"]


class TransportError(Exception):
    """A data-plane operation failed (peer dead, region not registered, out of bounds)."""


@fast_init
@dataclass(frozen=True, slots=True)
class Segment:
    """One contiguous copy: ``length`` bytes from local offset ``src`` to remote offset ``dst``."""

    src: int
    dst: int
    length: int


@fast_init
@dataclass(frozen=True, slots=True)
class Inbound:
    """Something that arrived for an endpoint.

    kind: "message" (control plane bytes from ``peer``), "notification" (after the data of a
    write from ``peer``), "completion" (of our own write ``tag``; ``ok`` and ``reason``),
    "peer_lost" (``peer`` crashed or its link broke). Only a batch handler (``BatchHandler``)
    also gets "completions": ``tag`` is a tuple of tags, writes that completed together (all
    ok), as one "completion" item each would say.
    """

    kind: Literal["message", "notification", "completion", "completions", "peer_lost"]
    peer: str
    data: bytes = b""
    tag: object = None
    ok: bool = True
    reason: str = ""


class SegmentArray(Sequence[Segment]):
    """Many segments as three 1-D int64 numpy arrays (``src``, ``dst``, ``length``): a scattered
    chunk's write, one segment per run of pages, without a ``Segment`` object per run. It is a
    ``Sequence[Segment]`` (indexing and iteration make the ``Segment``s, for a transport that
    walks them one by one); ``check_segments`` and the NIXL data plane read the arrays whole."""

    __slots__ = ("src", "dst", "length")

    def __init__(self, src: Any, dst: Any, length: Any) -> None:
        self.src = np.ascontiguousarray(src, dtype=np.int64)
        self.dst = np.ascontiguousarray(dst, dtype=np.int64)
        self.length = np.ascontiguousarray(length, dtype=np.int64)
        if not self.src.ndim == self.dst.ndim == self.length.ndim == 1 or not (
            len(self.src) == len(self.dst) == len(self.length)
        ):
            raise ValueError("SegmentArray: src, dst and length must be 1-D and of one length")

    @classmethod
    def of(cls, segments: Sequence[Segment]) -> SegmentArray:
        """The same segments, as arrays."""
        return cls([s.src for s in segments], [s.dst for s in segments], [s.length for s in segments])

    def __len__(self) -> int:
        return len(self.length)

    @overload
    def __getitem__(self, i: int) -> Segment: ...

    @overload
    def __getitem__(self, i: slice) -> SegmentArray: ...

    def __getitem__(self, i: int | slice) -> Segment | SegmentArray:
        if isinstance(i, slice):
            return SegmentArray(self.src[i], self.dst[i], self.length[i])
        return Segment(int(self.src[i]), int(self.dst[i]), int(self.length[i]))

    def __iter__(self) -> Iterator[Segment]:
        for src, dst, n in zip(self.src.tolist(), self.dst.tolist(), self.length.tolist(), strict=True):
            yield Segment(src, dst, n)

    def __repr__(self) -> str:
        return f"SegmentArray({len(self)} segments, {self.total()} bytes)"

    def total(self) -> int:
        """The bytes of every segment together."""
        return int(self.length.sum())

    def nonempty(self) -> SegmentArray:
        """The segments that move bytes (itself if all do)."""
        keep = self.length != 0
        return self if bool(keep.all()) else SegmentArray(self.src[keep], self.dst[keep], self.length[keep])


Handler = Callable[[Inbound], None]
# Optional: several items at once, in order, as if handed one by one. A transport that collects
# items in rounds (the NIXL poller: a folded transfer completes many writes at once) offers
# ``set_batch_handler`` and hands a round over in one call: the runtime takes its lock once for
# the round instead of once per item, so a thread that hands over chunks meanwhile is not woken
# and preempted for each completion. The writes of one transfer that completed may come as one
# "completions" item (see ``Inbound``): no item is built, nor handled, per write.
BatchHandler = Callable[[list[Inbound]], None]
# One write as ``write_many`` takes it: (peer, region, segments, notification, tag).
Write = tuple[str, Region, Sequence[Segment], bytes, object]
AddPeer = Callable[[str, bytes], None]
RemovePeer = Callable[[str], None]

MemKind = Literal["DRAM", "VRAM"]


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A registered buffer: where it is, how big, on which device. ``owner`` keeps it alive."""

    addr: int
    nbytes: int
    mem: MemKind
    device: int
    owner: object
    readonly: bool = False

    def view(self) -> memoryview:
        """The bytes of a host (DRAM) region."""
        if self.mem != "DRAM":
            raise TransportError(f"a {self.mem} region has no host view")
        if not self.nbytes:
            return memoryview(b"")
        return memoryview((ctypes.c_char * self.nbytes).from_address(self.addr)).cast("B")


def as_region(buf: Any) -> MemoryRegion:
    """A ``MemoryRegion`` for a KV or aux buffer: a torch tensor (CPU: DRAM, CUDA: VRAM), a numpy
    array, or anything with the buffer protocol (bytearray, memoryview, mmap). Must be contiguous."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):  # torch.Tensor, without importing torch
        if not buf.is_contiguous():
            raise TransportError("a registered tensor must be contiguous")
        dev = buf.device
        mem: MemKind = "VRAM" if dev.type == "cuda" else "DRAM"
        if dev.type not in ("cpu", "cuda"):
            raise TransportError(f"cannot register memory on device {dev}")
        return MemoryRegion(int(buf.data_ptr()), int(buf.numel() * buf.element_size()), mem, int(dev.index or 0), buf)
    mv = memoryview(buf)
    if not mv.contiguous:
        raise TransportError("a registered buffer must be contiguous")
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if not len(mv):
        return MemoryRegion(0, 0, "DRAM", 0, mv, mv.readonly)
    if mv.readonly:
        # ctypes cannot take the address of a read-only buffer; numpy can, without copying.
        import numpy as np

        arr = np.frombuffer(mv, dtype=np.uint8)
        return MemoryRegion(int(arr.ctypes.data), len(mv), "DRAM", 0, (mv, arr), True)
    return MemoryRegion(ctypes.addressof(ctypes.c_char.from_buffer(mv)), len(mv), "DRAM", 0, mv)


def region_nbytes(buf: Any) -> int:
    return sum(r.nbytes for r in as_regions(buf))


def as_regions(buf: Any) -> tuple[MemoryRegion, ...]:
    """The parts of a KV region: one ``MemoryRegion`` for a buffer, one per buffer for a list or
    tuple of buffers (an engine's per-layer tensors), which must all be host memory (DRAM) or
    all device memory (VRAM) of one device. The parts make one virtual region in which part
    ``i`` starts at the sum of the sizes of the parts before it (``Parts``)."""
    if not isinstance(buf, list | tuple):
        return (as_region(buf),)
    if not buf:
        raise TransportError("a region of several buffers needs at least one")
    parts = tuple(as_region(b) for b in buf)
    places = {(r.mem, r.device if r.mem == "VRAM" else 0) for r in parts}
    if len(places) > 1:
        raise TransportError(f"the buffers of one region must all be DRAM or all VRAM of one device, not {places}")
    return parts


class Parts:
    """Where the parts of a region of several buffers lie in its virtual address space: part
    ``i`` at ``bases[i]`` (the sum of the sizes before it), ``sizes[i]`` bytes; ``nbytes`` all
    of them. ``locate`` maps virtual offsets to (part, offset in part), for arrays at once."""

    __slots__ = ("bases", "sizes", "nbytes")

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        if not len(self.sizes) or bool((self.sizes < 0).any()):
            raise ValueError("Parts: one or more sizes, none negative")
        self.bases = np.concatenate(([0], np.cumsum(self.sizes)[:-1])).astype(np.int64)
        self.nbytes = int(self.sizes.sum())

    def locate(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(part, offset within it, fits) of each segment ``[offsets, offsets + lengths)`` (all
        within ``nbytes``): ``fits`` is False for one that runs past the end of its part, into
        the next (an empty segment fits anywhere)."""
        part = np.maximum(np.searchsorted(self.bases, offsets, side="right") - 1, 0)
        within = offsets - self.bases[part]
        fits = (lengths == 0) | (within + lengths <= self.sizes[part])
        return part, within, fits


def check_parts(segments: Sequence[Segment], src: Parts | None, dst: Parts | None, what: str) -> None:
    """Refuse (TransportError naming the first) a segment that crosses a buffer boundary of the
    source (``src``) or destination (``dst``) region of several buffers (None: one buffer, no
    boundary). Segments must be within both regions already (``check_segments``)."""
    arr = segments if type(segments) is SegmentArray else SegmentArray.of(segments)
    for side, parts, offsets in (("source", src, arr.src), ("destination", dst, arr.dst)):
        if parts is None or len(parts.sizes) < 2:
            continue
        fits = parts.locate(offsets, arr.length)[2]
        if not bool(fits.all()):
            s = arr[int(np.argmin(fits))]
            raise TransportError(
                f"{what}: segment {s} crosses a buffer boundary of the {side} region "
                f"(buffers at {parts.bases.tolist()}, {parts.nbytes} bytes)"
            )


class ControlPlane(Protocol):
    """Small messages between named peers. Inbound: "message" and "peer_lost" items."""

    name: str

    def set_handler(self, handler: Handler) -> None: ...

    def attach_data(self, descriptor: bytes, add_peer: AddPeer, remove_peer: RemovePeer) -> None:
        """Carry ``descriptor`` to every peer at handshake; call ``add_peer`` with each peer's
        before delivering any of its messages (a peer whose descriptor is refused is not heard)
        and ``remove_peer`` when it is lost."""
        ...

    def send(self, peer: str, data: bytes) -> None:
        """Best effort; a dead or unknown peer drops the message (the protocol's timers cover it)."""
        ...

    def close(self) -> None: ...


class DataPlane(Protocol):
    """Registered memory, one-sided writes and reads with notifications. Inbound:
    "notification" and "completion" items (and "peer_lost" when the data path finds a peer dead)."""

    name: str

    def set_handler(self, handler: Handler) -> None: ...

    def register_memory(self, kv: Any, aux: Any, *, kv_block: int = 0, aux_block: int = 0) -> None:
        """Register both regions; ``kv_block``/``aux_block`` (page and aux-slot sizes) let a data
        plane prepare block-granular descriptor lists once instead of per transfer. ``kv`` is a
        buffer or a list or tuple of buffers (``as_regions``: an engine's per-layer tensors),
        addressed as one virtual region in which buffer ``i`` starts at the sum of the sizes of
        the buffers before it; a segment may not cross from one buffer into the next."""
        ...

    def descriptor(self) -> bytes:
        """What a peer needs to reach our registered memory (opaque, no pickle)."""
        ...

    def add_peer(self, peer: str, descriptor: bytes) -> None:
        """Make ``peer`` reachable. Raises TransportError for a malformed or mismatched descriptor."""
        ...

    def remove_peer(self, peer: str) -> None: ...

    def write(self, peer: str, region: Region, segments: Sequence[Segment], notification: bytes, tag: object) -> int:
        """Copy ``segments`` (``src`` local offset, ``dst`` offset at ``peer``) into ``peer``'s
        ``region``; then deliver ``notification`` to it and a completion for ``tag`` to us.
        Returns the bytes posted. Raises TransportError *before any byte is written* if a segment
        lies outside either registered region, crosses a buffer boundary of a region of several
        buffers (on either side), or the peer is unknown or dead; a failure after
        posting comes back as a completion with ``ok=False``."""
        ...

    def read(
        self,
        peer: str,
        region: Region,
        segments: Sequence[Segment],
        notification: bytes,
        tag: object,
        within_s: float | None = None,
    ) -> int:
        """Copy ``segments`` (``src`` offset at ``peer``, ``dst`` local offset) from ``peer``'s
        ``region`` into ours; then notify ``peer`` and complete ``tag`` to us. Errors as ``write``.
        ``within_s``: a read still in flight this long after its post is cancelled (no byte of
        it moves any more) and completes as failed: pull mode's reads end by their lease."""
        ...

    def close(self) -> None: ...

    # Optional: ``write_many(writes: Sequence[Write]) -> list[int | Exception]``, several writes
    # handed over at once (an engine's batch of chunks): each one as ``write`` would do it, its
    # bytes or the exception that refused it (nothing of it moved; the others go on) in the
    # result, in order; a data plane that posts in transfers may fold them into fewer.
    # ``write_many`` below is the fallback for data planes without it.

    # Optional: ``write_run(peer, region, src, dst, length, notification, tag) -> int``, the
    # same as ``write(peer, region, [Segment(src, dst, length)], notification, tag)``: the usual
    # write (a chunk of adjacent pages to adjacent pages), which the runtime's leanest path hands
    # over without building the segment list.

    # Optional: ``expect_traffic(on: bool)``, the owner's hint whether peers may write into (or
    # read from) our memory now: a decode rank with rooms in flight, say. A data plane that must
    # poll to notice a peer's writes (NIXL: and to let them complete) may poll rarely while it is
    # off and nothing of its own is in flight. Before the first call a data plane assumes on.

    # Optional: ``flush()``, the owner's hint that it hands nothing more over for now and waits
    # for its writes (``Manager.wait``): a data plane that holds writes back to post them
    # together posts them now, and one that polls for completions polls closely until the
    # next write (no polling interval added to the last writes' latency).


def write_many(plane: Any, writes: Sequence[Write]) -> list[int | Exception]:
    """``plane.write_many(writes)`` if the data plane (or endpoint) has it, else one ``write`` at a
    time: each write's bytes, or the exception that refused it, in order."""
    many = getattr(plane, "write_many", None)
    if many is not None:
        return many(writes)  # type: ignore[no-any-return]
    out: list[int | Exception] = []
    for w in writes:
        try:
            out.append(plane.write(*w))
        except Exception as exc:  # noqa: BLE001 - a write that raises fails itself, not its batch
            out.append(exc)
    return out


class Endpoint(Protocol):
    """Both ports for one (side, rank), as the runtime uses them."""

    name: str

    def set_handler(self, handler: Handler) -> None: ...

    def register_memory(self, kv: Any, aux: Any, *, kv_block: int = 0, aux_block: int = 0) -> None: ...

    def send(self, peer: str, data: bytes) -> None:
        """Best effort; a dead or unknown peer drops the message (the protocol's timers cover it)."""
        ...

    def write(self, peer: str, region: Region, segments: Sequence[Segment], notification: bytes, tag: object) -> int:
        """Copy ``segments`` into ``peer``'s ``region``; then deliver ``notification`` to it and a
        completion for ``tag`` to us. Returns the bytes moved. Raises TransportError *before any
        byte is written* if a segment lies outside either registered region or the peer is dead."""
        ...

    def read(
        self,
        peer: str,
        region: Region,
        segments: Sequence[Segment],
        notification: bytes,
        tag: object,
        within_s: float | None = None,
    ) -> int:
        """Copy ``segments`` from ``peer``'s ``region`` into ours (``DataPlane.read``)."""
        ...


def check_segments(segments: Sequence[Segment], local: int, remote: int, what: str) -> int:
    """Bounds-check segments (``src`` within ``local`` bytes, ``dst`` within ``remote``); returns
    the total length. Raises TransportError naming the first bad segment."""
    if type(segments) is SegmentArray:  # the arrays at once (compared without sums: no overflow)
        src, dst, n = segments.src, segments.dst, segments.length
        bad = (n < 0) | (src < 0) | (dst < 0) | (src > local - n) | (dst > remote - n)
        if bool(bad.any()):
            s = segments[int(np.argmax(bad))]
            raise TransportError(
                f"{what}: segment {s} outside registered memory ({local} local, {remote} remote bytes)"
            )
        return segments.total()
    total = 0
    for s in segments:
        if s.length < 0 or s.src < 0 or s.dst < 0 or s.src + s.length > local or s.dst + s.length > remote:
            raise TransportError(
                f"{what}: segment {s} outside registered memory ({local} local, {remote} remote bytes)"
            )
        total += s.length
    return total


class SplitEndpoint:
    """An ``Endpoint`` made of a control plane and a data plane with the same name."""

    def __init__(self, control: ControlPlane, data: DataPlane) -> None:
        if control.name != data.name:
            raise ValueError(f"control plane {control.name!r} and data plane {data.name!r} must share a name")
        self.name = control.name
        self.control = control
        self.data = data
        # the data plane's own write_run, if it has one (no call through this endpoint)
        run = getattr(data, "write_run", None)
        if run is not None:
            self.write_run = run

    def set_handler(self, handler: Handler) -> None:
        self.data.set_handler(handler)
        self.control.set_handler(handler)

    def set_batch_handler(self, batch: BatchHandler) -> None:
        """Pass a batch handler on to a data plane that offers ``set_batch_handler``."""
        setter = getattr(self.data, "set_batch_handler", None)
        if setter is not None:
            setter(batch)

    def register_memory(self, kv: Any, aux: Any, *, kv_block: int = 0, aux_block: int = 0) -> None:
        self.data.register_memory(kv, aux, kv_block=kv_block, aux_block=aux_block)
        self.control.attach_data(self.data.descriptor(), self.data.add_peer, self.data.remove_peer)

    def send(self, peer: str, data: bytes) -> None:
        self.control.send(peer, data)

    def write(self, peer: str, region: Region, segments: Sequence[Segment], notification: bytes, tag: object) -> int:
        return self.data.write(peer, region, segments, notification, tag)

    def read(
        self,
        peer: str,
        region: Region,
        segments: Sequence[Segment],
        notification: bytes,
        tag: object,
        within_s: float | None = None,
    ) -> int:
        return self.data.read(peer, region, segments, notification, tag, within_s)

    def expect_traffic(self, on: bool) -> None:
        """Pass the hint on to a data plane that offers ``expect_traffic``."""
        hint = getattr(self.data, "expect_traffic", None)
        if hint is not None:
            hint(on)

    def flush(self) -> None:
        """Pass the hint on to a data plane that offers ``flush``."""
        flush = getattr(self.data, "flush", None)
        if flush is not None:
            flush()

    def write_many(self, writes: Sequence[Write]) -> list[int | Exception]:
        return write_many(self.data, writes)

    def close(self) -> None:
        self.control.close()
        self.data.close()
