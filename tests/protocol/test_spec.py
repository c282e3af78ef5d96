"""spec/ is the single source of truth: it loads, the code agrees with it, and bad edits fail at load."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from kvfsm.protocol import EVENT_CLASSES, RoomMachine, SpecError, load_spec
from kvfsm.protocol.functions import ACTIONS, GUARDS
from kvfsm.protocol.spec import spec_dir
from kvfsm.protocol.wire import MESSAGE_CLASSES, Codec

SPEC = load_spec()
MACHINE_NAMES = ("prefill_room", "decode_room")


def test_spec_loads_with_both_room_machines():
    assert SPEC.name == "kvfsm"
    assert SPEC.mode == "push and pull"
    assert SPEC.version == 5  # 4: layouts, chunks in tokens; 5: pull mode
    assert set(SPEC.machines) == {*MACHINE_NAMES, "prefill_link", "decode_link", "prefill_pull", "decode_pull"}
    assert SPEC.machines["prefill_room"].initial == "Bootstrapping.Waiting"
    assert SPEC.machines["decode_room"].initial == "Bootstrapping"
    for m in SPEC.machines.values():
        assert m.rows, f"{m.name} has no transition rows"
        assert not m.states[m.initial].terminal
    # a peer's protocol error fails the room; on decode, its pages may still be written: fenced
    assert SPEC.machines["prefill_room"].error_dest == "Failed"
    assert SPEC.machines["decode_room"].error_dest == "Fenced"


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_every_state_but_cleared_projects_to_a_kvpoll_code(name):
    for state in SPEC.machines[name].states.values():
        if state.name == "Cleared":
            assert state.kvpoll is None and state.terminal
        else:
            assert state.kvpoll in SPEC.kvpoll, state.name


def test_event_classes_match_spec_events_field_for_field():
    assert set(EVENT_CLASSES) == {e.class_name for e in SPEC.events.values()}
    for key, ev in SPEC.events.items():
        cls = EVENT_CLASSES[ev.class_name]
        assert [f.name for f in dataclasses.fields(cls)] == list(ev.fields), ev.class_name
        assert cls.cause == ev.cause, ev.class_name
        if ev.class_name != "TimerFired":  # its trigger is the timer's own
            assert cls.trigger == key, ev.class_name


def test_timer_fired_carries_the_timer_and_takes_the_timers_trigger():
    assert [f.name for f in dataclasses.fields(EVENT_CLASSES["TimerFired"])] == ["timer"]
    for m in SPEC.machines.values():
        for t in m.timers.values():
            assert EVENT_CLASSES["TimerFired"](t.name).trigger == t.trigger


def test_wire_message_classes_match_spec_messages():
    assert set(MESSAGE_CLASSES) == set(SPEC.messages)
    Codec(SPEC.version, {n: m.fields for n, m in SPEC.messages.items()})  # checks field names and types


def test_codec_refuses_a_spec_whose_message_fields_differ_from_the_classes():
    fields = {n: dict(m.fields) for n, m in SPEC.messages.items()}
    del fields["room_pages"]["aux_slot"]
    with pytest.raises(SpecError, match="room_pages"):
        Codec(SPEC.version, fields)


def test_codec_refuses_an_unknown_field_type():
    fields = {n: dict(m.fields) for n, m in SPEC.messages.items()}
    fields["abort"]["reason"] = "text"
    with pytest.raises(SpecError, match="unknown field type"):
        Codec(SPEC.version, fields)


def test_codec_refuses_a_declared_message_without_a_class():
    fields = {n: dict(m.fields) for n, m in SPEC.messages.items()}
    fields["gossip"] = {"room": "u64"}
    with pytest.raises(SpecError, match="gossip"):
        Codec(SPEC.version, fields)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_every_non_terminal_state_has_a_timeout(name):
    m = SPEC.machines[name]
    timer_triggers = {t.trigger for t in m.timers.values()}
    for state in m.states.values():
        if state.terminal:
            continue
        rows = [r.id for r in m.rows if state.name in r.sources and timer_triggers & set(r.triggers)]
        assert rows, f"{name}: {state.name} has no timeout row: a room could wait there forever"


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_no_row_leaves_a_terminal_state_except_clear(name):
    m = SPEC.machines[name]
    for row in m.rows:
        for src in row.sources:
            if m.states[src].terminal and row.dest not in (None, "Cleared"):
                pytest.fail(f"row {row.id} leaves terminal {src} for {row.dest}")
            if row.dest == "Cleared":
                assert row.triggers == ("clear",) and m.states[src].terminal


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_timer_actions_name_timers_of_their_machine(name):
    # The loader does not check action arguments; a typo here would be a KeyError at run time.
    m = SPEC.machines[name]
    for where, actions in [("on_create", m.on_create), *((r.id, r.actions) for r in m.rows)]:
        for spec_name in actions:
            action, _, arg = spec_name.partition(":")
            if action in ("arm", "arm_once", "cancel"):
                assert arg in m.timers, f"{name} {where}: {spec_name} names no timer of {sorted(m.timers)}"
            if action in ("tell_decode", "tell_prefill", "tell_announcer"):
                assert arg in ("failed", "aborted"), f"{name} {where}: {spec_name}"


def test_every_registered_guard_and_action_is_named_by_the_spec():
    guards, actions = set(), set()
    for m in SPEC.machines.values():
        for row in m.rows:
            guards |= {g.lstrip("!") for g in row.guards}
            actions |= {a.partition(":")[0] for a in row.actions}
        actions |= {a.partition(":")[0] for a in (*m.on_create, *m.error_actions)}
    # kvfsm.check.mutants registers its bug variants under "mutant_" (used by mutated specs only)
    live_guards = {g for g in GUARDS if not g.startswith("mutant_")}
    live_actions = {a for a in ACTIONS if not a.startswith("mutant_")}
    assert guards == live_guards, "a guard is named by the spec but not registered, or registered and dead"
    assert actions == live_actions, "an action is named by the spec but not registered, or registered and dead"


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_machines_build_from_the_repository_spec(name):
    m = RoomMachine(SPEC.machines[name], SPEC.kvpoll)
    for row in SPEC.machines[name].rows:
        for src in row.sources:
            for trigger in row.triggers:
                assert m.accepts(src, trigger), (row.id, src, trigger)


def test_fenced_is_a_failed_state_that_is_not_concluded():
    decode = SPEC.machines["decode_room"]
    fenced = decode.states["Fenced"]
    assert fenced.kvpoll == "Failed" and not fenced.terminal, "failed to the engine, pages still reserved"
    assert set(decode.timers) == {"bootstrap", "transfer", "fence"}
    assert decode.timers["fence"].trigger == "fence_timeout"
    # a necessary condition only: the fence outlasts any one prefill timer (kvfsm check models the rest)
    assert decode.timers["fence"].default_s > max(t.default_s for t in SPEC.machines["prefill_room"].timers.values())
    clear = [r.id for r in decode.rows if "clear" in r.triggers and "Fenced" in r.sources]
    assert not clear, f"clear is accepted while fenced ({clear}): the engine could reuse pages still written"


def _entering(m, dest: str) -> list:
    return [r for r in m.rows if r.dest == dest and any(s != dest for s in r.sources)]


def test_every_decode_failure_with_pages_announced_fences_them_unless_no_writer_remains():
    decode = SPEC.machines["decode_room"]
    announced = {"WaitingForInput.Announced", "Transferring"}
    for row in _entering(decode, "Failed"):
        if announced & set(row.sources):
            assert row.id == "D23" and "!writers_remain" in row.guards, f"{row.id} frees announced pages"
            assert set(row.sources) <= announced
        elif row.sources != ("Fenced",):
            assert not {"fence", "arm:fence"} & set(row.actions), row.id
    for row in _entering(decode, "Fenced"):
        assert set(row.sources) <= announced, f"{row.id} fences a room that never announced"
        assert row.actions[-2:] == ("fence", "arm:fence") and "cancel_timers" in row.actions, row.id
        assert "tell_prefill:aborted" in row.actions, f"{row.id}: the sources must be told to stop writing"
    assert decode.error_actions[-2:] == ("fence", "arm:fence")
    # the fence is left only for Failed: by the last drain or death (D25) or by its timer (D27)
    leaving = {(r.id, r.dest) for r in decode.rows if "Fenced" in r.sources and r.dest not in (None, "Fenced")}
    assert leaving == {("D25", "Failed"), ("D27", "Failed")}


def test_every_prefill_failure_tells_decode_and_confirms_drained():
    prefill = SPEC.machines["prefill_room"]
    rows = _entering(prefill, "Failed")
    assert rows
    for actions in [*(r.actions for r in rows), prefill.error_actions]:
        tell = [a for a in actions if a.startswith("tell_decode:")]
        assert tell and "tell_drained" in actions, actions
        assert actions.index(tell[0]) < actions.index("tell_drained"), "the reason before the drain"
        if "complete_write" in actions:  # a write that failed is no longer in flight
            assert actions.index("complete_write") < actions.index("tell_drained")
    (drain,) = [r for r in prefill.rows if "Failed" in r.sources and "write_completed" in r.triggers and r.guards]
    assert drain.id == "P28b" and drain.guards == ("write_pending",)
    assert drain.actions == ("complete_write", "tell_drained")


def test_the_drained_message_and_the_writes_drained_event_agree():
    msg = SPEC.messages["drained"]
    assert (msg.plane, msg.direction) == ("control", "prefill->decode")
    assert msg.fields == {"room": "u64", "prefill_rank": "u32"}
    assert [f.name for f in dataclasses.fields(MESSAGE_CLASSES["drained"])] == ["room", "prefill_rank"]
    ev = SPEC.events["writes_drained"]
    assert (ev.class_name, ev.cause, dict(ev.fields)) == ("WritesDrained", "remote", {"prefill_rank": "u32"})
    assert EVENT_CLASSES["WritesDrained"].trigger == "writes_drained"
    assert "writes_drained" in SPEC.machines["decode_room"].triggers
    assert "writes_drained" not in SPEC.machines["prefill_room"].triggers


# ---------------------------------------------------------------- bad edits fail at load


def _edited_spec(tmp_path: Path, file: str, old: str, new: str) -> str:
    """A copy of spec/ with ``old`` replaced by ``new`` (exactly once) in ``file``."""
    d = tmp_path / "spec"
    shutil.copytree(spec_dir(), d)
    text = (d / file).read_text()
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {file}"
    (d / file).write_text(text.replace(old, new))
    return str(d)  # load_spec is cached per directory string; tmp_path is new for every test


def test_copied_spec_loads_and_builds(tmp_path):
    spec = load_spec(_edited_spec(tmp_path, "protocol.toml", 'name = "kvfsm"', 'name = "kvfsm"'))
    RoomMachine(spec.machines["prefill_room"], spec.kvpoll)
    RoomMachine(spec.machines["decode_room"], spec.kvpoll)


@pytest.mark.parametrize(
    ("file", "machine", "old", "new", "named"),
    [
        ("prefill_room.toml", "prefill_room", 'guard = ["chunk_ok"]\ndest = "Bootstrapping.Holding"',
         'guard = ["chunk_okay"]\ndest = "Bootstrapping.Holding"', "chunk_okay"),
        ("prefill_room.toml", "prefill_room", 'guard = ["!announce_valid"]', 'guard = ["!announce_vaild"]',
         "announce_vaild"),
        ("decode_room.toml", "decode_room", 'guard = ["aux_repeat"]', 'guard = ["aux_reppeat"]', "aux_reppeat"),
        ("decode_room.toml", "decode_room", 'guard = ["drain_completes"]', 'guard = ["drain_complete"]',
         "drain_complete"),
    ],
)  # fmt: skip
def test_unknown_guard_fails_when_the_machine_is_built(tmp_path, file, machine, old, new, named):
    spec = load_spec(_edited_spec(tmp_path, file, old, new))
    with pytest.raises(SpecError, match=named):
        RoomMachine(spec.machines[machine], spec.kvpoll)


@pytest.mark.parametrize(
    ("file", "machine", "old", "new", "named"),
    [
        ("prefill_room.toml", "prefill_room", 'actions = ["hold_chunk", "arm_once:hold"]',
         'actions = ["hold_chunks", "arm_once:hold"]', "hold_chunks"),
        ("decode_room.toml", "decode_room", 'on_create = ["arm:bootstrap"]', 'on_create = ["arm_timer:bootstrap"]',
         "arm_timer"),
        ("decode_room.toml", "decode_room",
         'actions = ["fail:protocol_error", "tell_prefill:aborted", "cancel_timers", "fence", "arm:fence"]',
         'actions = ["fail:protocol_error", "tell_prefil:aborted", "cancel_timers", "fence", "arm:fence"]',
         "tell_prefil"),
        ("decode_room.toml", "decode_room", 'actions = ["record_drained", "cancel:fence"]',
         'actions = ["record_drain", "cancel:fence"]', "record_drain"),
        ("prefill_room.toml", "prefill_room", 'actions = ["complete_write", "tell_drained"]',
         'actions = ["complete_write", "tell_drain"]', "tell_drain"),
    ],
)  # fmt: skip
def test_unknown_action_fails_when_the_machine_is_built(tmp_path, file, machine, old, new, named):
    spec = load_spec(_edited_spec(tmp_path, file, old, new))
    with pytest.raises(SpecError, match=named):
        RoomMachine(spec.machines[machine], spec.kvpoll)


@pytest.mark.parametrize(
    ("file", "machine", "old", "new", "message"),
    [
        ("prefill_room.toml", "prefill_room", 'actions = ["hold_chunk", "arm_once:hold"]',
         'actions = ["hold_chunk", "arm_once:hodl"]', "not a timer"),
        ("decode_room.toml", "decode_room", 'on_create = ["arm:bootstrap"]', 'on_create = ["arm:transfr"]',
         "not a timer"),
        ("prefill_room.toml", "prefill_room",
         'actions = ["fail:aborted", "tell_decode:aborted", "tell_drained", "cancel_timers"]',
         'actions = ["fail:aborted", "tell_decode:abortd", "tell_drained", "cancel_timers"]', "must be one of"),
        ("prefill_room.toml", "prefill_room", 'actions = ["complete_write", "tell_drained"]',
         'actions = ["complete_write", "tell_drained:now"]', "takes no argument"),
        ("decode_room.toml", "decode_room", 'actions = ["record_drained", "cancel:fence"]',
         'actions = ["record_drained", "cancel:fense"]', "not a timer"),
        ("prefill_room.toml", "prefill_room", 'actions = ["hold_chunk", "arm_once:hold"]',
         'actions = ["hold_chunk:now", "arm_once:hold"]', "takes no argument"),
        ("decode_room.toml", "decode_room",
         'actions = ["fail:peer", "tell_prefill:aborted", "cancel_timers", "fence", "arm:fence"]',
         'actions = ["fail", "tell_prefill:aborted", "cancel_timers", "fence", "arm:fence"]', "needs a text argument"),
    ],
)  # fmt: skip
def test_a_bad_action_argument_fails_when_the_machine_is_built(tmp_path, file, machine, old, new, message):
    spec = load_spec(_edited_spec(tmp_path, file, old, new))
    with pytest.raises(SpecError, match=message):
        RoomMachine(spec.machines[machine], spec.kvpoll)


@pytest.mark.parametrize(
    ("file", "old", "new", "message"),
    [
        # unknown state as a row's source, and as its dest
        ("prefill_room.toml", 'source = "Bootstrapping.Holding"\ntrigger = "pages_announced"\nguard = ["held_has_last"]',
         'source = "Bootstrapping.Hodling"\ntrigger = "pages_announced"\nguard = ["held_has_last"]', "unknown state"),
        ("decode_room.toml", 'dest = "WaitingForInput.Allocating"', 'dest = "WaitingForInput.Allocated"',
         "not a leaf state"),
        # a parent state with children is not a destination
        ("decode_room.toml", 'dest = "WaitingForInput.Allocating"', 'dest = "WaitingForInput"', "not a leaf state"),
        # unknown trigger, and a timer trigger of a timer this machine does not have
        ("decode_room.toml", 'trigger = "peers_ready"\ndest', 'trigger = "peers_readied"\ndest', "unknown trigger"),
        ("decode_room.toml", 'trigger = "transfer_timeout"\ndest', 'trigger = "hold_timeout"\ndest', "unknown trigger"),
        # two rows with one id
        ("prefill_room.toml", 'id = "P27"', 'id = "P26"', "duplicate row id"),
        # a state projecting to a KVPoll code that does not exist
        ("decode_room.toml", 'kvpoll = "Transferring"', 'kvpoll = "Moving"', "unknown KVPoll"),
        # an event cause that is neither local nor remote
        ("events.toml", 'class = "PeerLost"\ncause = "remote"', 'class = "PeerLost"\ncause = "peer"', "cause"),
    ],
)  # fmt: skip
def test_inconsistent_spec_fails_at_load(tmp_path, file, old, new, message):
    with pytest.raises(SpecError, match=message):
        load_spec(_edited_spec(tmp_path, file, old, new))
