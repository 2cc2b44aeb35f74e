"""Identity: key files, peer ID text form, signatures."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.base58 import ALPHABET, b58decode, b58encode
from p2p.errors import IdentityError
from p2p.identity import Identity, PeerID, verify_signature


def test_save_writes_owner_only_file_and_load_round_trips(tmp_path):
    ident = Identity.generate()
    path = tmp_path / "key.pem"
    ident.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = Identity.load(path)
    assert loaded.peer_id == ident.peer_id
    assert loaded.public_key == ident.public_key
    assert loaded.private_bytes() == ident.private_bytes()
    assert not (tmp_path / "key.pem.tmp").exists()


def test_save_overwrites_and_fixes_permissions(tmp_path):
    path = tmp_path / "key.pem"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    ident = Identity.generate()
    ident.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).peer_id == ident.peer_id


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o666])
def test_load_refuses_files_others_can_read(tmp_path, mode):
    path = tmp_path / "key.pem"
    Identity.generate().save(path)
    os.chmod(path, mode)
    with pytest.raises(IdentityError, match="readable by others"):
        Identity.load(path)


def test_load_reports_missing_and_garbage_files(tmp_path):
    with pytest.raises(IdentityError, match="cannot read"):
        Identity.load(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot base64 at all\n")
    os.chmod(garbage, 0o600)
    with pytest.raises(IdentityError, match="no valid key"):
        Identity.load(garbage)


def test_load_refuses_non_ed25519_keys(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import x25519

    pem = x25519.X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = tmp_path / "x.pem"
    path.write_bytes(pem)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="not an Ed25519 key"):
        Identity.load(path)


def test_load_or_create_is_stable(tmp_path):
    path = tmp_path / "node.key"
    first = Identity.load_or_create(path)
    second = Identity.load_or_create(path)
    assert first.peer_id == second.peer_id
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_from_seed_is_deterministic_and_seed_sensitive():
    assert Identity.from_seed(b"a").peer_id == Identity.from_seed(b"a").peer_id
    assert Identity.from_seed(b"a").peer_id != Identity.from_seed(b"b").peer_id
    assert Identity.from_seed(bytes(32)).peer_id == Identity.from_seed(bytes(32)).peer_id


def test_peer_id_is_hash_of_public_key():
    ident = Identity.from_seed(b"peer")
    assert ident.peer_id.matches(ident.public_key)
    assert not ident.peer_id.matches(Identity.from_seed(b"other").public_key)
    assert PeerID.from_public_key(ident.public_key) == ident.peer_id
    with pytest.raises(IdentityError):
        PeerID.from_public_key(b"short")


def test_signatures_verify_only_for_the_right_key_and_data():
    ident, other = Identity.from_seed(b"s1"), Identity.from_seed(b"s2")
    sig = ident.sign(b"hello")
    assert verify_signature(ident.public_key, sig, b"hello")
    assert not verify_signature(ident.public_key, sig, b"hellO")
    assert not verify_signature(other.public_key, sig, b"hello")
    bad = bytes([sig[0] ^ 1]) + sig[1:]
    assert not verify_signature(ident.public_key, bad, b"hello")
    assert not verify_signature(ident.public_key, sig[:-1], b"hello")
    assert not verify_signature(b"\xff" * 32, sig, b"hello")


def test_peer_id_text_round_trip_and_ordering():
    ids = [Identity.from_seed(bytes([i])).peer_id for i in range(20)]
    for pid in ids:
        text = str(pid)
        assert text == pid.to_base58()
        assert PeerID.from_base58(text) == pid
        assert pid.to_bytes() == pid.digest
        assert text in repr(pid)
    assert sorted(ids) == sorted(ids, key=lambda p: p.digest)
    assert len(set(ids)) == 20


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0OIl",  # characters outside the base58 alphabet
        "abc",  # valid base58, wrong length
        "1" * 31,  # 31 zero bytes
        "1" * 33,
        "z" * 45,  # too many bytes
        "z" * 5000,  # long input is refused before any big-integer work
        " " + str(Identity.from_seed(b"x").peer_id),
    ],
)
def test_malformed_peer_ids_raise_identity_error(text):
    with pytest.raises(IdentityError, match="malformed peer ID"):
        PeerID.from_base58(text)


def test_peer_id_rejects_wrong_digest():
    with pytest.raises(IdentityError):
        PeerID(b"\x00" * 31)
    with pytest.raises(IdentityError):
        PeerID(bytearray(32))  # type: ignore[arg-type]


@settings(deadline=None, derandomize=True, database=None)
@given(st.binary(min_size=32, max_size=32))
def test_peer_id_base58_round_trip_property(digest):
    pid = PeerID(digest)
    assert PeerID.from_base58(pid.to_base58()) == pid


@settings(deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=64))
def test_base58_round_trip_property(data):
    assert b58decode(b58encode(data)) == data


@settings(deadline=None, derandomize=True, database=None)
@given(st.text(max_size=80))
def test_peer_id_parsing_never_raises_anything_else(text):
    try:
        pid = PeerID.from_base58(text)
    except IdentityError:
        return
    assert str(pid) == text  # base58 is canonical: only one text per peer ID


@settings(deadline=None, derandomize=True, database=None)
@given(st.text(alphabet=ALPHABET, min_size=40, max_size=48))
def test_valid_alphabet_text_parses_or_fails_cleanly(text):
    try:
        pid = PeerID.from_base58(text)
    except IdentityError:
        return
    assert len(pid.to_bytes()) == 32
