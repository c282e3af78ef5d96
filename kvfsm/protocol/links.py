"""Guards and actions of the link machines (spec/prefill_link.toml, spec/decode_link.toml).

Theory of operation
-------------------
Before any room uses a (prefill rank, decode rank) pair, decode registers its memory and KV
layout and prefill answers. Whether the pair can exchange KV is decided here, by pure functions
the link rows name, on both sides:

* the two ranks describe their memory the same way: both declare a KV layout
  (``kvfsm.layout.KVLayout``), or neither does and their page and aux slot sizes are equal (a
  page is then a token, and pages are copied whole);
* with layouts: the decode rank's layout can exist, it holds as many pages as its registered
  region, and ``kvfsm.layout.compatible`` holds (the same layers,
  KV heads, head_dim, element size and MLA, and a rank mapping between the two TP groups). A
  different page size or memory order is fine: plans bridge them;
* aux slots are copied whole on both sides: their sizes are equal.

A refusal carries the reason to the other side, whose rooms fail with it before any byte moves.
"""

from __future__ import annotations

from typing import Any

from kvfsm.protocol.actions import SendMessage
from kvfsm.protocol.functions import EXPLAIN, StepContext, action, guard
from kvfsm.protocol.rooms import DecodeLink, PrefillLink
from kvfsm.protocol.wire import LayoutFields, Register, RegisterAck


def _layouts_problem(prefill: LayoutFields | None, decode: LayoutFields | None) -> str:
    """Why a prefill rank with layout ``prefill`` cannot send to a decode rank with layout
    ``decode`` ("" if it can). Both None: nothing to compare here. (A decode rank's id in the
    protocol need not be its TP rank: several decode engines may register with one prefill
    engine, each rank under an id of its own; its layout says where it sits in its TP group.)"""
    if (prefill is None) != (decode is None):
        side = "prefill" if prefill is not None else "decode"
        return f"only {side} declares a KV layout (both ranks must, or neither)"
    if prefill is None or decode is None:
        return ""
    # (kvfsm.layout imports kvfsm.protocol: imported here, once both are loaded)
    from kvfsm.layout.kv import KVLayout, LayoutError, compatible

    try:
        mine = KVLayout.from_wire(prefill)
    except LayoutError as exc:
        return f"prefill layout: {exc}"
    try:
        theirs = KVLayout.from_wire(decode)
    except LayoutError as exc:
        return f"decode layout: {exc}"
    return compatible(mine, theirs) or ""


def _registration_problem(link: PrefillLink, ev: Any) -> str:
    reg: Register = ev.registration
    if reg.aux_slot_bytes != link.aux_slot_bytes:
        return f"aux slot of {reg.aux_slot_bytes} bytes at decode, {link.aux_slot_bytes} at prefill"
    if reg.layout is None and link.layout is None and reg.page_bytes != link.page_bytes:
        return f"page of {reg.page_bytes} bytes at decode, {link.page_bytes} at prefill"
    problem = _layouts_problem(link.layout, reg.layout)
    if problem:
        return problem
    if reg.layout is not None and reg.layout.num_pages != reg.kv_pages:
        return f"decode layout of {reg.layout.num_pages} pages for a region of {reg.kv_pages} pages"
    return ""


@guard
def registration_compatible(link: PrefillLink, ev: Any) -> bool:
    """The registering decode rank and this prefill rank can exchange KV (module docstring)."""
    return not _registration_problem(link, ev)


@action("accept_link")
def accept_link(link: PrefillLink, ev: Any, ctx: StepContext, arg: str) -> None:
    """Keep the registration and answer it with this rank's layout."""
    link.registration = ev.registration
    link.failure = None
    ack = RegisterAck(link.rank, link.page_bytes, link.aux_slot_bytes, True, "", link.layout)
    ctx.out.append(SendMessage(link.room, ack))


@action("refuse_link")
def refuse_link(link: PrefillLink, ev: Any, ctx: StepContext, arg: str) -> None:
    """Answer with the reason; an earlier registration no longer holds."""
    link.registration = None
    link.failure = (_registration_problem(link, ev) if ev is not None else "") or ctx.error or "refused"
    ack = RegisterAck(link.rank, link.page_bytes, link.aux_slot_bytes, False, link.failure[:1024], link.layout)
    ctx.out.append(SendMessage(link.room, ack))


@guard
def ack_accepted(link: DecodeLink, ev: Any) -> bool:
    return bool(ev.ack.accepted)


def _ack_problem(link: DecodeLink, ev: Any) -> str:
    ack: RegisterAck = ev.ack
    problem = _layouts_problem(ack.layout, link.layout)
    if problem:
        return problem
    if ack.layout is not None and (ack.layout.tp_rank != link.room or ack.layout.tp_size != link.prefill_tp):
        return (
            f"prefill rank {link.room} answers with the layout of TP rank {ack.layout.tp_rank} of "
            f"{ack.layout.tp_size}; this rank knows {link.prefill_tp} prefill ranks"
        )
    return ""


@guard
def ack_compatible(link: DecodeLink, ev: Any) -> bool:
    """The prefill rank's layout (in its accepting answer) is one this rank can receive from."""
    return not _ack_problem(link, ev)


EXPLAIN["registration_compatible"] = _registration_problem
EXPLAIN["ack_compatible"] = _ack_problem


@action("record_refusal")
def record_refusal(link: DecodeLink, ev: Any, ctx: StepContext, arg: str) -> None:
    """Why the link cannot be used: the prefill rank's reason, ours, or the loss."""
    if ev is None:
        reason = ctx.error or "refused"
    elif ev.trigger == "peer_lost":
        reason = ev.reason
    elif not ev.ack.accepted:
        reason = f"registration refused by prefill rank {link.room}: {ev.ack.reason}"
    else:
        reason = f"prefill rank {link.room} refused here: {_ack_problem(link, ev) or ctx.error}"
    link.failure = reason
