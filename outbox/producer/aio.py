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

What else can hold up the loop is the interpreter lock: the producer's threads take it too.
The longest holds measured through an outage and its recovery were the garbage collector's
passes over every object of the process (`benchmarks`, ``--scenarios loop-lag``): see
`DEFAULT_DRAIN_IN` for what this front does about it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka import KafkaError, Message

from outbox.errors import ProducerClosedError
from outbox.producer import sigterm
from outbox.producer.resilient import HookedHeaders, ResilientProducer
from outbox.transactions import is_async_sqlalchemy, run_in_async_transaction

log = logging.getLogger(__name__)

AsyncDeliveryCallback = Callable[[KafkaError | None, Message | None], None]

# Futures resolved per round of the submit thread: bounds how long the first caller of a
# burst waits for the last one's produce() (brief each, but they add up).
_ROUND = 256
_STOP = object()
_Result = tuple["asyncio.Future[str]", str | None, BaseException | None]
_BARRIER = object()


#: Where this front's drain workers run unless `drain_in` is given: "process" when the outbox is
#: a URL. Measured with ``python -m benchmarks --scenarios loop-lag`` (a 1 ms probe task through
#: a full outage and recovery): the event loop's longest stalls were the garbage collector's full
#: passes, which hold the interpreter lock for the whole process, and each drain worker keeps two
#: claimed batches of 10,000 rows alive in it (tens of thousands of tracked objects: a full pass
#: over them took an order of magnitude longer than one without them). In a process of their own
#: the drain's rows and CPU leave the loop's interpreter lock alone. `drain_in="threads"` keeps
#: them here (needed for an `Outbox` instance, or settings that cannot be pickled).
DEFAULT_DRAIN_IN = "process"


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
            `drain_in` defaults to `DEFAULT_DRAIN_IN` when `outbox` is a URL (see there why).

    Building the producer opens the outbox (a file or a connection pool): do it at start-up,
    or with ``await AsyncResilientProducer.create(...)``, which builds it in a thread.

    Follows confluent-kafka's ``confluent_kafka.aio.AIOProducer`` where it can: ``await
    produce(topic, value, key, partition, on_delivery, timestamp, headers, ...)`` in its
    positional order (``callback`` is ``on_delivery``'s alias), ``await flush(timeout)``,
    ``await poll(timeout)``, ``len()``, ``await close()``, ``async with``. Where it differs, and why:

    * ``await produce()`` returns the message id once the message is accepted (in librdkafka's
      queue or handed to the outbox; committed, with write-ahead ``sync``), not a future of
      its delivery: with an outbox, acceptance is the promise (the message will be delivered or
      dead-lettered, by this process or whichever drains the outbox later, possibly after this
      process is gone, when a delivery future could never complete). The delivery is heard
      through ``on_delivery``, which runs on this event loop.
    * Headers are accepted (AIOProducer's batching raises on them): every first send carries
      the ``outbox-id`` header.
    * No ``purge()``: nothing accepted is dropped. ``close(timeout)`` gives what is not
      delivered in time to the outbox instead.
    * ``close(timeout)`` takes a timeout and returns ResilientProducer.close()'s answer: True
      when every message is delivered or stored, False when some are neither (their number is
      in ``stats()["unsaved_at_close"]``); AIOProducer's returns None.
    * The client callbacks in ``config`` (``error_cb``, ``throttle_cb``, ``stats_cb``,
      ``oauth_cb``) are plain functions run on the producer's threads, as for
      ResilientProducer; AIOProducer takes coroutine functions and blocks librdkafka's polling
      thread until the loop has run them, which here would let a busy loop slow the outbox
      (its delivery thread and drain workers).
    * No transactions (``init_transactions`` ...): an outbox cannot hold part of a Kafka
      transaction; ``produce(..., transaction=conn)`` writes to the outbox inside a database
      transaction instead. No ``list_topics`` / ``cluster_id`` / ``set_sasl_credentials``.
    * Built by ``AsyncResilientProducer(config, **options)`` or ``await create(...)``, not
      ``AIOProducer(conf, max_workers, executor, batch_size, buffer_timeout)``: no batching
      buffer to size, one submit thread keeps per-key order.
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
            if isinstance(options.get("outbox", "sqlite:///outbox.db"), str):
                options.setdefault("drain_in", DEFAULT_DRAIN_IN)
            producer = ResilientProducer(config, **options)
        self.producer: ResilientProducer = producer
        self._sync = self.producer.mode == "write-ahead" and self.producer.durability == "sync"
        self._pool = ThreadPoolExecutor(sync_workers, thread_name_prefix="outbox-aio-sync") if self._sync else None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._closed_clean = False  # close()'s answer, for a later call
        self._thread = threading.Thread(target=self._submit_loop, name="outbox-aio-submit", daemon=True)
        self._thread.start()

    @classmethod
    async def create(
        cls, config: Mapping[str, Any], *, sync_workers: int = 16, **options: Any
    ) -> AsyncResilientProducer:
        """Build the producer (which opens the outbox) in a thread, off the event loop."""
        loop = asyncio.get_running_loop()
        made = await loop.run_in_executor(None, functools.partial(cls, config, sync_workers=sync_workers, **options))
        if options.get("handle_sigterm", True):  # built off the main thread, which alone sets handlers
            sigterm.install()
        return made

    # -- the public API ----------------------------------------------------------------------

    #: `hook_produce`'s hook, awaited on the event loop; None: produce() runs as it is.
    _produce_hook: Callable[..., Awaitable[str]] | None = None

    def hook_produce(self, hook: Callable[..., Awaitable[str]]) -> None:
        """Run every later produce() call through the coroutine function `hook`, on the event loop
        (OpenTelemetry's ``send`` spans, in the awaiting task's context).

        ``await hook(produce, topic, value, key, partition, on_delivery, timestamp, headers,
        callback, enable_retry, transaction)`` must return ``await produce(topic, value, key,
        partition, on_delivery, timestamp, HookedHeaders(...), callback=callback,
        enable_retry=enable_retry, transaction=transaction)``, as for
        :meth:`ResilientProducer.hook_produce`. One hook per producer: a second replaces the first.

        Raises:
            ProducerClosedError: the producer is closed (a RuntimeError).
        """
        if self._closed:
            raise ProducerClosedError("hook_produce() called after close()")
        if not callable(hook):
            raise TypeError(f"a produce hook must be callable, got {type(hook).__name__}")
        self._produce_hook = hook

    async def produce(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        partition: int = -1,
        on_delivery: AsyncDeliveryCallback | None = None,
        timestamp: int = 0,
        headers: Sequence[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None] | None = None,
        *,
        callback: AsyncDeliveryCallback | None = None,
        enable_retry: bool = True,
        transaction: Any = None,
    ) -> str:
        """Send a message, or store it in the outbox if Kafka cannot take it now.

        Same arguments, in confluent-kafka's positional order, errors and return value as
        :meth:`ResilientProducer.produce` (value and key are any object when the producer has
        serializers; ``callback`` is ``on_delivery``'s alias). Returns once the message is in
        librdkafka's queue or handed to the outbox writer (fallback, and write-ahead "batch"),
        or committed (write-ahead "sync").

        ``transaction`` takes, besides what :meth:`ResilientProducer.produce` takes, a SQLAlchemy
        ``AsyncSession`` or ``AsyncConnection`` on a PostgreSQL outbox through psycopg: the row
        is written inside it, awaited on this loop, and exists if and only if it commits.

        ``on_delivery(err, msg)`` runs on this event loop (not on a producer thread), so it may
        touch asyncio objects. Cancelling the await does not withdraw the message: once
        ``produce()`` is called the message is sent or stored.

        Returns:
            The message id (the ``outbox-id`` header value).
        """
        if self._closed:
            raise ProducerClosedError("produce() called after close()")
        hook = self._produce_hook
        if hook is not None and headers.__class__ is not HookedHeaders:
            return await hook(
                self.produce, topic, value, key, partition, on_delivery, timestamp, headers, callback,
                enable_retry, transaction,
            )
        if transaction is not None and is_async_sqlalchemy(transaction):
            # Written on this loop inside the caller's transaction; the drain workers send it.
            def write(sync: Any) -> str:  # `sync`: the transaction's synchronous face
                return self.producer.produce(
                    topic, value, key, partition, None, timestamp, headers, enable_retry=enable_retry, transaction=sync
                )

            return await run_in_async_transaction(transaction, write)
        loop = asyncio.get_running_loop()
        report = callback if callback is not None else on_delivery  # confluent: callback wins
        kw: dict[str, Any] = {
            "key": key, "headers": headers, "partition": partition,
            "on_delivery": None if report is None else functools.partial(_on_loop, loop, report),
            "enable_retry": enable_retry, "transaction": transaction,
        }
        if timestamp:
            kw["timestamp"] = timestamp
        if self._pool is not None:
            return await loop.run_in_executor(self._pool, functools.partial(self.producer.produce, topic, value, **kw))
        fut: asyncio.Future[str] = loop.create_future()
        self._queue.put((fut, topic, value, kw))
        return await fut

    async def poll(self, timeout: float = 0) -> int:
        """Compatibility with AIOProducer: callbacks already run (``on_delivery`` on this loop).

        Like :meth:`ResilientProducer.poll`, in a thread when it may wait."""
        if not timeout:
            return self.producer.poll(0)
        return await asyncio.get_running_loop().run_in_executor(None, self.producer.poll, timeout)

    def __len__(self) -> int:
        """Messages not yet delivered nor committed, including produce() calls not yet handed over."""
        return len(self.producer) + self._queue.qsize()

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

    async def close(self, timeout: float | None = None) -> bool:
        """Hand over every pending produce(), then close the producer (flush, stop its threads).

        Returns:
            True when every message is delivered or in the outbox; False when some are neither
            (`ResilientProducer.close`). A later call returns the first one's answer (False
            while the first is still closing).
        """
        if self._closed:
            return self._closed_clean
        await self._barrier()
        self._closed = True
        self._queue.put(_STOP)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join)
        if self._pool is not None:
            await loop.run_in_executor(None, self._pool.shutdown)
        self._closed_clean = await loop.run_in_executor(None, self.producer.close, timeout)
        return self._closed_clean

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
        self._queue.put((fut, _BARRIER, None, None))
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
            fut, topic, value, kw = item
            if topic is _BARRIER:
                done.append((fut, "", None))
                continue
            try:
                done.append((fut, produce(topic, value, **kw), None))
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
