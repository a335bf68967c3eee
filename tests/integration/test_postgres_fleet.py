"""A fleet on one PostgreSQL outbox, end to end: drainer processes under a broker crash, and the
transactional enqueue of `ResilientProducer.produce(..., transaction=conn)`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from outbox import ATTEMPT_HEADER, ID_HEADER, NewMessage, ResilientProducer, parse_url
from outbox.stores.postgres import PostgresOutbox
from outbox.testing import KafkaCluster

from .delivery import header, keyed_value, read_topic

WORKER = Path(__file__).with_name("fleet_worker.py")
N_WORKERS = 4


def _leader_of_partition_0(bootstrap: str, topic: str) -> int:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return int(admin.list_topics(topic, timeout=10).topics[topic].partitions[0].leader)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def test_four_drainer_processes_on_one_postgres_outbox_while_a_broker_is_killed(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], fresh_postgres_url: str, tmp_path: Path
) -> None:
    """4 drainer processes share 100,000 pending messages (200 keys, in group rows of 1,000 of
    one quarter of the keys each); a partition leader is killed -9 a third of the way through
    and restarted later.

    A group holds its keys until it is settled: with every key in every group (random keys),
    the drainers could only take turns; with groups of different keys, a drainer's claim skips
    the groups another holds and takes the next group of other keys.

    Checks: every row delivered; the outbox-ids Kafka acknowledged to each process are disjoint
    sets whose union is every row (no row was sent by two drainers); any duplicate in the topic
    is a re-send of a failed attempt (its copies carry different outbox-attempt numbers); the
    first arrivals of each key are in enqueue order.

    Measured on the 2-core test host with groups: fill 0.4 s, drain 10.8 s (the broker killed
    at 2 s and serving again at 9 s; the drain includes the 2 s idle stop), the four drainers
    delivering 48k / 17k / 13k / 22k, about 20 s for the test. With message.timeout.ms=10000 the
    failover (~5-10 s) costs no failed send; FLEET_MESSAGE_TIMEOUT_MS=3000 makes the kill time
    out a batch or more (re-sends and duplicates, still in order: the idempotent producer
    writes a partition without gaps). FLEET_MESSAGES sets the row count.
    """
    total = int(os.environ.get("FLEET_MESSAGES", "100000"))
    n_keys = 200
    topic = make_topic(partitions=6, replication_factor=3, config={"min.insync.replicas": "2"})
    bs = chaos_cluster.bootstrap_servers
    url = parse_url(fresh_postgres_url)

    rng = random.Random(5)
    seq = [0] * n_keys
    ids: list[str] = []
    t0 = time.monotonic()
    with PostgresOutbox(url) as store:
        for start in range(0, total, 5000):
            batch = []
            for i in range(start, min(start + 5000, total)):
                # Each 1,000 messages (a group row) are of one quarter of the keys, the next
                # 1,000 of the next quarter: as four producers, each writing its own customers.
                k = (i // 1000 % 4) * (n_keys // 4) + rng.randrange(n_keys // 4)
                key, value = keyed_value(k, seq[k])
                seq[k] += 1
                msg_id = f"fleet-{i}"
                ids.append(msg_id)
                batch.append(NewMessage(topic, value, key, [(ID_HEADER, msg_id.encode())], -1, msg_id))
            store.enqueue(batch)
        fill_seconds = time.monotonic() - t0
        assert store.stats(now=time.time()).pending == total

        reports = [tmp_path / f"worker-{n}.json" for n in range(N_WORKERS)]
        logs = [tmp_path / f"worker-{n}.log" for n in range(N_WORKERS)]
        t_start, wall_start = time.monotonic(), time.time()
        procs = []
        for report, log in zip(reports, logs, strict=True):
            with open(log, "wb") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), fresh_postgres_url, bs, str(report)],
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                    )
                )
        victim: int | None = None
        killed_at = restart_at = restarted_at = None
        killed_after = restart_after = 0
        try:
            deadline = t_start + 480
            while any(p.poll() is None for p in procs):
                assert time.monotonic() < deadline, "the fleet did not drain the outbox in 8 minutes"
                done = total - store.stats(now=time.time()).pending
                now = time.monotonic()
                if victim is None and done >= total // 3:
                    victim = _leader_of_partition_0(bs, topic)
                    chaos_cluster.kill_broker(victim)
                    killed_at, killed_after = now - t_start, done
                elif (
                    victim is not None
                    and restarted_at is None
                    and killed_at is not None
                    and (done >= 2 * total // 3 or now - t_start - killed_at >= 15)
                ):
                    restart_at, restart_after = round(now - t_start, 1), done
                    chaos_cluster.start_broker(victim)  # blocks until it serves (tens of s here)
                    restarted_at = round(time.monotonic() - t_start, 1)
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if victim is not None and restarted_at is None:
                chaos_cluster.start_broker(victim)
        drain_seconds = time.monotonic() - t_start
        for p, log in zip(procs, logs, strict=True):
            assert p.returncode == 0, f"drainer exited with {p.returncode}:\n{_tail(log)}"
        stats = store.stats(now=time.time())
    assert victim is not None, "the broker was never killed"
    assert (stats.pending, stats.dead) == (0, 0)

    workers = [json.loads(r.read_text()) for r in reports]
    acked = [set(w["acked"]) for w in workers]
    assert sum(len(w["acked"]) for w in workers) == total, "a row was acknowledged twice"
    for a in range(N_WORKERS):
        for b in range(a + 1, N_WORKERS):
            both = acked[a] & acked[b]
            assert not both, f"drainers {a} and {b} both sent {len(both)} rows, e.g. {sorted(both)[:5]}"
    assert set().union(*acked) == set(ids)
    assert sum(1 for a in acked if a) >= 2, "the work was not shared between processes"

    got = read_topic(bs, topic, total, timeout=180)
    assert got.unique == total and set(got.by_id) == set(ids), f"{total - got.unique} messages lost"
    # A copy sent twice with the same attempt number would be a row sent twice without a failure
    # in between (two claimers, or a producer retry the idempotent producer failed to dedup).
    same_attempt = [
        mid
        for mid, copies in got.by_id.items()
        if len(copies) > 1 and len({header(m, ATTEMPT_HEADER) for m in copies}) < len(copies)
    ]
    violations = got.order_violations()
    # Fleet throughput over time (what the broker kill and restart cost) and each worker's
    # longest wait between two settled batches.
    per_5s = [0] * (int(drain_seconds) // 5 + 1)
    longest_gap = []
    for w in workers:
        last_t, last_n, gap = wall_start, 0, 0.0
        for t, n in w["settled"]:
            per_5s[min(int(t - wall_start) // 5, len(per_5s) - 1)] += n - last_n
            gap = max(gap, t - last_t)
            last_t, last_n = t, n
        longest_gap.append(round(gap, 1))
    retried = sum(w["retried"] for w in workers)
    print(
        f"\nfleet: {total} rows, {n_keys} keys, fill {fill_seconds:.1f}s, drain {drain_seconds:.1f}s "
        f"({total / drain_seconds:.0f} msg/s incl. the 2 s idle stop); broker {victim} killed at "
        f"{killed_at:.1f}s ({killed_after} done), restarted at {restart_at}s ({restart_after} done), "
        f"serving again at {restarted_at}s\n"
        f"fleet: per worker delivered={[w['delivered'] for w in workers]} "
        f"retried={[w['retried'] for w in workers]} released={[w['released'] for w in workers]}; "
        f"topic: {len(got.messages)} records, {got.duplicates} duplicates, "
        f"{len(same_attempt)} same-attempt duplicates, {len(violations)} keys out of order\n"
        f"fleet: delivered per 5 s {per_5s}; longest wait between settled batches per worker {longest_gap}s"
    )
    assert same_attempt == [], f"{len(same_attempt)} messages sent twice in the same attempt: {same_attempt[:5]}"
    assert got.duplicates == 0 or retried > 0, "duplicates without any failed send"
    assert violations == [], f"{len(violations)} keys out of order, e.g. {violations[0][0]!r}"


@pytest.mark.parametrize("drain_in", ["threads", "process"])
def test_transactional_enqueue_delivers_only_what_the_business_transaction_committed(
    kafka_bootstrap: str, topic: str, fresh_postgres_url: str, drain_in: str
) -> None:
    """...with the drain in this process or in a drain process of its own (which opens the
    PostgreSQL outbox from the URL itself)."""
    url = parse_url(fresh_postgres_url)
    with psycopg.connect(fresh_postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")

    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap, "acks": "all"},
        outbox=fresh_postgres_url,
        drain_workers=1,
        drain_in=drain_in,
        drain_poll_interval=0.2,
    ) as p:
        # Rolled back explicitly.
        with psycopg.connect(fresh_postgres_url) as conn:
            conn.execute("INSERT INTO orders VALUES ('o-1')")
            rolled_back = p.produce(topic, b"o-1 created", key=b"o-1", transaction=conn)
            conn.rollback()
        # Rolled back by an exception leaving the transaction block.
        aborted = ""
        with psycopg.connect(fresh_postgres_url) as conn:
            try:
                with conn.transaction():
                    conn.execute("INSERT INTO orders VALUES ('o-2')")
                    aborted = p.produce(topic, b"o-2 created", key=b"o-2", transaction=conn)
                    raise LookupError("business rule failed after the enqueue")
            except LookupError:
                pass
        # Committed.
        with psycopg.connect(fresh_postgres_url) as conn:
            with conn.transaction():
                conn.execute("INSERT INTO orders VALUES ('o-3')")
                committed = p.produce(
                    topic, b"o-3 created\x00\xff", key=b"o-3", headers=[("trace", b"\x01")], transaction=conn
                )
                # Not visible to the drainer until the commit.
                assert p.store.stats(now=time.time()).pending == 0
            assert conn.execute("SELECT id FROM orders").fetchall() == [("o-3",)]

        deadline = time.monotonic() + 60
        while p.stats()["delivered_from_outbox"] < 1:
            assert time.monotonic() < deadline, "the committed message was not drained"
            time.sleep(0.1)
        # The drainer had every chance to send the rolled-back ones; read the topic after it.
        got = read_topic(kafka_bootstrap, topic, 1, timeout=30)
        st = p.stats()

    assert set(got.by_id) == {committed}, f"topic holds {sorted(got.by_id)}"
    assert rolled_back not in got.by_id and aborted not in got.by_id
    [msg] = got.messages
    assert (msg.key(), msg.value()) == (b"o-3", b"o-3 created\x00\xff")
    assert header(msg, ID_HEADER) == committed.encode()
    assert header(msg, "trace") == b"\x01"
    assert (st["pending"], st["dead"], st["delivered_from_outbox"]) == (0, 0, 1)
    with psycopg.connect(fresh_postgres_url) as conn:
        rows = conn.execute(f'SELECT msg_id FROM "{url.schema}"."{url.table}"').fetchall()
    assert rows == [], "a row of the outbox survived"
