"""Mutants: historical bug classes of SGLang and vLLM as named variants of the spec or a guard.

Each mutant rewrites spec rows (and may register an extra guard), and the protocol is built from
the result: the checker explores the same buggy protocol the runtime would run. A mutant named in
``kvfsm.protocol.routing.ROUTING_MUTANTS`` is (also) a variant of the routing decisions that the
model and the runtime share (``routing_for``): ``late_message_resurrects`` keeps a cleared room
routable (and adds the row that lets a late notification revive it), ``early_expiry_forgotten``
leaves no tombstone when early messages expire. A mutant named in
``kvfsm.check.mapping.MAPPING_MUTANTS`` is a variant of the rank mapping as the model uses it
(whom decode waits for, who writes which heads): ``replicated_heads_written_twice``,
``mla_decode_waits_for_every_rank``. A mutant named in ``kvfsm.check.plans.PLAN_MUTANTS`` is a
variant of the planner that gives each KV write its bytes (``kvfsm.layout.MUTANTS``):
``head_offset_from_global_rank``, ``multi_chunk_overwrite``. ``MUTANTS[name].config`` is a small configuration in which
``kvfsm check`` must find it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvfsm.check.model import CheckConfig
from kvfsm.protocol import Protocol, SendMessage, load_spec
from kvfsm.protocol.decode_rules import _source_done
from kvfsm.protocol.functions import ACTIONS, GUARDS
from kvfsm.protocol.spec import MachineSpec, ProtocolSpec, RowSpec
from kvfsm.protocol.wire import Drained

Transform = Callable[[ProtocolSpec], ProtocolSpec]


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what it reproduces, with the upstream reference
    expect: str  # the property the checker must report
    config: CheckConfig
    transform: Transform


def _machine(spec: ProtocolSpec, name: str, fn: Callable[[MachineSpec], MachineSpec]) -> ProtocolSpec:
    machines = dict(spec.machines)
    machines[name] = fn(machines[name])
    return replace(spec, machines=machines)


def _rows(ms: MachineSpec, fn: Callable[[tuple[RowSpec, ...]], list[RowSpec]]) -> MachineSpec:
    return replace(ms, rows=tuple(fn(ms.rows)))


def _row(rid: str, sources: tuple[str, ...], triggers: tuple[str, ...], dest: str | None,
         guards: tuple[str, ...] = (), actions: tuple[str, ...] = (), why: str = "mutant") -> RowSpec:  # fmt: skip
    return RowSpec(rid, sources, sources, triggers, guards, dest, actions, why)


def _drop_actions(names: set[str]) -> Callable[[MachineSpec], MachineSpec]:
    def fn(ms: MachineSpec) -> MachineSpec:
        rows = [replace(r, actions=tuple(a for a in r.actions if a not in names)) for r in ms.rows]
        ms = replace(ms, rows=tuple(rows))
        return replace(ms, error_actions=tuple(a for a in ms.error_actions if a not in names))

    return fn


def _prepend(*rows: RowSpec) -> Callable[[MachineSpec], MachineSpec]:
    return lambda ms: _rows(ms, lambda old: [*rows, *old])


def _rename_action(old: str, new: str) -> Callable[[MachineSpec], MachineSpec]:
    def fn(ms: MachineSpec) -> MachineSpec:
        ms = _rows(
            ms, lambda rows: [replace(r, actions=tuple(new if a == old else a for a in r.actions)) for r in rows]
        )
        return replace(ms, error_actions=tuple(new if a == old else a for a in ms.error_actions))

    return fn


def _swap_guard(old: str, new: str) -> Callable[[MachineSpec], MachineSpec]:
    def fn(ms: MachineSpec) -> MachineSpec:
        return _rows(ms, lambda rows: [replace(r, guards=tuple(g.replace(old, new) for g in r.guards)) for r in rows])

    return fn


# --------------------------------------------------------------------- mutated guards


def _completes_any_source(room: Any, ev: Any) -> bool:
    """#22145: completion keyed so that one finished source concludes the room."""
    return any(_source_done(room, src, ev) for src in room.sources)


def _completes_without_aux(room: Any, ev: Any) -> bool:
    """#26394: Success before the aux (metadata) landed."""
    for src in room.sources:
        got = dict(room.received.get(src, {}))
        count = room.last_count.get(src)
        if ev.trigger == "chunk_arrived" and ev.src == src:
            got[ev.chunk_id] = (0, 0, ev.is_last)
            if ev.is_last:
                count = ev.chunk_id + 1
        if count is None or len(got) != count:
            return False
    return True


def _never(room: Any, ev: Any) -> bool:
    return False


def _tell_drained_now(room: Any, ev: Any, ctx: Any, arg: str) -> None:
    for dest in sorted(room.dests):
        ctx.out.append(SendMessage(dest, Drained(room.room, room.rank)))


ACTIONS.setdefault("mutant_tell_drained_now", _tell_drained_now)
GUARDS.setdefault("mutant_completes_any_source", _completes_any_source)
GUARDS.setdefault("mutant_completes_without_aux", _completes_without_aux)
GUARDS.setdefault("mutant_never", _never)


def _no_fence(spec: ProtocolSpec) -> ProtocolSpec:
    def fn(ms: MachineSpec) -> MachineSpec:
        rows = [
            replace(r, dest="Failed", actions=tuple(a for a in r.actions if a not in ("fence", "arm:fence")))
            if r.dest == "Fenced" else r
            for r in ms.rows
        ]  # fmt: skip
        ms = replace(ms, rows=tuple(rows))
        return replace(ms, error_dest="Failed", error_actions=tuple(a for a in ms.error_actions if "fence" not in a))

    return _machine(spec, "decode_room", fn)


def _no_bootstrap_timeout(spec: ProtocolSpec) -> ProtocolSpec:
    def fn(ms: MachineSpec) -> MachineSpec:
        ms = replace(ms, on_create=tuple(a for a in ms.on_create if a != "arm:bootstrap"))
        ms = _drop_actions({"arm_once:hold", "arm:input"})(ms)
        return _rows(
            ms,
            lambda rows: [
                r for r in rows if not set(r.triggers) & {"bootstrap_timeout", "hold_timeout", "input_timeout"}
            ],
        )

    return _machine(spec, "prefill_room", fn)


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in [
        Mutant(
            "failed_revived_by_success",
            "Common/Mooncake update_status: max(Failed=0, x) lets a worker's later Success revive an aborted room (sglang.md §1.1)",
            "failed_is_sticky",
            CheckConfig(1, 1, 1, 1, aborts=1),
            lambda s: _machine(
                s,
                "prefill_room",
                _prepend(
                    _row("M1", ("Failed",), ("write_completed",), "Success", ("write_pending",), ("complete_write",))
                ),
            ),
        ),
        Mutant(
            "abort_flips_success",
            "CommonKVSender.abort() after Success stores Failed (sglang.md §6.5)",
            "success_is_final",
            CheckConfig(1, 1, 1, 1, aborts=1),
            lambda s: _machine(
                s, "prefill_room", _prepend(_row("M2", ("Success",), ("abort",), "Failed", (), ("fail:aborted",)))
            ),
        ),
        Mutant(
            "completion_per_pp_rank",
            "Decode completion keyed by pp_rank: with Tp > Td one source's chunks conclude the room (#22145, #32270)",
            "no_false_success",
            CheckConfig(2, 1, 1, 1),
            lambda s: _machine(s, "decode_room", _swap_guard("completes_room", "mutant_completes_any_source")),
        ),
        Mutant(
            "success_before_aux",
            "Decode reports Success before the aux/metadata write landed (#26394, the metadata gate)",
            "no_false_success",
            CheckConfig(1, 1, 1, 1),
            lambda s: _machine(s, "decode_room", _swap_guard("completes_room", "mutant_completes_without_aux")),
        ),
        Mutant(
            "no_bootstrap_timeout",
            "NIXL prefill had no bootstrap timeout: a room whose decode never announces stays forever (#34692)",
            "no_stuck_room",
            CheckConfig(1, 1, 1, 1, loss=1, aborts=1),
            _no_bootstrap_timeout,
        ),
        Mutant(
            "prefill_failure_untold",
            "NIXL prefill failures are not pushed to decode, which waits for its timeout (#36033)",
            "failure_is_told",
            CheckConfig(1, 1, 1, 1, aborts=1),
            lambda s: _machine(s, "prefill_room", _drop_actions({"tell_decode:failed", "tell_decode:aborted"})),
        ),
        Mutant(
            "decode_abort_untold",
            "Before #27372 a decode abort or timeout sent no ABORT: prefill kept writing",
            "failure_is_told",
            CheckConfig(1, 1, 1, 1, aborts=1),
            lambda s: _machine(s, "decode_room", _drop_actions({"tell_prefill:aborted"})),
        ),
        Mutant(
            "late_message_resurrects",
            "A late notification re-creates a cleared room (#24539 class)",
            "no_resurrection",
            CheckConfig(1, 1, 1, 1, dup=1),
            lambda s: _machine(
                s, "decode_room", _prepend(_row("M8", ("Cleared",), ("chunk_arrived",), "Transferring"))
            ),
        ),
        Mutant(
            "pages_released_before_drain",
            "Decode releases its pages as soon as it fails while a prefill write is in flight (#24527; #35049/#38961)",
            "no_write_into_freed_pages",
            CheckConfig(1, 1, 1, 1),
            _no_fence,
        ),
        Mutant(
            "drained_before_writes_done",
            "Prefill confirms the drain while writes are in flight (the ack target is dropped before the drain, #38961)",
            "no_write_into_freed_pages",
            CheckConfig(1, 1, 1, 1, aborts=1),
            lambda s: _machine(s, "prefill_room", _rename_action("tell_drained", "mutant_tell_drained_now")),
        ),
        Mutant(
            "source_released_in_flight",
            "Prefill releases source pages while a write still reads them (sglang.md §6.4: source pages are not held)",
            "no_read_of_released_source",
            CheckConfig(1, 1, 1, 1, aborts=1),
            lambda s: _machine(s, "prefill_room", _swap_guard("!writes_outstanding", "!mutant_never")),
        ),
        Mutant(
            "early_expiry_forgotten",
            "Runtime: a room whose early room_pages expired is forgotten, so a late duplicate restarts writes into released pages",
            "no_write_into_freed_pages",
            CheckConfig(1, 1, 1, 1, dup=1),
            lambda s: s,  # a routing variant only (ROUTING_MUTANTS): the spec is unchanged
        ),
        Mutant(
            "replicated_heads_written_twice",
            "Prefill TP > KV heads: every prefill rank holding a replicated head sends it, so decode's head is written twice (sglang.md §3.1)",
            "head_written_once",
            CheckConfig(2, 1, 1, 1, mla=True),
            lambda s: s,  # a mapping variant only (MAPPING_MUTANTS): the spec is unchanged
        ),
        Mutant(
            "mla_decode_waits_for_every_rank",
            "MLA with the non-MLA source count: decode waits for all Tp/Td prefill ranks while one sends the latent (sglang.md §3.1)",
            "no_wait_for_silent_rank",
            CheckConfig(2, 1, 1, 1, mla=True),
            lambda s: s,  # a mapping variant only (MAPPING_MUTANTS): the spec is unchanged
        ),
        Mutant(
            "head_offset_from_global_rank",
            "The destination head offset computed from the sender's global TP rank instead of its place in the decode rank's group: writes land on other heads or past the decode buffer (sglang.md §3.1)",
            "write_plan_exact",
            CheckConfig(2, 4, 1, 1),
            lambda s: s,  # a plan variant only (kvfsm.check.plans.PLAN_MUTANTS): the spec is unchanged
        ),
        Mutant(
            "multi_chunk_overwrite",
            "Chunk offsets from the chunk's own token count instead of the running total: chunk N overwrites chunk N-1 (SGLang PR 18968; sglang.md §6.3)",
            "write_plan_exact",
            CheckConfig(1, 1, 1, 2),
            lambda s: s,  # a plan variant only (kvfsm.check.plans.PLAN_MUTANTS): the spec is unchanged
        ),
    ]
}


def mutated_protocol(name: str | None) -> Protocol:
    if name is None:
        return Protocol()
    mutant = MUTANTS.get(name)
    if mutant is None:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))}")
    return Protocol(mutant.transform(load_spec()))
