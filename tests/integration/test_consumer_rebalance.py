"""A group's members come and go while a stream flows through the retry ladder, on both group
protocols: three `ResilientConsumer(ordering="key", dedup=True)` processes join one by one, then
leave one by one, while a keyed stream, 1 % of it failing once, is produced. Every message must
take effect once, in each key's produce order, across every hand-off (the effect log of
`outbox.testing.handled`); and a static member restarted within its session keeps its partitions."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO

from confluent_kafka import Message

from outbox import ConfigError, Ignore, ResilientConsumer, ResilientProducer, RetryTopics
from outbox.consumer.tiers import dlq_name, retry_tier_name
from outbox.testing.consume import topic_size
from outbox.testing.handled import check_handled

from ..chaos.consumer_runner import lag
from ..chaos.consumer_worker import DELAYS
from ..group_protocols import group_settings
from .test_consumer import group_name, produce, running, wait_until

WORKER = Path(__file__).parents[1] / "chaos" / "consumer_worker.py"
ROOT = Path(__file__).resolve().parents[2]  # the worker imports this tree's outbox, not an installed one
KEYS = 40


class Member:
    """One consumer process of the group: the chaos schedules' worker (tests/chaos/consumer_worker.py)."""

    def __init__(self, name: str, args: list[str], tmp: Path) -> None:
        self.stats_path = tmp / f"stats-{name}.json"
        self.log = tmp / f"{name}.log"
        self.args = [*args[:4], str(self.stats_path), *args[4:]]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        log: IO[bytes] = open(self.log, "ab")  # noqa: SIM115 - the child keeps it
        with log:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), *self.args], stderr=log, env=env)

    def alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"a consumer exited with {self.proc.returncode}:\n{tail}")

    def stats(self) -> dict[str, int]:
        return json.loads(self.stats_path.read_text()) if self.stats_path.exists() else {}  # type: ignore[no-any-return]

    def owns_partitions(self) -> bool:
        return self.stats().get("assigned", 0) >= 1

    def stop(self) -> int:
        """SIGTERM: it commits and leaves the group; its exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc = None


def applied(db: Path) -> int:
    """Distinct messages that took effect so far."""
    if not db.exists():
        return 0
    with sqlite3.connect(db, timeout=30) as c:
        try:
            return int(c.execute("SELECT count(DISTINCT msg_id) FROM effects").fetchone()[0])
        except sqlite3.OperationalError:  # not created yet
            return 0


def test_three_members_join_and_leave_one_by_one_while_a_failing_stream_flows_every_key_in_order(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=6)
    group = group_name()
    db = tmp_path / "consumer.db"  # one store for the group: the inbox's marks and the effect log
    settings = json.dumps(group_settings(group_protocol, max_poll_interval_ms=30000))
    members = [Member(n, [kafka_bootstrap, topic, group, str(db), "100", settings], tmp_path) for n in "abc"]
    producer = ResilientProducer({"bootstrap.servers": kafka_bootstrap}, outbox=f"sqlite:///{tmp_path / 'p.db'}")
    produced: list[tuple[bytes, str]] = []  # (key, outbox-id) in produce order
    failing: list[bytes] = []
    stop_feeding = threading.Event()
    errors: list[BaseException] = []

    def feed() -> None:
        """Keyed messages ``<key>:<seq>:<fails>`` until told to stop; 1 % fail once."""
        rng = random.Random(848)
        seqs = [0] * KEYS
        try:
            while not stop_feeding.is_set():
                k = rng.randrange(KEYS)
                fails = 1 if rng.random() < 0.01 else 0
                key = b"key-%02d" % k
                value = b"%s:%d:%d" % (key, seqs[k], fails)
                seqs[k] += 1
                produced.append((key, producer.produce(topic, value, key=key)))
                if fails:
                    failing.append(value)
                time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    def alive() -> None:
        for m in members:
            m.alive()

    def more_took_effect() -> None:
        done = applied(db)
        wait_until(lambda: applied(db) >= done + 300, 60, "300 more messages took effect")

    feeding = threading.Thread(target=feed)
    try:
        members[0].start()
        wait_until(members[0].owns_partitions, 90, "the first member owns the partitions")
        feeding.start()
        # Each change of the group lands while the stream flows, once the previous change is done
        # (the new member owns partitions, the leaving one exited) and more messages took effect.
        for joining in members[1:]:
            more_took_effect()
            joining.start()
            wait_until(joining.owns_partitions, 90, "the new member owns partitions")
            alive()
        for leaving in members[:2]:
            more_took_effect()
            assert leaving.stop() == 0, leaving.log.read_text(errors="replace")[-3000:]
            alive()
        more_took_effect()  # the last member alone
        stop_feeding.set()
        feeding.join()
        assert not errors, errors
        assert producer.flush(30) == 0
        wait_until(lambda: applied(db) == len(produced), 120, "every message took effect")
        ladder = [topic, *(retry_tier_name(topic, group, n) for n in range(1, len(DELAYS) + 1))]
        wait_until(lambda: lag(kafka_bootstrap, group, ladder) == 0, 60, "the ladder committed to its end")
        assert members[2].stop() == 0
    finally:
        stop_feeding.set()
        if feeding.is_alive():
            feeding.join()
        for m in members:
            if m.proc is not None:
                m.proc.kill()
                m.proc.wait()
        producer.close()
    with sqlite3.connect(db, timeout=30) as c:
        effects = [r[0] for r in c.execute("SELECT msg_id FROM effects ORDER BY n")]
        pids = {r[0] for r in c.execute("SELECT DISTINCT pid FROM effects")}
    h = check_handled(produced, effects)
    assert h.missing == [], h.summary()
    assert h.twice == {}, f"applied more than once: {list(h.twice.items())[:5]}"
    assert h.reordered == {}, "\n".join(h.first_inversions())
    assert h.unknown == 0, h.summary()
    assert failing, "some messages went through the ladder"
    assert topic_size(kafka_bootstrap, dlq_name(topic, group)) == 0
    assert len(pids) == 3, "each member applied some of the stream"


def test_a_static_member_restarted_within_its_session_keeps_its_partitions(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=4)
    group = group_name()
    handled: list[tuple[str, bytes, int]] = []  # (member, value, partition)

    def member(name: str) -> ResilientConsumer:
        def handle(msg: Message) -> None:
            handled.append((name, msg.value() or b"", msg.partition() or 0))

        return ResilientConsumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol),
             "group.instance.id": f"{group}-{name[0]}"},
            # No retry tiers: the main topic's four partitions are all there is to share, two each.
            topics=[topic], handler=handle, strategy=Ignore(),
            outbox=f"sqlite:///{tmp_path / (name + '.db')}",
        )

    first = [b"first-%03d" % i for i in range(200)]
    second = [b"second-%03d" % i for i in range(200)]

    def by(name: str) -> set[int]:
        return {p for n, _, p in handled if n == name}

    b = member("b")
    with running(b):
        a1 = member("a1")
        with running(a1):
            wait_until(lambda: a1.stats()["assigned"] >= 1, 60, "both members in the group")
            produce(kafka_bootstrap, topic, first)
            wait_until(lambda: len(handled) == len(first) and bool(by("a1")) and bool(by("b")), 60,
                       "the first batch handled by both members")
            time.sleep(2)  # the group settles: any rebalance still under way shows in b's counts
            before = b.stats()
        # a1 closed: a static member's leave keeps its partitions for the session (6 s).
        produce(kafka_bootstrap, topic, second)
        a2 = member("a2")  # the same group.instance.id as a1
        with running(a2):
            wait_until(lambda: len(handled) == len(first) + len(second), 60, "the second batch handled")
            time.sleep(1)  # room for a copy to show
        after = b.stats()
    counts = Counter(v for _, v, _ in handled)
    assert sorted(counts) == sorted(first + second) and set(counts.values()) == {1}, "each message handled once"
    assert (after["assigned"], after["revoked"]) == (before["assigned"], before["revoked"]), (before, after)
    assert by("a2") == by("a1") and not by("a1") & by("b"), (by("a1"), by("a2"), by("b"))


def test_a_setting_group_protocol_consumer_refuses_is_named_in_a_config_error(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = make_topic(partitions=1)
    for name, value in (("session.timeout.ms", 6000), ("heartbeat.interval.ms", 500),
                        ("partition.assignment.strategy", "range")):
        try:
            ResilientConsumer(
                {"bootstrap.servers": kafka_bootstrap, "group.id": group_name(), "group.protocol": "consumer",
                 name: value},
                topics=[topic], handler=print, strategy=RetryTopics(delays=[1]),
                outbox=f"sqlite:///{tmp_path / 'c.db'}",
            )
        except ConfigError as exc:
            assert str(exc).startswith(f"consumer config rejected: `{name}` is not supported for "
                                       "`group.protocol=consumer`"), str(exc)
            assert "\n" not in str(exc) and "KafkaError{" not in str(exc)
        else:
            raise AssertionError(f"{name} was accepted with group.protocol=consumer")
