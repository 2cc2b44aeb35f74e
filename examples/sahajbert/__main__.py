"""``python -m examples.sahajbert``: the demo, trainer, coordinator, aux and finetune roles.

python -m examples.sahajbert                       # local demo: coordinator + 3 trainers
python -m examples.sahajbert coordinator           # start a run (prints the address to join)
python -m examples.sahajbert --initial-peers ADDR  # join it as a trainer (default role)
python -m examples.sahajbert aux --initial-peers ADDR
python -m examples.sahajbert finetune --task ner --checkpoint DIR
python -m examples.sahajbert export --checkpoint DIR --out DIR

Each role has its own options: ``python -m examples.sahajbert ROLE --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from examples.sahajbert.config import (
    COMPRESSIONS,
    DEFAULT_WORK_DIR,
    DemoConfig,
    FinetuneConfig,
    NetConfig,
    TrainerConfig,
)
from models.text.sources import DATA_HELP

ROLES = (
    "demo", "prepare", "trainer", "coordinator", "aux", "finetune", "export", "invite",
    "identity",
)  # fmt: skip


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


QUIET_LOGGERS = ("absl", "orbax", "jax._src.xla_bridge")  # WARNING and above unless -v
FROM_MANIFEST = " (default: from the run's manifest)"


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default once, at the end of its help (none for flags and unset ones)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default in (None, False, [], (), argparse.SUPPRESS) or "%(default)" in text:
            return text
        if text.endswith(FROM_MANIFEST):  # the run decides it, not this default
            return text
        if not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help="cache for corpus, tokenizer and compiled programs",
    )


def _add_net_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network")
    g.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MULTIADDR",
        help="addresses of peers already in the run, e.g. /ip4/1.2.3.4/tcp/5000/p2p/PEER_ID; "
        "the coordinator prints one",
    )
    g.add_argument(
        "--listen",
        nargs="*",
        default=list(NetConfig().listen),
        help="addresses to listen on: on every interface, a home router is asked for a port "
        "and hole punching is tried (/ip4/127.0.0.1/tcp/PORT: this machine only)",
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
    g.add_argument(
        "--robust-tau",
        type=float,
        help="average with CenteredClip at this L2 radius (bounds what one peer's scaled "
        "gradients can do); unset: CenteredClip at a radius derived from the parts in an "
        "open run, the plain weighted mean in a private one (--owner)",
    )


def _add_private_options(p: argparse.ArgumentParser, *, owner: bool) -> None:
    g = p.add_argument_group("private run")
    if owner:
        g.add_argument(
            "--owner-key",
            type=Path,
            help="run a private collaboration as its owner: the key file `invite` signs with "
            "(it is this peer's identity)",
        )
        return
    g.add_argument("--owner", metavar="PUBKEY", help="the private run's owner key (hex)")
    g.add_argument("--invitation", type=Path, help="this peer's invitation file (from `invite`)")


def _add_compression_options(g: Any, d: TrainerConfig, run: Callable[[str], str]) -> None:
    """``--compression`` and TopK's ``--topk-*`` (``run(help)``: the manifest fixes them)."""
    g.add_argument(
        "--compression",
        choices=(*COMPRESSIONS, "topk", "powersgd"),
        default=d.codec,
        help=run(
            "what averaged vectors travel in: a codec for every leaf, or adaptive (1-D and "
            "small leaves fp16, matrices blockwise int8); unset: fp16 (the tiny model: none), "
            "int8 with --mode diloco; topk (--mode diloco): sparse 2-bit pseudo-gradients "
            "with error feedback (SparseLoCo), all-gathered; powersgd (--mode dedloc): rank "
            "--powersgd-rank gradients in two phases, with error feedback"
        ),
    )
    g.add_argument(
        "--powersgd-rank",
        type=int,
        default=d.powersgd_rank,
        help=run("powersgd: the rank of the gradients' approximation (1 to 64)"),
    )
    g.add_argument(
        "--topk-density",
        type=float,
        default=d.topk_density,
        help=run("topk: the fraction of each chunk's values sent"),
    )
    g.add_argument(
        "--topk-bits",
        type=int,
        default=d.topk_bits,
        help=run("topk: bits per value sent, sign included (1 to 8)"),
    )
    g.add_argument(
        "--topk-error-feedback",
        type=float,
        default=d.topk_error_feedback,
        help=run("topk: the decay of the unsent remainder kept for the next outer step"),
    )


def _add_model_options(
    p: argparse.ArgumentParser, d: TrainerConfig, *, joins: bool = False
) -> None:
    """The run's model, data and optimizer options, with ``d``'s values as defaults. A role
    that ``joins`` a run takes the run's options from its manifest: --help says so."""
    o = d.optimizer

    def run(text: str) -> str:
        return text + FROM_MANIFEST if joins else text

    g = p.add_argument_group("run, model and data")
    g.add_argument("--run-id", default=d.run_id, help=run("name of the collaboration"))
    g.add_argument(
        "--config",
        choices=("tiny", "sahajbert"),
        default=d.model,
        help=run("model size only: sahajbert (ALBERT-large, 18M parameters) or tiny (for CPUs)"),
    )
    g.add_argument(
        "--target-batch-size",
        type=int,
        default=d.target_batch_size,
        help=run("samples the whole collaboration gathers per step"),
    )
    g.add_argument(
        "--per-device-batch-size",
        type=int,
        default=d.per_device_batch_size,
        help="micro-batch per local device",
    )
    g.add_argument(
        "--grad-accumulation",
        type=int,
        default=d.grad_accumulation,
        help="micro-batches whose gradients are summed locally per report",
    )
    g.add_argument("--seq-length", type=int, default=d.seq_length, help=run("tokens per example"))
    unset = "the paths of your local copies of the run's files" if joins else "unset: synthetic"
    g.add_argument("--data", default=d.data, help=run(f"{DATA_HELP}; {unset}"))
    g.add_argument(
        "--data-mix",
        default=d.data_mix,
        metavar="W1,W2,...",
        help=run("weights of the --data sources, one each (unset: equal, or sahajBERT's for 'hf')"),
    )
    g.add_argument(
        "--tokenizer",
        default=d.tokenizer,
        help=run(
            "a saved tokenizer directory " + ("(the run's)" if joins else "(unset: train one)")
        ),
    )
    g.add_argument("--bf16", action="store_true", help="compute in bfloat16 (accelerators)")
    g.add_argument(
        "--max-epochs", type=int, default=d.max_epochs, help="stop after this epoch (unset: never)"
    )
    g.add_argument(
        "--mode",
        choices=("dedloc", "diloco"),
        default=d.mode,
        help=run(
            "dedloc: average gradients every target batch; diloco: train locally, average "
            "the parameters' change every --inner-steps target batches (int8 on the wire)"
        ),
    )
    g.add_argument(
        "--inner-steps",
        type=int,
        default=d.inner_steps,
        help=run("diloco: target batches between outer steps (DiLoCo's H)"),
    )
    _add_compression_options(g, d, run)
    g = p.add_argument_group("optimizer (sahajBERT's LAMB recipe)")
    g.add_argument("--learning-rate", type=float, default=o.learning_rate, help=run("peak lr"))
    g.add_argument("--warmup-steps", type=int, default=o.warmup_steps, help=run("linear warmup"))
    g.add_argument(
        "--total-steps",
        type=int,
        default=o.total_steps,
        help=run(
            "linear decay to 0 (diloco: the outer rate's cosine decay to 0 at total-steps / "
            "inner-steps outer steps; the inner rate, the run's times micro-batch / target "
            "batch, stays at its peak after the warmup)"
        ),
    )


def _add_trainer_options(p: argparse.ArgumentParser) -> None:
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
    g.add_argument(
        "--events",
        type=Path,
        metavar="FILE",
        help="append one JSON line per phase, heartbeat and epoch (with a parameter digest) "
        "to FILE, for watchdogs such as `python -m bench.chaos --peer sahajbert`",
    )


def _add_coordinator_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("coordinator")
    g.add_argument(
        "--checkpoint-dir", type=Path, help="where to save checkpoints (unset: OUT/checkpoints)"
    )
    g.add_argument("--checkpoint-every", type=int, default=10, help="epochs between checkpoints")
    g.add_argument(
        "--out", type=Path, default=Path("sahajbert-run"), help="metrics and status directory"
    )
    g.add_argument("--dashboard-port", type=int, default=0, help="dashboard port (0: any)")
    g.add_argument("--addr-file", type=Path, help="write the coordinator's addresses here")
    g.add_argument(
        "--manifest",
        type=Path,
        metavar="RUN_DIR",
        help="publish the run `prepare` wrote there (unset: prepare it now, into OUT/run)",
    )


FINETUNE_FORMAT = """\
data (--data DIR): train.jsonl, validation.jsonl and test.jsonl, one JSON object a line:
  ner  {"tokens": ["রবীন্দ্রনাথ", "ঠাকুর", "কলকাতায়", ...], "ner_tags": ["B-PER", "I-PER", "B-LOC", ...]}
       tags O, B-PER, I-PER, B-ORG, I-ORG, B-LOC, I-LOC (names, or ids 0-6 in this order);
       one tag per word, scored on each word's first sub-token (WikiANN bn's layout)
  ncc  {"text": "...", "label": "sports"}
       labels kolkata, state, national, sports, entertainment, international (names, or ids
       0-5 in this order; IndicGLUE sna.bn's layout)
--data hf loads wikiann/bn or indic_glue/sna.bn with `datasets`; unset: a small synthetic set.
"""


def _add_finetune_options(p: argparse.ArgumentParser) -> None:
    f = FinetuneConfig()
    g = p.add_argument_group("finetune (sahajBERT's recipe)")
    g.add_argument(
        "--task", choices=("ner", "ncc"), required=True, help="WikiANN bn NER or IndicGLUE sna.bn"
    )
    g.add_argument(
        "--checkpoint", type=Path, required=True, help="a checkpoint directory (or their parent)"
    )
    g.add_argument(
        "--data",
        "--finetune-data",
        dest="finetune_data",
        default=None,
        help="directory with train/validation/test .jsonl (see below), or 'hf'; unset: a small "
        "synthetic set",
    )
    g.add_argument("--lr", type=float, default=f.learning_rate, help="learning rate")
    g.add_argument("--epochs", type=int, default=f.epochs, help="maximum epochs")
    g.add_argument("--batch-size", type=int, default=f.batch_size, help="batch size")
    g.add_argument("--patience", type=int, default=f.patience, help="early-stopping patience")
    g.add_argument("--ft-seq-length", type=int, default=f.seq_length, help="tokens per example")


USAGE = """\
python -m examples.sahajbert                       # local demo: coordinator + 3 trainers
python -m examples.sahajbert prepare --out RUN     # the organiser: tokenizer + run manifest
python -m examples.sahajbert coordinator --manifest RUN  # start it (prints the address to join)
python -m examples.sahajbert --initial-peers ADDR  # join it as a trainer (default role)
python -m examples.sahajbert aux --initial-peers ADDR
python -m examples.sahajbert finetune --task ner --checkpoint DIR
python -m examples.sahajbert export --checkpoint DIR --out DIR
python -m examples.sahajbert ROLE --help           # that role's options and defaults
"""


# What a trainer's command line carries that the coordinator and an aux peer, which compute
# no gradients, have no use for (nor --robust-tau the coordinator, which never averages):
# accepted (one argument list can start them all, as the demo does) but not listed, since
# --help listed them as if they did something. --client-mode is refused (CLIENT_MODE_REFUSED).
UNUSED_WITHOUT_GRADIENTS = ("per_device_batch_size", "grad_accumulation", "bf16", "client_mode")
COORDINATOR_UNUSED = (*UNUSED_WITHOUT_GRADIENTS, "robust_tau")
CLIENT_MODE_REFUSED = {
    "coordinator": "--client-mode accepts no connections, and every peer joins through the "
    "coordinator: start it without (--listen picks the address)",
    "aux": "--client-mode accepts no connections, and an aux peer reduces shares the others "
    "send it: start it without (--listen picks the address)",
}


def _unlist(p: argparse.ArgumentParser, dests: tuple[str, ...]) -> None:
    for action in p._actions:
        if action.dest in dests:
            action.help = argparse.SUPPRESS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.sahajbert",
        description="sahajBERT with dedloc-jax. Without a role: demo, or trainer when "
        "--initial-peers is given.",
        epilog=USAGE,
        formatter_class=_Help,
    )
    sub = p.add_subparsers(dest="role", metavar="ROLE", required=True)

    def role(name: str, text: str, **kw: object) -> argparse.ArgumentParser:
        r = sub.add_parser(name, help=text, description=text, formatter_class=_Help, **kw)
        return r

    demo = role("demo", "a whole collaboration on this machine (tiny model, 3 trainers)")
    _add_common(demo)
    demo.add_argument("--demo-epochs", type=int, default=DemoConfig().epochs, help="demo length")
    demo.add_argument(
        "--demo-trainers", type=int, default=DemoConfig().trainers, help="trainer processes"
    )
    demo.add_argument("--out", type=Path, help="logs and metrics (unset: WORK_DIR/demo)")
    _add_model_options(demo, TrainerConfig.demo())
    # The demo's length is --demo-epochs; a --max-epochs given here means the same (it was
    # silently replaced by --demo-epochs: `demo --max-epochs 5` ran 30 epochs).
    demo.set_defaults(max_epochs=None)
    next(a for a in demo._actions if a.dest == "max_epochs").help = "the same as --demo-epochs"
    prep = role(
        "prepare",
        "the organiser's, once: train the tokenizer and write the run manifest (model, "
        "tokenizer, data recipe, target batch, optimizer, codec) for `coordinator --manifest`",
    )
    _add_common(prep)
    _add_model_options(prep, TrainerConfig())
    prep.add_argument("--out", type=Path, required=True, help="the run directory to write")
    trainer = role(
        "trainer",
        "join a run and train (a volunteer's role): the run's model, tokenizer and data come "
        "from its manifest; pass only --initial-peers and this machine's options",
    )
    _add_common(trainer)
    _add_net_options(trainer)
    _add_private_options(trainer, owner=False)
    _add_model_options(trainer, TrainerConfig(), joins=True)
    _add_trainer_options(trainer)
    coord = role("coordinator", "the run's first peer: monitor, dashboard, checkpoints")
    _add_common(coord)
    _add_net_options(coord)
    _add_private_options(coord, owner=True)
    _add_model_options(coord, TrainerConfig())
    _add_coordinator_options(coord)
    _unlist(coord, COORDINATOR_UNUSED)
    saved = "exit 0 once the run's state of this epoch is saved (unset: run until stopped)"
    next(a for a in coord._actions if a.dest == "max_epochs").help = saved
    aux = role("aux", "an averaging helper without an accelerator")
    _add_common(aux)
    _add_net_options(aux)
    _add_private_options(aux, owner=False)
    _add_model_options(aux, TrainerConfig(), joins=True)
    _unlist(aux, UNUSED_WITHOUT_GRADIENTS)
    ft = role(
        "finetune", "NER (WikiANN bn) or news classification (sna.bn) of a checkpoint",
        epilog=FINETUNE_FORMAT,
    )  # fmt: skip
    _add_common(ft)
    _add_finetune_options(ft)
    export = role("export", "a checkpoint as a transformers AlbertForPreTraining directory")
    export.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    export.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory")
    export.add_argument("--out", type=Path, required=True, help="the directory to write")
    inv = role("invite", "the organiser's: sign a peer's invitation to a private run")
    inv.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    inv.add_argument(
        "--owner-key", type=Path, required=True, help="the owner's key file (created if missing)"
    )
    inv.add_argument("--peer", required=True, help="the invited peer's ID (it prints it)")
    inv.add_argument(
        "--expires",
        required=True,
        help="a duration (7d, 12h, 30m), an ISO date/time (UTC), or unix seconds",
    )
    inv.add_argument(
        "--role", dest="invite_role", choices=("node", "client", "aux"), help="unset: any role"
    )
    inv.add_argument(
        "--run-id", default=TrainerConfig().run_id, help="the run it admits to (or --manifest)"
    )
    inv.add_argument(
        "--manifest", type=Path, metavar="RUN_DIR", help="admit to the run `prepare` wrote there"
    )
    inv.add_argument("--out", type=Path, help="the file to write (unset: PEER_ID.invitation)")
    ident = role("identity", "print a key file's peer ID and public key (--owner for an owner key)")
    ident.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    ident.add_argument(
        "--key", type=Path, required=True, help="the key file (--identity, --owner-key)"
    )
    ident.add_argument("--create", action="store_true", help="create the key file if missing")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the default role put in when none is named: ``trainer`` when
    ``--initial-peers`` is given, else ``demo``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = [a for a in argv if a in ("-v", "--verbose")]
    rest = [a for a in argv if a not in ("-v", "--verbose")]
    if not rest or rest[0] not in (*ROLES, "-h", "--help"):
        joins = any(a.split("=")[0] == "--initial-peers" for a in rest)
        rest.insert(0, "trainer" if joins else "demo")
    return build_parser().parse_args([rest[0], *flags, *rest[1:]])


def explicit_flags(argv: list[str] | None = None) -> set[str]:
    """The long options written on the command line (``--flag`` or ``--flag=value``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def trainer_config(args: argparse.Namespace, base: TrainerConfig | None = None) -> TrainerConfig:
    """``TrainerConfig`` from a role's parsed options (their defaults are ``base``'s values:
    :class:`TrainerConfig`'s, the demo's for the demo)."""
    base = base or TrainerConfig()
    chosen = getattr(args, "compression", None)
    sparse = chosen in ("topk", "powersgd")  # dedloc_jax.TopK or PowerSGD, not a codec
    opt = base.optimizer.replace(
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        total_steps=args.total_steps,
    )
    return base.replace(
        run_id=args.run_id,
        model=args.config,
        target_batch_size=args.target_batch_size,
        per_device_batch_size=args.per_device_batch_size,
        grad_accumulation=args.grad_accumulation,
        seq_length=args.seq_length,
        data=args.data,
        data_mix=args.data_mix,
        tokenizer=args.tokenizer,
        max_epochs=args.max_epochs,
        optimizer=opt,
        work_dir=args.work_dir,
        bf16=args.bf16 or base.bf16,
        step_delay=getattr(args, "step_delay", base.step_delay),
        wait_for_trainers=getattr(args, "wait_for_trainers", base.wait_for_trainers),
        mode=args.mode,
        inner_steps=args.inner_steps,
        codec=None if sparse else getattr(args, "compression", base.codec),
        compression=chosen if sparse else None,
        powersgd_rank=getattr(args, "powersgd_rank", base.powersgd_rank),
        topk_density=getattr(args, "topk_density", base.topk_density),
        topk_bits=getattr(args, "topk_bits", base.topk_bits),
        topk_error_feedback=getattr(args, "topk_error_feedback", base.topk_error_feedback),
    )


def net_config(args: argparse.Namespace) -> NetConfig:
    """The network options, with the private run's checked (``PrivateRunError`` when this
    peer would be refused)."""
    from examples.sahajbert import private

    if getattr(args, "owner_key", None) is not None:
        access = private.owner_access(args.owner_key, args.identity)
    else:
        mode = "aux" if args.role == "aux" else "client" if args.client_mode else "node"
        access = private.peer_access(
            run_id=args.run_id,
            mode=mode,
            owner=getattr(args, "owner", None),
            invitation=getattr(args, "invitation", None),
            identity=args.identity,
        )
    return NetConfig(
        initial_peers=tuple(args.initial_peers),
        listen=tuple(args.listen),
        announce=tuple(args.announce),
        identity=access.identity,
        client_mode=args.client_mode,
        owner_public_key=access.owner_public_key,
        invitation=access.invitation,
        robust_tau=args.robust_tau,
    )


def invited_run_id(args: argparse.Namespace, explicit: set[str]) -> str:
    """A trainer's or aux peer's run id: ``--run-id`` when given, else the run its invitation
    admits to (a private run), else ``--run-id``'s default (``join_run`` then takes the run
    the initial peers serve)."""
    from examples.sahajbert.private import invitation_run_id

    if "--run-id" in explicit or not getattr(args, "invitation", None):
        return args.run_id
    return invitation_run_id(args.invitation) or args.run_id


def join_run(cfg: TrainerConfig, net: NetConfig, explicit: set[str]) -> tuple[TrainerConfig, tuple]:
    """``cfg`` with the run manifest's settings, fetched from the initial peers (ManifestError
    when there is none, it is not validly signed, or an explicit option contradicts it; a
    FileNotFoundError when the run's local data is not here)."""
    from examples.sahajbert import manifest, training
    from models.text.tokenizer import load_tokenizer

    # The run is the one the initial peers serve, unless --run-id (or an invitation) names it.
    named = "--run-id" in explicit or net.invitation is not None
    got, envelope, tok_dir = manifest.fetch(
        net.initial_peers,
        run_id=cfg.run_id if named else None,
        work_dir=cfg.work_dir,
        owner=net.owner_public_key,
        identity=net.identity,
        invitation=net.invitation,
    )
    manifest.check(got, cfg, explicit)
    cfg = manifest.apply(got, cfg, tok_dir)
    if len(load_tokenizer(tok_dir)) != got.vocab_size:
        raise manifest.ManifestError(f"the run's tokenizer does not have {got.vocab_size} pieces")
    try:
        training.sources(cfg)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e}: the run trains on local files; pass --data with the paths of your copies "
            f"(the run's: {got.data_flag()[0]}, mix {got.data_flag()[1]})"
        ) from None
    return cfg, (envelope, tok_dir / manifest.TOKENIZER_FILE)


def inv_owner_hex(owner_key: Path) -> str:
    from p2p.identity import Identity

    return Identity.load(owner_key).public_key.hex()


def _invite(args: argparse.Namespace, explicit: set[str]) -> int:
    from examples.sahajbert import manifest
    from examples.sahajbert.private import PrivateRunError, describe_key, write_invitation

    run_id = args.run_id
    try:
        if args.manifest is not None:
            prepared, _ = manifest.load(args.manifest)
            if "--run-id" in explicit and run_id != prepared.run_id:
                raise manifest.ManifestMismatch("--run-id", run_id, prepared.run_id)
            run_id = prepared.run_id
        path, inv = write_invitation(
            args.owner_key, run_id, args.peer, args.expires, args.invite_role, args.out
        )
    except (PrivateRunError, manifest.ManifestError) as e:
        print(f"invite: {e}", file=sys.stderr)
        if args.owner_key.exists():  # the key is still worth knowing
            with contextlib.suppress(PrivateRunError):
                print(describe_key(args.owner_key, create=False)[0], file=sys.stderr)
        return 2
    owner = inv_owner_hex(args.owner_key)
    print(f"wrote {path}: {args.peer} may join run {inv.run_id!r} until {inv.expiry:.0f}")
    print(f"owner public key: {owner}")
    print(f"peers join with: --owner {owner} --invitation {path.name} --identity KEYFILE")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    role = args.role
    if getattr(args, "announce", None) and args.client_mode:
        print(
            "--announce needs a peer that accepts connections (not --client-mode)", file=sys.stderr
        )
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not args.verbose:
        # ~25 INFO lines per orbax checkpoint and JAX's backend probing: not the user's news
        for noisy in QUIET_LOGGERS:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if role != "demo":
        logging.getLogger("examples").setLevel(logging.INFO)
        # `kill -USR1 <pid>` prints every thread's stack: what a stuck peer is waiting on.
        with contextlib.suppress(OSError, ValueError):  # stderr without a file (embedded)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    if role == "demo":
        from examples.sahajbert.demo import run_demo

        epochs = args.demo_epochs if args.max_epochs is None else args.max_epochs
        demo = DemoConfig(epochs=epochs, trainers=args.demo_trainers)
        demo = demo.replace(client_trainers=min(demo.client_trainers, demo.trainers - 1))
        out = args.out or args.work_dir / "demo"
        return run_demo(demo, trainer_config(args, TrainerConfig.demo(args.work_dir)), out)
    if role == "finetune":
        from examples.sahajbert.finetune import main_finetune

        return main_finetune(args)
    if role == "export":
        from examples.sahajbert.export import ExportError, export

        try:
            print(export(args.checkpoint, args.out))
        except ExportError as e:
            print(f"export: {e}", file=sys.stderr)
            return 1
        return 0
    if role == "identity":
        from examples.sahajbert.private import PrivateRunError, describe_key

        try:
            text, created = describe_key(args.key, create=args.create)
        except PrivateRunError as e:
            hint = "" if args.key.exists() else " (--create makes one)"
            print(f"identity: {e}{hint}", file=sys.stderr)
            return 2
        print(f"created {args.key}\n{text}" if created else text)
        return 0
    if role == "invite":
        return _invite(args, explicit_flags(argv))
    from examples.sahajbert.dashboard import DashboardError
    from p2p.errors import ListenError

    with _Signals() as signals:
        try:
            return _run_peer(args, argv)
        except KeyboardInterrupt:
            # the collaboration closed on the way out: port mappings removed, peers told
            print(f"{role}: stopped by {signals.name}; left the run", file=sys.stderr)
            return 128 + signals.number
        except (ListenError, DashboardError) as e:
            print(f"{role}: {e}", file=sys.stderr)
            return 2


class _Signals:
    """SIGINT and SIGTERM both stop a role the same way: a KeyboardInterrupt in the main
    thread, so the collaboration closes (port mappings removed, peers told) and main says so
    in one line. One that lands in a garbage-collection callback is swallowed by Python
    ("Exception ignored in: ..."; seen with JAX's): it is asked again at once, and again
    after ``insist`` s should it be lost some other way."""

    def __init__(self, insist: float = 10.0) -> None:
        self.name, self.number = "SIGINT", int(signal.SIGINT)
        self.insist = insist
        self.done = False
        self._asked = 0
        self._old: dict[int, Any] = {}
        self._old_hook = sys.unraisablehook

    def _stop(self, signum: int, frame: Any) -> None:
        if self._asked == 0:
            self.name, self.number = signal.Signals(signum).name, int(signum)
            threading.Thread(target=self._ask_again, name="stop", daemon=True).start()
        self._asked += 1
        raise KeyboardInterrupt

    def _unraisable(self, unraisable: Any) -> None:
        """A stop swallowed by Python (a gc callback was running): ask again at once, quietly."""
        if issubclass(unraisable.exc_type, KeyboardInterrupt) and self._asked:
            # from another thread: raised in here, it would be swallowed again
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        self._old_hook(unraisable)

    def _ask_again(self) -> None:
        for _ in range(3):
            time.sleep(self.insist)
            if self.done:
                return
            os.kill(os.getpid(), signal.SIGINT)

    def __enter__(self) -> _Signals:
        with contextlib.suppress(ValueError):  # not the main thread (embedded): left alone
            # (a shell starts background jobs with SIGINT ignored; `kill -INT` still stops)
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._stop)
            self._old_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc: object) -> None:
        self.done = True
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._old.get(signal.SIGINT) is not None:
            sys.unraisablehook = self._old_hook


# A short run of the tiny model on CPUs (the demo's recipe): the README's one-machine try.
TINY_RECIPE = (
    "--target-batch-size 96 --seq-length 64 --learning-rate 0.03 --warmup-steps 2 "
    "--total-steps 1000"
)


def _recipe(cfg: TrainerConfig, made: Any) -> list[str]:
    """What ``prepare`` wrote that decides how the run learns: the data, the target batch and
    the optimizer; with the tiny model, a note when that optimizer is sahajBERT's (5000
    warmup steps of 4096 samples: a try of a few dozen steps would not move the loss)."""
    from examples.sahajbert.config import OptimizerConfig

    o = made.optimizer
    data = cfg.data or "the synthetic Bengali corpus (no --data)"
    per = f"DiLoCo: an outer step every {made.inner_steps}" if made.mode == "diloco" else "a step"
    lines = [
        f"data: {data}; sequence {made.seq_length}, target batch {made.target_batch_size} "
        f"samples ({per})",
        f"optimizer: LAMB, lr {o['learning_rate']:g}, warmup {o['warmup_steps']} steps, linear "
        f"decay to 0 at step {o['total_steps']}",
    ]
    if cfg.model == "tiny" and cfg.optimizer == OptimizerConfig():
        lines.append(
            "note: that is sahajBERT's recipe, for thousands of steps; for a short run of the "
            f"tiny model on CPUs prepare with {TINY_RECIPE}"
        )
    return lines


def _run_peer(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The prepare, trainer, coordinator and aux roles."""
    from examples.sahajbert.private import PrivateRunError

    role = args.role

    cfg = trainer_config(args)
    if role == "prepare":
        from examples.sahajbert.coordinator import prepare

        try:
            made, _ = prepare(cfg, args.out)
        except (FileNotFoundError, ValueError) as e:
            print(f"prepare: {e}", file=sys.stderr)
            return 2
        print(
            f"wrote {args.out}: run {made.run_id!r}, manifest {made.digest[:16]}, "
            f"tokenizer sha256 {made.tokenizer_sha256[:16]} ({made.vocab_size} pieces)"
        )
        for line in _recipe(cfg, made):
            print(line)
        print(f"start it with: python -m examples.sahajbert coordinator --manifest {args.out}")
        return 0
    if role in CLIENT_MODE_REFUSED and args.client_mode:
        print(f"{role}: {CLIENT_MODE_REFUSED[role]}", file=sys.stderr)
        return 2
    explicit = explicit_flags(argv)
    if role in ("trainer", "aux"):
        args.run_id = invited_run_id(args, explicit)
        cfg = cfg.replace(run_id=args.run_id)
    try:
        net = net_config(args)
    except PrivateRunError as e:
        print(f"{role}: {e}", file=sys.stderr)
        return 2
    if role in ("trainer", "aux"):
        if not net.initial_peers:
            print(f"a {role} needs --initial-peers (start a coordinator first)", file=sys.stderr)
            return 2
        try:
            cfg, run_manifest = join_run(cfg, net, explicit)
        except (RuntimeError, FileNotFoundError, ValueError) as e:
            print(f"{role}: {e}", file=sys.stderr)
            return 2
    if role == "trainer":
        from examples.sahajbert.trainer import run_trainer

        result = run_trainer(
            cfg, net, final_params=args.save_final, run_manifest=run_manifest, events=args.events
        )
        if result.diverged is not None:
            print(
                f"trainer: the run diverged at epoch {result.diverged} (a loss or parameter "
                "that is not finite); stopped",
                file=sys.stderr,
            )
            return 3
        print(f"stopped at epoch {result.epoch} after {result.samples} samples")
        if result.saved is not None:
            print(f"the coordinator saved epoch {result.saved[0]} to {result.saved[1]}")
        return 0
    if role == "coordinator":
        from examples.sahajbert.coordinator import (
            CoordinatorOptions,
            FinalStateMissing,
            run_coordinator,
        )

        opts = CoordinatorOptions(
            out_dir=args.out,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            dashboard_port=args.dashboard_port,
            exit_after_epoch=cfg.max_epochs,
            addr_file=args.addr_file,
            manifest_dir=args.manifest,
        )
        if args.manifest is not None:
            from examples.sahajbert import manifest

            try:
                prepared, _ = manifest.load(args.manifest)
                manifest.check(prepared, cfg, explicit)
            except manifest.ManifestError as e:
                print(f"coordinator: {e}", file=sys.stderr)
                return 2
        try:
            run_coordinator(cfg, net, opts)
        except FinalStateMissing as e:
            print(f"coordinator: {e}", file=sys.stderr)
            return 1
        return 0
    from examples.sahajbert.auxiliary import run_aux

    return run_aux(cfg, net)


if __name__ == "__main__":
    sys.exit(main())
