from __future__ import annotations

import warnings

import pytest

from dedloc_jax.config import (
    CollaborationConfig,
    DefenceConfig,
    ProgressConfig,
    ReachabilityConfig,
    RoundConfig,
)

# Where each flat setting of old lives now.
PLACES = {
    "target_batch_size": "target_batch_size",
    "mode": "mode",
    "rpc_timeout": "rpc_timeout",
    "max_group_size": "rounds.max_group_size",
    "matchmaking_time": "rounds.matchmaking_time",
    "averaging_timeout": "rounds.averaging_timeout",
    "codec": "rounds.codec",
    "on_no_group": "rounds.on_no_group",
    "nat": "reachability.detect",
    "port_mapping": "reachability.port_mapping",
    "upload_bps": "links.upload_bps",
    "download_bps": "links.download_bps",
    "unmeasured_upload_bps": "links.unmeasured_upload_bps",
    "unmeasured_download_bps": "links.unmeasured_download_bps",
    "measure_links": "links.measure",
    "probe_bytes": "links.probe_bytes",
    "min_refresh": "progress.min_refresh",
    "max_refresh": "progress.max_refresh",
    "progress_ttl": "progress.ttl",
    "idle_after": "progress.idle_after",
    "idle_refresh": "progress.idle_refresh",
    "idle_ttl": "progress.idle_ttl",
    "extrapolate": "progress.extrapolate",
    "state_chunk_bytes": "state.chunk_bytes",
    "owner_public_key": "access.owner_public_key",
    "invitation": "access.invitation",
    "robust_tau": "defence.robust_tau",
    "robust": "defence.robust",
    "verify": "defence.verify",
    "record_schemas": "defence.record_schemas",
}

# The defaults, dumped from the flat CollaborationConfig before it was grouped.
FLAT_DEFAULTS = {
    "target_batch_size": None,
    "max_group_size": 64,
    "matchmaking_time": None,
    "averaging_timeout": None,
    "codec": "fp16",
    "mode": None,
    "nat": True,
    "port_mapping": True,
    "upload_bps": None,
    "download_bps": None,
    "unmeasured_upload_bps": None,
    "unmeasured_download_bps": None,
    "measure_links": True,
    "probe_bytes": 4 << 20,
    "min_refresh": 0.25,
    "max_refresh": 5.0,
    "progress_ttl": 60.0,
    "idle_after": 600.0,
    "idle_refresh": 60.0,
    "idle_ttl": 1800.0,  # 600 before issue 48 cut the DHT background (decisions.md)
    "extrapolate": True,
    "on_no_group": "local",
    "state_chunk_bytes": 1 << 20,
    "rpc_timeout": 10.0,
    "owner_public_key": None,
    "invitation": None,
    "robust_tau": None,
    "robust": None,
    "verify": None,
    "record_schemas": True,
}
DEMO = {"codec": "none", "min_refresh": 0.1, "max_refresh": 0.5, "progress_ttl": 20.0}


def _flat(config: CollaborationConfig) -> dict[str, object]:
    def read(path: str) -> object:
        value: object = config
        for part in path.split("."):
            value = getattr(value, part)
        return value

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new places only
        return {old: read(new) for old, new in PLACES.items()}


def test_every_flat_setting_has_one_place() -> None:
    assert set(PLACES) == set(FLAT_DEFAULTS)
    assert len(set(PLACES.values())) == len(PLACES)


@pytest.mark.parametrize(
    "preset, changes",
    [
        (CollaborationConfig, {}),
        (CollaborationConfig.sahajbert, {"target_batch_size": 4096}),
        (CollaborationConfig.local_demo, {**DEMO, "target_batch_size": 64}),
        (lambda: CollaborationConfig.local_demo(8), {**DEMO, "target_batch_size": 8}),
    ],
)
def test_presets_hold_what_they_held_before_grouping(preset, changes) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        config = preset()
    assert _flat(config) == FLAT_DEFAULTS | changes


def test_old_keyword_names_build_the_same_config_and_warn_once() -> None:
    changes = {
        "codec": "int8",
        "nat": False,
        "max_refresh": 2.0,
        "progress_ttl": 30.0,
        "measure_links": False,
        "robust_tau": 1.5,
        "state_chunk_bytes": 4096,
    }
    with pytest.warns(DeprecationWarning) as caught:
        old = CollaborationConfig(target_batch_size=32, **changes)
    assert len(caught) == 1
    message = str(caught[0].message)
    for name in changes:  # the warning names each new place
        assert f"{name} -> {PLACES[name]}" in message
    assert caught[0].filename == __file__  # it points at the caller
    assert _flat(old) == FLAT_DEFAULTS | changes | {"target_batch_size": 32}
    new = CollaborationConfig(
        target_batch_size=32,
        rounds=RoundConfig(codec="int8"),
        reachability=ReachabilityConfig(detect=False),
        progress=ProgressConfig(max_refresh=2.0, ttl=30.0),
        links=CollaborationConfig().links.replace(measure=False),
        defence=DefenceConfig(robust_tau=1.5),
        state=CollaborationConfig().state.replace(chunk_bytes=4096),
    )
    assert old == new


def test_old_names_merge_into_a_group_given_beside_them_and_into_replace() -> None:
    with pytest.warns(DeprecationWarning, match="codec -> rounds.codec"):
        config = CollaborationConfig(rounds=RoundConfig(max_group_size=4), codec="bf16")
    assert config.rounds == RoundConfig(max_group_size=4, codec="bf16")
    demo = CollaborationConfig.local_demo(32)
    with pytest.warns(DeprecationWarning, match="max_refresh -> progress.max_refresh"):
        changed = demo.replace(max_refresh=1.0)
    assert changed.progress == demo.progress.replace(max_refresh=1.0)
    assert changed.rounds == demo.rounds  # the other groups kept


def test_old_names_still_read_with_a_warning() -> None:
    config = CollaborationConfig.local_demo(32)
    with pytest.warns(DeprecationWarning, match="progress_ttl -> progress.ttl"):
        assert config.progress_ttl == 20.0
    with pytest.raises(AttributeError):
        config.no_such_setting  # noqa: B018
    with pytest.raises(TypeError, match="no_such_setting"):
        CollaborationConfig(no_such_setting=1)


def test_presets_and_validation() -> None:
    assert CollaborationConfig.sahajbert().target_batch_size == 4096
    demo = CollaborationConfig.local_demo(32)
    assert demo.target_batch_size == 32 and demo.rounds.codec == "none"
    assert demo.replace(rounds=RoundConfig(max_group_size=4)).rounds.max_group_size == 4
    assert demo.replace(mode="client").mode == "client"
    for bad in (
        lambda: CollaborationConfig(target_batch_size=0),
        lambda: CollaborationConfig(mode="server"),
        lambda: RoundConfig(max_group_size=0),
        lambda: RoundConfig(codec="zip"),
        lambda: ProgressConfig(min_refresh=2.0, max_refresh=1.0),
        lambda: RoundConfig(averaging_timeout=-1.0),
        lambda: DefenceConfig(robust_tau=0.0),
    ):
        with pytest.raises(ValueError):
            bad()


def test_client_mode_is_set_in_one_place() -> None:
    from dedloc_jax import Collaboration

    client = CollaborationConfig(mode="client")
    collab = Collaboration("run", config=client)
    assert collab.config.mode == "client" and collab._listen == []  # dials out only
    with pytest.raises(ValueError, match="announces nothing"):
        Collaboration("run", config=client, announce=["/ip4/1.2.3.4/tcp/5"])
    with pytest.warns(DeprecationWarning, match='config.mode="client"'):
        old = Collaboration("run", client_mode=True)
    assert old.config == client and old._listen == []
    assert Collaboration("run").config.mode is None  # detected at run time, as before
