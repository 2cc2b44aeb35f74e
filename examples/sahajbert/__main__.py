"""``python -m examples.sahajbert``: the demo, trainer, coordinator, aux and finetune roles.

python -m examples.sahajbert                       # local demo: coordinator + 3 trainers
python -m examples.sahajbert coordinator           # start a run (prints the address to join)
python -m examples.sahajbert --initial-peers ADDR  # join it as a trainer (default role)
python -m examples.sahajbert aux --initial-peers ADDR
python -m examples.sahajbert finetune --task ner --checkpoint DIR
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import signal
import sys
from pathlib import Path

from examples.sahajbert.config import (
    DEFAULT_WORK_DIR,
    DemoConfig,
    FinetuneConfig,
    NetConfig,
    OptimizerConfig,
    TrainerConfig,
)

ROLES = ("demo", "trainer", "coordinator", "aux", "finetune", "export")


def _announce_addr(text: str) -> str:
    """An ``--announce`` value: a multiaddr with a host and a TCP port (checked early)."""
    from p2p.errors import MultiaddrError
    from p2p.multiaddr import Multiaddr

    try:
        addr = Multiaddr.parse(text)
    except MultiaddrError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if addr.is_relayed or addr.host is None or not addr.port:
        raise argparse.ArgumentTypeError(
            f"{text}: needs a host and a TCP port, e.g. /ip4/203.0.113.7/tcp/31337"
        )
    return text


def _add_run_options(p: argparse.ArgumentParser) -> None:
    d = TrainerConfig()
    o = OptimizerConfig()
    g = p.add_argument_group("run")
    g.add_argument("--run-id", default=None, help="name of the collaboration (default: sahajbert)")
    g.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MULTIADDR",
        help="addresses of peers already in the run, e.g. /ip4/1.2.3.4/tcp/5000/p2p/12D3...; "
        "the coordinator prints one",
    )
    g.add_argument(
        "--listen",
        nargs="*",
        default=["/ip4/127.0.0.1/tcp/0"],
        help="addresses to listen on (use /ip4/0.0.0.0/tcp/PORT to accept peers from the network)",
    )
    g.add_argument(
        "--announce",
        nargs="*",
        default=[],
        type=_announce_addr,
        help="addresses others reach this peer at (a forwarded port, a proxy), e.g. "
        "/ip4/203.0.113.7/tcp/31337: advertised in the DHT and the run's records instead of "
        "the --listen addresses",
    )
    g.add_argument(
        "--identity", type=Path, help="private key file (created if missing): a stable peer ID"
    )
    g.add_argument(
        "--client-mode",
        action="store_true",
        help="behind a NAT/firewall: do not listen; send gradients, reduce no share",
    )
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--config",
        choices=("tiny", "sahajbert"),
        default=None,
        help="model size: sahajbert (ALBERT-large, 18M parameters) or tiny (for CPUs)",
    )
    g.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        help=f"samples the whole collaboration gathers per step (default {d.target_batch_size})",
    )
    g.add_argument(
        "--per-device-batch-size",
        type=int,
        default=None,
        help=f"micro-batch per local device (default {d.per_device_batch_size})",
    )
    g.add_argument(
        "--grad-accumulation",
        type=int,
        default=None,
        help="micro-batches whose gradients are summed locally per report (default 1)",
    )
    g.add_argument(
        "--seq-length", type=int, default=None, help=f"tokens per example (default {d.seq_length})"
    )
    g.add_argument(
        "--data",
        default=None,
        help="comma-separated local text files (one document per line), or 'hf' for Bengali "
        "Wikipedia + OSCAR from Hugging Face datasets; default: the synthetic Bengali corpus",
    )
    g.add_argument(
        "--tokenizer", default=None, help="a saved tokenizer directory (default: train one)"
    )
    g.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help=f"cache for corpus, tokenizer and compiled programs (default {DEFAULT_WORK_DIR})",
    )
    g.add_argument("--bf16", action="store_true", help="compute in bfloat16 (accelerators)")
    g.add_argument("--max-epochs", type=int, default=None, help="stop after this epoch")
    g = p.add_argument_group("optimizer (sahajBERT's LAMB recipe)")
    g.add_argument("--learning-rate", type=float, default=None, help=f"peak lr ({o.learning_rate})")
    g.add_argument(
        "--warmup-steps", type=int, default=None, help=f"linear warmup ({o.warmup_steps})"
    )
    g.add_argument(
        "--total-steps", type=int, default=None, help=f"linear decay to 0 ({o.total_steps})"
    )
    g = p.add_argument_group("trainer")
    g.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="seconds to sleep per micro-step (simulates a slower device)",
    )
    g.add_argument(
        "--wait-for-trainers",
        type=int,
        default=0,
        help="before the first step, wait up to 60 s until this many other trainers are in the "
        "run (a local demo's first epoch is then a group one; a real run waits for nobody)",
    )
    g.add_argument("--save-final", type=Path, help="write the final parameters here (.npz)")
    g = p.add_argument_group("coordinator")
    g.add_argument(
        "--checkpoint-dir", type=Path, help="where to save checkpoints (default OUT/checkpoints)"
    )
    g.add_argument("--checkpoint-every", type=int, default=10, help="epochs between checkpoints")
    g.add_argument(
        "--out", type=Path, help="metrics/status dir (default ./sahajbert-run; demo: WORK_DIR/demo)"
    )
    g.add_argument("--dashboard-port", type=int, default=0, help="dashboard port (0: any)")
    g.add_argument("--addr-file", type=Path, help="write the coordinator's addresses here")


def _add_finetune_options(p: argparse.ArgumentParser) -> None:
    f = FinetuneConfig()
    g = p.add_argument_group("finetune (sahajBERT's recipe)")
    g.add_argument("--task", choices=("ner", "ncc"), help="WikiANN bn NER or IndicGLUE sna.bn")
    g.add_argument("--checkpoint", type=Path, help="a checkpoint directory (or their parent)")
    g.add_argument(
        "--finetune-data",
        dest="finetune_data",
        default=None,
        help="directory with train/validation/test .jsonl, or 'hf' (wikiann bn / indic_glue "
        "sna.bn); default: generate a small synthetic set. With the finetune role, --data "
        "means the same",
    )
    g.add_argument("--lr", type=float, default=f.learning_rate, help="learning rate")
    g.add_argument("--epochs", type=int, default=f.epochs, help="maximum epochs")
    g.add_argument("--batch-size", type=int, default=f.batch_size, help="batch size")
    g.add_argument("--patience", type=int, default=f.patience, help="early-stopping patience")
    g.add_argument("--ft-seq-length", type=int, default=f.seq_length, help="tokens per example")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.sahajbert",
        description="sahajBERT with dedloc-jax. Roles: demo (default without --initial-peers: a "
        "whole collaboration on this machine), trainer (default with --initial-peers), "
        "coordinator (first peer, monitor, dashboard, checkpoints), aux (averaging helper "
        "without accelerator), finetune (NER / news classification of a checkpoint).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("role", nargs="?", choices=ROLES, help="what to run")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--demo-epochs", type=int, default=DemoConfig().epochs, help="demo length")
    p.add_argument("--demo-trainers", type=int, default=DemoConfig().trainers, help="demo peers")
    _add_run_options(p)
    _add_finetune_options(p)
    return p


def trainer_config(args: argparse.Namespace, base: TrainerConfig | None = None) -> TrainerConfig:
    """``TrainerConfig`` from the command line (unset options keep ``base``'s values)."""
    base = base or (TrainerConfig.demo(args.work_dir) if args.config == "tiny" else TrainerConfig())
    opt = base.optimizer
    for name, field in (
        ("learning_rate", "learning_rate"),
        ("warmup_steps", "warmup_steps"),
        ("total_steps", "total_steps"),
    ):
        if getattr(args, name) is not None:
            opt = opt.replace(**{field: getattr(args, name)})
    changes = {
        "run_id": args.run_id,
        "model": args.config,
        "target_batch_size": args.target_batch_size,
        "per_device_batch_size": args.per_device_batch_size,
        "grad_accumulation": args.grad_accumulation,
        "seq_length": args.seq_length,
        "data": args.data,
        "tokenizer": args.tokenizer,
        "max_epochs": args.max_epochs,
    }
    cfg = base.replace(
        **{k: v for k, v in changes.items() if v is not None},
        optimizer=opt,
        work_dir=args.work_dir,
        bf16=args.bf16 or base.bf16,
        step_delay=args.step_delay or base.step_delay,
        wait_for_trainers=getattr(args, "wait_for_trainers", 0) or base.wait_for_trainers,
    )
    return cfg


def net_config(args: argparse.Namespace) -> NetConfig:
    return NetConfig(
        initial_peers=tuple(args.initial_peers),
        listen=tuple(args.listen),
        announce=tuple(args.announce),
        identity=args.identity,
        client_mode=args.client_mode,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    role = args.role or ("trainer" if args.initial_peers else "demo")
    if args.announce and args.client_mode:
        parser.error("--announce needs a peer that accepts connections (not --client-mode)")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if role != "demo":
        logging.getLogger("examples").setLevel(logging.INFO)
        # `kill -USR1 <pid>` prints every thread's stack: what a stuck peer is waiting on.
        with contextlib.suppress(OSError, ValueError):  # stderr without a file (embedded)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    if role == "demo":
        from examples.sahajbert.demo import run_demo

        demo = DemoConfig(epochs=args.demo_epochs, trainers=args.demo_trainers)
        demo = demo.replace(client_trainers=min(demo.client_trainers, demo.trainers - 1))
        out = args.out or args.work_dir / "demo"
        return run_demo(demo, trainer_config(args, TrainerConfig.demo(args.work_dir)), out)
    if role == "finetune":
        from examples.sahajbert.finetune import main_finetune

        return main_finetune(args)
    if role == "export":
        from examples.sahajbert.export import ExportError, export

        if args.checkpoint is None or args.out is None:
            parser.error("export needs --checkpoint DIR and --out DIR")
        try:
            print(export(args.checkpoint, args.out))
        except ExportError as e:
            print(f"export: {e}", file=sys.stderr)
            return 1
        return 0
    cfg = trainer_config(args)
    net = net_config(args)
    if role == "trainer":
        from examples.sahajbert.trainer import run_trainer

        if not net.initial_peers:
            print("a trainer needs --initial-peers (start a coordinator first)", file=sys.stderr)
            return 2
        result = run_trainer(cfg, net, final_params=args.save_final)
        print(f"stopped at epoch {result.epoch} after {result.samples} samples")
        return 0
    if role == "coordinator":
        from examples.sahajbert.coordinator import (
            CoordinatorOptions,
            FinalStateMissing,
            run_coordinator,
        )

        opts = CoordinatorOptions(
            out_dir=args.out or Path("sahajbert-run"),
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            dashboard_port=args.dashboard_port,
            exit_after_epoch=cfg.max_epochs,
            addr_file=args.addr_file,
        )
        try:
            run_coordinator(cfg, net, opts)
        except FinalStateMissing as e:
            print(f"coordinator: {e}", file=sys.stderr)
            return 1
        return 0
    from examples.sahajbert.aux import run_aux

    return run_aux(cfg, net)


if __name__ == "__main__":
    sys.exit(main())
