"""``python -m benchmarks.pg_long``: a fleet's PostgreSQL outbox over many millions of messages.

Four producer processes in write-ahead mode push `--messages` (20 million by default) at a steady
total `--rate` through one PostgreSQL outbox table, to a real 3-broker cluster (or
``KAFKA_BOOTSTRAP_SERVERS``), keyed over 1,000 keys. Every message is an insert and, once Kafka
acknowledged it, a delete; the drain workers' claims look for rows due meanwhile. Every
`--every` seconds it records:

- spill and drain throughput: messages committed to the outbox and delivered, per second;
- claim latency, p50 and p99 (`outbox_drain_claim_seconds`, each process's metrics);
- the table's, its indexes' and its TOAST's size;
- live and dead tuples and autovacuum runs (`pg_stat_user_tables`), and the age of the oldest
  snapshot any session holds (what keeps vacuum from removing dead rows).

It runs in three phases: plain (`--plain-minutes`); with a second connection holding a
``REPEATABLE READ`` transaction open (`--hold-minutes`), as an analyst's session or a stuck
report would; and after it ended, until every message is produced and delivered. Then the topic
is counted: every message must be there (duplicates are printed, not failed).

The curves go to ``benchmarks/pg-long.png`` and the samples to
``benchmarks/results/<date>-pg-long.json``; the table is printed. Outside ``make test``:
``make bench-pg-long`` (``PG_LONG_ARGS`` for a shorter run).
"""

from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROCESSES = 4
KEYS = 1_000
PARTITIONS = 6
#: What each process's drain workers report their claims in (`outbox.metrics`).
CLAIMS = "outbox_drain_claim_seconds"
PHASES = ("plain", "long transaction", "after")
Result = dict[str, Any]


# -- a producing process ---------------------------------------------------------------------


def child(p: Result) -> None:
    """One producer of the fleet: `n` messages at `rate` msgs/s from `start`, a line every `every` s."""
    from outbox import ResilientProducer
    from outbox.metrics import ProducerCollector

    n, rate, every, index = int(p["n"]), float(p["rate"]), float(p["every"]), int(p["index"])
    producer = ResilientProducer(
        {"bootstrap.servers": p["bootstrap"], "acks": "all", "enable.idempotence": True, "linger.ms": 5},
        outbox=p["outbox"],
        mode="write-ahead",
    )
    metrics = ProducerCollector(producer)
    value = os.urandom(int(p["size"]))
    keys = [b"key-%04d" % k for k in range(KEYS)]
    start = float(p["start"])

    def line(produced: int) -> None:
        claims = next(m for m in metrics.collect() if m.name == CLAIMS)
        buckets = [(s.labels["le"], s.value) for s in claims.samples if s.name.endswith("_bucket")]
        st = producer.stats()
        out = {"t": time.time(), "produced": produced, "delivered": st["delivered"], "claims": buckets}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()

    time.sleep(max(0.0, start - time.time()))
    next_line = start + every
    produced = 0
    tick = 0.01  # messages go out in small steps, so the rate is steady on every scale above 10 ms
    while produced < n:
        due = min(n, int((time.time() - start) * rate) + 1)
        while produced < due:
            producer.produce(p["topic"], value, keys[(produced * PROCESSES + index) % KEYS])
            produced += 1
        now = time.time()
        if now >= next_line:
            line(produced)
            next_line += every
        time.sleep(max(0.0, min(tick, next_line - now)))
    deadline = time.time() + 600
    while producer.stats()["delivered"] < n and time.time() < deadline:
        producer.flush(1)
        if time.time() >= next_line:
            line(produced)
            next_line += every
    line(produced)
    producer.close(30)


# -- the parent: cluster, database, phases, samples --------------------------------------------


@contextmanager
def kafka() -> Iterator[str]:
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    from outbox.testing.cluster import KafkaCluster

    with KafkaCluster(3) as cluster:
        yield cluster.bootstrap_servers


def make_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics(
        [NewTopic(topic, PARTITIONS, 3, config={"min.insync.replicas": "2"})]
    ).values():
        future.result(60)


def records_in_topic(bootstrap: str, topic: str) -> int:
    """Records in the topic: the sum of its partitions' high watermarks (it starts empty)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "pg-long-count"})
    try:
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, k), 30)[1] for k in range(PARTITIONS))
    finally:
        consumer.close()


TABLE_SQL = """
SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid),
       CASE WHEN c.reltoastrelid = 0 THEN 0 ELSE pg_total_relation_size(c.reltoastrelid) END,
       s.n_live_tup, s.n_dead_tup, s.autovacuum_count,
       (SELECT max(age(backend_xmin)) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL)
FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.relname = 'outbox' AND s.schemaname = 'public'
"""


def table_stats(conn: Any) -> Result:
    row = conn.execute(TABLE_SQL).fetchone()
    if row is None:  # before the first process made the table
        return {}
    table, indexes, toast, live, dead, autovacuums, xmin_age = row
    return {
        "table_mb": table / 2**20, "indexes_mb": indexes / 2**20, "toast_mb": toast / 2**20,
        "live": live, "dead": dead, "autovacuums": autovacuums, "oldest_snapshot_xids": xmin_age or 0,
    }


def quantile(buckets: Sequence[tuple[str, float]], q: float) -> float | None:
    """The q-quantile of cumulative histogram buckets (seconds), linear within its bucket."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    bounds = [float(le) for le, _ in buckets]
    counts = [c for _, c in buckets]
    i = bisect.bisect_left(counts, q * total)
    low = bounds[i - 1] if i else 0.0
    high = bounds[i] if bounds[i] != float("inf") else low * 2 or 1.0
    below = counts[i - 1] if i else 0.0
    inside = counts[i] - below
    return float(low + (high - low) * ((q * total - below) / inside if inside else 1.0))


def merge(lines: list[Result], previous: list[Result] | None, every: float) -> Result:
    """One interval's figures over every process: rates and the claims' quantiles."""

    def delta(field: str) -> float:
        now = sum(float(x[field]) for x in lines)
        return now - (sum(float(x[field]) for x in previous) if previous else 0.0)

    les = [le for le, _ in lines[0]["claims"]]
    summed = [sum(x["claims"][k][1] for x in lines) for k in range(len(les))]
    before = [sum(x["claims"][k][1] for x in previous) for k in range(len(les))] if previous else [0.0] * len(les)
    interval = list(zip(les, [a - b for a, b in zip(summed, before, strict=True)], strict=True))
    p50, p99 = quantile(interval, 0.50), quantile(interval, 0.99)
    return {
        "spill_per_s": delta("produced") / every,
        "drain_per_s": delta("delivered") / every,
        "claims": interval[-1][1],
        "claim_p50_ms": None if p50 is None else p50 * 1000,
        "claim_p99_ms": None if p99 is None else p99 * 1000,
        "produced": sum(x["produced"] for x in lines),
        "delivered": sum(x["delivered"] for x in lines),
    }


def run(args: argparse.Namespace) -> Result:
    import psycopg

    from outbox.testing.postgres import create_database, drop_database, ensure_server

    base = ensure_server()
    url = create_database(base, prefix="outbox_pg_long_")
    samples: list[Result] = []
    try:
        with kafka() as bootstrap:
            topic = f"pg-long-{uuid.uuid4().hex[:8]}"
            make_topic(bootstrap, topic)
            per = args.messages // PROCESSES
            start = time.time() + 15  # the processes' imports and connections come before it
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.pg_long", "--child", json.dumps({
                        "n": per, "topic": topic, "rate": args.rate / PROCESSES, "every": args.every, "index": i,
                        "bootstrap": bootstrap, "outbox": url, "size": args.size, "start": start,
                    })],
                    cwd=HERE.parent, stdout=subprocess.PIPE, text=True,
                )
                for i in range(PROCESSES)
            ]
            lines: list[list[Result]] = [[] for _ in procs]
            readers = [threading.Thread(target=_read, args=(pr, lines[i]), daemon=True) for i, pr in enumerate(procs)]
            for r in readers:
                r.start()
            hold_from = start + args.plain_minutes * 60
            hold_until = hold_from + args.hold_minutes * 60
            analyst: Any = None  # the long transaction's connection, while it is open
            try:
                with psycopg.connect(url, autocommit=True) as conn:
                    k = 0
                    while any(pr.poll() is None for pr in procs) or min(map(len, lines)) > k:
                        now = time.time()
                        if analyst is None and hold_from <= now < hold_until:
                            analyst = psycopg.connect(url)
                            analyst.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                            analyst.execute("SELECT count(*) FROM outbox")  # the snapshot is taken here
                        elif analyst is not None and now >= hold_until:
                            analyst.close()  # the transaction ends with its connection
                            analyst = None
                        if min(map(len, lines)) > k:
                            row = merge([x[k] for x in lines], [x[k - 1] for x in lines] if k else None, args.every)
                            phase = PHASES[0] if now < hold_from else PHASES[1] if now < hold_until else PHASES[2]
                            row = {"t": round((k + 1) * args.every), "phase": phase, **row, **table_stats(conn)}
                            samples.append(row)
                            print(format_row(row), flush=True)
                            k += 1
                        time.sleep(0.2)
                    left = conn.execute("SELECT count(*) FROM outbox").fetchone()
            finally:
                if analyst is not None:
                    analyst.close()
                for pr in procs:
                    if pr.poll() is None:
                        pr.kill()
            for pr in procs:
                if pr.wait() != 0:
                    raise SystemExit(f"a producing process failed (exit code {pr.returncode})")
            records = records_in_topic(bootstrap, topic)
    finally:
        drop_database(url, base)
    return {
        "messages": per * PROCESSES, "rate": args.rate, "size": args.size, "every": args.every,
        "plain_minutes": args.plain_minutes, "hold_minutes": args.hold_minutes,
        "held": [hold_from - start, hold_until - start],  # seconds from the start
        "records_in_topic": records, "duplicates": records - per * PROCESSES,
        "left_in_table": left[0] if left else None, "samples": samples,
    }


def _read(proc: subprocess.Popen[str], into: list[Result]) -> None:
    assert proc.stdout is not None
    for text in proc.stdout:
        if text.startswith("{"):
            into.append(json.loads(text))


COLUMNS = (
    ("t", "t s", 0), ("phase", "phase", None), ("spill_per_s", "spill/s", 0), ("drain_per_s", "drain/s", 0),
    ("claim_p50_ms", "claim p50 ms", 1), ("claim_p99_ms", "claim p99 ms", 1), ("table_mb", "table MB", 1),
    ("indexes_mb", "indexes MB", 1), ("toast_mb", "TOAST MB", 1), ("live", "live", 0), ("dead", "dead", 0),
    ("autovacuums", "autovac", 0), ("oldest_snapshot_xids", "snapshot age", 0),
)


def format_row(row: Result) -> str:
    cells = []
    for field, head, digits in COLUMNS:
        v = row.get(field)
        text = "-" if v is None else str(v) if digits is None else f"{v:,.{digits}f}"
        cells.append(text.rjust(max(len(head), 8 if digits is not None else 16)))
    return " ".join(cells)


def plot(result: Result, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    panels = (
        ("msgs/s", (("spill_per_s", "spill"), ("drain_per_s", "drain"))),
        ("claim ms", (("claim_p50_ms", "claim p50"), ("claim_p99_ms", "claim p99"))),
        ("MB", (("table_mb", "table"), ("indexes_mb", "indexes"), ("toast_mb", "TOAST"))),
        ("tuples", (("live", "live"), ("dead", "dead"))),
    )
    held_from, held_until = (x / 60 for x in result["held"])
    for ax, (unit, fields) in zip(axes, panels, strict=True):
        for field, label in fields:
            ax.plot(t, [x.get(field) for x in s], label=label)
        ax.axvspan(held_from, held_until, color="orange", alpha=0.15, label="REPEATABLE READ transaction open")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    axes[-1].set_xlabel("minutes")
    fig.suptitle(
        f"PostgreSQL outbox, {PROCESSES} write-ahead producers, {result['messages']:,} messages "
        f"at {result['rate']:,.0f} msgs/s"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pg_long", description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000_000, help="messages over the fleet (default 20,000,000)")
    ap.add_argument("--rate", type=float, default=8000.0, help="msgs/s over the fleet (default 8,000)")
    ap.add_argument("--size", type=int, default=200, help="value bytes (default 200)")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between samples (default 30)")
    ap.add_argument("--plain-minutes", type=float, default=10.0, help="before the long transaction (default 10)")
    ap.add_argument("--hold-minutes", type=float, default=10.0, help="the transaction's length (default 10)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    heads = " ".join(h.rjust(max(len(h), 8 if d is not None else 16)) for _, h, d in COLUMNS)
    print(heads, flush=True)
    result = run(args)
    stamp = _dt.date.today().isoformat()
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"{stamp}-pg-long.json").write_text(json.dumps(result, indent=1))
    plot(result, HERE / "pg-long.png")
    print(
        f"{result['messages']:,} messages, {result['records_in_topic']:,} records in the topic "
        f"({result['duplicates']:,} duplicates), {result['left_in_table']} rows left in the table; "
        f"curves: {HERE / 'pg-long.png'}"
    )
    return 0 if result["duplicates"] >= 0 and result["left_in_table"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
