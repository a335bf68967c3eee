"""AsyncResilientConsumer: ResilientConsumer with an ``async def`` handler, for asyncio applications.

    async def handle(msg): await db.save(msg.value())

    consumer = await AsyncResilientConsumer.create(config, topics=["orders"], handler=handle)
    async with consumer:
        await consumer.run()          # until stop(), cancellation, or `timeout`

The ResilientConsumer's poll loop runs unchanged on one thread of its own, so its semantics are
the same: retry tiers, dead letters, pauses, and offsets stored only once a message's fate is
durable. For each message that thread submits ``handler(msg)`` to the application's event loop
(``asyncio.run_coroutine_threadsafe``) and waits for it: the coroutine runs on the loop, with the
application's clients and context; a raise is a failure like a sync handler's. Nothing of the
consumer runs on the loop: polling, hops through the outbox, commits and pause/resume stay on the
consumer thread. Messages are handled one at a time, in partition order, as with the sync API.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from confluent_kafka import Message

from outbox.consumer.consumer import ResilientConsumer, is_async_callable
from outbox.errors import ConfigError

AsyncHandler = Callable[[Message], Awaitable[Any]]


class AsyncResilientConsumer:
    """An asyncio front for :class:`~outbox.ResilientConsumer` whose handler is a coroutine function.

    Args:
        config: confluent_kafka.Consumer settings, as for ResilientConsumer.
        handler: ``async def handler(msg)``; raising means the message failed (it then goes to a
            retry tier or the dead letters as the strategy says).
        **options: ResilientConsumer's other keyword arguments (topics, strategy, dead_letters,
            outbox, deserializer, on_dead_letter, ...). ``on_dead_letter`` and ``deserializer``
            stay plain functions and run on the consumer thread.

    Building the consumer checks or creates the tier topics and opens the outbox (blocking): do
    it at start-up, or with ``await AsyncResilientConsumer.create(...)``, which builds it in a thread.
    """

    def __init__(self, config: Mapping[str, Any], *, handler: AsyncHandler, **options: Any) -> None:
        if not is_async_callable(handler):
            raise ConfigError(
                f"handler must be a coroutine function (async def), got {type(handler).__name__}; "
                "use ResilientConsumer for a plain function"
            )
        #: The coroutine function called per message; read at each call (`wrap_handler` replaces it).
        self.handler: AsyncHandler = handler
        self._loop: asyncio.AbstractEventLoop | None = None
        self.consumer = ResilientConsumer(config, handler=self._on_consumer_thread, **options)
        self._thread: threading.Thread | None = None

    @classmethod
    async def create(
        cls, config: Mapping[str, Any], *, handler: AsyncHandler, **options: Any
    ) -> AsyncResilientConsumer:
        """Build the consumer (tier topics, outbox, group subscription) in a thread, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(cls, config, handler=handler, **options))

    def wrap_handler(self, wrap: Callable[[AsyncHandler], AsyncHandler]) -> None:
        """Await ``wrap(handler)`` for every message from the next one on, on the loop (a span
        around each call: `outbox.otel` opens its ``process`` spans this way)."""
        self.handler = wrap(self.handler)

    async def run(self, timeout: float | None = None) -> None:
        """Consume until :meth:`stop` (or `timeout` seconds, or cancellation), then return.

        The poll loop runs on a thread of its own; this coroutine only waits for it. Cancelling
        the awaiting task stops the loop after the batch in hand (up to `batch_size` messages,
        each handled to its end: a coroutine is never abandoned mid-message, and its fate must be
        settled before close() commits), waits for that, then raises CancelledError. An error of the loop
        (a fatal Kafka error) is raised here. No signal handlers are installed: the application
        (uvicorn, ``asyncio.run``) owns them; call stop() from its shutdown hook.
        """
        if self._thread is not None:
            raise RuntimeError("run() is already running")
        loop = asyncio.get_running_loop()
        self._loop = loop
        done: asyncio.Future[None] = loop.create_future()

        def target() -> None:
            try:
                self.consumer.run(timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                loop.call_soon_threadsafe(_settle, done, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, None)

        self._thread = threading.Thread(target=target, name="outbox-aio-consumer", daemon=True)
        self._thread.start()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            self.consumer.stop()
            await done  # the message in hand finishes (its coroutine runs on this loop)
            raise
        finally:
            self._thread = None

    def stop(self) -> None:
        """Ask run() to return after the batch in hand (thread-safe, and safe from a signal handler)."""
        self.consumer.stop()

    async def stats(self) -> dict[str, Any]:
        """ResilientConsumer.stats(), read in a thread (the hop producer's part queries the outbox)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.consumer.stats)

    async def close(self, timeout: float = 30.0) -> None:
        """Stop, make pending hops durable, commit, leave the group, close the outbox (in a thread)."""
        self.consumer.stop()
        loop = asyncio.get_running_loop()
        thread = self._thread
        if thread is not None:  # run() not awaited to its end: its loop must be out of librdkafka first
            await loop.run_in_executor(None, thread.join)
        await loop.run_in_executor(None, self.consumer.close, timeout)

    async def __aenter__(self) -> AsyncResilientConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _on_consumer_thread(self, msg: Message) -> None:
        """The sync handler the consumer thread calls: run the coroutine on the loop and wait for it."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("AsyncResilientConsumer: handle messages through run(), not the inner consumer")
        # A raise here (the coroutine's, or the loop being closed) is the message's failure: it
        # goes to a retry tier or the dead letters, never silently past.
        asyncio.run_coroutine_threadsafe(_call(self.handler, msg), loop).result()


async def _call(handler: AsyncHandler, msg: Message) -> Any:
    return await handler(msg)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
