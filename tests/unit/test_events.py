"""The events fan-out: every listener hears every event it has a method for, in order; one that
raises neither stops the others nor the telling thread, and the application hears of it."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from outbox import Listener, ResilientProducer
from outbox.events import EVENTS, Committed, Events
from outbox.producer.pollreport import PollReport
from outbox.records import DeadLetter


def _letter(msg_id: str = "m1") -> DeadLetter:
    return DeadLetter(1, "t", b"k", b"v", [], -1, 3, 0.0, 0.0, "boom", msg_id, None, None)


def _batch() -> Committed:
    return Committed([], [], [], [], [], [], [], [])


class Recorder(Listener):
    def __init__(self, name: str, log: list[tuple[str, str, Any]]) -> None:
        self.name, self.log = name, log

    def committed(self, batch: Committed) -> None:
        self.log.append((self.name, "committed", batch))

    def delivered(self, rows: Any) -> None:
        self.log.append((self.name, "delivered", rows))

    def retried(self, rows: Any) -> None:
        self.log.append((self.name, "retried", rows))

    def dead(self, letter: DeadLetter) -> None:
        self.log.append((self.name, "dead", letter))


def test_each_event_reaches_every_listener_in_subscription_order() -> None:
    log: list[tuple[str, str, Any]] = []
    events = Events(PollReport().failed)
    events.subscribe(Recorder("a", log))
    events.subscribe(Recorder("b", log))
    batch, letter, rows = _batch(), _letter(), [object()]
    events.committed(batch)
    events.delivered(rows)  # type: ignore[arg-type]
    events.retried(rows)  # type: ignore[arg-type]
    events.dead(letter)
    assert log == [
        (name, event, arg)
        for event, arg in [("committed", batch), ("delivered", rows), ("retried", rows), ("dead", letter)]
        for name in ("a", "b")
    ]


def test_a_listener_needs_only_the_methods_it_uses_and_need_not_subclass() -> None:
    heard: list[DeadLetter] = []

    class DeadOnly:  # duck-typed: no Listener base
        def dead(self, letter: DeadLetter) -> None:
            heard.append(letter)

    events = Events(PollReport().failed)
    events.subscribe(DeadOnly())
    events.committed(_batch())
    events.dead(_letter())
    assert [d.msg_id for d in heard] == ["m1"]
    assert events.listens("dead") and not events.listens("committed")


def test_a_listener_that_raises_is_counted_and_re_raised_to_the_application_the_others_still_hear(
    caplog: pytest.LogCaptureFixture,
) -> None:
    served = PollReport()
    log: list[tuple[str, str, Any]] = []

    class Broken(Listener):
        def dead(self, letter: DeadLetter) -> None:
            raise ValueError(f"audit log full ({letter.msg_id})")

    events = Events(served.failed)
    events.subscribe(Broken())
    events.subscribe(Recorder("after", log))
    with caplog.at_level(logging.ERROR, logger="outbox"):
        events.dead(_letter("m7"))  # on "a producer thread": must not raise here
    assert [(n, e) for n, e, _ in log] == [("after", "dead")]
    assert served.callback_errors == 1
    assert "audit log full (m7)" in caplog.text
    with pytest.raises(ValueError, match=r"audit log full \(m7\)"):
        served.raise_pending()  # what the next poll()/flush() does


def test_an_internal_listener_that_raises_is_logged_not_raised_to_the_application(
    caplog: pytest.LogCaptureFixture,
) -> None:
    served = PollReport()

    class Bug(Listener):
        def committed(self, batch: Committed) -> None:
            raise RuntimeError("library bug")

    events = Events(served.failed)
    events.subscribe(Bug(), internal=True)
    with caplog.at_level(logging.ERROR, logger="outbox"):
        events.committed(_batch())
    assert served.callback_errors == 0
    served.raise_pending()  # nothing pending
    assert "handling the committed event failed" in caplog.text


def test_a_listener_with_no_event_method_or_a_class_is_refused() -> None:
    events = Events(PollReport().failed)
    with pytest.raises(TypeError, match="none of the event methods"):
        events.subscribe(object())
    with pytest.raises(TypeError, match="not the class Recorder"):
        events.subscribe(Recorder)


def test_subscribing_while_another_thread_tells_events_loses_none_of_them() -> None:
    events = Events(PollReport().failed)
    counts = [0]

    class Count(Listener):
        def retried(self, rows: Any) -> None:
            counts[0] += 1

    events.subscribe(Count())
    stop = threading.Event()

    def tell() -> None:
        while not stop.is_set():
            events.retried([])

    t = threading.Thread(target=tell)
    t.start()
    late = [Count() for _ in range(50)]
    for listener in late:
        events.subscribe(listener)
    stop.set()
    t.join()
    before = counts[0]
    events.retried([])
    assert counts[0] == before + 51  # every subscription took


def test_event_names_are_the_listener_methods() -> None:
    assert all(callable(getattr(Listener, name)) for name in EVENTS)
    assert set(EVENTS) == {"committed", "delivered", "retried", "dead"}


def test_a_closed_producer_refuses_subscriptions(tmp_path: Any) -> None:
    p = ResilientProducer(
        {"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{tmp_path / 'o.db'}", drain_workers=0
    )
    p.close(1)
    with pytest.raises(RuntimeError, match="closed"):
        p.subscribe(Recorder("x", []))
