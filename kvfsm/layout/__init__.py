"""KV cache layouts and transfer plans between prefill and decode ranks (pure: no I/O, no torch)."""

from kvfsm.layout.kv import KVLayout, KVOrder, LayoutError, compatible
from kvfsm.layout.mapping import MappingError, RankMap, heads_of
from kvfsm.layout.plan import MUTANTS, Mutant, Plan, PlanKind, Planner, plan_chunk
from kvfsm.layout.verify import PlanError, verify_plan

__all__ = [
    "MUTANTS",
    "KVLayout",
    "KVOrder",
    "LayoutError",
    "MappingError",
    "Mutant",
    "Plan",
    "PlanError",
    "PlanKind",
    "Planner",
    "RankMap",
    "compatible",
    "heads_of",
    "plan_chunk",
    "verify_plan",
]
