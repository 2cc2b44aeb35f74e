"""The synchronous facade: a collaboration in one background trio thread.

:class:`Collaboration` runs :func:`~dedloc_jax.opening.open_collaboration` for ordinary
Python (the JAX training loop), and implements :class:`dedloc_jax.host.CollaborationHost` for
:func:`dedloc_jax.collaborative`.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import trio

from dedloc_jax.config import MID_STEP_POLL as MID_STEP_POLL  # (its public home was here)
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.handover import HandOver
from dedloc_jax.history import RoundOutcome
from dedloc_jax.host import AveragingOutcome
from dedloc_jax.opening import open_collaboration
from dedloc_jax.peer import CollaborationPeer
from dedloc_jax.progress import CollaborationEstimate, PeerProgress
from dedloc_jax.snapshot import ProgressSnapshot
from dedloc_jax.state import KeepConfig, StepKeeper
from p2p.bridge import TrioThread
from p2p.dht import DHTConfig
from p2p.errors import MultiaddrError, P2PError
from p2p.identity import Identity
from p2p.multiaddr import Multiaddr
from p2p.node import NodeConfig, announce_addrs, open_node
from p2p.transport import Transport

log = logging.getLogger(__name__)


class StepView(NamedTuple):
    """The host-side figures keep_in_step reads after every micro-step."""

    epoch: int  # the epoch the transform last reported (or stepped to)
    behind: bool
    others_train: bool
    newest_served: int | None  # the newest epoch another peer serves a state of
    newest_announced: int | None = None  # the same, backed or not (a newcomer asks of it)


class BackgroundAveraging:
    """One averaging that runs as a task of the collaboration's trio loop while the training
    thread goes on (``collaborative(overlap=True)``); the training thread polls
    :meth:`result` (no waiting)."""

    def __init__(self, average: Callable[[], Awaitable[AveragingOutcome]]) -> None:
        self._average = average
        self._done = threading.Event()
        self._outcome: AveragingOutcome | None = None
        self._error: Exception | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            self._outcome = await self._average()
        except Exception as e:  # noqa: BLE001 - handed to the training thread by result()
            # Logged in full here: the training thread may re-raise it through a JAX host
            # callback, whose error message keeps only the traceback's last line.
            log.error("averaging raised %r", e, exc_info=e)
            self._error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> AveragingOutcome:
        """The outcome of a finished averaging; raises what it raised."""
        if not self._done.is_set():
            raise RuntimeError("the averaging has not finished")
        if self._error is not None:
            raise self._error
        if self._outcome is None:
            raise RuntimeError("the collaboration closed while averaging")
        return self._outcome


class Collaboration:
    """Join a collaboration from ordinary Python; implements ``CollaborationHost``.

    Use as a context manager. It owns one background thread running a trio loop with the node,
    the DHT, the tracker, matchmaking, the averager and the state server::

        with dedloc_jax.Collaboration("sahajbert", initial_peers=[...]) as collab:
            tx = dedloc_jax.collaborative(optax.lamb(1e-3), collab, target_batch_size=4096)
    """

    def __init__(
        self,
        run_id: str,
        *,
        initial_peers: Sequence[str | Multiaddr] = (),
        listen: Sequence[str | Multiaddr] = ("/ip4/127.0.0.1/tcp/0",),
        announce: Sequence[str | Multiaddr] = (),
        identity: Identity | None = None,
        config: CollaborationConfig = CollaborationConfig(),
        node_config: NodeConfig | None = None,
        dht_config: DHTConfig | None = None,
        transport: Transport | None = None,
        keep: KeepConfig = KeepConfig(),
        client_mode: bool | None = None,
    ) -> None:
        """``client_mode`` is deprecated: ``config=CollaborationConfig(mode="client")``."""
        if client_mode:
            warnings.warn(
                'Collaboration(client_mode=True) is deprecated: use config.mode="client"',
                DeprecationWarning,
                stacklevel=2,
            )
            config = config.replace(mode="client")
        if not run_id or any(c in run_id for c in "[]"):
            raise ValueError(f"invalid run_id {run_id!r}")
        self.run_id = run_id
        self.config = config
        self._initial_peers = list(initial_peers)
        for addr in self._initial_peers:  # checked here: one clear error, not a task group's
            if isinstance(addr, str):
                try:
                    Multiaddr.parse(addr)
                except MultiaddrError as e:
                    raise MultiaddrError(f"initial peer {addr!r:.200}: {e}") from None
        client = config.mode == "client"  # dials out only: listens for nothing
        self._listen = [] if client else list(listen)
        if announce and client:
            raise ValueError("a client-mode peer accepts no connections: it announces nothing")
        self._identity = identity or Identity.generate()
        # checked here (a clear MultiaddrError); they replace the listen addresses (open_node)
        self._announce = announce_addrs(announce, self._identity.peer_id)
        self._node_config = node_config or NodeConfig.bulk()
        self._dht_config = dht_config or DHTConfig.fast()
        self._transport = transport
        self._thread: TrioThread | None = None
        self._snapshot: ProgressSnapshot | None = None
        self._background: BackgroundAveraging | None = None  # collaborative(overlap=True)
        self._handed: HandOver | None = None  # collaborative's accumulator, averaged mid-step
        self._stop: trio.Event | None = None
        self._target: int | None = None  # from collaborative(), applied when started
        self.core: CollaborationPeer | None = None
        self.keeper = StepKeeper(keep)  # keep_in_step's policy and memory for this peer
        self._closed: list[RoundOutcome] | None = None  # the history, once closed

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> Collaboration:
        self._closed = None
        self._thread = TrioThread(name=f"dedloc-{self.run_id}").start()
        try:
            self.core = self._thread.start_service(self._serve)
            if self._target is not None:
                self._thread.run_sync(self.core.tracker.use_target, self._target)
        except BaseException as e:
            self._thread.stop()
            leaf = e
            while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
                leaf = leaf.exceptions[0]
            if leaf is not e and isinstance(leaf, P2PError):
                # The one error a user acts on ("none of the 1 initial peers answered: ..."),
                # not the nurseries' nested groups around it.
                raise leaf from None
            raise
        return self

    async def _serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._stop = trio.Event()
        async with (
            open_node(
                self._identity,
                listen=self._listen,
                transport=self._transport,
                config=self._node_config,
                announce=self._announce,
            ) as node,
            open_collaboration(
                node,
                self.run_id,
                initial_peers=self._initial_peers,
                config=self.config,
                dht_config=self._dht_config,
            ) as core,
        ):
            task_status.started(core)
            await self._stop.wait()

    def close(self) -> None:
        if self._thread is None:
            return
        if self._stop is not None and self._thread.running:
            if self.core is not None:
                # What this peer averaged stays readable after it left (``history``); others
                # stop expecting us before our record expires.
                self._closed = self._thread.run_sync(lambda: list(self.core.history))
                if note := self._thread.run_sync(self.core.leaving_note):
                    log.warning("%s", note)
                try:
                    self._thread.run(self.core.leave)
                except Exception as e:  # (a loop that failed: nothing to tell then)
                    log.debug("could not tell the run we leave: %s", e)
            self._thread.run_sync(self._stop.set)
        self._thread.stop()
        self._thread = None

    def __enter__(self) -> Collaboration:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _core(self) -> tuple[TrioThread, CollaborationPeer]:
        if self._closed is not None:
            raise RuntimeError("the collaboration is closed (its history stays readable)")
        if self._thread is None or self.core is None:
            raise RuntimeError("the collaboration is not started (use it as a context manager)")
        return self._thread, self.core

    # --- what others need ----------------------------------------------------------------
    @property
    def addrs(self) -> list[str]:
        _, core = self._core()
        return [str(a) for a in core.node.addrs]

    @property
    def peer_id(self) -> str:
        _, core = self._core()
        return str(core.node.peer_id)

    @property
    def estimate(self) -> CollaborationEstimate:
        thread, core = self._core()
        return thread.run_sync(core.tracker.current_estimate)

    @property
    def epoch(self) -> int:
        _, core = self._core()
        return core.epoch

    def run_async(self, async_fn: Any, *args: Any) -> Any:
        """Run ``await async_fn(core, *args)`` in the collaboration's trio loop and return it.

        For code that needs the DHT or the node directly (e.g. publishing metrics):
        ``collab.run_async(lambda core: core.dht.get("key"))``.
        """
        thread, core = self._core()

        async def call() -> Any:
            return await async_fn(core, *args)

        return thread.run(call)

    def banned_peers(self) -> list[dict]:
        """Peers caught lying in verified rounds (:mod:`dedloc_jax.bans`), read anew from the
        DHT: ``peer``, ``role``, ``reason``, ``round``, ``by`` (the accuser) and ``verified``
        (whether this peer checked the evidence; unproven reports ban nobody)."""

        async def read(core: Any) -> list[dict]:
            await core.bans.refresh(force=True)
            return core.bans.listing()

        return self.run_async(read)

    def now(self) -> float:
        """The DHT clock's time (what records such as metrics are stamped with)."""
        thread, core = self._core()
        return thread.run_sync(core.dht.now)

    @property
    def mode(self) -> str:
        """How this peer takes part: "node", "client" or "aux"."""
        _, core = self._core()
        return core.mode

    @property
    def target(self) -> int | None:
        """Samples per step this peer trains toward (the run's, for a peer that sets none)."""
        thread, core = self._core()
        return thread.run_sync(lambda: core.tracker.target)

    def use_target(self, target: int) -> None:
        """Train toward ``target`` samples per step; ``collaborative`` calls it. ValueError
        when ``config.target_batch_size`` names another."""
        self._target = self.config.agreed_target(target)
        if self._thread is not None and self.core is not None:
            self._thread.run_sync(self.core.tracker.use_target, target)

    @property
    def last_outcome(self) -> RoundOutcome | None:
        """The last averaging step (:class:`~dedloc_jax.history.RoundOutcome`): epoch,
        group_size, complete (with every peer), seconds, reason (why it was not complete; empty
        when it was). None before the first."""
        if self._closed is not None:
            return self._closed[-1] if self._closed else None
        thread, core = self._core()
        return thread.run_sync(lambda: core.history[-1] if core.history else None)

    @property
    def history(self) -> list[RoundOutcome]:
        """Every averaging step this peer took, as :attr:`last_outcome` describes one (still
        readable after the collaboration closed)."""
        if self._closed is not None:
            return list(self._closed)
        thread, core = self._core()
        return thread.run_sync(lambda: list(core.history))

    @property
    def progress(self) -> dict[str, PeerProgress]:
        """The progress table as last read: peer ID -> its record (ours included)."""
        thread, core = self._core()

        def table() -> dict[str, PeerProgress]:
            found = dict(core.tracker.records)
            found[core.tracker.peer_id] = core.tracker.own_progress()
            return found

        return thread.run_sync(table)

    @property
    def links(self) -> dict[str, float | None]:
        """This peer's published link figures, what the averaging's split uses:
        ``upload_bps`` and ``download_bps`` (bytes/s, None: not measured yet) and
        ``upload_age`` / ``download_age`` (seconds since measured)."""
        thread, core = self._core()
        return thread.run_sync(lambda: core.link_keeper.figures()._asdict())

    def traffic(self) -> tuple[int, int]:
        """Bytes this peer has sent and received so far, all connections and protocols
        together (framing included): what its links actually carried."""
        thread, core = self._core()
        node = core.node
        return thread.run_sync(lambda: (sum(node.bytes_sent.values()), node.bytes_received.total))

    def step_view(self) -> StepView:
        """What :func:`dedloc_jax.keep_in_step` decides on, from the last progress snapshot
        (no DHT read; one hop to the trio thread only when no snapshot is at hand)."""
        thread, core = self._core()
        snap = self._snapshot
        if snap is None:
            snap = thread.run_sync(core.snapshot)
        return StepView(
            core.epoch, snap.behind, snap.others_train, snap.newest_served, snap.newest_announced
        )

    # --- CollaborationHost ---------------------------------------------------------------
    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        """Called on every micro-step: posts the numbers to the trio thread without waiting,
        and decides from the last snapshot of the others' progress plus our exact samples."""
        return self._report(epoch, samples, batch_size, whole_steps=False)

    def report_whole_steps(self, epoch: int, samples: int, batch_size: int) -> bool:
        """:meth:`report_progress` for a peer that averages mid-step (:meth:`hand_over`): it
        decides on the samples every peer holds in whole micro-steps, as
        :meth:`CollaborationPeer.due` does (what the round averages when each peer leaves its
        micro-step in flight to the next epoch)."""
        return self._report(epoch, samples, batch_size, whole_steps=True)

    def _report(self, epoch: int, samples: int, batch_size: int, *, whole_steps: bool) -> bool:
        thread, core = self._core()
        snap = self._snapshot
        if snap is not None and not snap.fresh and snap.reached(epoch, samples):
            # Reached the target by our own count before reading who else trains: wait
            # (bounded) for that read rather than step alone or keep accumulating.
            thread.run(core.read_fresh_table)
            snap = None
        report = functools.partial(self._apply_report, whole_steps=whole_steps)
        if snap is None or snap.epoch != epoch:  # no usable snapshot: one blocking hop
            return thread.run_sync(report, core, epoch, samples, batch_size)
        thread.post(report, core, epoch, samples, batch_size)
        return snap.ready(epoch, samples, whole_steps=whole_steps)

    def _apply_report(
        self, core: CollaborationPeer, epoch: int, samples: int, batch_size: int, *, whole_steps
    ) -> bool:
        ready = core.report(epoch, samples, batch_size, whole_steps=whole_steps)
        self._snapshot = core.snapshot(whole_steps=whole_steps)
        return ready

    def lands_within(self, seconds: float) -> bool:
        """Whether the target will likely land within ``seconds`` (half the ETA of the last
        snapshot falls inside them); False without a snapshot."""
        snap = self._snapshot
        return snap is not None and snap.lands_within(seconds)

    def hand_over(
        self, epoch: int, gradients: Sequence[np.ndarray], samples: int, *, codec: str | None = None
    ) -> None:
        """Hand over what this peer accumulated toward ``epoch`` while its next micro-step
        computes: the trio loop asks :meth:`CollaborationPeer.due` every
        ``config.rounds.mid_step_poll`` (0.25 s when unset) and begins the round at once when
        it is due (:mod:`dedloc_jax.handover`). :meth:`take_over` ends it."""
        thread, core = self._core()
        if self._handed is not None:
            raise RuntimeError("an accumulator is already handed over")
        poll = self.config.rounds.poll
        job = HandOver(
            functools.partial(core.due, epoch),
            functools.partial(core.average, epoch, list(gradients), samples, codec=codec),
            poll,
        )
        self._handed = job
        thread.start_service(job.run)

    def take_over(self) -> AveragingOutcome | None:
        """At the end of the micro-step after :meth:`hand_over`: the round's outcome if it
        began (waits for it to end), else None (it never will: nothing was averaged)."""
        thread, _ = self._core()
        job, self._handed = self._handed, None
        if job is None or not thread.run_sync(job.claim):
            return None
        try:
            return job.result()
        finally:
            self._snapshot = None

    def average_gradients(
        self, epoch: int, gradients: Sequence[np.ndarray], samples: int, *, codec: str | None = None
    ) -> AveragingOutcome:
        """Average with this epoch's group; ``codec``: on the wire (None: the config's). The
        round's record (:class:`RoundOutcome`: the mean in ``average``, ``next_epoch``) as an
        :class:`~dedloc_jax.host.AveragingOutcome` view."""
        thread, core = self._core()
        try:
            return thread.run(
                functools.partial(core.average, codec=codec), epoch, list(gradients), samples
            )
        except Exception as e:
            # Logged in full: a JAX host callback re-raising it keeps only its last line.
            log.error("averaging at epoch %d raised %r", epoch, e, exc_info=e)
            raise
        finally:
            self._snapshot = None

    def start_averaging(
        self, epoch: int, gradients: Sequence[np.ndarray], samples: int, *, codec: str | None = None
    ) -> None:
        """:meth:`average_gradients` in the background (delayed updates); see poll_averaging."""
        thread, core = self._core()
        if self._background is not None:
            raise RuntimeError("an averaging is already in flight")
        job = BackgroundAveraging(
            functools.partial(core.average, epoch, list(gradients), samples, codec=codec)
        )
        self._background = job
        thread.start_service(job.run)

    def poll_averaging(self) -> AveragingOutcome | None:
        """The background averaging's outcome once it finished, else None (no waiting)."""
        job = self._background
        if job is None or not job.done:
            return None
        self._background = None
        self._snapshot = None  # the epoch moved on
        return job.result()

    # --- state sync ----------------------------------------------------------------------
    def share_state(self, arrays: Sequence[np.ndarray], epoch: int) -> None:
        thread, core = self._core()
        thread.run(core.state.share, [np.asarray(a) for a in arrays], epoch)

    def load_state(
        self, *, timeout: float = 60.0, min_epoch: int | None = None
    ) -> tuple[int, list[np.ndarray]]:
        """Download the state the fork choice names and train on it; ``min_epoch``: raise
        :class:`~dedloc_jax.StaleStateError` (and change nothing) if it is older."""
        thread, core = self._core()
        return thread.run(functools.partial(core.load_state, timeout=timeout, min_epoch=min_epoch))

    def newest_state_epoch(self) -> int | None:
        """The epoch of the state a download would bring: the newest on the lineage most
        peers hold (None: nobody announces one). Cheaper than a download: one DHT read."""
        thread, core = self._core()
        return thread.run(core.state.newest_epoch)

    def on_minority_fork(self, *, patience: float = 0.0, undecided: bool = False) -> bool:
        """Whether the state this peer serves lost to another lineage of its epoch (more peers
        hold it): then load theirs (:func:`dedloc_jax.sync_state`). See
        :meth:`~dedloc_jax.state.local.LocalState.on_minority_fork`."""
        thread, core = self._core()
        check = functools.partial(
            core.state.on_minority_fork, patience=patience, undecided=undecided
        )
        return thread.run(check)

    def fork_verdict(self) -> bool | None:
        """:meth:`on_minority_fork` asked once, without waiting (None: it cannot tell yet)."""
        thread, core = self._core()
        return thread.run_sync(core.state.fork_verdict)

    @property
    def behind(self) -> bool:
        thread, core = self._core()
        return thread.run_sync(lambda: core.behind)

    def run_aux(self, template: Sequence[np.ndarray], *, epochs: int | None = None) -> int:
        """Blocking :meth:`CollaborationPeer.run_aux` (open with ``config.mode="aux"``)."""
        thread, core = self._core()
        return thread.run(functools.partial(core.run_aux, list(template), epochs=epochs))


__all__ = ["Collaboration"]
