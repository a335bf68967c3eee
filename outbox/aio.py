"""AsyncResilientProducer: ResilientProducer for asyncio applications.

    async with AsyncResilientProducer({"bootstrap.servers": "..."}, outbox="sqlite:///o.db") as p:
        msg_id = await p.produce("orders", b"...", key=b"42")

Built on ResilientProducer's public API. Nothing that can block runs on the event loop:

* ``produce()`` hands its arguments to one *submit thread* through a ``queue.SimpleQueue``
  and awaits a future. The thread calls ``ResilientProducer.produce()`` (which may wait for
  the outbox writer's backpressure, a lock or a commit) and resolves the futures of everything
  it handled in one ``loop.call_soon_threadsafe`` per round, so a burst costs one wake-up of
  the loop, not one per message. One thread, first in first out: calls made on the loop in a
  given order reach the producer in that order, which keeps per-key order.
* write-ahead mode with ``durability="sync"`` waits for a commit per message; those calls run
  in a thread pool instead, so that many of them share one group commit.
* ``flush()``, ``close()`` and ``stats()`` (a store query) run in the loop's default executor.

Why not confluent-kafka's own ``AIOProducer``: it raises on headers, and the outbox needs the
``outbox-id`` header on every first send.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka import KafkaError, Message

from .errors import ProducerClosedError
from .producer import DeliveryCallback, ResilientProducer

log = logging.getLogger(__name__)

AsyncDeliveryCallback = Callable[[KafkaError | None, Message | None], None]

# Futures resolved per round of the submit thread: bounds how long the first caller of a
# burst waits for the last one's produce() (each ~5-10 µs on the fast path).
_ROUND = 256
_STOP = object()
_Result = tuple["asyncio.Future[str]", str | None, BaseException | None]
_BARRIER = object()


class AsyncResilientProducer:
    """An asyncio front for :class:`~outbox.ResilientProducer` with the same guarantees.

    Args:
        config: confluent_kafka settings, as for ResilientProducer. Omit it when passing
            ``producer=``.
        producer: an existing ResilientProducer to wrap instead of building one. It is closed
            by :meth:`close`.
        sync_workers: threads for write-ahead ``durability="sync"`` calls (each waits for a
            commit; concurrent calls share one).
        **options: ResilientProducer's keyword arguments (outbox, retry, mode, durability, ...).

    Building the producer opens the outbox (a file or a connection pool): do it at start-up,
    or with ``await AsyncResilientProducer.create(...)``, which builds it in a thread.
    """

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        *,
        producer: ResilientProducer | None = None,
        sync_workers: int = 16,
        **options: Any,
    ) -> None:
        if (config is None) == (producer is None):
            raise TypeError("pass either config (and ResilientProducer options) or producer=, not both or neither")
        if producer is not None and options:
            raise TypeError(f"options {sorted(options)} apply only when building a producer from config")
        if producer is None:
            assert config is not None
            producer = ResilientProducer(config, **options)
        self.producer: ResilientProducer = producer
        self._sync = self.producer.mode == "write-ahead" and self.producer.durability == "sync"
        self._pool = ThreadPoolExecutor(sync_workers, thread_name_prefix="outbox-aio-sync") if self._sync else None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._submit_loop, name="outbox-aio-submit", daemon=True)
        self._thread.start()

    @classmethod
    async def create(
        cls, config: Mapping[str, Any], *, sync_workers: int = 16, **options: Any
    ) -> AsyncResilientProducer:
        """Build the producer (which opens the outbox) in a thread, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, functools.partial(cls, config, sync_workers=sync_workers, **options)
        )

    # -- the public API ----------------------------------------------------------------------

    async def produce(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        headers: Sequence[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None] | None = None,
        partition: int | None = None,
        on_delivery: AsyncDeliveryCallback | None = None,
        enable_retry: bool = True,
        *,
        transaction: Any = None,
    ) -> str:
        """Send a message, or store it in the outbox if Kafka cannot take it now.

        Same arguments, errors and return value as :meth:`ResilientProducer.produce` (value and
        key are any object when the producer has serializers). Returns
        once the message is in librdkafka's queue or handed to the outbox writer (fallback, and
        write-ahead "batch"), or committed (write-ahead "sync").

        ``on_delivery(err, msg)`` runs on this event loop (not on a producer thread), so it may
        touch asyncio objects. Cancelling the await does not withdraw the message: once
        ``produce()`` is called the message is sent or stored.

        Returns:
            The message id (the ``outbox-id`` header value).
        """
        if self._closed:
            raise ProducerClosedError("produce() called after close()")
        loop = asyncio.get_running_loop()
        cb: DeliveryCallback | None = None
        if on_delivery is not None:
            cb = functools.partial(_on_loop, loop, on_delivery)
        args = (topic, value, key, headers, partition, cb, enable_retry)
        if self._pool is not None:
            call = functools.partial(self.producer.produce, *args, transaction=transaction)
            return await loop.run_in_executor(self._pool, call)
        fut: asyncio.Future[str] = loop.create_future()
        self._queue.put((fut, args, transaction))
        return await fut

    async def flush(self, timeout: float | None = None) -> int:
        """Wait until every message produced so far is delivered or safely in the outbox.

        Returns:
            How many messages are neither delivered nor committed to the outbox (0 on success).
        """
        await self._barrier()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.producer.flush, timeout)

    async def stats(self) -> dict[str, Any]:
        """ResilientProducer.stats(), read in a thread (it queries the outbox)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.producer.stats)

    async def close(self, timeout: float | None = None) -> int:
        """Hand over every pending produce(), then close the producer (flush, stop its threads).

        Returns:
            How many messages are neither delivered nor in the outbox (0 on a clean close).
        """
        if self._closed:
            return 0
        await self._barrier()
        self._closed = True
        self._queue.put(_STOP)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join)
        if self._pool is not None:
            await loop.run_in_executor(None, self._pool.shutdown)
        return await loop.run_in_executor(None, self.producer.close, timeout)

    async def __aenter__(self) -> AsyncResilientProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the submit thread -------------------------------------------------------------------

    async def _barrier(self) -> None:
        """Return once every produce() queued before this call has reached the producer."""
        if self._closed:
            return
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue.put((fut, _BARRIER, None))
        await fut

    def _submit_loop(self) -> None:
        get, get_nowait = self._queue.get, self._queue.get_nowait
        while True:
            items = [get()]
            try:
                while len(items) < _ROUND:
                    items.append(get_nowait())
            except queue.Empty:
                pass
            try:
                stop = self._submit_round(items)
            except Exception:  # a bug here must not leave callers awaiting forever
                log.exception("outbox: async submit thread failed; failing this round's produce() calls")
                error = ProducerClosedError("internal error in the submit thread (logged)")
                failed: list[_Result] = [(it[0], None, error) for it in items if it is not _STOP]
                self._resolve(failed)
                stop = any(it is _STOP for it in items)
            if stop:
                return

    def _submit_round(self, items: list[Any]) -> bool:
        """Hand one round of calls to the producer; True if the round held the stop marker."""
        produce = self.producer.produce
        done: list[_Result] = []
        stop = False
        for item in items:
            if item is _STOP:
                stop = True
                continue
            fut, args, transaction = item
            if args is _BARRIER:
                done.append((fut, "", None))
                continue
            try:
                done.append((fut, produce(*args, transaction=transaction), None))
            except BaseException as exc:  # noqa: BLE001 - every error belongs to its caller
                done.append((fut, None, exc))
        self._resolve(done)
        return stop

    @staticmethod
    def _resolve(done: list[_Result]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Result]] = {}
        for entry in done:
            by_loop.setdefault(entry[0].get_loop(), []).append(entry)
        for loop, entries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, entries)
            except RuntimeError:
                # The loop is closed: its callers are gone, but the messages were handed over.
                log.warning("outbox: event loop closed before %d produce() results could be returned", len(entries))


def _settle(entries: list[_Result]) -> None:
    """On the loop: complete the futures of one round."""
    for fut, value, exc in entries:
        if fut.cancelled():
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value or "")


def _on_loop(
    loop: asyncio.AbstractEventLoop, cb: AsyncDeliveryCallback, err: KafkaError | None, msg: Message | None
) -> None:
    """On a producer thread: run the application's delivery callback on its event loop."""
    try:
        loop.call_soon_threadsafe(cb, err, msg)
    except RuntimeError:
        log.warning("outbox: event loop closed; delivery callback not run (err=%s)", err)
