"""The gathering's wait when nobody is expected (dedloc_jax.rounds.matchmaking)."""

from __future__ import annotations

from types import SimpleNamespace

import trio
import trio.testing

from dedloc_jax.rounds.matchmaking import Matchmaker, _Gathering


def test_a_gathering_with_nobody_expected_ends_at_its_window_in_virtual_time() -> None:
    """With nobody expected the gathering slept ``window - elapsed`` and compared ``now -
    start >= window``: here the wake-up lands on ``start + window`` (16.641) but ``now -
    start`` is 2.3389999999999986, one ulp short of the window, so it slept 1e-15 s (which
    moves no float clock at 16.6) for ever. A peer alone after its mate's kill -9 hung the
    simulator so at its epoch 4. It now waits until the instant and compares instants."""
    start, began, window = 14.302, 14.471, 2.339
    reads: list[float] = []

    async def registrations(registry, *, sweep=False, states=None) -> dict:
        reads.append(trio.current_time())
        if len(reads) > 50:
            raise AssertionError("the gathering keeps reading at one instant")
        return {}

    matchmaker = object.__new__(Matchmaker)
    matchmaker.eager = False
    matchmaker._registrations = registrations  # type: ignore[method-assign]
    matchmaker._too_late = lambda slot, expected: False  # type: ignore[method-assign]
    g = _Gathering(
        registry=None,  # type: ignore[arg-type]
        me=None,  # type: ignore[arg-type]
        target=0.0,
        expected=set(),
        deadlines=SimpleNamespace(window=window, eager=False),  # type: ignore[arg-type]
        start=start,
    )

    async def main() -> bool:
        await trio.sleep_until(began)
        return await matchmaker._read_until_gathered((3, 0), g)

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert reads == [start + window] * 2  # one read at the window's end, then the sweep
