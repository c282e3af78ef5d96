"""``VllmConnectorConfig``: the settings of ``KvfsmConnector``, read from vLLM's
``kv_transfer_config.kv_connector_extra_config`` (every key optional: a prefill and a decode
engine on one host need none of them)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvfsm.config import ConfigError, non_negative_int, one_of, positive, positive_int, setting, validate

_HOLD_S = 60.0
_PEER_TIMEOUT_S = 10.0
_LEASE_S = 30.0
_TRANSFER_S = 60.0
_BOOTSTRAP_S = 30.0
_AUX_SLOTS = 1024


def _port(v: Any) -> bool:
    return non_negative_int(v) and v < 65536


@dataclass(frozen=True, slots=True)
class VllmConnectorConfig:
    """How ``KvfsmConnector`` reaches its peers and how long it waits for them."""

    host: str = setting(
        "127.0.0.1",
        doc="Address the prefill engine's bootstrap service and every rank's control plane bind "
        "to, and advertise in the params a decode request carries.",
        when="Prefill and decode on different hosts: an address of this host the other can reach.",
        check=lambda v: isinstance(v, str) and bool(v) and v not in ("0.0.0.0", "::"),
        must="a concrete address (peers connect to what is advertised)",
    )
    bootstrap_port: int = setting(
        0,
        doc="Prefill: the port of its bootstrap service (where decode ranks find prefill ranks); 0 "
        "picks a free one, advertised to decode in each request's kv_transfer_params.",
        when="A firewall that opens one known port.",
        check=_port,
        must="an integer in [0, 65535]",
    )
    transfer_mode: str = setting(
        "push",
        doc="push: decode registers the request's blocks with prefill, which writes the KV into them "
        "as soon as both are there (vLLM PR 35264's order). pull: prefill holds the request's blocks "
        "under a lease and decode reads them (vLLM's default), the lease extended by decode's "
        "heartbeats and every read due before it ends. A prefill request's "
        "kv_transfer_params['transfer_mode'] overrides it for that request.",
        when="pull where decode engines allocate late and prefill should keep nothing pinned for "
        "decodes that are gone (the lease ends seconds after a decode dies); push otherwise.",
        check=one_of("push", "pull"),
        must="'push' or 'pull'",
    )
    lease_s: float = setting(
        _LEASE_S,
        doc="Pull: prefill holds a request's blocks this long after decode's last claim or heartbeat; "
        "decode renews it every sixth of it and posts no read once less than a third of it remains.",
        when="Shorter to free the blocks of dead decode engines sooner; longer for reads that take "
        "seconds (very large prompts over a slow network).",
        check=positive,
        must="a number of seconds > 0",
    )
    hold_timeout_s: float = setting(
        _HOLD_S,
        doc="Prefill: how long a finished request's blocks stay held for its decode request to "
        "register its blocks (push) or claim them (pull); then they are freed and the decode "
        "request fails.",
        when="Longer where decode engines queue requests for long before allocating their blocks.",
        check=positive,
        must="a number of seconds > 0",
    )
    transfer_timeout_s: float = setting(
        _TRANSFER_S,
        doc="Both sides: a transfer that makes no progress for this long fails its request.",
        when="Longer for very large prompts over a slow network.",
        check=positive,
        must="a number of seconds > 0",
    )
    bootstrap_timeout_s: float = setting(
        _BOOTSTRAP_S,
        doc="Decode: how long a request waits for the handshake with the prefill ranks it reads from.",
        when="Longer where prefill engines start slowly after decode engines.",
        check=positive,
        must="a number of seconds > 0",
    )
    peer_timeout_s: float = setting(
        _PEER_TIMEOUT_S,
        doc="Both sides: a peer rank whose control connection answers no heartbeat for this long is "
        "lost, and its requests fail (a crashed process is told at once). A decode engine that "
        "lost a prefill engine's rank talks to it again through a fresh link at its next request.",
        when="Longer where engines' workers are starved of CPU for seconds (more processes than "
        "cores); shorter to fail requests of a frozen host sooner.",
        check=positive,
        must="a number of seconds > 0",
    )
    aux_slots: int = setting(
        _AUX_SLOTS,
        doc="Requests in flight per rank at most (each holds one small aux slot while it transfers).",
        when="Raise it for engines that run more concurrent transfers.",
        check=positive_int,
        must="an integer > 0",
    )

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> VllmConnectorConfig:
        """The config of vLLM's ``kv_connector_extra_config`` (unknown keys are an error)."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"VllmConnectorConfig: unknown kv_connector_extra_config keys {unknown}; known {sorted(known)}"
            )
        return cls(**extra)
