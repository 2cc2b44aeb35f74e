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


def test_two_groups_apart_count_the_same_voters_once_their_roots_endorse() -> None:
    """Pairs A and B averaged apart: each vouches only for itself, so in A's view B is
    unvouched and A wins, in B's view the reverse (the run trained two models for good).
    Endorsed by their common root, both pairs count the same voters and agree; a pair the
    root trusts none of loses to one it trusts, and Sybils that mint vouches for each other
    (more of them, ahead) never vote."""
    la, lb = _lineage(b"A", 9), _lineage(b"B", 9)
    a = [Announcement(f"a{i}", 9, b"A\x09", la) for i in range(2)]
    b = [Announcement(f"b{i}", 9, b"B\x09", lb) for i in range(2)]
    sybils = [Announcement(f"s{i}", 11, b"S\x0b", _lineage(b"S", 11)) for i in range(5)]
    own = lambda side: [replace(x, vouched=True) for x in side]  # noqa: E731
    # Before: each pair wins in its own view.
    assert fork_choice([*own(a), *b, *sybils]) == (9, b"A\x09")
    assert fork_choice([*a, *own(b), *sybils]) == (9, b"B\x09")
    assert fork_verdict([a[1], *b], 9, b"A\x09", la, vouched=True) is False
    assert fork_verdict([*a, b[1]], 9, b"B\x09", lb, vouched=True) is False
    # The root trusts both: one choice in both views, and exactly one pair lost.
    both = [replace(x, endorsed=True) for x in (*a, *b)]
    view_a = [*own(both[:2]), *both[2:], *sybils]
    view_b = [*both[:2], *own(both[2:]), *sybils]
    assert fork_choice(view_a) == fork_choice(view_b) == (9, b"A\x09")  # (the smaller digest)
    assert fork_verdict([both[1], *both[2:]], 9, b"A\x09", la, True, True) is False
    assert fork_verdict([*both[:2], both[3]], 9, b"B\x09", lb, True, True) is True
    # The root trusts only B (it read B's vouches first): B wins, the larger A side loses.
    a3 = [*a, Announcement("a2", 9, b"A\x09", la)]
    rooted_b = [replace(x, endorsed=True, vouched=True) for x in b]
    assert fork_choice([*own(a3), *rooted_b, *sybils]) == (9, b"B\x09")
    assert fork_verdict([*own(a3[1:]), *rooted_b], 9, b"A\x09", la, vouched=True) is True
    # Sybils vouched in some view (their own clique) still never vote against endorsed ones.
    assert fork_choice([*both, *own(sybils)]) == (9, b"A\x09")


def test_a_book_endorses_whom_its_roots_trust_and_the_peers_they_vouch_for() -> None:
    root, peer, mate, sybil = _ids(4, "e")
    pr, pp, pm, ps = (str(x.peer_id) for x in (root, peer, mate, sybil))
    book = VouchBook([pr])
    assert not book.referred and not book.endorsed(pr)
    assert book.endorse([]) == 0 and not book.referred  # a root that trusts nobody yet
    assert VouchBook().endorse([pp]) == 0  # no root: nobody to take the word of
    assert book.endorse([pp]) == 2  # the root itself, and whom it named
    assert book.endorsed(pr) and book.endorsed(pp) and not book.endorsed(pm)
    assert book.endorses(pp) and not book.endorses(ps)
    assert book.endorse([pp]) == 0  # nothing new
    # Endorsement does not widen whose vouches our own trust counts.
    book.anchor([pm])
    assert not book.trusts(pp)

    async def main() -> dict[str, tuple[bool, bool]]:
        net = SimNetwork(seed=3)
        async with (
            open_sim_nodes(
                net, 3, config=NodeConfig.testing(), identities=[root, peer, sybil]
            ) as nodes,
            AsyncExitStack() as stack,
        ):
            dhts = [
                await stack.enter_async_context(
                    open_dht(
                        n,
                        initial_peers=[str(nodes[0].addrs[0])] if i else [],
                        config=DHTConfig.fast(),
                        clock=DHTClock(trio.current_time),
                    )
                )
                for i, n in enumerate(nodes)
            ]
            await trio.sleep(1.0)
            digest = b"d" * 32
            # peer (endorsed) vouches for mate; the Sybil vouches for itself and the mate
            for dht, who, mates in (
                (dhts[1], peer, [pm]),
                (dhts[2], sybil, [ps, pm]),
            ):
                vouch = sign_vouch(who, RUN, 5, digest, mates)
                value = {"epoch": 5, "digest": digest, "lineage": [], "addrs": []}
                value["vouches"] = [vouch.to_wire()]
                await dht.store(
                    state_key(RUN), value, dht.now() + 60, subkey=owner_marker(dht.peer_id)
                )
            await trio.sleep(1.0)
            reader = VouchBook([pr])
            reader.anchor([pm])  # (our own trust: the mate only)
            reader.endorse([pp])
            found = await read_announcements(nodes[0], dhts[0], RUN, whole=True, book=reader)
            names = {pp: "p", ps: "s"}
            out = {names[str(x.peer)]: (x.vouched, x.endorsed) for x in found}
            out["mate"] = (reader.vouched(pm), reader.endorsed(pm))
            return out

    seen = run_sim(main)
    assert seen == {"p": (False, True), "s": (False, False), "mate": (True, True)}


def test_a_first_peer_takes_co_founders_only_before_it_trusts_anyone() -> None:
    top, other, late, mate, b_mate, sybil = (str(x.peer_id) for x in _ids(6, "c"))
    book = VouchBook()  # a first peer: no roots, no mates
    assert book.join([b_mate]) == 0  # no co-founder: nobody's word to take
    # A peer joined through us and another first peer introduces it: a co-founder.
    assert book.cofound([top, other], top) == 1 and book.cofounders == {other}
    assert book.cofound([top, other], top) == 0
    book.ground([mate])  # trust on first use: the first vouches we read were our pair's
    assert book.cofound([top, late], top) == 0  # introduced after that: no co-founder
    assert book.cofounders == {other}
    # Whom the co-founder trusts, we trust as our own first signers, and tell our newcomers.
    assert not book.trusts(b_mate) and b_mate not in book.trusted_peers()
    assert book.join([b_mate]) == 1 and book.join([b_mate]) == 0
    assert book.trusts(b_mate) and book.trusted_peers() == [mate, b_mate]
    assert not book.trusts(sybil)
    # A peer with roots has its roots' word: it takes no co-founders.
    rooted = VouchBook([top])
    assert rooted.cofound([top, other], other) == 0 and not rooted.cofounders
