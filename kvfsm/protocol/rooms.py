"""Per-room data the machines operate on (the ``transitions`` model objects).

A room holds only what the protocol needs to decide; every field is written by an action named
in the spec. ``state`` is the machine state (a leaf name from spec/); there are no side flags that
duplicate it (h2's smell): e.g. "last chunk posted" is the state Transferring.Draining.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfsm.protocol.events import ChunkReady
from kvfsm.protocol.pages import PageRun, Pages, long_run, page_summary


@dataclass(frozen=True, slots=True)
class Announcement:
    """One decode rank's room_pages, as accepted by the prefill room."""

    pages: Pages
    aux_slot: int
    run: bool = field(default=False, compare=False)  # derived: pages are one ascending run
    # derived: the same pages as a PageRun when they are one long run (a long chunk's slice of it
    # costs the same for any length; short chunks slice ``pages``, a tuple, faster still)
    span: PageRun | None = field(default=None, compare=False)

    @classmethod
    def of(cls, pages: Pages, aux_slot: int) -> Announcement:
        """The announcement of ``pages``, its derived fields filled in."""
        return cls(pages, aux_slot, page_summary(pages)[3], long_run(pages))


@dataclass(slots=True, eq=False)
class PrefillRoom:
    room: int
    rank: int
    kv_pages: int  # size of this rank's registered KV region (local page indices must be below)
    aux_slots: int
    state: str = ""
    failure: str | None = None
    timers: set[str] = field(default_factory=set)
    # decode rank -> its announcement; required_dests is 0 until the first one arrives
    dests: dict[int, Announcement] = field(default_factory=dict)
    required_dests: int = 0
    held: list[ChunkReady] = field(default_factory=list)  # scenario 2: chunks waiting for decode
    last_seen: bool = False  # the engine handed over the last chunk (held or posted)
    next_chunk: int = 0
    cursor: int = 0  # pages of the room already handed over (into every dest's announcement)
    inflight: set[tuple[int, int]] = field(default_factory=set)  # (dest_rank, chunk_id | AUX_WRITE)
    last_row: str = ""


@dataclass(slots=True, eq=False)
class DecodeRoom:
    room: int
    rank: int
    kv_pages: int
    aux_slots: int
    sources: tuple[int, ...]  # prefill ranks this decode rank expects KV and aux from
    required_dests: int = 1  # decode ranks each of those prefill ranks writes this room to
    state: str = ""
    failure: str | None = None
    timers: set[str] = field(default_factory=set)
    pages: Pages = ()
    aux_slot: int = -1
    # src -> chunk_id -> (page_start, num_pages, is_last)
    received: dict[int, dict[int, tuple[int, int, bool]]] = field(default_factory=dict)
    last_count: dict[int, int] = field(default_factory=dict)  # src -> number of chunks
    aux_done: set[int] = field(default_factory=set)
    undrained: set[int] = field(default_factory=set)  # Fenced: sources that may still be writing
    last_row: str = ""


Room = PrefillRoom | DecodeRoom
