"""Opening a collaboration on a p2p node: :func:`open_collaboration` is the one place that
builds a peer's parts (reachability, the DHT, progress, bans, state, links, rounds) and hands
each the finished parts it uses; then it registers their handlers and starts their tasks."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from dedloc_jax.access import PrivateRun
from dedloc_jax.averaging import (
    AllReduceConfig,
    AveragingService,
    BandwidthMeter,
    LinkLocks,
    install_probe,
)
from dedloc_jax.averaging.links import LinkKeeper
from dedloc_jax.bans import Bans
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.peer import CollaborationPeer
from dedloc_jax.rounds.across import AcrossGroups
from dedloc_jax.rounds.average import Averager
from dedloc_jax.rounds.context import context_of
from dedloc_jax.rounds.early import EarlyGroups
from dedloc_jax.rounds.gather import SparseGather
from dedloc_jax.rounds.matchmaking import Matchmaker
from dedloc_jax.rounds.slots import Slots
from dedloc_jax.rounds.stepping import Stepper
from dedloc_jax.run_dht import RunDHT
from dedloc_jax.state import StateServer
from dedloc_jax.state.download import GoneDonors
from dedloc_jax.state.local import LocalState, mates_into
from dedloc_jax.state.serving import TRUST_REFRESH
from dedloc_jax.state.vouching import VouchBook
from dedloc_jax.tracker import ProgressTracker
from dedloc_jax.validators import run_validators
from p2p.dht import DHTClock, DHTConfig, open_dht
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.nat import NATConfig, NATManager, open_nat
from p2p.node import Node


@asynccontextmanager
async def open_collaboration(
    node: Node,
    run_id: str,
    *,
    initial_peers: Sequence[str | Multiaddr] = (),
    config: CollaborationConfig = CollaborationConfig(),
    dht_config: DHTConfig = DHTConfig(),
    dht_clock: DHTClock | None = None,
    nat_config: NATConfig | None = None,
    allreduce_config: AllReduceConfig = AllReduceConfig(),
) -> AsyncIterator[CollaborationPeer]:
    """Join (or start, with no initial peers) the collaboration ``run_id`` on ``node``.

    With ``config.reachability.detect`` the node first finds out whether it is reachable
    (``p2p.nat``, with ``nat_config``; None: the defaults): a peer behind NAT keeps relay
    reservations and advertises relayed addresses, and one with no inbound path at all takes
    part as a client.
    Unless ``config.mode`` forces one, the averaging mode follows reachability for the whole
    run (see :meth:`CollaborationPeer.follow_reachability`), as the DHT's mode does.
    ``allreduce_config``: the node's all-reduce settings (the run's robust aggregation and
    checks come from ``config``).
    """
    forced_mode = mode = config.mode
    # Made here, not by the DHT, so that a private run's policy reads DHT time from the start.
    clock = dht_clock or DHTClock(
        samples=dht_config.clock_samples, max_skew=dht_config.max_clock_skew
    )
    private = PrivateRun.for_config(
        node, run_id, config.access.owner_public_key, config.access.invitation, clock.now
    )
    async with AsyncExitStack() as stack:
        if config.reachability.detect:
            forced = {"client": True, "node": False, "aux": False}.get(mode or "")
            nat_config = nat_config or NATConfig()
            if forced is not None:
                nat_config = nat_config.replace(force_client_mode=forced)
            if not config.reachability.port_mapping:
                nat_config = nat_config.replace(port_mapping=None)
            nat = await stack.enter_async_context(
                open_nat(node, peers=initial_peers, config=nat_config)
            )
            mode = mode or ("client" if nat.client_mode else "node")
        else:
            nat = None
            mode = mode or ("node" if node.addrs else "client")
        dht = await stack.enter_async_context(
            open_dht(
                node,
                initial_peers=initial_peers,
                config=dht_config,
                client_mode=mode == "client" or (nat is not None and nat.dht_client_mode),
                clock=clock,
                # who may write first (a stranger is told that), then what a record holds
                validators=[
                    *(private.validators if private is not None else ()),
                    *(run_validators(run_id) if config.defence.record_schemas else ()),
                ],
            )
        )
        if nat is not None:
            nat.use_dht(dht)
        if private is not None:
            dht = private.attach(dht)
        admit = private.guard.admit if private is not None else None
        roots = _peer_ids(initial_peers)
        core = _assemble(node, dht, run_id, config, mode, nat, admit, allreduce_config, roots)
        install_probe(node, core.link_keeper.locks, core.meter)
        core.matchmaker.register()
        core.across.register()
        if core.rounds.gather is not None:
            core.rounds.gather.register()
        core.state_server.register()
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(core.tracker.run)
        if core.rounds.early is not None:
            await nursery.start(core.rounds.early.run)
        nursery.start_soon(core.state.keep_announced)
        nursery.start_soon(core.state.keep_referred, TRUST_REFRESH)
        if nat is not None and forced_mode is None:
            nursery.start_soon(core.follow_reachability)
        if config.links.measure and (mode != "client" or forced_mode is None):
            nursery.start_soon(core.link_keeper.keep_measured)
        try:
            yield core
        finally:
            nursery.cancel_scope.cancel()


def _assemble(
    node: Node,
    dht: RunDHT,
    run_id: str,
    config: CollaborationConfig,
    mode: str,
    nat: NATManager | None,
    admit: Callable[[PeerID, str | None], Awaitable[None]] | None,
    allreduce_config: AllReduceConfig,
    roots: Sequence[str] = (),
) -> CollaborationPeer:
    """Build a peer's parts, each handed the finished parts it uses. ``admit``: a private
    run's access guard (:meth:`~dedloc_jax.access.AccessGuard.admit`), which every handler
    calls first; None in an open run. ``roots``: the peers we joined through, whose vouches a
    newcomer trusts (:class:`~dedloc_jax.state.vouching.VouchBook`). The all-reduce service
    registers its handlers here, before any round can start."""
    bans = Bans(node, dht, run_id)
    vouches = VouchBook(roots)
    # Offers of donors that failed our downloads, held for an announcement's lifetime (the
    # tracker's record TTL, as the state server's): the tracker reads them too.
    gone = GoneDonors(lambda: tracker.record_ttl())
    tracker = ProgressTracker(
        dht,
        run_id,
        config,
        mode,
        banned=bans.is_banned,
        vouched=vouches.vouched,
        endorsed=vouches.endorsed,
        failed=gone.failed_at,
    )
    server = StateServer(
        node,
        dht,
        run_id,
        chunk_bytes=config.state.chunk_bytes,
        ttl=tracker.record_ttl,
        admit=admit,
        mates=functools.partial(mates_into, tracker),
        book=vouches,
    )
    state = LocalState(
        node,
        dht,
        run_id,
        server,
        tracker,
        vouches,
        rpc_timeout=config.rpc_timeout,
        renew_every=config.progress.ttl / 3,
        gone=gone,
    )
    slots = Slots()
    context = context_of(tracker, server.head_at, bans.is_banned, admit)
    meter = BandwidthMeter(
        upload_override=config.links.upload_bps, download_override=config.links.download_bps
    )
    links = LinkKeeper(
        node,
        meter,
        LinkLocks(),
        tracker,
        probe_bytes=config.links.probe_bytes,
        rpc_timeout=config.rpc_timeout,
        unmeasured=(config.links.unmeasured_upload_bps, config.links.unmeasured_download_bps),
    )
    matchmaker = Matchmaker(
        node,
        dht,
        run_id,
        max_group_size=config.rounds.max_group_size,
        context=context,
        slots=slots,
    )
    rounds = Averager(
        AveragingService(node, allreduce_config, admit=admit),
        matchmaker,
        AcrossGroups(node, slots, admit=admit),
        links,
        tracker,
        averaging_timeout=config.rounds.averaging_timeout,
        robust_tau=config.defence.robust_tau,
        robust=config.robust_on,
        verify=config.verify_on,
        gather=SparseGather(node, admit=admit),
        bans=bans,
        # planning ahead of the target only when asked: otherwise a round forms its group at it
        early=EarlyGroups(matchmaker, bans) if config.rounds.match_early else None,
    )
    stepper = Stepper(rounds, tracker, server, config)
    return CollaborationPeer(
        node, dht, config, mode, tracker=tracker, bans=bans, state=state, stepper=stepper, nat=nat
    )


def _peer_ids(addrs: Sequence[str | Multiaddr]) -> list[str]:
    """The peer IDs named in ``addrs`` (those without one, or malformed, are skipped)."""
    out = []
    for addr in addrs:
        try:
            pid = (addr if isinstance(addr, Multiaddr) else Multiaddr.parse(str(addr))).peer_id
        except P2PError:
            continue
        if pid is not None:
            out.append(str(pid))
    return out
