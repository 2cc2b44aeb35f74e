"""``dedloc_jax.__all__`` is the user API: what users call is there, the machinery is not."""

from __future__ import annotations

import dedloc_jax

# The names the README and the examples call; each must stay importable from dedloc_jax.
USER_NAMES = {
    "AccessConfig",
    "Collaboration",
    "CollaborationConfig",
    "DefenceConfig",
    "LinkConfig",
    "ProgressConfig",
    "ReachabilityConfig",
    "RoundConfig",
    "StateConfig",
    "KeepConfig",
    "RoundOutcome",
    "StaleStateError",
    "StateSyncError",
    "collaborative",
    "diloco",
    "keep_in_step",
    "share_state",
    "sync_state",
}

# Internals that once sat beside them: reached through their own modules now.
INTERNAL_NAMES = {
    "CollaborationCore",
    "CollaborationPeer",
    "Matchmaker",
    "Member",
    "StateServer",
    "average_round",
    "install",
    "open_collaboration",
    "solve_shares",
}


def test_the_user_api_is_exported_and_importable() -> None:
    exported = set(dedloc_jax.__all__)
    assert exported >= USER_NAMES, USER_NAMES - exported
    for name in exported:
        assert getattr(dedloc_jax, name) is not None, name


def test_no_internal_name_is_exported() -> None:
    assert not INTERNAL_NAMES & set(dedloc_jax.__all__)
