"""Network faults between Kafka clients and brokers: a small TCP proxy with per-broker faults.

:class:`FaultProxy` listens on one port per target (a broker's client listener) and forwards
every connection to it. Each target's fault state can be changed at any time, from any thread:

* :meth:`FaultProxy.latency`: every chunk, in both directions, is held back by a delay (order kept);
* :meth:`FaultProxy.bandwidth`: a cap in bytes per second, per direction, shared by the target's
  connections;
* :meth:`FaultProxy.blackhole`: connections are accepted and read, nothing is forwarded or answered
  (open connections go silent too);
* :meth:`FaultProxy.reset`: every open connection is closed with a TCP RST, and new ones are reset
  as soon as they are accepted;
* :meth:`FaultProxy.heal`: back to a plain pass-through.

A black-holed connection has lost bytes mid-stream, so the Kafka protocol on it can never be
trusted again (a response may be missing, later ones would not match their requests): healing
closes those connections and the client reconnects, as it would after a real network partition.

The proxy runs its own asyncio event loop in a daemon thread. :class:`KafkaCluster` builds one
with ``proxied=True`` and exposes it as :attr:`KafkaCluster.network`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from outbox.testing.ports import free_port

__all__ = ["FaultProxy", "LinkFaults"]

_CHUNK = 16 * 1024
"""Bytes read at a time: small enough that a bandwidth cap paces traffic rather than bursts."""

_QUEUE = 64
"""Chunks in flight per direction; a full queue stops reading, so a slow link pushes back on its sender."""

_T = TypeVar("_T")


class _Mode(enum.Enum):
    PASS = "pass"
    BLACKHOLE = "blackhole"
    RESET = "reset"


@dataclass(frozen=True)
class LinkFaults:
    """The faults in force on one target (a snapshot; see :meth:`FaultProxy.faults`).

    Attributes:
        mode: ``"pass"``, ``"blackhole"`` or ``"reset"``.
        latency: Seconds added to every chunk in each direction.
        bandwidth: Cap in bytes per second per direction, or ``None``.
        connections: Connections currently open through the proxy.
    """

    mode: str
    latency: float
    bandwidth: int | None
    connections: int


class _Pacer:
    """Shared send schedule of one direction of one link: a byte may leave no sooner than its turn."""

    def __init__(self) -> None:
        self.next_free = 0.0

    def reserve(self, now: float, size: int, rate: int) -> float:
        start = max(now, self.next_free)
        self.next_free = start + size / rate
        return start - now


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with an RST: SO_LINGER 0 makes the kernel drop the socket instead of a FIN handshake."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Conn:
    link: _Link
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    # Lost bytes in a direction: the stream is unusable once healed, so heal() closes it.
    tainted: bool = False

    def abort(self, rst: bool) -> None:
        for w in (self.client, self.upstream):
            if w is not None:
                if rst:
                    _rst(w)
                else:
                    w.transport.abort()


@dataclass(eq=False)
class _Link:
    target_port: int
    listen_port: int
    server: asyncio.Server | None = None
    mode: _Mode = _Mode.PASS
    latency: float = 0.0
    bandwidth: int | None = None
    conns: set[_Conn] = field(default_factory=set)
    up: _Pacer = field(default_factory=_Pacer)
    down: _Pacer = field(default_factory=_Pacer)

    def resetting(self) -> bool:
        # A method, not an inline test: the mode may change at any await, which mypy's narrowing ignores.
        return self.mode is _Mode.RESET


class FaultProxy:
    """A TCP proxy on 127.0.0.1 with one listening port per target and per-target faults.

    Targets are numbered in the order :meth:`add` is called (a :class:`KafkaCluster` adds its
    brokers in index order, so target ``i`` is broker ``i``). Every method is thread-safe and
    returns once the change is in effect; new faults apply to open connections as well.

    Example::

        proxy = FaultProxy()
        i = proxy.add(9092)             # forward proxy.port(i) to 127.0.0.1:9092
        proxy.latency(i, 0.2)
        proxy.blackhole(i)
        proxy.heal(i)
        proxy.close()

    Args:
        host: Address the proxy listens on and connects to.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._links: list[_Link] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="outbox-fault-proxy", daemon=True)
        self._closed = False
        self._thread.start()

    # -- setup --------------------------------------------------------------

    def add(self, target_port: int, listen_port: int | None = None) -> int:
        """Start forwarding a new listening port to ``host:target_port``.

        The target need not be up: a connection to it while it is down is reset, as a client
        connecting to a stopped broker would be refused.

        Args:
            target_port: Port the connections are forwarded to.
            listen_port: Port to listen on; ``None`` picks a free one.

        Returns:
            The target's index for the fault methods.
        """
        return self._call(lambda: self._add(target_port, listen_port))

    def port(self, i: int) -> int:
        """The listening port of target ``i``."""
        return self._link(i).listen_port

    @property
    def ports(self) -> list[int]:
        """The listening port of every target, by index."""
        return [link.listen_port for link in self._links]

    def faults(self, i: int) -> LinkFaults:
        """The faults in force on target ``i`` and its open connections."""

        async def snapshot() -> LinkFaults:
            link = self._link(i)
            return LinkFaults(link.mode.value, link.latency, link.bandwidth, len(link.conns))

        return self._call(snapshot)

    # -- faults -------------------------------------------------------------

    def latency(self, i: int, seconds: float) -> None:
        """Delay every chunk to and from target ``i`` by ``seconds`` (``0`` removes the delay)."""
        if seconds < 0:
            raise ValueError("latency must be >= 0")

        async def apply() -> None:
            self._link(i).latency = float(seconds)

        self._call(apply)

    def bandwidth(self, i: int, bytes_per_second: int | None) -> None:
        """Cap the traffic of target ``i`` at ``bytes_per_second`` in each direction (``None``: no cap)."""
        if bytes_per_second is not None and bytes_per_second <= 0:
            raise ValueError("bandwidth must be > 0 bytes per second, or None")

        async def apply() -> None:
            self._link(i).bandwidth = bytes_per_second

        self._call(apply)

    def blackhole(self, i: int) -> None:
        """Make target ``i`` silent: connections are accepted and read, nothing passes either way."""

        async def apply() -> None:
            link = self._link(i)
            link.mode = _Mode.BLACKHOLE
            for conn in link.conns:
                conn.tainted = True

        self._call(apply)

    def reset(self, i: int) -> None:
        """Reset (TCP RST) every connection to target ``i``, and every new one until healed."""

        async def apply() -> None:
            link = self._link(i)
            link.mode = _Mode.RESET
            for conn in list(link.conns):
                conn.abort(rst=True)

        self._call(apply)

    def heal(self, i: int) -> None:
        """Remove every fault of target ``i``; connections that lost bytes to a black hole are closed."""
        self._call(lambda: self._heal(i))

    def heal_all(self) -> None:
        """:meth:`heal` every target."""
        for i in range(len(self._links)):
            self.heal(i)

    def close(self) -> None:
        """Stop listening, close every connection and stop the proxy's thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError, TimeoutError):  # the loop already stopped, or is stuck
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FaultProxy(ports={self.ports})"

    # -- event loop side ----------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, make: Callable[[], Awaitable[_T]]) -> _T:
        if self._closed:
            raise RuntimeError("the fault proxy is closed")
        if threading.current_thread() is self._thread:
            raise RuntimeError("FaultProxy methods block; do not call them from the proxy's own loop")

        async def run() -> _T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def _link(self, i: int) -> _Link:
        if not 0 <= i < len(self._links):
            raise IndexError(f"no proxied target {i} (have {len(self._links)})")
        return self._links[i]

    async def _add(self, target_port: int, listen_port: int | None) -> int:
        link = _Link(target_port, 0)
        server: asyncio.Server | None = None
        for _ in range(20):
            port = free_port() if listen_port is None else listen_port
            try:
                server = await asyncio.start_server(
                    lambda r, w: self._serve(link, r, w), self.host, port, reuse_address=True
                )
            except OSError:
                if listen_port is not None:
                    raise
                continue  # taken between the pick and the bind: pick again
            link.listen_port = port
            break
        if server is None:
            raise OSError("the fault proxy found no free port to listen on")
        link.server = server
        self._links.append(link)
        return len(self._links) - 1

    async def _heal(self, i: int) -> None:
        link = self._link(i)
        link.mode = _Mode.PASS
        link.latency = 0.0
        link.bandwidth = None
        for conn in list(link.conns):
            if conn.tainted:
                conn.abort(rst=False)

    async def _shutdown(self) -> None:
        for link in self._links:
            if link.server is not None:
                link.server.close()
            for conn in list(link.conns):
                conn.abort(rst=False)
        for link in self._links:
            if link.server is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(link.server.wait_closed(), 5)

    async def _serve(self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(link, writer)
        link.conns.add(conn)
        try:
            if link.mode is _Mode.RESET:
                _rst(writer)
                return
            if link.mode is _Mode.BLACKHOLE:
                # No upstream connection at all: the broker never hears of this client.
                conn.tainted = True
                while await reader.read(_CHUNK):
                    pass
                return
            try:
                up_reader, conn.upstream = await asyncio.open_connection(self.host, link.target_port)
            except OSError:
                _rst(writer)  # the broker is down: the client sees its connection refused/reset
                return
            if link.resetting():  # reset while connecting
                conn.abort(rst=True)
                return
            pumps = [
                asyncio.ensure_future(self._pump(conn, reader, conn.upstream, link.up)),
                asyncio.ensure_future(self._pump(conn, up_reader, writer, link.down)),
            ]
            # Kafka never half-closes: once either side ends, the connection is over.
            _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            link.conns.discard(conn)
            conn.abort(rst=False)

    async def _pump(self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter, pacer: _Pacer) -> None:
        """Copy ``src`` to ``dst`` under the link's faults; returns when ``src`` ends or fails."""
        link = conn.link
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(_QUEUE)

        async def read() -> None:
            try:
                while data := await src.read(_CHUNK):
                    if link.mode is _Mode.BLACKHOLE:
                        conn.tainted = True
                        continue
                    # The delay is fixed when a chunk arrives, so chunks keep their order and spacing.
                    await queue.put((loop.time() + link.latency, data))
            except OSError:
                pass
            await queue.put(None)

        async def write() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                if link.mode is _Mode.BLACKHOLE:
                    conn.tainted = True
                    continue
                if link.bandwidth is not None:
                    wait = pacer.reserve(loop.time(), len(data), link.bandwidth)
                    if wait > 0:
                        await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        reader = asyncio.ensure_future(read())
        try:
            await write()
        except OSError:
            pass
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
