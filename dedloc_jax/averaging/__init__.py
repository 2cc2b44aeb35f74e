"""Bandwidth-proportional butterfly all-reduce of gradient pytrees (DeDLOC's averaging).

Usage: build a :class:`GroupSpec` (matchmaking does it), one :class:`AveragingService` per node
before the round (it registers the handlers), then ``await all_reduce(service, spec, grads,
weight=samples)``.
"""

from .bandwidth import (
    BandwidthMeter,
    Gauge,
    LinkFigures,
    LinkLocks,
    install_probe,
    measure_links,
    probe,
)
from .butterfly import AllReduceResult, AveragingService, ShareResult, all_reduce
from .chunk_codecs import CODECS, Codec, get_codec
from .config import AllReduceConfig
from .errors import (
    AllReduceError,
    AveragingError,
    BadContributionError,
    CodecError,
    GroupError,
    LoadBalancingError,
    PartitionError,
    ShareLostError,
)
from .group import GroupSpec, Member
from .load_balancing import ShareSolution, equal_split, predicted_time, solve_shares
from .partition import TreeSpec, flatten, unflatten

__all__ = [
    "CODECS",
    "AllReduceConfig",
    "AllReduceError",
    "AllReduceResult",
    "AveragingError",
    "AveragingService",
    "BadContributionError",
    "BandwidthMeter",
    "Codec",
    "Gauge",
    "CodecError",
    "GroupError",
    "GroupSpec",
    "LoadBalancingError",
    "LinkFigures",
    "LinkLocks",
    "Member",
    "PartitionError",
    "ShareLostError",
    "ShareResult",
    "ShareSolution",
    "TreeSpec",
    "all_reduce",
    "equal_split",
    "flatten",
    "get_codec",
    "install_probe",
    "measure_links",
    "predicted_time",
    "probe",
    "solve_shares",
    "unflatten",
]
