"""The listening socket of every HTTP server of ours (router, pd-proxy, worker): connections accepted in
batches, however long the event loop's iterations get.

uvicorn serves on uvloop when it is installed, and uvloop's libuv accepts ONE connection per event-loop
iteration. Under a flood an iteration of the router runs thousands of callbacks (relayed chunks, hops, the
door's refusals) and takes 20-50 ms, so the router accepted 20-80 connections a second while 770 a second came:
its accept queue filled to the backlog within seconds, the kernel dropped SYNs, and clients waited for their
SYN retries (1, 3, 7 s) - seconds of TTFT no server metric saw, with the router's loop idle half the time. Here
a reader on the listening socket accepts up to ACCEPT_BATCH connections each time it is ready (what asyncio's
own loop does) and hands each to the loop as an accepted socket, TLS included; everything after that is
uvicorn's as before.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

logger = logging.getLogger(__name__)

ACCEPT_BATCH = 128  # connections accepted per readiness of the listening socket: at most this many per iteration
ACCEPT_RETRY_S = 1.0  # out of file descriptors or memory: accepting pauses this long (as asyncio's loop does)
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Acceptor:
    """One listening socket, accepted from in batches. Quacks like the server uvicorn keeps (close, wait_closed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol_factory: Callable[[], Any],
                 ssl: Any = None):
        self.loop, self.sock, self.protocol_factory, self.ssl = loop, sock, protocol_factory, ssl
        self.sockets = [sock]
        self._connecting: set[asyncio.Task] = set()
        self._closed = False
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client gave up while queued
                continue
            except OSError as e:
                if e.errno not in _OUT_OF_RESOURCES:
                    raise
                logger.warning("cannot accept a connection on %s (%s): accepting again in %.0f s",
                               self.sock.getsockname(), e, ACCEPT_RETRY_S)
                self.loop.remove_reader(self.sock.fileno())
                self.loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            conn.setblocking(False)
            task = self.loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    def _resume(self) -> None:
        if not self._closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    async def _connect(self, conn: socket.socket) -> None:
        # The transport owns the socket from here on, and closes it on failure too (uvloop's closes the
        # descriptor later, in libuv: closing it here as well could close a newer connection's).
        try:
            await self.loop.connect_accepted_socket(self.protocol_factory, conn, ssl=self.ssl)
        except (OSError, asyncio.CancelledError) as e:  # reset before it started, a failed TLS handshake
            logger.debug("an accepted connection ended before it started: %r", e)

    def close(self) -> None:
        """Stop accepting; connections already serving go on (one still in its TLS handshake is dropped: the
        handshake may take up to its 60 s timeout, and the listener is closing)."""
        if self._closed:
            return
        self._closed = True
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for task in self._connecting:
            task.cancel()

    async def wait_closed(self) -> None:
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)


def listening_sockets(host: str | None, port: int, backlog: int) -> list[socket.socket]:
    """Bound, listening sockets for host:port - every address the host resolves to, as asyncio's create_server
    binds them (SO_REUSEADDR; an IPv6 socket is IPv6 only). OSError when one cannot be bound."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, type_, proto, _name, address in dict.fromkeys(infos):
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise OSError(e.errno, f"cannot listen on {address[0]}:{address[1]}: {e.strerror}") from None
            sock.listen(backlog)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class BatchAcceptServer(uvicorn.Server):
    """uvicorn's server, listening through Acceptors on a host and port (a Unix socket, a passed file descriptor
    or passed sockets go uvicorn's own way)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        if sockets is not None or config.uds is not None or config.fd is not None:
            return await super().startup(sockets)
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        try:
            listeners = listening_sockets(config.host, config.port, config.backlog)
        except OSError as e:
            logger.error("%s", e)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        loop = asyncio.get_running_loop()

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=self.server_state,  # type: ignore[call-arg]
                                              app_state=self.lifespan.state)

        self.servers = [Acceptor(loop, sock, create_protocol, config.ssl) for sock in listeners]  # type: ignore
        self._log_started_message(listeners)
        self.started = True
