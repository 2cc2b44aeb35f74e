"""Verified averaging (after BTARD, Gorbunov et al. 2022): the pure half, no I/O.

Every reducer's result is checked by every member holding it, in the same round:

1. *Commitments.* A sender hashes each encoded part chunk as it sends it; the root of a
   share's hashes (:func:`parts_root`) goes in its signed :class:`Statement`, so what it sent
   is fixed before it learns the check direction. The chunk hashes are revealed with the parts
   when the share is disputed; a statement grows by a chunk's ``q`` and norm (16 bytes).
2. *A direction nobody chose.* The seed is the hash of every share's result (values, contributor
   masks, CenteredClip radii): every member holds the same bits, so all derive the same seed, and
   it exists only after every reducer has sent its result. :func:`direction` expands it into a
   vector per chunk of independent coordinates uniform on ``[-sqrt 3, sqrt 3)`` (mean 0,
   variance 1; five times cheaper to draw than normals, which took a fifth of a round's CPU).
3. *Projections.* Each sender states, per chunk it contributed to, ``q_i = s_i <z, x_i - r>``
   (``x_i`` its part as the reducer decoded it, ``r`` the result, ``s_i`` the CenteredClip scale
   ``min(1, tau / |x_i - r|)``; 1 for a plain mean) and ``|x_i|``. For the plain weighted mean
   ``sum_i w_i (x_i - r) = 0``, for CenteredClip its fixed point ``sum_i w_i clip(x_i - r) = 0``:
   the check is ``|sum_i w_i q_i| / W <= SIGMAS * b`` with ``b`` a bound on the L2 norm of the
   honest residual (the codec's rounding of the result, float32 accumulation, CenteredClip's
   stopping slack): see :func:`tolerance`.

Detection probability. ``z`` is drawn after the residual ``e`` (honest rounding plus any lie)
is fixed. A uniform variable is strictly sub-Gaussian (variance proxy = variance = 1), so an
honest chunk fails with probability at most ``2 exp(-SIGMAS**2 / 2)`` (< 2.6e-14 at 8 sigmas).
By Ball's cube-slicing theorem the density of ``<z, e> / |e|`` is at most ``sqrt(2 / 12)`` (a
normal's is 0.399), so a result off the aggregate by ``|e|`` passes with probability at most
``2 * SIGMAS * b * sqrt(1 / 6) / |e|``, i.e. ``6.6 b / |e|``: a lie ten thousand times the
codec's rounding (fp16: 1e4 * 2**-10 ~ 10x the result's own norm) is missed with probability
below 1e-3 per chunk, and a share of C such chunks below 1e-3**C. Lies within ``~SIGMAS * b``
(the codec's own noise) may pass; they move the result by no more than that.

A failed check is followed by a *reveal* (:mod:`.audit`): the contributors send their chunk
hashes (which must hash to their committed root) and their encoded parts, each of which must
match its hash and reproduce their stated projection and norm; if all do, the reducer lied
(proof: the parts, the statements, the result), else the sender whose part contradicts its own
signed statement lied. Either way, everyone drops that share.

A reducer signs each result chunk's :func:`result_digest` inside a :func:`result_claim`
(round, share and chunk in the clear): two of its claims of one chunk with different digests
convict it of equivocation before anyone, without the chunks (:mod:`.audit`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from p2p.identity import PeerID, verify_signature

from .errors import BadContributionError
from .robust import cap_weights, weighted_median

SIGMAS = 8.0
"""Standard deviations of the honest residual's projection a result may be off."""
CLIP_SLACK = 1e-3
"""CenteredClip stops within this fraction of its radius of its fixed point (see reducer)."""
ACCUMULATION = 2.0**-20
"""Relative error bound of float32 accumulation of a few dozen contributions, per member."""
MAX_STATEMENT_BYTES = 16 << 20


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """A float64 dot product. einsum, not BLAS: 27x faster here for one chunk (BLAS threads
    contend on a loaded machine), and members' last bits may differ either way (the checks
    allow 1e-6)."""
    return float(np.einsum("i,i->", a, b))


def part_norm(x: np.ndarray) -> float:
    """The L2 norm in float64 (the same figure on every member holding the same bits)."""
    x64 = np.asarray(x, np.float64)
    return math.sqrt(_dot(x64, x64))


MIN_CLIPPED = 3
"""With a derived radius, CenteredClip needs this many contributors to a chunk: of two, it
cannot tell which one lies, and it only bent the honest pair's mean. Fewer: the plain mean."""


def clips(robust: bool, fixed_tau: float | None, contributors: int) -> bool:
    """Whether a chunk with this many contributors is aggregated with CenteredClip."""
    return robust and (fixed_tau is not None or contributors >= MIN_CLIPPED)


RADIUS = 2.0
"""The derived radius in upper medians of the parts' norms: honest parts are rarely clipped
(bench.byzantine, clean: loss 0.0042 as with the plain mean; at 1x, 0.0065)."""
OUTLIER = 5.0
"""With a derived radius, a part longer than this many radii (ten upper medians) counts for
nothing: CenteredClip alone still lets it pull by its weight times the radius, every round in
the same direction (a -1000x gradient, one of four, multiplied bench.byzantine's loss by 3 at
12 epochs); no honest gradient is ten times the upper median of its peers'."""


def robust_weights(
    raw: Sequence[float], norms: Sequence[float], fixed_tau: float | None
) -> np.ndarray:
    """CenteredClip's weights: capped (:func:`.robust.cap_weights`), and with a derived radius
    zero for parts longer than :data:`OUTLIER` times it (unless that leaves none)."""
    w = cap_weights(raw)
    if fixed_tau is None and len(norms):
        out = np.where(np.asarray(norms, np.float64) > OUTLIER * derived_tau(norms), 0.0, w)
        if out.sum() > 0:
            return out
    return w


def upper_median(values: Sequence[float]) -> float:
    """The upper median: liars fewer than half the values cannot raise it above an honest
    value."""
    s = sorted(values)
    return float(s[len(s) // 2]) if s else 0.0


def derived_tau(norms: Sequence[float]) -> float:
    """CenteredClip's radius from the contributors' part norms: :data:`RADIUS` times their
    upper median (a positive floor so an all-zero chunk still has a radius). Liars fewer than
    half the contributors cannot raise it above twice an honest part's norm."""
    return max(RADIUS * upper_median(norms), 1e-30)


def clip_scale(dev_norm: float, tau: float | None) -> float:
    if tau is None or dev_norm <= tau:
        return 1.0
    return tau / dev_norm


def seed_of(
    round_id: bytes,
    digest: bytes,
    results: Sequence[tuple[bytes | np.ndarray, Sequence[frozenset[int]], Sequence[float | None]]],
) -> bytes:
    """The check seed from every share's result bytes (or its contiguous float32 values,
    hashed in place: a copy of the whole result was a third of the hashing's time), masks
    and radii (same on all members)."""
    h = hashlib.sha256(b"dedloc-verify/1" + round_id + digest)
    for values, masks, taus in results:
        h.update(hashlib.sha256(values).digest())
        h.update(msgpack.packb([sorted(m) for m in masks]))
        h.update(msgpack.packb([t if t is not None else -1.0 for t in taus]))
    return h.digest()


def chunk_terms(
    start: int, stop: int, codec_name: str, robust: bool, fixed_tau: float | None
) -> bytes:
    """The terms a result chunk is checked under: its place in the vector (the check
    direction's), its codec and the run's aggregation rule. Signed by the reducer and by every
    member that received the chunk (:func:`result_digest`), so an accuser naming other terms
    in its evidence (another codec, no CenteredClip) convicts nobody."""
    body = [int(start), int(stop), str(codec_name), bool(robust)]
    body.append(float(fixed_tau) if fixed_tau is not None else -1.0)
    return hashlib.sha256(b"dedloc-terms/1" + msgpack.packb(body)).digest()


def result_digest(
    round_id: bytes,
    digest: bytes,
    j: int,
    k: int,
    data: bytes,
    mask: frozenset[int],
    tau: float | None,
    terms: bytes,
) -> bytes:
    """What a reducer signs for result chunk ``k`` of its share ``j`` (its encoded bytes,
    under :func:`chunk_terms`); every sender signs the same digest of the chunk it received
    in its statement (:attr:`ShareFigures.results`)."""
    h = hashlib.sha256(b"dedloc-result/2" + round_id + digest + terms)
    h.update(msgpack.packb([j, k, sorted(mask), tau if tau is not None else -1.0]))
    h.update(bytes(data))
    return h.digest()


def result_claim(round_id: bytes, digest: bytes, j: int, k: int, rdigest: bytes) -> bytes:
    """The bytes a reducer signs for result chunk ``k`` of share ``j``: its
    :func:`result_digest` with the round, the share and the chunk in the clear, so that two of
    its signatures of one chunk with different digests prove to anyone, without the chunks,
    that it sent two results (equivocation, :func:`.audit.check_evidence`). An honest reducer
    signs one result per chunk (the bytes it sends every member)."""
    body = ["dedloc-claim/1", round_id, digest, int(j), int(k), rdigest]
    return msgpack.packb(body, use_bin_type=True)


def direction(seed: bytes, start: int, n: int) -> np.ndarray:
    """The check direction for the ``n`` values from vector index ``start``: coordinates
    uniform on ``[-sqrt 3, sqrt 3)`` (see the module docstring), a pure function of the seed and
    the position (anyone can recompute one chunk's). SFC64 and uniform doubles: 5x faster than
    PCG64 normals (bench/allreduce: 40 -> 8 ms per 4M values)."""
    key = [int.from_bytes(seed[i : i + 8], "little") for i in range(0, 32, 8)]
    z = np.random.Generator(np.random.SFC64([*key, start])).random(n, np.float64)
    z -= 0.5
    z *= math.sqrt(12.0)
    return z


def projection(z: np.ndarray, part: np.ndarray, result: np.ndarray, tau: float | None) -> float:
    """``s <z, part - result>`` with the CenteredClip scale ``s`` (1 for a plain mean). The
    difference is taken in float32 (IEEE: the same bits everywhere; its rounding is far
    inside :data:`ACCUMULATION`), the sums in float64."""
    dev = np.subtract(part, result, dtype=np.float32).astype(np.float64)
    return clip_scale(math.sqrt(_dot(dev, dev)), tau) * _dot(z, dev)


def tolerance(
    result_bound: float, norms: Sequence[float], weights: Sequence[float], tau: float | None
) -> float:
    """How far ``|sum w q| / W`` may be from 0 for an honest reducer: SIGMAS times a bound on
    the honest residual's norm (``result_bound``: the codec's rounding of the result)."""
    total = float(sum(weights)) or 1.0
    acc = ACCUMULATION * len(norms) * sum(w * n for w, n in zip(weights, norms, strict=True))
    slack = CLIP_SLACK * tau if tau is not None else 0.0
    return SIGMAS * (result_bound + acc / total + slack) + 1e-30


def recompute(
    parts: Sequence[np.ndarray],
    raw: Sequence[float],
    norms: Sequence[float],
    robust: bool,
    fixed_tau: float | None,
    iters: int,
) -> tuple[np.ndarray, float | None]:
    """The aggregate of ``parts`` (weights ``raw``, stated norms ``norms``) by the reducers'
    rule, computed by every member of a round for a caught share: the same bits on each, so
    only element-wise float64 arithmetic in the parts' order and numpy's pairwise sums (no
    einsum or BLAS, whose order follows the CPU). Returns the float32 values and the radius
    (None for a plain mean)."""
    tau = None
    weights = np.asarray(raw, np.float64)
    if clips(robust, fixed_tau, len(parts)):
        weights = robust_weights(raw, norms, fixed_tau)
        tau = fixed_tau or derived_tau(norms)
    w = weights / float(np.add.reduce(weights))
    mean = np.zeros(parts[0].size, np.float64)
    for wi, x in zip(w, parts, strict=True):
        mean += wi * np.asarray(x, np.float64)
    if tau is None:
        return mean.astype(np.float32), None
    x = np.asarray(parts, np.float64)
    center = mean
    bound = float(np.add.reduce(w * np.asarray(norms, np.float64)))
    if any(n + bound > tau for n, wi in zip(norms, w, strict=True) if wi > 0):
        center = weighted_median(x, w)  # as the reducer's CenteredClip starts
        for _ in range(iters):
            dev = x - center
            dist = np.sqrt(np.add.reduce(dev * dev, axis=1))
            scale = w * np.minimum(1.0, tau / np.maximum(dist, 1e-300))
            step = np.zeros_like(center)
            for si, d in zip(scale, dev, strict=True):
                step += si * d
            center = center + step
            if math.sqrt(float(np.add.reduce(step * step))) <= CLIP_SLACK / 10 * tau:
                break
    return center.astype(np.float32), tau


def residual(qs: Sequence[float], weights: Sequence[float]) -> float:
    total = float(sum(weights))
    return float(sum(w * q for w, q in zip(weights, qs, strict=True))) / (total or 1.0)


# ---- statements ---------------------------------------------------------------------------


def counted_weight(stated: float, bound: float) -> float:
    """The weight a sender counts for, in the reducer and in every check alike: its group
    spec's (what it registered, as the leader bounded it) whenever the spec bounds it, else
    what it states; nothing when it states none. The stated figure is in the hello and again
    in the signed statement; a sender stating one to the reducer and another to the checkers
    made an honest reducer fail its check, so only "contributes or not" is taken from it."""
    if not stated > 0:
        return 0.0
    return float(bound) if math.isfinite(bound) else float(stated)


def parts_root(hashes: Sequence[bytes]) -> bytes:
    """A sender's commitment to its parts of one share: the hash of its chunks' hashes
    (:data:`NO_HASH` where it sent nothing). The chunk hashes themselves are revealed only with
    the parts, when the share is disputed (:mod:`.audit`)."""
    return hashlib.sha256(b"dedloc-parts/1" + b"".join(hashes)).digest()


def results_root(digests: Sequence[bytes]) -> bytes:
    """What a sender signs about the result chunks of one share it received: the hash of their
    :func:`result_digest` s, in order (evidence lists them, :func:`.audit.check_evidence`)."""
    return hashlib.sha256(b"dedloc-results/1" + b"".join(digests)).digest()


@dataclass(frozen=True)
class ShareFigures:
    """One sender's figures for one reducer's share: its commitment to its parts
    (:func:`parts_root`), per chunk ``q`` and ``|x|`` (NaN where it sent nothing; the check and
    the derived radius are per chunk), and its :func:`results_root` of the result chunks it
    received (the bytes, codec and terms its ``q`` were computed against): two hashes a share,
    16 bytes a chunk."""

    parts: bytes
    q: np.ndarray
    norms: np.ndarray
    results: bytes


@dataclass(frozen=True)
class SignedHello:
    """What a sender signed at the start of a round, before any part: whether it contributes
    (``weight`` > 0) or abstains (0). It opens every exchange stream of a verified round, and
    a reducer counts a sender only on it; the reducer lists the hellos it holds in its own
    statement, so counting a member who signed no contribution convicts the reducer, and a
    member that signed one and then states it abstained convicts itself (:mod:`.audit`)."""

    round_id: bytes
    digest: bytes
    sender: int
    weight: float
    wire: dict
    """The signed form ({"b": body, "pk": key, "sig": signature}), kept as evidence."""


def _hello_body(round_id: bytes, digest: bytes, sender: int, weight: float) -> bytes:
    """The one encoding of a hello's body: a reducer lists a hello by sender, weight and
    signature alone (:func:`make_statement`), and anyone rebuilds the body from the round."""
    body = {"t": "hello", "r": round_id, "g": digest, "s": int(sender), "w": float(weight)}
    return msgpack.packb(body, use_bin_type=True)


def make_hello(
    identity: object, round_id: bytes, digest: bytes, sender: int, weight: float
) -> dict:
    """The signed wire form of a sender's hello (``weight`` 0: it abstains)."""
    body = _hello_body(round_id, digest, sender, weight)
    return {"b": body, "pk": identity.public_key, "sig": identity.sign(body)}  # type: ignore[attr-defined]


def _signed_body(msg: object, what: str, limit: int) -> tuple[dict, PeerID]:
    """A signed message's body and signer (signature checked). Raises BadContributionError."""
    if not isinstance(msg, dict):
        raise BadContributionError(f"{what} is not a map")
    body, pk, sig = msg.get("b"), msg.get("pk"), msg.get("sig")
    if not all(isinstance(v, bytes) for v in (body, pk, sig)) or len(body) > limit:
        raise BadContributionError(f"malformed {what}")
    if not verify_signature(pk, sig, body):
        raise BadContributionError(f"{what} signature does not verify")
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=False)
        signer = PeerID.from_public_key(pk)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise BadContributionError(f"malformed {what} body: {e!r:.100}") from None
    if not isinstance(d, dict):
        raise BadContributionError(f"malformed {what} body")
    return d, signer


MAX_HELLO_BYTES = 512


def parse_signed_hello(
    msg: object, *, round_id: bytes | None, digest: bytes | None, members: Sequence[str]
) -> SignedHello:
    """Check a signed hello: signed by the member it names, of this round (``round_id`` and
    ``digest`` None: of whichever round its body names). Raises BadContributionError."""
    d, signer = _signed_body(msg, "signed hello", MAX_HELLO_BYTES)
    r, g, s, w = d.get("r"), d.get("g"), d.get("s"), d.get("w")
    if d.get("t") != "hello" or not isinstance(r, bytes) or not isinstance(g, bytes):
        raise BadContributionError("not a signed hello")
    if (round_id is not None and r != round_id) or (digest is not None and g != digest):
        raise BadContributionError("signed hello of another round")
    if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < len(members):
        raise BadContributionError("signed hello names no member")
    if str(signer) != members[s]:
        raise BadContributionError("hello signed by another peer than the member it names")
    if not isinstance(w, float) or not math.isfinite(w) or w < 0:
        raise BadContributionError("bad signed hello weight")
    if msg["b"] != _hello_body(r, g, s, w):  # type: ignore[index]
        # a reducer lists it by its figures: another encoding would not verify from them
        raise BadContributionError("signed hello not in its one encoding")
    return SignedHello(r, g, s, w, msg)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Statement:
    """A sender's signed figures for one round (what a verifier needs from it)."""

    round_id: bytes
    digest: bytes
    sender: int
    weight: float
    seed: bytes
    shares: Mapping[int, ShareFigures]
    wire: dict
    """The signed form ({"b": body, "pk": key, "sig": signature}), kept as evidence."""
    hello_wires: tuple[list, ...] = ()
    """As a reducer: the signed hellos of the senders that opened an exchange with it (and its
    own): what it may count, each as ``[sender, weight, signature]`` (the body follows from the
    round, the key from the sender's own statement). Checked only when a
    share is disputed (:func:`hello_of`): a member parsing every reducer's would verify n**2
    signatures a round."""
    pending: frozenset[int] = frozenset()
    """Shares (reducer indices) whose results its member still waited for when a member asked
    at its check (:func:`.audit.answer`): every member recomputes them without its part."""
    checked: bool = True
    """Whether its signature was verified. One that came straight from its member over our
    authenticated channel is taken on the channel's word (``parse_statement(direct=...)``):
    the signature matters only to third parties, so it is verified when the statement becomes
    evidence (:func:`statement_holds`)."""


def statement_holds(st: Statement) -> bool:
    """Whether ``st``'s signature verifies (its key is the member's: checked on parsing)."""
    wire = st.wire
    return st.checked or verify_signature(wire["pk"], wire["sig"], wire["b"])


def hello_of(st: Statement, members: Sequence[str], i: int, key: bytes) -> SignedHello | None:
    """Member ``i``'s hello as a reducer's statement lists it, if one verifies with ``key``
    (member ``i``'s public key; a malformed entry counts as none: the reducer signed the
    list). Of two by one member (that member signed both), the contribution."""
    out = None
    for entry in st.hello_wires:
        if not isinstance(entry, list) or len(entry) != 3 or entry[0] != i:
            continue
        s, w, sig = entry
        if not isinstance(w, float) or not isinstance(sig, bytes):
            continue
        raw = {"b": _hello_body(st.round_id, st.digest, i, w), "pk": key, "sig": sig}
        try:
            h = parse_signed_hello(raw, round_id=st.round_id, digest=st.digest, members=members)
        except (BadContributionError, ValueError):
            continue
        if out is None or h.weight > 0:
            out = h
    return out


def _listed(hello: dict) -> list:
    """A signed hello as a reducer's statement lists it (its body was checked on receipt)."""
    d = msgpack.unpackb(hello["b"], raw=False, strict_map_key=False)
    return [d["s"], d["w"], hello["sig"]]


def make_statement(
    identity: object,
    round_id: bytes,
    digest: bytes,
    sender: int,
    weight: float,
    seed: bytes,
    shares: Mapping[int, ShareFigures],
    hellos: Sequence[dict] = (),
    pending: Sequence[int] = (),
) -> dict:
    """The signed wire form of a statement (``identity`` has ``sign`` and ``public_key``);
    ``hellos``: the signed hellos it holds as a reducer (:class:`SignedHello`); ``pending``:
    the shares it said it still waited for (listed only when there are some, so a clean
    round's statement keeps its bytes)."""
    extra = {"p": sorted(int(j) for j in pending)} if pending else {}
    body = msgpack.packb(
        extra
        | {
            "h": [_listed(h) for h in hellos],
            "r": round_id,
            "g": digest,
            "s": sender,
            "w": float(weight),
            "z": seed,
            "j": {
                int(j): [
                    f.parts,
                    f.q.astype("<f8").tobytes(),
                    f.norms.astype("<f8").tobytes(),
                    f.results,
                ]
                for j, f in shares.items()
            },
        },
        use_bin_type=True,
    )
    return {"b": body, "pk": identity.public_key, "sig": identity.sign(body)}  # type: ignore[attr-defined]


def parse_statement(
    msg: object,
    *,
    round_id: bytes,
    digest: bytes,
    members: Sequence[str],
    chunks: Mapping[int, int],
    ours: bool = False,
    direct: int | None = None,
) -> Statement:
    """Check a signed statement against the round: signature by the member it names, sizes per
    share (``chunks``: reducer -> chunk count). Raises BadContributionError. ``ours``: the one
    we just signed, whose signature is not verified again (the rest is checked alike).
    ``direct``: the member whose authenticated channel brought it; its own statement's
    signature is left for when it is used as evidence (``Statement.checked``), a relayed one's
    is verified here (a relay could forge it)."""
    if not isinstance(msg, dict):
        raise BadContributionError("statement is not a map")
    body, pk, sig = msg.get("b"), msg.get("pk"), msg.get("sig")
    if not all(isinstance(v, bytes) for v in (body, pk, sig)) or len(body) > MAX_STATEMENT_BYTES:
        raise BadContributionError("malformed statement")
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise BadContributionError(f"malformed statement body: {e!r:.100}") from None
    if not isinstance(d, dict) or d.get("r") != round_id or d.get("g") != digest:
        raise BadContributionError("statement of another round")
    s, w, seed, per = d.get("s"), d.get("w"), d.get("z"), d.get("j")
    if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < len(members):
        raise BadContributionError("statement names no member")
    try:
        signer = PeerID.from_public_key(pk)
    except ValueError:
        raise BadContributionError("bad statement key") from None
    if str(signer) != members[s]:
        raise BadContributionError("statement signed by another peer than the member it names")
    checked = not ours and s != direct
    if checked and not verify_signature(pk, sig, body):
        raise BadContributionError("statement signature does not verify")
    if not isinstance(w, float) or not math.isfinite(w) or w < 0:
        raise BadContributionError("bad statement weight")
    if not isinstance(seed, bytes) or len(seed) != 32 or not isinstance(per, dict):
        raise BadContributionError("malformed statement")
    listed = d.get("h", [])
    if not isinstance(listed, list) or len(listed) > len(members):
        raise BadContributionError("malformed hello list")
    shares: dict[int, ShareFigures] = {}
    for j, fig in per.items():
        if j not in chunks or not isinstance(fig, list) or len(fig) != 4:
            raise BadContributionError("statement for a share that does not exist")
        parts, q, norms, results = fig
        n = chunks[j]
        sizes = (32, 8 * n, 8 * n, 32)
        if not all(isinstance(v, bytes) for v in fig) or tuple(map(len, fig)) != sizes:
            raise BadContributionError("statement figures of the wrong size")
        shares[j] = ShareFigures(
            parts, np.frombuffer(q, "<f8").copy(), np.frombuffer(norms, "<f8").copy(), results
        )
    pending = d.get("p", [])
    # reducers are members (a third party re-checking evidence knows only the members)
    if not isinstance(pending, list) or len(pending) > len(members):
        raise BadContributionError("malformed pending shares")
    if not all(isinstance(j, int) and not isinstance(j, bool) for j in pending):
        raise BadContributionError("malformed pending shares")
    if not all(0 <= j < len(members) for j in pending):
        raise BadContributionError("malformed pending shares")
    listed, pending = tuple(listed), frozenset(pending)
    return Statement(round_id, digest, s, w, seed, shares, msg, listed, pending, checked or ours)


NO_HASH = bytes(32)
"""The hash slot of a chunk a sender did not send."""
