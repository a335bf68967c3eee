"""Where a message goes when retrying is over: the group's DLQ topic, the outbox's dead-letter store, or both."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from confluent_kafka import Message

from outbox.consumer.headers import Origin, cap_utf8, error_class, record_timestamp
from outbox.errors import ConfigError
from outbox.records import DeadLetter, Headers, NewMessage
from outbox.stores import Outbox

log = logging.getLogger(__name__)

DEAD_LETTER_MODES = ("topic", "store", "both")

#: Publishes (topic, message, headers, partition) through the hop producer; returns a hop token.
Publish = Callable[[str, Message, Headers, int], int]


def check_mode(mode: object) -> str:
    if mode not in DEAD_LETTER_MODES:
        raise ConfigError(f"dead_letters must be one of {DEAD_LETTER_MODES}, got {mode!r}")
    return str(mode)


def last_error(exc: BaseException) -> str:
    """The dead letter's `last_error`, for people: "<class> (consumer): <message>" (`error_name` holds the class)."""
    return f"{error_class(exc)} (consumer): {cap_utf8(str(exc)).decode('utf-8')}"


class DeadLetters:
    """Stores or publishes a dead letter and tells the application once.

    Args:
        mode: "topic", "store" or "both".
        store: the outbox store (its dead-letter state holds consumer dead letters too).
        publish: sends to the DLQ topic through the hop producer and returns a hop token.
        on_dead_letter: the application's recovery callback (exceptions in it are logged, never raised).
    """

    def __init__(
        self,
        mode: str,
        store: Outbox,
        publish: Publish,
        on_dead_letter: Callable[[DeadLetter], None] | None,
    ) -> None:
        self.mode = mode
        self._store = store
        self._publish = publish
        self._on_dead_letter = on_dead_letter
        self.count = 0

    def record(
        self,
        msg: Message,
        *,
        headers: Headers,
        msg_id: str,
        origin: Origin,
        attempts: int,
        exc: BaseException,
        dlq_topic: str,
        replay_topic: str,
        partition: int,
    ) -> int | None:
        """Dead-letter `msg`. Returns the DLQ publish's hop token (None when only stored).

        The store row's topic is `replay_topic` (the group's first retry tier when there is one),
        so `outbox dlq replay` redrives the message into this group's ladder, not the main topic
        that other groups read too.
        """
        token: int | None = None
        row_id = 0
        now = time.time()
        if self.mode in ("topic", "both"):
            token = self._publish(dlq_topic, msg, headers, partition)
        if self.mode in ("store", "both"):
            row = NewMessage(
                topic=replay_topic,
                value=msg.value(),
                key=msg.key(),
                headers=headers,
                partition=partition,
                msg_id=msg_id,
                attempts=attempts,
                first_failed_at=origin.timestamp_ms / 1000.0 if origin.timestamp_ms > 0 else now,
                last_error=last_error(exc),
                # No librdkafka code: the handler's exception class is the name `dlq list --error` matches.
                error_name=error_class(exc),
                timestamp=record_timestamp(msg),
            )
            row_id = self._store.add_dead([row], failed_at=now)[0]
        self.count += 1
        log.warning(
            "dead letter: %s [%d] @%d after %d attempts: %s", origin.topic, origin.partition, origin.offset,
            attempts, error_class(exc),
        )
        if self._on_dead_letter is not None:
            dl = DeadLetter(
                id=row_id,
                topic=origin.topic,
                key=msg.key(),
                value=msg.value(),
                headers=headers,
                partition=origin.partition,
                attempts=attempts,
                first_failed_at=origin.timestamp_ms / 1000.0 if origin.timestamp_ms > 0 else None,
                last_failed_at=now,
                last_error=last_error(exc),
                msg_id=msg_id,
                error_name=error_class(exc),
                timestamp=record_timestamp(msg),
            )
            try:
                self._on_dead_letter(dl)
            except Exception:
                log.exception("on_dead_letter callback raised (the dead letter is kept)")
        return token
