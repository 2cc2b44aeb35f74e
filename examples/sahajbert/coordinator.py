"""The coordinator: the run's first peer, its monitor, checkpointer and state server.

It opens the collaboration (others pass its address as ``--initial-peers``) as an ``aux``-mode
peer that trains nothing, then polls: every peer's signed metrics from the DHT become one row
per collaboration epoch (median loss, samples/s, peers, how many of them stepped alone and
on how many lineages they went on) appended to ``metrics.jsonl``
and ``metrics.csv``; the live status goes to the dashboard and to ``status.json``. Every
``checkpoint_every`` epochs, and when most trainers say they stopped (``--max-epochs``), it
downloads the collaboration's state (verified, from the trainers), saves an orbax checkpoint,
announces it in the DHT, and serves that state to newcomers itself, so a run whose trainers
all left can still be resumed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from examples.sahajbert import checkpoint, metrics, trainer, training
from examples.sahajbert.config import NetConfig, TrainerConfig
from examples.sahajbert.dashboard import Dashboard, clean_json

log = logging.getLogger(__name__)

CSV_FIELDS = (
    "epoch", "loss", "samples", "peers", "lone", "lineages", "seconds", "samples_per_second",
    "time",
)  # fmt: skip


@dataclass(frozen=True)
class CoordinatorOptions:
    out_dir: Path = Path("sahajbert-run")  # metrics.jsonl, metrics.csv, status.json
    checkpoint_dir: Path | None = None  # default: out_dir / "checkpoints"
    checkpoint_every: int = 10  # epochs
    dashboard_port: int = 0  # 0: any free port (printed)
    poll_interval: float = 0.5
    exit_after_epoch: int | None = None  # stop once this epoch is checkpointed (demo, tests)
    final_wait: float = 120.0  # seconds to try for that epoch's state once the run reached it
    read_timeout: float = 10.0  # one DHT read or write of the poll loop
    addr_file: Path | None = None  # write our dialable addresses here (for scripts)
    manifest_dir: Path | None = None  # a prepared run (`prepare`); None: prepare it in out_dir/run
    manifest_check_interval: float = 10.0  # seconds between reads of the manifests peers serve


class FinalStateMissing(RuntimeError):
    """The run reached the last epoch, but no peer served its state in time."""


class MetricsLog:
    """Appends finished epoch rows to JSONL and CSV."""

    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = out_dir / "metrics.jsonl"
        self.csv = out_dir / "metrics.csv"
        for path in (self.jsonl, self.csv):
            path.unlink(missing_ok=True)
        with self.csv.open("w", newline="") as f:
            csv.writer(f).writerow(CSV_FIELDS)

    def write(self, rows: list[dict[str, Any]]) -> None:
        with self.jsonl.open("a") as f:
            for row in rows:
                f.write(json.dumps(clean_json(row)) + "\n")
        with self.csv.open("a", newline="") as f:
            w = csv.writer(f)
            for row in rows:
                w.writerow([row[k] for k in CSV_FIELDS])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Coordinator:
    def __init__(self, cfg: TrainerConfig, net: NetConfig, opts: CoordinatorOptions) -> None:
        self.cfg = cfg
        self.net = net
        self.opts = opts
        self.ckpt_dir = opts.checkpoint_dir or opts.out_dir / "checkpoints"
        self.table = metrics.EpochTable(cfg.collaboration_target)
        self.log = MetricsLog(opts.out_dir)
        self.last_checkpoint: tuple[int, Path] | None = None
        self.started = time.monotonic()
        self.newest_epoch = 0  # the highest collaboration epoch seen (the estimate may fall back)
        self.final_seen_at: float | None = None  # when the run reached ``exit_after_epoch``
        self.manifest: Any = None  # the run manifest published (run() sets it)
        self._republish: tuple[float, dict, Path] | None = None  # when, envelope, tokenizer
        self.envelope: dict | None = None  # what we sign and serve (run() sets it)
        self.manifest_conflicts: dict[str, str] = {}  # peer -> digest of what it republishes
        self._manifests_checked = -math.inf
        # peer -> the epoch at which it found the run diverged (kept after its record lapses:
        # a trainer stops then); bounded, since any peer may claim it
        self.diverged: dict[str, int] = {}
        self._bans: list[dict] = []  # peers banned for lying (status.json, dashboard)
        self._bans_read = -math.inf
        self._stop_saved: int | None = None  # the trainers' stop epoch last logged

    def run(self) -> dict[str, Any]:
        from examples.sahajbert import manifest

        training.enable_compilation_cache(self.cfg.work_dir / "jax-cache")
        run_manifest, tok_dir = prepare_run(self.cfg, self.opts)
        self.cfg = manifest.apply(run_manifest, self.cfg, tok_dir)
        self.manifest = run_manifest
        # bound before we join: a dashboard port in use ends the start at once
        with Dashboard(self.cfg.run_id, port=self.opts.dashboard_port) as dash:
            return self._run(run_manifest, tok_dir, dash)

    def _run(self, run_manifest: Any, tok_dir: Path, dash: Dashboard) -> dict[str, Any]:
        from examples.sahajbert import manifest

        self.model_cfg = training.model_config(
            self.cfg.model, run_manifest.vocab_size, self.cfg.seq_length, self.cfg.bf16
        )
        _, params, _ = training.build_model(self.model_cfg, seed=self.cfg.seed)
        collab = trainer.open_collaboration(self.cfg, self.net, mode="aux")
        try:
            envelope = collab.run_async(lambda core: _signed(run_manifest, core.node.identity))
            tok_file = tok_dir / manifest.TOKENIZER_FILE
            trainer.serve_manifest(collab, envelope, tok_file)
            self._republish = (time.monotonic(), envelope, tok_file)
            self.envelope = envelope
            log.info(
                "run manifest %s: model %s, vocabulary %d (tokenizer sha256 %s), seq %d, "
                "target batch %d", run_manifest.digest[:16], run_manifest.model,
                run_manifest.vocab_size, run_manifest.tokenizer_sha256, run_manifest.seq_length,
                run_manifest.target_batch_size,
            )  # fmt: skip
            tx = training.make_optimizer(
                self.cfg.optimizer,
                collab,
                self.cfg.collaboration_target,
                diloco=trainer.diloco_of(self.cfg),
                inner_steps=self.cfg.inner_steps,
                compression=trainer.powersgd_of(self.cfg),
            )
            self.template = (params, tx.init(params))
            addrs = trainer.dialable(collab)
            if self.opts.addr_file is not None:
                _write_atomic(self.opts.addr_file, json.dumps(addrs))
            log.info("dashboard at %s", dash.url)
            log.info("join with: --initial-peers %s", addrs[0])
            return self._poll(collab, dash, addrs)
        finally:
            collab.close()

    def _poll(self, collab: Any, dash: Dashboard, addrs: list[str]) -> dict[str, Any]:
        while True:
            if self._republish is not None:
                stored_at, envelope, tok_file = self._republish
                if time.monotonic() - stored_at > trainer.MANIFEST_TTL / 4:  # before it lapses
                    trainer.serve_manifest(collab, envelope, tok_file)
                    self._republish = (time.monotonic(), envelope, tok_file)
            if time.monotonic() - self._manifests_checked > self.opts.manifest_check_interval:
                self._check_manifests(collab)
                self._manifests_checked = time.monotonic()
            records = self._fetch(collab)
            self._note_divergence(records)
            est = collab.estimate
            now = time.time()
            self.table.add(records, now=now)
            rows = self.table.ready(est.epoch)
            if rows:
                self.log.write(rows)
            # Once the trainers leave, the estimate falls back to our own epoch; the newest
            # epoch seen is what still has to be checkpointed.
            self.newest_epoch = max(self.newest_epoch, est.epoch)
            stopped = self._stopped(records)
            if self._checkpoint_due(self.newest_epoch, stopped):
                if stopped is not None and stopped != self._stop_saved:
                    log.info(
                        "most trainers stopped, at epoch %d or later: saving the newest state",
                        stopped,
                    )
                    self._stop_saved = stopped
                self._checkpoint(collab)
            self._read_bans(collab)
            status = self._status(records, est, dash.url, addrs)
            dash.status = status
            _write_atomic(self.opts.out_dir / "status.json", json.dumps(clean_json(status)))
            final = self.opts.exit_after_epoch
            if final is not None and self.last_checkpoint and self.last_checkpoint[0] >= final:
                time.sleep(1.0)  # the trainers' last metrics
                self.table.add(self._fetch(collab), now=time.time())
                self.log.write(self.table.flush())
                status = self._status(records, est, dash.url, addrs)
                _write_atomic(self.opts.out_dir / "status.json", json.dumps(clean_json(status)))
                return status
            self._check_final(final)
            time.sleep(self.opts.poll_interval)

    def _note_divergence(self, records: dict[str, metrics.PeerMetrics]) -> None:
        for peer, r in records.items():
            if r.diverged is not None and peer not in self.diverged and len(self.diverged) < 64:
                self.diverged[peer] = r.diverged
                log.error("peer %s reports that the run diverged at epoch %d", peer, r.diverged)

    def _read_bans(self, collab: Any) -> None:
        """Peers banned for lying in a verified round, with reasons (at most one DHT read per
        minute; dedloc_jax.bans), for the status."""
        if time.monotonic() - self._bans_read > 60.0:
            try:
                self._bans = collab.banned_peers()[:100]
            except (RuntimeError, ValueError, trio.TooSlowError) as e:
                log.warning("could not read the ban list: %s", e)
            self._bans_read = time.monotonic()

    def _fetch(self, collab: Any) -> dict[str, metrics.PeerMetrics]:
        """Every peer's metrics, or none when the DHT does not answer within the read timeout
        (a slow read must not hold back a checkpoint: trainers serve a final state only for
        so long)."""
        limit = self.opts.read_timeout

        async def fetch(core: Any) -> dict[str, metrics.PeerMetrics]:
            with trio.move_on_after(limit):
                return await metrics.fetch(core)
            log.warning("reading the metrics took over %.0f s; skipping this read", limit)
            return {}

        try:
            return collab.run_async(fetch)
        except RuntimeError as e:  # P2PError: the DHT could not be read this time
            log.warning("could not read metrics: %s", e)
            return {}

    def _check_manifests(self, collab: Any) -> None:
        """Compare the manifests peers republish (their DHT slots) with ours; WARNING, once per
        peer and digest, for any other: newcomers that join through that peer would train
        another model. We only ever serve our own."""
        from examples.sahajbert import manifest
        from p2p.dht.records import owner_markers

        if self.envelope is None or self.manifest is None:
            return
        limit = self.opts.read_timeout

        async def read(core: Any) -> Any:
            with trio.move_on_after(limit):
                return await core.dht.get(manifest.manifest_key(core.run_id))
            return None

        try:
            found = collab.run_async(read)
        except RuntimeError as e:  # P2PError: not readable this time
            log.info("could not read the manifests peers serve: %s", e)
            return
        if not isinstance(found, dict):
            return
        ours = self.manifest.digest
        for subkey, item in list(found.items())[:4096]:
            names = owner_markers(subkey) if isinstance(subkey, str) else []
            if len(names) != 1:
                continue
            peer, envelope = names[0], getattr(item, "value", item)
            if envelope == self.envelope:
                self.manifest_conflicts.pop(peer, None)
                continue
            try:
                theirs, signer = manifest.verify(envelope, run_id=self.cfg.run_id)
                digest, why = theirs.digest, f"signed by {signer}"
            except manifest.ManifestError as e:
                body = envelope.get("manifest") if isinstance(envelope, dict) else None
                raw = body if isinstance(body, bytes) else repr(envelope).encode()
                digest, why = hashlib.sha256(raw).hexdigest(), str(e)
            if digest == ours:
                continue  # the same manifest, signed again (by the owner)
            if self.manifest_conflicts.get(peer) != digest:
                if len(self.manifest_conflicts) >= 4096:
                    self.manifest_conflicts.clear()
                self.manifest_conflicts[peer] = digest
                log.warning(
                    "peer %s republishes run manifest %s (%s), not the run's %s: peers that "
                    "join through it train another model", peer, digest, why, ours,
                )  # fmt: skip

    def _check_final(self, final: int | None) -> None:
        """Give up, with :class:`FinalStateMissing`, when the run reached ``final`` but its
        state could not be downloaded for ``final_wait`` seconds (e.g. every trainer left
        before we got it): waiting on would wait forever."""
        if final is None or self.newest_epoch < final:
            return
        now = time.monotonic()
        if self.final_seen_at is None:
            self.final_seen_at = now
        elif now - self.final_seen_at > self.opts.final_wait:
            got = self.last_checkpoint[0] if self.last_checkpoint else None
            raise FinalStateMissing(
                f"the run reached epoch {final}, but its state could not be downloaded within "
                f"{self.opts.final_wait:.0f} s; the newest checkpoint is of epoch {got}"
            )

    def _stopped(self, records: dict[str, metrics.PeerMetrics]) -> int | None:
        """The epoch at which more than half of the trainers say they stopped (their
        ``--max-epochs``), or None. They serve that state only until we saved it, so it is
        saved then, off the ``checkpoint_every`` cadence; a minority's claim (one liar, or a
        volunteer leaving a run that goes on) saves nothing."""
        trainers = [r for r in records.values() if r.mode != "aux"]
        claims = sorted((r.stopped for r in trainers if r.stopped is not None), reverse=True)
        if len(claims) * 2 <= len(trainers):
            return None
        return claims[len(trainers) // 2]  # more than half stopped at this epoch or later

    def _checkpoint_due(self, epoch: int, stopped: int | None = None) -> bool:
        """Every ``checkpoint_every`` epochs, at ``exit_after_epoch``, and when most trainers
        stopped (at an epoch the run reached: a claim ahead of it waits for the run)."""
        done = self.last_checkpoint[0] if self.last_checkpoint else 0
        # the stop epoch itself: the claims may land a poll before our view reaches it, and
        # saving what we saw then wrote one checkpoint too many (epoch_000029 beside _000030)
        if stopped is not None and epoch >= stopped > done:
            return True
        final = self.opts.exit_after_epoch
        if epoch <= done:
            return False
        return epoch - done >= self.opts.checkpoint_every or (final is not None and epoch >= final)

    def _checkpoint(self, collab: Any) -> None:
        import dedloc_jax

        done = self.last_checkpoint[0] if self.last_checkpoint else None
        try:
            newest = collab.newest_state_epoch()
        except RuntimeError as e:  # P2PError: the DHT could not be read this time
            log.warning("could not read the states peers serve: %s", e)
            return
        if newest is None or (done is not None and newest <= done):
            return  # nothing newer to download (yet): the trainers announce after each step
        params, opt_state = self.template
        try:
            params, opt_state, epoch = dedloc_jax.sync_state(collab, params, opt_state, timeout=30)
        except (dedloc_jax.StateSyncError, ValueError) as e:
            log.warning("could not download the state to checkpoint: %s", e)
            return
        if done is not None and epoch <= done:
            log.info("the state served is of epoch %d, already checkpointed", epoch)
            return
        path = checkpoint.save_checkpoint(
            self.ckpt_dir,
            epoch,
            training.flat_params(params),
            self.model_cfg,
            training.tokenizer_dir(self.cfg),
            self.cfg.run_id,
            collab.run_async(checkpoint.served_lineage),
        )
        self.last_checkpoint = (epoch, path)
        dedloc_jax.share_state(collab, params, opt_state)  # serve it to newcomers too

        async def announce(core: Any) -> None:
            from p2p.dht import owner_marker

            # in our signed slot: a private run's keys take owned records only
            with trio.fail_after(self.opts.read_timeout):
                await core.dht.store(
                    metrics.checkpoint_key(core.run_id),
                    {"epoch": epoch, "path": str(path)},
                    core.dht.now() + 3600,
                    subkey=owner_marker(core.dht.peer_id),
                )

        try:
            collab.run_async(announce)
        except (RuntimeError, ValueError, trio.TooSlowError) as e:  # P2PError, a refused record
            log.warning("could not announce the checkpoint: %s", e)

    def _status(self, records: dict, est: Any, url: str, addrs: list[str]) -> dict[str, Any]:
        peers = [
            {k: v for k, v in asdict(r).items() if k != "history"}
            for r in sorted(records.values(), key=lambda r: r.peer)
        ]
        diverged = self.diverged
        # The trainers' own measured throughput: the tracker's rate counts a peer as zero
        # while it averages, which read "0.0 samples/s, ETA 0.0 s" while the run trained.
        rate = sum(r.samples_per_second for r in records.values() if r.mode != "aux")
        target = self.cfg.collaboration_target
        remaining = max(0.0, target - est.samples)
        eta = remaining / rate if rate > 0 else (est.eta if math.isfinite(est.eta) else None)
        return {
            "run_id": self.cfg.run_id,
            "state": "diverged" if diverged else "training",
            "diverged": {"epoch": min(diverged.values()), "peers": sorted(diverged)}
            if diverged
            else None,
            "manifest": self.manifest.digest if self.manifest else None,
            "tokenizer_sha256": self.manifest.tokenizer_sha256 if self.manifest else None,
            "manifest_conflicts": dict(sorted(self.manifest_conflicts.items())[:100]),
            "target_batch_size": self.cfg.target_batch_size,
            "target": target,  # samples per averaging (DiLoCo: inner_steps target batches)
            "mode": self.cfg.mode,
            # the manifest's: a codec, or topk (DiLoCo's sparse payloads) with its settings
            "compression": "topk"
            if self.cfg.compression == "topk"
            else trainer.collaboration_config(self.cfg).codec,
            # PowerSGD's rank, None when the run does not average low-rank gradients
            "powersgd": {"rank": self.cfg.powersgd_rank}
            if self.cfg.compression == "powersgd"
            else None,
            "topk": {
                "density": self.cfg.topk_density,
                "bits": self.cfg.topk_bits,
                "error_feedback": self.cfg.topk_error_feedback,
            }
            if self.cfg.compression == "topk"
            else None,
            "estimate": {
                "epoch": est.epoch,
                "samples": est.samples,
                "samples_per_second": rate,
                "eta": eta,
                "num_peers": getattr(est, "num_peers", len(peers)),
            },
            "peers": peers,
            "banned": self._bans,
            "rows": self.table.rows,
            "checkpoint": str(self.last_checkpoint[1]) if self.last_checkpoint else None,
            "checkpoint_epoch": self.last_checkpoint[0] if self.last_checkpoint else None,
            "dashboard": url,
            "addrs": addrs,
            "uptime": time.monotonic() - self.started,
        }


async def _signed(run_manifest: Any, identity: Any) -> dict:
    from examples.sahajbert import manifest

    return manifest.sign(run_manifest, identity)


def prepare_run(cfg: TrainerConfig, opts: CoordinatorOptions) -> tuple[Any, Path]:
    """The run's manifest and tokenizer directory: ``opts.manifest_dir``'s (prepared before),
    or prepared now from ``cfg`` into ``out_dir/run`` (the tokenizer trained once, here)."""
    from examples.sahajbert import manifest

    if opts.manifest_dir is not None:
        return manifest.load(opts.manifest_dir)
    return prepare(cfg, opts.out_dir / "run")


def prepare(cfg: TrainerConfig, out_dir: Path) -> tuple[Any, Path]:
    """Train (or take ``--tokenizer``'s) tokenizer once and write ``out_dir/manifest.json``
    and ``out_dir/tokenizer/``: what ``coordinator --manifest DIR`` publishes."""
    from examples.sahajbert import manifest

    tokenizer, tok_dir = training.prepare_tokenizer(cfg)
    codec = trainer.collaboration_config(cfg).rounds.codec
    made = manifest.build(cfg, tok_dir / manifest.TOKENIZER_FILE, len(tokenizer), codec)
    manifest.save(made, tok_dir / manifest.TOKENIZER_FILE, out_dir)
    return made, out_dir / "tokenizer"


def run_coordinator(cfg: TrainerConfig, net: NetConfig, opts: CoordinatorOptions) -> dict:
    return Coordinator(cfg, net, opts).run()
