"""The data-plane checks: writes and reads land exactly, notify after their data, complete once,
and bad input is refused before a byte moves. See ``kvfsm.testing.conformance``."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import numpy as np

from kvfsm.testing.conformance.harness import Net, Planes, PlanesFactory, case, raises
from kvfsm.transport.base import Inbound, Segment, SegmentArray, TransportError, write_many

# The memory a data-plane check registers on each plane: 64 KV pages of 512 bytes, 16 aux slots
# of 64 bytes, seeded random contents.
KV_BLOCK = 512
KV_BYTES = 64 * KV_BLOCK
AUX_BLOCK = 64
AUX_BYTES = 16 * AUX_BLOCK


def _connect(planes: dict[str, Any]) -> None:
    """Every plane learns every other plane's descriptor (what the control plane's HELLOs do)."""
    for n, p in planes.items():
        for m, q in planes.items():
            if m != n:
                p.add_peer(m, q.descriptor())


class _DataNet(Net):
    """Data planes with seeded KV and aux memory registered, each the peer of every other."""

    def __init__(self, made: Planes[Any], names: tuple[str, ...], timeout: float, seed: int = 0) -> None:
        super().__init__(made, names, timeout)
        rng = np.random.default_rng(seed)
        self.kv = {n: rng.integers(0, 256, KV_BYTES, dtype=np.uint8) for n in names}
        self.aux = {n: rng.integers(0, 256, AUX_BYTES, dtype=np.uint8) for n in names}
        try:
            for n, p in self.planes.items():
                p.register_memory(self.kv[n], self.aux[n], kv_block=KV_BLOCK, aux_block=AUX_BLOCK)
            _connect(self.planes)
        except BaseException:
            made.close()
            raise

    def region(self, name: str, region: str) -> np.ndarray:
        return self.kv[name] if region == "kv" else self.aux[name]

    def crash(self, name: str) -> None:
        if self.made.crash is not None:
            self.made.crash(name)
        else:
            for n, p in self.planes.items():
                if n != name:
                    p.remove_peer(name)


@contextmanager
def _data_case(make: PlanesFactory, label: str, timeout: float) -> Iterator[_DataNet]:
    with case(make, label, ("a", "b", "c"), timeout, _DataNet) as net:
        yield net


def _apply(dst: np.ndarray, src: np.ndarray, segments: Sequence[Segment]) -> np.ndarray:
    out = dst.copy()
    for s in segments:
        out[s.dst : s.dst + s.length] = src[s.src : s.src + s.length]
    return out


def _random_segments(rng: random.Random, src_len: int, dst_len: int, n: int, block: int = 1) -> list[Segment]:
    segs = []
    for _ in range(n):
        length = rng.randint(1, min(src_len, dst_len) // 4 // block) * block
        src = rng.randrange(0, (src_len - length) // block + 1) * block
        dst = rng.randrange(0, (dst_len - length) // block + 1) * block
        segs.append(Segment(src, dst, length))
    return segs


def _watch_notifications(net: _DataNet, dst: np.ndarray) -> tuple[dict[bytes, bool], dict[bytes, np.ndarray]]:
    """(seen, plans): for each notification ``b`` receives, whether ``dst`` held exactly
    ``plans[note]`` (what the check expects once that write landed) when it arrived."""
    seen_at_notify: dict[bytes, bool] = {}
    plans: dict[bytes, np.ndarray] = {}

    def check(name: str, item: Inbound) -> None:
        if name == "b" and item.kind == "notification":
            seen_at_notify[item.data] = bool((dst == plans[item.data]).all())

    net.rec.hooks.append(check)
    return seen_at_notify, plans


def _contains(seen: dict[bytes, bool], key: bytes) -> Callable[[], bool]:
    return lambda: key in seen


def _both_arrived(net: _DataNet) -> bool:
    return bool(net.rec.got("a", "completion")) and bool(net.rec.got("b", "notification"))


def check_write_lands_exactly_and_notifies_after_data(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """Writes of random segments, block-aligned or byte ranges, into either region: the bytes
    land exactly (later segments of a write win where they overlap), each notification arrives
    after its write's data, each write completes once with its tag, and no one else hears."""
    for region in ("kv", "aux"):
        for aligned in (True, False):
            label = f"write lands exactly [{region}, {'block-aligned' if aligned else 'byte-ranges'}]"
            with _data_case(make, label, timeout) as net:
                rng = random.Random(7)
                block = (KV_BLOCK if region == "kv" else AUX_BLOCK) if aligned else 1
                src, dst = net.region("a", region), net.region("b", region)
                expected = dst.copy()
                seen_at_notify, plans = _watch_notifications(net, dst)
                for i in range(5):
                    segs = _random_segments(rng, len(src), len(dst), rng.randint(1, 4), block)
                    expected = _apply(expected, src, segs)
                    note = f"w{i}".encode()
                    plans[note] = expected.copy()
                    moved = net.planes["a"].write("b", region, segs, note, ("tag", i))
                    assert moved == sum(s.length for s in segs), f"write returned {moved}, not the bytes of {segs}"
                    net.wait_count("a", "completion", i + 1, f"completion of write {i}")
                    net.wait(_contains(seen_at_notify, note), f"notification {note!r}")
                assert (dst == expected).all(), "the destination does not hold exactly the written bytes"
                assert all(seen_at_notify.values()), "a notification arrived before its data"
                done = net.rec.got("a", "completion")
                assert [c.tag for c in done] == [("tag", i) for i in range(5)], (
                    f"completion tags {[c.tag for c in done]}"
                )
                assert all(c.ok and c.peer == "b" for c in done), f"completions {done}"
                notes = net.rec.got("b", "notification")
                assert [n.peer for n in notes] == ["a"] * 5, f"notifications {notes}"
                assert net.rec.got("c", "notification") == [], "a bystander was notified"


def check_read_copies_from_peer_and_notifies_it(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """A read copies the peer's segments into our memory, notifies the peer and completes to us."""
    with _data_case(make, "read", timeout) as net:
        segs = [Segment(3 * KV_BLOCK, 10 * KV_BLOCK, 2 * KV_BLOCK), Segment(100, 7, 300)]
        expected = _apply(net.kv["a"], net.kv["b"], segs)
        moved = net.planes["a"].read("b", "kv", segs, b"read-done", "r1")
        assert moved == 2 * KV_BLOCK + 300, f"read returned {moved}"
        net.wait(lambda: _both_arrived(net), "the read's completion and notification")
        assert (net.kv["a"] == expected).all(), "the reader's memory does not hold exactly the bytes read"
        (note,) = net.rec.got("b", "notification")
        assert (note.peer, note.data) == ("a", b"read-done"), f"notification {note}"
        (done,) = net.rec.got("a", "completion")
        assert (done.tag, done.ok) == ("r1", True), f"completion {done}"


def check_empty_write_still_notifies_and_completes(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """A write of no segments moves nothing, yet notifies and completes."""
    with _data_case(make, "empty write", timeout) as net:
        before = net.kv["b"].copy()
        assert net.planes["a"].write("b", "kv", [], b"nothing", "e") == 0, "an empty write moved bytes"
        net.wait(lambda: _both_arrived(net), "the empty write's completion and notification")
        assert (net.kv["b"] == before).all(), "an empty write changed the destination"
        assert net.rec.got("b", "notification")[0].data == b"nothing"
        assert net.rec.got("a", "completion")[0].tag == "e"


def check_scattered_write_lands_as_segments_or_as_a_segment_array(
    make: PlanesFactory, *, timeout: float = 10.0
) -> None:
    """A write of many short runs (a scattered chunk: one segment per page or run, here 24..64)
    lands byte for byte whether its segments come as ``Segment``s or as a ``SegmentArray`` (the
    runtime's form for long scattered chunks), and counts the same bytes."""
    shapes = {"blocks-reversed": (KV_BLOCK, True), "two-block-runs": (2 * KV_BLOCK, False), "byte-ranges": (100, True)}
    for form in ("list", "array"):
        for shape, (per_segment, reverse) in shapes.items():
            with _data_case(make, f"scattered write [{form}, {shape}]", timeout) as net:
                n = min(64, KV_BYTES // per_segment // 2)
                order = list(range(n))[::-1] if reverse else list(range(n))
                segs = [Segment(i * per_segment, (n + j) * per_segment, per_segment) for i, j in enumerate(order)]
                arg: Any = segs if form == "list" else SegmentArray.of(segs)
                expected = _apply(net.kv["b"], net.kv["a"], segs)
                moved = net.planes["a"].write("b", "kv", arg, b"scattered", "s")
                assert moved == n * per_segment, f"write returned {moved}, not {n * per_segment}"
                net.wait(lambda: _both_arrived(net), "the write's completion and notification")
                assert (net.kv["b"] == expected).all(), "the destination does not hold exactly the written bytes"
                (done,) = net.rec.got("a", "completion")
                assert (done.tag, done.ok) == ("s", True), f"completion {done}"


_BAD_SEGMENTS = {
    "remote-overflow": Segment(0, KV_BYTES - 10, 11),  # past the end of the peer's region
    "local-overflow": Segment(KV_BYTES, 0, 1),  # past the end of ours
    "negative-offset": Segment(-1, 0, 4),
    "negative-remote-offset": Segment(0, -1, 4),
    "negative-length": Segment(0, 0, -4),
}


def check_out_of_bounds_is_refused_before_any_byte_moves(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """A write with a segment outside either region (alone or after a good one, as ``Segment``s
    or a ``SegmentArray``) raises TransportError naming that segment, and moves, notifies and
    completes nothing."""
    for form in ("list", "array"):
        for bad_id, bad in _BAD_SEGMENTS.items():
            for alone in (False, True):
                label = f"out of bounds [{form}, {bad_id}, {'alone' if alone else 'after-a-good-one'}]"
                with _data_case(make, label, timeout) as net:
                    before = net.kv["b"].copy()
                    segs = [bad] if alone else [Segment(0, 0, KV_BLOCK), bad]
                    arg: Any = segs if form == "list" else SegmentArray.of(segs)
                    with raises(TransportError, f"write of {segs}", match="outside registered") as err:
                        net.planes["a"].write("b", "kv", arg, b"x", "t")
                    assert str(bad) in str(err[0]), f"the error {err[0]!r} does not name the bad segment {bad}"
                    net.quiet()
                    assert (net.kv["b"] == before).all(), "a refused write moved bytes"
                    assert net.rec.got("b", "notification") == [], "a refused write notified"
                    assert net.rec.got("a", "completion") == [], "a refused write completed"


def check_write_run_is_a_write_of_one_segment(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """``write_run`` (the runtime's leanest path, optional) lands, notifies after its data and
    completes exactly as ``write`` of the one segment, and refuses what ``write`` refuses, before
    a byte moves: out of either region, a negative offset or length, an unknown or removed peer."""
    with _data_case(make, "write_run", timeout) as net:
        plane, src, dst = net.planes["a"], net.kv["a"], net.kv["b"]
        if getattr(plane, "write_run", None) is None:
            return  # the plane does not offer it
        rng = random.Random(3)
        expected = dst.copy()
        seen_at_notify, plans = _watch_notifications(net, dst)
        runs = [(0, 0, KV_BLOCK), (KV_BYTES - 3 * KV_BLOCK, 5 * KV_BLOCK, 3 * KV_BLOCK), (17, KV_BYTES - 40, 40)]
        runs += [(g.src, g.dst, g.length) for g in _random_segments(rng, KV_BYTES, KV_BYTES, 3)]
        for i, (s, d, n) in enumerate(runs):
            expected = _apply(expected, src, [Segment(s, d, n)])
            note = f"run{i}".encode()
            plans[note] = expected.copy()
            assert plane.write_run("b", "kv", s, d, n, note, ("run", i)) == n, f"write_run {(s, d, n)} miscounted"
            net.wait_count("a", "completion", i + 1, f"completion of run {i}")
            net.wait(_contains(seen_at_notify, note), f"notification {note!r}")
        assert (dst == expected).all(), "the destination does not hold exactly the written bytes"
        assert all(seen_at_notify.values()), "a notification arrived before its data"
        tags = [c.tag for c in net.rec.got("a", "completion")]
        assert tags == [("run", i) for i in range(len(runs))], f"completion tags {tags}"
        for s, d, n in [(0, KV_BYTES - 10, 11), (KV_BYTES, 0, 1), (-1, 0, 4), (0, -1, 4), (0, 0, -4)]:
            with raises(TransportError, f"write_run {(s, d, n)}", match="outside registered") as err:
                plane.write_run("b", "kv", s, d, n, b"x", "t")
            assert str(Segment(s, d, n)) in str(err[0]), f"the error {err[0]!r} does not name the bad segment"
        with raises(TransportError, "write_run to an unknown peer"):
            plane.write_run("nobody", "kv", 0, 0, 8, b"x", "t")
        net.crash("c")
        with raises(TransportError, "write_run to a lost peer"):
            plane.write_run("c", "kv", 0, 0, 8, b"x", "t")
        net.quiet()
        assert (dst == expected).all(), "a refused write_run moved bytes"
        assert len(net.rec.got("a", "completion")) == len(runs), "a refused write_run completed"
        assert len(net.rec.got("b", "notification")) == len(runs), "a refused write_run notified"


def check_unknown_or_removed_peer_is_refused(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """A write to an unknown peer, to an unknown region or to a lost peer raises TransportError;
    writes to the others go on."""
    with _data_case(make, "unknown or removed peer", timeout) as net:
        a = net.planes["a"]
        with raises(TransportError, "write to an unknown peer"):
            a.write("nobody", "kv", [Segment(0, 0, 8)], b"x", "t")
        with raises(TransportError, "write to an unknown region"):
            a.write("b", "gpu", [Segment(0, 0, 8)], b"x", "t")
        net.crash("c")
        with raises(TransportError, "write to a lost peer"):
            a.write("c", "kv", [Segment(0, 0, 8)], b"x", "t")
        a.write("b", "kv", [Segment(0, 0, 8)], b"still-works", "ok")
        net.wait(lambda: bool(net.rec.got("b", "notification")), "a write to a live peer after a refusal")


_BAD_DESCRIPTORS = {
    "garbage": b"garbage",
    "header-overflow": b"KVFSMNX1\xff\xff\xff\xff",
    "bad-header": b"KVFSMNX1\x05\x00\x00\x00{}xyz" + b"m" * 10,
}


def check_malformed_descriptor_is_refused(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """``add_peer`` raises TransportError for a descriptor it cannot use, and the peer stays
    unknown."""
    for desc_id, descriptor in _BAD_DESCRIPTORS.items():
        with _data_case(make, f"malformed descriptor [{desc_id}]", timeout) as net:
            with raises(TransportError, f"add_peer with the descriptor {descriptor!r}"):
                net.planes["a"].add_peer("mallory", descriptor)
            with raises(TransportError, "write to a peer whose descriptor was refused"):
                net.planes["a"].write("mallory", "kv", [Segment(0, 0, 8)], b"x", "t")


def check_write_many_is_each_write_in_order(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """``write_many`` (the plane's own, or ``base.write_many`` falling back to one ``write`` at a
    time): each write's bytes or the error that refused it, in order; a refused write moves
    nothing, and every other write lands, notifies after its data and completes once."""
    with _data_case(make, "write_many", timeout) as net:
        src, dst = net.kv["a"], net.kv["b"]
        in_place: list[int] = []

        def check(name: str, item: Inbound) -> None:  # the write's own page holds its data already
            if name == "b" and item.kind == "notification":
                i = int(item.data[1:])
                if (dst[(40 + i) * KV_BLOCK : (41 + i) * KV_BLOCK] == src[i * KV_BLOCK : (i + 1) * KV_BLOCK]).all():
                    in_place.append(i)

        net.rec.hooks.append(check)
        writes: list[Any] = []
        expected = dst.copy()
        good = []
        for i in range(12):
            seg = Segment(i * KV_BLOCK, (40 + i) * KV_BLOCK, KV_BLOCK)
            if i == 3:
                writes.append(("b", "kv", [Segment(0, KV_BYTES, KV_BLOCK)], b"m3", ("m", i)))  # beyond b's region
            elif i == 7:
                writes.append(("nobody", "kv", [seg], b"m7", ("m", i)))
            else:
                expected = _apply(expected, src, [seg])
                writes.append(("b", "kv", [seg], f"m{i}".encode(), ("m", i)))
                good.append(i)
        results = write_many(net.planes["a"], writes)
        assert [type(r) is int for r in results] == [i in good for i in range(12)], f"results {results}"
        assert isinstance(results[3], TransportError), f"the write beyond the region gave {results[3]!r}"
        assert isinstance(results[7], TransportError), f"the write to an unknown peer gave {results[7]!r}"
        net.wait(lambda: len(net.rec.got("a", "completion")) == len(good), "a completion per good write")
        net.wait(lambda: len(net.rec.got("b", "notification")) == len(good), "a notification per good write")
        assert (dst == expected).all(), "the destination does not hold exactly the written bytes"
        assert sorted(in_place) == good, "a notification arrived before its data"
        done = net.rec.got("a", "completion")
        tags = sorted(cast(list[tuple[str, int]], [c.tag for c in done]))
        assert tags == [("m", i) for i in good] and all(c.ok for c in done), f"completions {done}"


def check_concurrent_writers_each_complete_exactly_once(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """Four threads writing through one plane at once: every write lands, notifies and completes
    exactly once."""
    with _data_case(make, "concurrent writers", timeout) as net:
        src, dst = net.kv["a"], net.kv["b"]
        writers, per = 4, 16
        errors: list[BaseException] = []

        def writer(w: int) -> None:
            try:
                for i in range(per):
                    page = w * per + i  # disjoint destination pages
                    seg = Segment((page * 7 % 64) * KV_BLOCK, (page % 64) * KV_BLOCK, KV_BLOCK)
                    net.planes["a"].write("b", "kv", [seg], f"{w}.{i}".encode(), (w, i))
            except BaseException as exc:  # noqa: BLE001 - reported below, on the checking thread
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"a writer raised {errors[0]!r}"
        net.wait(lambda: len(net.rec.got("a", "completion")) == writers * per, "a completion per write")
        net.wait(lambda: len(net.rec.got("b", "notification")) == writers * per, "a notification per write")
        tags = sorted(cast(list[tuple[int, int]], [c.tag for c in net.rec.got("a", "completion")]))
        assert tags == sorted((w, i) for w in range(writers) for i in range(per)), "completions lost or duplicated"
        for page in range(writers * per):
            s = (page * 7 % 64) * KV_BLOCK
            d = (page % 64) * KV_BLOCK
            assert (dst[d : d + KV_BLOCK] == src[s : s + KV_BLOCK]).all(), f"page {page} did not land"


def check_registers_torch_tensors(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """CPU torch tensors register like any buffer and a write between them lands (checked when
    torch is installed)."""
    try:
        import torch
    except ImportError:
        return
    names = ("x", "y")
    with case(make, "torch tensors", names, timeout, Net) as net:
        g = torch.Generator().manual_seed(3)
        tensors = {n: torch.randint(0, 256, (KV_BYTES,), dtype=torch.uint8, generator=g) for n in names}
        aux = {n: torch.zeros(AUX_BYTES, dtype=torch.uint8) for n in names}
        for n, p in net.planes.items():
            p.register_memory(tensors[n], aux[n], kv_block=KV_BLOCK, aux_block=AUX_BLOCK)
        net.planes["x"].add_peer("y", net.planes["y"].descriptor())
        net.planes["x"].write("y", "kv", [Segment(KV_BLOCK, 0, 4 * KV_BLOCK)], b"t", "t")
        net.wait(lambda: bool(net.rec.got("x", "completion")), "the write's completion")
        assert torch.equal(tensors["y"][: 4 * KV_BLOCK], tensors["x"][KV_BLOCK : 5 * KV_BLOCK]), "the tensor write"


# The KV buffers of the check of regions of several buffers: three of different sizes on "a" and
# on "b", cut differently, and one buffer on "c" (a region of one buffer facing one of several).
_PARTS = {
    "a": (3 * KV_BLOCK, 5 * KV_BLOCK + 100, 2 * KV_BLOCK),
    "b": (2 * KV_BLOCK + 50, 4 * KV_BLOCK, 4 * KV_BLOCK + 50),
    "c": (10 * KV_BLOCK + 100,),
}


class _PartsNet(Net):
    """Data planes whose KV region is a list of buffers (``_PARTS``), seeded, peers of each other."""

    def __init__(self, made: Planes[Any], names: tuple[str, ...], timeout: float) -> None:
        super().__init__(made, names, timeout)
        rng = np.random.default_rng(5)
        self.parts = {n: [rng.integers(0, 256, k, dtype=np.uint8) for k in _PARTS[n]] for n in names}
        try:
            for n, p in self.planes.items():
                kv = self.parts[n] if len(self.parts[n]) > 1 else self.parts[n][0]
                p.register_memory(kv, np.zeros(AUX_BYTES, np.uint8), kv_block=KV_BLOCK, aux_block=AUX_BLOCK)
            _connect(self.planes)
        except BaseException:
            made.close()
            raise

    def kv(self, name: str) -> np.ndarray:
        """``name``'s KV region as its virtual space: its buffers one after another (a copy)."""
        return np.concatenate(self.parts[name])


def check_kv_of_several_buffers_is_one_virtual_region(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """A KV region registered as a list of buffers is one virtual region (buffer ``i`` starts at
    the sum of the sizes before it) on both sides: writes with several segments, each inside one
    buffer on both sides and together touching every buffer, land byte for byte (as ``Segment``s
    or a ``SegmentArray``, between two such regions or with a region of one buffer at either
    end), and so does a read; a segment that crosses a buffer boundary of either side, alone or
    after a good one, is refused with TransportError naming it before anything moves, notifies or
    completes."""
    b0, b1 = _PARTS["b"][0], _PARTS["b"][0] + _PARTS["b"][1]  # where b's buffers 1 and 2 start
    a1, a2 = _PARTS["a"][0], _PARTS["a"][0] + _PARTS["a"][1]
    good = [  # inside one buffer on both sides; every buffer of a and b touched
        Segment(10, b1 + 7, 300),
        Segment(a1 + 5, 3, 2 * KV_BLOCK),
        Segment(a2, b0, KV_BLOCK),
        Segment(a2 + KV_BLOCK, b1 + 4 * KV_BLOCK + 50 - 8, 8),  # ends exactly where b ends
        Segment(a1 - 40, b0 + 2 * KV_BLOCK, 40),  # ends exactly where a's buffer 0 ends
    ]
    pairs = {"a->b": ("a", "b"), "a->c": ("a", "c"), "c->b": ("c", "b")}
    for form in ("list", "array"):
        for label, (w, r) in pairs.items():
            with case(make, f"several buffers [{form}, write {label}]", ("a", "b", "c"), timeout, _PartsNet) as net:
                segs = [g for g in good if g.dst + g.length <= len(net.kv(r)) and g.src + g.length <= len(net.kv(w))]
                expected = _apply(net.kv(r), net.kv(w), segs)
                arg: Any = segs if form == "list" else SegmentArray.of(segs)
                moved = net.planes[w].write(r, "kv", arg, b"parts", "p")
                assert moved == sum(g.length for g in segs), f"write returned {moved}"
                net.wait(lambda: bool(net.rec.got(w, "completion")), "the write's completion")  # noqa: B023
                net.wait(lambda: bool(net.rec.got(r, "notification")), "the write's notification")  # noqa: B023
                assert (net.kv(r) == expected).all(), f"{r}'s buffers do not hold exactly the written bytes"
                (done,) = net.rec.got(w, "completion")
                assert (done.tag, done.ok) == ("p", True), f"completion {done}"
    with case(make, "several buffers [read]", ("a", "b", "c"), timeout, _PartsNet) as net:
        segs = [Segment(g.dst, g.src, g.length) for g in good]  # b's offsets are the source now
        expected = _apply(net.kv("a"), net.kv("b"), segs)
        moved = net.planes["a"].read("b", "kv", segs, b"read", "r")
        assert moved == sum(g.length for g in segs), f"read returned {moved}"
        net.wait(lambda: bool(net.rec.got("a", "completion")) and bool(net.rec.got("b", "notification")), "the read")
        assert (net.kv("a") == expected).all(), "the reader's buffers do not hold exactly the bytes read"
    crossing = {
        "source": Segment(a1 - 8, 0, 16),  # a's buffers 0 and 1
        "destination": Segment(0, b1 - 8, 16),  # b's buffers 1 and 2
        "destination-of-one-buffer-source": Segment(0, b0 - 1, 2),
    }
    for form in ("list", "array"):
        for bad_id, bad in crossing.items():
            for alone in (False, True):
                w = "c" if bad_id.endswith("one-buffer-source") else "a"
                label = f"several buffers [{form}, crossing the {bad_id}, {'alone' if alone else 'after-a-good-one'}]"
                with case(make, label, ("a", "b", "c"), timeout, _PartsNet) as net:
                    before = net.kv("b")
                    segs = [bad] if alone else [Segment(0, 0, 8), bad]
                    arg = segs if form == "list" else SegmentArray.of(segs)
                    with raises(TransportError, f"write of {segs}", match="boundary") as err:
                        net.planes[w].write("b", "kv", arg, b"x", "t")
                    assert str(bad) in str(err[0]), f"the error {err[0]!r} does not name the bad segment {bad}"
                    run = getattr(net.planes[w], "write_run", None)
                    if run is not None:
                        with raises(TransportError, f"write_run of {bad}", match="boundary"):
                            run("b", "kv", bad.src, bad.dst, bad.length, b"x", "t")
                    net.quiet()
                    assert (net.kv("b") == before).all(), "a refused write moved bytes"
                    assert net.rec.got("b", "notification") == [], "a refused write notified"
                    assert net.rec.got(w, "completion") == [], "a refused write completed"


DATA_PLANE_CHECKS: tuple[Callable[..., None], ...] = (
    check_write_lands_exactly_and_notifies_after_data,
    check_read_copies_from_peer_and_notifies_it,
    check_empty_write_still_notifies_and_completes,
    check_scattered_write_lands_as_segments_or_as_a_segment_array,
    check_out_of_bounds_is_refused_before_any_byte_moves,
    check_write_run_is_a_write_of_one_segment,
    check_unknown_or_removed_peer_is_refused,
    check_malformed_descriptor_is_refused,
    check_write_many_is_each_write_in_order,
    check_concurrent_writers_each_complete_exactly_once,
    check_registers_torch_tensors,
    check_kv_of_several_buffers_is_one_virtual_region,
)


def check_data_plane(make: PlanesFactory, *, timeout: float = 10.0) -> None:
    """Run every data-plane check (``DATA_PLANE_CHECKS``) on the planes ``make`` builds; each
    wait gives up after ``timeout`` seconds. Raises AssertionError at the first violation."""
    for check in DATA_PLANE_CHECKS:
        check(make, timeout=timeout)
