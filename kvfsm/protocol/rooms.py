"""Per-room data the machines operate on (the ``transitions`` model objects).

A room holds only what the protocol needs to decide; every field is written by an action named
in the spec. ``state`` is the machine state (a leaf name from spec/); there are no side flags that
duplicate it (h2's smell): e.g. "last chunk posted" is the state Transferring.Draining.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfsm.protocol.events import ChunkReady
from kvfsm.protocol.pages import PageRun, Pages, long_run, page_summary
from kvfsm.protocol.wire import LayoutFields, Register, RegisterAck


@dataclass(frozen=True, slots=True)
class Announcement:
    """One decode rank's room_pages, as accepted by the prefill room."""

    pages: Pages
    aux_slot: int
    tokens: int = 0  # the room's tokens, which the pages hold exactly
    page_size: int = 1  # tokens per page at the decode rank (1 where it declared no layout)
    run: bool = field(default=False, compare=False)  # derived: pages are one ascending run
    # derived: the same pages as a PageRun when they are one long run (a long chunk's slice of it
    # costs the same for any length; short chunks slice ``pages``, a tuple, faster still)
    span: PageRun | None = field(default=None, compare=False)

    @classmethod
    def of(cls, pages: Pages, aux_slot: int, tokens: int = 0, page_size: int = 1) -> Announcement:
        """The announcement of ``pages`` (``tokens`` 0: every token of them), its derived fields
        filled in."""
        return cls(
            pages, aux_slot, tokens or len(pages) * page_size, page_size, page_summary(pages)[3], long_run(pages)
        )


@dataclass(slots=True, eq=False)
class PrefillRoom:
    room: int
    rank: int
    kv_pages: int  # size of this rank's registered KV region (local page indices must be below)
    aux_slots: int
    page_size: int = 1  # tokens per page (1 where the rank declared no layout: a page is a token)
    state: str = ""
    failure: str | None = None
    timers: set[str] = field(default_factory=set)
    # decode rank -> its announcement; required_dests is 0 until the first one arrives
    dests: dict[int, Announcement] = field(default_factory=dict)
    required_dests: int = 0
    held: list[ChunkReady] = field(default_factory=list)  # scenario 2: chunks waiting for decode
    last_seen: bool = False  # the engine handed over the last chunk (held or posted)
    next_chunk: int = 0
    cursor: int = 0  # tokens of the room already handed over (into every dest's announcement)
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
    page_size: int = 1  # tokens per page (1 where the rank declared no layout: a page is a token)
    state: str = ""
    failure: str | None = None
    timers: set[str] = field(default_factory=set)
    pages: Pages = ()
    aux_slot: int = -1
    tokens: int = 0  # the room's tokens, which ``pages`` hold exactly
    # src -> chunk_id -> (token_start, num_tokens, is_last)
    received: dict[int, dict[int, tuple[int, int, bool]]] = field(default_factory=dict)
    last_count: dict[int, int] = field(default_factory=dict)  # src -> number of chunks
    aux_done: set[int] = field(default_factory=set)
    undrained: set[int] = field(default_factory=set)  # Fenced: sources that may still be writing
    last_row: str = ""


@dataclass(slots=True, eq=False)
class PrefillLink:
    """A prefill rank's view of one decode rank's link (prefill_link): what it judges a
    registration against, and the registration it accepted. ``room`` is the decode rank (the
    machines name the object they step by it)."""

    room: int
    rank: int  # this prefill rank
    page_bytes: int
    aux_slot_bytes: int
    layout: LayoutFields | None  # this rank's KV layout, or None (pages of page_bytes, a page a token)
    state: str = ""
    failure: str | None = None
    timers: set[str] = field(default_factory=set)
    registration: Register | None = None  # the accepted one
    last_row: str = ""


@dataclass(slots=True, eq=False)
class DecodeLink:
    """A decode rank's view of its link to one prefill rank (decode_link). ``room`` is the
    prefill rank; ``failure`` says why the link is Refused or Lost."""

    room: int
    rank: int  # this decode rank
    layout: LayoutFields | None
    prefill_tp: int  # the prefill ranks this rank knows of: the prefill TP group
    state: str = ""
    failure: str | None = None
    timers: set[str] = field(default_factory=set)
    ack: RegisterAck | None = None  # the accepted answer (its layout: the prefill rank's)
    last_row: str = ""


@dataclass(slots=True, eq=False)
class PullSource:
    """A prefill rank's room in pull mode (prefill_pull): the engine's pages that hold the room's
    tokens, pinned while decode may read them."""

    room: int
    rank: int
    pages: Pages
    tokens: int
    page_size: int = 1  # tokens per page (1 where the rank declared no layout)
    state: str = ""
    failure: str | None = None
    timers: set[str] = field(default_factory=set)
    readers: int = 0  # decode ranks that read this room from this rank (0 until the first claim)
    claimants: set[int] = field(default_factory=set)  # decode ranks that claimed
    done: set[int] = field(default_factory=set)  # readers whose reads are over (notified or released)
    last_row: str = ""


@dataclass(frozen=True, slots=True)
class Grant:
    """One source's latest grant, as the decode room recorded it."""

    epoch: int
    lease_s: float
    pages: Pages
    tokens: int
    page_size: int = 1  # tokens per page at the source


@dataclass(slots=True, eq=False)
class PullSink:
    """A decode rank's room in pull mode (decode_pull): it reads every source's pages into its
    own once each granted a lease that covers the reads."""

    room: int
    rank: int
    kv_pages: int
    sources: tuple[int, ...]  # prefill ranks this rank reads from
    readers: int = 1  # decode ranks that read from each of those prefill ranks (this one among them)
    page_size: int = 1  # tokens per page here
    tokens: int = 0  # the room's tokens, if known at creation (0: taken from the grants)
    state: str = ""
    failure: str | None = None
    timers: set[str] = field(default_factory=set)
    pages: Pages | None = None  # the engine's pages, once allocated
    epoch: int = 0  # the newest claim sent
    claims: dict[int, float] = field(default_factory=dict)  # epoch -> when its claim was sent
    grants: dict[int, Grant] = field(default_factory=dict)  # source -> its newest grant
    lease_end: float = 0.0  # reads posted now must end by then (0: no lease yet)
    reading: set[int] = field(default_factory=set)  # sources whose read is in flight
    read: set[int] = field(default_factory=set)  # sources whose read landed
    last_row: str = ""


Room = PrefillRoom | DecodeRoom | PullSource | PullSink
