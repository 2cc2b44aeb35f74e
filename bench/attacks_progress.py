"""Hostile records against a run's progress, state offers and group registrations (issue 46).

Each function mounts one attack from an attacker's DHT (give it a DHT opened *without* the
run's schemas, as an attacker's own node would be: with them, its own store refuses what the
honest nodes refuse). They work the same in the simulator and against a real run, and return
what the store answered, so a benchmark can tell an attack the network refused from one it
accepted and the readers had to ignore.

- :func:`hijack_epoch`: one signed progress record at ``epoch`` 2**53 - 1, stored once with a
  7-day TTL (or, when the honest nodes refuse that TTL, the longest they take), then the
  attacker may leave; :func:`keep_leading` is the subtle variant (always one epoch ahead of
  the run, claiming a state of it).
- :func:`claim_samples`, :func:`keep_claiming_samples`: a record of 2**53 - 1 samples at the
  run's current epoch, once or republished.
- :func:`junk_state_offer`: a ``RUN.state`` announcement at epoch 10**6 with markup for addresses.
- :func:`lying_registration`: a group registration claiming 1e15 B/s up and down and a huge
  weight; :func:`lying_config`: a collaboration config whose peer claims those links in every
  registration it makes (the honest code path, lying figures).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.rounds.matchmaking import register
from dedloc_jax.rounds.wire import group_key
from dedloc_jax.state.serving import state_key
from dedloc_jax.tracker import progress_key
from p2p.dht import DHT, InvalidRecordError, StoreResult
from p2p.dht.records import owner_marker, owner_markers

HUGE = (1 << 53) - 1  # the largest integer the schemas took (exact in a float)
WEEK = 7 * 24 * 3600.0
LIE_BPS = 1e15
FAKE_DIGEST = b"\x00" * 32


def _progress(epoch: int, samples: int, sps: float, now: float) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "samples": samples,
        "sps": sps,
        "time": now,
        "mode": "node",
        "interval": 0.0,
        "waiting": False,
    }


async def _store(dht: DHT, key: str, value: Any, ttl: float) -> StoreResult:
    return await dht.store(key, value, dht.now() + ttl, subkey=owner_marker(dht.peer_id))


def accepted(result: StoreResult) -> bool:
    """Whether every node asked took the record (the attacker's own included)."""
    return result.stored > 0 and not result.refused


async def hijack_epoch(
    dht: DHT,
    run_id: str,
    *,
    epoch: int = HUGE,
    ttl: float = WEEK,
    fallback_ttl: float = 3000.0,
    state: bool = False,
) -> tuple[StoreResult, float]:
    """Store our progress record at ``epoch`` (no samples; with ``state``, claiming to serve a
    made-up state of that epoch) for ``ttl`` seconds; if a node refuses it, store it for
    ``fallback_ttl`` instead (the lifetime was perhaps what it refused). Returns the store's
    last answer and the TTL it used."""
    value = _progress(epoch, 0, 0.0, dht.now())
    if state:
        value["state"] = [epoch, FAKE_DIGEST, []]
    try:
        result = await _store(dht, progress_key(run_id), value, ttl)
    except InvalidRecordError:
        result = StoreResult(refused={"self": "refused locally"})
    if not result.refused:
        return result, ttl
    return await _store(dht, progress_key(run_id), value, fallback_ttl), fallback_ttl


async def current_epoch(dht: DHT, run_id: str) -> int:
    """The epoch most other peers of the run publish (0 when none is read)."""
    value = await dht.get(progress_key(run_id), quorum=0)
    me = str(dht.peer_id)
    epochs: Counter = Counter()
    for subkey, item in (value or {}).items() if isinstance(value, dict) else ():
        names = owner_markers(subkey)
        v = item.value
        if len(names) == 1 and names[0] != me and isinstance(v, dict):
            e = v.get("epoch")
            if isinstance(e, int) and not isinstance(e, bool) and e < HUGE:
                epochs[e] += 1
    return max(epochs, key=lambda e: (epochs[e], e)) if epochs else 0


async def keep_leading(
    dht: DHT,
    run_id: str,
    *,
    lead: int = 1,
    every: float = 0.5,
    state: bool = True,
    ttl: float = 60.0,
    samples: int = 0,
) -> None:
    """Claim the run's current epoch + ``lead`` (serving a made-up state of it with
    ``state``) every ``every`` seconds, so that the honest peers always look behind;
    ``samples``: claimed at that epoch too, so that a reader with no history of its own sees
    the attacker train there, as it sees a donor (keep_leading and claim_samples in one).

    Pass the ``ttl`` of the attacker's first record (:func:`hijack_epoch`'s): a node keeps
    whichever record of a subkey expires last, so republishes of a shorter life are dropped
    as outdated and the attack would be that one record, soon behind the run."""
    while True:
        epoch = await current_epoch(dht, run_id) + lead
        value = _progress(epoch, samples, 0.0, dht.now())
        if state:
            value["state"] = [epoch, FAKE_DIGEST, []]
        await _store(dht, progress_key(run_id), value, ttl)
        await trio.sleep(every)


async def claim_samples(
    dht: DHT,
    run_id: str,
    *,
    epoch: int,
    samples: int = HUGE,
    sps: float = 0.0,
    ttl: float = 60.0,
) -> StoreResult:
    """Claim ``samples`` samples (and ``sps`` samples/s) toward ``epoch``, once."""
    return await _store(dht, progress_key(run_id), _progress(epoch, samples, sps, dht.now()), ttl)


async def keep_claiming_samples(
    dht: DHT,
    run_id: str,
    *,
    samples: int = HUGE,
    every: float = 1.0,
    ttl: float = 60.0,
) -> None:
    """Claim ``samples`` at the run's current epoch every ``every`` seconds (until cancelled)."""
    while True:
        epoch = await current_epoch(dht, run_id)
        await claim_samples(dht, run_id, epoch=epoch, samples=samples, ttl=ttl)
        await trio.sleep(every)


async def junk_state_offer(
    dht: DHT,
    run_id: str,
    *,
    epoch: int = 10**6,
    addrs: tuple[str, ...] = ("<script>alert(1)</script>", "/ip4/1.2.3.4/tcp/1<b>"),
    ttl: float = 60.0,
) -> StoreResult:
    """Announce a state of ``epoch`` with a made-up digest and ``addrs`` (markup by default).
    Raises InvalidRecordError when the attacker's own DHT already refuses it."""
    value = {"epoch": epoch, "digest": FAKE_DIGEST, "lineage": [], "addrs": list(addrs)}
    return await _store(dht, state_key(run_id), value, ttl)


async def lying_registration(
    dht: DHT,
    run_id: str,
    epoch: int,
    addrs: list[str],
    *,
    bps: float = LIE_BPS,
    weight: float = float(HUGE),
    ttl: float = 60.0,
) -> None:
    """Register for ``epoch``'s group claiming ``bps`` up and down and ``weight`` samples."""
    member = {"mode": "node", "up": bps, "down": bps, "weight": weight}
    await register(
        dht, dht.peer_id, group_key(run_id, epoch), {"member": member, "addrs": addrs}, ttl
    )


def lying_config(config: CollaborationConfig, bps: float = LIE_BPS) -> CollaborationConfig:
    """``config`` for a peer that states ``bps`` up and down in every registration (its
    measured figures overridden), so the load-balancing LP would give it most of the vector."""
    if not (math.isfinite(bps) and bps > 0):
        raise ValueError("bps must be positive and finite")
    return config.replace(links=config.links.replace(upload_bps=bps, download_bps=bps))
