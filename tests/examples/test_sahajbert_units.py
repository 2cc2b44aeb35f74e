"""Pure pieces of examples.sahajbert: metrics records, epoch rows, scoring, options, dashboard."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from dedloc_jax import CollaborationEstimate
from examples.sahajbert import metrics
from examples.sahajbert.__main__ import build_parser, main, parse_args, trainer_config
from examples.sahajbert.config import OptimizerConfig, TrainerConfig
from examples.sahajbert.dashboard import Dashboard, clean_json
from examples.sahajbert.finetune import entity_spans, f1_score
from examples.sahajbert.training import schedule, weight_decay_mask
from p2p.identity import Identity


def _record(peer: str, epoch: int, history: list[tuple[int, float, int]]) -> metrics.PeerMetrics:
    return metrics.PeerMetrics(
        peer=peer,
        epoch=epoch,
        loss=history[-1][1] if history else math.nan,
        samples_per_second=10.0,
        micro_steps=5,
        samples=40,
        mode="node",
        history=tuple(metrics.EpochFigures(e, loss, s, 2.0) for e, loss, s in history),
    )


def test_metrics_record_round_trip_and_rejects_garbage() -> None:
    rec = _record("peerA", 3, [(1, 7.5, 32), (2, 7.25, 40)])
    wire = rec.to_record()
    assert "peer" not in wire  # the signed subkey names the peer
    assert metrics.PeerMetrics.from_record("peerA", wire) == rec
    for bad in (None, [], {"epoch": 1}, {**wire, "epoch": -1}, {**wire, "history": [[1, 2]]}):
        with pytest.raises(ValueError):
            metrics.PeerMetrics.from_record("peerA", bad)


def test_parse_records_keeps_only_owner_signed_slots() -> None:
    good = _record("x", 1, [(0, 7.0, 8)]).to_record()
    value = {"[owner:3mAbc]": good, "unsigned": good, "[owner:3mDef]": {"epoch": "?"}}
    parsed = metrics.parse_records(value)
    assert list(parsed) == ["3mAbc"]
    assert parsed["3mAbc"].epoch == 1


def test_epoch_table_takes_median_loss_and_writes_each_epoch_once() -> None:
    table = metrics.EpochTable(target_batch_size=64)
    a = _record("a", 2, [(0, 8.0, 30), (1, 6.0, 10)])
    b = _record("b", 1, [(0, 4.0, 10)])
    c = _record("c", 1, [(0, 5.0, 20)])
    table.add({"a": a, "b": b, "c": c}, now=1.0)
    rows = table.ready(2)  # all trainers are past epoch 0; b and c have not published epoch 1
    assert [r["epoch"] for r in rows] == [0] and table.rows == rows
    assert rows[0]["loss"] == 5.0  # the median, whatever a's samples say
    assert rows[0]["samples"] == 60 and rows[0]["peers"] == 3
    b = _record("b", 2, [(0, 4.0, 10), (1, 6.0, 30)])
    c = _record("c", 2, [(0, 5.0, 20), (1, 7.0, 30)])
    table.add({"a": a, "b": b, "c": c}, now=2.0)  # the same epoch-0 figures again: no new row
    rows = table.ready(2)
    assert [r["epoch"] for r in rows] == [1] and rows[0]["peers"] == 3
    assert rows[0]["loss"] == 6.0
    assert [r["epoch"] for r in table.rows] == [0, 1] and table.flush() == []


def test_epoch_table_caps_one_peers_samples_and_drops_far_future_epochs() -> None:
    table = metrics.EpochTable(target_batch_size=64)
    honest = _record("a", 2, [(0, 7.0, 40), (1, 7.0, 40)])
    greedy = _record("b", 2, [(0, 7.0, 10**12), (1, 7.0, 40), (90, 7.0, 40)])
    table.add({"a": honest, "b": greedy}, now=1.0)
    rows = table.ready(2)
    assert [r["epoch"] for r in rows] == [0, 1]  # epoch 90 is far past the run's 2: dropped
    assert rows[0]["samples"] == 40 + 2 * 64  # b counts at most twice the target batch
    assert table.flush() == []


def test_metrics_record_fields_are_typed_and_bounded() -> None:
    wire = _record("peerA", 3, [(1, 7.5, 32), (2, 7.25, 40)]).to_record()
    for field, bad in [
        ("epoch", math.inf), ("epoch", 2.0), ("epoch", True), ("epoch", 10**12),
        ("loss", -1e30), ("loss", math.inf), ("loss", "7"),
        ("samples", 1e15), ("samples", 10**15), ("micro_steps", -1),
        ("samples_per_second", math.nan), ("samples_per_second", 1e30),
        ("upload_bps", -1.0), ("download_bps", math.inf), ("time", math.nan),
        ("devices", 0), ("mode", "<script>x</script>"), ("mode", "NODE"), ("mode", None),
        ("history", [[1, 7.5, 32, 2.0]] * 2), ("history", [[1, 7.5, 32]]),
        ("history", [[e, 7.0, 1, 1.0] for e in range(metrics.HISTORY + 1)]),
        ("history", [[1, math.inf, 32, 2.0]]), ("history", [[1, 7.0, 32, -1.0]]),
        ("history", "[]"), ("diverged", -1), ("diverged", 2.5), ("diverged", "3"),
        ("stopped", -1), ("stopped", 10**12), ("stopped", "3"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=field.split("_")[0]):
            metrics.PeerMetrics.from_record("peerA", {**wire, field: bad})
    # no loss yet (before the first epoch) is NaN, and that is allowed
    assert math.isnan(metrics.PeerMetrics.from_record("peerA", {**wire, "loss": math.nan}).loss)
    # so is an epoch without a figure (a diverged one), and the epoch the run diverged at
    diverged = {**wire, "history": [[2, math.nan, 40, 2.0]], "diverged": 2}
    parsed = metrics.PeerMetrics.from_record("peerA", diverged)
    assert parsed.diverged == 2 and math.isnan(parsed.history[0].loss)
    again = metrics.PeerMetrics.from_record("peerA", parsed.to_record())
    assert again.diverged == 2 and math.isnan(again.history[0].loss)
    assert "diverged" not in _record("peerA", 3, []).to_record()  # absent while training
    assert "stopped" not in _record("peerA", 3, []).to_record()
    stopped = replace(_record("peerA", 3, []), stopped=3)
    assert metrics.PeerMetrics.from_record("peerA", stopped.to_record()).stopped == 3


_PEER = Identity.generate().peer_id


class _StoppedCollab:
    """What a stopped trainer's ``_linger`` touches: a DHT with no checkpoint announced, whose
    stores of our metrics record are kept."""

    peer_id, mode, links = "peerA", "node", {"upload_bps": None, "download_bps": None}

    def __init__(self, run_epoch: int) -> None:
        self.stored: list[dict] = []
        self.left = False  # told the run it averages no more
        self.estimate = CollaborationEstimate(
            epoch=run_epoch, samples=0.0, samples_per_second=0.0, eta=0.0, num_peers=2,
            num_clients=0, target=96,
        )  # fmt: skip

    def traffic(self) -> tuple[int, int]:
        return 0, 0

    def now(self) -> float:
        return 0.0

    def run_async(self, fn, *args):
        import trio

        outer = self

        class DHT:
            peer_id = _PEER

            async def get(self, key: str):
                return None

            async def store(self, key, value, expiry, subkey=None):
                outer.stored.append(value)

            def now(self) -> float:
                return 0.0

        class Core:
            run_id, dht = "run", DHT()

            async def leave(self) -> None:
                outer.left = True

        return trio.run(fn, Core(), *args)


def test_a_stopped_trainer_says_what_it_waited_for_and_why_it_left(caplog) -> None:
    """A trainer past its --max-epochs serves its state until the coordinator saved it. It left
    after two minutes without a word when no save came; now its record says it stopped (so
    that the coordinator saves that epoch), and giving up is one WARNING naming the epoch and
    when a coordinator saves."""
    import time

    from examples.sahajbert import trainer

    collab = _StoppedCollab(run_epoch=3)
    tally = trainer._Tally(collab, 1, 3, time.monotonic() - 60)
    tally.meter.rate = 50.0
    tally.stopped = 3
    with caplog.at_level("INFO", logger="examples.sahajbert.trainer"):
        assert trainer._linger(collab, 3, 0.2, tally) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "did not save epoch 3" in warning and "--checkpoint-every" in warning, warning
    assert collab.stored, "the record saying it stopped was not republished"
    record = metrics.PeerMetrics.from_record("peerA", collab.stored[-1])
    assert (record.stopped, record.samples_per_second) == (3, 0.0)  # stopped: computes nothing
    # A peer that trains on expected it in its next round, waited 10 s and warned that it
    # "stepped without the whole collaboration": its progress record says it left.
    assert collab.left
    # a volunteer leaving a run that goes on: its state is no run's last copy, it just leaves
    caplog.clear()
    with caplog.at_level("INFO", logger="examples.sahajbert.trainer"):
        assert trainer._linger(_StoppedCollab(run_epoch=4), 3, 60.0, tally) is None
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("went on past epoch 3" in r.getMessage() for r in caplog.records)


def test_epoch_table_waits_for_a_silent_peer_only_a_few_epochs() -> None:
    table = metrics.EpochTable(target_batch_size=64)
    live = _record("a", 5, [(e, 7.0, 16) for e in range(5)])
    stale = _record("b", 1, [(0, 7.0, 16)])  # b died in epoch 1; its record has not expired
    aux = replace(_record("c", 0, []), mode="aux")  # the coordinator trains nothing
    table.add({"a": live, "b": stale, "c": aux}, now=1.0)
    assert [r["epoch"] for r in table.ready(5)] == [0, 1, 2]  # 3, 4: b might still report
    table.add({}, now=2.0)  # a failed read changes nothing
    assert table.ready(5) == []
    assert [r["epoch"] for r in table.ready(7)] == [3, 4]
    assert [r["peers"] for r in table.rows] == [2, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("tags", "spans"),
    [
        (["B-PER", "I-PER", "O", "B-LOC"], {(0, 2, "PER"), (3, 4, "LOC")}),
        (["I-ORG", "I-ORG", "O"], {(0, 2, "ORG")}),  # I- after O opens a chunk (conlleval)
        (["B-PER", "I-LOC"], {(0, 1, "PER"), (1, 2, "LOC")}),
        (["B-PER", "B-PER"], {(0, 1, "PER"), (1, 2, "PER")}),
        (["O", "O"], set()),
    ],
)
def test_entity_spans(tags: list[str], spans: set) -> None:
    assert entity_spans(tags) == spans


def test_f1_counts_exact_entities() -> None:
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "O"], ["B-ORG", "B-LOC"]]
    s = f1_score(gold, pred)
    assert s["precision"] == pytest.approx(2 / 3)
    assert s["recall"] == pytest.approx(2 / 3)
    assert s["f1"] == pytest.approx(2 / 3)
    assert f1_score(gold, gold)["f1"] == 1.0


def test_weight_decay_skips_biases_and_layer_norms() -> None:
    params = {
        "dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
        "LayerNorm": {"scale": jnp.ones(2), "bias": jnp.ones(2)},
        "full_layer_layer_norm": {"scale": jnp.ones(2)},
        "word_embeddings": {"embedding": jnp.ones((3, 2))},
    }
    mask = weight_decay_mask(params)
    assert mask["dense"] == {"kernel": True, "bias": False}
    assert mask["LayerNorm"] == {"scale": False, "bias": False}
    assert mask["full_layer_layer_norm"] == {"scale": False}
    assert mask["word_embeddings"] == {"embedding": True}


def test_schedule_warms_up_then_decays_linearly() -> None:
    opt = OptimizerConfig()  # sahajBERT: 0.00176, 5000 warmup steps
    lr = schedule(opt)
    assert float(lr(0)) == 0.0
    assert float(lr(2500)) == pytest.approx(0.00088, rel=1e-4)
    assert float(lr(5000)) == pytest.approx(0.00176, rel=1e-4)
    mid = opt.warmup_steps + (opt.total_steps - opt.warmup_steps) // 2
    assert float(lr(mid)) == pytest.approx(0.00088, rel=1e-3)
    assert float(lr(opt.total_steps)) == pytest.approx(0.0, abs=1e-9)


def test_command_line_defaults_are_sahajbert_and_options_apply() -> None:
    cfg = trainer_config(parse_args(["trainer", "--initial-peers", "/ip4/1.2.3.4/tcp/1"]))
    assert cfg == TrainerConfig(work_dir=cfg.work_dir)
    assert cfg.optimizer.learning_rate == 0.00176 and cfg.target_batch_size == 4096
    assert cfg.seq_length == 512 and cfg.model == "sahajbert"
    args = parse_args(
        ["--initial-peers", "/ip4/1.2.3.4/tcp/1", "--target-batch-size", "64", "--seq-length",
         "32", "--learning-rate", "0.1", "--grad-accumulation", "2", "--client-mode"]
    )  # fmt: skip
    assert args.role == "trainer"  # the default role with --initial-peers
    cfg = trainer_config(args)
    assert (cfg.target_batch_size, cfg.seq_length) == (64, 32)
    assert cfg.optimizer.learning_rate == 0.1 and cfg.grad_accumulation == 2
    assert args.client_mode
    assert parse_args([]).role == "demo" and parse_args(["-v"]).verbose
    help_text = build_parser()._subparsers._group_actions[0].choices["trainer"].format_help()
    options = ["--initial-peers", "--client-mode", "--identity", "--bf16", "--announce"]
    options += ["--per-device-batch-size", "--data", "--tokenizer", "--step-delay"]
    for option in options:
        assert option in help_text


def test_config_tiny_chooses_the_model_only() -> None:
    """``--config tiny`` used to bring the demo's 30 epochs, lr 0.03, target 96 and run id."""
    cfg = trainer_config(parse_args(["trainer", "--config", "tiny", "--initial-peers", "/x"]))
    assert cfg == TrainerConfig(model="tiny", work_dir=cfg.work_dir)
    demo = trainer_config(parse_args(["demo"]), TrainerConfig.demo())
    # the demo's settings are the demo's; its length is --demo-epochs (or --max-epochs), which
    # run_demo gives its trainers
    assert demo.max_epochs is None
    assert demo.replace(max_epochs=30) == TrainerConfig.demo(demo.work_dir)


def _help(*argv: str, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit):
        parse_args([*argv, "--help"])
    return capsys.readouterr().out


def test_each_role_has_its_own_help_page_with_each_default_once(capsys) -> None:
    roles = ("trainer", "finetune", "coordinator", "prepare")
    pages = {role: _help(role, capsys=capsys) for role in roles}
    top = _help(capsys=capsys)
    assert len({top, *pages.values()}) == 5  # five different pages
    assert all(role in top for role in ("demo", "trainer", "finetune", "export"))
    prepare = pages["prepare"]
    assert prepare.count("4096") == 1 and prepare.count("0.00176") == 1
    assert prepare.count("(default: 512)") == 1 and "--lr " not in prepare
    # a volunteer's run options come from the run's manifest, not sahajBERT's defaults
    trainer = " ".join(pages["trainer"].split())
    assert "4096" not in trainer and "0.00176" not in trainer and "(default: 512)" not in trainer
    # --compression, --topk-*, --powersgd-rank
    assert trainer.count("(default: from the run's manifest)") == 17
    assert "--checkpoint-dir" in pages["coordinator"] and "--step-delay" not in pages["finetune"]
    for page in pages.values():
        assert "default: None" not in page and "default: False" not in page
        # no help line says its default twice
        for entry in re.split(r"\n  -", page):
            assert entry.count("default") <= 1, entry
    ft = pages["finetune"]
    assert '"ner_tags"' in ft and '"label"' in ft and "validation.jsonl" in ft  # the row format
    assert "(default: 1e-05)" in ft and "(default: 128)" in ft


def test_finetune_without_a_split_is_a_clear_error(tmp_path, capsys, monkeypatch) -> None:
    """A directory without validation.jsonl gave a raw traceback; --work-dir was ignored."""
    from examples.sahajbert import finetune as finetune_mod

    caches = []
    monkeypatch.setattr(finetune_mod.training, "enable_compilation_cache", caches.append)
    data = tmp_path / "ner"
    data.mkdir()
    (data / "train.jsonl").write_text('{"tokens": ["ক"], "ner_tags": ["O"]}\n')
    (data / "test.jsonl").write_text('{"tokens": ["ক"], "ner_tags": ["O"]}\n')
    argv = ["finetune", "--task", "ner", "--checkpoint", str(tmp_path / "none"), "--data",
            str(data), "--work-dir", str(tmp_path / "wd")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "lacks validation.jsonl" in err and "Traceback" not in err
    assert caches == [tmp_path / "wd" / "jax-cache"]
    (data / "validation.jsonl").write_text('{"tokens": ["ক", "খ"], "ner_tags": ["O"]}\n')
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "validation.jsonl, row 1" in err and '"ner_tags"' in err


def test_dashboard_serves_page_and_json() -> None:
    with Dashboard("demo-run") as dash:
        dash.status = {
            "run_id": "demo-run",
            "peers": [{"peer": "3mPeerOne", "mode": "node", "loss": math.nan}],
            "rows": [{"epoch": 0, "loss": 7.5}],
        }
        with urllib.request.urlopen(dash.url + "api/status", timeout=10) as r:
            status = json.loads(r.read())  # strict JSON: NaN became null
        with urllib.request.urlopen(dash.url, timeout=10) as r:
            page = r.read().decode()
    assert status["peers"][0]["peer"] == "3mPeerOne" and status["peers"][0]["loss"] is None
    assert "api/status" in page and "demo-run" in page


def test_clean_json_replaces_non_finite_numbers() -> None:
    assert clean_json({"a": [1.0, math.inf, {"b": math.nan}], 2: (None, "x")}) == {
        "a": [1.0, None, {"b": None}],
        "2": [None, "x"],
    }


@pytest.mark.slow
def test_pretraining_applies_the_sop_heads_dropout_with_a_fresh_mask_per_seed() -> None:
    """sahajBERT pretrains with classifier dropout 0.1: the trainer's step draws the SOP head's
    mask from the batch's seed (the same seed, the same loss; another seed, another loss)."""
    import numpy as np

    from examples.sahajbert import training
    from models.albert import IGNORE_INDEX

    cfg = training.model_config("tiny", 64, 16, False)
    assert cfg.classifier_dropout_prob == 0.1
    graphdef, params, rest = training.build_model(cfg)
    grad_step = training.make_grad_step(graphdef, rest)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 64, (1, 8, 16)).astype(np.int32)
    labels = np.where(rng.random(ids.shape) < 0.2, ids, IGNORE_INDEX).astype(np.int32)
    batch = {
        "input_ids": ids,
        "mlm_labels": labels,
        "sop_labels": rng.integers(0, 2, (1, 8)).astype(np.int32),
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }

    def loss(seed: int | None) -> float:
        b = dict(batch)
        if seed is not None:
            b[training.DROPOUT_SEED] = np.full((1, 8), seed, np.uint32)
        return float(grad_step(params, b)[1])

    assert loss(1) == loss(1)
    assert loss(1) != loss(2) and loss(1) != loss(None)  # None: no dropout at all


def test_each_peer_draws_its_own_dropout_seeds() -> None:
    import numpy as np

    from examples.sahajbert import training
    from models.text.data import TokenizedCorpus

    cfg = TrainerConfig.demo().replace(per_device_batch_size=2, grad_accumulation=3)
    rng = np.random.default_rng(0)
    corpus = TokenizedCorpus(
        tokens=rng.integers(5, 64, 20 * 3 * 6).astype(np.int32),
        sentence_offsets=np.arange(0, 20 * 3 * 6 + 1, 6, dtype=np.int64),
        document_offsets=np.arange(0, 20 * 3 + 1, 3, dtype=np.int64),
        vocab_size=64,
    )
    seeds = {}
    for peer in (1, 2):
        stream = training.batches(cfg, corpus, 64, peer)
        seeds[peer] = [next(stream)[training.DROPOUT_SEED] for _ in range(2)]
    assert seeds[1][0].shape == (3, 2 * jax.local_device_count())
    assert not (seeds[1][0] == seeds[1][1]).all()  # a new seed per step
    assert not (seeds[1][0] == seeds[2][0]).all()  # and per peer


def test_the_demo_passes_bf16_on_to_its_trainers() -> None:
    """`demo --bf16` (bench/gpu_check.sh's collaboration on a GPU) computes in bf16 in every
    child process, not only in the parent that starts them."""
    import dataclasses

    from examples.sahajbert.config import TrainerConfig
    from examples.sahajbert.demo import cli_args

    assert "--bf16" not in cli_args(TrainerConfig())
    assert "--bf16" in cli_args(dataclasses.replace(TrainerConfig(), bf16=True))


def test_traffic_rates_are_bytes_over_the_last_window() -> None:
    from examples.sahajbert.trainer import _Traffic

    t = _Traffic(window=30.0)
    assert t.update(0.0, 0, 0) == (0.0, 0.0)
    assert t.update(10.0, 1_000_000, 500_000) == (100_000.0, 50_000.0)
    # an averaging burst, then quiet: the rate falls once the burst leaves the window
    t.update(20.0, 3_000_000, 2_500_000)
    assert t.update(60.0, 3_000_000, 2_500_000) == (0.0, 0.0)


def test_prepare_says_which_recipe_it_wrote(tmp_path) -> None:
    """`prepare --config tiny` keeps sahajBERT's optimizer (lr 0.00176, 5000 warmup steps of
    4096 samples), under which a short CPU run's loss stayed at 7.55: prepare now prints the
    data, target batch and optimizer it wrote, and with the tiny model on that recipe, the
    flags of one that learns in a few dozen steps."""
    from pathlib import Path

    from examples.sahajbert import manifest
    from examples.sahajbert.__main__ import TINY_RECIPE, _recipe

    def lines(argv: list[str]) -> str:
        cfg = trainer_config(parse_args(["prepare", *argv, "--out", str(tmp_path)]))
        made = manifest.build(cfg, Path(__file__), 900, "none")
        return "\n".join(_recipe(cfg, made))

    tiny = lines(["--config", "tiny"])
    assert "data: the synthetic Bengali corpus (no --data)" in tiny
    assert "target batch 4096 samples (a step)" in tiny
    assert "optimizer: LAMB, lr 0.00176, warmup 5000 steps" in tiny
    assert f"prepare with {TINY_RECIPE}" in tiny
    short = lines(["--config", "tiny", *TINY_RECIPE.split()])
    assert "lr 0.03, warmup 2 steps, linear decay to 0 at step 1000" in short
    assert "note" not in short
    assert "note" not in lines([])  # sahajBERT's own recipe, for sahajBERT
    diloco = lines(["--mode", "diloco", "--inner-steps", "8"])
    assert "(DiLoCo: an outer step every 8)" in diloco
