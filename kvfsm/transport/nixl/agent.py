"""Finding NIXL: whichever of its Python wheels is installed."""

from __future__ import annotations

from typing import Any


def load_nixl() -> tuple[Any, Any, tuple[type[BaseException], ...]]:
    """(nixl_agent, nixl_agent_config, NIXL's exception classes) from whichever wheel is installed.
    Raises ImportError with the reason when none is."""
    errors: list[str] = []
    for mod in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            api = __import__(f"{mod}._api", fromlist=["nixl_agent"])
            bindings = __import__(f"{mod}._bindings", fromlist=["nixlNotFoundError"])
        except Exception as exc:  # noqa: BLE001 - a broken wheel is as absent as a missing one
            errors.append(f"{mod}: {exc}")
            continue
        excs = tuple(
            v for k, v in vars(bindings).items() if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type)
        )
        return api.nixl_agent, api.nixl_agent_config, excs
    raise ImportError("no NIXL Python package is importable (" + "; ".join(errors) + ")")


def nixl_available() -> str | None:
    """None if NIXL can be used here, else why not."""
    try:
        load_nixl()
    except ImportError as exc:
        return str(exc)
    return None
