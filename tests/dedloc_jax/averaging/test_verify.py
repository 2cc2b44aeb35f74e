"""Verified averaging: every member checks every reducer's result in the same round."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import trio

from dedloc_jax.averaging import AllReduceConfig, flatten
from dedloc_jax.averaging.audit import check_evidence
from dedloc_jax.averaging.butterfly import AllReduceState
from dedloc_jax.averaging.reducer import Reducer
from dedloc_jax.averaging.robust import centered_clip
from dedloc_jax.averaging.verify import derived_tau

from .helpers import check_survivors, equivocate, make_tree, run_round

SHAPES = [(7, 9), (33,), (5,)]
VERIFY = AllReduceConfig.testing().replace(verify=True)


def _results(outcome):
    ok = [o for o in outcome if o is not None and not isinstance(o, Exception)]
    assert len(ok) == len(outcome), outcome
    return ok


@pytest.fixture
def liar(monkeypatch):
    """Make the reducer named in ``liar.name`` return -1000 x the aggregate of its share."""

    class Liar:
        name: str | None = None
        factor = -1000.0

    original = Reducer._aggregate

    def lying(self, k, avg):
        original(self, k, avg)
        if self.plan.name(self.plan.me) == Liar.name:
            avg *= np.float32(Liar.factor)

    monkeypatch.setattr(Reducer, "_aggregate", lying)
    return Liar


def ev_bytes(result):
    return result.accusations[0].evidence["encoded"]


def _names(n: int, seed: int = 0) -> list[str]:
    """The members' peer IDs of a run_round with ``n`` nodes (deterministic per seed)."""
    _, _, names = run_round(["node"] * n, [{"x": np.zeros(1, np.float32)}] * n, [1.0] * n)
    return names


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("robust", [False, True])
def test_honest_round_passes_its_check_with_every_codec(codec, robust):
    rng = np.random.default_rng(3)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 1.5]
    cfg = VERIFY.replace(robust=robust)
    outcome, _, names = run_round(
        ["node"] * 3 + ["client"], trees, weights, codec=codec, config=cfg
    )
    results = _results(outcome)
    for r in results:
        assert r.accusations == ()
        assert not any(s.dropped for s in r.shares)
        assert r.vector.tobytes() == results[0].vector.tobytes()
    if not robust:
        tol = {"none": 1e-5, "fp16": 2e-3, "bf16": 2e-2, "int8": 5e-2}[codec]
        check_survivors(outcome, trees, weights, names, rtol=tol, atol=tol)


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("robust", [False, True])
def test_lying_reducer_is_caught_in_the_same_round_and_its_share_recomputed(liar, codec, robust):
    """Every honest member convicts the reducer and recomputes its share from the senders'
    revealed parts without the liar's: the same bits everywhere, the honest members' aggregate
    there and the whole group's elsewhere (it was zeroed before)."""
    n = 4
    names = _names(n)
    liar.name = names[1]
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(n)]
    weights = [1.0] * n
    cfg = VERIFY.replace(robust=robust)
    outcome, _, got_names = run_round(["node"] * n, trees, weights, codec=codec, config=cfg)
    assert got_names == names
    results = _results(outcome)
    honest = [r for i, r in enumerate(results) if i != 1]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()  # identical bits
        assert [a.peer for a in r.accusations] == [liar.name]
        assert r.accusations[0].role == "reducer"
        assert check_evidence(r.accusations[0].evidence, liar.name)
        assert not check_evidence(r.accusations[0].evidence, names[0])  # nobody else convicted
        forged = dict(r.accusations[0].evidence, encoded=b"\0" * len(ev_bytes(r)))
        assert not check_evidence(forged, liar.name)  # the reducer never signed other bytes
    share = next(s for s in honest[0].shares if s.owner == liar.name)
    assert share.recomputed and not share.dropped
    assert share.contributors == frozenset(names) - {liar.name}
    vec = honest[0].vector
    # the liar's share is the others' aggregate, every other share the whole group's
    parts = [flatten(t)[0] for t in trees]
    tol = {"none": 1e-5, "fp16": 2e-3, "bf16": 2e-2, "int8": 5e-2}[codec]
    tol = max(tol, 1e-3) if robust else tol  # CenteredClip stops within 1e-4 of its radius
    for s in honest[0].shares:
        members = [p for i, p in enumerate(parts) if i != 1] if s.owner == liar.name else parts
        want = _aggregate(members, s.start, s.stop, cfg.chunk_elems, robust)
        np.testing.assert_allclose(vec[s.start : s.stop], want, atol=tol, rtol=tol)


def _aggregate(parts, start, stop, chunk, robust):
    """The rule's aggregate of equal-weight parts over ``start..stop``, chunk by chunk."""
    out = np.empty(stop - start)
    for a in range(start, stop, chunk):
        b = min(a + chunk, stop)
        x = np.asarray([p[a:b] for p in parts], np.float64)
        if robust:
            tau = derived_tau([np.linalg.norm(v) for v in x])
            out[a - start : b - start] = centered_clip(x, np.ones(len(x)), tau, 200, tol=1e-9)
        else:
            out[a - start : b - start] = x.mean(axis=0)
    return out


def test_sender_lying_about_its_projection_is_convicted_not_the_reducer(monkeypatch):
    import dedloc_jax.averaging.audit as audit

    names = _names(4)
    original = audit._figures

    async def lying(rnd, seed):
        figs = await original(rnd, seed)
        if rnd.name(rnd.me) == names[2]:
            figs = {j: replace(f, q=f.q * 10 + 1.0) for j, f in figs.items()}
        return figs

    monkeypatch.setattr(audit, "_figures", lying)
    rng = np.random.default_rng(9)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    results = _results(outcome)
    honest = [r for i, r in enumerate(results) if i != 2]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        accused = {(a.peer, a.role) for a in r.accusations}
        assert accused == {(names[2], "sender")}, accused  # no honest reducer is named
        for a in r.accusations:
            assert check_evidence(a.evidence, names[2])
            reducer = a.evidence["members"][a.share]
            assert reducer == names[2] or not check_evidence(a.evidence, reducer)
        # every share failed (its figures were false everywhere): recomputed without it
        assert all(s.recomputed and names[2] not in s.contributors for s in r.shares)
    parts = [flatten(t)[0] for i, t in enumerate(trees) if i != 2]
    np.testing.assert_allclose(honest[0].vector, np.mean(parts, axis=0), atol=2e-3, rtol=2e-3)


def test_sign_flipped_gradient_is_bounded_by_default_centered_clip():
    """One of four sends -1000 x its gradient: the plain mean is poisoned, the derived-radius
    CenteredClip gives the honest peers' mean."""
    rng = np.random.default_rng(11)
    truth = rng.standard_normal(400).astype(np.float32)
    vecs = [truth + 0.3 * rng.standard_normal(400).astype(np.float32) for _ in range(4)]
    honest = np.mean(np.asarray(vecs[:3], np.float64), axis=0)
    vecs[3] = vecs[3] * np.float32(-1000)
    errs = {}
    for robust in (False, True):
        cfg = VERIFY.replace(robust=robust, chunk_elems=100)
        outcome, _, _ = run_round(["node"] * 4, [{"g": v} for v in vecs], [1.0] * 4, config=cfg)
        results = _results(outcome)
        assert all(r.accusations == () for r in results)  # honest reducers: nothing to catch
        errs[robust] = np.linalg.norm(results[0].vector - honest) / np.linalg.norm(honest)
    assert errs[False] > 100
    # a part ten times longer than the radius counts for nothing: the honest mean (clipping
    # alone left it at 1/3 of the radius off: 0.34 here)
    assert errs[True] < 0.01, errs


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("robust", [False, True])
def test_a_huge_hello_weight_counts_for_no_more_than_the_spec_allows(monkeypatch, verify, robust):
    """A sender whose hello states 1e6 samples (the spec, as the leader bounded it, says 1)
    moves the mean as one sample of four would; the verified check still passes."""
    original = AllReduceState.hello

    def boasting(self, share=-1):
        h = original(self, share)
        return replace(h, weight=1e6) if self.me == 3 else h

    monkeypatch.setattr(AllReduceState, "hello", boasting)
    n = 4
    trees = [{"x": np.full(40, 2.0 if i == 3 else 1.0, np.float32)} for i in range(n)]
    cfg = AllReduceConfig.testing().replace(verify=verify, robust=robust)
    outcome, _, _ = run_round(["node"] * n, trees, [1.0] * n, config=cfg, member_weights=[1.0] * n)
    results = _results(outcome)
    for r in results:
        assert r.accusations == ()
        assert not any(s.dropped for s in r.shares)
        # (3 * 1 + 2) / 4; CenteredClip leaves parts within its radius alone (the plain mean)
        np.testing.assert_allclose(r.vector, 1.25, atol=1e-6)


@pytest.mark.parametrize("robust", [False, True])
@pytest.mark.parametrize("hello_weight", [0.01, 0.5])
def test_a_sender_stating_a_smaller_hello_weight_cannot_frame_an_honest_reducer(
    monkeypatch, robust, hello_weight
):
    """A sender telling the reducers fewer samples than its signed statement (and the spec)
    says counts for the spec's weight in both: the honest reducers pass their checks, nobody
    is accused or dropped, and every member holds the same honest mean."""
    original = AllReduceState.hello

    def modest(self, share=-1):
        h = original(self, share)
        return replace(h, weight=hello_weight) if self.me == 3 else h

    monkeypatch.setattr(AllReduceState, "hello", modest)
    n = 4
    trees = [{"x": np.full(40, 2.0 if i == 3 else 1.0, np.float32)} for i in range(n)]
    cfg = VERIFY.replace(robust=robust)
    outcome, _, _ = run_round(["node"] * n, trees, [1.0] * n, config=cfg, member_weights=[1.0] * n)
    results = _results(outcome)
    for r in results:
        assert r.accusations == ()
        assert not any(s.dropped for s in r.shares)
        np.testing.assert_array_equal(r.vector, results[0].vector)
    np.testing.assert_allclose(results[0].vector, 1.25, atol=1e-6)


def test_a_sender_stating_no_weight_for_parts_it_sent_is_convicted_not_the_reducers(monkeypatch):
    """A sender whose parts every reducer counted signs a statement of weight 0: every share
    fails its check, and the reveal convicts the sender (its own hashes show it sent them),
    never an honest reducer; the shares are recomputed without it, the same bits everywhere."""
    import dedloc_jax.averaging.audit as audit

    names = _names(4)
    original = audit.make_statement

    def disowning(identity, round_id, digest, sender, weight, seed, shares, *rest):
        weight = 0.0 if sender == 3 else weight
        return original(identity, round_id, digest, sender, weight, seed, shares, *rest)

    monkeypatch.setattr(audit, "make_statement", disowning)
    rng = np.random.default_rng(4)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    honest = _results(outcome)[:3]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert {(a.peer, a.role) for a in r.accusations} == {(names[3], "sender")}
        assert all(check_evidence(a.evidence, names[3]) for a in r.accusations)
        assert all(s.recomputed and names[3] not in s.contributors for s in r.shares)


@pytest.mark.parametrize("modes", [["node"] * 3 + ["client"], ["node"] * 2 + ["client"] * 2])
def test_clients_push_their_parts_so_a_lying_reducers_share_is_recomputed(liar, modes):
    """Nobody can dial a client, so it pushes its parts of a failed share to the dialable
    members, who relay them to the other clients: the liar is convicted and its share
    recomputed by every honest member, clients included, with the same bits (without the
    pushes the clients' silence left the liar unconvicted and the share zeroed)."""
    n = len(modes)
    names = _names(n)
    liar.name = names[1]
    rng = np.random.default_rng(6)
    trees = [make_tree(rng, SHAPES) for _ in range(n)]
    outcome, _, _ = run_round(modes, trees, [1.0] * n, config=VERIFY)
    honest = [r for i, r in enumerate(_results(outcome)) if i != 1]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert [a.peer for a in r.accusations] == [liar.name]
        share = next(s for s in r.shares if s.owner == liar.name)
        assert share.recomputed and share.contributors == frozenset(names) - {liar.name}
    parts = [flatten(t)[0] for i, t in enumerate(trees) if i != 1]
    share = next(s for s in honest[0].shares if s.owner == liar.name)
    want = np.mean(parts, axis=0)[share.start : share.stop]
    np.testing.assert_allclose(honest[0].vector[share.start : share.stop], want, atol=2e-3)


def test_recompute_follows_the_reducers_rule_in_each_case():
    """A caught share's recomputation (every member, the same bits) is the reducers'
    aggregate: the plain weighted mean, CenteredClip's mean when nothing lies outside the
    radius, its clipped fixed point when a part does, nothing from a part over ten medians."""
    from dedloc_jax.averaging.verify import part_norm, recompute

    rng = np.random.default_rng(12)
    parts = [rng.standard_normal(500).astype(np.float32) for _ in range(4)]
    raw = [1.0, 2.0, 1.0, 3.0]

    def run(ps, robust):
        return recompute(ps, raw, [part_norm(p) for p in ps], robust, None, 200)

    got, tau = run(parts, False)
    want = np.average(np.asarray(parts, np.float64), axis=0, weights=raw)
    assert tau is None and np.allclose(got, want, atol=1e-6)
    got, tau = run(parts, True)  # all within the radius: the same mean
    assert tau == derived_tau([part_norm(p) for p in parts]) and np.allclose(got, want, atol=1e-6)
    far = [*parts[:3], parts[3] + np.float32(0.15) * np.float32(part_norm(parts[3]))]
    got, tau = run(far, True)  # one part outside the radius: CenteredClip's fixed point
    w = np.asarray(raw) / sum(raw)
    clipped = centered_clip(np.asarray(far, np.float64), w, tau, 500, tol=1e-12)
    assert np.allclose(got, clipped, atol=1e-3 * tau)
    assert not np.allclose(got, np.average(np.asarray(far, np.float64), axis=0, weights=raw))
    huge = [*parts[:3], parts[3] * np.float32(1000)]  # over ten medians: weighs nothing
    got, _ = run(huge, True)
    want = np.average(np.asarray(parts[:3], np.float64), axis=0, weights=raw[:3])
    assert np.allclose(got, want, atol=1e-5)
    again, _ = run(huge, True)
    assert again.tobytes() == got.tobytes()


def test_a_clean_rounds_check_costs_one_round_trip():
    """The statement swap was a stream per member (its acceptance a round trip) answered once
    the member held every statement: two round trips after the round, 81 ms of bench.byzantine's
    ~1 s epochs (7.3% slower than undefended). A unary call answered at once: one."""
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    latency = 0.01  # per host: a round trip between two hosts is 4 of them
    durations = {}
    for verify in (False, True):
        cfg = VERIFY.replace(verify=verify, robust=False)
        outcome, durations[verify], _ = run_round(
            ["node"] * 4, trees, [1.0] * 4, codec="fp16", config=cfg, latency=latency
        )
        _results(outcome)
    extra = durations[True] - durations[False]
    assert 0 < extra <= 4 * latency * 1.25, durations


def test_a_clean_rounds_statements_cross_each_link_once(monkeypatch):
    """Each member answered a statement call with every statement it held: n members moved
    ~n^3 statements a round (12 members in bench.collaboration: 15 MB of statements against
    8.5 MB of averaging). A clean round moves each statement over each link once: n(n-1).
    And one call a pair (the lower node calls, the answer waits for the callee's statement):
    each member called every other one before, n(n-1) calls of ~250 us CPU each."""
    from dedloc_jax.averaging import audit

    answer = audit.answer
    listed: list[int] = []

    async def counting(rnd, request, remote):
        reply = await answer(rnd, request, remote)
        listed.append(len(reply["l"]))
        return reply

    monkeypatch.setattr(audit, "answer", counting)
    n = 6
    rng = np.random.default_rng(7)
    trees = [make_tree(rng, SHAPES) for _ in range(n)]
    outcome, _, _ = run_round(["node"] * n, trees, [1.0] * n, codec="fp16", config=VERIFY)
    results = _results(outcome)
    assert all(r.vector.tobytes() == results[0].vector.tobytes() for r in results)
    assert len(listed) == n * (n - 1) // 2  # one call a pair (n(n-1) before)
    # pushed statements (n(n-1), in the requests) plus those listed in the answers
    assert n * (n - 1) + sum(listed) <= 2 * n * (n - 1), listed


def test_members_that_cannot_reach_each_other_get_their_statements_relayed(liar, monkeypatch):
    """Members 1 and 2 cannot call each other: each one's statement reaches the other through
    a member asked to answer once it holds them all, and both still catch the lying reducer."""
    from dedloc_jax.averaging import audit

    swap = audit._swap

    async def cut(rnd, i, mine, wait, unreached):
        if {rnd.me, i} == {1, 2}:
            unreached.add(i)
            return
        await swap(rnd, i, mine, wait, unreached)

    monkeypatch.setattr(audit, "_swap", cut)
    rng = np.random.default_rng(6)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    liar.name = _names(4)[3]
    outcome, _, names = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    results = _results(outcome)
    honest = [r for r, n in zip(results, names, strict=True) if n != liar.name]
    assert all(len(r.accusations) == 1 for r in honest)
    assert all(r.accusations[0].peer == liar.name for r in honest)
    assert all(r.vector.tobytes() == honest[0].vector.tobytes() for r in honest)


def _framing_evidence(monkeypatch, codec, robust):
    """Members that 'fail' the honest reducer names[1]'s share and so gather real signed
    statements, revealed parts and the reducer's signed result into an accusation: the
    material an accuser holds to forge evidence from (a member answers reveals only while it
    keeps its parts, after a failed check of its own, so all of them 'fail' it here)."""
    import dedloc_jax.averaging.audit as audit
    from dedloc_jax.averaging.audit import ChunkCheck

    names = _names(4)
    original = audit._check_shares

    async def framing(rnd, stated, *rest):
        unverified, failures, silent = await original(rnd, stated, *rest)
        j = [m.peer_id for m in rnd.members].index(names[1])
        failures[j] = (0, ChunkCheck(False, "framed"))
        return unverified, failures, silent

    monkeypatch.setattr(audit, "_check_shares", framing)
    rng = np.random.default_rng(11)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    cfg = VERIFY.replace(robust=robust)
    outcome, _, got = run_round(["node"] * 4, trees, [1.0] * 4, codec=codec, config=cfg)
    assert got == names
    accuser = _results(outcome)[0]
    (acc,) = accuser.accusations
    assert acc.peer == names[1] and acc.role == "reducer"
    return acc.evidence, names


@pytest.mark.parametrize("codec,robust", [("fp16", False), ("int8", True)])
def test_evidence_naming_other_terms_than_the_signed_ones_convicts_nobody(
    monkeypatch, codec, robust
):
    """The codec, the chunk's place and the aggregation rule in a ban's evidence are signed by
    the reducer and by every contributor (the digest of the result chunk each received): an
    accuser naming another codec (whose decoding contradicts an honest sender's projection),
    no CenteredClip (an honest reducer's radius then 'breaks the rule'), a fixed radius, another
    place or other result bytes convicts neither the honest reducer nor an honest sender."""
    evidence, names = _framing_evidence(monkeypatch, codec, robust)
    assert not any(check_evidence(evidence, p) for p in names)  # the unforged check passes
    other = {"fp16": "bf16", "int8": "fp16"}[codec]
    forgeries = {
        "codec": dict(evidence, codec=other),
        "segments": dict(evidence, codec=f"{codec}*{evidence['stop'] - evidence['start']}"),
        "robust": dict(evidence, robust=not robust),
        "fixed_tau": dict(evidence, fixed_tau=1e-9, robust=True),
        "start": dict(evidence, start=evidence["start"] + 1, stop=evidence["stop"] + 1),
        "encoded": dict(evidence, encoded=bytes(len(evidence["encoded"]))),
    }
    for what, forged in forgeries.items():
        convicted = [p for p in names if check_evidence(forged, p)]
        assert convicted == [], (what, convicted)


def test_a_member_that_states_no_figures_for_a_share_it_was_counted_in_is_not_convicted(
    monkeypatch,
):
    """A member whose share of reducer j was repaired on its side states no figures for it,
    though j counted its part: it was convicted as a sender ("stated nothing for this share"),
    and by a third party too, so a reducer that stalled one member's results could have it
    banned, and a lying reducer that counted an abstainer could frame it. Nothing signed tells
    which of the two lies: nobody is convicted, and the share is dropped."""
    import dedloc_jax.averaging.audit as audit

    names = _names(4)
    original = audit._figures

    async def repaired_here(rnd, seed):
        figs = await original(rnd, seed)
        if rnd.name(rnd.me) == names[2]:
            j = [m.peer_id for m in rnd.members].index(names[1])
            figs = {jj: f for jj, f in figs.items() if jj != j}
        return figs

    monkeypatch.setattr(audit, "_figures", repaired_here)
    rng = np.random.default_rng(13)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    results = _results(outcome)
    for r in results:
        assert r.accusations == ()
        share = next(s for s in r.shares if s.owner == names[1])
        assert share.dropped
        assert r.vector.tobytes() == results[0].vector.tobytes()


@pytest.mark.parametrize("lies", [False, True])
def test_a_reducer_counting_an_abstainer_is_convicted_on_its_signed_hello(monkeypatch, lies):
    """Member 2 abstains (weight 0): its signed hello says so. A reducer that counts it in its
    share anyway was dropped with nobody convicted (parts are not signed); its own statement
    lists the hellos it counted on, so it is convicted, by a third party too, and the share is
    recomputed without it and the abstainer. An honest reducer with the same abstainer is
    never accused."""
    names = _names(4)
    original = Reducer._aggregate

    def counting(self, k, avg):
        original(self, k, avg)
        if lies and self.plan.name(self.plan.me) == names[1]:
            self.cmask[k].add(2)

    monkeypatch.setattr(Reducer, "_aggregate", counting)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    weights = [1.0, 1.0, 0.0, 1.0]
    outcome, _, got = run_round(["node"] * 4, trees, weights, config=VERIFY)
    assert got == names
    results = _results(outcome)
    honest = [r for i, r in enumerate(results) if i != 1 or not lies]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert all(names[2] not in s.contributors for s in r.shares)
        if not lies:
            assert r.accusations == ()
            assert not any(s.dropped or s.recomputed for s in r.shares)
            continue
        assert [(a.peer, a.role) for a in r.accusations] == [(names[1], "reducer")]
        evidence = r.accusations[0].evidence
        assert [p for p in names if check_evidence(evidence, p)] == [names[1]]
        share = next(s for s in r.shares if s.owner == names[1])
        assert share.recomputed and share.contributors == {names[0], names[3]}
        forged = {
            "mask": dict(evidence, mask=[0, 2, 3]),
            "member": dict(evidence, member=0),
            "members": dict(evidence, members=evidence["members"][::-1]),
        }
        for what, ev in forged.items():
            assert [p for p in names if check_evidence(ev, p)] == [], what
    vecs = [flatten(t)[0] for t in trees]
    for s in honest[0].shares:  # each share: the plain mean of its contributors
        want = np.mean([vecs[names.index(p)][s.start : s.stop] for p in s.contributors], axis=0)
        np.testing.assert_allclose(want, honest[0].vector[s.start : s.stop], atol=2e-6)


def test_a_member_that_signed_a_contribution_then_states_it_abstained_is_convicted(
    monkeypatch,
):
    """Member 3 sends its parts (its signed hello: a contribution), then signs a statement of
    weight 0 with no figures, as an abstainer would, so that every reducer looks as if it
    counted an abstainer. The reducers' statements list its signed hello: it is convicted on
    its own two signatures (by a third party too), never a reducer, and every share is
    recomputed without it."""
    import dedloc_jax.averaging.audit as audit

    names = _names(4)
    make, figures = audit.make_statement, audit._figures

    def abstaining(identity, round_id, digest, sender, weight, seed, shares, *rest):
        if sender == 3:
            weight, shares = 0.0, {}
        return make(identity, round_id, digest, sender, weight, seed, shares, *rest)

    async def none_from_3(rnd, seed):
        return {} if rnd.me == 3 else await figures(rnd, seed)

    monkeypatch.setattr(audit, "make_statement", abstaining)
    monkeypatch.setattr(audit, "_figures", none_from_3)
    rng = np.random.default_rng(6)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    honest = _results(outcome)[:3]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert {(a.peer, a.role) for a in r.accusations} == {(names[3], "sender")}
        for a in r.accusations:
            assert [p for p in names if check_evidence(a.evidence, p)] == [names[3]]
        assert all(s.recomputed and names[3] not in s.contributors for s in r.shares)
    vecs = [flatten(t)[0] for t in trees]
    np.testing.assert_allclose((vecs[0] + vecs[1] + vecs[2]) / 3, honest[0].vector, atol=2e-6)


@pytest.mark.parametrize("lies", [False, True])
def test_a_reducer_that_leaves_a_member_out_of_one_chunk_only_is_convicted(monkeypatch, lies):
    """A reducer that ignores member 0's part of chunk 1 alone, and counts it in every other
    chunk, passes every check (each chunk is the aggregate of its mask), and picks chunk by
    chunk whose part counts. An honest reducer leaves a sender out from a chunk on and never
    takes it back: both signed masks convict it, by a third party too; nobody else is
    accused, and an honest round with the same members convicts nobody."""
    from dedloc_jax.averaging import wire

    names = _names(4)
    original = Reducer._accept_part

    def picky(self, s, msg):
        me = self.plan.name(self.plan.me)
        if lies and me == names[1] and s == 0 and self.next_k.get(s, 0) == 1:
            wire.parse_chunk(msg, 1, len(msg["d"]))
            self.next_k[s] = 2  # read, not counted, not excluded
            self.last[s] = trio.current_time()
            return
        original(self, s, msg)

    monkeypatch.setattr(Reducer, "_accept_part", picky)
    rng = np.random.default_rng(8)
    trees = [make_tree(rng, [(200,)]) for _ in range(4)]  # 3 or 4 chunks a share
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    results = _results(outcome)
    for r in results:
        share = next(s for s in r.shares if s.owner == names[1])
        if not lies:
            assert r.accusations == () and share.contributors == set(names)
            continue
        assert [names[0] in seg[2] for seg in share.segments] == [True, False, True]
        assert [(a.peer, a.role) for a in r.accusations] == [(names[1], "reducer")]
        evidence = r.accusations[0].evidence
        assert [p for p in names if check_evidence(evidence, p)] == [names[1]]
        first, second = evidence["results"]
        swapped = dict(evidence, results=[second, first])
        assert [p for p in names if check_evidence(swapped, p)] == []
        assert not any(s.dropped or s.recomputed for s in r.shares)


def test_a_node_that_calls_for_statements_gets_only_the_callees_own(monkeypatch):
    """Every node calls every other node with its statement, so the answer carries only the
    callee's own. Before, it listed every statement the callee held: O(n^2) bytes per round
    (bench.collaboration, 40 peers: 505 MB of statements against 130 MB of all-reduce), and
    slow uplinks held every member's check up. Clients still get every statement (nobody
    dials a client), and every member ends holding all of them: a client from each node's
    own answer and from :data:`.audit.RELAYS` members' relays (every node relayed every
    statement to every client before: 93% of the statements' bytes at 40 peers)."""
    from dedloc_jax.averaging import audit

    answer, check = audit.answer, audit._check_shares
    listed: list[tuple[str, bool, int]] = []
    held: list[int] = []

    async def counted(rnd, request, remote):  # noqa: ANN001, ANN202
        reply = await answer(rnd, request, remote)
        who = next(m.mode for m in rnd.members if m.peer_id == str(remote))
        listed.append((who, request.get("w") is True, len(reply["l"])))
        return reply

    async def holding(rnd, stated, *rest):  # noqa: ANN001, ANN002, ANN202
        held.append(len(stated))
        return await check(rnd, stated, *rest)

    monkeypatch.setattr(audit, "answer", counted)
    monkeypatch.setattr(audit, "_check_shares", holding)
    rng = np.random.default_rng(7)
    modes = ["node"] * 6 + ["client"] * 2
    trees = [make_tree(rng, SHAPES) for _ in modes]
    cfg = VERIFY.replace(robust=False)
    outcome, _, _ = run_round(modes, trees, [1.0] * len(modes), codec="fp16", config=cfg)
    assert not any(o.accusations for o in _results(outcome))  # averaged, checks passed
    plain = [n for mode, wait, n in listed if mode == "node" and not wait]
    assert plain and max(plain) <= 1, listed
    assert held == [len(modes)] * len(modes)  # every member checked with every statement
    # each client gets each statement about once: from its node or from one of its relays
    to_clients = sum(n for mode, _, n in listed if mode == "client")
    assert to_clients <= 2 * audit.RELAYS * (len(modes) - 1), listed


@pytest.mark.parametrize("forgery", ["unsigned", "other_key", "bad_signature", "no_key"])
@pytest.mark.parametrize("lies", [False, True])
def test_a_result_its_reducer_did_not_sign_is_refused_on_receipt(monkeypatch, forgery, lies):
    """Reducer 1 sends its results unsigned, signed by another key, with a signature of other
    bytes, or without its key. Taken as they came, a lie in them was caught by the audit and
    convicted before the members only: the evidence named no signature of the reducer, so no
    third party could re-check it. Each member now refuses such a chunk on receipt and the
    share is repaired by another reducer from the senders' parts: nobody holds the forged
    bits, every member the same, and the share is the other members' mean."""
    from dedloc_jax.averaging import wire
    from p2p.identity import Identity

    names = _names(4)
    stranger = Identity.from_seed(b"stranger")
    original_result = wire.result

    def forged(k, data, contributors, kind="res", tau=None, sig=None, key=None, **rest):
        if kind == "res" and sig is not None and key_of.get(id(sig)) == names[1]:
            if forgery == "unsigned":
                sig = key = None
            elif forgery == "other_key":
                sig, key = stranger.sign(b"x"), stranger.public_key if k == 0 else None
            elif forgery == "bad_signature":
                sig = bytes(64)
            else:
                key = None
        msg = original_result(k, data, contributors, kind, tau, sig, **rest)
        if key is not None:
            msg["pk"] = key
        return msg

    key_of: dict[int, str] = {}
    original_finalise = Reducer._finalise

    def finalise(self, k):
        original_finalise(self, k)
        if self.sigs[k] is not None:
            key_of[id(self.sigs[k])] = self.plan.name(self.plan.me)
        if lies and self.plan.name(self.plan.me) == names[1]:  # too late to sign other bytes
            self.enc[k] = (-1000.0 * np.frombuffer(self.enc[k], np.float32)).tobytes()

    monkeypatch.setattr(wire, "result", forged)
    monkeypatch.setattr(Reducer, "_finalise", finalise)
    rng = np.random.default_rng(7)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    results = _results(outcome)
    honest = [r for i, r in enumerate(results) if i != 1]
    vecs = [flatten(t)[0] for t in trees]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        for a in r.accusations:  # any conviction stands before a third party
            assert check_evidence(a.evidence, a.peer)
        share = next(s for s in r.shares if s.owner == names[1])
        assert share.repaired and not share.dropped
        # the refused reducer's part is left out with its result (the repair's failed peer)
        assert share.contributors == frozenset(names) - {names[1]}
        want = np.mean([v for i, v in enumerate(vecs) if i != 1], axis=0)
        np.testing.assert_allclose(
            r.vector[share.start : share.stop], want[share.start : share.stop], atol=2e-6
        )


@pytest.mark.parametrize("how", ["withheld", "other_seed"])
def test_a_lying_reducer_that_states_nothing_about_our_results_cannot_pass_unchecked(
    liar, monkeypatch, how
):
    """Reducer 1 returns -1000 x its aggregate and then withholds its statement, or signs one
    about other results (another seed). Its own part is in its share, so nobody could check
    the share without its figures: it was taken unchecked, the lie included (974 off the
    mean, nobody convicted). Every honest member now recomputes the share from the revealed
    parts: the same bits everywhere, the liar's part left out when it stated nothing."""
    import dedloc_jax.averaging.audit as audit

    names = _names(4)
    liar.name = names[1]
    swap, answer, make, ask = audit._swap, audit.answer, audit.make_statement, audit._ask_at_check

    async def no_swap(rnd, i, mine, wait, unreached):
        if rnd.name(rnd.me) != names[1]:
            await swap(rnd, i, mine, wait, unreached)

    async def no_answer(rnd, request, remote):
        if rnd.name(rnd.me) == names[1]:
            await trio.sleep_forever()
        return await answer(rnd, request, remote)

    async def no_ask(rnd, mine):  # its asks at its check would carry its statement
        if rnd.name(rnd.me) != names[1]:
            await ask(rnd, mine)

    def other_seed(identity, round_id, digest, sender, weight, seed, *rest):
        if sender == 1:
            seed = bytes(32)
        return make(identity, round_id, digest, sender, weight, seed, *rest)

    if how == "withheld":
        monkeypatch.setattr(audit, "_swap", no_swap)
        monkeypatch.setattr(audit, "answer", no_answer)
        monkeypatch.setattr(audit, "_ask_at_check", no_ask)
    else:
        monkeypatch.setattr(audit, "make_statement", other_seed)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    honest = [o for i, o in enumerate(outcome) if i != 1]
    honest = _results(honest)
    vecs = [flatten(t)[0] for t in trees]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert r.accusations == ()
        share = next(s for s in r.shares if s.owner == names[1])
        assert share.recomputed and not share.dropped
        left = {names[1]} if how == "withheld" else set()
        assert share.contributors == frozenset(names) - left
        want = np.mean([vecs[names.index(p)] for p in share.contributors], axis=0)
        np.testing.assert_allclose(
            r.vector[share.start : share.stop], want[share.start : share.stop], atol=2e-6
        )


def test_a_lying_aux_reducer_is_convicted_with_evidence_a_third_party_rechecks(liar):
    """An aux peer (it reduces, sends nothing, states nothing) returns -1000 x its share's
    aggregate. Its conviction named no key (it states none): no third party could re-check
    it, so no ban could travel. Its key now comes with its first result chunk, proven against
    its peer ID: the evidence convicts it, and only it, anywhere."""
    modes = ["node", "node", "node", "aux"]
    _, _, names = run_round(modes, [{"x": np.zeros(1, np.float32)}] * 4, [1.0] * 4)
    liar.name = names[3]
    rng = np.random.default_rng(9)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(modes, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    honest = _results(outcome[:3])
    vecs = [flatten(t)[0] for t in trees[:3]]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert [(a.peer, a.role) for a in r.accusations] == [(names[3], "reducer")]
        assert [p for p in names if check_evidence(r.accusations[0].evidence, p)] == [names[3]]
        share = next(s for s in r.shares if s.owner == names[3])
        assert share.recomputed
        np.testing.assert_allclose(r.vector, np.mean(vecs, axis=0), atol=2e-6)


@pytest.mark.parametrize("lies", [False, True])
def test_an_aux_reducer_counting_an_abstainer_is_convicted_on_its_signed_hellos(monkeypatch, lies):
    """Member 2 abstains; the aux reducer (member 3: it reduces, sends nothing, swaps no
    statement) counts it anyway. It stated no hellos, so nothing signed told who lied: nobody
    was convicted and its share was dropped. It now signs a statement of the hellos it counted
    on and sends it with its first result chunk: it is convicted, by a third party too, and
    its share recomputed without the abstainer. An honest aux reducer is never accused."""
    modes = ["node", "node", "node", "aux"]
    _, _, names = run_round(modes, [{"x": np.zeros(1, np.float32)}] * 4, [1.0] * 4)
    original = Reducer._aggregate

    def counting(self, k, avg):
        original(self, k, avg)
        if lies and self.plan.name(self.plan.me) == names[3]:
            self.cmask[k].add(2)

    monkeypatch.setattr(Reducer, "_aggregate", counting)
    rng = np.random.default_rng(4)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(modes, trees, [1.0, 1.0, 0.0, 1.0], config=VERIFY)
    assert got == names
    honest = _results(outcome[:3])
    vecs = [flatten(t)[0] for t in trees[:2]]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert all(names[2] not in s.contributors for s in r.shares)
        share = next(s for s in r.shares if s.owner == names[3])
        assert not share.dropped
        if not lies:
            assert r.accusations == () and not share.recomputed
            continue
        assert [(a.peer, a.role) for a in r.accusations] == [(names[3], "reducer")]
        assert [p for p in names if check_evidence(r.accusations[0].evidence, p)] == [names[3]]
        assert share.recomputed and share.contributors == {names[0], names[1]}
    np.testing.assert_allclose(honest[0].vector, np.mean(vecs, axis=0), atol=2e-6)


def test_an_aux_reducer_that_sends_no_statement_is_refused(monkeypatch):
    """An aux reducer whose first result chunk carries no statement of its own (or one of
    another member) is refused like an unsigned result: its share is repaired without it."""
    from dedloc_jax.averaging import wire

    modes = ["node", "node", "node", "aux"]
    _, _, names = run_round(modes, [{"x": np.zeros(1, np.float32)}] * 4, [1.0] * 4)
    original = wire.result

    def bare(*args, **kwargs):
        msg = original(*args, **kwargs)
        msg.pop("st", None)
        return msg

    monkeypatch.setattr(wire, "result", bare)
    rng = np.random.default_rng(4)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, _ = run_round(modes, trees, [1.0] * 4, config=VERIFY)
    honest = _results(outcome[:3])
    vecs = [flatten(t)[0] for t in trees[:3]]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert next(s for s in r.shares if s.owner == names[3]).repaired
    np.testing.assert_allclose(honest[0].vector, np.mean(vecs, axis=0), atol=2e-6)


def test_a_statement_grows_by_its_projection_and_norm_per_chunk_not_its_hashes(monkeypatch):
    """A sender's statement held a part hash and a result digest per chunk of every share (80
    bytes a chunk: 644 MB of statements in bench.collaboration at 40 peers against 132 MB of
    all-reduce). Each share's hashes are now one root each, revealed chunk by chunk only when
    the share is disputed: a chunk adds its projection and its norm (16 bytes), whatever the
    number of chunks, and the checks still pass."""
    from dedloc_jax.averaging import audit

    make = audit.make_statement
    sizes: dict[int, list[tuple[int, int]]] = {}

    def measured(identity, round_id, digest, sender, weight, seed, shares, hellos=(), *rest):
        signed = make(identity, round_id, digest, sender, weight, seed, shares, (), *rest)
        chunks = sum(len(f.q) for f in shares.values())
        sizes.setdefault(chunk, []).append((len(signed["b"]), chunks))
        return make(identity, round_id, digest, sender, weight, seed, shares, hellos, *rest)

    monkeypatch.setattr(audit, "make_statement", measured)
    rng = np.random.default_rng(9)
    trees = [{"x": rng.standard_normal(2048).astype(np.float32)} for _ in range(4)]
    for chunk in (512, 16):  # 1 chunk a share, then 32
        cfg = VERIFY.replace(robust=False, chunk_elems=chunk)
        outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, codec="fp16", config=cfg)
        assert not any(r.accusations for r in _results(outcome))
    (few, n_few), (many, n_many) = max(sizes[512]), max(sizes[16])
    assert n_many >= 30 * n_few
    per_chunk = (many - few) / (n_many - n_few)
    assert per_chunk <= 16.5, per_chunk  # 80 before


def test_a_reducer_lists_hellos_by_their_figures_and_other_encodings_are_refused():
    """A reducer's statement lists each signed hello as sender, weight and signature (77 bytes,
    were 210): anyone rebuilds the body from the round and checks it with the sender's key. A
    hello signed in another encoding of the same fields would then not verify from the list,
    and a sender could make an honest reducer look as if it counted an unsigned member: it is
    refused on receipt."""
    import msgpack

    from dedloc_jax.averaging.errors import BadContributionError
    from dedloc_jax.averaging.verify import (
        hello_of,
        make_hello,
        make_statement,
        parse_signed_hello,
        parse_statement,
    )
    from p2p.identity import Identity, PeerID

    ids = [Identity.generate() for _ in range(2)]
    members = [str(PeerID.from_public_key(i.public_key)) for i in ids]
    rid, digest = b"round", bytes(range(32))
    hello = make_hello(ids[1], rid, digest, 1, 3.0)
    assert parse_signed_hello(hello, round_id=rid, digest=digest, members=members).weight == 3.0
    fields = {"w": 3.0, "s": 1, "g": digest, "r": rid, "t": "hello"}  # another key order
    body = msgpack.packb(fields, use_bin_type=True)
    other = {"b": body, "pk": ids[1].public_key, "sig": ids[1].sign(body)}
    with pytest.raises(BadContributionError):
        parse_signed_hello(other, round_id=rid, digest=digest, members=members)
    signed = make_statement(ids[0], rid, digest, 0, 1.0, bytes(32), {}, [hello])
    st = parse_statement(signed, round_id=rid, digest=digest, members=members, chunks={})
    assert len(msgpack.packb(st.hello_wires[0])) < 80
    listed = hello_of(st, members, 1, ids[1].public_key)
    assert listed is not None and listed.weight == 3.0 and listed.sender == 1
    assert hello_of(st, members, 1, ids[0].public_key) is None  # another member's key
    assert hello_of(st, members, 0, ids[0].public_key) is None  # not listed


def test_evidence_missing_a_field_or_of_the_wrong_types_convicts_nobody(monkeypatch):
    """Evidence comes from the DHT, written by anyone: a missing field (the share's result
    digests, a reducer's key, ...) or one of another type is no conviction, and no crash (a
    missing ``seed`` raised KeyError out of check_evidence before)."""
    evidence, names = _framing_evidence(monkeypatch, "fp16", False)
    for key in evidence:
        dropped = {k: v for k, v in evidence.items() if k != key}
        assert not any(check_evidence(dropped, p) for p in names), key
        assert not any(check_evidence(dict(evidence, **{key: 7}), p) for p in names), key
    for junk in ({"kind": "hello"}, {"kind": 3}, {}, []):
        assert check_evidence(junk, names[1]) is False  # type: ignore[arg-type]


def test_a_node_calling_late_is_not_sent_the_statements_it_already_holds(monkeypatch):
    """Member 0 swaps late: every other node has called it, pushing its statement and taking
    member 0's. Its own calls then list those as held, and the answers carry nothing; each
    answer carried the callee's statement again before (each statement crossed each link twice
    in a round whose members finish at different times)."""
    from dedloc_jax.averaging import audit

    answer, exchange = audit.answer, audit._exchange
    to_late: list[int] = []

    async def counted(rnd, request, remote):  # noqa: ANN001, ANN202
        reply = await answer(rnd, request, remote)
        if str(remote) == rnd.members[0].peer_id:
            to_late.append(len(reply["l"]))
        return reply

    async def late(rnd, mine, until):  # noqa: ANN001, ANN202
        if rnd.me == 0:
            await rnd.statement_changes.wait(until)  # until the first push
            await trio.sleep(0.5)
        await exchange(rnd, mine, until)

    monkeypatch.setattr(audit, "answer", counted)
    monkeypatch.setattr(audit, "_exchange", late)
    n = 5
    rng = np.random.default_rng(8)
    trees = [make_tree(rng, SHAPES) for _ in range(n)]
    outcome, _, _ = run_round(["node"] * n, trees, [1.0] * n, codec="fp16", config=VERIFY)
    results = _results(outcome)
    assert not any(r.accusations for r in results)
    assert all(r.vector.tobytes() == results[0].vector.tobytes() for r in results)
    assert len(to_late) == n - 1 and sum(to_late) == 0, to_late


@pytest.fixture
def equivocator(monkeypatch):
    return equivocate(monkeypatch)


@pytest.mark.parametrize("victim", ["node", "client"])
def test_an_equivocating_reducer_is_convicted_on_its_two_signed_results(equivocator, victim):
    """Reducer 1 sends member 3 -1000 x the result it sends the others, each chunk signed.
    Members' seeds and roots differed and the share was recomputed or taken unchecked, and
    nobody was convicted: two signatures of one chunk over different digests prove the lie.
    Every honest member now convicts it (role "reducer", reason "equivocation") with evidence
    a third party accepts, and every honest member ends with the same bits. A client victim,
    whom nobody dials, shows its digests to the nodes it asks for theirs."""
    names = _names(4)
    equivocator.name = names[1]
    rng = np.random.default_rng(11)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(["node"] * 3 + [victim], trees, [1.0] * 4, config=VERIFY)
    assert got == names
    results = _results(outcome)
    for i in (0, 2, 3):
        accs = results[i].accusations
        assert [(a.peer, a.role, a.reason) for a in accs] == [
            (names[1], "reducer", "equivocation")
        ], i
        ev = accs[0].evidence
        assert check_evidence(ev, names[1])
        assert not check_evidence(ev, names[0])  # the evidence names its signer only
        share = next(s for s in results[i].shares if s.owner == names[1])
        assert share.recomputed and not share.dropped
        assert names[1] not in share.contributors  # its part left out, like a convicted one
    # the victim too: it recomputes the shares it could not check, as the others do (it took
    # them as they came, 1 ulp off the others' recomputation)
    for i in (2, 3):
        assert results[i].vector.tobytes() == results[0].vector.tobytes(), i
    vecs = [flatten(t)[0] for t in trees]
    share = next(s for s in results[0].shares if s.owner == names[1])
    want = np.mean([v for i, v in enumerate(vecs) if i != 1], axis=0)
    np.testing.assert_allclose(
        results[0].vector[share.start : share.stop], want[share.start : share.stop], atol=2e-6
    )


def test_equivocation_evidence_that_is_forged_or_mixed_convicts_nobody():
    """Evidence of equivocation convicts only on two signatures by the accused's own key of
    the same chunk of the same round over different digests: one signature by another key,
    the same digest twice, signatures of two different chunks, another round, or malformed
    fields convict nobody (and raise nothing)."""
    import hashlib

    from dedloc_jax.averaging.verify import result_claim
    from p2p.identity import Identity, PeerID

    reducer, stranger = Identity.from_seed(b"reducer"), Identity.from_seed(b"stranger")
    accused = str(PeerID.from_public_key(reducer.public_key))
    rid, g, j, k = b"round", b"group digest", 1, 2
    d0, d1 = hashlib.sha256(b"0").digest(), hashlib.sha256(b"1").digest()

    def sign(who, d, chunk=k, round_id=rid):
        return who.sign(result_claim(round_id, g, j, chunk, d))

    ev = {
        "kind": "results",
        "round": rid,
        "group": g,
        "share": j,
        "chunk": k,
        "reducer_key": reducer.public_key,
        "digests": [d0, d1],
        "sigs": [sign(reducer, d0), sign(reducer, d1)],
    }
    assert check_evidence(ev, accused)  # two signed results of one chunk
    assert not check_evidence(ev, str(PeerID.from_public_key(stranger.public_key)))
    assert not check_evidence(ev, "not a peer id")
    forged = [
        dict(ev, sigs=[sign(reducer, d0), sign(stranger, d1)]),  # one by another key
        dict(ev, reducer_key=stranger.public_key),  # the reducer's signatures, another key
        dict(ev, digests=[d0, d0], sigs=[sign(reducer, d0)] * 2),  # the same digest twice
        dict(ev, sigs=[sign(reducer, d0), sign(reducer, d1, chunk=k + 1)]),  # two chunks
        dict(ev, chunk=k + 1),  # another chunk than the signed one
        dict(ev, sigs=[sign(reducer, d0), sign(reducer, d1, round_id=b"other")]),  # two rounds
        dict(ev, digests=[d0, d1[:31]]),
        dict(ev, sigs=[ev["sigs"][0], None]),
        dict(ev, chunk="2"),
        dict(ev, share=True),
        dict(ev, digests=d0 + d1),
        dict(ev, reducer_key=b"short"),
        {key: v for key, v in ev.items() if key != "sigs"},
    ]
    for bad in forged:
        assert not check_evidence(bad, accused), bad


def test_a_member_reporting_other_results_cannot_frame_an_honest_reducer(monkeypatch):
    """Member 3 states (and, asked, sends) result digests other than the ones reducer 1 signed,
    with the reducer's genuine signatures of the real ones, and another seed (as a member sent
    other results would): its root differs from the others', so they ask it, but only two of
    the reducer's own signatures of one chunk convict, and nobody is convicted."""
    import hashlib

    from dedloc_jax.averaging import audit

    names = _names(4)
    received = audit._received
    asked = []
    results_of = audit._results_of

    def lying_received(rnd, j, k):
        got = received(rnd, j, k)
        if rnd.me == 3 and j == 1:
            return hashlib.sha256(b"other" + got).digest()
        return got

    async def counting(rnd, i, j):
        asked.append((rnd.me, i, j))
        return await results_of(rnd, i, j)

    make = audit.make_statement

    def other_seed(identity, round_id, digest, sender, weight, seed, *rest):
        return make(
            identity, round_id, digest, sender, weight, seed[::-1] if sender == 3 else seed, *rest
        )

    monkeypatch.setattr(audit, "_received", lying_received)
    monkeypatch.setattr(audit, "_results_of", counting)
    monkeypatch.setattr(audit, "make_statement", other_seed)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    assert {(me, j) for me, _, j in asked} >= {(0, 1), (2, 1)}  # the dispute was looked into
    for r in _results(outcome):
        assert r.accusations == ()


def test_an_honest_round_asks_nobody_for_result_digests_and_convicts_nobody(monkeypatch):
    """In a clean round every member's roots agree: nobody is asked for its digests."""
    from dedloc_jax.averaging import audit

    asked = []
    results_of = audit._results_of

    async def counting(rnd, i, j):
        asked.append((rnd.me, i, j))
        return await results_of(rnd, i, j)

    monkeypatch.setattr(audit, "_results_of", counting)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, _ = run_round(["node"] * 3 + ["client"], trees, [1.0] * 4, config=VERIFY)
    for r in _results(outcome):
        assert r.accusations == ()
    assert asked == []


def test_a_member_of_our_seed_stating_another_root_is_not_asked(monkeypatch):
    """Two results of one chunk make the seeds differ: a member stating our seed and another
    results root lies about its own, and is not asked (waiting on it could only stall us)."""
    import hashlib

    from dedloc_jax.averaging import audit

    received, results_of, asked = audit._received, audit._results_of, []

    def lying_received(rnd, j, k):
        got = received(rnd, j, k)
        return hashlib.sha256(got).digest() if rnd.me == 3 and j == 1 else got

    async def counting(rnd, i, j):
        asked.append((rnd.me, i, j))
        return await results_of(rnd, i, j)

    monkeypatch.setattr(audit, "_received", lying_received)
    monkeypatch.setattr(audit, "_results_of", counting)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    for r in _results(outcome):
        assert r.accusations == ()
    assert asked == []


@pytest.mark.parametrize("leaver", [1, 4])
def test_a_member_that_leaves_before_its_statement_costs_only_its_own_share(monkeypatch, leaver):
    """A member (a reducer: node 1; a sender only: client 4) leaves right after the exchange,
    its statement never sent (churn: the 12-peer bench lost one so). Every share it sent a
    part to lacked its figures on every member: all of them were recomputed from reveals
    (0.7x the payload asked of everyone, the asks of the slow ones timed out) and members
    ended with other bits. A lone liar hides a lie only in its own share by withholding its
    statement: that share alone is recomputed (none when the leaver reduces nothing), the
    others are taken as they came on every member; all survivors hold the same bits."""
    from dedloc_jax.averaging import audit
    from p2p.testing import host_of

    modes = ["node"] * 4 + ["client"] * 3
    world: dict = {}

    async def capture(net, nodes, scopes):
        world.update(net=net, nodes=nodes, scopes=scopes)

    original, reveal, asked = audit.audit, audit._reveal, []

    async def leaving(rnd):
        if rnd.me == leaver:  # gone once its own exchange is over: no statement goes out
            world["net"].kill(host_of(world["net"], world["nodes"][leaver]))
            world["scopes"][leaver].cancel()
            await trio.sleep_forever()
        return await original(rnd)

    async def counting(rnd, i, j):
        asked.append((rnd.me, i, j))
        return await reveal(rnd, i, j)

    monkeypatch.setattr(audit, "audit", leaving)
    monkeypatch.setattr(audit, "_reveal", counting)
    rng = np.random.default_rng(13)
    trees = [make_tree(rng, SHAPES) for _ in modes]
    outcome, _, names = run_round(modes, trees, [1.0] * len(modes), config=VERIFY, fault=capture)
    assert outcome[leaver] is None
    results = _results([o for i, o in enumerate(outcome) if i != leaver])
    own = {names[leaver]} if leaver < 4 else set()  # a client reduces nothing
    for r in results:
        assert r.accusations == ()
        assert r.vector.tobytes() == results[0].vector.tobytes()
        assert {s.owner for s in r.shares if s.recomputed or s.dropped} == own
    assert {names[j] for _, _, j in asked} == own


def test_a_lying_reducer_is_not_let_through_by_a_member_stating_other_results(liar, monkeypatch):
    """Reducer 1 returns -1000 x its aggregate; member 3 (a contributor, not the liar) states
    about other results (another seed: a reducer can make a member repair its share, so its
    results differ). Without member 3's figures nobody can check share 1; taking it as it
    came (as a share a member that left keeps unchecked) let the lie through. It is
    recomputed from the revealed parts on every member: the same bits, no lie."""
    import dedloc_jax.averaging.audit as audit

    names = _names(4)
    liar.name = names[1]
    make = audit.make_statement

    def other_seed(identity, round_id, digest, sender, weight, seed, *rest):
        if sender == 3:
            seed = bytes(32)
        return make(identity, round_id, digest, sender, weight, seed, *rest)

    monkeypatch.setattr(audit, "make_statement", other_seed)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    honest = _results([outcome[0], outcome[2]])
    vecs = [flatten(t)[0] for t in trees]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        share = next(s for s in r.shares if s.owner == names[1])
        assert share.recomputed and not share.dropped
        want = np.mean([vecs[names.index(p)] for p in share.contributors], axis=0)
        np.testing.assert_allclose(
            r.vector[share.start : share.stop], want[share.start : share.stop], atol=2e-6
        )


def test_a_reducer_dying_mid_exchange_leaves_every_survivor_the_same_bits_and_no_reveals(
    monkeypatch,
):
    """Reducer 1 dies in mid-exchange (5 nodes, 2 clients, slow links): its share is repaired,
    the others lack its part from some chunk on and its statement. Every share it sent a part
    to was recomputed from reveals on every survivor; now they are taken as they came (it left:
    no sign of a lie by their reducers), with no reveal asked and the same bits everywhere."""
    from dedloc_jax.averaging import audit
    from p2p.testing import host_of

    reveal, asked = audit._reveal, []

    async def counting(rnd, i, j):
        asked.append((rnd.me, i, j))
        return await reveal(rnd, i, j)

    async def kill(net, nodes, scopes):
        await trio.sleep(0.6)
        net.kill(host_of(net, nodes[1]))
        scopes[1].cancel()

    monkeypatch.setattr(audit, "_reveal", counting)
    rng = np.random.default_rng(1)
    modes = ["node"] * 5 + ["client"] * 2
    trees = [make_tree(rng, [(30, 50), (700,)]) for _ in modes]
    outcome, _, names = run_round(
        modes, trees, [1.0] * 7, bandwidth=[(4e4, 4e4)] * 7, fault=kill, config=VERIFY
    )
    assert outcome[1] is None
    results = _results([o for i, o in enumerate(outcome) if i != 1])
    assert len(results) == 6
    for r in results:
        assert r.accusations == ()
        assert not any(s.recomputed or s.dropped for s in r.shares)
        assert next(s for s in r.shares if s.owner == names[1]).repaired
        assert r.vector.tobytes() == results[0].vector.tobytes()
    assert asked == []


def test_a_clean_round_hashes_each_result_chunk_and_verifies_each_signature_once(monkeypatch):
    """A verified round's fixed CPU: each member hashed every result chunk on receipt (to check
    its signature) and again for its statement, and verified the statement it had just signed
    itself. A clean round now hashes each chunk once per member (its reducer to sign it, the
    others to check it) and verifies only others' signatures: as a reducer n - 1 hellos, and
    the signature of each chunk the n - 1 other reducers sent. The n - 1 statements came each
    from its own member's channel: their signatures wait until one is used as evidence."""
    from collections import Counter

    from dedloc_jax.averaging import audit, reducer, verify

    digests: Counter = Counter()
    verified: list[bytes] = []
    original_digest, original_verify = verify.result_digest, verify.verify_signature

    def counting_digest(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        digests[args[2], args[3]] += 1  # (share, chunk)
        return original_digest(*args, **kw)

    def counting_verify(key, sig, data):  # noqa: ANN001, ANN202
        verified.append(key)
        return original_verify(key, sig, data)

    for module in (audit, reducer):
        monkeypatch.setattr(module, "result_digest", counting_digest)
    for module in (audit, verify):
        monkeypatch.setattr(module, "verify_signature", counting_verify)
    n = 4
    rng = np.random.default_rng(11)
    trees = [make_tree(rng, SHAPES) for _ in range(n)]
    cfg = VERIFY.replace(robust=True)
    outcome, _, _ = run_round(["node"] * n, trees, [1.0] * n, codec="fp16", config=cfg)
    results = _results(outcome)
    assert not any(r.accusations for r in results)
    assert len(digests) >= n and set(digests.values()) == {n}, digests  # 2n before
    chunks = len(digests)
    assert len(verified) == n * (n - 1) + (n - 1) * chunks  # + n * (n - 1) statements before


@pytest.fixture
def junk_signer(monkeypatch):
    """Make the member named in ``junk_signer.name`` send its own statement under a signature
    that does not verify (straight from it, on its own authenticated channel)."""
    from dedloc_jax.averaging import audit

    class Junk:
        name: str | None = None

    original = audit.make_statement

    def junk(identity, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = original(identity, *args, **kw)
        if str(identity.peer_id) == Junk.name:
            out = dict(out, sig=bytes(64))
        return out

    monkeypatch.setattr(audit, "make_statement", junk)
    return Junk


def test_a_junk_signed_statement_from_its_own_member_passes_a_clean_round(junk_signer):
    """A statement from its own member is taken on its channel's word (its signature waits
    until it is evidence): a clean round with one junk signer checks every share and convicts
    nobody."""
    n = 4
    names = _names(n)
    junk_signer.name = names[2]
    rng = np.random.default_rng(12)
    trees = [make_tree(rng, SHAPES) for _ in range(n)]
    outcome, _, _ = run_round(["node"] * n, trees, [1.0] * n, codec="fp16", config=VERIFY)
    results = _results(outcome)
    for r in results:
        assert r.accusations == ()
        assert not any(s.dropped or s.recomputed for s in r.shares)
        assert r.vector.tobytes() == results[0].vector.tobytes()


@pytest.mark.parametrize("junk", ["liar", "other"])
def test_a_junk_signed_statement_is_verified_before_it_is_evidence(liar, junk_signer, junk):
    """Statements taken on their channel's word are verified before any becomes evidence, and
    a junk one counts as none. A lying reducer whose own statement is junk-signed ("liar")
    is still caught: its share recomputed on every member, the same bits. Without the
    verification it was convicted on its own junk signature: evidence no third party accepts,
    so no other peer would ban it. With another member's junk ("other"), that member counts
    as having stated nothing, as when a junk statement was refused on receipt: nobody but
    the liar is accused, and every accusation holds before a third party."""
    n = 4
    names = _names(n)
    liar.name = names[1]
    junk_signer.name = names[1] if junk == "liar" else names[3]
    rng = np.random.default_rng(13)
    trees = [make_tree(rng, SHAPES) for _ in range(n)]
    outcome, _, _ = run_round(["node"] * n, trees, [1.0] * n, codec="fp16", config=VERIFY)
    results = _results(outcome)
    honest = [r for i, r in enumerate(results) if names[i] not in (liar.name, junk_signer.name)]
    for r in honest:
        for a in r.accusations:
            assert a.peer == liar.name
            assert check_evidence(a.evidence, a.peer)
    if junk == "liar":
        for r in honest:
            assert r.vector.tobytes() == honest[0].vector.tobytes()
            share = next(s for s in r.shares if s.owner == liar.name)
            assert share.recomputed and liar.name not in share.contributors
        assert np.abs(honest[0].vector).max() < 100  # the -1000x lie did not go through


@pytest.fixture
def delayer(monkeypatch):
    """Make the reducer named ``delayer.name`` commit its share to every other member at once
    and hold member ``delayer.victim``'s results (heartbeats only) for ``delayer.delay``
    seconds: the victim's statement comes after the others' check."""
    from dedloc_jax.averaging import wire

    class Delayer:
        name: str | None = None
        victim = 3
        delay = 6.0

    original = Reducer._send_results_to

    async def delaying(self, s, ms, gauge):
        if self.plan.name(self.plan.me) == Delayer.name and s == Delayer.victim:
            self.acked.add(s)  # counted as acked: the others get the commit at once
            self.changes.notify()
            while self.done < len(self.chunks):
                await trio.sleep(0.01)
            # its own bytes, as signed (a lossless chunk is a view of the result, which this
            # member's own check rewrites when it recomputes the share)
            self.enc = {k: bytes(v) for k, v in self.enc.items()}
            until = trio.current_time() + Delayer.delay
            while trio.current_time() < until:
                await ms.send(wire.simple("hb"))
                await trio.sleep(self.plan.config.stall_timeout / 3)
        await original(self, s, ms, gauge)

    monkeypatch.setattr(Reducer, "_send_results_to", delaying)
    return Delayer


@pytest.mark.parametrize("victim", ["node", "client"])
def test_a_lying_reducer_that_delays_one_member_past_the_check_poisons_nobody(
    liar, delayer, victim
):
    """Reducer 1 returns -1000 x its aggregate and holds member 3's results until after the
    others' check (4 nodes). Without member 3's statement nobody else could check share 1,
    and a member with no statement at all counts as gone: the others took the lie as it came
    (-1000 x the mean). Asked at the check, member 3 names the reducer it still waits on;
    every member (member 3 too, once its results come) recomputes that share from the revealed
    parts without member 3's: the same bits everywhere, no lie; member 3, which can check it,
    convicts the liar with evidence a third party re-checks. A client, which nobody dials, is
    asked over the connection it opened to each reducer."""
    names = _names(4)
    liar.name = delayer.name = names[1]
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    modes = ["node"] * 3 + [victim]
    outcome, _, got = run_round(modes, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    honest = _results([outcome[0], outcome[2], outcome[3]])
    vecs = [flatten(t)[0] for t in trees]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        share = next(s for s in r.shares if s.owner == names[1])
        assert share.recomputed and not share.dropped
        assert share.contributors == frozenset(names) - {names[3]}
        want = np.mean([vecs[names.index(p)] for p in share.contributors], axis=0)
        np.testing.assert_allclose(
            r.vector[share.start : share.stop], want[share.start : share.stop], atol=2e-6
        )
    victim = honest[2]
    assert [a.peer for a in victim.accusations] == [names[1]]
    assert check_evidence(victim.accusations[0].evidence, names[1])


def test_a_member_whose_statement_is_late_is_asked_for_it_at_the_check(monkeypatch):
    """Member 3 takes 1.2 x the check's time to sign its statement (a slow CPU): the others'
    swap ended without it, so they took every share it sent to as it came and recomputed its
    own share from reveals (its missing statement could hide a lie there). Asked at the check,
    a member holding all its results waits for its own statement (up to half the check's
    time): every share is checked, none recomputed, no reveal asked."""
    from dedloc_jax.averaging import audit

    figures, reveal, asked = audit._figures, audit._reveal, []

    async def slow(rnd, seed):
        if rnd.me == 3:
            await trio.sleep(1.2 * rnd.verify_timeout)
        return await figures(rnd, seed)

    async def counting(rnd, i, j):
        asked.append((rnd.me, i, j))
        return await reveal(rnd, i, j)

    monkeypatch.setattr(audit, "_figures", slow)
    monkeypatch.setattr(audit, "_reveal", counting)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    results = _results(outcome)
    for r in results:
        assert r.vector.tobytes() == results[0].vector.tobytes()
        assert not any(s.recomputed or s.dropped for s in r.shares)
        assert r.accusations == ()
    assert asked == []


def test_a_member_naming_an_honest_reducers_share_costs_that_share_only(monkeypatch):
    """A hostile member withholds its statement and, asked at the check, names an honest
    reducer's share as still awaited: every honest member recomputes that share (and the
    namer's own, as a withheld statement's) from the committed parts without the namer's,
    the same bits everywhere, and takes the others as they came; nobody is convicted."""
    from dedloc_jax.averaging import audit

    names = _names(4)
    swap, answer, ask = audit._swap, audit.answer, audit._ask_at_check

    async def no_swap(rnd, i, mine, wait, unreached):
        if rnd.me != 3:
            await swap(rnd, i, mine, wait, unreached)

    async def naming(rnd, request, remote):
        if rnd.me != 3:
            return await answer(rnd, request, remote)
        if request.get("p") is True:
            return {"l": [], "p": [0]}
        await trio.sleep_forever()

    async def no_ask(rnd, mine):
        if rnd.me != 3:
            await ask(rnd, mine)

    monkeypatch.setattr(audit, "_swap", no_swap)
    monkeypatch.setattr(audit, "answer", naming)
    monkeypatch.setattr(audit, "_ask_at_check", no_ask)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    honest = _results(outcome[:3])
    vecs = [flatten(t)[0] for t in trees]
    for r in honest:
        assert r.vector.tobytes() == honest[0].vector.tobytes()
        assert r.accusations == ()
        assert {s.owner for s in r.shares if s.recomputed} == {names[0], names[3]}
        for s in r.shares:
            if s.recomputed:
                assert s.contributors == frozenset(names[:3])
                want = np.mean(vecs[:3], axis=0)
                np.testing.assert_allclose(
                    r.vector[s.start : s.stop], want[s.start : s.stop], atol=2e-6
                )


def test_a_lying_reducer_that_resets_one_members_stream_does_not_poison_its_repair(
    liar, monkeypatch
):
    """Reducer 1 returns -1000 x its aggregate, commits it to members 0 and 2, and resets
    member 3's stream. Member 3 repaired the share from a member's copy (the lie) and took it
    unchecked (a repaired share is not checked): 1318 off the mean, while the others convicted
    the liar and recomputed it. A share another member states figures for (its reducer
    committed it to them) is recomputed from the revealed parts without the reducer's on the
    member that repaired it: no honest member holds the lie. (Member 3's results differ from
    the others', so they recompute every share without its part and it keeps the rest as it
    came: the bits of the other shares differ, as for any member made to repair.)"""
    names = _names(4)
    liar.name = names[1]
    original = Reducer._send_results_to

    async def resetting(self, s, ms, gauge):
        if self.plan.name(self.plan.me) == liar.name and s == 3:
            self.receivers.discard(s)  # committed to the others without its ack
            self.results.notify()
            self.changes.notify()
            ms.reset("dropped")
            return
        await original(self, s, ms, gauge)

    monkeypatch.setattr(Reducer, "_send_results_to", resetting)
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, SHAPES) for _ in range(4)]
    outcome, _, got = run_round(["node"] * 4, trees, [1.0] * 4, config=VERIFY)
    assert got == names
    honest = _results([outcome[0], outcome[2], outcome[3]])
    assert honest[1].vector.tobytes() == honest[0].vector.tobytes()
    vecs = [flatten(t)[0] for t in trees]
    for r in honest:
        share = next(s for s in r.shares if s.owner == names[1])
        assert share.recomputed and not share.dropped
        want = np.mean([vecs[names.index(p)] for p in share.contributors], axis=0)
        np.testing.assert_allclose(
            r.vector[share.start : share.stop], want[share.start : share.stop], atol=2e-6
        )
    assert next(s for s in honest[2].shares if s.owner == names[1]).repaired
    bits = {r.vector[share.start : share.stop].tobytes() for r in honest}
    assert len(bits) == 1  # share 1: the same bits on every honest member
