"""kvfsm check: explores every interleaving of the protocol the runtime runs.

``model`` composes P prefill ranks x D decode ranks x rooms x chunks into one hashable system
state over an explicit network model; ``properties`` holds the predicates named in
spec/invariants.toml; ``explore`` runs breadth-first search (shortest counterexamples);
``mutants`` are named historical bug classes as spec variants.
"""

from __future__ import annotations

from kvfsm.check.explore import CheckResult, explore
from kvfsm.check.model import CheckConfig, Model

__all__ = ["CheckConfig", "CheckResult", "Model", "explore"]
