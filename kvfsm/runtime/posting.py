"""The prefill side's writes: how a row's posts become data-plane writes (``WritePoster``, the
base of ``PrefillManager``).

A chunk's KV write is described once, as segments: whole pages (``coalesce``) where neither rank
declared a KV layout, else the byte runs of a plan between the two layouts
(``kvfsm.layout.Planner``, one per decode rank, built when its registration was accepted). It is
then handed to the data plane: inline or through the worker pool, or with the other writes of a
``send_many()`` as one batch; a write that cannot be described or posted fails its room alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from kvfsm.layout import Planner, verify_plan
from kvfsm.protocol import LocalProtocolError, PostAuxWrite, PostWrite, Protocol
from kvfsm.protocol.events import AUX_WRITE, WriteFailed
from kvfsm.protocol.pages import Pages
from kvfsm.protocol.wire import ChunkWritten, Message
from kvfsm.runtime.manager import Manager, RoomRuntime, log
from kvfsm.runtime.pages import coalesce
from kvfsm.transport.base import Segment, SegmentArray, Write, write_many

_LENGTH = attrgetter("length")  # of a Segment (map in C: one write has one segment, mostly)
WriteTag = tuple[int, int, int]  # (room, dest_rank, chunk_id | AUX_WRITE): the transport's completion tag


class WritePoster(Manager):
    """Posting a prefill rank's writes (see the module docstring)."""

    def __init__(self, rank: int, endpoint: Any, protocol: Protocol | None = None, **kwargs: Any) -> None:
        super().__init__(rank, endpoint, protocol, **kwargs)
        self._peer_names: dict[int, str] = {}  # decode rank -> its transport name (the route)
        self._planners: dict[int, Planner] = {}  # decode rank -> plans from our layout into its
        self._batch: list[Write] | None = None  # writes of a send_many(), handed over together
        self._batch_bytes = self._batch_segments = 0  # ... and their bytes and segments
        self._batch_aux: list[Write] = []  # ... its aux writes: handed over at its end, together
        self._batch_runs = 0  # ... and how many one-segment writes _post_run added to it (not counted yet)
        self._pack_note = self.codec.packer("chunk_written")  # a chunk's notification from its fields
        self._pack_aux = self.codec.packer("aux_written")  # ... and an aux write's

    def _post(self, rt: RoomRuntime, action: PostWrite | PostAuxWrite) -> None:
        if isinstance(action, PostWrite):
            a = action
            self._post_kv(rt, a.dest_rank, a.chunk_id, a.src_pages, a.dst_pages, a.notification, a.contiguous)
            return
        tag = (action.room, action.dest_rank, AUX_WRITE)
        try:
            segments = coalesce((action.src_slot,), (action.dst_slot,), self.aux_slot_bytes)
            note = self.codec.encode(action.notification)
        except Exception as exc:  # noqa: BLE001 - the write fails, not the step (the room has moved on)
            self._fail_write(tag, exc)
            return
        self._hand(rt, tag, "aux", segments, note)

    def _post_kv(
        self, rt: RoomRuntime, dest: int, chunk_id: int, src: Pages, dst: Pages, notification: Message, contiguous: bool
    ) -> None:
        """Post one KV write (a PostWrite's fields: the fast rows P11 and P10 post without building one)."""
        tag = (rt.room.room, dest, chunk_id)
        try:
            if self.layout is None:
                segments: Sequence[Segment] = coalesce(src, dst, self.page_bytes, one_run=contiguous)
            else:
                segments = self._planned(dest, src, dst, notification)  # type: ignore[arg-type] # (a chunk_written)
            note = self.codec.encode(notification)
        except Exception as exc:  # noqa: BLE001 - the write fails, not the step (the room has moved on)
            self._fail_write(tag, exc)
            return
        self._hand(rt, tag, "kv", segments, note)

    def _planned(self, dest: int, src: Pages, dst: Pages, note: ChunkWritten) -> SegmentArray:
        """The write of a chunk's tokens (``note``) from our pages ``src`` into decode rank
        ``dest``'s pages ``dst`` (each list starting at the page that holds the chunk's first
        token), planned from the two layouts: byte runs in each side's virtual KV region."""
        planner = self._planners.get(dest)
        if planner is None:
            raise LocalProtocolError(f"decode rank {dest} registered no KV layout to plan a write into")
        first, n = note.token_start, note.num_tokens
        src_first, dst_first = first // planner.src.page_size, first // planner.dst.page_size
        plan = planner.plan(src, dst, first, n, src_first_page=src_first, dst_first_page=dst_first)
        if self.config.verify_plans:
            first, n = planner.span(first, n)  # (opaque pages: the whole pages the plan moves)
            verify_plan(
                plan, planner.src, planner.dst, src, dst, first, n, planner.mapping,
                src_first_page=src_first, dst_first_page=dst_first,
            )  # fmt: skip
        return SegmentArray(*plan.segments(planner.src, planner.dst))

    def _hand(self, rt: RoomRuntime, tag: WriteTag, region: str, segments: Sequence[Segment], note: bytes) -> None:
        """Hand a prepared write to the transport: to the batch of a send_many(), else to the
        worker pool (inline with workers=0)."""
        nseg = len(segments)
        if nseg == 1:
            moved = segments[0].length
        elif type(segments) is SegmentArray:
            moved = segments.total()
        else:
            moved = sum(map(_LENGTH, segments))
        rt.bytes += moved
        rt.descriptors += nseg
        self.telemetry.count2("writes_posted", 1, "descriptors", nseg)
        peer = self._peer_names.get(tag[1])  # the route as it is now, when posted
        if self._batch is not None:  # send_many: handed over with the batch's other writes
            if region == "aux":
                # at the batch's end, all together: handed over with a large chunk's KV instead,
                # each would go as a transfer of its own where the KV is in VRAM and aux in DRAM
                self._batch_aux.append((peer, region, segments, note, tag))  # type: ignore[arg-type]
                return
            self._batch_kv((peer, region, segments, note, tag), moved, nseg)  # type: ignore[arg-type]
            return
        self.pool.submit(tag[0], self._write, (peer, region, segments, note, tag), self._write_failed)

    def _batch_kv(self, write: Write, moved: int, nseg: int) -> None:
        """A KV write of a send_many() joins its batch, which is handed over whenever
        ``batch_bytes`` or ``batch_segments`` are pending."""
        batch = self._batch
        assert batch is not None  # (a send_many() is under way)
        batch.append(write)
        self._batch_bytes += moved
        self._batch_segments += nseg
        if self._batch_bytes >= self.config.batch_bytes or self._batch_segments >= self.config.batch_segments:
            self._batch, self._batch_bytes, self._batch_segments = [], 0, 0
            self._hand_batch(batch)

    def _hand_batch(self, batch: list[Write]) -> None:
        """The writes of a send_many(): one transfer job per worker shard (a room's writes stay on
        its worker, in order), inline with workers=0."""
        size = self.pool.size
        if not size:  # inline: one job
            if batch:
                self.pool.submit(0, self._write_batch, (batch,), self._batch_failed)
            return
        shards: dict[int, list[Write]] = {}
        for w in batch:
            shards.setdefault(w[4][0] % size, []).append(w)  # type: ignore[index]
        for shard, writes in shards.items():
            self.pool.submit(shard, self._write_batch, (writes,), self._batch_failed)

    def _write_batch(self, writes: list[Write]) -> None:
        """Transfer job of a send_many()'s writes: one ``write_many``; each refused write fails alone."""
        routed = []
        for w in writes:
            if w[0] is None:
                self._fail_write(w[4], LocalProtocolError(f"no route to decode rank {w[4][1]}"))
            else:
                routed.append(w)
        written = 0
        for w, moved in zip(routed, write_many(self.endpoint, routed), strict=True):
            if isinstance(moved, int):
                written += moved
            else:
                self._fail_write(w[4], moved)  # type: ignore[arg-type]
        if written:
            self.telemetry.count("bytes_written", written)

    def _batch_failed(self, exc: BaseException, writes: list[Write]) -> None:
        """``_write_batch`` itself raised (the pool's on_error): every write of it fails."""
        for w in writes:
            self._fail_write(w[4], exc)  # type: ignore[arg-type]

    def _write(self, peer: str | None, region: str, segments: Sequence[Segment], note: bytes, tag: WriteTag) -> None:
        """Transfer job of one posted write (a worker thread, or inline with workers=0)."""
        if peer is None:
            raise LocalProtocolError(f"no route to decode rank {tag[1]}")
        moved = self.endpoint.write(peer, region, segments, note, tag)  # type: ignore[arg-type]
        self.telemetry.count("bytes_written", moved)

    def _write_failed(
        self, exc: BaseException, peer: str | None, region: str, segments: Sequence[Segment], note: bytes, tag: WriteTag
    ) -> None:
        """``_write`` raised (the pool's on_error, called with the job's arguments)."""
        self._fail_write(tag, exc)

    def _fail_write(self, tag: WriteTag, exc: BaseException) -> None:
        """The write ``tag`` failed: WriteFailed for its room, if it still exists (while a room
        steps, the event waits for the step's end)."""
        rid, dest_rank, chunk_id = tag
        self.telemetry.count("write_errors")
        log.warning("prefill%d room %d: write to decode rank %d failed: %r", self.rank, rid, dest_rank, exc)
        with self._lock:
            if rid in self._rooms:
                self._dispatch(rid, WriteFailed(dest_rank, chunk_id, f"{type(exc).__name__}: {exc}"))

    def _post_run(
        self, rt: RoomRuntime, tag: WriteTag, region: str, src: int, dst: int, length: int, note: bytes
    ) -> None:
        """``_run_posted``'s writes (one segment each, byte offsets), as ``_post_kv`` and ``_post``
        post them: with no transfer workers and no send_many() under way, handed straight to the
        endpoint's ``write_run`` if it has one (what ``_hand`` and ``_write`` would do, inline);
        a send_many()'s KV write added to its batch (as ``_hand`` adds it); else through
        ``_hand``."""
        batched = self._batch is not None
        write_run = None if batched or self.pool.size else getattr(self.endpoint, "write_run", None)
        if write_run is None and not (batched and region == "kv"):
            self._hand(rt, tag, region, [Segment(src, dst, length)], note)
            return
        rt.bytes += length
        rt.descriptors += 1
        peer = self._peer_names.get(tag[1])  # the route as it is now, when posted
        if write_run is None:  # send_many: the KV write joins the batch (as _hand adds it)
            self._batch_runs += 1  # (counted when the send_many() ends)
            self._batch_kv((peer, region, [Segment(src, dst, length)], note, tag), length, 1)  # type: ignore[arg-type]
            return
        try:
            if peer is None:
                raise LocalProtocolError(f"no route to decode rank {tag[1]}")
            moved = write_run(peer, region, src, dst, length, note, tag)
        except BaseException as exc:  # noqa: BLE001 - as the inline worker pool: the write fails
            self.telemetry.count2("writes_posted", 1, "descriptors", 1)
            self._fail_write(tag, exc)
            return
        self.telemetry.count3("writes_posted", 1, "descriptors", 1, "bytes_written", moved)
