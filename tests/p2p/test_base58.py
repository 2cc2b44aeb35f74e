from hypothesis import given
from hypothesis import strategies as st

from p2p.base58 import b58decode, b58encode


@given(st.binary(max_size=64))
def test_round_trip(data: bytes) -> None:
    assert b58decode(b58encode(data)) == data


def test_leading_zeros_are_kept() -> None:
    assert b58encode(b"\0\0\x01") == "112"
    assert b58decode("112") == b"\0\0\x01"


def test_rejects_characters_outside_the_alphabet() -> None:
    for bad in ("0", "O", "I", "l", "+"):
        try:
            b58decode("abc" + bad)
        except ValueError as e:
            assert repr(bad) in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")
