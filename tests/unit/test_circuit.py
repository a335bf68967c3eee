"""CircuitBreaker state machine, driven by an injected fake clock (no sleeping)."""

from __future__ import annotations

import threading

from outbox.producer.circuit import CircuitBreaker, CircuitState


class FakeClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(threshold: int = 3, reset: float = 10.0) -> tuple[CircuitBreaker, FakeClock, list[int]]:
    clock = FakeClock()
    opened: list[int] = []
    cb = CircuitBreaker(
        failure_threshold=threshold,
        reset_timeout=reset,
        clock=clock,
        on_open=lambda: opened.append(1),
    )
    return cb, clock, opened


def test_starts_closed() -> None:
    cb, _, opened = make()
    assert cb.closed and cb.state is CircuitState.CLOSED
    assert cb.allow_probe()  # closed: every message goes to Kafka
    assert opened == [] and cb.opened_count == 0


def test_opens_after_threshold_consecutive_failures() -> None:
    cb, _, opened = make(threshold=3)
    cb.record_failure()
    cb.record_failure()
    assert cb.closed and cb.state is CircuitState.CLOSED
    cb.record_failure()
    assert not cb.closed and cb.state is CircuitState.OPEN
    assert opened == [1] and cb.opened_count == 1
    # Further failures while open do not open it "again".
    for _ in range(10):
        cb.record_failure()
    assert opened == [1] and cb.opened_count == 1


def test_success_resets_the_failure_count() -> None:
    cb, _, _ = make(threshold=3)
    for _ in range(5):
        cb.record_failure()
        cb.record_failure()
        cb.record_success()
    assert cb.closed and cb.state is CircuitState.CLOSED
    cb.record_failure()
    cb.record_failure()
    assert cb.closed
    cb.record_failure()
    assert not cb.closed


def test_threshold_one_opens_on_first_failure() -> None:
    cb, _, opened = make(threshold=1)
    cb.record_failure()
    assert not cb.closed and opened == [1]


def test_trip_opens_at_once() -> None:
    cb, _, opened = make(threshold=100)
    cb.trip("all brokers down")
    assert not cb.closed and cb.state is CircuitState.OPEN
    assert opened == [1]


def test_no_probe_before_reset_timeout_then_exactly_one() -> None:
    cb, clock, _ = make(reset=10.0)
    cb.trip("down")
    assert not cb.allow_probe()
    clock.advance(9.999)
    assert not cb.allow_probe()
    assert cb.state is CircuitState.OPEN
    clock.advance(0.001)
    assert cb.state is CircuitState.HALF_OPEN
    assert cb.allow_probe()
    # One probe only, however long its result takes.
    for _ in range(5):
        assert not cb.allow_probe()
        clock.advance(100)
    assert cb.state is CircuitState.HALF_OPEN
    assert not cb.closed


def test_half_open_probe_failure_reopens_for_another_period() -> None:
    cb, clock, opened = make(reset=10.0)
    cb.trip("down")
    clock.advance(10)
    assert cb.allow_probe()
    cb.record_failure()  # the probe failed
    assert cb.state is CircuitState.OPEN and not cb.closed
    # The reset period starts again from the probe's failure.
    clock.advance(9)
    assert not cb.allow_probe()
    clock.advance(1)
    assert cb.allow_probe()
    assert not cb.allow_probe()
    # Reopening from half-open is not a new opening: the circuit never closed in between.
    assert opened == [1] and cb.opened_count == 1


def test_half_open_probe_success_closes() -> None:
    cb, clock, opened = make(threshold=2, reset=5.0)
    cb.record_failure()
    cb.record_failure()
    clock.advance(5)
    assert cb.allow_probe()
    cb.record_success()
    assert cb.closed and cb.state is CircuitState.CLOSED
    assert cb.allow_probe()
    # Closed again with a fresh count: the threshold applies from zero.
    cb.record_failure()
    assert cb.closed
    cb.record_failure()
    assert not cb.closed
    assert opened == [1, 1] and cb.opened_count == 2


def test_success_while_open_closes() -> None:
    # A drain worker's successful delivery proves Kafka is back, probe or not.
    cb, _, _ = make()
    cb.trip("down")
    cb.record_success()
    assert cb.closed and cb.state is CircuitState.CLOSED


def test_on_open_called_once_per_opening() -> None:
    cb, clock, opened = make(threshold=1, reset=1.0)
    for round_ in range(1, 4):
        cb.trip("down")
        cb.trip("still down")
        cb.record_failure()
        assert opened == [1] * round_
        clock.advance(1)
        assert cb.allow_probe()
        cb.record_failure()  # probe fails: reopened, not a new opening
        assert opened == [1] * round_
        clock.advance(1)
        assert cb.allow_probe()
        cb.record_success()
        assert cb.closed
    assert cb.opened_count == 3


def test_trip_while_open_restarts_the_reset_period() -> None:
    cb, clock, _ = make(reset=10.0)
    cb.trip("down")
    clock.advance(8)
    cb.trip("still down")
    clock.advance(8)
    assert not cb.allow_probe()
    clock.advance(2)
    assert cb.allow_probe()


def test_trip_while_half_open_reopens() -> None:
    cb, clock, opened = make(reset=10.0)
    cb.trip("down")
    clock.advance(10)
    assert cb.allow_probe()
    cb.trip("all brokers down again")
    assert cb.state is CircuitState.OPEN and not cb.closed
    clock.advance(10)
    assert cb.allow_probe()  # a new probe in the next period
    assert opened == [1]


def test_closed_attribute_tracks_state_through_a_cycle() -> None:
    cb, clock, _ = make(threshold=2, reset=3.0)
    seen = [cb.closed]
    cb.record_failure()
    seen.append(cb.closed)
    cb.record_failure()
    seen.append(cb.closed)
    clock.advance(3)
    seen.append(cb.closed)  # half-open is not closed
    cb.allow_probe()
    seen.append(cb.closed)
    cb.record_success()
    seen.append(cb.closed)
    assert seen == [True, True, False, False, False, True]


def test_on_open_called_once_under_concurrent_failures() -> None:
    cb, _, opened = make(threshold=50)
    start = threading.Barrier(4)

    def fail() -> None:
        start.wait()
        for _ in range(1000):
            cb.record_failure()

    threads = [threading.Thread(target=fail) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opened == [1] and cb.opened_count == 1 and not cb.closed
