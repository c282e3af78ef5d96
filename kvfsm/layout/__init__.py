"""KV cache layouts and transfer plans between prefill and decode ranks (pure: no I/O, no torch)."""

from kvfsm.layout.mapping import MappingError, RankMap, heads_of

__all__ = ["MappingError", "RankMap", "heads_of"]
