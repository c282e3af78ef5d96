"""``kvfsm replay FILE``: drive the real runtime over loopback through a checker trace.

The trace (JSONL from ``kvfsm check --trace-out``) is followed step by step on real managers
over a ``Fabric`` in async-write mode, where every queued item (message, notification, write in
flight, completion, peer loss) is chosen by hand, timers fire only when the trace says so, and
engine calls are the runtime's public API. After every step the machine state of every room on
every rank is compared with the model's; and the runtime is watched for the same violations the
checker reports: a write landing in released decode pages (sentinel bytes), a write reading
released source pages, a Failed code that changes, Success turning into Failed, a cleared room
coming back, a Success without every write landed, a decode room that fails although every rank
that writes to it delivered everything.

A mapping mutant (``kvfsm.check.mapping.MAPPING_MUTANTS``) reaches the runtime through the
engine calls: the decode engine is told the sources the mutant's mapping expects
(``create_receiver``), and only the prefill ranks that write somebody create their rooms. Which
KV heads a write carries is not the runtime's business here (its writes are pages, sliced by
``kvfsm.layout``'s plans): ``head_written_once`` is seen by the checker only, and its replay
shows that the runtime follows the model state for state.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfsm.check.encoding import _msg_tuple
from kvfsm.check.explore import _jsonable
from kvfsm.check.model import CheckConfig, Model
from kvfsm.protocol import LocalProtocolError
from kvfsm.protocol.rooms import DecodeRoom
from kvfsm.protocol.routing import CLEARED, CLEARED_FAILED, EARLY, EXPIRED, LIVE, ROUTING
from kvfsm.runtime import RuntimeConfig
from kvfsm.runtime.decode import KVReceiver
from kvfsm.runtime.manager import Manager
from kvfsm.runtime.prefill import KVSender
from kvfsm.testing import LoopbackCluster

SENTINEL = 0xA5
FAILED, SUCCESS = 0, 4


class ReplayError(Exception):
    """The trace cannot be followed (not enabled in the model, or no matching item on the runtime)."""


@dataclass
class ReplayResult:
    config: CheckConfig
    expected: str
    steps: int = 0
    divergences: list[str] = field(default_factory=list)
    observed: list[str] = field(default_factory=list)  # violations seen on the runtime
    final_states: dict[str, str | None] = field(default_factory=dict)

    @property
    def reproduced(self) -> bool:
        """The runtime followed the model state for state, and showed the violation (where it is
        observable on the runtime) — or reached the same final states (liveness, telling)."""
        if self.divergences:
            return False
        observable = {"no_write_into_freed_pages", "no_read_of_released_source", "failed_is_sticky",
                      "success_is_final", "no_resurrection", "no_false_success", "no_wait_for_silent_rank"}  # fmt: skip
        return self.expected in self.observed if self.expected in observable else True


def _ep(node: str) -> str:
    return ("prefill/" if node[0] == "P" else "decode/") + node[1:]


class Replayer:
    def __init__(self, cfg: CheckConfig, routing_bugs: bool = True) -> None:
        """The runtime runs the model's protocol and the model's routing (``kvfsm.protocol.routing``:
        a routing mutant's variant too). ``routing_bugs=False`` gives the runtime the correct
        routing instead: a routing mutant's trace then shows that it stops the bug."""
        self.cfg = cfg
        self.model = Model(cfg)
        self.state = self.model.initial()
        self.page_bytes, self.aux_bytes = 32, 8
        self.c = LoopbackCluster(
            prefill_ranks=cfg.prefill_ranks, decode_ranks=cfg.decode_ranks, pages=cfg.rooms * cfg.chunks,
            page_bytes=self.page_bytes, aux_slots=cfg.rooms, aux_bytes=self.aux_bytes, workers=0,
            ordered=cfg.ordered, protocol=self.model.protocol, async_writes=True, config=RuntimeConfig(workers=0),
            routing=self.model.routing if routing_bugs else ROUTING,
        )  # fmt: skip
        self.handles: dict[tuple[str, int, int], KVSender | KVReceiver] = {}
        self.freed: set[tuple[int, int]] = set()  # (room, decode rank) whose pages were handed back
        self.released_sources: set[tuple[int, int]] = set()  # (room, prefill rank)
        self.landed: set[tuple[int, int, int, int]] = set()
        self.polls: dict[tuple[str, int, int], int | None] = {}
        self.cleared: set[tuple[str, int, int]] = set()
        self.observed: list[str] = []

    def manager(self, side: str, rank: int) -> Manager:
        return self.c.prefill[rank] if side == "P" else self.c.decode[rank]

    # ------------------------------------------------------------------ one step

    def step(self, label: list[Any]) -> list[str]:
        nxt = None
        for lab, st, notes in self.model.successors(self.state):
            if _jsonable(lab) == label:
                nxt = (st, notes)
                break
        if nxt is None:
            raise ReplayError(f"{label} is not enabled in the model here")
        self._apply(label)
        self.state = nxt[0]
        self._watch()
        return self._compare()

    def _apply(self, label: list[Any]) -> None:
        kind = label[0]
        m, cfg = self.model, self.cfg
        if kind == "create":
            _, side, rank, room = label
            if side == "P":
                self.handles[("P", rank, room)] = self.c.prefill[rank].create_sender(room)
            else:
                src = m.sources[rank]
                self.handles[("D", rank, room)] = self.c.decode[rank].create_receiver(room, src, m.required[rank])
        elif kind == "send":
            _, rank, room, k = label
            last = k == cfg.chunks - 1
            sender = self.handles[("P", rank, room)]
            assert isinstance(sender, KVSender)
            sender.send([m.pages(room)[k]], is_last=last, aux_slot=room if last else None)
        elif kind == "init":
            _, rank, room = label
            recv = self.handles[("D", rank, room)]
            assert isinstance(recv, KVReceiver)
            recv.init(m.pages(room), room)
        elif kind == "abort":
            self.handles[(label[1], label[2], label[3])].abort("")
        elif kind == "clear":
            _, side, rank, room = label
            self.handles[(side, rank, room)].clear()
            if side == "D":
                self.freed.add((room, rank))
                b, a = self.page_bytes, self.aux_bytes
                for page in m.pages(room):
                    self.c.dkv[rank][page * b : (page + 1) * b] = bytes([SENTINEL]) * b
                self.c.daux[rank][room * a : (room + 1) * a] = bytes([SENTINEL]) * a  # aux slot = room
            else:
                self.released_sources.add((room, rank))
        elif kind == "timer":
            _, side, rank, room, timer = label
            self.manager(side, rank).fire_timer(room, timer)
        elif kind == "expire":
            self.c.prefill[label[1]].expire_early(label[2])
        elif kind == "crash":
            self.c.fabric.crash(_ep(f"{label[1]}{label[2]}"))
        elif kind in ("deliver", "lose", "duplicate"):
            self._item(kind, label[1])
        else:
            raise ReplayError(f"unknown step {label}")

    def _item(self, kind: str, item: list[Any]) -> None:
        fabric = self.c.fabric
        codec = self.model.protocol.codec

        def match(fi: Any) -> bool:
            k = item[0]
            if k in ("m", "n"):
                want = "message" if k == "m" else "notification"
                if fi.job is not None or fi.inbound.kind != want or (fi.src, fi.dst) != (_ep(item[1]), _ep(item[2])):
                    return False
                return bool(_jsonable(_msg_tuple(codec.decode(fi.inbound.data))) == item[3])
            if k == "w":
                tag = (item[3], int(item[2][1:]), item[4])
                return fi.job is not None and (fi.src, fi.dst) == (_ep(item[1]), _ep(item[2])) and fi.inbound.tag == tag
            if k == "c":
                tag = (item[2], item[3], item[4])
                return (fi.job is None and fi.inbound.kind == "completion" and fi.dst == _ep(item[1])
                        and fi.inbound.tag == tag and fi.inbound.ok == item[5])  # fmt: skip
            return bool(fi.inbound.kind == "peer_lost" and fi.dst == _ep(item[1]) and fi.inbound.peer == _ep(item[2]))

        if kind == "duplicate":
            found = next((fi for fi in fabric.queued() if match(fi)), None)
            if found is None:
                raise ReplayError(f"no queued item matches {item}")
            fabric.requeue(found)
            return
        fi = fabric.take(match)
        if fi is None:
            raise ReplayError(f"no queued item matches {item}")
        if kind == "lose":
            if fi.job is not None:
                fabric.fail_write(fi)
            return
        if item[0] == "w":
            room, p, d, chunk = item[3], int(item[1][1:]), int(item[2][1:]), item[4]
            if (room, p) in self.released_sources:
                self.observed.append("no_read_of_released_source")
            self.landed.add((room, p, chunk, d))
        fabric.deliver(fi)

    # ------------------------------------------------------------------ watching

    def runtime_state(self, side: str, rank: int, room: int) -> str | None:
        mgr = self.manager(side, rank)
        with mgr._lock:
            known = mgr._known(room)  # (as the shared routing knows it)
            if known == LIVE:
                return str(mgr._rooms[room].room.state)
        return {EXPIRED: "X", CLEARED: "Cleared", CLEARED_FAILED: "Cleared", EARLY: "E"}.get(known)

    def model_state(self, idx: int) -> str | None:
        slot = self.model.slots(self.state)[idx]
        return None if slot is None else str(slot[0])

    def _compare(self) -> list[str]:
        out = []
        for idx, (side, room, rank) in enumerate(self.model.slot_info):
            if self.model.node(side, rank) in self.model.crashed(self.state):
                continue  # a crashed rank: the runtime object lives on, the model froze it
            want, got = self.model_state(idx), self.runtime_state(side, rank, room)
            if want != got:
                out.append(f"{side}{rank} room {room}: model {want}, runtime {got}")
        return out

    def _watch(self) -> None:
        b, a = self.page_bytes, self.aux_bytes
        for room, rank in self.freed:
            pages = [self.c.dkv[rank][page * b : (page + 1) * b] for page in self.model.pages(room)]
            pages.append(self.c.daux[rank][room * a : (room + 1) * a])
            if any(any(x != SENTINEL for x in chunk) for chunk in pages):
                self.observed.append("no_write_into_freed_pages")
        for side, room, rank in self.model.slot_info:
            st = self.runtime_state(side, rank, room)
            key = (side, rank, room)
            before = self.polls.get(key)
            poll = None if st in (None, "E", "X", "Cleared") else self.model._polls.get((side, st))
            if before == FAILED and poll not in (FAILED, None):
                self.observed.append("failed_is_sticky")
            if before == SUCCESS and poll == FAILED:
                self.observed.append("success_is_final")
            if st not in (None, "E", "X", "Cleared") and key in self.cleared:
                self.observed.append("no_resurrection")
            if st == "Cleared":
                self.cleared.add(key)
            if side == "D" and poll == FAILED and before not in (FAILED, None) and self._got_all(rank, room):
                self.observed.append("no_wait_for_silent_rank")
            if side == "D" and poll == SUCCESS and before != SUCCESS:
                for p in self.model.sources[rank]:
                    for chunk in (*range(self.cfg.chunks), -1):
                        if (room, p, chunk, rank) not in self.landed:
                            self.observed.append("no_false_success")
            if poll is not None or st == "Cleared":
                self.polls[key] = poll

    def _got_all(self, rank: int, room: int) -> bool:
        """The runtime's decode room has every chunk and the aux of every rank that writes to it."""
        mgr = self.manager("D", rank)
        with mgr._lock:
            r = mgr._rooms[room].room
            assert isinstance(r, DecodeRoom)
            senders = self.model.mapping.senders_of(rank)
            return bool(senders) and all(
                p in r.last_count and len(r.received.get(p, {})) == r.last_count[p] and p in r.aux_done for p in senders
            )


def replay(path: Path, routing_bugs: bool = True) -> ReplayResult:
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    cfg = CheckConfig(**header["config"])
    labels = [json.loads(x)["label"] for x in lines[1:]]
    r = Replayer(cfg, routing_bugs)
    res = ReplayResult(cfg, header.get("violation", ""))
    for i, label in enumerate(labels, 1):
        try:
            diffs = r.step(label)
        except (ReplayError, LocalProtocolError) as exc:
            res.divergences.append(f"step {i} {label}: {exc}")
            break
        res.steps = i
        res.divergences += [f"step {i}: {d}" for d in diffs]
    res.observed = sorted(set(r.observed))
    res.final_states = {
        f"{side}{rank} room {room}": r.runtime_state(side, rank, room) for side, room, rank in r.model.slot_info
    }
    r.c.close()
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="JSONL written by kvfsm check --trace-out")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--runtime-fixes",
        action="store_true",
        help="for a routing mutant, run the correct routing on the runtime (shows that it stops the bug)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        res = replay(args.trace, routing_bugs=not args.runtime_fixes)
    except ReplayError as exc:
        print(f"cannot replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"expected": res.expected, "steps": res.steps, "reproduced": res.reproduced,
                          "observed": res.observed, "divergences": res.divergences, "final_states": res.final_states}))  # fmt: skip
    else:
        print(f"kvfsm replay: {res.steps} steps on the runtime over loopback; checker reported {res.expected}")
        for d in res.divergences:
            print(f"  DIVERGED {d}")
        print(f"  observed on the runtime: {', '.join(res.observed) or 'nothing'}")
        print(f"  final states: {res.final_states}")
        print("  REPRODUCED" if res.reproduced else "  NOT reproduced")
    return 0 if res.reproduced else 1
