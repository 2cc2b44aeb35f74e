"""In a private run the manifest and tokenizer RPCs admit invited peers only.

The owner's peer (as the coordinator runs it: a collaboration with the owner key, serving the
signed manifest) answers a fetch from an invited peer; a peer with no invitation, a forged one
or an expired one is refused, and its fetch ends at once with the reason and what to do.
"""

from __future__ import annotations

import time

import pytest

from dedloc_jax import AccessConfig, Collaboration, CollaborationConfig, ReachabilityConfig, access
from examples.sahajbert import manifest, trainer
from examples.sahajbert.config import TrainerConfig
from models.text.corpus import write_corpus
from models.text.sources import read_local_documents
from models.text.tokenizer import train_tokenizer
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(300)
RUN = "private-serving"


@pytest.fixture(scope="module")
def owner_peer(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("owner")
    text = tmp / "text.txt"
    write_corpus(text, 40, seed=3)
    tok_dir = tmp / "tok"
    train_tokenizer(read_local_documents(text), 200, tok_dir)
    tok_file = tok_dir / manifest.TOKENIZER_FILE
    cfg = TrainerConfig().replace(model="tiny", run_id=RUN, seq_length=32)
    made = manifest.build(cfg, tok_file, 200, "none")
    owner = Identity.generate()
    config = CollaborationConfig.local_demo(32)
    config = config.replace(
        access=AccessConfig(owner_public_key=owner.public_key),
        reachability=ReachabilityConfig(detect=False),
        links=config.links.replace(measure=False),
        mode="aux",
    )
    collab = Collaboration(RUN, identity=owner, config=config)
    collab.start()
    try:
        trainer.serve_manifest(collab, manifest.sign(made, owner), tok_file)
        yield {"collab": collab, "owner": owner, "made": made, "tmp": tmp}
    finally:
        collab.close()


def _fetch(peer: dict, name: str, identity: Identity | None, invitation: bytes | None):
    key = None
    if identity is not None:
        key = peer["tmp"] / f"{name}.key"
        identity.save(key)
    return manifest.fetch(
        trainer.dialable(peer["collab"])[:1],
        run_id=RUN,
        work_dir=peer["tmp"] / name,
        owner=peer["owner"].public_key,
        identity=key,
        invitation=invitation,
        timeout=60,
    )


def test_an_invited_peer_gets_the_manifest_and_tokenizer(owner_peer) -> None:
    me = Identity.generate()
    inv = access.invite(owner_peer["owner"], RUN, me.peer_id, time.time() + 600)
    got, envelope, tok_dir = _fetch(owner_peer, "invited", me, inv)
    assert got == owner_peer["made"]
    tok = tok_dir / manifest.TOKENIZER_FILE
    assert manifest.sha256_file(tok) == got.tokenizer_sha256


def test_uninvited_forged_and_expired_callers_are_refused_with_the_reason(owner_peer) -> None:
    owner = owner_peer["owner"]
    forger = Identity.generate()
    cases = []
    me = Identity.generate()
    cases.append((me, None, "has no invitation"))
    me = Identity.generate()
    cases.append((me, access.invite(forger, RUN, me.peer_id, time.time() + 600), "not signed"))
    me = Identity.generate()
    cases.append((me, access.invite(owner, RUN, me.peer_id, time.time() - 5), "expired"))
    me = Identity.generate()  # another peer's invitation
    cases.append((me, access.invite(owner, RUN, owner.peer_id, time.time() + 600), "is for"))
    for i, (me, inv, why) in enumerate(cases):
        started = time.monotonic()
        with pytest.raises(manifest.ManifestError) as e:
            _fetch(owner_peer, f"refused{i}", me, inv)
        text = str(e.value)
        assert manifest.REFUSED in text and why in text, text
        assert f"refused this peer ({me.peer_id})" in text and "--invitation FILE" in text
        assert time.monotonic() - started < 30  # refused, not retried until the timeout
        assert not (owner_peer["tmp"] / f"refused{i}" / "tokenizers").exists()
    # an open-run client (no owner key, a throwaway identity) is refused too
    with pytest.raises(manifest.ManifestError, match="refused this peer"):
        manifest.fetch(
            trainer.dialable(owner_peer["collab"])[:1],
            run_id=RUN,
            work_dir=owner_peer["tmp"] / "open",
            timeout=60,
        )
    # the owner's peer kept serving: an invited peer still gets it
    me = Identity.generate()
    inv = access.invite(owner, RUN, me.peer_id, time.time() + 600)
    assert _fetch(owner_peer, "after", me, inv)[0] == owner_peer["made"]
