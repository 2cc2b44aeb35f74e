"""Keeping a peer in step with the collaboration: :func:`keep_in_step`.

Called once per micro-step after the train step, it makes a training loop follow the run:

- on its first call, a newcomer (or a restarted peer) loads the run's current state when
  other peers serve a newer one than it holds, else serves its own;
- after every step this peer took with the whole collaboration, it serves the new state;
- after a step alone (or one whose mean missed part of the run) while others train, it loads
  the others' state, unless theirs is older than ours;
- every few seconds it asks whether the state it serves lost the fork choice to a lineage more
  peers hold (a healed partition), and loads the winner's with a few retries;
- when the others are at a newer epoch and a newer state is served, it loads it.

The policy is :class:`StepKeeper`, written without I/O in the style of a sans-IO protocol: it
yields requests (serve, load, ask the fork check, sleep) and the driver answers them. The
synchronous driver (:func:`keep_in_step`, for a :class:`dedloc_jax.Collaboration` and JAX
pytrees) and the asynchronous one (:func:`keep_in_step_async`, for a
:class:`~dedloc_jax.collaboration.CollaborationCore` in the simulator) share it. The decision
whether anything is due reads only host-side figures (the progress snapshot, the epoch the
transform last reported); nothing reads the DHT on the calling thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeepConfig:
    """Timings of :class:`StepKeeper` (seconds)."""

    fork_check_after: float = 5.0  # into an epoch: the others have announced its state by then
    fork_recheck: float = 10.0  # and again this often until the epoch ends
    lost_loads: int = 3  # downloads tried when our lineage lost the fork check
    behind_recheck: float = 1.0  # between looks for a newer state while behind
    settle: float = 0.5  # after a step alone, before loading: the others' states land
    retry: float = 1.0  # between download attempts
    load_timeout: float = 60.0  # one state download at most


# --- what the policy asks of its driver --------------------------------------------------
class Serve(NamedTuple):
    """Serve the state this peer holds now. Answer: None."""


class Load(NamedTuple):
    """Load the state the fork choice names (``min_epoch``: not one older than that).
    Answer: the epoch loaded, :data:`STALE` (theirs is older: nothing changed) or
    :data:`FAILED` (nobody served one, or the download failed)."""

    min_epoch: int | None


class ForkLost(NamedTuple):
    """Whether our served state lost to another lineage of its epoch. Answer: bool."""


class NewerServed(NamedTuple):
    """Whether a download would bring a state newer than ``epoch``. Answer: bool."""

    epoch: int


class Sleep(NamedTuple):
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


class StepKeeper:
    """The policy behind :func:`keep_in_step`, for one peer (see the module docstring)."""

    def __init__(self, config: KeepConfig = KeepConfig()) -> None:
        self.config = config
        self.epoch: int | None = None  # the epoch we last saw (None: never called)
        self._epoch_started = 0.0
        self._fork_checked_at: float | None = None  # this epoch's last fork check
        self._behind_checked = -math.inf
        self.loads = 0  # states loaded (figures for tests and benchmarks)

    def due(self, now: float, epoch: int | None, behind: bool) -> bool:
        """Whether :meth:`plan` may do anything now (cheap: no request, no hop); ``epoch``:
        the epoch the transform last reported (None: unknown)."""
        c = self.config
        if self.epoch is None or (epoch is not None and epoch != self.epoch):
            return True
        if self._fork_check_due(now):
            return True
        return behind and now - self._behind_checked > c.behind_recheck

    def _fork_check_due(self, now: float) -> bool:
        if self._fork_checked_at is None:
            return now - self._epoch_started > self.config.fork_check_after
        return now - self._fork_checked_at > self.config.fork_recheck

    def _enter(self, epoch: int, now: float) -> None:
        self.epoch = epoch
        self._epoch_started = now
        self._fork_checked_at = None

    def plan(self, obs: Observation) -> Generator[Request, Any, None]:
        """The requests for this micro-step; the driver sends each one's answer back."""
        c = self.config
        if self.epoch is None:  # the first call: a newcomer takes the run's state
            self._enter(obs.epoch, obs.now)
            if obs.newest_served is not None and obs.newest_served > obs.epoch:
                got = yield Load(None)
                if isinstance(got, int):
                    self._loaded(got, obs.now)
                    return
            yield Serve()
            return
        if obs.epoch != self.epoch:  # this peer stepped
            unchecked = self._fork_checked_at is None
            self._enter(obs.epoch, obs.now)
            # An epoch shorter than fork_check_after had no fork check: check the state we
            # trained it on now, or a lost lineage outlives several epochs.
            if unchecked and (yield ForkLost()):
                log.warning("epoch %d: our state lost to the majority's; loading it", obs.epoch)
                yield from self._adopt(obs, attempts=c.lost_loads)
            elif not obs.complete and obs.others_train:
                log.warning(
                    "epoch %d: stepped without the whole collaboration; loading its state",
                    obs.epoch,
                )
                yield Sleep(c.settle)
                yield from self._adopt(obs, attempts=1)
            else:
                yield Serve()
            return
        if self._fork_check_due(obs.now):
            self._fork_checked_at = obs.now
            if (yield ForkLost()):
                # Another lineage of this epoch, held by more peers, won (after a partition
                # healed, each side having averaged apart): take theirs.
                log.warning("epoch %d: our state lost to the majority's; loading it", obs.epoch)
                yield from self._adopt(obs, attempts=c.lost_loads)
                return
        if obs.behind and obs.now - self._behind_checked > c.behind_recheck:
            self._behind_checked = obs.now
            if (yield NewerServed(obs.epoch)):
                log.info("epoch %d: the collaboration is ahead; loading its state", obs.epoch)
                got = yield Load(None)
                if isinstance(got, int):
                    self._loaded(got, obs.now)
                else:
                    yield Serve()

    def _adopt(self, obs: Observation, *, attempts: int) -> Generator[Request, Any, None]:
        """Load the others' state unless it is older than ours (an older one, e.g. a peer
        still on its first micro-step serving the initial state, would undo the run's
        progress: ours is kept and served, and the late peers load it)."""
        for attempt in range(attempts):
            if attempt:
                yield Sleep(self.config.retry)
            got = yield Load(obs.epoch)
            if isinstance(got, int):
                self._loaded(got, obs.now)
                return
            if got == STALE:
                break
        log.info("keeping this peer's state of epoch %d", obs.epoch)
        yield Serve()

    def _loaded(self, epoch: int, now: float) -> None:
        self.loads += 1
        self._enter(epoch, now)


def run_plan(plan: Generator[Request, Any, None], answer: Callable[[Request], Any]) -> None:
    """Drive ``plan`` synchronously, answering each request with ``answer``."""
    try:
        request = next(plan)
        while True:
            request = plan.send(answer(request))
    except StopIteration:
        pass


# --- the synchronous driver: a Collaboration and JAX pytrees ------------------------------
def keep_in_step(collab: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
    """Keep this peer in step with the collaboration; call once per micro-step, after the
    train step, and go on with what it returns.

    Returns ``(params, opt_state)``: the same objects when there is nothing to do, else the
    state loaded from the others (see the module docstring for when). ``collab`` is the
    :class:`dedloc_jax.Collaboration` the optimizer's ``collaborative`` transform uses.
    """
    from dedloc_jax.diloco import outer_params_after_step
    from dedloc_jax.state_sync import StaleStateError, StateSyncError
    from dedloc_jax.training_state import collaboration_state, share_state, sync_state

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
    obs = Observation(now, epoch, complete, view.others_train, view.newest_served, view.behind)
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
            return collab.on_minority_fork()
        if isinstance(request, NewerServed):
            newest = collab.newest_state_epoch()
            return newest is None or newest > request.epoch
        time.sleep(request.seconds)
        return None

    run_plan(keeper.plan(obs), answer)
    return held["params"], held["opt_state"]


# --- the asynchronous driver: a CollaborationCore and flat arrays -------------------------
async def keep_in_step_async(
    core: Any,
    keeper: StepKeeper,
    arrays: Sequence[np.ndarray],
    epoch: int,
    complete: bool,
) -> tuple[list[np.ndarray], int]:
    """:func:`keep_in_step` for a peer written against the async core (the simulator's):
    ``arrays`` is the state it holds at ``epoch``; returns the state and epoch to go on with.
    """
    import trio

    from dedloc_jax.state_sync import StaleStateError, StateSyncError

    now = trio.current_time()
    behind = core.behind
    held = {"arrays": list(arrays), "epoch": epoch}
    if not keeper.due(now, epoch, behind):
        return held["arrays"], epoch
    served = [state[1] for state in core.tracker.states()]
    newest = max(served) if served else None
    obs = Observation(now, epoch, complete, core.others_train(), newest, behind)
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
                reply = await core.on_minority_fork()
            elif isinstance(request, NewerServed):
                newest = await core.newest_state_epoch()
                reply = newest is None or newest > request.epoch
            else:
                await trio.sleep(request.seconds)
                reply = None
            request = plan.send(reply)
    except StopIteration:
        pass
    return held["arrays"], held["epoch"]
