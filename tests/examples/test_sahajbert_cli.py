"""The volunteer program's command line as a user meets it: errors are one line naming what
to fix, signals end a peer cleanly, defaults fit a home machine.

Real processes on loopback (a tiny prepared run); every wait is bounded generously.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.sahajbert.__main__ import QUIET_LOGGERS, main, parse_args
from models.text.corpus import write_corpus

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "examples.sahajbert", *args]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("cli")
    write_corpus(tmp / "bn.txt", 120, seed=2)
    out = tmp / "RUN"
    prep = subprocess.run(
        _cmd("prepare", "--run-id", "cli-test", "--config", "tiny", "--seq-length", "32",
             "--target-batch-size", "32", "--data", str(tmp / "bn.txt"), "--out", str(out),
             "--work-dir", str(tmp / "org")),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    return out


def _coordinator(run_dir: Path, tmp: Path, *extra: str) -> list[str]:
    return _cmd("coordinator", "--manifest", str(run_dir), "--out", str(tmp / "out"),
                "--work-dir", str(tmp / "work"), *extra)  # fmt: skip


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.slow
def test_a_listen_or_dashboard_port_in_use_is_one_line_naming_it(run_dir, tmp_path) -> None:
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        cases = [
            (("--listen", f"/ip4/127.0.0.1/tcp/{port}"),
             f"coordinator: cannot listen on /ip4/127.0.0.1/tcp/{port}: address already in use"),
            (("--dashboard-port", str(port)),
             f"coordinator: cannot serve the dashboard on 127.0.0.1:{port}: in use"),
        ]  # fmt: skip
        for extra, line in cases:
            got = subprocess.run(_coordinator(run_dir, tmp_path, *extra), cwd=ROOT, env=_env(),
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
            assert got.returncode == 2, got.stderr[-3000:]
            assert line in got.stderr, got.stderr[-3000:]
            assert "Traceback" not in got.stderr and "ExceptionGroup" not in got.stderr


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)]
)
def test_sigint_and_sigterm_end_a_peer_cleanly_with_one_line(run_dir, tmp_path, sig) -> None:
    """It leaves the run (port mappings removed, connections closed) and says so once; it
    listens on every interface by default and advertises only dialable addresses."""
    addr_file = tmp_path / "addrs.json"
    log = tmp_path / "coordinator.log"
    with log.open("w") as out:
        argv = _coordinator(run_dir, tmp_path, "--addr-file", str(addr_file))
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not addr_file.is_file():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        addrs = json.loads(addr_file.read_text())
        assert addrs and not any("/ip4/0.0.0.0/" in a for a in addrs), addrs
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 128 + sig, text[-3000:]
    assert f"coordinator: stopped by {sig.name}; left the run" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.slow
def test_unreachable_initial_peers_fail_fast_with_the_reason(run_dir, tmp_path) -> None:
    """A closed port, or a peer whose key is not the address's /p2p/ ID: the reason is known at
    once, so the volunteer hears it after a brief retry, not after two minutes."""
    from p2p.identity import Identity

    other = Identity.generate().peer_id
    closed = _busy_port()
    closed_port = closed.getsockname()[1]
    closed.close()
    addr_file = tmp_path / "addrs.json"
    log = tmp_path / "coordinator.log"
    with log.open("w") as out:
        coord = subprocess.Popen(
            _coordinator(run_dir, tmp_path, "--addr-file", str(addr_file)),
            cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not addr_file.is_file():
            assert coord.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        real = next(a for a in json.loads(addr_file.read_text()) if "/127.0.0.1/" in a)
        wrong_id = real.rsplit("/p2p/", 1)[0] + f"/p2p/{other}"
        cases = [
            (f"/ip4/127.0.0.1/tcp/{closed_port}/p2p/{other}", "cannot connect"),
            (wrong_id, "the key that answered belongs to"),
        ]
        for addr, why in cases:
            got = subprocess.run(
                _cmd("--initial-peers", addr, "--work-dir", str(tmp_path / "v")),
                cwd=ROOT,
                env=_env(),
                capture_output=True,
                text=True,
                timeout=100,
            )  # fmt: skip (two minutes of retrying would overrun the timeout)
            assert got.returncode == 2, got.stderr[-3000:]
            assert "could not connect to any of the --initial-peers" in got.stderr
            assert why in got.stderr and "/p2p/ ID" in got.stderr, got.stderr[-3000:]
    finally:
        coord.terminate()
        coord.wait(timeout=60)


def test_defaults_fit_a_home_machine(tmp_path, capsys, monkeypatch) -> None:
    """Peers listen on every interface (the demo keeps to loopback); --help says which options
    the run's manifest decides; library chatter stays below WARNING."""
    for role in ("trainer", "aux", "coordinator"):
        argv = [role] if role == "coordinator" else [role, "--initial-peers", "/ip4/1.2.3.4/tcp/1"]
        assert parse_args(argv).listen == ["/ip4/0.0.0.0/tcp/0"]
    from examples.sahajbert import demo
    from examples.sahajbert.config import DemoConfig, TrainerConfig

    started: list[list[str]] = []

    class Procs:
        def start(self, name: str, args: list[str]) -> None:
            started.append(args)
            if name == "coordinator":
                (tmp_path / "addrs.json").write_text(json.dumps(["/ip4/127.0.0.1/tcp/1/p2p/x"]))

    monkeypatch.setattr(demo, "wait_for_file", lambda *a, **k: None)
    demo.start_run(DemoConfig(), TrainerConfig.demo(tmp_path), tmp_path, Procs())  # type: ignore[arg-type]
    for args in started:
        assert args[args.index("--listen") + 1] == "/ip4/127.0.0.1/tcp/0", args
    with pytest.raises(SystemExit):
        main(["trainer", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens per example (default: from the run's manifest)" in text
    assert "(default: 512)" not in text and "micro-batch per local device (default: 4)" in text
    assert main(["identity", "--key", str(tmp_path / "k"), "--create"]) == 0
    for name in QUIET_LOGGERS:
        assert logging.getLogger(name).getEffectiveLevel() >= logging.WARNING


def test_a_stop_swallowed_by_python_is_asked_again() -> None:
    """Python swallows a KeyboardInterrupt raised in a garbage-collection callback ("Exception
    ignored in: <function _xla_gc_callback ...>"): a SIGINT then left a trainer running."""
    from examples.sahajbert.__main__ import _Signals

    stopped = False
    with _Signals(insist=0.2) as signals:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # swallowed, as some code may
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.05)
        except KeyboardInterrupt:
            stopped = True
    assert stopped and signals.name == "SIGTERM"


def test_a_stop_raised_in_a_gc_callback_is_asked_again_at_once() -> None:
    """Python reports a KeyboardInterrupt raised in a gc callback as unraisable and goes on;
    the stop is asked again at once, without the "Exception ignored" text."""
    import gc

    from examples.sahajbert.__main__ import _Signals

    def callback(phase: str, info: dict) -> None:
        if phase == "start" and not hit:
            hit.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs here: its KeyboardInterrupt is unraisable

    hit: list[int] = []
    stopped = False
    with _Signals(insist=60.0):
        gc.callbacks.append(callback)
        try:
            try:
                gc.collect()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    time.sleep(0.01)
            finally:
                gc.callbacks.remove(callback)
        except KeyboardInterrupt:
            stopped = True
    assert hit and stopped


def test_help_says_what_an_unset_robust_tau_does(capsys) -> None:
    """--help said "unset: the plain weighted mean" while an open run averages with a derived
    CenteredClip radius (CollaborationConfig.robust_on): a new user read the wrong default. The
    example address also showed a libp2p-style "12D3..." ID, which this project's IDs are not."""
    with pytest.raises(SystemExit):
        main(["trainer", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "unset: the plain weighted mean" not in text
    assert "derived from the parts in an open run" in text and "12D3" not in text


def test_the_demos_max_epochs_sets_its_length(monkeypatch, tmp_path) -> None:
    """`demo --max-epochs 5` (the trainers' option, listed by `demo --help` with "default: 30")
    ran 30 epochs: the demo replaced it by --demo-epochs. It is the demo's length now."""
    from examples.sahajbert import demo

    lengths: list[int] = []
    monkeypatch.setattr(demo, "run_demo", lambda d, cfg, out: lengths.append(d.epochs) or 0)
    common = ["demo", "--work-dir", str(tmp_path)]
    for extra, epochs in (([], 30), (["--max-epochs", "5"], 5), (["--demo-epochs", "7"], 7)):
        main(common + extra)
        assert lengths[-1] == epochs, extra


def test_the_coordinators_help_lists_only_options_it_uses(capsys, tmp_path) -> None:
    """`coordinator --help` listed a trainer's machine options (--per-device-batch-size,
    --grad-accumulation, --bf16), --robust-tau (it never averages) and --client-mode (which
    left it unreachable: nobody could join). The first four are accepted, for argument lists
    shared with trainers (the demo's), and not listed; --client-mode is refused. So for an aux
    peer (it averages: --robust-tau stays), whose --client-mode raised a traceback after it
    joined."""
    with pytest.raises(SystemExit):
        main(["coordinator", "--help"])
    text = capsys.readouterr().out
    for unused in ("--per-device-batch-size", "--grad-accumulation", "--bf16", "--robust-tau",
                   "--client-mode"):  # fmt: skip
        assert unused not in text, unused
    assert "exit 0 once the run's state of this epoch is saved" in " ".join(text.split())
    args = parse_args(["coordinator", "--bf16", "--per-device-batch-size", "8"])
    assert args.bf16 and args.per_device_batch_size == 8  # (still parsed)
    refused = main(["coordinator", "--client-mode", "--out", str(tmp_path / "out")])
    assert refused == 2 and "--client-mode accepts no connections" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["aux", "--help"])  # an aux peer computes no gradient either, and must be reached
    text = capsys.readouterr().out
    for unused in ("--per-device-batch-size", "--grad-accumulation", "--bf16", "--client-mode"):
        assert unused not in text, unused
    assert "--robust-tau" in text  # (it averages)
    refused = main(["aux", "--client-mode", "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/x"])
    assert refused == 2 and "an aux peer reduces shares" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trainer", "--help"])
    assert "--client-mode" in capsys.readouterr().out  # (a trainer's option)
