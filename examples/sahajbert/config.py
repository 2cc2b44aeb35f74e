"""Run options of the sahajBERT example: frozen dataclasses whose defaults are sahajBERT's.

``OptimizerConfig`` holds the published recipe (LAMB, lr 0.00176, betas (0.9, 0.999), eps 1e-6,
weight decay 0.01 except biases and LayerNorm, 5000 warmup steps then linear decay, clip 1.0);
``TrainerConfig`` what one volunteer's program needs; ``FinetuneConfig`` the evaluation recipe.
The ``tiny``/``demo`` presets shrink everything so the local demo runs on a laptop CPU.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_WORK_DIR = Path(os.environ.get("DEDLOC_JAX_CACHE", "~/.cache/dedloc-jax")).expanduser()


@dataclass(frozen=True)
class OptimizerConfig:
    """LAMB as sahajBERT ran it; the step count is the collaboration's epoch."""

    learning_rate: float = 0.00176
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 5000
    total_steps: int = 125_000  # linear decay reaches 0 here (sahajBERT's run_trainer default)
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.learning_rate <= 0 or self.clip_norm <= 0:
            raise ValueError("learning_rate and clip_norm must be positive")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError("need 0 <= warmup_steps < total_steps")

    def replace(self, **changes: object) -> OptimizerConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def sahajbert(cls) -> OptimizerConfig:
        return cls()

    @classmethod
    def demo(cls) -> OptimizerConfig:
        """A tiny model and a few dozen steps: a larger rate and almost no warmup."""
        return cls(learning_rate=0.03, warmup_steps=2, total_steps=1000)


COMPRESSIONS = ("none", "fp16", "bf16", "int8", "adaptive")
"""``--compression``'s choices: dedloc_jax's codecs and per-leaf policies (a test keeps them
equal to ``dedloc_jax.averaging.leaf_codecs.COMPRESSIONS``; the program imports no jax for
--help)."""


@dataclass(frozen=True)
class TrainerConfig:
    """One peer's program: model size, batches, data, and how it joins the run."""

    run_id: str = "sahajbert"
    model: str = "sahajbert"  # "tiny" or "sahajbert" (models.albert.AlbertConfig presets)
    target_batch_size: int = 4096
    per_device_batch_size: int = 4
    grad_accumulation: int = 1
    seq_length: int = 512
    bf16: bool = False
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    work_dir: Path = DEFAULT_WORK_DIR
    data: str | None = None  # --data sources (models.text.sources.parse_data); None: synthetic
    data_mix: str | None = None  # --data-mix weights, one per source (None: the default mix)
    tokenizer: str | None = None  # a saved tokenizer directory; default: work_dir/tokenizer
    # averaged vectors on the wire, one of COMPRESSIONS (--compression; None: the model
    # preset's in DeDLOC mode, int8 in DiLoCo mode)
    codec: str | None = None
    masking: tuple[tuple[str, float], ...] = ()  # PretrainingConfig overrides (the manifest's)
    max_epochs: int | None = None  # stop after this collaboration epoch (None: run forever)
    step_delay: float = 0.0  # seconds slept per micro-step: simulates a slower device
    wait_for_trainers: int = 0  # before the first step, wait (<= 60 s) for this many other trainers
    seed: int = 0
    # "dedloc": one averaged step per target batch; "diloco": local inner steps on every
    # micro-batch and one averaged outer step per inner_steps target batches (dedloc_jax.diloco)
    mode: str = "dedloc"
    inner_steps: int = 500
    # "topk" (DiLoCo mode): pseudo-gradients as dedloc_jax.TopK(density=topk_density,
    # bits=topk_bits, error_feedback=topk_error_feedback) (TopK's defaults; a test checks)
    compression: str | None = None
    topk_density: float = 1 / 64
    # "powersgd" (DeDLOC mode): gradients as dedloc_jax.PowerSGD(rank=powersgd_rank), its
    # factors in the run's codec
    powersgd_rank: int = 4
    topk_bits: int = 2
    topk_error_feedback: float = 0.95

    def __post_init__(self) -> None:
        if self.model not in ("tiny", "sahajbert"):
            raise ValueError(f"unknown model config {self.model!r}")
        if min(self.target_batch_size, self.per_device_batch_size, self.grad_accumulation) < 1:
            raise ValueError("batch sizes and grad_accumulation must be positive")
        if self.seq_length < 8:
            raise ValueError("seq_length must be at least 8")
        if self.mode not in ("dedloc", "diloco") or self.inner_steps < 1:
            raise ValueError("mode must be dedloc or diloco, and inner_steps positive")
        if self.compression == "topk" and self.mode != "diloco":
            raise ValueError("--compression topk needs --mode diloco")
        if self.compression == "powersgd" and self.mode != "dedloc":
            raise ValueError("--compression powersgd needs --mode dedloc")
        if not 1 <= self.powersgd_rank <= 64:
            raise ValueError(f"powersgd_rank must be 1 to 64, got {self.powersgd_rank}")
        if not 0.0 < self.topk_density <= 1.0:
            raise ValueError(f"topk_density must be in (0, 1], got {self.topk_density}")
        if not 1 <= self.topk_bits <= 8:
            raise ValueError(f"topk_bits must be 1 to 8, got {self.topk_bits}")
        if not 0.0 <= self.topk_error_feedback <= 1.0:
            raise ValueError(f"topk_error_feedback must be in [0, 1]: {self.topk_error_feedback}")

    @property
    def collaboration_target(self) -> int:
        """Samples the collaboration gathers per averaging: the target batch, times
        ``inner_steps`` in DiLoCo mode (the samples of that many DeDLOC steps)."""
        return self.target_batch_size * (self.inner_steps if self.mode == "diloco" else 1)

    def replace(self, **changes: object) -> TrainerConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def sahajbert(cls) -> TrainerConfig:
        return cls()

    @classmethod
    def demo(cls, work_dir: Path = DEFAULT_WORK_DIR) -> TrainerConfig:
        """The embedded local demo: tiny ALBERT, short sequences, a small target batch."""
        return cls(
            run_id="sahajbert-demo",
            model="tiny",
            target_batch_size=96,
            per_device_batch_size=16,  # vs 8: ~25% less CPU per sample (fixed cost per step)
            seq_length=64,
            optimizer=OptimizerConfig.demo(),
            work_dir=work_dir,
            max_epochs=30,
            inner_steps=4,
        )


@dataclass(frozen=True)
class NetConfig:
    """How a peer reaches the others."""

    initial_peers: tuple[str, ...] = ()  # multiaddrs with /p2p/<peer-id>; empty: start a run
    # Every interface: peers on the network (and a home router's mapped port) reach us; we
    # advertise the interfaces' addresses, a mapped, observed or announced one, never 0.0.0.0.
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce: tuple[str, ...] = ()  # advertised instead of `listen` (port forward, proxy)
    identity: Path | None = None  # key file, created on first use: a stable peer ID
    client_mode: bool = False  # no listening: dial out only, send gradients, reduce nothing
    # Private runs (examples.sahajbert.private): the owner's public key and our invitation.
    owner_public_key: bytes | None = None
    invitation: bytes | None = None
    robust_tau: float | None = None  # CenteredClip radius (None: derived in open runs)

    def replace(self, **changes: object) -> NetConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class DemoConfig:
    """The local collaboration started by ``python -m examples.sahajbert``."""

    trainers: int = 3  # trainer processes besides the coordinator
    client_trainers: int = 1  # of which this many run in client mode
    slow_step_delay: float = 0.15  # extra seconds per micro-step of the deliberately slow peer
    epochs: int = 30
    checkpoint_every: int = 10
    timeout: float = 600.0  # the demo gives up after this many seconds

    def __post_init__(self) -> None:
        if self.trainers < 1 or not 0 <= self.client_trainers <= self.trainers:
            raise ValueError("need at least one trainer and client_trainers <= trainers")
        if self.epochs < 1 or self.checkpoint_every < 1:
            raise ValueError("epochs and checkpoint_every must be positive")

    def replace(self, **changes: object) -> DemoConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class FinetuneConfig:
    """sahajBERT's evaluation recipe: lr 1e-5, seq 128, batch 128, <= 20 epochs, patience 3."""

    learning_rate: float = 1e-5
    seq_length: int = 128
    batch_size: int = 128
    epochs: int = 20
    patience: int = 3  # epochs without a better validation loss before stopping
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.learning_rate <= 0 or min(self.batch_size, self.epochs, self.patience) < 1:
            raise ValueError("learning_rate, batch_size, epochs and patience must be positive")

    def replace(self, **changes: object) -> FinetuneConfig:
        return dataclasses.replace(self, **changes)
