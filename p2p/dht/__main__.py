"""The standalone DHT command: run a DHT node, or store/get one value, without JAX.

    python -m p2p.dht serve [--listen MADDR ...] [--announce MADDR ...] [--initial-peers MADDR ...]
                            [--force-reachability public|private] [--identity FILE]
                            [--client-mode] [--no-nat]
    python -m p2p.dht store KEY VALUE --ttl SECONDS [--subkey S | --owned] --initial-peers MADDR ...
    python -m p2p.dht get KEY --initial-peers MADDR ...

``serve`` runs a full node (DHT, identify, AutoNAT dial-back, relay service, relayed dialing)
and prints each address others can dial (``/ip4/.../tcp/PORT/p2p/PEERID``, relayed ones when
private; never ``0.0.0.0``), one per line, then serves until SIGINT/SIGTERM.

``store`` parses VALUE as strict JSON (``--string`` stores it as text instead; malformed JSON
exits 2) and prints on how many nodes it was stored.
``get`` prints the value as strict JSON (a dictionary value as an object of subkeys).
Exit codes of ``store`` and ``get``: 0 done; 1 the DHT answered no (``get``: nodes answered
and none holds a live value; ``store``: refused, or a newer value held); 2 a usage error;
3 no node answered (none of the initial peers; for ``store`` also none of the nodes it
stored to), so nothing is known about the key.

Values JSON cannot hold travel as one-key objects, both ways: bytes as
``{"$bytes": "<base64>"}``, non-finite floats as ``{"$float": "nan" | "inf" | "-inf"}``; a map
key that starts with ``$`` gets one more ``$`` in front, so no value is mistaken for another.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import math
import signal
import sys
from contextlib import AsyncExitStack
from typing import Any

import trio

from p2p.dht.config import PRESETS
from p2p.dht.errors import BootstrapError, InvalidRecordError
from p2p.dht.node import open_dht
from p2p.dht.records import ValueWithExpiration, owner_marker, pack_value
from p2p.errors import P2PError
from p2p.identity import Identity
from p2p.nat import NATConfig, nat_validators, open_nat
from p2p.node import open_node

DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"
# A script must tell "the key is absent" from "the DHT could not be asked": distinct codes.
EXIT_NO = 1  # get: not found; store: refused or outdated
EXIT_UNREACHABLE = 3  # no node answered: nothing is known about the key
EXIT_CODES = (
    "exit codes: 0 done; 1 get: not found (nodes answered, none holds a live value), store: "
    "refused or a newer value held; 2 usage error; 3 no node answered (unreachable)"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m p2p.dht", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, peers_required: bool) -> None:
        sp.add_argument(
            "--initial-peers",
            nargs="+",
            default=[],
            required=peers_required,
            metavar="MADDR",
            help="full addresses of running nodes (/ip4/IP/tcp/PORT/p2p/PEER_ID: the lines "
            "`serve` prints)",
        )
        sp.add_argument("--identity", metavar="FILE", help="key file (created if missing)")
        sp.add_argument(
            "--config",
            choices=sorted(PRESETS),
            default="default",
            help="timeouts and bucket sizes: default (the Internet), fast (loopback, tests), "
            "small (a few dozen nodes)",
        )
        sp.add_argument(
            "-v", "--verbose", action="count", default=0, help="-v: INFO logs, -vv: DEBUG"
        )

    serve = sub.add_parser("serve", help="run a DHT node until SIGINT/SIGTERM")
    serve.add_argument(
        "--listen",
        nargs="+",
        default=None,
        metavar="MADDR",
        help=f"addresses to listen on (unset: {DEFAULT_LISTEN}, this machine only; "
        "/ip4/0.0.0.0/tcp/PORT: every interface)",
    )
    serve.add_argument(
        "--announce",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="addresses that reach this node from outside (a forwarded port, a 1:1 NAT); "
        "they replace the listen addresses in what the node advertises",
    )
    serve.add_argument(
        "--force-reachability",
        choices=["public", "private"],
        default=None,
        help="skip dial-back detection: public serves directly (and relays for others), "
        "private takes relay reservations and advertises relayed addresses",
    )
    serve.add_argument("--no-nat", action="store_true", help="no identify/dial-back/relay")
    serve.add_argument(
        "--no-port-mapping",
        action="store_true",
        help="do not ask the home router (NAT-PMP, UPnP) to forward a port (also off with "
        "--announce or --force-reachability)",
    )
    serve.add_argument("--client-mode", action="store_true", help="query only, accept nothing")
    common(serve, False)

    store = sub.add_parser("store", help="store one value and exit", epilog=EXIT_CODES)
    store.add_argument("key", help="the key to store VALUE under")
    store.add_argument("value", help='strict JSON (bytes as {"$bytes": BASE64})')
    store.add_argument("--string", action="store_true", help="store VALUE as text, not JSON")
    store.add_argument(
        "--ttl", type=float, required=True, metavar="SECONDS", help="how long the value lives"
    )
    group = store.add_mutually_exclusive_group()
    group.add_argument("--subkey", help="store VALUE as this subkey's entry of KEY's dictionary")
    group.add_argument("--owned", action="store_true", help="subkey = this identity's owner marker")
    common(store, True)

    get = sub.add_parser(
        "get",
        help="print a value as JSON and exit (1 if not found, 3 if no node answered)",
        epilog=EXIT_CODES,
    )
    get.add_argument("key", help="the key to look up")
    common(get, True)
    return p


_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class BadValue(ValueError):
    """VALUE on the command line is not what ``store`` accepts (exit 2)."""


def _escape_key(key: str) -> str:
    return "$" + key if key.startswith("$") else key


def _to_json(value: Any) -> Any:
    """A msgpack value as strict JSON (see the module docstring for the encoding)."""
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"}
    if isinstance(value, dict):
        return {
            _escape_key(k) if isinstance(k, str) else json.dumps(_to_json(k)): _to_json(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    """The inverse of :func:`_to_json` on parsed JSON."""
    if isinstance(value, dict):
        if len(value) == 1 and "$bytes" in value:
            try:
                return base64.b64decode(value["$bytes"], validate=True)
            except (TypeError, ValueError):
                raise BadValue('{"$bytes": ...} needs a base64 string') from None
        if len(value) == 1 and "$float" in value:
            if value["$float"] not in _NON_FINITE:
                raise BadValue('{"$float": ...} is one of "nan", "inf", "-inf"')
            return _NON_FINITE[value["$float"]]
        out = {}
        for k, v in value.items():
            if k.startswith("$"):
                if not k.startswith("$$"):
                    raise BadValue(f"map key {k[:40]!r}: write a leading $ as $$")
                k = k[1:]
            out[k] = _from_json(v)
        return out
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _reject_constant(name: str) -> Any:
    raise BadValue(f'{name} is not JSON (write {{"$float": "nan" | "inf" | "-inf"}})')


def _parse_value(text: str, as_string: bool = False) -> Any:
    """VALUE as given: strict JSON, or the text itself with ``--string``."""
    if as_string:
        return text
    try:
        return _from_json(json.loads(text, parse_constant=_reject_constant))
    except json.JSONDecodeError as e:
        raise BadValue(
            f"VALUE is not valid JSON ({e}); quote a string as '\"text\"' or pass --string"
        ) from None


def _identity(args: argparse.Namespace) -> Identity:
    return Identity.load_or_create(args.identity) if args.identity else Identity.generate()


def printable_addrs(addrs: list[Any]) -> list[str]:
    """What ``serve`` prints: addresses others can dial (never a wildcard host)."""
    out = []
    for addr in addrs:
        host = addr.value_of("ip4") or addr.value_of("ip6")
        if host in ("0.0.0.0", "::"):
            continue
        out.append(str(addr))
    return out


async def _serve(args: argparse.Namespace) -> int:
    """A full node: the DHT plus (unless --no-nat) identify, AutoNAT dial-back, the relay
    service and relayed dialing, all from :mod:`p2p.nat`, so that peers bootstrapping
    through it learn their reachability and NATed ones can take reservations on it."""
    listen = args.listen
    if listen is None:
        listen = [] if args.client_mode else [DEFAULT_LISTEN]
    nat_config = NATConfig(
        force_reachability=args.force_reachability,
        force_client_mode=True if args.client_mode else None,
    )
    if args.no_port_mapping or args.announce:
        nat_config = nat_config.replace(port_mapping=None)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with AsyncExitStack() as stack:
            node = await stack.enter_async_context(
                open_node(_identity(args), listen=listen, announce=args.announce)
            )
            nat = None
            if not args.no_nat:
                nat = await stack.enter_async_context(
                    open_nat(node, peers=args.initial_peers, config=nat_config)
                )
            dht = await stack.enter_async_context(
                open_dht(
                    node,
                    initial_peers=args.initial_peers,
                    config=PRESETS[args.config](),
                    client_mode=args.client_mode or (nat is not None and nat.dht_client_mode),
                    validators=nat_validators(),
                )
            )
            if nat is not None:
                nat.use_dht(dht)
                logging.getLogger(__name__).info(
                    "reachability %s, role %s", nat.reachability.value, nat.role.value
                )
            for addr in printable_addrs(node.addrs):
                print(addr, flush=True)
            async for _ in signals:
                break
    return 0


async def _store(args: argparse.Namespace) -> int:
    value = _parse_value(args.value, args.string)  # before any network: a typo costs nothing
    identity = _identity(args)
    subkey = owner_marker(identity.peer_id) if args.owned else args.subkey
    async with (
        open_node(identity, listen=[]) as node,
        open_dht(
            node,
            initial_peers=args.initial_peers,
            config=PRESETS[args.config](),
            client_mode=True,
        ) as dht,
    ):
        result = await dht.store(args.key, value, dht.now() + args.ttl, subkey=subkey)
    if not result.ok and not result.outdated and not result.refused:
        print(
            f"unreachable: none of the {result.failed} nodes asked answered; not stored",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    if not result.ok:
        refused = ""
        if result.refused:
            reasons = sorted(set(result.refused.values()))
            refused = f", {len(result.refused)} refused it: " + "; ".join(reasons)
        print(
            f"not stored: {result.outdated} nodes hold a newer value, "
            f"{result.failed} did not answer{refused}",
            file=sys.stderr,
        )
        return EXIT_NO
    print(f"stored on {result.stored} nodes", flush=True)
    return 0


async def _get(args: argparse.Namespace) -> int:
    async with (
        open_node(_identity(args), listen=[]) as node,
        open_dht(
            node,
            initial_peers=args.initial_peers,
            config=PRESETS[args.config](),
            client_mode=True,
        ) as dht,
    ):
        found = await dht.get(args.key)
    if found is None:
        print(f"not found: {args.key} (the nodes asked hold no live value)", file=sys.stderr)
        return EXIT_NO
    if isinstance(found, ValueWithExpiration):
        out = _to_json(found.value)
    else:
        out = {sub: _to_json(v.value) for sub, v in found.items()}
    print(json.dumps(out, ensure_ascii=False, allow_nan=False), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "store":
        try:
            pack_value(_parse_value(args.value, args.string))
        except (BadValue, TypeError) as e:  # TypeError: msgpack cannot hold it (huge ints)
            parser.error(str(e))  # exit 2, before any network
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else 10
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = {"serve": _serve, "store": _store, "get": _get}[args.command]
    try:
        return trio.run(command, args)
    except KeyboardInterrupt:
        return 130
    except (P2PError, BaseExceptionGroup) as e:
        err = _leaf(e)
        if isinstance(err, InvalidRecordError):
            print(f"refused: {err.reason}", file=sys.stderr)
            return EXIT_NO
        if isinstance(err, BootstrapError):
            print(f"unreachable: {err}; nothing was asked", file=sys.stderr)
            return EXIT_UNREACHABLE
        if isinstance(err, P2PError):  # DialError, ...
            print(f"error: {err}", file=sys.stderr)
            return EXIT_UNREACHABLE
        raise


def _leaf(exc: BaseException) -> BaseException:
    """The one error inside nested single-exception groups (nurseries wrap what they raise)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


if __name__ == "__main__":
    sys.exit(main())
