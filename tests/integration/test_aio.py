"""AsyncResilientProducer in real asyncio applications against the real 3-broker cluster."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outbox import ID_HEADER, ProducerClosedError, RetryPolicy, SQLiteOutbox
from outbox.producer.aio import AsyncResilientProducer
from outbox.testing import KafkaCluster

from .delivery import keyed_value, read_topic

FAST = {"acks": "all", "enable.idempotence": True, "linger.ms": 5, "message.timeout.ms": 3000}
# Tests without an outage: librdkafka's usual patience, so a loaded machine's slow acknowledgements
# do not send messages to the outbox (3 s time-outs did at load average 30).
STEADY = {**FAST, "message.timeout.ms": 30000}


def make_async(bootstrap: str, path: Path, **kw: Any) -> AsyncResilientProducer:
    opts: dict[str, Any] = {
        "outbox": f"sqlite:///{path}",
        "retry": RetryPolicy(max_attempts=100, initial_delay=0.5),
        "circuit_reset_timeout": 1.0,
        "drain_poll_interval": 0.2,
        "lease_seconds": 10.0,
    }
    opts.update(kw)
    return AsyncResilientProducer({"bootstrap.servers": bootstrap, **STEADY}, **opts)


async def wait_drained(p: AsyncResilientProducer, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = await p.stats()
        if st["pending"] == 0 and st["in_memory"] == 0 and st["unsaved"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"outbox not drained after {timeout}s: {st}")
        await asyncio.sleep(0.2)


class Ticker:
    """Measures how late the event loop wakes a task that sleeps `period` seconds at a time."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.delays: list[tuple[float, float]] = []  # (monotonic time, lateness in seconds)
        self.stopped = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopped:
            t0 = loop.time()
            await asyncio.sleep(self.period)
            self.delays.append((time.monotonic(), loop.time() - t0 - self.period))

    def worst(self, start: float = 0.0, end: float = float("inf")) -> float:
        return max((d for t, d in self.delays if start <= t <= end), default=0.0)

    def p99(self, start: float = 0.0, end: float = float("inf")) -> float:
        ds = sorted(d for t, d in self.delays if start <= t <= end)
        return ds[int(len(ds) * 0.99)] if ds else 0.0


# The same ticker alone in its own process: how late the machine itself wakes a sleeping task
# (on a shared 2-core machine this floor is far from zero). time.monotonic() is system-wide.
_CONTROL_TICKER = """
import asyncio, sys, time
async def main():
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(0.005)
        print(time.monotonic(), loop.time() - t0 - 0.005)
asyncio.run(main())
"""


def test_async_happy_path_round_trips_and_callbacks_run_on_the_loop(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    async def app() -> tuple[list[str], str, list[Any], int, dict[str, Any]]:
        loop_thread = threading.get_ident()
        reports: list[Any] = []
        async with make_async(kafka_bootstrap, tmp_path / "o.db") as p:
            ids = await asyncio.gather(
                *(p.produce(topic, b"v%d" % i, key=b"k%d" % (i % 7), headers=[("h", b"1"), ("h", b"2")])
                  for i in range(300))
            )
            special = await p.produce(
                topic, b"special", key="text", headers={"a": "x"}, partition=1,
                on_delivery=lambda e, m: reports.append((e, m, threading.get_ident() == loop_thread)),
            )
            left = await p.flush(30)
            st = await p.stats()
        return list(ids), special, reports, left, st

    ids, special, reports, left, st = asyncio.run(app())
    assert left == 0 and st["delivered"] == 301 and st["outboxed"] == 0 and st["pending"] == 0
    assert len(set(ids)) == 300
    assert len(reports) == 1 and reports[0][0] is None and reports[0][1].partition() == 1
    assert reports[0][2], "on_delivery must run on the event loop's thread"
    got = read_topic(kafka_bootstrap, topic, 301)
    assert got.unique == 301 and set(got.by_id) == set(ids) | {special}
    msg = got.by_id[special][0]
    assert msg.key() == b"text" and msg.headers() == [("a", b"x"), (ID_HEADER, special.encode())]


def test_async_produce_takes_confluents_positional_order_and_drains_in_a_process(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    """AIOProducer's order: (topic, value, key, partition, on_delivery, timestamp, headers);
    `callback` is on_delivery's alias; poll() and len() answer; the drain runs in a child."""

    async def app() -> tuple[str, list[Any], int, int, bool]:
        reports: list[Any] = []
        async with make_async(kafka_bootstrap, tmp_path / "o.db") as p:
            in_process = p.producer.drainer.__class__.__name__ == "DrainProcess"
            msg_id = await p.produce(
                topic, b"pos", b"key", 2, None, 0, [("h", b"1")], callback=lambda e, m: reports.append((e, m))
            )
            polled = await p.poll(0)
            assert await p.flush(30) == 0
            return msg_id, reports, polled, len(p), in_process

    msg_id, reports, polled, left, in_process = asyncio.run(app())
    assert in_process, "the asyncio front drains in a process of its own by default"
    assert polled == 0 and left == 0
    assert len(reports) == 1 and reports[0][0] is None and reports[0][1].partition() == 2
    msg = read_topic(kafka_bootstrap, topic, 1).by_id[msg_id][0]
    assert (msg.key(), msg.value(), msg.partition()) == (b"key", b"pos", 2)
    assert msg.headers() == [("h", b"1"), (ID_HEADER, msg_id.encode())]


def test_async_bad_input_raises_at_await_and_stores_nothing(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    async def app() -> list[str]:
        errors = []
        p = make_async(kafka_bootstrap, tmp_path / "o.db")
        for bad in (
            lambda: p.produce("bad topic!", b"x"),
            lambda: p.produce(topic, 12),  # type: ignore[arg-type]
            lambda: p.produce(topic, b"x", partition=-5),
        ):
            try:
                await bad()
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        assert await p.close() is True
        assert await p.close() is True  # again: the first call's answer
        try:
            await p.produce(topic, b"late")
        except ProducerClosedError as exc:
            errors.append(str(exc))
        return errors

    errors = asyncio.run(app())
    assert errors == [
        "topic name 'bad topic!' has characters Kafka does not allow (only a-z A-Z 0-9 . _ -)",
        "value must be bytes, str or None, not int",
        "partition must be an int from -1 to 2147483647, got -5",
        "produce() called after close()",
    ]
    with SQLiteOutbox(tmp_path / "o.db") as store:
        assert store.stats(now=time.time()).pending == 0


def test_async_write_ahead_sync_returns_after_commit(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    async def app() -> tuple[list[str], dict[str, Any]]:
        async with make_async(
            kafka_bootstrap, tmp_path / "o.db", mode="write-ahead", durability="sync"
        ) as p:
            ids = await asyncio.gather(*(p.produce(topic, b"w%d" % i) for i in range(200)))
            assert await p.flush(30) == 0
            return list(ids), await wait_drained(p, 30)

    ids, st = asyncio.run(app())
    assert st["produced"] == 200 and st["unsaved"] == 0
    got = read_topic(kafka_bootstrap, topic, 200)
    assert got.unique == 200 and set(got.by_id) == set(ids)


def test_async_outage_of_all_brokers_loses_nothing_and_the_loop_keeps_serving(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    """While every broker is down, produce() keeps answering and other tasks keep running; no
    message is lost. How late the loop woke its tasks is printed, not asserted: on a shared
    machine that is a measurement, not a property."""
    topic = make_topic(config={"min.insync.replicas": "2"})
    bs = chaos_cluster.bootstrap_servers
    ticker = Ticker()
    control = Ticker()
    window: dict[str, float] = {}
    control_log = tmp_path / "control-ticks.txt"
    with open(control_log, "w") as sink:  # a file, not a pipe: a full pipe would stall the ticker
        control_proc = subprocess.Popen([sys.executable, "-u", "-c", _CONTROL_TICKER], stdout=sink)

    async def app() -> tuple[list[str], dict[str, Any]]:
        p = await AsyncResilientProducer.create(
            {"bootstrap.servers": bs, **FAST},
            outbox=f"sqlite:///{tmp_path / 'o.db'}",
            retry=RetryPolicy(max_attempts=100, initial_delay=0.5),
            circuit_reset_timeout=1.0,
            drain_poll_interval=0.2,
            lease_seconds=10.0,
        )
        ids: list[str] = []
        answered: list[float] = []  # when each produce() returned
        seq = [0] * 10
        done = asyncio.Event()
        tick = asyncio.create_task(ticker.run())

        async def writer(k0: int) -> None:
            # Four tasks, ~250 msg/s each: a service handling requests while Kafka goes away.
            while not done.is_set():
                for k in range(k0, 10, 4):
                    key, value = keyed_value(k, seq[k])
                    seq[k] += 1
                    ids.append(await p.produce(topic, value, key=key))
                    answered.append(time.monotonic())
                await asyncio.sleep(0.01)

        async def chaos() -> None:
            await asyncio.sleep(1.5)
            window["start"] = time.monotonic()
            await asyncio.to_thread(chaos_cluster.stop_all)  # the test's own blocking calls stay off the loop
            window["down"] = time.monotonic()
            await asyncio.sleep(8.0)
            window["restart"] = time.monotonic()
            await asyncio.to_thread(chaos_cluster.start_all)
            window["end"] = time.monotonic()
            await asyncio.sleep(1.5)
            done.set()

        await asyncio.gather(chaos(), *(writer(k) for k in range(4)))
        assert await p.flush(60) == 0
        st = await wait_drained(p, 120)
        ticker.stopped = True
        await tick
        await p.close()
        window["answered_while_down"] = sum(window["down"] <= t <= window["restart"] for t in answered)
        return ids, st

    try:
        ids, st = asyncio.run(app())
    finally:
        control_proc.terminate()
        control_proc.wait(30)
    lines = control_log.read_text().splitlines()
    control.delays = [(float(t), float(d)) for t, d in (ln.split() for ln in lines if ln.count(" ") == 1)]
    total = len(ids)
    assert st["produced"] == total and st["dead"] == 0
    assert st["outboxed"] > 0, "the outage should have sent messages to the outbox"
    got = read_topic(bs, topic, total)
    lost = set(ids) - set(got.by_id)
    assert not lost, f"lost {len(lost)} of {total} messages"
    w = (window["start"], window["end"])
    down = (window["down"], window["restart"])  # every broker stopped, none stopping or starting
    before = (0.0, window["start"])
    assert window["answered_while_down"] > 0, "no produce() returned while every broker was down"
    assert any(down[0] <= t <= down[1] for t, _ in ticker.delays), "the loop ran no other task while Kafka was down"

    def line(what: str, span: tuple[float, float]) -> str:
        return (
            f"  {what}: this loop {ticker.worst(*span) * 1000:.1f} / {ticker.p99(*span) * 1000:.1f}, "
            f"idle control process {control.worst(*span) * 1000:.1f} / {control.p99(*span) * 1000:.1f}"
        )

    print(
        f"\nasync outage: {total} produced, {got.unique} unique delivered, {got.duplicates} duplicates, "
        f"{st['outboxed']} through the outbox, outage {w[1] - w[0]:.1f} s (brokers fully down "
        f"{down[1] - down[0]:.1f} s); load average {os.getloadavg()[0]:.1f}\n"
        f"event-loop tick delay (5 ms sleeps), max / p99 in ms:\n"
        + "\n".join(
            (
                line("whole outage (incl. broker stop/start)", w),
                line("brokers fully down", down),
                line("before the outage", before),
            )
        )
    )
