"""``RuntimeConfig``: the configuration of a prefill or decode manager (``kvfsm.config``'s convention)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfsm.config import non_negative_int, positive, positive_int, setting, validate

_WORKERS = 4
_BATCH_BYTES = 256 << 20
_BATCH_SEGMENTS = 64
_REGISTER_RETRY_S = 1.0
_TOMBSTONE_TTL_S = 600.0
_EARLY_TTL_S = 300.0
_MAX_EARLY_ROOMS = 65536


def _timeouts(t: Any) -> bool:
    return isinstance(t, dict) and all(isinstance(k, str) and positive(v) for k, v in t.items())


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """Knobs of a prefill or decode manager, validated at construction (``ConfigError``)."""

    timeouts: dict[str, float] = setting(
        default_factory=dict,
        doc="Overrides of the spec's timer defaults in seconds, by timer name, e.g. {'transfer': 5.0}.",
        when="An engine whose transfers or bootstraps take longer than the spec's defaults allow.",
        check=_timeouts,
        must="a dict of timer names to positive seconds",
    )
    pull_timeouts: dict[str, float] = setting(
        default_factory=dict,
        doc="Pull mode: overrides of the pull machines' timer defaults in seconds, by timer name "
        "(prefill: claim, lease; decode: bootstrap, renew, window, read), e.g. {'lease': 10.0}. "
        "Keep renew well below the lease, and the read window below it too.",
        when="Reads that take longer than the read window allows (raise lease and window), or a "
        "prefill engine short of memory (a shorter lease frees the pages of a dead decode sooner).",
        check=_timeouts,
        must="a dict of timer names to positive seconds",
    )
    workers: int = setting(
        _WORKERS,
        doc="Transfer worker threads of a prefill rank that post writes; 0 runs every transfer job "
        "inline in the caller (deterministic; decode ranks never post).",
        when="0 for tests and trace replay; more where posting a write blocks for long.",
        check=non_negative_int,
        must="an integer >= 0",
    )
    batch_bytes: int = setting(
        _BATCH_BYTES,
        doc="send_many() hands its writes to the data plane whenever this many bytes are pending.",
        when="Lower it to start large chunks moving sooner within one engine batch.",
        check=positive_int,
        must="an integer > 0",
    )
    batch_segments: int = setting(
        _BATCH_SEGMENTS,
        doc="... or whenever this many segments are pending (scattered pages: one descriptor per run).",
        when="Lower it when scattered chunks are slow to post.",
        check=positive_int,
        must="an integer > 0",
    )
    register_retry_s: float = setting(
        _REGISTER_RETRY_S,
        doc="A decode rank re-sends its registration to a prefill rank this often until acknowledged.",
        when="Shorter on a fast local network, to connect sooner after a prefill rank starts.",
        check=positive,
        must="a number > 0",
    )
    tombstone_ttl_s: float = setting(
        _TOMBSTONE_TTL_S,
        doc="How long a cleared or expired room id is remembered, so that a late message for it is "
        "dropped (and answered) instead of reaching a new room.",
        when="Longer than any message can be delayed on the network.",
        check=positive,
        must="a number > 0",
    )
    early_ttl_s: float = setting(
        _EARLY_TTL_S,
        doc="Prefill: how long messages for a room the engine has not created yet are kept; then the "
        "decode ranks that announced it are told it failed.",
        when="Longer than the engine's worst delay between decode's announcement and prefill's create.",
        check=positive,
        must="a number > 0",
    )
    max_early_rooms: int = setting(
        _MAX_EARLY_ROOMS,
        doc="Prefill: how many not-yet-created rooms' messages are kept at most; a further room's are "
        "dropped (counted as dropped.early_overflow).",
        when="Raise it for an engine that runs far more concurrent rooms.",
        check=positive_int,
        must="an integer > 0",
    )
    verify_plans: bool = setting(
        False,
        doc="Prefill with a KV layout: prove every plan before its write is posted "
        "(kvfsm.layout.verify_plan: every head vector of the chunk written once, from the right "
        "source element, inside registered memory); a plan that fails fails its room.",
        when="Debugging a new engine layout or mapping; it costs about as much as planning again.",
        check=lambda v: type(v) is bool,
        must="True or False",
    )

    def __post_init__(self) -> None:
        validate(self)
