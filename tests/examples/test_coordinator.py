"""The coordinator's poll loop against a scripted collaboration: it checkpoints the run's last
epoch even after the estimate fell back (the trainers left), downloads only what is newer
than its last checkpoint, and gives up with a clear error instead of waiting forever."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from dedloc_jax import CollaborationEstimate
from examples.sahajbert import coordinator as coordinator_mod
from examples.sahajbert.config import NetConfig, TrainerConfig
from examples.sahajbert.coordinator import Coordinator, CoordinatorOptions, FinalStateMissing
from p2p.dht import owner_marker
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(60)  # a coordinator that never gives up would loop forever


class _DHT:
    peer_id = Identity.generate().peer_id

    async def get(self, key: str, **_: Any) -> None:
        return None

    async def store(self, *_: Any, **__: Any) -> bool:
        return True

    def now(self) -> float:
        return 0.0


class _Tracker:
    served = None  # (epoch, digest, lineage) of the state the coordinator serves

    def announcements(self) -> list:
        return []


class _Core:
    run_id = "test"
    dht = _DHT()
    tracker = _Tracker()


class ScriptedCollab:
    """Each poll reads the next estimate epoch and the next newest served epoch (the last one
    repeats); a download returns the state of the newest served epoch."""

    def __init__(self, estimates: list[int], served: list[int | None]) -> None:
        self._estimates = _repeat_last(estimates)
        self._served = _repeat_last(served)
        self.newest: int | None = None
        self.downloads: list[int] = []
        self.shared: list[int] = []

    @property
    def estimate(self) -> CollaborationEstimate:
        return CollaborationEstimate(
            epoch=next(self._estimates), samples=0.0, samples_per_second=0.0, eta=0.0,
            num_peers=0, num_clients=0, target=96,
        )  # fmt: skip

    def run_async(self, async_fn: Any, *args: Any) -> Any:
        import trio

        return trio.run(async_fn, _Core(), *args)

    def newest_state_epoch(self) -> int | None:
        self.newest = next(self._served)
        return self.newest

    def banned_peers(self) -> list[dict]:
        return [{"peer": "liar", "role": "reducer", "reason": "lied", "verified": True}]

    def load_state(self, *, timeout: float = 60.0) -> tuple[int, list[np.ndarray]]:
        assert self.newest is not None
        self.downloads.append(self.newest)
        return self.newest, [np.full(3, float(self.newest), np.float32)]

    def share_state(self, arrays: Any, epoch: int) -> None:
        self.shared.append(epoch)


def _repeat_last(values: list) -> Iterator:
    yield from values
    while True:
        yield values[-1]


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """Checkpoints the coordinator saves: (epoch, the value of the saved array)."""
    calls: list[tuple[int, float]] = []

    def save(directory: Path, epoch: int, flat: dict, *_: Any) -> Path:
        calls.append((epoch, float(next(iter(flat.values()))[0])))
        return directory / f"epoch_{epoch}"

    monkeypatch.setattr(coordinator_mod.checkpoint, "save_checkpoint", save)
    return calls


def _coordinator(tmp_path: Path, **opts: Any) -> Coordinator:
    defaults = {"checkpoint_every": 2, "poll_interval": 0.0, "exit_after_epoch": 4}
    options = CoordinatorOptions(out_dir=tmp_path, **{**defaults, **opts})
    coord = Coordinator(TrainerConfig.demo(tmp_path), NetConfig(), options)
    coord.template = ({"w": jnp.zeros(3, jnp.float32)}, ())
    coord.model_cfg = None
    return coord


class _Dash:
    url = "http://127.0.0.1:1/"
    status: dict = {}


def test_the_last_epoch_is_saved_after_the_estimate_fell_back(tmp_path, saved) -> None:
    # The run reaches epoch 4 while the trainers still serve epoch 3, then the estimate falls
    # back to 2 (as when they leave); the state of epoch 4 shows up two polls later.
    collab = ScriptedCollab(estimates=[2, 4, 2], served=[2, 3, 3, 4])
    status = _coordinator(tmp_path)._poll(collab, _Dash(), [])
    assert [epoch for epoch, _ in saved] == [2, 3, 4]
    assert saved[-1][1] == 4.0  # the downloaded state, not the template
    assert status["checkpoint_epoch"] == 4
    assert [b["peer"] for b in status["banned"]] == ["liar"]  # status.json lists the banned
    # epoch 3, served on two polls, was downloaded once
    assert collab.downloads == [2, 3, 4]
    assert len(collab.shared) == 3  # and serves each checkpoint


def test_without_the_last_state_it_gives_up_with_a_clear_error(tmp_path, saved) -> None:
    collab = ScriptedCollab(estimates=[4, 3], served=[3])
    coord = _coordinator(tmp_path, final_wait=0.3)
    with pytest.raises(FinalStateMissing, match="reached epoch 4.*newest checkpoint is of epoch 3"):
        coord._poll(collab, _Dash(), [])
    assert [epoch for epoch, _ in saved] == [3]
    assert collab.downloads == [3]


# ---- hostile metrics records --------------------------------------------------------------------
class _MetricsDHT(_DHT):
    def __init__(self, value: dict) -> None:
        self.value = value

    async def get(self, key: str, **_: Any) -> Any:
        return self.value if key.endswith(".metrics") else None


class MetricsCollab(ScriptedCollab):
    """A run at epoch 4 whose DHT holds the given metrics records (subkey -> value)."""

    def __init__(self, value: dict) -> None:
        super().__init__(estimates=[4], served=[4])
        self.core = _Core()
        self.core.dht = _MetricsDHT(value)

    def run_async(self, async_fn: Any, *args: Any) -> Any:
        import trio

        return trio.run(async_fn, self.core, *args)


def _honest() -> dict:
    from examples.sahajbert.metrics import EpochFigures, PeerMetrics
    from p2p.dht import owner_marker
    from p2p.identity import Identity

    out = {}
    for i, (loss, rate) in enumerate([(7.0, 10.0), (7.2, 12.0), (7.4, 8.0)]):
        peer = Identity.from_seed(b"honest-%d" % i).peer_id
        history = tuple(EpochFigures(e, loss - 0.1 * e, 32, 3.0 + i) for e in range(4))
        rec = PeerMetrics(str(peer), 4, history[-1].loss, rate, 16, 128, "node", history=history)
        out[owner_marker(peer)] = rec.to_record()
    return out


def _rows(tmp_path: Path, value: dict) -> tuple[list[dict], dict]:
    coord = _coordinator(tmp_path)
    status = coord._poll(MetricsCollab(value), _Dash(), [])
    return [{k: v for k, v in r.items() if k != "time"} for r in coord.table.rows], status


HOSTILE = {
    "epoch inf": {"epoch": math.inf},
    "epoch huge": {"epoch": 1 << 62},
    "epoch text": {"epoch": "4"},
    "epoch bool": {"epoch": True},
    "loss -1e30": {"loss": -1e30, "history": [[3, -1e30, 32, 3.0]]},
    "samples 1e15": {"samples": 1e15, "history": [[3, 7.0, 10**15, 3.0]]},
    "history loss inf": {"history": [[3, math.inf, 32, 3.0]]},
    "diverged text": {"diverged": "3"},
    "history inf seconds": {"history": [[3, 7.0, 32, math.inf]]},
    "history too long": {"history": [[e, 7.0, 32, 3.0] for e in range(100)]},
    "script mode": {"mode": "<img src=x onerror=alert(1)>"},
    "rate inf": {"samples_per_second": math.inf},
    "wrong shape": {"history": {"3": "x"}},
}


def test_hostile_metrics_records_leave_the_rows_unchanged(tmp_path, saved, caplog) -> None:
    """Signed records each with one bad field (an ``epoch = inf`` made the coordinator exit
    with OverflowError) are dropped and logged; the coordinator runs to its last epoch and
    writes exactly the rows of the honest peers."""
    from p2p.dht import owner_marker
    from p2p.identity import Identity

    honest = _honest()
    expected, _ = _rows(tmp_path / "honest", honest)
    good = next(iter(honest.values()))
    liars = {owner_marker(Identity.from_seed(name.encode()).peer_id): name for name in HOSTILE}
    value = {**honest, **{m: {**good, **HOSTILE[name]} for m, name in liars.items()}}
    rows, status = _rows(tmp_path / "hostile", value)
    assert rows == expected and len(rows) == 4
    assert len(status["peers"]) == 3  # only the honest ones
    dropped = {r.args[0] for r in caplog.records if "dropping the metrics" in r.getMessage()}
    assert len(dropped) == len(HOSTILE)  # each liar logged


def test_a_diverged_run_shows_as_diverged_with_its_peers(tmp_path, saved, caplog) -> None:
    """A trainer that found the run diverged publishes a record whose last epoch has no loss
    (NaN) and which says at which epoch: the coordinator counts the peer (it dropped every
    such record before, "history loss nan is outside [0, 10000]", and showed 0 peers), logs an
    ERROR and shows the run as diverged in status.json, also once the record has lapsed."""
    honest = _honest()
    marker = next(iter(honest))
    record = honest[marker]
    record["history"][-1][1] = math.nan
    honest[marker] = {**record, "loss": math.nan, "diverged": 3}
    coord = _coordinator(tmp_path)
    status = coord._poll(MetricsCollab(honest), _Dash(), [])
    assert len(status["peers"]) == 3
    assert status["state"] == "diverged"
    (peer,) = [p["peer"] for p in status["peers"] if math.isnan(p["loss"])]
    assert status["diverged"] == {"epoch": 3, "peers": [peer]}
    assert any(
        r.levelname == "ERROR" and "diverged at epoch 3" in r.getMessage() for r in caplog.records
    )
    # epoch 3's row: the median of the other two peers' losses (6.9 and 7.1)
    assert coord.table.rows[-1]["epoch"] == 3
    assert coord.table.rows[-1]["loss"] == pytest.approx(7.0)
    lapsed = coord._status({}, MetricsCollab({}).estimate, "", [])
    assert lapsed["state"] == "diverged" and lapsed["diverged"]["peers"] == [peer]


def test_one_lying_peer_cannot_move_the_epoch_rows(tmp_path, saved) -> None:
    """A liar within every bound (loss 9,999, 10^12 samples, an epoch of 10^7 s): each row
    stays inside what the honest peers reported."""
    from p2p.dht import owner_marker
    from p2p.identity import Identity

    honest = _honest()
    expected, _ = _rows(tmp_path / "honest", honest)
    good = next(iter(honest.values()))
    lies = {**good, "history": [[e, 9999.0, 10**12, 1e7] for e in range(4)]}
    liar = owner_marker(Identity.from_seed(b"liar").peer_id)
    rows, _ = _rows(tmp_path / "liar", {**honest, liar: lies})
    target = TrainerConfig.demo(tmp_path).target_batch_size
    for row, ref in zip(rows, expected, strict=True):
        losses = [7.0 - 0.1 * row["epoch"], 7.4 - 0.1 * row["epoch"]]
        assert losses[0] - 1e-9 <= row["loss"] <= losses[1] + 1e-9
        assert 3.0 <= row["seconds"] <= 5.0  # the honest peers' 3, 4 and 5 s
        assert ref["samples"] <= row["samples"] <= ref["samples"] + 2 * target
        assert row["peers"] == 4


def test_an_epoch_of_lone_steps_on_two_lineages_says_so(tmp_path, saved) -> None:
    """Two trainers that each stepped alone in epoch 2 (issue 45: the row read "peers 2,
    samples 192" like an averaged epoch) give a row with lone 2, lineages 2; the epochs they
    averaged say lone 0, lineages 1; a trainer that says nothing leaves both unknown."""
    from examples.sahajbert.metrics import EpochFigures, PeerMetrics

    value = {}
    for i in range(2):
        peer = Identity.from_seed(b"pair-%d" % i).peer_id
        history = tuple(
            EpochFigures(e, 7.0, 48, 3.0, *((1, f"{i + 1:016x}") if e == 2 else (2, "0" * 16)))
            for e in range(4)
        )
        rec = PeerMetrics(str(peer), 4, 7.0, 10.0, 16, 192, "node", history=history)
        value[owner_marker(peer)] = rec.to_record()
    rows, _ = _rows(tmp_path / "pair", value)
    assert [(r["epoch"], r["peers"], r["lone"], r["lineages"]) for r in rows] == [
        (0, 2, 0, 1), (1, 2, 0, 1), (2, 2, 2, 2), (3, 2, 0, 1),
    ]  # fmt: skip
    header, *lines = (tmp_path / "pair" / "metrics.csv").read_text().splitlines()
    assert "lone" in header.split(",") and "lineages" in header.split(",")
    older, _ = _rows(tmp_path / "older", _honest())  # records without "stepped"
    assert all(r["lone"] is None and r["lineages"] is None for r in older)


def test_a_checkpoint_names_the_lineage_of_the_state_it_saved() -> None:
    """The coordinator's copy names no ancestors of its own: the checkpoint takes those the
    trainers serving the same state announce."""
    import trio

    from dedloc_jax.state import Announcement
    from examples.sahajbert.checkpoint import served_lineage

    a, b, c = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32

    class Tracker:
        served = (5, a, ())

        def announcements(self) -> list:
            return [Announcement("t1", 5, a, (b, c)), Announcement("t2", 5, c, (b,))]

    class Core:
        tracker = Tracker()

    got = trio.run(served_lineage, Core())
    assert got == {"digest": a.hex(), "lineage": [b.hex(), c.hex()]}
    Core.tracker.served = None
    assert trio.run(served_lineage, Core()) == {}


def test_the_coordinator_warns_of_peers_that_republish_another_manifest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trainers serve the manifest on; one that serves another (another tokenizer, a forged
    or garbled envelope) is named in a WARNING with the digest it serves, once, and in the
    status; the coordinator serves only its own."""
    from examples.sahajbert import manifest

    cfg = TrainerConfig().replace(model="tiny", run_id="test", seq_length=32)
    ours = manifest.build(cfg, Path(__file__), 900, "none")
    owner, rogue = Identity.generate(), Identity.generate()
    envelope = manifest.sign(ours, owner)
    other = manifest.build(cfg.replace(seq_length=64), Path(__file__), 900, "none")
    honest, liar, garbler = (Identity.generate().peer_id for _ in range(3))
    slots = {
        owner_marker(honest): envelope,  # republished unchanged
        owner_marker(liar): manifest.sign(other, rogue),
        owner_marker(garbler): {"manifest": b"<script>", "signer": b"x", "signature": b"y"},
        "no-owner-marker": manifest.sign(other, rogue),  # not a peer's slot: ignored
    }

    class _ManifestDHT(_DHT):
        async def get(self, key: str, **_: Any) -> Any:
            return slots if key == manifest.manifest_key("test") else None

    class _Collab:
        def run_async(self, async_fn: Any, *args: Any) -> Any:
            import trio

            core = _Core()
            core.dht = _ManifestDHT()
            return trio.run(async_fn, core, *args)

    coord = Coordinator(cfg, NetConfig(), CoordinatorOptions(out_dir=tmp_path))
    coord.manifest, coord.envelope = ours, envelope
    with caplog.at_level("WARNING", logger="examples.sahajbert.coordinator"):
        coord._check_manifests(_Collab())
        coord._check_manifests(_Collab())  # the same again: no second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings
    (about_liar,) = [w for w in warnings if str(liar) in w]
    assert other.digest in about_liar and ours.digest in about_liar
    assert f"signed by {rogue.peer_id}" in about_liar
    (about_garbler,) = [w for w in warnings if str(garbler) in w]
    assert "signature" in about_garbler
    assert not any(str(honest) in w for w in warnings)
    assert coord.manifest_conflicts[str(liar)] == other.digest
    assert set(coord.manifest_conflicts) == {str(liar), str(garbler)}
    # the liar comes back to the run's manifest: no longer listed
    slots[owner_marker(liar)] = envelope
    coord._check_manifests(_Collab())
    assert set(coord.manifest_conflicts) == {str(garbler)}


def test_live_figures_are_the_trainers_throughput_while_they_average(tmp_path) -> None:
    """While every trainer averages, the tracker's estimate reads 0 samples/s and ETA 0; the
    status shows what the trainers measured (~130 samples/s) and the ETA it gives, and each
    peer's traffic apart from its link capacity."""
    from examples.sahajbert.metrics import PeerMetrics

    coord = _coordinator(tmp_path)
    records = {
        p: PeerMetrics(
            peer=p,
            epoch=5,
            loss=6.0,
            samples_per_second=rate,
            micro_steps=10,
            samples=160,
            mode=mode,
            upload_bps=3e8,
            sent_bps=2.5e5,
        )  # fmt: skip
        for p, rate, mode in [("a", 60.0, "node"), ("b", 70.0, "client"), ("c", 0.0, "aux")]
    }
    est = CollaborationEstimate(
        epoch=5, samples=31.0, samples_per_second=0.0, eta=0.0, num_peers=3, num_clients=1,
        target=96,
    )  # fmt: skip
    status = coord._status(records, est, "http://x/", [])
    assert status["estimate"]["samples_per_second"] == 130.0
    assert status["estimate"]["eta"] == pytest.approx((96 - 31) / 130)
    assert status["target"] == coord.cfg.collaboration_target == 96
    assert (status["mode"], status["compression"]) == ("dedloc", "none")  # the tiny preset's
    assert status["topk"] is None
    # a TopK DiLoCo run: the status names topk and its settings (not the unused codec)
    coord.cfg = coord.cfg.replace(mode="diloco", compression="topk", topk_bits=3)
    status = coord._status(records, est, "http://x/", [])
    assert status["compression"] == "topk"
    assert status["topk"] == {"density": 1 / 64, "bits": 3, "error_feedback": 0.95}
    peer = status["peers"][0]
    assert (peer["sent_bps"], peer["upload_bps"]) == (2.5e5, 3e8)


# ---- trainers that stop (--max-epochs) ------------------------------------------------------
class _Polled(Exception):
    """Ends a poll loop that has no last epoch after a few polls."""


class StoppingCollab(MetricsCollab):
    """A run at epoch 5 whose trainers serve its state; ``stopped`` says which of them say
    they stopped there. The loop ends after ``polls`` polls."""

    def __init__(self, stopped: list[bool], polls: int = 5) -> None:
        from examples.sahajbert.metrics import PeerMetrics

        value = {}
        for i, stop in enumerate(stopped):
            peer = Identity.from_seed(b"stopping-%d" % i).peer_id
            rec = PeerMetrics(str(peer), 5, 6.5, 10.0, 40, 640, "node", stopped=5 if stop else None)
            value[owner_marker(peer)] = rec.to_record()
        super().__init__(value)
        self._estimates = _repeat_last([5])
        self._served = _repeat_last([5])
        self.polls = polls

    @property
    def estimate(self) -> CollaborationEstimate:
        self.polls -= 1
        if self.polls < 0:
            raise _Polled
        return super().estimate


@pytest.mark.parametrize(
    ("stopped", "expected"),
    [([True, True], [5]), ([True, True, False], [5]), ([True, False, False], [])],
    ids=["all", "most", "one of three"],
)
def test_the_state_is_saved_when_most_trainers_stop(tmp_path, saved, stopped, expected) -> None:
    """Trainers given ``--max-epochs 5`` stop there and serve their state until it is saved;
    a coordinator that checkpoints every 10 epochs and has no --max-epochs of its own saved
    nothing, and the trainers waited two minutes for it in silence. Now it saves the state
    once more than half of the trainers say they stopped; one peer of three (a liar, or a
    volunteer leaving a run that goes on) makes it save nothing."""
    coord = _coordinator(tmp_path, exit_after_epoch=None, checkpoint_every=10)
    with pytest.raises(_Polled):
        coord._poll(StoppingCollab(stopped), _Dash(), [])
    assert [epoch for epoch, _ in saved] == expected


def test_a_stop_claim_ahead_of_the_run_waits_for_it(tmp_path, saved) -> None:
    """Trainers that claim to have stopped at an epoch the run has not reached (epoch 10**9)
    make the coordinator save nothing until the run is there."""
    collab = StoppingCollab([True, True])
    for key, value in collab.core.dht.value.items():
        collab.core.dht.value[key] = {**value, "stopped": 10**9}
    coord = _coordinator(tmp_path, exit_after_epoch=None, checkpoint_every=10)
    coord.last_checkpoint = (5, tmp_path / "epoch_5")
    with pytest.raises(_Polled):
        coord._poll(collab, _Dash(), [])
    assert saved == [] and collab.newest is None  # not even asked for the newest state


class _LaggingCollab(StoppingCollab):
    """Both trainers stopped at 5; the coordinator's view (and the newest state served)
    reaches 5 one poll after their stop claims."""

    def __init__(self) -> None:
        super().__init__([True, True], polls=3)
        self._estimates = _repeat_last([4, 5])
        self._seen = 0

    @property
    def estimate(self) -> CollaborationEstimate:
        est = super().estimate
        self._seen = est.epoch
        return est

    def newest_state_epoch(self) -> int | None:
        self.newest = self._seen
        return self.newest


def test_a_stop_claim_one_poll_ahead_of_the_view_saves_only_the_stop_epoch(tmp_path, saved) -> None:
    """The README's one-machine try saved epoch_000029 beside _000030: the trainers' stop
    claims (30) came while the coordinator still saw epoch 29, and it saved what it saw. It
    waits for the epoch they stopped at."""
    coord = _coordinator(tmp_path, exit_after_epoch=None, checkpoint_every=10)
    with pytest.raises(_Polled):
        coord._poll(_LaggingCollab(), _Dash(), [])
    assert [epoch for epoch, _ in saved] == [5]
