"""The run manifest: what every peer of one sahajBERT run must share, prepared once and signed.

The organiser prepares a run once (``prepare``, or the coordinator when given none): the model
config, the tokenizer (trained once, on the organiser's machine), the data recipe (sources, mix,
sequence length, masking), the target batch, the optimizer recipe, the training mode (DeDLOC or
DiLoCo, with its inner steps) and the wire codec. The coordinator signs it with its identity,
stores it under ``<run_id>.manifest`` in the DHT (its owner-marked subkey) and serves it, with
the tokenizer file, over two RPCs; a trainer that adopted it serves both too, so volunteers can
join through any peer.

A volunteer's trainer asks its ``--initial-peers`` for the manifest before it opens the
collaboration (the manifest decides how to open it), checks the signature (in a private run:
the owner's), downloads the tokenizer file and checks its SHA-256 against the manifest's, and
trains with the manifest's settings. An explicit flag that contradicts the manifest refuses the
start with a message naming the flag and both values: a peer on another vocabulary or sequence
length would average gradients of a different model without any error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from examples.sahajbert.config import COMPRESSIONS, OptimizerConfig, TrainerConfig
from models.text.sources import MAX_SOURCES, SourceSpec, parse_data

log = logging.getLogger(__name__)

VERSION = 3  # 2: training mode, DiLoCo's inner steps; 3: powersgd's rank, topk's settings
GET_MANIFEST = "sahajbert.manifest"  # RPC: the signed manifest
GET_TOKENIZER = "sahajbert.tokenizer"  # RPC: the tokenizer.json the manifest names
MAX_MANIFEST_BYTES = 64 << 10
MAX_TOKENIZER_BYTES = 24 << 20  # a 32k Unigram tokenizer.json is ~2 MB
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
_DOMAIN = b"dedloc-jax/sahajbert-manifest/1\0"
_MASKING_FIELDS = (
    "mlm_probability",
    "mask_fraction",
    "random_fraction",
    "swap_probability",
    "short_seq_probability",
)


class ManifestError(RuntimeError):
    """No usable manifest: none served, a bad signature, a tokenizer that fails its digest."""


class ManifestMismatch(ManifestError):
    """An explicit option contradicts the run's manifest."""

    def __init__(self, flag: str, given: object, manifest: object) -> None:
        super().__init__(
            f"{flag} {given} contradicts the run's manifest ({flag} {manifest}); drop the "
            "option to train with the run's value"
        )
        self.flag, self.given, self.manifest = flag, given, manifest


def manifest_key(run_id: str) -> str:
    return f"{run_id}.manifest"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _masking(value: dict[str, Any]) -> dict[str, float]:
    from models.text.data import PretrainingConfig

    if not isinstance(value, dict) or set(value) != set(_MASKING_FIELDS):
        raise ValueError(f"masking must hold exactly {list(_MASKING_FIELDS)}")
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
            raise ValueError(f"masking {k} must be a number in [0, 1]")
    PretrainingConfig(**value)  # the combined rules (fractions sum to <= 1)
    return {k: float(v) for k, v in value.items()}


def _optimizer(value: dict[str, Any]) -> dict[str, float | int]:
    names = {f for f in OptimizerConfig.__dataclass_fields__}
    if not isinstance(value, dict) or set(value) != names:
        raise ValueError(f"optimizer must hold exactly {sorted(names)}")
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"optimizer {k} must be a finite number")
    OptimizerConfig(**value)
    return dict(value)


def _topk(value: Any) -> dict[str, Any] | None:
    """TopK's settings, each within TopK's own bounds (None: not a topk run)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"density", "bits", "error_feedback"}:
        raise ValueError("topk must be null or {density, bits, error_feedback}")
    density, feedback = value["density"], value["error_feedback"]
    for name, x, low_open in (("density", density, True), ("error_feedback", feedback, False)):
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise ValueError(f"topk {name} must be a number")
        if not (0.0 < x <= 1.0 if low_open else 0.0 <= x <= 1.0):
            raise ValueError(f"topk {name} {x!r} is out of range")
    return {
        "density": float(density),
        "bits": _int(value["bits"], "topk bits", 1, 8),
        "error_feedback": float(feedback),
    }


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}]")
    return value


@dataclass(frozen=True)
class RunManifest:
    """One run's shared settings (:meth:`from_dict` validates all of them)."""

    run_id: str
    model: str  # "tiny" or "sahajbert"
    vocab_size: int
    seq_length: int
    target_batch_size: int
    optimizer: dict[str, Any]  # OptimizerConfig's fields
    data: tuple[SourceSpec, ...] | None  # None: the synthetic corpus (regenerated, seed 0)
    masking: dict[str, float]  # models.text.data.PretrainingConfig's masking and SOP fields
    codec: str  # gradients on the wire
    mode: str  # "dedloc" or "diloco" (TrainerConfig.mode)
    inner_steps: int  # diloco: target batches per outer step (1 in dedloc mode)
    tokenizer_sha256: str
    tokenizer_bytes: int
    seed: int = 0  # the shared initialisation
    # --compression powersgd (dedloc mode): PowerSGD's rank, its factors in ``codec``; None
    # otherwise
    powersgd_rank: int | None = None
    # --compression topk (diloco mode): TopK's {"density", "bits", "error_feedback"}; None
    # otherwise (``codec`` is then what the averaged vectors travel in)
    topk: dict[str, Any] | None = None
    version: int = VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["extra"]
        out["data"] = None if self.data is None else [s.to_dict() for s in self.data]
        return out

    @classmethod
    def from_dict(cls, value: Any) -> RunManifest:
        """ValueError naming the field for anything malformed (a manifest may come from a
        hostile peer)."""
        if not isinstance(value, dict):
            raise ValueError("a manifest is a map")
        if value.get("version") != VERSION:
            raise ValueError(f"manifest version {value.get('version')!r}, expected {VERSION}")
        names = set(cls.__dataclass_fields__) - {"extra"}
        if set(value) != names:
            raise ValueError(f"manifest fields {sorted(value)} are not {sorted(names)}")
        run_id = value["run_id"]
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 200:
            raise ValueError("run_id must be a short string")
        if value["model"] not in ("tiny", "sahajbert"):
            raise ValueError(f"unknown model {value['model']!r}")
        if value["codec"] not in COMPRESSIONS:
            raise ValueError(f"unknown codec {value['codec']!r}")
        if value["mode"] not in ("dedloc", "diloco"):
            raise ValueError(f"unknown mode {value['mode']!r}")
        inner_steps = _int(value["inner_steps"], "inner_steps", 1, 1 << 20)
        if value["mode"] == "dedloc" and inner_steps != 1:
            raise ValueError("inner_steps must be 1 in dedloc mode")
        digest = value["tokenizer_sha256"]
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or set(digest) - set("0123456789abcdef")
        ):
            raise ValueError("tokenizer_sha256 must be 64 hex digits")
        powersgd_rank = value["powersgd_rank"]
        if powersgd_rank is not None:
            powersgd_rank = _int(powersgd_rank, "powersgd_rank", 1, 64)
            if value["mode"] != "dedloc":
                raise ValueError("powersgd_rank needs mode dedloc")
        topk = _topk(value["topk"])
        if topk is not None and value["mode"] != "diloco":
            raise ValueError("topk needs mode diloco")
        data = value["data"]
        if data is not None:
            if not isinstance(data, list) or not 0 < len(data) <= MAX_SOURCES:
                raise ValueError(f"data must be null or 1..{MAX_SOURCES} sources")
            data = tuple(SourceSpec.from_dict(s) for s in data)
        return cls(
            run_id=run_id,
            model=value["model"],
            vocab_size=_int(value["vocab_size"], "vocab_size", 6, 1 << 20),
            seq_length=_int(value["seq_length"], "seq_length", 8, 1 << 16),
            target_batch_size=_int(value["target_batch_size"], "target_batch_size", 1, 1 << 30),
            optimizer=_optimizer(value["optimizer"]),
            data=data,
            masking=_masking(value["masking"]),
            codec=value["codec"],
            mode=value["mode"],
            inner_steps=inner_steps,
            tokenizer_sha256=digest,
            tokenizer_bytes=_int(
                value["tokenizer_bytes"], "tokenizer_bytes", 1, MAX_TOKENIZER_BYTES
            ),
            seed=_int(value["seed"], "seed", 0, (1 << 31) - 1),
            powersgd_rank=powersgd_rank,
            topk=topk,
        )

    def encode(self) -> bytes:
        """Canonical bytes (what is signed and what the digest covers)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    # --- what a peer trains with ---------------------------------------------------------
    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(**self.optimizer)

    def data_flag(self) -> tuple[str | None, str | None]:
        """The ``--data`` and ``--data-mix`` values of this recipe."""
        if self.data is None:
            return None, None
        return ",".join(s.describe() for s in self.data), ",".join(
            repr(s.weight) for s in self.data
        )


# --- preparing ---------------------------------------------------------------------------
def build(cfg: TrainerConfig, tokenizer_file: Path, vocab_size: int, codec: str) -> RunManifest:
    """The manifest of ``cfg``'s run with this tokenizer."""
    from models.text.data import PretrainingConfig

    masking = PretrainingConfig()
    data = None if cfg.data is None else parse_data(cfg.data, cfg.data_mix)
    return RunManifest(
        run_id=cfg.run_id,
        model=cfg.model,
        vocab_size=vocab_size,
        seq_length=cfg.seq_length,
        target_batch_size=cfg.target_batch_size,
        optimizer=asdict(cfg.optimizer),
        data=data,
        masking={k: float(getattr(masking, k)) for k in _MASKING_FIELDS},
        codec=codec,
        mode=cfg.mode,
        inner_steps=cfg.inner_steps if cfg.mode == "diloco" else 1,
        tokenizer_sha256=sha256_file(tokenizer_file),
        tokenizer_bytes=tokenizer_file.stat().st_size,
        seed=cfg.seed,
        powersgd_rank=cfg.powersgd_rank if cfg.compression == "powersgd" else None,
        topk=_topk_settings(cfg) if cfg.compression == "topk" else None,
    )


def _topk_settings(cfg: TrainerConfig) -> dict[str, Any]:
    """``cfg``'s TopK settings as the manifest's ``topk`` holds them."""
    return {
        "density": float(cfg.topk_density),
        "bits": cfg.topk_bits,
        "error_feedback": float(cfg.topk_error_feedback),
    }


def _compression(compression: str | None, codec: str) -> str:
    """What ``--compression`` names: a scheme (powersgd, topk) or else the codec."""
    return compression if compression in ("powersgd", "topk") else codec


def save(manifest: RunManifest, tokenizer_file: Path, out_dir: Path) -> Path:
    """``out_dir/manifest.json`` and ``out_dir/tokenizer/`` (what ``coordinator --manifest``
    publishes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = out_dir / "tokenizer"
    if Path(tokenizer_file).resolve() != (tok_dir / TOKENIZER_FILE).resolve():
        install_tokenizer(Path(tokenizer_file).read_bytes(), tok_dir)
    _write_atomic(out_dir / MANIFEST_FILE, json.dumps(manifest.to_dict(), indent=1).encode())
    return out_dir


def load(run_dir: Path) -> tuple[RunManifest, Path]:
    """A prepared run: its manifest and tokenizer directory (digest checked)."""
    path = Path(run_dir) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{run_dir} holds no {MANIFEST_FILE} (run `prepare` first)")
    try:
        manifest = RunManifest.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ManifestError(f"{path}: {e}") from None
    tok_dir = Path(run_dir) / "tokenizer"
    tok_file = tok_dir / TOKENIZER_FILE
    if not tok_file.is_file() or sha256_file(tok_file) != manifest.tokenizer_sha256:
        raise ManifestError(f"{tok_file} is missing or is not the tokenizer {path} names")
    return manifest, tok_dir


def install_tokenizer(data: bytes, tok_dir: Path) -> Path:
    """Write ``tokenizer.json`` byte for byte (its digest is the manifest's) plus the
    transformers config files around it, so :func:`models.text.tokenizer.load_tokenizer` loads
    it."""
    import tempfile

    from tokenizers import Tokenizer

    from models.text.tokenizer import save_tokenizer, wrap_fast

    tok_dir.mkdir(parents=True, exist_ok=True)
    fast = wrap_fast(Tokenizer.from_str(data.decode("utf-8")))
    with tempfile.TemporaryDirectory(dir=tok_dir.parent) as tmp:
        save_tokenizer(fast, tmp)
        for extra in Path(tmp).iterdir():
            if extra.name != TOKENIZER_FILE:
                os.replace(extra, tok_dir / extra.name)
    _write_atomic(tok_dir / TOKENIZER_FILE, data)
    return tok_dir


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- signing -----------------------------------------------------------------------------
def sign(manifest: RunManifest, identity: Any) -> dict[str, bytes]:
    body = manifest.encode()
    return {
        "manifest": body,
        "signer": identity.public_key,
        "signature": identity.sign(_DOMAIN + body),
    }


def verify(
    envelope: Any, *, run_id: str | None, owner: bytes | None = None
) -> tuple[RunManifest, str]:
    """``(manifest, signer's peer ID)`` from a signed envelope; ManifestError when it is not
    well-formed, not validly signed, of another run than ``run_id`` (None: any run), or
    (private run) not the owner's."""
    from p2p.identity import PeerID, verify_signature

    if not isinstance(envelope, dict):
        raise ManifestError("the manifest answer is not a map")
    body, signer, signature = (envelope.get(k) for k in ("manifest", "signer", "signature"))
    if not all(isinstance(x, bytes) for x in (body, signer, signature)):
        raise ManifestError("the manifest answer lacks manifest/signer/signature bytes")
    if len(body) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"the manifest is over {MAX_MANIFEST_BYTES} bytes")
    if owner is not None and signer != owner:
        raise ManifestError("the manifest is not signed by the private run's owner")
    try:
        ok = verify_signature(signer, signature, _DOMAIN + body)
    except Exception as e:  # a malformed key
        raise ManifestError(f"the manifest's signer key is invalid: {e}") from None
    if not ok:
        raise ManifestError("the manifest's signature does not verify")
    try:
        manifest = RunManifest.from_dict(json.loads(body))
    except (ValueError, TypeError) as e:
        raise ManifestError(f"malformed manifest: {e}") from None
    if manifest.encode() != body:
        raise ManifestError("the manifest is not in canonical form")
    if run_id is not None and manifest.run_id != run_id:
        raise ManifestError(
            f"the initial peers serve run {manifest.run_id!r}, not {run_id!r} (--run-id): drop "
            f"--run-id to join run {manifest.run_id!r}, or give --initial-peers of run {run_id!r}"
        )
    return manifest, str(PeerID.from_public_key(signer))


# --- serving ---------------------------------------------------------------------------
REFUSED = "not admitted to this run"  # starts the RPC error an uninvited caller gets


async def serve(core: Any, envelope: dict[str, bytes], tokenizer_file: Path, ttl: float) -> None:
    """Answer the manifest RPCs on this peer and store the envelope in our DHT slot (run in
    the collaboration's trio loop). In a private run both RPCs admit only invited peers (the
    guard the collaboration put on its state RPCs): the manifest names the run's data."""
    from dedloc_jax.access import AccessDenied
    from p2p.dht import owner_marker

    data = Path(tokenizer_file).read_bytes()
    admit = getattr(core.state_server, "admit", None)  # None in an open run

    async def guard(ctx: Any) -> None:
        if admit is None:
            return
        try:
            await admit(ctx.remote_peer)
        except AccessDenied as e:
            raise AccessDenied(f"{REFUSED}: {e.reason}") from None

    async def get_manifest(ctx: Any, request: Any) -> Any:
        await guard(ctx)
        return envelope

    async def get_tokenizer(ctx: Any, request: Any) -> Any:
        await guard(ctx)
        return data

    core.node.add_handler(GET_MANIFEST, get_manifest)
    core.node.add_handler(GET_TOKENIZER, get_tokenizer)
    await core.dht.store(
        manifest_key(core.run_id),
        envelope,
        core.dht.now() + ttl,
        subkey=owner_marker(core.dht.peer_id),
    )


# --- joining -----------------------------------------------------------------------------
def fetch(
    initial_peers: Sequence[str],
    *,
    run_id: str | None,
    work_dir: Path,
    owner: bytes | None = None,
    identity: Path | None = None,
    invitation: bytes | None = None,
    timeout: float = 120.0,
    unreachable_after: float = 10.0,
) -> tuple[RunManifest, dict[str, bytes], Path]:
    """Ask the initial peers for the run's manifest (retrying until ``timeout``; of run
    ``run_id``, or of the run they serve when None), and make
    sure the tokenizer it names is in ``work_dir/tokenizers/<digest>/`` (downloaded and
    checked when it is not). Returns the manifest, its signed envelope and that directory.
    When no initial peer could even be connected to (refused, another peer's key, no route)
    for ``unreachable_after`` seconds, it fails then, with each address's reason.

    We call as ``identity`` (a throwaway one without). In a private run (``owner``) the
    peers serve only invited callers: we show ``invitation`` first; a peer's refusal ends the
    fetch at once with its reason (ManifestError)."""
    import threading

    import outcome
    import trio

    from p2p.identity import Identity

    me = Identity.load_or_create(identity) if identity is not None else None
    args = (list(initial_peers), run_id, Path(work_dir), owner, me, invitation, timeout)
    # In a thread of its own: the caller's thread stays interruptible (a stop signal raises
    # there, not inside trio's loop, which swallowed it) and the fetch dies with the process.
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(outcome.Value(trio.run(_fetch, *args, unreachable_after)))
        except BaseException as e:
            result.append(outcome.Error(e))

    worker = threading.Thread(target=run, name="manifest-fetch", daemon=True)
    worker.start()
    worker.join()
    return result[0].unwrap()


async def _fetch(
    peers: list[str],
    run_id: str | None,
    work_dir: Path,
    owner: bytes | None,
    me: Any,
    invitation: bytes | None,
    timeout: float,
    unreachable_after: float,
) -> tuple[RunManifest, dict[str, bytes], Path]:
    import trio

    from dedloc_jax.access import AUTH
    from p2p.errors import DialError, HandshakeError, P2PError, RPCError
    from p2p.multiaddr import Multiaddr
    from p2p.node import open_node

    addrs = [Multiaddr.parse(a) for a in peers]
    last = "no initial peer answered"
    got: tuple[RunManifest, dict[str, bytes], Path] | ManifestError | None = None
    unreachable: dict[Multiaddr, str] = {}  # why each address could not be connected to
    reached = False  # some initial peer took a connection (then wait up to `timeout`)

    async def show_invitation(ctx: Any, request: Any) -> Any:  # a guard may ask us
        return {"invitation": invitation}

    async def ask(node: Any, addr: Multiaddr) -> tuple[RunManifest, dict[str, bytes], Path]:
        if owner is not None:
            await node.call(addr, AUTH, {"invitation": invitation}, timeout=30)
        envelope = await node.call(addr, GET_MANIFEST, {}, timeout=30)
        manifest, signer = verify(envelope, run_id=run_id, owner=owner)
        tok_dir = work_dir / "tokenizers" / manifest.tokenizer_sha256[:16]
        tok_file = tok_dir / TOKENIZER_FILE
        if not tok_file.is_file() or sha256_file(tok_file) != manifest.tokenizer_sha256:
            data = await node.call(addr, GET_TOKENIZER, {}, timeout=120)
            _check_tokenizer(data, manifest)
            install_tokenizer(data, tok_dir)
        log.info(
            "run manifest %s (signed by %s), tokenizer sha256 %s",
            manifest.digest[:16], signer, manifest.tokenizer_sha256,
        )  # fmt: skip
        return manifest, envelope, tok_dir

    # A throwaway client (the manifest says how to join), as this peer in a private run.
    # Errors leave the node's nursery as results: raised inside, they would come out grouped.
    started = trio.current_time()
    async with open_node(me, listen=[]) as node:
        node.add_handler(AUTH, show_invitation)
        with trio.move_on_after(timeout):
            while got is None:
                for addr in addrs:
                    try:
                        got = await ask(node, addr)
                    except ManifestError as e:
                        got = e
                    except RPCError as e:
                        if e.remote and str(e).startswith(REFUSED):
                            got = ManifestError(_refusal(addr, node.peer_id, str(e)))
                        last = f"{addr}: {e}"
                    except (DialError, HandshakeError, OSError) as e:
                        last = unreachable[addr] = f"{addr}: {e}"
                    except P2PError as e:
                        last, reached = f"{addr}: {e}", True
                    if got is not None:
                        break
                else:
                    if not reached and trio.current_time() - started >= unreachable_after:
                        break
                    await trio.sleep(1.0)
    if isinstance(got, ManifestError):
        raise got
    if got is None and not reached and unreachable:
        raise ManifestError(
            f"could not connect to any of the --initial-peers ({'; '.join(unreachable.values())}): "
            "check the address, port and /p2p/ ID against what the coordinator prints after "
            "'join with: --initial-peers'"
        )
    if got is None:
        raise ManifestError(f"no run manifest from --initial-peers within {timeout:.0f} s ({last})")
    return got


def _refusal(addr: Any, me: Any, reason: str) -> str:
    return (
        f"{addr} refused this peer ({me}): {reason}. The run is private: send your peer ID "
        "(start with --identity FILE to keep it) to the organiser, who runs `python -m "
        "examples.sahajbert invite`, then start with --owner PUBKEY --invitation FILE"
    )


def _check_tokenizer(data: Any, manifest: RunManifest) -> None:
    if not isinstance(data, bytes) or len(data) != manifest.tokenizer_bytes:
        raise ManifestError("the tokenizer served is not the size the manifest names")
    got = hashlib.sha256(data).hexdigest()
    if got != manifest.tokenizer_sha256:
        raise ManifestError(
            f"the tokenizer served has sha256 {got}, the manifest names "
            f"{manifest.tokenizer_sha256}: refusing it"
        )


# --- checking a peer's options against it ------------------------------------------------


def check(manifest: RunManifest, cfg: TrainerConfig, explicit: set[str]) -> None:
    """ManifestMismatch for the first option in ``explicit`` (flags given on the command
    line) whose value in ``cfg`` contradicts the manifest."""
    o = cfg.optimizer
    simple = {
        "--run-id": (cfg.run_id, manifest.run_id),
        "--config": (cfg.model, manifest.model),
        "--seq-length": (cfg.seq_length, manifest.seq_length),
        "--target-batch-size": (cfg.target_batch_size, manifest.target_batch_size),
        "--learning-rate": (o.learning_rate, manifest.optimizer["learning_rate"]),
        "--warmup-steps": (o.warmup_steps, manifest.optimizer["warmup_steps"]),
        "--total-steps": (o.total_steps, manifest.optimizer["total_steps"]),
        "--mode": (cfg.mode, manifest.mode),
        "--compression": (
            _compression(cfg.compression, cfg.codec),
            "powersgd" if manifest.powersgd_rank else "topk" if manifest.topk else manifest.codec,
        ),
    }
    if manifest.mode == "diloco":
        simple["--inner-steps"] = (cfg.inner_steps, manifest.inner_steps)
    if manifest.powersgd_rank:
        simple["--powersgd-rank"] = (cfg.powersgd_rank, manifest.powersgd_rank)
    if manifest.topk:
        given = _topk_settings(cfg)
        for key in ("density", "bits", "error_feedback"):
            simple[f"--topk-{key.replace('_', '-')}"] = (given[key], manifest.topk[key])
    for flag, (given, wanted) in simple.items():
        if flag in explicit and given != wanted:
            raise ManifestMismatch(flag, given, wanted)
    if "--tokenizer" in explicit and cfg.tokenizer:
        given = Path(cfg.tokenizer)  # a saved tokenizer's directory, or its tokenizer.json
        path = given if given.is_file() else given / TOKENIZER_FILE
        got = sha256_file(path) if path.is_file() else "(none)"
        if got != manifest.tokenizer_sha256:
            raise ManifestMismatch(
                "--tokenizer", f"{cfg.tokenizer} (sha256 {got[:16]})",
                f"sha256 {manifest.tokenizer_sha256[:16]}",
            )  # fmt: skip
    if "--data" in explicit or "--data-mix" in explicit:
        _check_data(manifest, cfg)


def _check_data(manifest: RunManifest, cfg: TrainerConfig) -> None:
    """Local sources may sit at other paths on a volunteer's machine: their kind, layout and
    weight must match; hub sources must be the same datasets."""
    wanted_flag, wanted_mix = manifest.data_flag()
    given = None if cfg.data is None else parse_data(cfg.data, cfg.data_mix)
    if manifest.data is None or given is None:
        if (manifest.data is None) != (given is None):
            raise ManifestMismatch(
                "--data", cfg.data or "(synthetic)", wanted_flag or "(synthetic)"
            )
        return
    if len(given) != len(manifest.data):
        raise ManifestMismatch("--data", cfg.data, wanted_flag)
    for g, m in zip(given, manifest.data, strict=True):
        same = (g.kind, g.layout) == (m.kind, m.layout) and (
            g.local or (g.path, g.name, g.split) == (m.path, m.name, m.split)
        )
        if not same:
            raise ManifestMismatch("--data", cfg.data, wanted_flag)
        if not math.isclose(g.weight / sum(s.weight for s in given),
                            m.weight / sum(s.weight for s in manifest.data)):  # fmt: skip
            raise ManifestMismatch("--data-mix", cfg.data_mix, wanted_mix)


def apply(manifest: RunManifest, cfg: TrainerConfig, tok_dir: Path) -> TrainerConfig:
    """``cfg`` with the manifest's run settings (the local data paths given stay)."""
    data, mix = manifest.data_flag()
    if cfg.data is not None and manifest.data is not None:
        data, mix = cfg.data, cfg.data_mix
    return cfg.replace(
        run_id=manifest.run_id,
        model=manifest.model,
        seq_length=manifest.seq_length,
        target_batch_size=manifest.target_batch_size,
        optimizer=manifest.optimizer_config(),
        data=data,
        data_mix=mix,
        tokenizer=str(tok_dir),
        codec=manifest.codec,
        mode=manifest.mode,
        inner_steps=manifest.inner_steps if manifest.mode == "diloco" else cfg.inner_steps,
        seed=manifest.seed,
        masking=tuple(sorted(manifest.masking.items())),
        # the manifest's compression, whatever this peer chose
        compression="powersgd" if manifest.powersgd_rank else "topk" if manifest.topk else None,
        powersgd_rank=manifest.powersgd_rank or cfg.powersgd_rank,
        **(
            {f"topk_{k}": v for k, v in manifest.topk.items()}
            if manifest.topk
            else {}  # not a topk run: the topk options mean nothing and stay as given
        ),
    )
