"""A peer's averaging step around its round (dedloc_jax.rounds.stepping)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import trio
import trio.testing

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.progress import PeerProgress
from dedloc_jax.rounds.stepping import Stepper


@pytest.mark.parametrize("others_poll", [0.25, None], ids=["all-check-mid-step", "one-does-not"])
def test_the_round_begins_while_the_waiting_record_is_stored(others_poll: float | None) -> None:
    """A peer at the target stored its "waiting" progress record, then registered for the
    round: the store (0.08 s at 40 simulated peers) was on the path of every round, through
    the last peer to stop. When we and every expected peer check mid-step (each announces
    its poll) both go at once now, and the epoch moves on only after both; otherwise the
    store still comes first."""
    events: list[str] = []

    class Tracker:
        dht_latency = 0.05
        target = 8
        records = {"p1": PeerProgress("p1", 3, 8, 1.0, 0.0, poll=others_poll)}
        peer_id = "me"
        poll = 0.25  # we check mid-step (the default poll)

        def current_estimate(self) -> SimpleNamespace:
            return SimpleNamespace(max_step_interval=0.25, samples=8.0)

        async def freeze(self) -> None:
            await trio.sleep(0.5)  # a DHT store
            events.append("frozen")

        def set_epoch(self, epoch: int, *, state_follows: bool = False) -> None:
            events.append(f"epoch {epoch}")

        def contenders(self) -> dict:
            return {}

    class Rounds:
        early = None
        matchmaker = SimpleNamespace(needs_cross=lambda epoch: False, decline=lambda epoch: None)
        across = SimpleNamespace(close=lambda epoch: None)

        def member(self, weight: float) -> SimpleNamespace:
            return SimpleNamespace(weight=weight, mode="node", sends=True)

        async def group(self, epoch: int, me: object, **kw: object) -> None:
            events.append("registered")
            await trio.sleep(1.0)  # the others

    stepper = Stepper(
        Rounds(),  # type: ignore[arg-type]
        Tracker(),  # type: ignore[arg-type]
        SimpleNamespace(latest=None),  # type: ignore[arg-type]
        CollaborationConfig(target_batch_size=8),
    )

    async def main() -> None:
        await stepper.step(3, [np.ones(2, np.float32)], 8, codec="none", expected={"p1"})

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    if others_poll is not None:
        assert events == ["registered", "frozen", "epoch 4"], events
    else:
        assert events == ["frozen", "registered", "epoch 4"], events


def test_a_missing_peer_is_warned_of_once_and_a_new_problem_still_warns(caplog) -> None:
    """The policy behind "stepped without the whole collaboration" (:class:`Absences`): one
    WARNING naming a missing peer, DEBUG while the same peer is missing for the same cause;
    a newly missing peer, a new cause, a step short with nobody missing, and a missing peer
    whose record moves on (it trains apart, not stopped) warn again; one INFO line when a
    peer is back in our group or its record is gone."""
    from dedloc_jax.rounds.stepping import Absences

    b, c = "Bbbbbbbbbbbb", "Cccccccccccc"
    tracker = SimpleNamespace(peer_id="me", records={b: PeerProgress(b, 4, 8, 1.0, 0.0)})
    absences = Absences(tracker)  # type: ignore[arg-type]
    said: list[tuple[int, str]] = []

    def step(epoch: int, members: set[str], cause: str = "alone") -> None:
        absences.settle(epoch, members)
        level, tail = absences.judge(members, cause)
        said.append((level, tail))

    with caplog.at_level(logging.INFO, logger="dedloc_jax.rounds.stepping"):
        step(5, {"me"})
        step(6, {"me"})
        step(7, {"me"})
        assert [lv for lv, _ in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
        assert "Bbbbbbbb (its record at epoch 4)" in said[0][1]
        tracker.records[c] = PeerProgress(c, 8, 8, 1.0, 0.0)  # a new peer, missing too
        step(8, {"me"})
        assert said[-1][0] == logging.WARNING and "Cccccccc" in said[-1][1]
        step(9, {"me", c}, "some members' sparse payloads never came")  # a new cause
        assert said[-1][0] == logging.WARNING and "Bbbbbbbb" in said[-1][1]
        step(10, {"me", b, c}, "phase P failed")  # nobody missing: the members' failure
        assert said[-1] == (logging.WARNING, "")
        step(11, {"me", c})
        tracker.records[b] = PeerProgress(b, 11, 8, 1.0, 0.0)  # it moved on: trains apart
        step(12, {"me", c})
        step(13, {"me", c})
        assert [lv for lv, _ in said[-3:]] == [logging.WARNING, logging.WARNING, logging.DEBUG]
        del tracker.records[b]  # its record lapsed
        step(14, {"me", c})
        step(15, {"me", c})
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("INFO", "epoch 9: peer Cccccccc is back in our group"),
        ("INFO", "epoch 10: peer Bbbbbbbb is back in our group"),
        ("INFO", "epoch 14: peer Bbbbbbbb left the progress table: not missed"),
    ], lines


def test_a_peer_left_alone_says_so_once() -> None:
    """A trainer whose mates stopped (--max-epochs) steps alone by design: it logged "stepped
    without the whole collaboration" at INFO every epoch to the end. Now INFO once, DEBUG
    while it stays alone, INFO again after it averaged with others."""
    from dedloc_jax.rounds.stepping import Absences

    absences = Absences(SimpleNamespace(peer_id="me", records={}))  # type: ignore[arg-type]
    levels = [absences.alone() for _ in range(3)]
    absences.settle(9, {"me", "other"})  # a group of two
    levels.append(absences.alone())
    assert levels == [logging.INFO, logging.DEBUG, logging.DEBUG, logging.INFO]
