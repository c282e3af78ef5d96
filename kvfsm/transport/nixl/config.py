"""``NixlConfig``: the NIXL data plane's settings, one documented, validated object.

The defaults are the right ones for a GPU server (KV in VRAM, one NIXL agent per rank, UCX
backend); they also keep a CPU-only host (KV in DRAM) within a few percent of raw NIXL. Each
field says what it does and when to change it; ``kvfsm docs`` renders them into
``docs/configuration.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfsm.config import non_negative, non_negative_int, one_of, positive, positive_int, setting, validate

CALLER_POSTS = ("auto", "always", "never")
POLLER_SCHED = ("auto", "batch", "normal")


def _str_map(x: Any) -> bool:
    return isinstance(x, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in x.items())


@dataclass(frozen=True, slots=True)
class NixlConfig:
    """Settings of a ``NixlDataPlane`` (``NixlDataPlane(name, config=NixlConfig(...))``)."""

    # ------------------------------------------------------------------ the agent
    backend_params: Mapping[str, str] = setting(
        default_factory=dict,
        doc="Parameters of NIXL's UCX backend, passed to ``create_backend('UCX', ...)`` as they are "
        "(the environment's ``UCX_*`` variables apply too).",
        when="To choose UCX transports or devices where the defaults do not reach the fabric you want.",
        check=_str_map,
        must="a mapping of str to str",
    )
    xfer_timeout_s: float = setting(
        60.0,
        doc="A transfer still in flight this long after its post is cancelled and its writes complete "
        "as failed, so that no NIXL handle leaks when a peer vanishes without a word.",
        when="Raise it for transfers that legitimately take longer (very large chunks over a slow "
        "link); the runtime's own transfer timeout usually fails the room first.",
        check=positive,
        must="a positive number of seconds",
    )

    # ------------------------------------------------------------------ who posts a write
    caller_posts: str = setting(
        "auto",
        doc="Who posts a write to NIXL. ``auto``: the engine's thread posts writes from or to device "
        "memory and host writes of at most 4 KiB (the post only queues the copy); the data plane's "
        "posting thread posts host-to-host writes (UCX copies inside the post), writes of many short "
        "runs (UCX spends CPU per descriptor inside the post) and, while the link is busy, a lone "
        "write of ``large_write`` bytes or more. ``always``/``never``: the caller/the posting thread "
        "posts every write.",
        when="Leave it on ``auto``; ``always`` and ``never`` exist to test and compare the two paths.",
        check=one_of(*CALLER_POSTS),
        must="one of " + ", ".join(CALLER_POSTS),
    )
    large_write: int = setting(
        32 << 20,
        doc="Bytes from which a write counts as large. With ``caller_posts='auto'`` a lone large write "
        "(``write``, ``write_run``) made while a transfer is in flight or queued goes to the posting "
        "thread, whose NIXL calls (tens of µs of CPU) then overlap the engine's Python while the busy "
        "link hides the hand-off; otherwise the caller posts it at once, waiting for the agent if "
        "another thread is inside a NIXL call, rather than hold it.",
        when="Lower it only if a chunk crosses your link in more time than a thread hand-off takes "
        "(16 MiB over NVLink does not: ~45 µs); raise it if large writes arrive when the link is idle.",
        check=positive_int,
        must="a positive int (bytes)",
    )

    # ------------------------------------------------------------------ holding caller-posted writes
    hold_writes: int = setting(
        64,
        doc="Caller-posted writes made while a transfer is in flight are held back, Nagle-style, and "
        "posted as one folded transfer once this many are held (or ``hold_bytes``, or at the poller's "
        "next round, or at ``flush()``). Also the most a caller holds, instead of waiting, while "
        "another thread is inside a NIXL call.",
        when="Lower it to trade engine CPU per chunk for latency of the first write of a burst.",
        check=positive_int,
        must="a positive int",
    )
    hold_bytes: int = setting(
        32 << 20,
        doc="... or once this many bytes are held.",
        when="As ``hold_writes``; 16 MiB cost more engine CPU per 1 MiB chunk on GPUs, 64 MiB gained "
        "nothing more and lengthened the tail.",
        check=positive_int,
        must="a positive int (bytes)",
    )
    hold_below: int = setting(
        8 << 20,
        doc="Only writes smaller than this are held; a larger one is posted at once, with the held "
        "writes that fold into its transfer, since holding it would leave the link idle.",
        when="0 disables holding. Raise it only if your chunks are many and small relative to the link's speed.",
        check=non_negative_int,
        must="a non-negative int (bytes)",
    )

    # ------------------------------------------------------------------ the poller
    busy_poll_s: float = setting(
        0.0002,
        doc="While transfers are in flight the poller checks them (and collects notifications) every "
        "``busy_poll_s``; a caller that posts also completes what it finds done, so the poller leaves "
        "the transfers to it meanwhile.",
        when="Seldom: faster polling did not raise throughput on GPUs and costs CPU.",
        check=positive,
        must="a positive number of seconds",
    )
    tail_poll_s: float = setting(
        0.00002,
        doc="After ``flush()`` (the owner waits for its writes) the poller checks the in-flight "
        "transfers this often at first, then every eighth of the wait since the last completion, up "
        "to ``busy_poll_s``: nobody else completes them then.",
        when="Raise it to spend less CPU on a waiting engine's last transfers.",
        check=positive,
        must="a positive number of seconds",
    )
    idle_poll_s: float = setting(
        0.0005,
        doc="With nothing in flight the poller waits up to this long between rounds (a post wakes it "
        "at once): the longest a peer's notification waits to be noticed.",
        when="Raise it to spend less CPU on an idle decode rank, at the cost of that latency.",
        check=positive,
        must="a positive number of seconds",
    )
    hot_window_s: float = setting(
        0.05,
        doc="For this long after traffic the poller polls every eighth of the quiet so far (from "
        "``busy_poll_s`` up to ``idle_poll_s``), so that the next chunk's notification is seen soon.",
        when="0 polls every ``idle_poll_s`` right after traffic.",
        check=non_negative,
        must="a non-negative number of seconds",
    )
    quiet_poll_s: float = setting(
        0.1,
        doc="While the owner expects no peer to write into us (``expect_traffic(False)``: a prefill "
        "rank in push mode, a decode rank with no room) and nothing of ours is in flight, the poller "
        "waits up to this long; ``expect_traffic(True)`` wakes it.",
        when="Lower it if peers write into this rank without the runtime announcing it.",
        check=positive,
        must="a positive number of seconds",
    )
    poller_sched: str = setting(
        "auto",
        doc="The poller thread's Linux scheduling policy. ``auto``: SCHED_BATCH once KV is registered "
        "in host memory (its timed wake-ups then take a free CPU instead of preempting a copy), as it "
        "is otherwise; ``batch``/``normal`` force either. Needs no privilege; where it cannot be "
        "taken the poller runs as it is.",
        when="``normal`` if the host has many idle CPUs and KV in DRAM; otherwise leave it.",
        check=one_of(*POLLER_SCHED),
        must="one of " + ", ".join(POLLER_SCHED),
    )

    def __post_init__(self) -> None:
        validate(self)
