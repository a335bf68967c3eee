"""Events: what happens to a producer's messages, told to whoever observes it.

Events are for observers only: the optional OpenTelemetry spans and Prometheus metrics, the
drain process's forwarding of `retried` to its parent, and the application
(`ResilientProducer.subscribe`). The
producer's own parts do not steer each other through them: the writer hands each committed
batch to its owner (`outbox.producer.writer.CommitHandoff`), and a drain worker hands what it
settled back to the producer whose outbox it drains (`outbox.drain.workers.DrainHandback`),
before either tells the event.

Events come per batch, never per message on the fast path: a message sent and acknowledged on
its first try makes none (its `on_delivery` says so). Each runs on the thread that learned it:

* `committed(batch)`: the writer thread committed a batch of messages to the outbox
  (`Committed`: new rows, and dead letters of failed first sends);
* `delivered(rows)`: a drain worker delivered stored rows (`Drained`: `msg_id`, `topic`, `key`,
  `headers`, `attempts`, `created_at`), whether the drain runs in threads or in a process;
* `retried(rows)`: a drain worker's send of these rows failed; they are due again later
  (`Drained` too);
* `dead(letter)`: a message was dead-lettered (the dead letter is stored).

Every payload is a frozen type: a listener cannot reassign what the next one is told (the lists
a `Committed` holds are the writer's own, to be read, not changed).

A listener that raises never stops the thread that told it: the exception is logged, counted in
`stats()["callback_errors"]` and raised again by the application's next `poll()` / `flush()`
(`outbox.producer.pollreport`); the event still reaches every other listener.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from outbox.headers import ID_HEADER, id_alone
from outbox.records import Headers, NewMessage, OutboxMessage

if TYPE_CHECKING:
    from outbox.records import DeadLetter

__all__ = ["EVENTS", "Committed", "Drained", "Events", "Listener", "drained", "drained_fields"]

log = logging.getLogger("outbox")


# -- what the events carry -------------------------------------------------------------------


@dataclass(frozen=True)
class Committed:
    """A committed batch, told to the `committed` event (`outbox.events`)."""

    new_ids: list[int]
    new: list[NewMessage]
    new_meta: list[Any]
    leased: list[bool]
    dead_ids: list[int]
    dead: list[NewMessage]
    dead_meta: list[Any]
    dead_failed: list[OutboxMessage]  # rows that record_failures dead-lettered now


class Drained(NamedTuple):
    """A row a drain worker delivered or will retry: what the `delivered` and `retried` events carry.

    Not the whole `OutboxMessage`: a drain process would pickle its value for nothing (a whole
    row took over four times as long to pickle). Nor, for most rows, its headers: when they are
    the `outbox-id` header alone, `stored_headers` is None and `headers` rebuilds them if someone
    reads them (the OpenTelemetry hook); the parent read rows back in about half the time
    without them.
    """

    msg_id: str
    topic: str
    key: bytes | None
    stored_headers: Headers | None
    attempts: int
    created_at: float

    @property
    def headers(self) -> Headers:
        """The row's headers, as stored."""
        h = self.stored_headers
        return [(ID_HEADER, self.msg_id.encode())] if h is None else h


_new_tuple = tuple.__new__


def drained_fields(rows: Sequence[OutboxMessage]) -> list[tuple[Any, ...]]:
    """Each row as the fields of a `Drained` (plain tuples: what a drain process pickles)."""
    out = []
    for r in rows:
        hs = None if id_alone(r.headers, r.msg_id.encode()) else r.headers
        out.append((r.msg_id, r.topic, r.key, hs, r.attempts, r.created_at))
    return out


def drained(rows: Sequence[OutboxMessage]) -> list[Drained]:
    """Stored rows as the `delivered` and `retried` events carry them (their headers kept only
    when they are more than the `outbox-id` header)."""
    return [_new_tuple(Drained, t) for t in drained_fields(rows)]

#: The event names, in the order the docs list them.
EVENTS = ("committed", "delivered", "retried", "dead")


class Listener:
    """Hears a producer's events; every method does nothing: override the ones you need.

    Subclassing is optional: any object with some of these methods may listen (the others are
    not called). Keep each method short: it runs on a producer thread that has other work.
    """

    def committed(self, batch: Committed) -> None:
        """The writer thread committed `batch` to the outbox."""

    def delivered(self, rows: Sequence[Drained]) -> None:
        """A drain worker delivered these stored rows."""

    def retried(self, rows: Sequence[Drained]) -> None:
        """A drain worker's send of these rows failed; they are due again later."""

    def dead(self, letter: DeadLetter) -> None:
        """A message was dead-lettered; `letter` is stored."""


_NOOPS = {name: getattr(Listener, name) for name in EVENTS}


def _handlers(listener: object, name: str) -> Callable[..., None] | None:
    """`listener`'s method for event `name`, or None if it has none or keeps the no-op."""
    if getattr(type(listener), name, None) is _NOOPS[name]:
        return None
    fn = getattr(listener, name, None)
    return fn if callable(fn) else None


class Events(Listener):
    """The fan-out: tells each event to every subscribed listener, in subscription order.

    Args:
        failed: called with what a listener raised (the producer's: `PollReport.failed`, which
            logs, counts and hands it to the next poll()/flush()).

    Subscribing copies the tuples of handlers (rare); telling reads one tuple (every event), so
    threads tell without a lock while another subscribes.
    """

    def __init__(self, failed: Callable[[BaseException], None]) -> None:
        self._failed = failed
        self._by_event: dict[str, tuple[tuple[Callable[..., None], bool], ...]] = {name: () for name in EVENTS}

    def subscribe(self, listener: object, *, internal: bool = False) -> None:
        """Add `listener`. `internal`: one of the producer's own parts; what it raises is a
        fault of the library, logged only (the application cannot act on it)."""
        if isinstance(listener, type):
            raise TypeError(f"a listener is an object, not the class {listener.__name__}: pass an instance")
        found = False
        by_event = dict(self._by_event)
        for name in EVENTS:
            fn = _handlers(listener, name)
            if fn is not None:
                by_event[name] = (*by_event[name], (fn, internal))
                found = True
        if not found:
            raise TypeError(
                f"{type(listener).__name__} has none of the event methods {', '.join(EVENTS)}: nothing would call it"
            )
        self._by_event = by_event

    def listens(self, name: str) -> bool:
        """Whether any listener hears event `name` (a part may skip building an event nobody hears)."""
        return bool(self._by_event[name])

    def _tell(self, name: str, *args: Any) -> None:
        for fn, internal in self._by_event[name]:
            try:
                fn(*args)
            except Exception as exc:
                if internal:
                    log.exception("outbox: handling the %s event failed; the producer goes on", name)
                else:
                    self._failed(exc)

    def committed(self, batch: Committed) -> None:
        self._tell("committed", batch)

    def delivered(self, rows: Sequence[Drained]) -> None:
        self._tell("delivered", rows)

    def retried(self, rows: Sequence[Drained]) -> None:
        self._tell("retried", rows)

    def dead(self, letter: DeadLetter) -> None:
        self._tell("dead", letter)


def logged_and_counted(count: Callable[[], None]) -> Callable[[BaseException], None]:
    """A `failed` for parts that run without an application to raise to (a standalone
    `Drainer`): log the listener's exception and count it."""

    def failed(exc: BaseException) -> None:
        log.error("outbox: an event listener raised %r; the worker goes on", exc, exc_info=exc)
        count()

    return failed
