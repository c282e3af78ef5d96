"""The handshake's declared rows (spec/prefill_link.toml, spec/decode_link.toml): which pairs of
ranks may exchange KV, judged on both sides before any room uses the pair."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfsm.layout import KVLayout
from kvfsm.protocol import Protocol, SendMessage
from kvfsm.protocol.events import AckReceived, PeerLost, RegistrationReceived
from kvfsm.protocol.rooms import DecodeLink, PrefillLink
from kvfsm.protocol.wire import Register, RegisterAck

PROTOCOL = Protocol()
PAGE, AUX = 512, 32


def lay(tp: int, rank: int, *, page: int = 16, pages: int = 8, **change) -> KVLayout:
    return replace(KVLayout(2, 4, 8, 2, tp, rank, page, pages), **change)


def prefill_link(layout: KVLayout | None = None) -> PrefillLink:
    link = PrefillLink(1, 0, PAGE, AUX, layout.to_wire() if layout else None)
    PROTOCOL.prefill_link.create(link, 0.0)
    return link


def register(layout: KVLayout | None = None, *, rank: int = 1, pages: int = 8, page_bytes: int = PAGE, aux: int = AUX):
    return RegistrationReceived(
        Register(rank, "decode/1", pages, page_bytes, 4, aux, layout.to_wire() if layout else None)
    )


def judged(link: PrefillLink, event: RegistrationReceived) -> RegisterAck:
    actions = PROTOCOL.prefill_link.step(link, event, 1.0)
    (ack,) = [a.message for a in actions if isinstance(a, SendMessage)]
    assert isinstance(ack, RegisterAck) and ack.accepted == (link.state == "Ready")
    return ack


def test_ranks_without_layouts_pair_when_page_and_aux_sizes_match():
    link = prefill_link()
    ack = judged(link, register())
    assert link.state == "Ready" and ack.layout is None and link.registration is not None


@pytest.mark.parametrize(
    ("mine", "theirs", "reason"),
    [
        (None, dict(page_bytes=256), "page of 256 bytes at decode, 512 at prefill"),
        (None, dict(aux=16), "aux slot of 16 bytes at decode, 32 at prefill"),
        (lay(2, 0), dict(), "only prefill declares a KV layout"),
        (None, dict(layout=lay(4, 1)), "only decode declares a KV layout"),
        (lay(2, 0), dict(layout=lay(4, 1, num_layers=3)), "model shape differs: num_layers"),
        (lay(2, 0), dict(layout=lay(4, 1, mla=False, head_dim=4)), "model shape differs: head_dim"),
        (lay(2, 0), dict(layout=lay(4, 1), pages=9), "layout of 8 pages for a region of 9 pages"),
    ],
)
def test_a_pair_that_cannot_exchange_kv_is_refused_with_the_reason(mine, theirs, reason):
    link = prefill_link(mine)
    layout = theirs.pop("layout", None)
    ack = judged(link, register(layout, **theirs))
    assert link.state == "Refused" and reason in ack.reason, ack.reason


def test_a_layout_that_cannot_exist_is_refused_not_dropped():
    link = prefill_link(lay(2, 0))
    wire = lay(4, 1).to_wire()
    bad = RegistrationReceived(Register(1, "decode/1", 8, PAGE, 4, AUX, type(wire)(*[0] * 8, "sglang", False, False)))
    ack = judged(link, bad)
    assert link.state == "Refused" and "decode layout: KVLayout.num_layers must be a positive int" in ack.reason


def test_layouts_of_other_page_sizes_orders_and_tp_pair_and_the_ack_carries_ours():
    mine = lay(2, 0, page=16)
    link = prefill_link(mine)
    ack = judged(link, register(lay(4, 1, page=64, order="vllm_hnd")))
    assert link.state == "Ready" and ack.layout == mine.to_wire()


def test_a_repeat_is_answered_again_and_a_changed_registration_is_judged_anew():
    link = prefill_link()
    judged(link, register())
    assert judged(link, register()).accepted and link.state == "Ready"  # decode's retry after a lost ack
    assert not judged(link, register(page_bytes=128)).accepted and link.state == "Refused"
    assert link.registration is None
    assert judged(link, register()).accepted and link.state == "Ready"  # a fixed, restarted decode rank


def decode_link(layout: KVLayout | None = None, prefill_tp: int = 2) -> DecodeLink:
    link = DecodeLink(0, 1, layout.to_wire() if layout else None, prefill_tp)
    PROTOCOL.decode_link.create(link, 0.0)
    return link


def ack(accepted: bool = True, reason: str = "", layout: KVLayout | None = None) -> AckReceived:
    return AckReceived(RegisterAck(0, PAGE, AUX, accepted, reason, layout.to_wire() if layout else None))


def test_decode_takes_an_accepting_answer_whose_layout_it_can_receive_from():
    link = decode_link(lay(4, 1))
    PROTOCOL.decode_link.step(link, ack(layout=lay(2, 0)), 1.0)
    assert link.state == "Ready" and link.failure is None


@pytest.mark.parametrize(
    ("mine", "event", "reason"),
    [
        (None, ack(False, "page of 256 bytes at decode"), "registration refused by prefill rank 0: page of 256"),
        (lay(4, 1), ack(layout=lay(2, 0, num_layers=5)), "model shape differs: num_layers"),
        (lay(4, 1), ack(layout=None), "only decode declares a KV layout"),
        (lay(4, 1), ack(layout=lay(2, 1)), "answers with the layout of TP rank 1"),
        (lay(4, 1), ack(layout=lay(1, 0, num_kv_heads=4)), "this rank knows 2 prefill ranks"),
    ],
)
def test_decode_refuses_a_refusal_or_an_answer_it_cannot_receive_from(mine, event, reason):
    link = decode_link(mine)
    PROTOCOL.decode_link.step(link, event, 1.0)
    assert link.state == "Refused" and reason in (link.failure or ""), link.failure


def test_a_later_answer_changes_nothing_and_a_lost_peer_is_lost_once():
    link = decode_link()
    PROTOCOL.decode_link.step(link, ack(), 1.0)
    PROTOCOL.decode_link.step(link, ack(False, "late"), 2.0)
    assert link.state == "Ready" and link.last_row == "K4"
    PROTOCOL.decode_link.step(link, PeerLost(0, "prefill rank 0 died"), 3.0)
    assert link.state == "Lost" and link.failure == "prefill rank 0 died"
    PROTOCOL.decode_link.step(link, PeerLost(0, "again"), 4.0)
    assert link.state == "Lost" and link.failure == "prefill rank 0 died" and link.last_row == "K6"
    PROTOCOL.decode_link.step(link, ack(), 5.0)
    assert link.state == "Lost"
