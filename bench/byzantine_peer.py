"""The real sahajBERT trainer with one attack patched in, for ``python -m bench.byzantine
--processes`` (issue 46): ``python -m bench.byzantine_peer ATTACK GO_FILE PREFIX -- ARGS``.

The process is ``python -m examples.sahajbert ARGS`` (``trainer ...`` or ``coordinator ...``);
the patches live here, in this process only (production code has no switch for any of them),
and take effect once ``GO_FILE`` exists, so that the run is measured clean first:

- ``none``: an honest trainer; ``undefended``: an honest trainer (or coordinator) whose
  rounds run without robust aggregation and verification in alternate spans of epochs from
  the one written in ``GO_FILE`` (every peer of the run patched alike switches at the same
  epochs: the defences' cost measured within one run, its load drift averaged out);
- ``lying_reducer``: states 1e15 B/s links (so the load balancer gives it a share) and returns
  -1000 x the aggregate of every share it reduces;
- ``sign_flip``: sends -1000 x its gradients;
- ``lying_config``: states 1e15 B/s links in every registration (reduces honestly);
- the progress attacks of :mod:`bench.attacks_progress` (``hijack_epoch``, ``keep_leading``,
  ``claim_samples``, ``junk_state_offer``), mounted from a second DHT node of this process
  (without the run's schemas, as an attacker's own node would be) while it trains honestly.

``PREFIX.notes.jsonl`` gets one line per log record that tells of an attack seen (a ban, a
progress record ignored, an invalid record dropped, a claim bounded) with its exact time, for
the driver to count rounds; ``PREFIX.attack.json`` one object when a progress attack was
mounted: ``refused`` (whether an honest node refused one of its records), ``at``,
``mounted_at`` and ``peer`` (the attacker's node, whose records the honest peers' logs name).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio

from bench.attacks_progress import lying_config
from dedloc_jax.rounds.wire import MAX_BPS

log = logging.getLogger("bench.byzantine_peer")

LIE = np.float32(-1000.0)
LIE_BPS = MAX_BPS  # the most the registration schema takes
PROGRESS = ("hijack_epoch", "keep_leading", "claim_samples", "junk_state_offer")
ATTACKS = ("none", "undefended", "lying_reducer", "sign_flip", "lying_config", *PROGRESS)


class Go:
    """Whether the attack is on (the driver created the file), from which epoch and for how
    many epochs at a time (the file's ``EPOCH PERIOD``: on for ``PERIOD`` epochs, off for as
    many, and so on; empty: on from now, for good)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._on = False
        self.epoch = 0
        self.period = 0

    def __call__(self) -> bool:
        if not self._on and self.path.exists():
            numbers = [int(w) for w in self.path.read_text().split() if w.isdigit()]
            self.epoch, self.period = (numbers + [0, 0])[:2]
            self._on = True
        return self._on

    def at(self, epoch: int) -> bool:
        """Whether the attack holds at ``epoch``."""
        if not self() or epoch < self.epoch:
            return False
        return not self.period or (epoch - self.epoch) // self.period % 2 == 0


def _undefended_from(go: Go) -> None:
    """Rounds of an epoch from ``go.epoch`` on run the plain mean, unchecked."""
    import dataclasses

    from dedloc_jax.rounds import stepping

    defended = stepping.average_round  # the name the trainer's rounds call

    async def switched(rounds: Any, epoch: int, *args: Any, **kw: Any) -> Any:
        if go.at(epoch):
            rounds = dataclasses.replace(rounds, robust=False, verify=False)
        return await defended(rounds, epoch, *args, **kw)

    stepping.average_round = switched


NOTED = ("banning", "ignoring peer", "invalid record", "bounded by the group's medians")


class _Notes(logging.Handler):
    """Appends the records that tell of an attack seen to a JSON-lines file, timed exactly
    (the trainer's log format keeps whole seconds only)."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(n in message for n in NOTED):
            row = {"t": record.created, "logger": record.name, "message": message[:300]}
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


def _patch_config(change: Callable[[Any], Any]) -> None:
    """Every collaboration this process opens gets its config through ``change``."""
    from examples.sahajbert import trainer

    honest = trainer.collaboration_config

    def patched(*args: Any, **kw: Any) -> Any:
        return change(honest(*args, **kw))

    trainer.collaboration_config = patched


def _lying_reducer(go: Go) -> None:
    from dedloc_jax.averaging.reducer import Reducer

    honest = Reducer._aggregate

    def lying(self: Reducer, k: int, avg: np.ndarray) -> None:
        honest(self, k, avg)
        if go():
            avg *= LIE

    Reducer._aggregate = lying  # type: ignore[method-assign]


def _sign_flip(go: Go) -> None:
    from dedloc_jax.collaboration import Collaboration

    honest = Collaboration.average_gradients

    def flipped(self: Collaboration, epoch: int, gradients: Any, samples: int, **kw: Any) -> Any:
        if go():
            gradients = [np.asarray(g) * LIE for g in gradients]
        return honest(self, epoch, gradients, samples, **kw)

    Collaboration.average_gradients = flipped  # type: ignore[method-assign]


def _progress_attack(attack: str, go: Go, report: Path) -> None:
    """Once started, the collaboration also runs an attacker's DHT node that mounts ``attack``
    when ``go`` turns on."""
    from bench.byzantine import mount
    from dedloc_jax.collaboration import Collaboration
    from p2p.dht import DHTConfig, open_dht
    from p2p.identity import Identity
    from p2p.node import NodeConfig, open_node

    honest_start = Collaboration.start

    async def attacker(collab: Collaboration, *, task_status: Any = trio.TASK_STATUS_IGNORED):
        async with (
            open_node(Identity.generate(), config=NodeConfig.bulk()) as node,
            open_dht(node, initial_peers=collab.addrs, config=DHTConfig.fast()) as dht,
        ):
            task_status.started()
            while not go():
                await trio.sleep(0.2)
            refused: list[bool] = []
            mounted = time.time()

            def write() -> None:
                row = {"refused": any(refused), "at": time.time(), "peer": str(node.peer_id),
                       "mounted_at": mounted}  # fmt: skip
                report.write_text(json.dumps(row))

            log.warning("mounting %s", attack)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(mount, attack, dht, collab.run_id, refused)
                await trio.sleep(3.0)
                write()
                await trio.sleep_forever()

    def start(self: Collaboration) -> Collaboration:
        honest_start(self)
        if self.mode != "aux":
            self._thread.start_service(attacker, self)  # type: ignore[union-attr]
        return self

    Collaboration.start = start  # type: ignore[method-assign]


def _cpu_in_epoch_events() -> None:
    """Each epoch event also carries this process's CPU seconds so far (``cpu``): the driver
    sets the CPU an epoch costs with the defences against without them."""
    import time

    from examples.sahajbert.events import EventLog

    plain = EventLog.epoch

    def with_cpu(self: Any, epoch: int, how: str, params: Any, **fields: Any) -> None:
        plain(self, epoch, how, params, cpu=round(time.process_time(), 4), **fields)

    EventLog.epoch = with_cpu


def main(argv: list[str]) -> int:
    attack, go_file, prefix = argv[0], Path(argv[1]), argv[2]
    if attack not in ATTACKS or argv[3] != "--":
        raise SystemExit(f"usage: ATTACK GO_FILE PREFIX -- ARGS (ATTACK: {ATTACKS})")
    go = Go(go_file)
    notes = _Notes(Path(prefix + ".notes.jsonl"))
    for name in ("dedloc_jax", "p2p"):
        logging.getLogger(name).addHandler(notes)
    _cpu_in_epoch_events()
    if attack == "undefended":
        _undefended_from(go)
    elif attack in ("lying_reducer", "lying_config"):
        _patch_config(lambda c: lying_config(c, LIE_BPS))
    if attack == "lying_reducer":
        _lying_reducer(go)
    elif attack == "sign_flip":
        _sign_flip(go)
    elif attack in PROGRESS:
        _progress_attack(attack, go, Path(prefix + ".attack.json"))
    from examples.sahajbert.__main__ import main as sahajbert

    return sahajbert(argv[4:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
