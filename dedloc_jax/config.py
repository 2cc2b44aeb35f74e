"""Configuration of a collaboration: one frozen dataclass of per-subsystem groups, with named
presets. Each setting has one place; the flat keyword names of old still work but warn."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from dedloc_jax.averaging.leaf_codecs import COMPRESSIONS

MAX_RECORD_TTL = 3600.0
"""Seconds a record of the run's keys may live (the schemas refuse longer ones, with a minute
for clocks): a record stored once by a peer that left lapses within the hour, not in a week."""


def _positive_when_set(group: object, *names: str) -> None:
    for name in names:
        value = getattr(group, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive when set")


class _Group:
    """A frozen group of settings; ``config.rounds.replace(codec="none")`` changes one."""

    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class ProgressConfig(_Group):
    """How often the progress table is read, and how long our record in it lives."""

    min_refresh: float = 0.25  # seconds between progress reads near the target
    max_refresh: float = 5.0  # ... and far from it (reads at half the ETA in between)
    ttl: float = 60.0  # a vanished peer's progress expires after this
    # Far from the target (an ETA of idle_after or more: diloco's outer steps, hours apart,
    # never a DeDLOC epoch) reads come at a tenth of the ETA up to idle_refresh, and our
    # record lives up to half the ETA within idle_ttl (renewed at a third of that): a peer
    # that vanishes still expires before the step, and the table is not re-read every
    # max_refresh for hours. (At a tenth of an 80 s epoch's ETA, DeDLOC rounds failed.)
    # idle_ttl is long (30 min) because renewals and the follower's relocations come once per
    # record lifetime: hours from the step they are most of a DiLoCo run's DHT bytes.
    # (idle_refresh uncapped, a newcomer whose first view of the table was partial read it
    # every tenth of a long ETA and missed the step: issue 48, docs/decisions.md.)
    idle_after: float = 600.0
    idle_refresh: float = 60.0
    idle_ttl: float = 1800.0
    # Count others' samples since their last report from their rate (DeDLOC): less overshoot,
    # but a peer may stop early and wait in matchmaking for the rest. False: published only.
    extrapolate: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.min_refresh <= self.max_refresh <= self.idle_refresh:
            raise ValueError("need 0 < min_refresh <= max_refresh <= idle_refresh")
        if not 0 < self.ttl <= self.idle_ttl <= MAX_RECORD_TTL:
            raise ValueError(f"need 0 < ttl <= idle_ttl <= {MAX_RECORD_TTL:.0f}")
        if not self.idle_after > 0:
            raise ValueError("idle_after must be positive")


MID_STEP_POLL = 0.25
"""Seconds between a peer's checks inside a micro-step whether to average, when
``RoundConfig.mid_step_poll`` does not say."""


@dataclass(frozen=True)
class RoundConfig(_Group):
    """How averaging groups form and how long a round may take.

    Deadlines left as None are derived at run time from what the progress tracker and the
    measured bandwidths predict (see :mod:`dedloc_jax.rounds.deadlines`); setting them fixes them.
    """

    max_group_size: int = 64  # Moshpit-style cap; groups are reshuffled every epoch
    matchmaking_time: float | None = None  # seconds a leader waits for joins
    averaging_timeout: float | None = None  # seconds an all-reduce round may take
    # on the wire: a codec for every leaf (none, fp16, bf16, int8) or a per-leaf policy
    # (adaptive: small and 1-D leaves fp16, matrices int8; averaging/leaf_codecs.py)
    codec: str = "fp16"
    on_no_group: Literal["local", "skip"] = "local"  # no group in time: step alone, or skip
    # Begin matchmaking when the ETA to the target is below what matchmaking takes, computing
    # on meanwhile; the round still averages only at the target (rounds/early.py). Off by
    # default: with it the capped soak's seeds split peers and left a joiner alone
    # (docs/decisions.md).
    match_early: bool = False
    # Seconds between a peer's checks, inside a micro-step, whether to average now
    # (CollaborationPeer.due; MID_STEP_POLL when unset). A peer that checks announces it in
    # its progress record; when every peer a round expects announces it, they notice the
    # target a poll apart, not a micro-step, and the round matchmakes quickly (rounds/stepping.py).
    mid_step_poll: float | None = None

    @property
    def poll(self) -> float:
        """The seconds between checks inside a micro-step of a peer that makes them."""
        return self.mid_step_poll or MID_STEP_POLL

    def __post_init__(self) -> None:
        if self.max_group_size < 1:
            raise ValueError("max_group_size must be at least 1")
        if self.codec not in COMPRESSIONS:
            raise ValueError(f"unknown codec {self.codec!r}; known: {list(COMPRESSIONS)}")
        _positive_when_set(self, "matchmaking_time", "averaging_timeout", "mid_step_poll")


@dataclass(frozen=True)
class LinkConfig(_Group):
    """What this peer's links carry (bytes/s), measured or set."""

    upload_bps: float | None = None  # override the measured bandwidth (bytes/s)
    download_bps: float | None = None
    # What an unmeasured link counts as (bytes/s; None: a 10 Mbit/s up, 25 Mbit/s down home
    # link): slow on purpose, so that deadlines assume a slow member until it is measured.
    unmeasured_upload_bps: float | None = None
    unmeasured_download_bps: float | None = None
    # Probe this peer's links (a few MB with a few peers) when it joins and when the figure
    # goes stale, so the first rounds split the work by measured rates.
    measure: bool = True
    probe_bytes: int = 4 << 20  # what a probe sends, and fetches (scaled down in simulations)

    def __post_init__(self) -> None:
        if self.probe_bytes < 1:
            raise ValueError("probe_bytes must be positive")
        _positive_when_set(
            self, "upload_bps", "download_bps", "unmeasured_upload_bps", "unmeasured_download_bps"
        )


@dataclass(frozen=True)
class ReachabilityConfig(_Group):
    """Whether others can dial us (the node's side is ``p2p.nat.NATConfig``)."""

    detect: bool = True  # detect reachability, use relays when behind NAT (p2p.nat)
    # With detect: ask the home router (NAT-PMP, PCP, UPnP IGD) to forward our port; a mapped
    # peer is reachable directly and serves as a node instead of going through a relay.
    port_mapping: bool = True


@dataclass(frozen=True)
class StateConfig(_Group):
    """How the training state is served to peers that load it."""

    chunk_bytes: int = 1 << 20


@dataclass(frozen=True)
class AccessConfig(_Group):
    """Private runs (dedloc_jax.access): the owner's raw Ed25519 public key, and this peer's
    invitation signed by it (Invitation.to_bytes). None: an open run."""

    owner_public_key: bytes | None = None
    invitation: bytes | None = None


@dataclass(frozen=True)
class DefenceConfig(_Group):
    """Against hostile peers."""

    # Reducers aggregate with CenteredClip instead of the plain weighted mean
    # (AllReduceConfig.robust), at this fixed L2 radius per chunk, or (None) one derived from
    # the parts. robust None: on in open runs, off in private ones.
    robust_tau: float | None = None
    robust: bool | None = None
    # Every member checks every reducer's result in its round and bans a caught liar with
    # evidence (dedloc_jax.averaging.audit, dedloc_jax.bans). None: on in open runs.
    verify: bool | None = None
    # Install the schemas of the run's DHT keys (dedloc_jax.validators): a record of another
    # shape is refused where it would be stored, with the reason told to its writer.
    record_schemas: bool = True

    def __post_init__(self) -> None:
        _positive_when_set(self, "robust_tau")


# The flat keyword names of old: (group, name in the group).
_MOVED: dict[str, tuple[str, str]] = {
    "max_group_size": ("rounds", "max_group_size"),
    "matchmaking_time": ("rounds", "matchmaking_time"),
    "averaging_timeout": ("rounds", "averaging_timeout"),
    "codec": ("rounds", "codec"),
    "on_no_group": ("rounds", "on_no_group"),
    "nat": ("reachability", "detect"),
    "port_mapping": ("reachability", "port_mapping"),
    "upload_bps": ("links", "upload_bps"),
    "download_bps": ("links", "download_bps"),
    "unmeasured_upload_bps": ("links", "unmeasured_upload_bps"),
    "unmeasured_download_bps": ("links", "unmeasured_download_bps"),
    "measure_links": ("links", "measure"),
    "probe_bytes": ("links", "probe_bytes"),
    "min_refresh": ("progress", "min_refresh"),
    "max_refresh": ("progress", "max_refresh"),
    "progress_ttl": ("progress", "ttl"),
    "idle_after": ("progress", "idle_after"),
    "idle_refresh": ("progress", "idle_refresh"),
    "idle_ttl": ("progress", "idle_ttl"),
    "extrapolate": ("progress", "extrapolate"),
    "state_chunk_bytes": ("state", "chunk_bytes"),
    "owner_public_key": ("access", "owner_public_key"),
    "invitation": ("access", "invitation"),
    "robust_tau": ("defence", "robust_tau"),
    "robust": ("defence", "robust"),
    "verify": ("defence", "verify"),
    "record_schemas": ("defence", "record_schemas"),
}


def _moved_message(old: list[str]) -> str:
    where = ", ".join(f"{o} -> {'.'.join(_MOVED[o])}" for o in old)
    return f"CollaborationConfig's flat settings are deprecated; set them in their group: {where}"


@dataclass(frozen=True, init=False)
class CollaborationConfig:
    """How a peer takes part in a collaboration: a few run-wide settings and one group per
    subsystem (``config.rounds.codec``, ``config.links.upload_bps``, ...).

    ``CollaborationConfig(codec="none")`` and the other flat names of old still work and emit
    one DeprecationWarning naming where each setting now lives.
    """

    # Samples per step. None (the default): the target given to ``collaborative(...,
    # target_batch_size=N)``; a peer that trains nothing (aux) follows the run's published one.
    # Set here, it must agree with the transform's (a ValueError names both otherwise).
    target_batch_size: int | None
    # The one place that says how this peer takes part: "node" (reachable, reduces), "client"
    # (dials out only, listens for nothing, reduces nothing), "aux" (trains nothing).
    # None: detect (client if unreachable).
    mode: Literal["node", "client", "aux"] | None
    rpc_timeout: float  # seconds one request to another peer may take (state, probes, reads)
    progress: ProgressConfig
    rounds: RoundConfig
    links: LinkConfig
    reachability: ReachabilityConfig
    state: StateConfig
    access: AccessConfig
    defence: DefenceConfig

    def __init__(
        self,
        target_batch_size: int | None = None,
        *,
        mode: Literal["node", "client", "aux"] | None = None,
        rpc_timeout: float = 10.0,
        progress: ProgressConfig = ProgressConfig(),
        rounds: RoundConfig = RoundConfig(),
        links: LinkConfig = LinkConfig(),
        reachability: ReachabilityConfig = ReachabilityConfig(),
        state: StateConfig = StateConfig(),
        access: AccessConfig = AccessConfig(),
        defence: DefenceConfig = DefenceConfig(),
        **flat: Any,
    ) -> None:
        groups: dict[str, Any] = {
            "progress": progress,
            "rounds": rounds,
            "links": links,
            "reachability": reachability,
            "state": state,
            "access": access,
            "defence": defence,
        }
        unknown = sorted(set(flat) - set(_MOVED))
        if unknown:
            raise TypeError(f"CollaborationConfig got unexpected keyword arguments {unknown}")
        if flat:
            warnings.warn(_moved_message(sorted(flat)), DeprecationWarning, stacklevel=2)
            for group in groups:
                moved = {_MOVED[o][1]: v for o, v in flat.items() if _MOVED[o][0] == group}
                if moved:
                    groups[group] = dataclasses.replace(groups[group], **moved)
        settings = dict(target_batch_size=target_batch_size, mode=mode, rpc_timeout=rpc_timeout)
        for name, value in (settings | groups).items():
            object.__setattr__(self, name, value)
        if self.target_batch_size is not None and self.target_batch_size <= 0:
            raise ValueError("target_batch_size must be positive")
        if self.mode not in (None, "node", "client", "aux"):
            raise ValueError(f"mode must be node, client, aux or None, got {self.mode!r}")

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: an old flat name, read from its group.
        if name in _MOVED:
            warnings.warn(_moved_message([name]), DeprecationWarning, stacklevel=2)
            group, field = _MOVED[name]
            return getattr(getattr(self, group), field)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def public(self) -> bool:
        """An open run (anyone may join), as opposed to a private one."""
        return self.access.owner_public_key is None

    @property
    def robust_on(self) -> bool:
        """Whether averages use CenteredClip (default: in open runs, or a radius is set)."""
        d = self.defence
        if d.robust is not None:
            return d.robust or d.robust_tau is not None
        return self.public or d.robust_tau is not None

    @property
    def verify_on(self) -> bool:
        """Whether rounds are verified (default: in open runs)."""
        return self.public if self.defence.verify is None else self.defence.verify

    def agreed_target(self, target: int) -> int:
        """``target`` (what ``collaborative`` was given) when this config names no other;
        ValueError naming both values otherwise."""
        if self.target_batch_size is not None and self.target_batch_size != target:
            raise ValueError(
                f"target_batch_size {target} given to collaborative() differs from "
                f"CollaborationConfig.target_batch_size {self.target_batch_size}: set one of them"
            )
        return target

    def replace(self, **changes: object) -> CollaborationConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def sahajbert(cls) -> CollaborationConfig:
        """The public sahajBERT run: 4096 samples per step, fp16 on the wire."""
        return cls(target_batch_size=4096)

    @classmethod
    def local_demo(cls, target_batch_size: int | None = 64) -> CollaborationConfig:
        """A few peers on one machine: small batches, quick refreshes, exact averages."""
        return cls(
            target_batch_size=target_batch_size,
            rounds=RoundConfig(codec="none"),
            progress=ProgressConfig(min_refresh=0.1, max_refresh=0.5, ttl=20.0),
        )
