"""Private runs from the command line: ``invite`` writes an invitation; a trainer or aux peer
that peers would refuse (no invitation, another peer's, a forged or expired one, the wrong
role) is refused at start with a message saying what to do; the owner key, invitation and
``--robust-tau`` reach the collaboration's config."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from dedloc_jax import access
from examples.sahajbert import trainer
from examples.sahajbert.__main__ import (
    explicit_flags,
    invited_run_id,
    main,
    net_config,
    parse_args,
    trainer_config,
)
from p2p.identity import Identity

PEERS = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWExample"


@pytest.fixture
def run(tmp_path: Path, capsys: pytest.CaptureFixture) -> dict[str, Any]:
    """An owner key, a volunteer's key, and the owner's invitation of that volunteer."""
    owner_key, me_key = tmp_path / "owner.key", tmp_path / "me.key"
    me = Identity.load_or_create(me_key)
    inv = tmp_path / "me.invitation"
    argv = ["invite", "--owner-key", str(owner_key), "--peer", str(me.peer_id),
            "--expires", "7d", "--out", str(inv)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    owner = Identity.load(owner_key)
    assert f"--owner {owner.public_key.hex()}" in out
    return {"owner": owner, "hex": owner.public_key.hex(), "me": me, "me_key": me_key, "inv": inv}


def _trainer(run: dict, *extra: str) -> list[str]:
    return ["trainer", "--initial-peers", PEERS, "--owner", run["hex"], *extra]


def _refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_an_invited_trainer_starts_with_the_owner_key_and_its_invitation(run) -> None:
    args = parse_args(_trainer(run, "--identity", str(run["me_key"]), "--invitation",
                               str(run["inv"]), "--robust-tau", "2.5"))  # fmt: skip
    net = net_config(args)
    assert net.owner_public_key == run["owner"].public_key
    assert net.invitation == run["inv"].read_bytes() and net.robust_tau == 2.5
    inv = access.Invitation.from_bytes(net.invitation)
    inv.verify(run["owner"].public_key, run["me"].peer_id, time.time(), "sahajbert")
    assert inv.expiry == pytest.approx(time.time() + 7 * 86400, abs=60)


def test_an_uninvited_trainer_is_refused_with_what_to_do(run, capsys) -> None:
    err = _refused(_trainer(run, "--identity", str(run["me_key"])), capsys)
    assert "is private" in err and f"invite --peer {run['me'].peer_id}" in err
    err = _refused(_trainer(run), capsys)  # no stable peer ID to invite
    assert "needs --identity" in err


def test_invitations_of_others_forged_or_expired_are_refused(run, tmp_path, capsys) -> None:
    other = tmp_path / "other.key"
    err = _refused(_trainer(run, "--identity", str(other), "--invitation", str(run["inv"])), capsys)
    assert "does not admit this peer" in err and "invitation is for" in err
    forger = Identity.generate()
    forged = tmp_path / "forged"
    forged.write_bytes(access.invite(forger, "sahajbert", run["me"].peer_id, time.time() + 60))
    argv = _trainer(run, "--identity", str(run["me_key"]), "--invitation", str(forged))
    assert "not signed by the run's owner" in _refused(argv, capsys)
    old = tmp_path / "old"
    old.write_bytes(access.invite(run["owner"], "sahajbert", run["me"].peer_id, time.time() - 1))
    argv = _trainer(run, "--identity", str(run["me_key"]), "--invitation", str(old))
    assert "expired" in _refused(argv, capsys)
    argv = _trainer(run, "--identity", str(run["me_key"]), "--invitation", str(run["inv"]),
                    "--run-id", "another")  # fmt: skip
    assert "not 'another'" in _refused(argv, capsys)


def test_an_invitation_admits_its_role_only(run, tmp_path, capsys) -> None:
    client = tmp_path / "client.inv"
    argv = ["invite", "--owner-key", str(tmp_path / "owner.key"), "--peer",
            str(run["me"].peer_id), "--expires", "2099-01-01", "--role", "client",
            "--out", str(client)]  # fmt: skip
    assert main(argv) == 0
    base = _trainer(run, "--identity", str(run["me_key"]), "--invitation", str(client))
    assert "for role 'client', not 'node'" in _refused(base, capsys)
    assert net_config(parse_args([*base, "--client-mode"])).invitation == client.read_bytes()


def test_invite_rejects_bad_input(tmp_path, capsys) -> None:
    key = str(tmp_path / "owner.key")
    me = str(Identity.generate().peer_id)
    for expires, peer, message in [
        ("soon", me, "give a duration"),
        ("2001-01-01", me, "has passed"),
        ("7d", "<script>", "is not a peer ID"),
    ]:
        argv = ["invite", "--owner-key", key, "--peer", peer, "--expires", expires]
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert main(["trainer", "--initial-peers", PEERS, "--owner", "zz"]) == 2
    assert "public key in hex" in capsys.readouterr().err


def test_identity_prints_the_peer_id_and_the_public_key(run, tmp_path, capsys) -> None:
    assert main(["identity", "--key", str(tmp_path / "none.key")]) == 2
    assert "--create makes one" in capsys.readouterr().err
    assert not (tmp_path / "none.key").exists()
    assert main(["identity", "--key", str(tmp_path / "owner.key")]) == 0
    out = capsys.readouterr().out
    assert run["hex"] in out and str(run["owner"].peer_id) in out and "--owner" in out
    assert main(["identity", "--key", str(tmp_path / "new.key"), "--create"]) == 0
    assert f"created {tmp_path / 'new.key'}" in capsys.readouterr().out


def test_a_failed_invite_still_prints_the_owner_public_key(run, tmp_path, capsys) -> None:
    argv = ["invite", "--owner-key", str(tmp_path / "owner.key"), "--peer", "<x>",
            "--expires", "7d"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is not a peer ID" in err and run["hex"] in err


def test_invite_and_a_volunteer_take_the_run_from_the_manifest_and_invitation(
    run, tmp_path, capsys
) -> None:
    """`invite --manifest RUN` admits to the prepared run's id; a volunteer with that
    invitation and no --run-id takes the invitation's run."""
    from examples.sahajbert import manifest
    from examples.sahajbert.config import TrainerConfig

    tok = tmp_path / "RUN" / "tokenizer" / manifest.TOKENIZER_FILE
    tok.parent.mkdir(parents=True)
    tok.write_text("{}")  # any file: load() checks its digest only
    made = manifest.build(TrainerConfig(run_id="foo", model="tiny"), tok, 900, "fp16")
    manifest.save(made, tok, tmp_path / "RUN")
    inv = tmp_path / "foo.invitation"
    base = ["invite", "--owner-key", str(tmp_path / "owner.key"), "--peer", str(run["me"].peer_id),
            "--expires", "7d", "--manifest", str(tmp_path / "RUN")]  # fmt: skip
    assert main([*base, "--out", str(inv)]) == 0
    assert "may join run 'foo'" in capsys.readouterr().out
    assert main([*base, "--run-id", "bar"]) == 2
    assert "--run-id bar contradicts the run's manifest (--run-id foo)" in capsys.readouterr().err
    argv = _trainer(run, "--identity", str(run["me_key"]), "--invitation", str(inv))
    args = parse_args(argv)
    args.run_id = invited_run_id(args, explicit_flags(argv))
    assert args.run_id == "foo"
    assert net_config(args).invitation == inv.read_bytes()


def test_the_coordinator_runs_as_the_owner_and_the_config_reaches_the_collaboration(
    run, tmp_path, monkeypatch
) -> None:
    key = tmp_path / "owner.key"
    args = parse_args(["coordinator", "--owner-key", str(key), "--robust-tau", "1.5"])
    net = net_config(args)
    assert net.identity == key and net.owner_public_key == run["owner"].public_key
    assert net.invitation is None  # the owner needs none

    seen: dict[str, Any] = {}

    class FakeCollaboration:
        def __init__(self, run_id: str, **kw: Any) -> None:
            seen.update(kw, run_id=run_id)
            self.addrs: list[str] = []
            self.peer_id = "x"

        def start(self) -> None:
            pass

    import dedloc_jax

    monkeypatch.setattr(dedloc_jax, "Collaboration", FakeCollaboration)
    trainer.open_collaboration(trainer_config(args), net, mode="aux")
    config = seen["config"]
    assert config.access.owner_public_key == run["owner"].public_key
    assert config.defence.robust_tau == 1.5
    assert seen["identity"].peer_id == run["owner"].peer_id  # the owner's own peer
