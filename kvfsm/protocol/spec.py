"""Loads spec/*.toml into plain, immutable Python values.

The spec is the single source of truth: states (with their KVPoll projection), events, timers,
transition rows and wire messages. This module only parses and cross-checks it; guard and action
names are resolved against the registry when machines are built (kvfsm.protocol.machine).
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfsm.protocol.errors import SpecError


def spec_dir() -> Path:
    """The directory holding the spec: the repository's spec/ or the copy packaged in a wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent.parent / "spec", here.parent / "spec"):
        if (candidate / "protocol.toml").is_file():
            return candidate
    raise SpecError(f"spec/ not found next to {here}")


@dataclass(frozen=True, slots=True)
class StateSpec:
    name: str  # full name, "Parent.Child" for nested states
    kvpoll: str | None  # the KVPoll name it projects to (None: Cleared, not observable)
    terminal: bool
    why: str
    parent: str | None


@dataclass(frozen=True, slots=True)
class TimerSpec:
    name: str
    trigger: str
    default_s: float
    why: str


@dataclass(frozen=True, slots=True)
class RowSpec:
    id: str
    source_decl: tuple[str, ...]  # as written: leaf or parent state names
    sources: tuple[str, ...]  # expanded to leaf states
    triggers: tuple[str, ...]
    guards: tuple[str, ...]  # "!name" negates
    dest: str | None  # None: stay ("=" in the spec)
    actions: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True)
class MachineSpec:
    name: str
    side: str
    initial: str
    on_create: tuple[str, ...]
    summary: str
    states: dict[str, StateSpec]  # leaf states, in declaration order
    groups: dict[str, tuple[str, ...]]  # top-level name -> its leaf states
    group_why: dict[str, str]
    timers: dict[str, TimerSpec]
    rows: tuple[RowSpec, ...]
    error_dest: str
    error_actions: tuple[str, ...]

    @property
    def triggers(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for row in self.rows:
            for t in row.triggers:
                seen.setdefault(t, None)
        return tuple(seen)


@dataclass(frozen=True, slots=True)
class EventSpec:
    key: str
    class_name: str
    cause: str
    fields: dict[str, str]
    why: str


@dataclass(frozen=True, slots=True)
class MessageSpec:
    name: str
    plane: str
    direction: str
    fields: dict[str, str]
    why: str
    binary_id: int | None = None  # fixed binary layout instead of JSON (messages.toml header)


@dataclass(frozen=True, slots=True)
class ProtocolSpec:
    name: str
    version: int
    mode: str
    summary: str
    kvpoll: dict[str, int]
    events: dict[str, EventSpec]
    messages: dict[str, MessageSpec]
    machines: dict[str, MachineSpec]


def _tuple(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(v)


def _load_machine(path: Path, kvpoll: dict[str, int], event_keys: set[str]) -> MachineSpec:
    raw = tomllib.loads(path.read_text())
    m = raw["machine"]
    states: dict[str, StateSpec] = {}
    groups: dict[str, tuple[str, ...]] = {}
    group_why: dict[str, str] = {}
    for top, body in raw["states"].items():
        poll = body.get("kvpoll")
        if poll is not None and poll not in kvpoll:
            raise SpecError(f"{path.name}: state {top} projects to unknown KVPoll {poll!r}")
        terminal = bool(body.get("terminal", False))
        group_why[top] = body.get("why", "")
        children = body.get("children", {})
        if children:
            names = []
            for child, cbody in children.items():
                full = f"{top}.{child}"
                states[full] = StateSpec(full, poll, terminal, cbody.get("why", ""), top)
                names.append(full)
            groups[top] = tuple(names)
        else:
            states[top] = StateSpec(top, poll, terminal, body.get("why", ""), None)
            groups[top] = (top,)
    timers = {
        name: TimerSpec(name, t["trigger"], float(t["default_s"]), t.get("why", ""))
        for name, t in raw.get("timers", {}).items()
    }
    known_triggers = event_keys - {"timeout"} | {t.trigger for t in timers.values()}

    def expand(name: str, where: str) -> tuple[str, ...]:
        if name in groups:
            return groups[name]
        if name in states:
            return (name,)
        raise SpecError(f"{path.name}: {where}: unknown state {name!r}")

    def leaf(name: str, where: str) -> str:
        if name in states:
            return name
        if name in groups and len(groups[name]) == 1:
            return groups[name][0]
        raise SpecError(f"{path.name}: {where}: {name!r} is not a leaf state")

    rows = []
    ids: set[str] = set()
    for r in raw.get("transition", []):
        rid = r["id"]
        if rid in ids:
            raise SpecError(f"{path.name}: duplicate row id {rid}")
        ids.add(rid)
        decl = _tuple(r["source"])
        sources = tuple(s for name in decl for s in expand(name, f"row {rid} source"))
        triggers = _tuple(r["trigger"])
        for t in triggers:
            if t not in known_triggers:
                raise SpecError(f"{path.name}: row {rid}: unknown trigger {t!r}")
        dest_raw = r["dest"]
        dest = None if dest_raw == "=" else leaf(dest_raw, f"row {rid} dest")
        rows.append(
            RowSpec(
                rid,
                decl,
                sources,
                triggers,
                _tuple(r.get("guard")),
                dest,
                _tuple(r.get("actions")),
                r.get("why", ""),
            )
        )
    err = m["on_remote_error"]
    return MachineSpec(
        name=m["name"],
        side=m["side"],
        initial=leaf(m["initial"], "initial"),
        on_create=_tuple(m.get("on_create")),
        summary=m.get("summary", "").strip(),
        states=states,
        groups=groups,
        group_why=group_why,
        timers=timers,
        rows=tuple(rows),
        error_dest=leaf(err["dest"], "on_remote_error"),
        error_actions=_tuple(err.get("actions")),
    )


@functools.cache
def load_spec(directory: str | None = None) -> ProtocolSpec:
    """Parse and cross-check spec/. Raises SpecError on any inconsistency."""
    d = Path(directory) if directory else spec_dir()
    proto = tomllib.loads((d / "protocol.toml").read_text())
    kvpoll = {k: int(v) for k, v in proto["kvpoll"].items()}
    events = {
        key: EventSpec(key, e["class"], e["cause"], dict(e.get("fields", {})), e.get("why", ""))
        for key, e in tomllib.loads((d / "events.toml").read_text())["events"].items()
    }
    for e in events.values():
        if e.cause not in ("local", "remote"):
            raise SpecError(f"event {e.key}: cause must be local or remote")
    messages = {
        name: MessageSpec(name, m["plane"], m["direction"], dict(m["fields"]), m.get("why", ""), m.get("binary_id"))
        for name, m in tomllib.loads((d / "messages.toml").read_text())["messages"].items()
    }
    ids = [m.binary_id for m in messages.values() if m.binary_id is not None]
    if len(ids) != len(set(ids)) or any(type(i) is not int or not 0 < i < 256 for i in ids):
        raise SpecError(f"messages: binary_id must be distinct integers in [1, 255], got {ids}")
    machines = {}
    for f in (
        "prefill_room.toml",
        "decode_room.toml",
        "prefill_link.toml",
        "decode_link.toml",
        "prefill_pull.toml",
        "decode_pull.toml",
    ):
        ms = _load_machine(d / f, kvpoll, set(events))
        machines[ms.name] = ms
    p = proto["protocol"]
    return ProtocolSpec(
        name=p["name"],
        version=int(p["version"]),
        mode=p["mode"],
        summary=p.get("summary", "").strip(),
        kvpoll=kvpoll,
        events=events,
        messages=messages,
        machines=machines,
    )
