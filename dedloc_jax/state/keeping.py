"""Keeping a peer in step with the collaboration: :func:`keep_in_step`.

Called once per micro-step after the train step, it makes a training loop follow the run:

- on its first call, a newcomer (or a restarted peer) loads the run's current state when
  other peers serve a newer one than it holds, else serves its own;
- after every step this peer took, it serves the new state;
- it asks whether the state it serves lost the fork choice to a lineage more peers hold (a
  healed partition, a step alone while the others averaged): ``fork_check_after`` seconds
  into each epoch and every ``fork_recheck`` seconds after, and at once after a step taken
  without the whole collaboration or at the end of an epoch too short to have been checked;
  when it lost, it loads the winner's state (an older one too), with a few retries;
- when the others are at a newer epoch and a newer state is served, it loads it.

A fork check is patient without blocking: while it cannot tell (most peers still average the
epoch), it is asked again every ``fork_poll`` seconds, at the next calls, for up to
``fork_patience`` seconds into the epoch. Then it counts as "not lost", except after a step
without the whole collaboration: that peer is most likely the odd one out, and it loads
the state the fork choice names. By default no call waits on a check: the
training thread goes on with its micro-steps while the others finish averaging (and may train
on its lone state until the check tells). ``fork_hold`` lets a call after such a step wait
instead, polling, for up to that many seconds into the epoch, until it knows which state to
train on (the simulator's soak holds its peers so).

The policy is :class:`StepKeeper`, written without I/O in the style of a sans-IO protocol: it
yields requests (serve, load, ask the fork check, sleep) and the driver answers them. The
synchronous driver (:func:`keep_in_step`, for a :class:`dedloc_jax.Collaboration` and JAX
pytrees) and the asynchronous one (:func:`keep_in_step_async`, for a
:class:`~dedloc_jax.peer.CollaborationPeer`, e.g. in the simulator) share it. The
decision whether anything is due reads only host-side figures (the progress snapshot, the
epoch the transform last reported); nothing reads the DHT on the calling thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import trio

from dedloc_jax.state.download import StaleStateError, StateSyncError
from dedloc_jax.state.training import collaboration_state, share_state, sync_state
from dedloc_jax.state.transform_states import outer_params_after_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeepConfig:
    """Timings of :class:`StepKeeper` (seconds). The defaults suit runs whose rounds take
    seconds to tens of seconds; a simulation of short epochs shortens them."""

    fork_check_after: float = 5.0  # into an epoch: the others have announced its state by then
    fork_recheck: float = 10.0  # and again this often until the epoch ends
    # A check that cannot tell yet (most peers still average the epoch) is asked again every
    # fork_poll seconds until fork_patience seconds into the epoch (see the module docstring).
    fork_patience: float = 30.0
    fork_poll: float = 1.0
    # After a step without the whole collaboration, a call may wait (polling) this long into
    # the epoch for the check to tell, rather than train on (0: never waits).
    fork_hold: float = 0.0
    lost_loads: int = 3  # downloads tried when our lineage lost the fork check
    behind_recheck: float = 1.0  # between looks for a newer state while behind
    # A history-less peer (it served its own initial state: nothing loaded, no step since)
    # asks the download's choice again this often while a state ahead is announced.
    fresh_recheck: float = 5.0
    retry: float = 1.0  # between download attempts
    load_timeout: float = 60.0  # one state download at most


# --- what the policy asks of its driver --------------------------------------------------
# Frozen dataclasses, not tuples: requests of different kinds never compare equal.
@dataclass(frozen=True)
class Serve:
    """Serve the state this peer holds now. Answer: None."""


@dataclass(frozen=True)
class Load:
    """Load the state the fork choice names (``min_epoch``: not one older than that), and
    serve it. Answer: the epoch loaded, :data:`STALE` (theirs is older: nothing changed) or
    :data:`FAILED` (nobody served one, or the download failed)."""

    min_epoch: int | None


@dataclass(frozen=True)
class ForkLost:
    """Whether our served state lost to another lineage, asked once (no waiting). Answer:
    True, False, or None while it cannot tell yet."""


@dataclass(frozen=True)
class NewerServed:
    """Whether a download would bring a state newer than ``epoch``. Answer: bool; with
    ``strict``, False also when no state can be chosen (else True: try the download)."""

    epoch: int
    strict: bool = False


@dataclass(frozen=True)
class Sleep:
    """Sleep. Answer: the time after it (the clock of :attr:`Observation.now`)."""

    seconds: float


STALE, FAILED = "stale", "failed"
Request = Serve | Load | ForkLost | NewerServed | Sleep


class Observation(NamedTuple):
    """What the driver sees after a micro-step."""

    now: float
    epoch: int  # the epoch of the state this peer holds
    complete: bool  # its last step averaged with the whole collaboration
    others_train: bool  # the progress table names another peer that computes gradients
    newest_served: int | None  # the newest epoch another peer serves a state of
    behind: bool  # the collaboration is at a newer epoch than ours
    newest_announced: int | None = None  # newest_served, backed or not


class StepKeeper:
    """The policy behind :func:`keep_in_step`, for one peer (see the module docstring)."""

    def __init__(self, config: KeepConfig = KeepConfig()) -> None:
        self.config = config
        self.epoch: int | None = None  # the epoch we last saw (None: never called)
        self.checked = False  # this epoch's fork check answered (or could not tell in time)
        self._epoch_started = 0.0
        self._next_check = math.inf  # when the fork check is due next
        self._patient_until = -math.inf  # this epoch's check waits for an answer until
        self._suspect = False  # the epoch began with a step without the whole collaboration
        self._said_suspect = False  # the last step was one too (its line said at INFO)
        self._behind_checked = -math.inf
        self._fresh = False  # history-less: serves its own initial state (see _look_again)
        self._fresh_checked = -math.inf
        # figures for tests and benchmarks
        self.loads = 0  # states loaded
        self.forks = 0  # of them, after our lineage lost a fork check
        self.resyncs = 0  # times a newer state was served while we were behind
        self.load_failures = 0  # downloads that failed (nobody served one, or it broke off)

    def due(self, now: float, epoch: int | None, behind: bool) -> bool:
        """Whether :meth:`plan` may do anything now (cheap: no request, no hop); ``epoch``:
        the epoch the transform last reported (None: unknown)."""
        if self.epoch is None or (epoch is not None and epoch != self.epoch):
            return True
        if now >= self._next_check:
            return True
        if self._fresh and now - self._fresh_checked > self.config.fresh_recheck:
            return True
        return behind and now - self._behind_checked > self.config.behind_recheck

    def _enter(self, epoch: int, now: float) -> None:
        self.epoch = epoch
        self.checked = False
        self._epoch_started = now
        self._next_check = now + self.config.fork_check_after
        self._patient_until = now + self.config.fork_patience
        self._suspect = False

    def plan(self, obs: Observation) -> Generator[Request, Any, None]:
        """The requests for this micro-step; the driver sends each one's answer back."""
        c = self.config
        if self.epoch is None:  # the first call: a newcomer takes the run's state
            self._enter(obs.epoch, obs.now)
            newer = obs.newest_served is not None and obs.newest_served > obs.epoch
            if not newer and (obs.newest_announced or -1) > obs.epoch:
                # A state ahead that the table does not back: a coordinator's copy once every
                # trainer left (an aux peer claims no samples; newcomers restarted at epoch 0).
                # The download's choice, defended by our roots' trust, decides on it.
                newer = yield NewerServed(obs.epoch, strict=True)
            if newer and isinstance((yield from self._load(None, obs.now)), int):
                return
            yield Serve()
            self._fresh, self._fresh_checked = True, obs.now
            return
        if self._fresh and (yield from self._look_again(obs)):
            return
        if obs.epoch != self.epoch:  # this peer stepped
            unchecked = not self.checked
            self._enter(obs.epoch, obs.now)
            yield Serve()
            self._suspect = not obs.complete and obs.others_train
            if self._suspect:
                # (the round already warned, naming why: one event, one WARNING). Said at
                # INFO once per run of such steps, not at every step until a record lapses.
                log.log(
                    logging.DEBUG if self._said_suspect else logging.INFO,
                    "epoch %d: stepped without the whole collaboration; checking our lineage",
                    obs.epoch,
                )
            self._said_suspect = self._suspect
            # An epoch shorter than fork_check_after had no check: ask now (the verdict on
            # the new state covers the lineage it descends from), or a lost lineage outlives
            # several epochs.
            if self._suspect or unchecked:
                yield from self._check(obs)
            return
        if obs.now >= self._next_check:
            yield from self._check(obs)
            if self.epoch != obs.epoch:
                return  # loaded the winner's state
        if obs.behind and obs.now - self._behind_checked > c.behind_recheck:
            self._behind_checked = obs.now
            if (yield NewerServed(obs.epoch)):
                self.resyncs += 1
                log.info("epoch %d: the collaboration is ahead; loading its state", obs.epoch)
                yield from self._load(None, obs.now)

    def _look_again(self, obs: Observation) -> Generator[Request, Any, bool]:
        """A history-less peer asks the download's choice again (as its first call did) while
        a state ahead is announced; whether it loaded one. Its first call may have chosen
        nothing (a failed or early progress read), and with no trainer around nothing else
        looks. It stops once it stepped or loaded, or after ``lost_loads`` failed downloads
        (a stranger's made-up state, renamed at each republish, would keep it trying)."""
        c = self.config
        if obs.epoch != self.epoch or self.load_failures >= c.lost_loads:
            self._fresh = False  # it stepped (its own lineage now), or gave up
            return False
        if obs.now - self._fresh_checked <= c.fresh_recheck:
            return False
        self._fresh_checked = obs.now  # (paced when nothing is ahead too: see due)
        if (obs.newest_announced or -1) <= obs.epoch:
            return False
        if not (yield NewerServed(obs.epoch, strict=True)):
            return False
        if isinstance((yield from self._load(None, obs.now)), int):
            self._fresh = False
            return True
        return False

    def _check(self, obs: Observation) -> Generator[Request, Any, None]:
        """Ask whether our lineage lost (patiently: see the module docstring); load the
        winner's state when it did."""
        c, now, epoch = self.config, obs.now, obs.epoch
        hold_until = self._epoch_started + c.fork_hold if self._suspect else -math.inf
        while True:
            patient = now < self._patient_until
            verdict = yield ForkLost()
            if verdict is None:
                if patient and now < hold_until:
                    now = yield Sleep(c.fork_poll)
                    continue
                if patient:
                    self._next_check = now + c.fork_poll
                    return
                log.info("epoch %d: the fork check could not tell in time", epoch)
                verdict = self._suspect  # after a step without the others: ours is the odd one
            self.checked = True
            # The first check is due fork_check_after into the epoch even when one answered
            # at its start (the others' states had not all landed), the next fork_recheck later.
            first = self._epoch_started + c.fork_check_after
            self._next_check = first if now < first else now + c.fork_recheck
            if not verdict:
                return
            # Another lineage, held by more peers, won (after a partition healed, each side
            # having averaged apart; or we stepped alone): take theirs.
            log.warning("epoch %d: our state lost to the majority's; loading it", epoch)
            yield from self._adopt(epoch, now)
            return

    def _adopt(self, epoch: int, now: float) -> Generator[Request, Any, None]:
        """Load the winner's state, trying ``lost_loads`` times: whatever its epoch. The
        winners never come to a lineage they beat, so a loser that kept its newer state (one
        restarted or slow, the other stepping alone meanwhile) stepped alone on both sides
        for as long as it stayed ahead; states that must not win (an aux peer's copy, a
        newcomer's own initial one) are no votes in the fork choice instead."""
        for attempt in range(self.config.lost_loads):
            if attempt:
                now = yield Sleep(self.config.retry)
            got = yield from self._load(None, now)
            if isinstance(got, int):
                self.forks += 1
                return
        log.info("keeping this peer's state of epoch %d: no download succeeded", epoch)

    def _load(self, min_epoch: int | None, now: float) -> Generator[Request, Any, int | str]:
        got = yield Load(min_epoch)
        if isinstance(got, int):
            self.loads += 1
            self._enter(got, now)
        elif got == FAILED:
            self.load_failures += 1
        return got


def run_plan(plan: Generator[Request, Any, None], answer: Callable[[Request], Any]) -> None:
    """Drive ``plan`` synchronously, answering each request with ``answer``."""
    try:
        request = next(plan)
        while True:
            request = plan.send(answer(request))
    except StopIteration:
        pass


def _newer(newest: int | None, request: NewerServed) -> bool:
    """The answer to ``request`` when a download would bring ``newest`` (None: none chosen)."""
    if newest is None:
        return not request.strict
    return newest > request.epoch


# --- the synchronous driver: a Collaboration and JAX pytrees ------------------------------
def keep_in_step(collab: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
    """Keep this peer in step with the collaboration; call once per micro-step, after the
    train step, and go on with what it returns.

    Returns ``(params, opt_state)``: the same objects when there is nothing to do, else the
    state loaded from the others (see the module docstring for when). ``collab`` is the
    :class:`dedloc_jax.Collaboration` the optimizer's ``collaborative`` transform uses.
    """
    keeper: StepKeeper = collab.keeper
    view = collab.step_view()
    now = time.monotonic()
    if not keeper.due(now, view.epoch, view.behind):
        return params, opt_state
    state = collaboration_state(opt_state)
    if state is None:
        raise ValueError("opt_state holds no dedloc_jax.collaborative state")
    # diloco: right after an outer step, the parameters are its outer ones, bit for bit
    params = outer_params_after_step(params, opt_state)
    # Reading the state's epoch waits for the step in flight: done only when something is due.
    epoch, complete = int(state.epoch), bool(state.complete)
    if keeper.epoch is not None and epoch != keeper.epoch and view.epoch != epoch:
        # The transform reported the step, its result is not applied yet (delayed updates):
        # act once the state holds it.
        epoch = keeper.epoch
    obs = Observation(
        now,
        epoch,
        complete,
        view.others_train,
        view.newest_served,
        view.behind,
        view.newest_announced,
    )
    held = {"params": params, "opt_state": opt_state}

    def answer(request: Request) -> Any:
        if isinstance(request, Serve):
            share_state(collab, held["params"], held["opt_state"])
            return None
        if isinstance(request, Load):
            try:
                p, s, got = sync_state(
                    collab,
                    held["params"],
                    held["opt_state"],
                    timeout=keeper.config.load_timeout,
                    min_epoch=request.min_epoch,
                )
            except StaleStateError as e:
                log.info("%s: keeping ours", e)
                return STALE
            except StateSyncError as e:
                log.info("no state downloaded: %s", e)
                return FAILED
            held.update(params=p, opt_state=s)
            return got
        if isinstance(request, ForkLost):
            return collab.fork_verdict()
        if isinstance(request, NewerServed):
            return _newer(collab.newest_state_epoch(), request)
        time.sleep(request.seconds)
        return time.monotonic()

    run_plan(keeper.plan(obs), answer)
    return held["params"], held["opt_state"]


# --- the asynchronous driver: a CollaborationPeer and flat arrays -------------------------
async def keep_in_step_async(
    core: Any,
    keeper: StepKeeper,
    arrays: Sequence[np.ndarray],
    epoch: int,
    complete: bool,
) -> tuple[list[np.ndarray], int]:
    """:func:`keep_in_step` for a peer written against :class:`~dedloc_jax.peer.
    CollaborationPeer` (the simulator's):
    ``arrays`` is the state it holds at ``epoch``; returns the state and epoch to go on with.
    """
    now = trio.current_time()
    behind = core.behind
    held = {"arrays": list(arrays), "epoch": epoch}
    if not keeper.due(now, epoch, behind):
        return held["arrays"], epoch
    tracker = core.tracker
    newest = tracker.newest_served()
    announced = tracker.newest_announced()
    obs = Observation(now, epoch, complete, core.others_train(), newest, behind, announced)
    plan = keeper.plan(obs)
    reply: Any = None
    try:
        request = plan.send(None)
        while True:
            if isinstance(request, Serve):
                await core.share_state(held["arrays"], held["epoch"])
                reply = None
            elif isinstance(request, Load):
                try:
                    got, loaded = await core.load_state(
                        timeout=keeper.config.load_timeout, min_epoch=request.min_epoch
                    )
                except StaleStateError:
                    reply = STALE
                except StateSyncError:
                    reply = FAILED
                else:
                    held.update(arrays=list(loaded), epoch=got)
                    reply = got
            elif isinstance(request, ForkLost):
                reply = core.fork_verdict()
            elif isinstance(request, NewerServed):
                reply = _newer(await core.newest_state_epoch(), request)
            else:
                await trio.sleep(request.seconds)
                reply = trio.current_time()
            request = plan.send(reply)
    except StopIteration:
        pass
    return held["arrays"], held["epoch"]
