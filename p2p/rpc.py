"""RPC over multiplexed streams: protocol headers, unary calls, message streams.

Wire conventions on each new stream (all messages length-prefixed msgpack, see
:mod:`p2p.messages`):

* the opener sends a header ``["u" | "s", protocol_name]`` (unary or streaming);
* unary: then the request, then EOF; the server answers with one message, the response or
  an error (msgpack ext type ``EXT_ERROR`` with utf-8 text), then EOF;
* streaming: the server first answers ``EXT_ACCEPT`` (or ``EXT_ERROR``, e.g. unknown
  protocol), then both sides exchange messages freely until each sends EOF.

Cancelling a call resets its stream; the mux cancels the remote handler's scope on reset.
The server side lives here (:func:`serve_stream`); the client side is the node's
(:meth:`~p2p.node.Node.call`, :meth:`~p2p.node.Node.open_stream`: a call goes down from the node
to the stream without stepping back up); :class:`~p2p.mux_stream.MessageStream` (messages over
one stream) lives with the stream it frames.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import trio

from p2p.errors import ConnectionClosed, P2PError, ProtocolError
from p2p.identity import PeerID
from p2p.messages import EXT_ACCEPT, EXT_ERROR, encode_parts
from p2p.multiaddr import Multiaddr
from p2p.mux import MuxStream
from p2p.mux_stream import MessageStream

if TYPE_CHECKING:
    from p2p.node import Node

logger = logging.getLogger(__name__)

UNARY = "u"
STREAMING = "s"
MAX_PROTOCOL_NAME = 128
MAX_ERROR_TEXT = 1024


@dataclass(frozen=True)
class CallContext:
    """Who is calling a handler: the proven peer ID and the address it was observed at."""

    remote_peer: PeerID
    remote_addr: Multiaddr | None
    node: Node
    protocol: str = ""


def error_message(text: str) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_ERROR, text.encode("utf-8", "replace")[:MAX_ERROR_TEXT])


UnaryHandler = Callable[[CallContext, Any], Awaitable[Any]]
StreamHandler = Callable[[CallContext, MessageStream], Awaitable[None]]


@dataclass
class Registry:
    """Protocol name -> (kind, handler)."""

    handlers: dict[str, tuple[str, Callable[..., Awaitable[Any]]]] = field(default_factory=dict)

    def add(self, name: str, kind: str, handler: Callable[..., Awaitable[Any]]) -> None:
        if not isinstance(name, str) or not name or len(name) > MAX_PROTOCOL_NAME:
            raise ValueError(f"protocol names are 1..{MAX_PROTOCOL_NAME} characters: {name!r}")
        self.handlers[name] = (kind, handler)


# ---- server side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeLimits:
    max_message_size: int
    header_timeout: float
    request_timeout: float


async def serve_stream(
    stream: MuxStream,
    registry: Registry,
    make_context: Callable[[str], CallContext],
    limits: ServeLimits,
) -> None:
    """Serve one inbound stream. Never raises for the peer's or the handler's faults."""
    ms = MessageStream(stream, limits.max_message_size)
    request: Any = None
    try:
        # one deadline covers the header and, for unary calls, the request (slow peers)
        with trio.move_on_after(limits.header_timeout) as scope:
            header = await ms.receive_raw()
            kind, name = _parse_header(header)
            stream.protocol = name
            entry = registry.handlers.get(name)
            if entry is None or entry[0] != kind:
                what = "unknown protocol" if entry is None else "wrong call kind for protocol"
                reply = error_message(f"{what} {name!r:.130}")
                await stream.send_parts(encode_parts(reply, limits.max_message_size), eof=True)
                return
            if kind == UNARY:
                scope.deadline += limits.request_timeout
                request = await ms.receive_raw()
        if scope.cancelled_caught:
            logger.info("stream %s: no complete request in time", stream.stream_id)
            stream.reset("request not received in time")
            return
        ctx = make_context(name)
        if kind == UNARY:
            await _serve_unary(ms, entry[1], ctx, request)
        else:
            await _serve_streaming(ms, entry[1], ctx)
    except (ConnectionClosed, trio.ClosedResourceError):
        stream.reset("closed")
    except ProtocolError as e:
        logger.info("bad stream from peer: %s", e)
        stream.reset(f"protocol error: {e}")


def _parse_header(header: Any) -> tuple[str, str]:
    if (
        not isinstance(header, list)
        or len(header) != 2
        or header[0] not in (UNARY, STREAMING)
        or not isinstance(header[1], str)
    ):
        raise ProtocolError(f"malformed stream header {header!r:.100}")
    return header[0], header[1]


async def _serve_unary(
    ms: MessageStream, handler: UnaryHandler, ctx: CallContext, request: Any
) -> None:
    ok, result = await _run_handler(ctx, handler, request)
    if ok:
        try:
            parts = encode_parts(result, ms.max_message_size)
        except ProtocolError as e:
            ok, result = False, error_message(f"bad response from {ctx.protocol}: {e}")
    if not ok:
        parts = encode_parts(result, ms.max_message_size)
    await ms.stream.send_parts(parts, eof=True)


async def _serve_streaming(ms: MessageStream, handler: StreamHandler, ctx: CallContext) -> None:
    await ms.send_raw(msgpack.ExtType(EXT_ACCEPT, b""))
    ok, result = await _run_handler(ctx, handler, ms)
    if not ok:
        try:
            await ms.send_raw(result)
        except (ConnectionClosed, trio.ClosedResourceError):
            return
    await ms.aclose()


async def _run_handler(
    ctx: CallContext, handler: Callable[..., Awaitable[Any]], arg: Any
) -> tuple[bool, Any]:
    """(True, result) or (False, error message): a handler's fault never escapes."""
    try:
        return True, await handler(ctx, arg)
    except (P2PError, ValueError) as e:
        # RPCError/ValueError/ProtocolError are the handler's way to answer with an error; other
        # P2P errors come from calls the handler made to other peers.
        logger.debug("handler %s raised %r", ctx.protocol, e)
        return False, error_message(str(e) or type(e).__name__)
    except Exception:  # noqa: BLE001 - the node must outlive a buggy handler; logged in full
        logger.exception("handler %s crashed serving %s", ctx.protocol, ctx.remote_peer)
        return False, error_message(f"internal error in handler {ctx.protocol}")
