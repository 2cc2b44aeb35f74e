"""Messages from the network are validated before anything is taken from them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedloc_jax.averaging import wire
from dedloc_jax.averaging.errors import BadContributionError

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_parsers_reject_garbage_with_one_error_class(msg):
    for parse in (
        wire.parse_hello,
        lambda m: wire.parse_chunk(m, 0, 4),
        lambda m: wire.parse_contributors(m, frozenset({0, 1})),
        lambda m: wire.parse_need(m, 3),
        wire.kind_of,
    ):
        try:
            parse(msg)
        except BadContributionError:
            pass


def test_hello_roundtrip_and_field_checks():
    h = wire.Hello(b"r", b"g", 2, 3.0, 10, "fp16", False, 1, 4)
    assert wire.parse_hello(wire.hello(h)) == h
    for key, bad in (("w", float("nan")), ("w", -1.0), ("n", -5), ("s", "2"), ("a", 1)):
        msg = wire.hello(h)
        msg[key] = bad
        with pytest.raises(BadContributionError):
            wire.parse_hello(msg)


def test_chunks_and_contributors_are_checked_against_what_we_expect():
    msg = wire.result(3, b"abcd", [0, 2])
    assert wire.parse_chunk(msg, 3, 4) == b"abcd"
    with pytest.raises(BadContributionError):
        wire.parse_chunk(msg, 4, 4)  # out of order
    with pytest.raises(BadContributionError):
        wire.parse_chunk(msg, 3, 8)  # wrong size
    assert wire.parse_contributors(msg, frozenset({0, 1, 2})) == {0, 2}
    with pytest.raises(BadContributionError):
        wire.parse_contributors(msg, frozenset({0, 1}))  # names a non-sender
    with pytest.raises(BadContributionError):
        wire.parse_contributors(wire.result(0, b"", [1, 1]), frozenset({0, 1}))
    with pytest.raises(BadContributionError):
        wire.parse_need(wire.need((0, 5), (0, 1)), 3)
    assert wire.parse_need(wire.need((1, 2), (2, 3)), 3) == ((1, 2), (2, 3))
