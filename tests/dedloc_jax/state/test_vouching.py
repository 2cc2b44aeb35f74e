"""Vouches (dedloc_jax.state.vouching) and the fork choice's rule for them (pure), and how
read_announcements counts them (simulator)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import replace

import trio

from dedloc_jax.state.lineage import Announcement, fork_choice, fork_verdict, losing_peers
from dedloc_jax.state.serving import read_announcements, state_key
from dedloc_jax.state.vouching import Vouch, VouchBook, sign_vouch, vouched_by_another
from p2p.dht import DHTClock, DHTConfig, open_dht
from p2p.dht.records import owner_marker
from p2p.identity import Identity
from p2p.node import NodeConfig
from p2p.testing import SimNetwork, open_sim_nodes, run_sim

RUN = "run"


def _ids(n: int, tag: str) -> list[Identity]:
    return [Identity.from_seed(f"{tag}{i}".encode()) for i in range(n)]


def test_a_vouch_counts_only_signed_by_another_peer_naming_the_announcer() -> None:
    a, b, sybil = _ids(3, "v")
    pa, pb, ps = (str(x.peer_id) for x in (a, b, sybil))
    digest = b"d" * 32
    by_b = sign_vouch(b, RUN, 5, digest, [pa, pb])
    assert vouched_by_another(RUN, pa, [by_b])
    assert not vouched_by_another(RUN, ps, [by_b])  # replayed: names a, not the Sybil
    assert not vouched_by_another(RUN, pb, [by_b])  # its own word is no vouch
    assert not vouched_by_another("other", pa, [by_b])  # another run's
    forged = replace(by_b, mates=(pa, ps))  # the Sybil added to b's mates
    assert not vouched_by_another(RUN, ps, [forged])
    by_sybil = replace(by_b, key=sybil.public_key)  # b's signature under another key
    assert not vouched_by_another(RUN, pa, [by_sybil])
    wire = Vouch.from_wire(by_b.to_wire())
    assert wire == by_b
    assert Vouch.from_wire([5, digest, [pa], b"short", b"sig"]) is None
    book = VouchBook()
    book.record(pa)
    assert book.vouched(pa) and not book.vouched(pb)


def _lineage(tag: bytes, epoch: int) -> tuple[bytes, ...]:
    return tuple(tag + bytes([epoch - k]) for k in range(1, 5))


def test_unvouched_announcers_vote_only_when_no_state_is_vouched() -> None:
    honest = [Announcement(f"h{i}", 9, b"H\x09", _lineage(b"H", 9), vouched=True) for i in range(3)]
    sybils = [Announcement(f"s{i}", 12, b"S\x0c", _lineage(b"S", 12)) for i in range(6)]
    assert fork_choice([*honest, *sybils]) == (9, b"H\x09")
    assert losing_peers([*honest, *sybils]) == {f"s{i}" for i in range(6)}
    assert fork_verdict(sybils + honest[1:], 9, b"H\x09", _lineage(b"H", 9), True) is False
    # Before the vouches: six announcers outvote three.
    unvouched = [replace(a, vouched=False) for a in honest]
    assert fork_choice([*unvouched, *sybils]) == (12, b"S\x0c")
    # A run of one (no vouch anywhere): its state is the one to load.
    assert fork_choice([replace(honest[0], vouched=False)]) == (9, b"H\x09")


def test_a_vouch_counts_only_from_a_signer_traced_to_our_own_mates() -> None:
    """Sybils signing vouches for each other got vouched; once we averaged with someone, only
    our mates' vouches and those of peers they vouched for count."""
    mate, far, s1, s2 = _ids(4, "t")
    pm, pf, p1, p2 = (str(x.peer_id) for x in (mate, far, s1, s2))
    digest = b"d" * 32
    book = VouchBook()
    by_s1 = sign_vouch(s1, RUN, 5, digest, [p2])
    assert book.trusts(p1)  # a newcomer (no mate yet) takes every signer, as before
    assert vouched_by_another(RUN, p2, [by_s1], book.trusts)
    book.anchor([pm])
    assert book.vouched(pm) and book.trusts(pm)
    assert not vouched_by_another(RUN, p2, [by_s1], book.trusts)  # a Sybil's word for a Sybil
    assert vouched_by_another(RUN, pf, [sign_vouch(mate, RUN, 5, digest, [pf])], book.trusts)


def test_a_vouch_counts_wherever_it_is_carried() -> None:
    """Issue 46: after a partition healed, a peer whose mates were all on its side traced no
    signer to the majority: each announcement's own vouches name its newest mates, none of
    ours, so the majority's states counted as unvouched, our side's lineage won our fork
    choice and we stepped apart on it (test_soak_small[capped], seen under the scheduler
    order hypothesis's trio plugin sets). A mate's own vouch names the peers it averaged with:
    that is the same signed word, carried in its announcement instead of theirs."""
    names = ["reader", "mate", "x", "y", "s1", "s2"]
    ids = {n: Identity.from_seed(f"carried-{n}".encode()) for n in names}
    pid = {n: str(i.peer_id) for n, i in ids.items()}

    def vouch(signer: str, epoch: int, *mates: str) -> list:
        digest = bytes([epoch]) * 32
        return sign_vouch(ids[signer], RUN, epoch, digest, [pid[m] for m in mates]).to_wire()

    carried = {
        # our mate moved on with x (its own vouch names x); it serves epoch 4
        "mate": (4, [vouch("mate", 4, "x"), vouch("reader", 3, "mate")]),
        # x and y averaged into 5: each carries its own vouch and the other's naming it
        "x": (5, [vouch("x", 5, "y"), vouch("y", 5, "x")]),
        "y": (5, [vouch("y", 5, "x"), vouch("x", 5, "y")]),
        # two Sybils vouch for each other: nobody we trust named either
        "s1": (9, [vouch("s1", 9, "s2"), vouch("s2", 9, "s1")]),
        "s2": (9, [vouch("s2", 9, "s1"), vouch("s1", 9, "s2")]),
    }

    async def main() -> dict[str, bool]:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(
            net, len(names), config=NodeConfig.testing(), names=names, identities=list(ids.values())
        ) as nodes:
            dhts = []
            async with AsyncExitStack() as stack:
                for node in nodes:
                    first = [] if not dhts else [str(nodes[0].addrs[0])]
                    dhts.append(
                        await stack.enter_async_context(
                            open_dht(
                                node,
                                initial_peers=first,
                                config=DHTConfig.fast(),
                                clock=DHTClock(trio.current_time),
                            )
                        )
                    )
                await trio.sleep(1.0)
                for name, dht in zip(names, dhts, strict=True):
                    if name in carried:
                        epoch, vouches = carried[name]
                        value = {"epoch": epoch, "digest": bytes([epoch]) * 32, "lineage": [],
                                 "addrs": [], "vouches": vouches}  # fmt: skip
                        subkey = owner_marker(nodes[names.index(name)].peer_id)
                        assert (await dht.store(state_key(RUN), value, dht.now() + 60,
                                                subkey=subkey)).ok  # fmt: skip
                book = VouchBook()
                book.anchor([pid["mate"]])  # the reader averaged with its mate only
                found = await read_announcements(nodes[0], dhts[0], RUN, whole=True, book=book)
                return {names[[pid[n] for n in names].index(str(a.peer))]: a.vouched for a in found}

    vouched = run_sim(main)
    assert vouched == {"mate": True, "x": True, "y": True, "s1": False, "s2": False}


def test_a_newcomer_traces_signers_to_the_peers_it_joined_through() -> None:
    """A newcomer (no mate yet) trusted every signer, so Sybils vouching for each other led
    it; with roots (its initial peers) only signers traced to them count, and peers recorded
    while it trusted everyone are forgotten once it averages."""
    root, mate, s1, s2 = _ids(4, "r")
    pr, pm, p1, p2 = (str(x.peer_id) for x in (root, mate, s1, s2))
    digest = b"d" * 32
    by_s1 = sign_vouch(s1, RUN, 5, digest, [p2])
    rooted = VouchBook([pr])
    assert not rooted.trusts(p1)
    assert not vouched_by_another(RUN, p2, [by_s1], rooted.trusts)  # a Sybil's word
    assert vouched_by_another(RUN, pm, [sign_vouch(root, RUN, 5, digest, [pm])], rooted.trusts)
    rooted.record(pm)
    assert rooted.trusts(pm)  # traced to the root
    book = VouchBook()  # the run's first peer: no root, every signer counts
    assert vouched_by_another(RUN, p2, [by_s1], book.trusts)
    book.record(p2)
    book.anchor([pm])
    assert not book.trusts(p2)  # recorded on a Sybil's word before we had a mate
