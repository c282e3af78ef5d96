"""``fast_init``: a cheaper ``__init__`` for the frozen, slotted dataclasses of events, actions,
wire messages, and the transport's segments and inbound items.

Theory of operation
-------------------
The ``__init__`` that ``dataclass(frozen=True)`` writes sets each field with
``object.__setattr__(self, name, value)``: a global and an attribute lookup, then the generic
attribute path, per field. ``fast_init`` replaces it by one that calls each field's slot
descriptor directly (``Cls.field.__set__``, bound once when the class is defined): same
signature, same defaults, same result. The class stays a frozen dataclass (assignment after
construction still raises FrozenInstanceError; eq, hash and repr are untouched), so messages and
events remain hashable and immutable for the model checker.

It is kept because it shows end to end: a generic step builds its action records and a decode
rank's chunk notification builds its message and event, and with the plain dataclass
``__init__`` the step costs up to ~15% more and the notification ~12% more (docs/design.md
gives the figures and the command). The prefill side's per-chunk path builds no record.

Only plain fields are supported: a ``default_factory``, an ``init=False`` or keyword-only field
or a ``__post_init__`` would need the generated code's extra steps, so they raise TypeError here
(when the class is defined) rather than being silently skipped.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def fast_init(cls: type[T]) -> type[T]:
    """Give the frozen, slotted dataclass ``cls`` a faster ``__init__`` (see module docstring).
    Apply it on top of ``@dataclass(frozen=True, slots=True)``."""
    params = getattr(cls, "__dataclass_params__", None)
    if not is_dataclass(cls) or params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init needs a frozen, slotted dataclass, not {cls.__name__}")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: fast_init does not run __post_init__")
    names: list[str] = []
    defaults: list[Any] = []
    for f in fields(cls):
        if not f.init or f.default_factory is not MISSING or f.kw_only is True:
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init supports plain fields only")
        names.append(f.name)
        if f.default is not MISSING:
            defaults.append(f.default)
    # Generated source, as dataclasses does; it names only the class's own fields. The setters
    # (_s0 sets the first field, and so on) reach __init__ as closure cells, and its globals are
    # the class's module, as for the generated original (get_type_hints resolves its annotations).
    setters = [getattr(cls, name).__set__ for name in names]
    cells = ", ".join(f"_s{i}" for i in range(len(names)))
    body = "".join(f"        _s{i}(self, {name})\n" for i, name in enumerate(names)) or "        pass\n"
    src = f"def make({cells}):\n    def __init__(self, {', '.join(names)}):\n{body}    return __init__\n"
    namespace: dict[str, Any] = {}
    exec(src, sys.modules[cls.__module__].__dict__, namespace)
    init = namespace["make"](*setters)
    init.__defaults__ = tuple(defaults) or None
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(cls.__init__.__annotations__)  # introspection (hypothesis builds())
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
