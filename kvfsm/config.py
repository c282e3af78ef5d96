"""Configuration objects: one per layer, documented field by field, validated at construction.

Theory of operation
-------------------
Each layer that has knobs owns one frozen dataclass (``RuntimeConfig``, ``NixlConfig``,
``ZmqConfig``, ...), modelled on aioquic's ``QuicConfiguration``: every field is declared with
``setting(default, doc=..., when=..., check=..., must=...)``, which keeps its documentation next to
its default. The class calls ``validate(self)`` from ``__post_init__``: a value that fails its
``check`` raises ``ConfigError`` naming the class, the field, the value and what it must be, at
construction, before any room or connection exists. ``reference(cls)`` returns the rows of the
configuration reference table that ``kvfsm docs`` writes to ``docs/configuration.md``.

Defaults are the right ones for a GPU server; module constants behind them are private.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

from kvfsm.protocol.errors import LocalProtocolError


class ConfigError(LocalProtocolError, ValueError):
    """A configuration value is out of its range: raised when the configuration is built."""


def setting(
    default: Any = MISSING,
    *,
    doc: str,
    when: str = "",
    check: Callable[[Any], bool] | None = None,
    must: str = "",
    default_factory: Callable[[], Any] | Any = MISSING,
) -> Any:
    """A configuration field: its default (or ``default_factory``), what it means (``doc``), when
    a user should change it (``when``), and a predicate its value must satisfy (``check``, with
    ``must`` saying in words what it accepts, for the error and the reference table)."""
    meta = {"doc": doc, "when": when, "check": check, "must": must}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def validate(cfg: Any) -> None:
    """Check every field of the configuration ``cfg`` against its ``check``; ConfigError if one fails."""
    for f in dataclasses.fields(cfg):
        check = f.metadata.get("check")
        value = getattr(cfg, f.name)
        if check is None:
            continue
        try:
            ok = bool(check(value))
        except Exception:  # noqa: BLE001 - a value the check cannot even look at is out of range
            ok = False
        if not ok:
            must = f.metadata.get("must") or "a valid value"
            raise ConfigError(f"{type(cfg).__name__}.{f.name} = {value!r}: it must be {must}")


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the configuration reference."""

    name: str
    type: str
    default: str
    doc: str
    when: str
    must: str


def reference(cls: type) -> list[Setting]:
    """The documented fields of the configuration class ``cls``, in declaration order."""
    rows = []
    for f in dataclasses.fields(cls):
        if "doc" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(): it has no documentation")
        if f.default is not MISSING:
            default = repr(f.default)
        elif f.default_factory is not MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(Setting(f.name, type_name, default, f.metadata["doc"], f.metadata["when"], f.metadata["must"]))
    return rows


# Checks shared by the layers' configurations.
def positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


def non_negative(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x >= 0


def positive_int(x: Any) -> bool:
    return type(x) is int and x > 0


def non_negative_int(x: Any) -> bool:
    return type(x) is int and x >= 0


def one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda x: x in choices
