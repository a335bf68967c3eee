"""Bulk drain of a kafka-outbox, or replay of its dead letters, into Kafka with PySpark.

After a long outage an outbox can hold millions of messages; one `outbox drain` process is bounded
by one machine. This job reads the rows with Spark's JDBC reader (partitioned by id range),
re-partitions them by (topic, key) hash and sorts by id, so each key's messages leave in their
original order from one executor, and sends them with one idempotent `acks=all` confluent_kafka
producer per Spark partition, with the same headers as the SDK's drain (`outbox-id`,
`outbox-attempt`, `outbox-first-failed-at`, `outbox-last-error`).

Usage::

    python -m spark_drain --outbox sqlite:////var/lib/app/outbox.db --bootstrap-servers k1:9092
    python -m outbox.testing fetch     # once: pinned JDBC drivers (and Kafka) from Maven Central
    spark-submit --jars ~/.cache/kafka-outbox/jdbc-1/libs/postgresql-42.7.14.jar spark_drain/job.py \\
        --outbox 'jdbc:postgresql://db/app?user=outbox' --bootstrap-servers k1:9092 --partitions 16
    python -m spark_drain ... --dead-letters --topic orders --error MSG_TIMED_OUT
    python -m spark_drain ... --dry-run            # count per topic, send nothing
    python -m spark_drain --outbox ... --dead-letters --export /archive/x --purge-after-export   # to Parquet
    python -m spark_drain --bootstrap-servers k1:9092 --from-parquet /archive/x           # replay an archive

    from spark_drain import JobOptions, run_job
    report = run_job(spark, JobOptions(outbox=url, bootstrap_servers=bs, partitions=8))

Running on a cluster:
    * JDBC driver jars: Spark loads the database driver, not Python. `python -m spark_drain` sets
      `spark.jars` to `--jars`, else to the pinned driver that `python -m outbox.testing fetch`
      cached from Maven Central (`org.postgresql:postgresql:42.7.14`, `org.sqlite.JDBC` from
      `org.xerial:sqlite-jdbc:3.54.1.0`), else to Debian's jar in `/usr/share/java` if installed.
      Under spark-submit pass `--jars PATH` (or `--conf spark.jars=...`, or
      `spark.jars.packages=org.postgresql:postgresql:42.7.14`); a missing driver is reported as
      one line saying how to get it. A SQLite outbox is one local file: every executor must
      see it at the same path, so SQLite is for `local[*]` and single-host runs.
    * Python on executors: executors import `outbox` (stores, codec, retry policy) and
      `confluent_kafka`; `PYSPARK_PYTHON` must name an interpreter with kafka-outbox installed
      (`pip install kafka-outbox[spark,postgres]`), on every node, or with its dependencies only
      when the job is shipped with `--py-files` (`python -m spark_drain.bundle DIR` packs it).
      For local masters the command-line entry points set it to the current interpreter when it
      is unset.
    * The outbox URL (password included) is shipped to the executors so they can mark rows;
      it is never logged or printed (`outbox.stores.urls.StoreURL.redacted`).

Guarantees:
    * A row is deleted only after Kafka acknowledged it: each executor collects the acknowledged
      ids and deletes them in batches (`--mark-batch`, default 5,000) with `Outbox.mark_delivered`,
      which is idempotent, so a retried Spark task cannot corrupt state.
    * A failed send counts one attempt and follows the SDK's retry policy (`--max-attempts`,
      `--retry-delay`, `--backoff`): retriable errors leave the row pending with its next attempt
      scheduled; permanent ones (e.g. MSG_SIZE_TOO_LARGE) dead-letter it at once.
    * After a retriable failure, the key's later rows in that task are not sent (left pending,
      untouched), and pending rows behind a not-yet-due row of their key are not selected, so a
      later drain still sends every key in order (the SDK's `claim()` rule).
    * Re-running after a crash resumes: what was acknowledged and marked is gone, everything else
      is still pending. Duplicates are possible (sent, acknowledged, not yet marked when the task
      died; consumers dedup on `outbox-id`); losses are not.
    * `--dead-letters` first puts the selected dead letters back to pending (attempts reset) on
      the driver through the store API, then sends exactly those ids. A crash in between leaves
      them pending, where a re-run without `--dead-letters` or any drain sends them.
    * Pre-flight: an unreachable outbox or Kafka cluster fails with one line before any Spark
      stage runs (the cluster is not checked for `--dry-run`).
    * By default only due rows are sent; due also means "not leased", so rows a running
      `outbox drain` holds are left to it. `--include-not-due` also sends leased and backing-off
      rows (a concurrent drainer may then send some of them too: duplicates, never losses).

Exit status of the command-line entry points (the table of `outbox.exitcodes`, shared with the
`outbox` command; docs/exit-codes.md): 0 all selected rows delivered (or dead-lettered), 1 error,
2 bad command line, 3 some rows were left pending (the cluster did not answer, or rows failed or
were held back): run the job again later.

PySpark is an optional dependency: ``pip install 'kafka-outbox[spark]'``.
"""

from __future__ import annotations

from spark_drain.job import main, preflight, run_job
from spark_drain.options import JobOptions, parse_args
from spark_drain.report import JobReport, TopicCounts

__all__ = ["JobOptions", "JobReport", "TopicCounts", "main", "parse_args", "preflight", "run_job"]
