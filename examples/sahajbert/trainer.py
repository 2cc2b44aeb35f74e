"""The volunteer's program: join a run, load its state, compute gradients, step with everyone.

A trainer loads the run's newest parameters and optimizer state from peers (or starts from the
shared initialisation when it is the first), then loops: one jitted micro-step computes the
gradients of a batch and hands them to :func:`dedloc_jax.collaborative`, which steps once the
whole collaboration has gathered the target batch. After each collaboration step the trainer
serves its state to newcomers and publishes its signed metrics. A trainer that was killed and is
started again simply loads the state again and carries on.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from examples.sahajbert import metrics, training
from examples.sahajbert.config import NetConfig, TrainerConfig
from examples.sahajbert.events import EventLog, PhaseHost, finite

log = logging.getLogger(__name__)

METRICS_TTL = 30.0
MANIFEST_TTL = 3600.0  # the coordinator stores it again well before it lapses


def collaboration_config(cfg: TrainerConfig, mode: str | None = None) -> Any:
    """Quick refreshes and exact (uncompressed) averages for the tiny local model."""
    from dedloc_jax import CollaborationConfig

    if cfg.model == "tiny":
        # The matchmaking window adapts to the peers' micro-step times; those are real from the
        # first report on, since trainers compile (warm_up_step) before they report.
        base = CollaborationConfig.local_demo(cfg.collaboration_target)
    else:
        base = CollaborationConfig.sahajbert().replace(target_batch_size=cfg.collaboration_target)
    if cfg.codec is not None:  # the run manifest's
        base = base.replace(rounds=base.rounds.replace(codec=cfg.codec))
    codec = diloco_of(cfg)
    if isinstance(codec, str):  # aux peers reduce the pseudo-gradients in diloco's codec too
        base = base.replace(rounds=base.rounds.replace(codec=codec))
    elif codec is not None:  # TopK payloads are all-gathered: no share split to measure for
        base = base.replace(links=base.links.replace(measure=False))
    return base.replace(mode=mode) if mode else base


def powersgd_of(cfg: TrainerConfig) -> Any:
    """A :class:`dedloc_jax.PowerSGD` with ``--compression powersgd`` (its factors in the
    run's codec), else None."""
    if cfg.compression != "powersgd":
        return None
    from dedloc_jax import PowerSGD

    return PowerSGD(rank=cfg.powersgd_rank, codec=collaboration_config(cfg).rounds.codec)


def diloco_of(cfg: TrainerConfig) -> Any:
    """The pseudo-gradients' codec in DiLoCo mode (int8 unless the run names one; a
    :class:`dedloc_jax.TopK` with ``--compression topk``), else None."""
    if cfg.mode != "diloco":
        return None
    if cfg.compression == "topk":
        from dedloc_jax import TopK

        return TopK(
            density=cfg.topk_density, bits=cfg.topk_bits, error_feedback=cfg.topk_error_feedback
        )
    return cfg.codec or "int8"


def open_collaboration(cfg: TrainerConfig, net: NetConfig, mode: str | None = None) -> Any:
    """A started :class:`dedloc_jax.Collaboration` for this peer (close it when done)."""
    from dedloc_jax import AccessConfig, Collaboration, DefenceConfig
    from p2p.identity import Identity

    identity = Identity.load_or_create(net.identity) if net.identity else None
    collab = Collaboration(
        cfg.run_id,
        initial_peers=list(net.initial_peers),
        listen=list(net.listen),
        announce=list(net.announce),
        identity=identity,
        config=collaboration_config(cfg, "client" if net.client_mode else mode).replace(
            access=AccessConfig(owner_public_key=net.owner_public_key, invitation=net.invitation),
            defence=DefenceConfig(robust_tau=net.robust_tau),
        ),
    )
    collab.start()
    for addr in collab.addrs:  # what the DHT and the run's records carry (the announced ones)
        log.info("peer %s reachable at %s", collab.peer_id, addr)
    return collab


def serve_manifest(collab: Any, envelope: dict, tokenizer_file: Path) -> None:
    """Serve the run's manifest and tokenizer from this peer (and store the manifest in its
    DHT slot); a failed store is logged, the RPCs serve all the same."""
    from examples.sahajbert import manifest

    try:
        collab.run_async(lambda c: manifest.serve(c, envelope, tokenizer_file, MANIFEST_TTL))
    except (RuntimeError, ValueError) as e:  # P2PError is a RuntimeError
        log.warning("could not publish the run manifest: %s", e)


def dialable(collab: Any) -> list[str]:
    """This peer's addresses as others pass them to ``--initial-peers``."""
    return [a if "/p2p/" in a else f"{a}/p2p/{collab.peer_id}" for a in collab.addrs]


@dataclass
class TrainerResult:
    epoch: int
    micro_steps: int
    samples: int
    history: list[metrics.EpochFigures] = field(default_factory=list)
    final_params: Path | None = None
    diverged: int | None = None  # the epoch whose loss or state was not finite (then it stopped)
    saved: tuple[int, str] | None = None  # the coordinator's checkpoint of our last epoch


class _Traffic:
    """Bytes/s sent and received over the last ``window`` seconds, from running totals (the
    averaging's traffic comes in bursts: a longer window shows what the link carries)."""

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def update(self, now: float, sent: int, received: int) -> tuple[float, float]:
        self._samples.append((now, sent, received))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()
        t0, s0, r0 = self._samples[0]
        if now <= t0:
            return 0.0, 0.0
        return (sent - s0) / (now - t0), (received - r0) / (now - t0)


class _Throughput:
    """Samples per second, smoothed over the last few seconds of computing."""

    def __init__(self, half_life: float = 5.0) -> None:
        self.rate = 0.0
        self.half_life = half_life
        self._last: float | None = None

    def update(self, samples: int, now: float) -> float:
        if self._last is not None and now > self._last:
            dt = now - self._last
            alpha = 1.0 - 0.5 ** (dt / self.half_life)
            self.rate = (
                (1 - alpha) * self.rate + alpha * samples / dt if self.rate else samples / dt
            )
        self._last = now
        return self.rate


def run_trainer(
    cfg: TrainerConfig,
    net: NetConfig,
    *,
    final_params: Path | None = None,
    linger: float = 120.0,
    run_manifest: tuple[dict, Path] | None = None,
    events: Path | None = None,
) -> TrainerResult:
    """Train until ``cfg.max_epochs`` (forever when None); see the module docstring.

    ``run_manifest``: the run's signed manifest and its tokenizer file, served on to peers
    that join through this one (:mod:`examples.sahajbert.manifest`). ``events``: append
    what the trainer does there (:mod:`examples.sahajbert.events`)."""

    training.enable_compilation_cache(cfg.work_dir / "jax-cache")
    tokenizer, corpus = training.prepare_data(cfg)
    if isinstance(corpus, tuple):  # sources, streamed in this peer's own order
        mix = ", ".join(f"{s.describe()} (weight {s.weight:g})" for s in corpus)
        log.info("streaming %s, tokenized on the fly", mix)
    vocab = len(tokenizer)
    model_cfg = training.model_config(cfg.model, vocab, cfg.seq_length, cfg.bf16)
    graphdef, params, rest = training.build_model(model_cfg, seed=cfg.seed)
    log_events = EventLog(events)
    collab = open_collaboration(cfg, net)
    try:
        if run_manifest is not None:
            serve_manifest(collab, *run_manifest)
        host = PhaseHost(collab, log_events) if events is not None else collab
        micro = cfg.per_device_batch_size * jax.local_device_count() * cfg.grad_accumulation
        inner = training.trainer_inner(cfg, micro)  # DiLoCo: its rate is per micro-batch
        tx = training.make_optimizer(
            cfg.optimizer,
            host,
            cfg.collaboration_target,
            inner=inner,
            diloco=diloco_of(cfg),
            inner_steps=cfg.inner_steps,
            compression=powersgd_of(cfg),
        )
        opt_state = tx.init(params)
        # Before anything is compiled: a newcomer loads the run's state, the first peer
        # serves its own (keep_in_step then follows the run on every micro-step).
        params, opt_state = _keep_in_step(host, params, opt_state, log_events)
        log_events.phase("compiling", epoch=int(opt_state.epoch))
        devices = jax.local_device_count()
        grad_step = training.make_grad_step(graphdef, rest)
        step = training.make_train_step(graphdef, rest, tx, micro, grad_step=grad_step)
        peer_seed = int.from_bytes(hashlib.sha256(collab.peer_id.encode()).digest()[:4], "big")
        data = training.batches(cfg, corpus, vocab, peer_seed)
        if devices > 1:  # data parallel over this peer's accelerators (jax.sharding)
            params, opt_state, data = _spread(params, opt_state, data)
        # Compile before the first report: a peer that reported progress and then spends its
        # first micro-step compiling makes the others wait for it, or step without it.
        seconds = training.warm_up_step(grad_step, inner, micro, params, next(data))
        log.info("compiled the training step in %.1f s", seconds)
        if cfg.wait_for_trainers > 0:
            _publish_ready(collab, devices)
            seen = _wait_for_trainers(collab, cfg.wait_for_trainers, timeout=60.0)
            log.info("%d other trainer(s) ready at the start", seen)
        log.info("training on %d local device(s), %d samples per micro-step", devices, micro)
        log_events.phase("accumulating", epoch=int(opt_state.epoch))
        result = _loop(cfg, collab, step, data, params, opt_state, devices, host, log_events)
        params, opt_state = result.pop("params"), result.pop("opt_state")
        tally = result.pop("tally")
        out = TrainerResult(**result)
        if out.diverged is not None:
            return out  # nothing finite to save or to serve on
        if final_params is not None:
            final_params.parent.mkdir(parents=True, exist_ok=True)
            flat = training.flat_params(params)
            np.savez(final_params, __epoch__=np.int64(out.epoch), **flat)
            out.final_params = final_params
        out.saved = _linger(collab, out.epoch, linger, tally)
        return out
    finally:
        collab.close()


def _keep_in_step(host: Any, params: Any, opt_state: Any, events: EventLog) -> tuple[Any, Any]:
    """:func:`dedloc_jax.keep_in_step`, with an event for each state it loaded."""
    import dedloc_jax

    loads = host.keeper.loads
    params, opt_state = dedloc_jax.keep_in_step(host, params, opt_state)
    if host.keeper.loads != loads:
        events.epoch(int(opt_state.epoch), "load", shared_params(params, opt_state))
        events.phase("accumulating", epoch=int(opt_state.epoch))
    return params, opt_state


def shared_params(params: Any, opt_state: Any) -> Any:
    """The parameters every peer of a step holds bit for bit: in DiLoCo mode the outer ones
    (the local ones are each peer's own work, and right after an outer step they are moved
    onto the outer ones with one rounding each, which differs per peer), else ``params``."""
    from dedloc_jax import DiLoCoState

    return opt_state.outer_params if isinstance(opt_state, DiLoCoState) else params


def _diverged(loss: float, shared: Any) -> bool:
    """Whether an epoch's figures say the run diverged: a loss that is not finite or beyond
    any a record may carry (metrics.MAX_LOSS), or parameters holding a NaN or an infinity."""
    return not 0.0 <= loss <= metrics.MAX_LOSS or not finite(shared)


def _spread(params: Any, opt_state: Any, data: Any) -> tuple[Any, Any, Any]:
    """Replicate the state on every local device and split each micro-batch across them."""
    from jax.sharding import NamedSharding, PartitionSpec

    from models.sharding import DATA_AXIS, make_mesh, replicate

    mesh = make_mesh()
    params, opt_state = replicate((params, opt_state), mesh)
    split = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS))  # [accumulation, batch, ...]
    return params, opt_state, (jax.device_put(b, split) for b in data)


def _publish_ready(collab: Any, devices: int) -> None:
    """A first metrics record (no steps yet): this peer has compiled and is about to train."""
    record = metrics.PeerMetrics(
        peer=collab.peer_id,
        epoch=collab.epoch,
        loss=math.nan,
        samples_per_second=0.0,
        micro_steps=0,
        samples=0,
        mode=collab.mode,
        devices=devices,
    )
    collab.run_async(lambda c: metrics.publish(c, record, METRICS_TTL))


def _wait_for_trainers(collab: Any, count: int, *, timeout: float) -> int:
    """Wait (bounded) until ``count`` other trainers are ready (have published metrics).

    Without it, in a local demo the trainer that finishes starting first takes the first epochs
    alone and the others load its state; with it, the first epoch is a group one. Trainers
    publish metrics only once their step is compiled, so this waits for that too (progress
    records would not: the collaboration publishes one as soon as it starts). The wait is
    bounded and a real run does not use it: a collaboration never waits for anybody.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = collab.run_async(metrics.fetch)
        seen = sum(r.mode != "aux" and peer != collab.peer_id for peer, r in found.items())
        if seen >= count or time.monotonic() >= deadline:
            return seen
        time.sleep(0.2)


def _loop(
    cfg: TrainerConfig,
    collab: Any,
    step: Any,
    data: Any,
    params: Any,
    opt_state: Any,
    devices: int,
    host: Any,
    events: EventLog,
) -> dict[str, Any]:
    micro = cfg.per_device_batch_size * devices * cfg.grad_accumulation
    tally = _Tally(collab, devices, int(opt_state.epoch), time.monotonic())
    while cfg.max_epochs is None or tally.epoch < cfg.max_epochs:
        batch = next(data)
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)
        now = time.monotonic()
        tally.count(micro, loss, now)
        stepped_to = int(opt_state.epoch)
        events.beat(stepped_to)
        figures = None
        if stepped_to != tally.epoch:
            figures = _close_epoch(tally, stepped_to, params, opt_state, now, events)
            if tally.diverged is not None:
                break
        # Serves the new state after a step; loads the run's after a step alone, a lost fork
        # check, or when the run is ahead (the library's policy: dedloc_jax.keep_in_step).
        params, opt_state = _keep_in_step(host, params, opt_state, events)
        new_epoch = int(opt_state.epoch)
        if figures is not None:
            state = _served_state(collab, int(opt_state.epoch))
            tally.history.append(replace(figures, state=state))
            log.info(
                "epoch %d done: loss %.4f (%d samples here)",
                tally.epoch, tally.last_loss, tally.epoch_samples,
            )  # fmt: skip
        if new_epoch != tally.epoch:
            tally.begin_epoch(new_epoch, now)
            tally.publish(now)
        elif now - tally.last_publish > 2.0:
            tally.publish(now)
        if cfg.step_delay:
            time.sleep(cfg.step_delay)
    if tally.diverged is None:
        tally.stopped = tally.epoch  # the coordinator saves the state when most trainers stop
    tally.publish(tally.last_publish)
    return {
        "tally": tally,
        "diverged": tally.diverged,
        "epoch": tally.epoch,
        "micro_steps": tally.micro_steps,
        "samples": tally.samples,
        "history": tally.history,
        "params": params,
        "opt_state": opt_state,
    }


class _Tally:
    """What the training loop counts, and this peer's metrics record made of it."""

    def __init__(self, collab: Any, devices: int, epoch: int, now: float) -> None:
        self.collab = collab
        self.devices = devices
        self.epoch = epoch
        self.history: list[metrics.EpochFigures] = []
        self.meter = _Throughput()
        self.traffic = _Traffic()
        self.micro_steps = self.samples = 0
        self.epoch_losses: list[float] = []
        self.epoch_samples = 0
        self.epoch_started = self.last_publish = now
        self.last_loss = math.nan
        self.diverged: int | None = None
        self.stopped: int | None = None  # the epoch this peer stopped at (its --max-epochs)

    def count(self, micro: int, loss: float, now: float) -> None:
        """One micro-step of ``micro`` samples."""
        self.micro_steps += 1
        self.samples += micro
        self.epoch_samples += micro
        self.epoch_losses.append(loss)
        self.meter.update(micro, now)

    def begin_epoch(self, epoch: int, now: float) -> None:
        self.epoch, self.epoch_losses, self.epoch_samples, self.epoch_started = epoch, [], 0, now

    def publish(self, now: float) -> None:
        """Publish this peer's metrics record (a failure is logged, training goes on)."""
        self.last_publish = now
        collab = self.collab
        links = collab.links
        sent_bps, received_bps = self.traffic.update(time.monotonic(), *collab.traffic())
        record = metrics.PeerMetrics(
            peer=collab.peer_id,
            epoch=self.epoch,
            loss=metrics.reportable_loss(self.last_loss),
            samples_per_second=0.0 if self.stopped is not None else self.meter.rate,
            micro_steps=self.micro_steps,
            samples=self.samples,
            mode=collab.mode,
            upload_bps=float(links["upload_bps"] or 0.0),
            download_bps=float(links["download_bps"] or 0.0),
            sent_bps=sent_bps,
            received_bps=received_bps,
            time=collab.now(),
            devices=self.devices,
            history=tuple(self.history[-metrics.HISTORY :]),
            diverged=self.diverged,
            stopped=self.stopped,
        )
        try:
            collab.run_async(lambda c: metrics.publish(c, record, METRICS_TTL))
        except (OSError, RuntimeError, ValueError) as e:  # P2PError is a RuntimeError
            log.warning("could not publish metrics: %s", e)


def _close_epoch(
    tally: _Tally, stepped_to: int, params: Any, opt_state: Any, now: float, events: EventLog
) -> metrics.EpochFigures:
    """The figures of the epoch this peer just stepped out of; marks the run diverged (and
    keeps the figures) when they say so."""
    tally.last_loss = float(np.mean(tally.epoch_losses))
    loss_shown = metrics.reportable_loss(tally.last_loss)
    group = int(opt_state.group_size)
    figures = metrics.EpochFigures(
        tally.epoch, loss_shown, tally.epoch_samples, now - tally.epoch_started, group
    )
    shared = shared_params(params, opt_state)
    events.epoch(stepped_to, "step", shared, group=group, loss=tally.last_loss)
    if _diverged(tally.last_loss, shared):
        # Stop the damage: this state is never served (nor loaded by anyone), and a
        # trainer that went on would only feed NaN to the others.
        log.error(
            "the run diverged: epoch %d's loss is %s and its state is %s; stopping "
            "(restart the run from an earlier checkpoint with a smaller learning rate)",
            tally.epoch, tally.last_loss, "finite" if finite(shared) else "not finite",
        )  # fmt: skip
        tally.diverged = tally.epoch
        tally.history.append(figures)
    return figures


def _served_state(collab: Any, epoch: int) -> str:
    """The first hex digits of the digest of the state this peer serves, if of ``epoch`` (the
    one it goes on with); "" when it serves none of that epoch."""

    async def served(core: Any) -> Any:
        return core.tracker.served

    try:
        got = collab.run_async(served)
    except RuntimeError:
        return ""
    if got is None or got[0] != epoch:
        return ""
    return got[1].hex()[: metrics.STATE_HEX]


def _linger(collab: Any, epoch: int, seconds: float, tally: _Tally) -> tuple[int, str] | None:
    """Keep serving the final state until the coordinator has checkpointed it (or time is up),
    republishing our record, which says we stopped: the coordinator saves the state once most
    trainers stopped. It downloads the state from the trainers, so once they are all gone it
    never can. The coordinator's checkpoint (epoch, path), or None when it did not come."""
    if seconds <= 0:
        return None
    # We average no more: our progress record says so at once (the state stays served), or
    # the peers that train on expect us in their next round and step without us, warning.
    try:
        collab.run_async(lambda core: core.leave())
    except RuntimeError as e:
        log.debug("could not tell the run we average no more: %s", e)
    log.info("serving epoch %d until the coordinator saved it (at most %.0f s)", epoch, seconds)
    start = time.monotonic()
    saved = None
    while time.monotonic() - start < seconds:
        if time.monotonic() - tally.last_publish > METRICS_TTL / 3:
            tally.publish(time.monotonic())  # the record says we stopped; it must not lapse
        try:
            found = collab.run_async(lambda c: c.dht.get(metrics.checkpoint_key(c.run_id)))
        except RuntimeError as e:
            log.info("could not read the checkpoint announcement: %s", e)
            found = None
        saved = metrics.parse_checkpoint(found) or saved  # None: forged, garbled, or none
        if saved is not None and saved[0] >= epoch:
            log.info("the coordinator saved epoch %d to %s", *saved)
            return saved
        # The others trained on (the estimate: bounded by what most peers claim): they serve
        # newer states, and ours is no run's last copy.
        went_on = collab.estimate.epoch
        if went_on > epoch:
            log.info("the run went on past epoch %d (it is at %d): leaving it", epoch, went_on)
            return None
        time.sleep(0.5)
    newest = f"epoch {saved[0]} ({saved[1]})" if saved else "none announced"
    log.warning(
        "the coordinator did not save epoch %d within %.0f s (its newest checkpoint: %s); "
        "leaving without it. A coordinator saves every --checkpoint-every epochs, at its own "
        "--max-epochs, and once most trainers stopped: is it running, and in this run?",
        epoch, seconds, newest,
    )  # fmt: skip
    return None
