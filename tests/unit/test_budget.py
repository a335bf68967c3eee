"""The memory budget (outbox/budget.py), librdkafka's queue bounds taken from it (outbox/producer/link.py),
the drain's claims bounded by it, and the producer's `memory_budget` setting."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import ConfigError, Drainer, NewMessage, ResilientProducer, SQLiteOutbox
from outbox.budget import MemoryBudget
from outbox.message import HEADER_OVERHEAD, MESSAGE_OVERHEAD, message_cost
from outbox.producer.link import queue_limits


class Part:
    def __init__(self, held: int = 0) -> None:
        self.held_bytes = held


def test_a_message_costs_its_value_key_and_headers_plus_the_overhead() -> None:
    m = NewMessage("t", b"v" * 100, b"k" * 10, [("h", b"12345"), ("none", None)])
    assert message_cost(m) == MESSAGE_OVERHEAD + 100 + 10 + (HEADER_OVERHEAD + 1 + 5) + (HEADER_OVERHEAD + 4)
    assert message_cost(NewMessage("t", None)) == MESSAGE_OVERHEAD


def test_the_budget_sums_its_parts_and_is_full_when_the_next_message_would_pass_the_limit() -> None:
    a, b = Part(), Part()
    budget = MemoryBudget(1000)
    budget.add_part(a)
    budget.add_part(b)
    assert not budget.full(5000), "a message larger than the budget passes when nothing is held"
    a.held_bytes, b.held_bytes = 300, 400
    assert budget.held() == 700
    assert not budget.full(300) and budget.full(301)
    budget.sample()
    a.held_bytes = 0
    assert budget.peak == 700 and budget.peak_now() == 700


def test_the_reserve_for_librdkafka_lowers_where_producers_wait_at_most_to_half() -> None:
    assert MemoryBudget(1000, reserve=300).admit == 700
    assert MemoryBudget(1000, reserve=10**9).admit == 500


def test_librdkafkas_queue_gets_a_quarter_of_the_budget_unless_the_config_sets_it() -> None:
    budget = 64 * 1024 * 1024
    add, reserve = queue_limits({"bootstrap.servers": "x"}, budget)
    assert add == {"queue.buffering.max.kbytes": budget // 4 // 1024}  # the message count stays librdkafka's
    kib = budget // 4 // 1024
    assert reserve == kib * 1024 + kib * MESSAGE_OVERHEAD  # its payload, and a message per KiB of it
    # The user's settings stand, and count in what librdkafka may hand back.
    add, reserve = queue_limits({"queue.buffering.max.kbytes": 1024, "queue.buffering.max.messages": "500"}, budget)
    assert add == {}
    assert reserve == 1024 * 1024 + 500 * MESSAGE_OVERHEAD


@pytest.mark.parametrize("budget", [0, -1, 1.5, True, "64MB"])
def test_a_memory_budget_that_is_not_a_positive_int_is_a_clear_error_and_opens_nothing(
    budget: object, tmp_path: Path
) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=r"memory_budget must be a positive number of bytes \(int\), got "):
        ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{db}", memory_budget=budget)  # type: ignore[arg-type]
    assert not db.exists()


def test_the_producer_shares_its_budget_and_reports_it(tmp_path: Path) -> None:
    budget = 8 * 1024 * 1024
    with ResilientProducer(
        {"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{tmp_path / 'o.db'}", memory_budget=budget,
        drain_workers=0,
    ) as p:
        st = p.stats()
        assert (st["memory_budget"], st["memory_held_bytes"], st["memory_held_peak"]) == (budget, 0, 0)
        assert p.writer.budget is p.memory
        assert isinstance(p.drainer, Drainer) and p.drainer.batch_bytes == budget // 4


# -- the drain's claims --------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteOutbox]:
    s = SQLiteOutbox(str(tmp_path / "o.db"))
    yield s
    s.close()


def one_message_rows(store: SQLiteOutbox, prefix: str, n: int, size: int) -> None:
    """Stored in batches too short to become groups (a claim takes a group whole)."""
    for start in range(0, n, 10):
        store.enqueue([NewMessage("t", b"x" * size, msg_id=f"{prefix}-{i}") for i in range(start, start + 10)])


def test_a_drain_claims_fewer_rows_when_they_would_pass_its_batch_bytes(store: SQLiteOutbox) -> None:
    one_message_rows(store, "big", 100, 4096)
    row = 4096 + MESSAGE_OVERHEAD
    d = Drainer(store, {"bootstrap.servers": "127.0.0.1:1"}, batch_size=50, batch_bytes=10 * row)
    first = d._claim(None, True, [], True)
    assert len(first) == 10  # 4 KiB a row assumed, and measured: ten fit
    one_message_rows(store, "small", 100, 100)
    d._give_back(first, None, True)
    d._row_bytes = 100 + MESSAGE_OVERHEAD  # as sampled from a claim of small rows
    assert len(d._claim(None, True, [], True)) == 50  # batch_size bounds it: 10 rows' bytes hold 53 small ones


def test_until_the_cluster_took_a_batch_a_drain_claims_a_probe_batch(store: SQLiteOutbox) -> None:
    one_message_rows(store, "m", 100, 100)
    d = Drainer(store, {"bootstrap.servers": "127.0.0.1:1"}, batch_size=50)
    assert len(d._claim(None, True, [], False)) == 5  # a tenth of the batch: little held if the cluster is down
    assert len(d._claim(None, True, [], True)) == 50


class CircuitOpen:
    """A producer's hand-back whose circuit is open (its own sends found no broker)."""

    def delivered(self, rows: object) -> None:
        raise AssertionError("nothing can be delivered: no broker")

    def dead(self, letter: object) -> None:
        raise AssertionError("nothing was sent to fail")

    def cluster_known_down(self) -> bool:
        return True


def test_a_drain_claims_nothing_while_its_producers_circuit_is_open_and_no_broker_answers(
    store: SQLiteOutbox, caplog: pytest.LogCaptureFixture
) -> None:
    one_message_rows(store, "m", 30, 4096)
    d = Drainer(store, {"bootstrap.servers": "127.0.0.1:1"}, workers=2)
    with caplog.at_level("INFO", logger="outbox.drain.workers"):  # INFO: a producer's drain
        d.start(CircuitOpen())
        try:
            deadline = time.monotonic() + 30
            while not any("waiting for the cluster" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the workers never found the cluster down"
                time.sleep(0.05)
            # Both workers are waiting, and neither sent a batch to wait in librdkafka.
            while sum("waiting for the cluster" in r.getMessage() for r in caplog.records) < 2:
                assert time.monotonic() < deadline, "a worker never found the cluster down"
                time.sleep(0.05)
            assert len(store.claim("test", 100, 60, now=time.time())) == 30, "a worker leased rows"
        finally:
            d.stop(10)


def test_without_batch_bytes_a_drain_claims_batch_size_rows(store: SQLiteOutbox) -> None:
    one_message_rows(store, "big", 30, 4096)
    d = Drainer(store, {"bootstrap.servers": "127.0.0.1:1"}, batch_size=20)
    assert len(d._claim(None, True, [], True)) == 20
