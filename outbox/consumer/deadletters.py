"""Where a message goes when retrying is over: the group's DLQ topic, the outbox's dead-letter store, or both."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from confluent_kafka import Message

from outbox.consumer.headers import Origin, cap_utf8, error_class, failure_headers, record_timestamp
from outbox.consumer.hops import Hops
from outbox.consumer.inbox import Inbox
from outbox.consumer.offsets import TP, OffsetTracker
from outbox.consumer.tiers import Ladder, Place
from outbox.errors import ConfigError
from outbox.headers import IdGenerator
from outbox.records import DeadLetter, Headers, NewMessage
from outbox.stores import Outbox

log = logging.getLogger(__name__)

DEAD_LETTER_MODES = ("topic", "store", "both")


class Failure(NamedTuple):
    """A dead letter's account of its message: the headers it carries, its `outbox-id`, where it
    came from, the attempts made, and the exception of the last one."""

    headers: Headers
    msg_id: str
    origin: Origin
    attempts: int
    exc: BaseException


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
        hops: publishes to the DLQ topic (through the hop producer) and keeps the key order's ladder entries.
        on_dead_letter: the application's recovery callback (exceptions in it are logged, never raised).
        ladder: names the DLQ topic, and the topic a stored dead letter is replayed into.
        ids: where a dead letter's `outbox-id` comes from when the message has none.
        tracker: the dead-lettered message's offset is done once its dead letter is stored, or
            waits for its DLQ publish.
        inbox: dedup=True: its batch is settled before a dead letter is made.
    """

    def __init__(
        self,
        mode: str,
        store: Outbox,
        hops: Hops,
        on_dead_letter: Callable[[DeadLetter], None] | None,
        ladder: Ladder,
        ids: IdGenerator,
        tracker: OffsetTracker,
        inbox: Inbox | None,
    ) -> None:
        self.mode = mode
        self._store = store
        self._hops = hops
        self._on_dead_letter = on_dead_letter
        self._ladder = ladder
        self._ids = ids
        self._tracker = tracker
        self._inbox = inbox
        self.count = 0

    def dead_letter(self, m: Message, tp: TP, offset: int, place: Place, *, attempts: int, exc: BaseException) -> None:
        """Dead-letter `m` (at `offset` of `tp`) after `attempts` attempts, the last of which raised `exc`."""
        if self._inbox is not None:
            self._inbox.settle()  # the dead letter may go to the store: not under the inbox's lock
        headers, msg_id, origin = failure_headers(
            m, group=self._ladder.group, attempt=attempts, exc=exc, due_at_s=None, ids=self._ids
        )
        if place.tier:
            self._hops.left(m, tp, place)
        token = self.record(m, Failure(headers, msg_id, origin, attempts, exc), place.main, tp[1])
        if token is None:
            self._tracker.done(tp, offset)
        else:
            self._tracker.wait(tp, offset, token)

    def record(self, msg: Message, failure: Failure, main: str, partition: int) -> int | None:
        """Dead-letter `msg`, read from `partition` of `main` or of one of its tiers. Returns the DLQ
        publish's hop token (None when only stored).

        The store row's topic is the group's first retry tier when there is one (else `main`), so
        `outbox dlq replay` redrives the message into this group's ladder, not the main topic
        that other groups read too.
        """
        headers, msg_id, origin, attempts, exc = failure
        token: int | None = None
        row_id = 0
        now = time.time()
        if self.mode in ("topic", "both"):
            token = self._hops.publish(self._ladder.dlq_topic(main), msg, headers, partition)
        if self.mode in ("store", "both"):
            row = NewMessage(
                topic=self._ladder.retry_topic(main, 1) if self._ladder.tiers else main,
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
