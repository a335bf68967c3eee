"""Handler kinds are checked before anything touches Kafka: an async handler given to the sync
consumer would return an un-awaited coroutine per message (all "handled", none run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Message

from outbox import AsyncResilientConsumer, ConfigError, ResilientConsumer

CONFIG = {"bootstrap.servers": "127.0.0.1:1", "group.id": "g"}


async def handle(msg: Message) -> None:
    pass


class AsyncCallable:
    async def __call__(self, msg: Message) -> None:
        pass


@pytest.mark.parametrize("handler", [handle, AsyncCallable()], ids=["coroutine-function", "async-__call__"])
def test_sync_consumer_refuses_an_async_handler(handler: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="use outbox.AsyncResilientConsumer for async handlers"):
        ResilientConsumer(CONFIG, topics=["t"], handler=handler, outbox=f"sqlite:///{tmp_path / 'a.db'}")  # type: ignore[arg-type]
    assert not (tmp_path / "a.db").exists(), "refused before the outbox was opened"


def test_async_consumer_refuses_a_plain_handler(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"handler must be a coroutine function \(async def\), got builtin_function"):
        AsyncResilientConsumer(CONFIG, topics=["t"], handler=print, outbox=f"sqlite:///{tmp_path / 'b.db'}")  # type: ignore[arg-type]
    assert not (tmp_path / "b.db").exists()
