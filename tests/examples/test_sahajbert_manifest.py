"""The run manifest: prepared once, published signed, fetched and obeyed by every trainer.

Peers run as separate processes with separate work directories (standing in for separate
machines) on loopback. The organiser prepares the run on a local text file; trainers are
started with ``--initial-peers`` and device options only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.sahajbert import manifest
from examples.sahajbert.config import TrainerConfig
from models.text.corpus import write_corpus
from models.text.sources import SourceKind, parse_data

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--run-id", "manifest-test"]
DEVICE = ["--per-device-batch-size", "8"]


def _cli(args: list[str], work: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "examples.sahajbert", *args, "--work-dir", str(work)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """A prepared run on a local text file, and its coordinator (stopped at the end)."""
    tmp = tmp_path_factory.mktemp("run")
    data = tmp / "bn-wiki.txt"
    write_corpus(data, 300, seed=11)
    run_dir = tmp / "prepared"
    prep = subprocess.run(
        [sys.executable, "-m", "examples.sahajbert", "prepare", *RUN, "--config", "tiny",
         "--seq-length", "32", "--target-batch-size", "32", "--learning-rate", "0.01",
         "--warmup-steps", "1", "--data", str(data), "--out", str(run_dir),
         "--work-dir", str(tmp / "organiser")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    addr_file = tmp / "addrs.json"
    coord_log = tmp / "coordinator.log"
    # neither the coordinator nor the volunteers name the run: the manifest does
    coord = _cli(
        ["coordinator", "--manifest", str(run_dir), "--out", str(tmp / "out"),
         "--addr-file", str(addr_file), "--checkpoint-every", "1"],
        tmp / "organiser", coord_log,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not addr_file.is_file():
        assert coord.poll() is None, coord_log.read_text()
        assert time.monotonic() < deadline, coord_log.read_text()
        time.sleep(0.2)
    addr = json.loads(addr_file.read_text())[0]
    yield {"tmp": tmp, "addr": addr, "run_dir": run_dir, "data": data, "coord": coord}
    coord.terminate()
    coord.wait(timeout=30)


def _trainer(run: dict, name: str, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    work = run["tmp"] / name
    log = run["tmp"] / f"{name}.log"
    proc = _cli(["trainer", "--initial-peers", run["addr"], *DEVICE, *extra], work, log)
    return proc, work, log


def test_a_trainer_with_another_seq_length_or_tokenizer_is_refused(run) -> None:
    other_tok = run["tmp"] / "other-tok"
    other = run["tmp"] / "other.txt"
    write_corpus(other, 50, seed=5)
    from models.text.sources import read_local_documents
    from models.text.tokenizer import train_tokenizer

    train_tokenizer(read_local_documents(other), 400, other_tok)
    seq, _, seq_log = _trainer(run, "refused-seq", "--seq-length", "128")
    tok, _, tok_log = _trainer(run, "refused-tok", "--tokenizer", str(other_tok))
    assert seq.wait(timeout=300) == 2, seq_log.read_text()
    assert tok.wait(timeout=300) == 2, tok_log.read_text()
    assert (
        "--seq-length 128 contradicts the run's manifest (--seq-length 32)" in seq_log.read_text()
    )
    text = tok_log.read_text()
    assert "--tokenizer" in text and "contradicts the run's manifest" in text, text
    assert _sha(other_tok / "tokenizer.json")[:16] in text  # both digests named


def test_the_manifest_names_the_run_for_every_role(run) -> None:
    """`prepare --run-id X`, then `coordinator --manifest` and the volunteers' one-line start
    without --run-id all take part in run X; a --run-id that contradicts it is refused with
    both values and the fix."""
    status = run["tmp"] / "out" / "status.json"
    deadline = time.monotonic() + 120
    while not status.is_file():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert json.loads(status.read_text())["run_id"] == "manifest-test"
    got, _, _ = manifest.fetch([run["addr"]], run_id=None, work_dir=run["tmp"] / "fetch")
    assert got.run_id == "manifest-test"
    with pytest.raises(manifest.ManifestError, match="drop --run-id to join run 'manifest-test'"):
        manifest.fetch([run["addr"]], run_id="other", work_dir=run["tmp"] / "fetch")
    log = run["tmp"] / "coord-other.log"
    argv = ["coordinator", "--run-id", "other", "--manifest", str(run["run_dir"]),
            "--out", str(run["tmp"] / "out-other")]  # fmt: skip
    other = _cli(argv, run["tmp"] / "organiser", log)
    assert other.wait(timeout=120) == 2, log.read_text()
    assert "--run-id other contradicts the run's manifest (--run-id manifest-test)" in (
        log.read_text()
    )


def test_the_coordinator_refuses_a_tokenizer_the_manifest_does_not_name(
    run, monkeypatch, capsys
) -> None:
    """`coordinator --manifest RUN --tokenizer X` trained and published RUN's tokenizer and
    never looked at X: one that is not the manifest's is refused naming both digests, the
    manifest's own (its directory or its file) is taken."""
    from examples.sahajbert import __main__ as cli
    from examples.sahajbert import coordinator
    from models.text.sources import read_local_documents
    from models.text.tokenizer import train_tokenizer

    other_tok = run["tmp"] / "coord-other-tok"
    other = run["tmp"] / "coord-other.txt"
    write_corpus(other, 50, seed=6)
    train_tokenizer(read_local_documents(other), 400, other_tok)
    started: list = []
    monkeypatch.setattr(coordinator, "run_coordinator", lambda cfg, net, opts: started.append(1))
    base = ["coordinator", "--manifest", str(run["run_dir"]), "--out", str(run["tmp"] / "o-tok"),
            "--work-dir", str(run["tmp"] / "organiser")]  # fmt: skip
    assert cli.main([*base, "--tokenizer", str(other_tok)]) == 2
    err = capsys.readouterr().err
    prepared, _ = manifest.load(run["run_dir"])
    assert "--tokenizer" in err and "contradicts the run's manifest" in err, err
    assert _sha(other_tok / "tokenizer.json")[:16] in err, err
    assert prepared.tokenizer_sha256[:16] in err, err
    assert started == []
    own = run["run_dir"] / "tokenizer"
    assert cli.main([*base, "--tokenizer", str(own)]) == 0
    assert cli.main([*base, "--tokenizer", str(own / "tokenizer.json")]) == 0
    assert started == [1, 1]


@pytest.mark.slow
def test_a_trainer_with_no_data_flags_trains_on_the_manifests_data_and_vocabulary(run) -> None:
    _volunteers_train_on_the_manifest(run, 1, "one")


@pytest.mark.slow
def test_three_trainers_share_the_manifests_tokenizer_and_data(run) -> None:
    _volunteers_train_on_the_manifest(run, 3, "three")


def _volunteers_train_on_the_manifest(run: dict, count: int, name: str) -> None:
    prepared, _ = manifest.load(run["run_dir"])
    trainers = [_trainer(run, f"{name}{i}", "--max-epochs", "2") for i in range(count)]
    for proc, _, log in trainers:
        assert proc.wait(timeout=500) == 0, log.read_text()[-3000:]
    for _, work, log in trainers:
        # the tokenizer was downloaded (never trained here) and is the manifest's
        files = list((work / "tokenizers").glob("*/tokenizer.json"))
        assert [_sha(f) for f in files] == [prepared.tokenizer_sha256]
        assert not list(work.glob("*/tokenizer/tokenizer.json"))  # none trained
        assert not (work / "synthetic").exists()  # not the synthetic corpus
        text = log.read_text()
        assert f"tokenizer sha256 {prepared.tokenizer_sha256}" in text
        assert f"streaming line:{run['data']}" in text, text[-2000:]
    assert _sha(run["run_dir"] / "tokenizer" / "tokenizer.json") == prepared.tokenizer_sha256


def test_manifest_round_trip_and_hostile_envelopes() -> None:
    from p2p.identity import Identity

    cfg = TrainerConfig().replace(model="tiny", data="hf", run_id="r")
    tok = Path(__file__)  # any file: the digest is what is checked
    made = manifest.build(cfg, tok, 953, "fp16")
    assert [s.kind for s in made.data] == [SourceKind.HUB, SourceKind.HUB]
    assert [s.weight for s in made.data] == [0.23, 0.77]
    me, other = Identity.generate(), Identity.generate()
    env = manifest.sign(made, me)
    got, signer = manifest.verify(env, run_id="r")
    assert got == made and signer == str(me.peer_id)
    assert manifest.verify(env, run_id="r", owner=me.public_key)[0] == made
    bad = [
        ({**env, "signature": other.sign(env["manifest"])}, "does not verify"),
        (env, "not signed by the private run's owner"),
        ({**env, "manifest": env["manifest"].replace(b'"fp16"', b'"fp17"')}, "verify"),
        ("garbage", "not a map"),
        ({**env, "signer": b"short"}, "does not verify"),
    ]
    for i, (e, why) in enumerate(bad):
        owner = other.public_key if i == 1 else None
        with pytest.raises(manifest.ManifestError, match=why):
            manifest.verify(e, run_id="r", owner=owner)
    with pytest.raises(manifest.ManifestError, match="serve run 'r', not 's'"):
        manifest.verify(env, run_id="s")
    assert manifest.verify(env, run_id=None)[0] == made  # the run the peer serves
    for field, value in [("seq_length", float("inf")), ("vocab_size", -1), ("codec", "<b>"),
                         ("tokenizer_sha256", "zz"), ("data", [{"kind": "text", "path": ""}]),
                         ("masking", {"mlm_probability": 2.0}), ("mode", "local"),
                         ("inner_steps", 0), ("inner_steps", 5)]:  # fmt: skip
        forged = {**made.to_dict(), field: value}
        body = json.dumps(forged, sort_keys=True, separators=(",", ":")).encode()
        e = {"manifest": body, "signer": me.public_key, "signature": me.sign(
            manifest._DOMAIN + body)}  # fmt: skip
        with pytest.raises(manifest.ManifestError, match="malformed manifest"):
            manifest.verify(e, run_id="r")


def test_flags_that_contradict_the_manifest_name_the_flag_and_both_values(tmp_path) -> None:
    data = tmp_path / "a.txt"
    cfg = TrainerConfig().replace(model="tiny", data=f"block:{data}", seq_length=64)
    made = manifest.build(cfg, Path(__file__), 900, "none")
    ok = cfg.replace(data=f"block:{tmp_path / 'my-copy.txt'}")  # another path, same recipe
    manifest.check(made, ok, {"--data", "--seq-length", "--config"})
    cases = [
        (cfg.replace(seq_length=128), "--seq-length", "--seq-length 128 contradicts"),
        (cfg.replace(model="sahajbert"), "--config", "(--config tiny)"),
        (cfg.replace(data=str(data)), "--data", "--data"),  # line layout, not block
        (cfg.replace(data=None), "--data", "(synthetic)"),
        (cfg.replace(data=f"block:{data},hf"), "--data", "--data"),
    ]
    for bad, flag, text in cases:
        with pytest.raises(manifest.ManifestMismatch, match=re.escape(text)) as e:
            manifest.check(made, bad, {flag})
        assert e.value.flag == flag
        manifest.check(made, bad, set())  # not given explicitly: the manifest's value is used
    applied = manifest.apply(made, TrainerConfig(run_id="other"), tmp_path)
    assert (applied.model, applied.seq_length, applied.data) == ("tiny", 64, f"block:{data}")
    assert applied.run_id == made.run_id  # the manifest names the run
    with pytest.raises(manifest.ManifestMismatch, match="--run-id other contradicts"):
        manifest.check(made, TrainerConfig(run_id="other"), {"--run-id"})
    assert parse_data(applied.data, applied.data_mix) == made.data


def test_a_diloco_run_makes_every_volunteer_train_in_diloco_mode(tmp_path) -> None:
    """The organiser's --mode diloco --inner-steps H travels in the manifest: a volunteer's
    one-line start (no --mode) trains in DiLoCo mode with H, and a --mode or --inner-steps that
    contradicts it is refused."""
    cfg = TrainerConfig().replace(model="tiny", run_id="r", mode="diloco", inner_steps=7)
    made = manifest.build(cfg, Path(__file__), 900, "int8")
    assert manifest.RunManifest.from_dict(made.to_dict()) == made
    applied = manifest.apply(made, TrainerConfig(), tmp_path)
    assert (applied.mode, applied.inner_steps, applied.codec) == ("diloco", 7, "int8")
    assert applied.collaboration_target == 7 * applied.target_batch_size
    manifest.check(made, applied, {"--mode", "--inner-steps"})
    for bad, flag in [(applied.replace(mode="dedloc"), "--mode"),
                      (applied.replace(inner_steps=500), "--inner-steps")]:  # fmt: skip
        with pytest.raises(manifest.ManifestMismatch, match=re.escape(flag)):
            manifest.check(made, bad, {flag})
    # a DeDLOC run: the mode travels too, and --inner-steps means nothing there
    plain = manifest.build(cfg.replace(mode="dedloc"), Path(__file__), 900, "fp16")
    assert (plain.mode, plain.inner_steps) == ("dedloc", 1)
    assert manifest.apply(plain, applied, tmp_path).mode == "dedloc"
    manifest.check(plain, TrainerConfig().replace(inner_steps=9), {"--inner-steps"})


def test_compression_travels_in_the_manifest_and_a_contradicting_flag_is_refused(tmp_path):
    """``prepare --compression adaptive`` writes it in the manifest; a volunteer with no flag
    averages in it, and one whose --compression differs is refused, naming both values."""
    from dedloc_jax.averaging.leaf_codecs import COMPRESSIONS
    from examples.sahajbert.__main__ import parse_args, trainer_config
    from examples.sahajbert.config import COMPRESSIONS as CLI_CHOICES
    from examples.sahajbert.trainer import collaboration_config

    assert CLI_CHOICES == COMPRESSIONS  # every compression the library knows is offered
    args = parse_args(["prepare", "--config", "tiny", "--compression", "adaptive", "--out", "x"])
    cfg = trainer_config(args)
    assert cfg.codec == "adaptive" and collaboration_config(cfg).codec == "adaptive"
    made = manifest.build(cfg, Path(__file__), 900, collaboration_config(cfg).codec)
    assert manifest.RunManifest.from_dict(made.to_dict()).codec == "adaptive"
    applied = manifest.apply(made, TrainerConfig(), tmp_path)  # a volunteer with no flag
    assert collaboration_config(applied).codec == "adaptive"
    manifest.check(made, applied, {"--compression"})
    flagged = trainer_config(parse_args(["trainer", "--compression", "int8"]))
    with pytest.raises(
        manifest.ManifestMismatch,
        match=re.escape("--compression int8 contradicts the run's manifest (--compression "
                        "adaptive)"),
    ):  # fmt: skip
        manifest.check(made, flagged, {"--compression"})
    manifest.check(made, flagged, set())  # not given: the manifest's is used
    assert trainer_config(parse_args(["trainer"])).codec is None  # unset: the preset's
    with pytest.raises(ValueError, match="unknown codec 'gzip'"):
        manifest.RunManifest.from_dict({**made.to_dict(), "codec": "gzip"})
    # DiLoCo: the pseudo-gradients travel in the named compression too
    dil = cfg.replace(mode="diloco", inner_steps=3)
    assert collaboration_config(dil).codec == "adaptive"


def test_powersgd_travels_in_the_manifest_and_a_contradicting_flag_is_refused(tmp_path):
    """``prepare --compression powersgd --powersgd-rank 2`` writes the rank in the manifest; a
    volunteer with no flag trains with PowerSGD(rank=2) in the run's codec; one whose
    --compression or --powersgd-rank differs is refused, naming both values."""
    from dedloc_jax import PowerSGD
    from examples.sahajbert.__main__ import parse_args, trainer_config
    from examples.sahajbert.trainer import collaboration_config, powersgd_of

    args = parse_args(
        ["prepare", "--config", "tiny", "--compression", "powersgd", "--powersgd-rank", "2",
         "--out", "x"]
    )  # fmt: skip
    cfg = trainer_config(args)
    assert (cfg.compression, cfg.powersgd_rank, cfg.codec) == ("powersgd", 2, None)
    made = manifest.build(cfg, Path(__file__), 900, collaboration_config(cfg).codec)
    assert manifest.RunManifest.from_dict(made.to_dict()).powersgd_rank == 2
    applied = manifest.apply(made, TrainerConfig(), tmp_path)  # a volunteer with no flag
    assert powersgd_of(applied) == PowerSGD(rank=2, codec=collaboration_config(cfg).codec)
    manifest.check(made, applied, {"--compression", "--powersgd-rank"})
    flagged = trainer_config(parse_args(["trainer", "--powersgd-rank", "8"]))
    with pytest.raises(
        manifest.ManifestMismatch,
        match=re.escape("--powersgd-rank 8 contradicts the run's manifest (--powersgd-rank 2)"),
    ):
        manifest.check(made, flagged, {"--powersgd-rank"})
    flagged = trainer_config(parse_args(["trainer", "--compression", "fp16"]))
    with pytest.raises(manifest.ManifestMismatch, match=re.escape("(--compression powersgd)")):
        manifest.check(made, flagged, {"--compression"})
    # a plain run refuses a volunteer who would average low-rank gradients
    plain = manifest.build(TrainerConfig(model="tiny"), Path(__file__), 900, "none")
    assert plain.powersgd_rank is None and powersgd_of(manifest.apply(plain, cfg, tmp_path)) is None
    with pytest.raises(manifest.ManifestMismatch, match="--compression powersgd contradicts"):
        manifest.check(plain, cfg, {"--compression"})
    for bad in (0, 65, "4"):
        with pytest.raises(ValueError, match="powersgd_rank"):
            manifest.RunManifest.from_dict({**made.to_dict(), "powersgd_rank": bad})
    with pytest.raises(ValueError, match="needs mode dedloc"):
        manifest.RunManifest.from_dict({**made.to_dict(), "mode": "diloco", "inner_steps": 2})
    with pytest.raises(ValueError, match="needs --mode dedloc"):
        TrainerConfig(compression="powersgd", mode="diloco")


def test_topk_settings_travel_in_the_manifest_and_a_contradicting_flag_is_refused(tmp_path):
    """``prepare --mode diloco --compression topk --topk-density D --topk-bits B
    --topk-error-feedback F`` writes all three in the manifest; a volunteer with no flag trains
    with them (its diloco gets that TopK), and one whose flag differs is refused, naming both
    values. A manifest whose topk settings are out of TopK's bounds is rejected."""
    from dedloc_jax import TopK
    from examples.sahajbert.__main__ import parse_args, trainer_config
    from examples.sahajbert.trainer import diloco_of

    assert (TrainerConfig.topk_density, TrainerConfig.topk_bits,
            TrainerConfig.topk_error_feedback) == (TopK.density, TopK.bits,
                                                  TopK.error_feedback)  # fmt: skip
    flags = ["--mode", "diloco", "--compression", "topk", "--topk-density", "0.03125",
             "--topk-bits", "3", "--topk-error-feedback", "0.9"]  # fmt: skip
    cfg = trainer_config(parse_args(["prepare", "--config", "tiny", *flags, "--out", "x"]))
    made = manifest.build(cfg, Path(__file__), 900, "int8")
    assert made.topk == {"density": 0.03125, "bits": 3, "error_feedback": 0.9}
    assert manifest.RunManifest.from_dict(made.to_dict()) == made
    applied = manifest.apply(made, TrainerConfig(), tmp_path)  # a volunteer with no flag
    assert applied.compression == "topk"
    assert diloco_of(applied) == TopK(density=0.03125, bits=3, error_feedback=0.9)
    manifest.check(made, applied, {"--compression", "--topk-density", "--topk-bits",
                                   "--topk-error-feedback"})  # fmt: skip
    base = ["trainer", "--mode", "diloco", "--compression", "topk"]
    cases = [
        (["--topk-density", "0.05"], "--topk-density",
         "--topk-density 0.05 contradicts the run's manifest (--topk-density 0.03125)"),
        (["--topk-bits", "2"], "--topk-bits",
         "--topk-bits 2 contradicts the run's manifest (--topk-bits 3)"),
        (["--topk-error-feedback", "0.95"], "--topk-error-feedback",
         "--topk-error-feedback 0.95 contradicts the run's manifest (--topk-error-feedback 0.9)"),
    ]  # fmt: skip
    for extra, flag, text in cases:
        bad = trainer_config(parse_args([*base, *extra]))
        with pytest.raises(manifest.ManifestMismatch, match=re.escape(text)):
            manifest.check(made, bad, {flag})
        manifest.check(made, bad, set())  # not given: the manifest's is used
    int8 = trainer_config(parse_args(["trainer", "--mode", "diloco", "--compression", "int8"]))
    with pytest.raises(
        manifest.ManifestMismatch,
        match=re.escape("--compression int8 contradicts the run's manifest (--compression topk)"),
    ):
        manifest.check(made, int8, {"--compression"})
    # a run that is not topk: a volunteer asking for topk is refused, and applying it drops topk
    plain = manifest.build(cfg.replace(compression=None), Path(__file__), 900, "int8")
    assert plain.topk is None
    with pytest.raises(manifest.ManifestMismatch, match=re.escape("(--compression int8)")):
        manifest.check(plain, applied, {"--compression"})
    assert manifest.apply(plain, applied, tmp_path).compression is None
    good = made.to_dict()
    for bad_topk, text in [
        ({**made.topk, "bits": 9}, "topk bits"),
        ({**made.topk, "density": 0.0}, "topk density"),
        ({**made.topk, "error_feedback": float("nan")}, "topk error_feedback"),
        ({**made.topk, "chunk": 4096}, "topk must be"),
        ("topk", "topk must be"),
    ]:
        with pytest.raises(ValueError, match=text):
            manifest.RunManifest.from_dict({**good, "topk": bad_topk})
    with pytest.raises(ValueError, match="topk needs mode diloco"):
        manifest.RunManifest.from_dict({**good, "mode": "dedloc", "inner_steps": 1})
