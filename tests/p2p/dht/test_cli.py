"""Real sockets: ``python -m p2p.dht serve`` processes on loopback, driven by the CLI."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2p.multiaddr import Multiaddr

ROOT = Path(__file__).resolve().parents[3]
CMD = [sys.executable, "-m", "p2p.dht"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [*CMD, "serve", "--config", "fast", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        proc.kill()
        raise AssertionError(f"serve printed no address: {proc.stderr.read()[-2000:]}")
    addr = Multiaddr.parse(line)  # a full address: /ip4/127.0.0.1/tcp/PORT/p2p/PEERID
    assert addr.host == "127.0.0.1" and addr.port and addr.peer_id is not None
    return proc, line


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CMD, *args, "--config", "fast"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=60,
    )


@pytest.fixture
def servers():
    procs: list[subprocess.Popen] = []
    try:
        first, addr0 = _serve()
        procs.append(first)
        addrs = [addr0]
        for _ in range(3):
            proc, addr = _serve("--initial-peers", addr0)
            procs.append(proc)
            addrs.append(addr)
        yield procs, addrs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_serve_store_get_kill_get(servers) -> None:
    procs, addrs = servers
    stored = _run(
        "store",
        "run/alpha",
        '{"loss": 2.5, "step": [1, 2]}',
        "--ttl",
        "120",
        "--initial-peers",
        addrs[1],
    )
    assert stored.returncode == 0, stored.stderr
    assert "stored on 4 nodes" in stored.stdout
    owned = _run(
        "store", "run/peers", '"me"', "--ttl", "120", "--owned", "--initial-peers", addrs[2]
    )
    assert owned.returncode == 0, owned.stderr

    got = _run("get", "run/alpha", "--initial-peers", addrs[2])
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout) == {"loss": 2.5, "step": [1, 2]}

    procs[1].send_signal(signal.SIGKILL)  # the node we stored through dies
    procs[1].wait(10)
    got = _run("get", "run/alpha", "--initial-peers", addrs[3])
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout) == {"loss": 2.5, "step": [1, 2]}
    subkeys = json.loads(_run("get", "run/peers", "--initial-peers", addrs[0]).stdout)
    assert list(subkeys.values()) == ["me"] and list(subkeys)[0].startswith("[owner:")

    missing = _run("get", "run/none", "--initial-peers", addrs[0])
    assert missing.returncode == 1  # nodes answered: absent (3 would say nobody answered)
    assert "not found: run/none" in missing.stderr

    for i in (0, 2, 3):  # SIGINT / SIGTERM: clean shutdown, exit 0
        procs[i].send_signal(signal.SIGTERM if i else signal.SIGINT)
        assert procs[i].wait(20) == 0, procs[i].stderr.read()[-2000:]


def test_cli_errors_are_messages_not_tracebacks() -> None:
    """No node answered: exit 3, which a script tells from "absent" (exit 1; both were 1)."""
    for command in (["get", "k"], ["store", "k", "1", "--ttl", "60"]):
        dead = _run(*command, "--initial-peers", "/ip4/127.0.0.1/tcp/1")
        assert dead.returncode == 3, (command, dead.stderr)
        assert "unreachable: none of the 1 initial peers answered" in dead.stderr
        assert "Traceback" not in dead.stderr


def test_get_help_names_each_exit_code() -> None:
    helped = subprocess.run(
        [*CMD, "get", "--help"], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=60
    )
    text = " ".join(helped.stdout.split())
    assert "1 get: not found" in text and "3 no node answered" in text


def test_dht_needs_no_jax() -> None:
    code = (
        "import sys; sys.modules['jax'] = None; sys.modules['flax'] = None\n"
        "import p2p, p2p.dht, p2p.dht.__main__, p2p.dht.memnet\n"
        "assert not any(m.split('.')[0] in ('jax', 'flax', 'optax', 'dedloc_jax', 'models')\n"
        "               for m, v in sys.modules.items() if v is not None)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    helped = subprocess.run(
        [*CMD, "--help"], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=60
    )
    assert helped.returncode == 0 and "serve" in helped.stdout


def _strict(text: str):
    def bad(name: str):
        raise AssertionError(f"{name} in the output is not JSON")

    return json.loads(text, parse_constant=bad)


def test_cli_shadow_attack_is_refused_and_output_is_strict_json(servers) -> None:
    procs, addrs = servers
    owner = _run("store", "run.progress", '{"epoch": 3}', "--ttl", "120", "--owned",
                 "--initial-peers", addrs[1])  # fmt: skip
    assert owner.returncode == 0, owner.stderr
    attack = _run("store", "run.progress", '"x"', "--ttl", "600000", "--initial-peers", addrs[2])
    assert attack.returncode == 1
    assert "signed subkeys" in attack.stderr, attack.stderr
    got = _strict(_run("get", "run.progress", "--initial-peers", addrs[3]).stdout)
    assert list(got.values()) == [{"epoch": 3}]

    # values JSON cannot hold come back tagged, distinct from look-alike strings
    for key, value, flag in (
        ("v.bytes", '{"$bytes": "aGk="}', ()),
        ("v.text", "base64:aGk=", ("--string",)),
        ("v.nan", '[{"$float": "nan"}, {"$float": "-inf"}, {"$$bytes": 1}]', ()),
    ):
        res = _run("store", key, value, *flag, "--ttl", "120", "--initial-peers", addrs[0])
        assert res.returncode == 0, res.stderr
    assert _strict(_run("get", "v.bytes", "--initial-peers", addrs[1]).stdout) == {"$bytes": "aGk="}
    assert _strict(_run("get", "v.text", "--initial-peers", addrs[1]).stdout) == "base64:aGk="
    assert _strict(_run("get", "v.nan", "--initial-peers", addrs[1]).stdout) == [
        {"$float": "nan"},
        {"$float": "-inf"},
        {"$$bytes": 1},
    ]


def test_cli_store_refuses_malformed_json_before_any_network() -> None:
    for bad in ("hello", '{"a": NaN}', "[1, 2", '{"$bytes": 5}'):
        res = _run("store", "k", bad, "--ttl", "5", "--initial-peers", "/ip4/127.0.0.1/tcp/1")
        assert res.returncode == 2, (bad, res.stderr)
        assert "Traceback" not in res.stderr and "none of the" not in res.stderr


def test_every_option_says_what_it_takes() -> None:
    """A new user's `serve --help` listed --listen, --initial-peers, --config and -v with no
    word on what they take (nor that serve listens on loopback unless told)."""
    from p2p.dht.__main__ import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        for action in parser._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_the_readme_names_the_exit_codes_the_cli_returns() -> None:
    from p2p.dht.__main__ import EXIT_NO, EXIT_UNREACHABLE

    readme = (ROOT / "README.md").read_text()
    section = " ".join(readme.split("## The DHT on its own")[1].split("\n## ")[0].split())
    assert f"{EXIT_NO} when the DHT answered no" in section
    assert f"{EXIT_UNREACHABLE} when no node answered" in section
