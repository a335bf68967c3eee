"""The stages every kind of run shares (a drain, a dead-letter replay, an archive's replay):
change the messages on the executors, send them (and settle what Kafka acknowledged), and the
one-line errors a failed Spark stage or JDBC read becomes."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from outbox.errors import ConfigError, OutboxError
from outbox.stores.registry import jdbc_of
from spark_drain.options import JobOptions
from spark_drain.report import JobReport

#: How the innermost line of a failed change starts (`spark_drain.transform.TransformError`).
CHANGE_FAILED = "spark_drain.transform.TransformError"

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame


@contextlib.contextmanager
def changed_messages(
    messages: DataFrame, options: JobOptions, report: JobReport, *, replay: bool,
    explode: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = None,
    blockers: Mapping[tuple[str, bytes], int] | None = None,
) -> Iterator[tuple[DataFrame, int]]:
    """`messages` through `--where`/`--set`/`--to-topic`/`--transform` (`spark_drain.transform.prepare`),
    computed and kept on the executors (memory, then local disk) before the caller sends any:
    a failing expression or transform raises here, with nothing sent. Counts the messages not
    selected in `report.skipped`, and on a dry run the selected ones per topic; yields the
    prepared messages (`keep` marks those to send) and how many are kept, until the caller is
    done with them. With `explode`, `messages` are a grouped store's rows (`spark_drain.transform.prepare`).
    With `blockers` (pending rows, not a replay), a dry run counts as the send stage would
    (`count_would_send`): a message left out holds back its key's later ones.

    Raises:
        OutboxError: a change failed (nothing was sent).
    """
    from pyspark import StorageLevel

    from spark_drain.transform import prepare

    prepared = prepare(messages, options.keys, options.where, options.sets, options.to_topic, options.transform,
                       replay=replay, explode=explode).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        try:
            counts = [tuple(r) for r in prepared.groupBy("topic", "keep").count().collect()]
        except Exception as exc:
            raise _change_failed(cause_of(exc, options)) from exc
        report.skipped = sum(int(n) for _, keep, n in counts if not keep)
        if options.dry_run and blockers is not None:
            count_would_send(report, prepared, blockers)
        elif options.dry_run:
            report.add_rows([(t, int(n), 0, 0, 0, 0) for t, keep, n in counts if keep])
        yield prepared, sum(int(n) for _, keep, n in counts if keep)
    finally:
        prepared.unpersist()


def count_would_send(report: JobReport, messages: DataFrame, blockers: Mapping[tuple[str, bytes], int]) -> None:
    """A dry run's counts of pending messages, as the send stage would make them: per topic the
    messages it would send, and in `report.held_back` those it would hold back.

    The rule is `spark_drain.batches.chunks`': a message waits when an earlier message of its key
    (in the outbox's topic) stays in the outbox, one not selected or not due (`blockers`) or one
    the changes leave out (`keep` false). Counted with a window per key on the executors, so the
    driver holds no message.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    origin = "origin" if "origin" in messages.columns else "topic"
    keep = F.col("keep") if "keep" in messages.columns else F.lit(True)
    rows = messages.select("id", "topic", F.col(origin).alias("o"), "key", keep.alias("keep"))
    first_left = F.min(F.when(~F.col("keep"), F.col("id"))).over(Window.partitionBy("o", "key"))
    rows = rows.withColumn("first", first_left)
    if blockers:
        spark = messages.sparkSession
        found = spark.createDataFrame([(t, k, i) for (t, k), i in blockers.items()], "o STRING, key BINARY, b LONG")
        rows = rows.join(F.broadcast(found), ["o", "key"], "left").withColumn("first", F.least("first", "b"))
    waits = F.coalesce(F.col("key").isNotNull() & (F.col("id") > F.col("first")), F.lit(False))
    counts = rows.where("keep").groupBy("topic", waits.alias("waits")).count().collect()
    report.add_rows([(t, int(n), 0, 0, 0, 0) for t, held, n in counts if not held])
    report.held_back = sum(int(n) for _, held, n in counts if held)


def send_stage(
    options: JobOptions, report: JobReport, grouped: bool, messages: DataFrame,
    blockers: dict[tuple[str, bytes], int],
) -> None:
    """The send stage (and a grouped store's settle stage); its counts go into `report`.
    Messages of an archive (`--from-parquet`) are sent and settled nowhere.

    Raises:
        OutboxError: the stage failed (what Kafka acknowledged before is settled).
    """
    from pyspark.sql import functions as F

    from spark_drain.batches import COUNT_NAMES, COUNTS, SENT
    from spark_drain.send import SendConfig, send_batches, settle_split
    from spark_drain.transform import change_mark

    cfg = SendConfig(
        outbox_url=options.outbox if options.from_parquet is None else None,
        producer_config=options.producer_config(),
        mark_batch=options.mark_batch,
        max_attempts=options.max_attempts,
        retry_delay=options.retry_delay,
        backoff=options.backoff,
        keys=options.keys,
        # What it changed and does not deliver is stored changed; an archive's messages, nowhere.
        changed=change_mark(options.sets, options.to_topic, options.transform, options.where)
        if options.from_parquet is None else None,
    )
    # One task per (topic, key) hash, messages in id order: each key leaves from one producer in
    # its original order. The shuffle and the sort run in the JVM; messages without a key are
    # spread by id. A key is its topic's in the outbox (`origin`), wherever a message is sent.
    topic = "origin" if "origin" in messages.columns else "topic"
    route = F.when(F.col("key").isNull(), F.col("id")).otherwise(F.xxhash64(topic, "key"))
    ordered = messages.repartition(options.partitions, route).sortWithinPartitions("id")
    # Blockers (keys held back by an unselected earlier message) are usually none; each task gets them.
    sender = functools.partial(send_batches, cfg, blockers or None)
    sent = ordered.mapInArrow(sender, SENT)
    # A group's delivered messages, from every send task, settled together (`spark_drain.send`).
    counted = (
        sent.repartition(options.partitions, "grp").mapInArrow(functools.partial(settle_split, cfg), COUNTS)
        if grouped else sent.select(*COUNT_NAMES)
    )
    send_started = time.time()
    try:
        results = [tuple(r) for r in counted.collect()]
    except Exception as exc:
        cause = cause_of(exc, options)
        if cause.startswith(CHANGE_FAILED):
            # The changes run before the shuffle that feeds the send tasks, and Spark starts no
            # task after a shuffle until every task before it succeeded: nothing was sent.
            raise _change_failed(cause) from exc
        if options.from_parquet is not None:
            raise OutboxError(
                f"the send stage failed: {cause}. Messages of the archive may have been sent "
                "before it failed: run the replay again (consumers dedup on outbox-id)"
            ) from exc
        raise OutboxError(
            f"the send stage failed: {cause}. Rows Kafka acknowledged before are marked; "
            "everything else is still pending: run the job again"
        ) from exc
    report.send_seconds += time.time() - send_started
    report.waves += 1
    report.skipped += sum(int(r[6]) for r in results)
    report.add_rows(r[:6] for r in results if any(r[1:6]))  # not a topic whose messages were all skipped


def _change_failed(cause: str) -> OutboxError:
    """The error of a change that failed before anything was sent."""
    return OutboxError(f"changing the messages failed, nothing was sent: {cause}")


def cause_of(exc: Exception, options: JobOptions) -> str:
    """The most telling line of a Spark/Py4J error: the innermost Python or Java exception."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    picked = next(
        (line for line in reversed(lines) if line.startswith(("outbox.errors.", "confluent_kafka.", "spark_drain."))),
        None,
    ) or next((line for line in lines if "Exception:" in line or "Error:" in line), lines[0] if lines else "")
    password = options.store_url().password if options.outbox else None
    if password:
        picked = picked.replace(password, "***")
    return picked[:400] or type(exc).__name__


def jdbc_error(exc: Exception, options: JobOptions) -> Exception:
    """A one-line error for a failed JDBC read (a missing driver jar above all)."""
    if isinstance(exc, OutboxError):
        return exc
    text = str(exc)
    url = options.store_url()
    if "ClassNotFoundException" in text or "No suitable driver" in text:
        return ConfigError(
            f"the JDBC driver for {url.kind} is not on Spark's classpath: give spark-submit "
            f"--packages {jdbc_of(url).package} (or its jar with --jars, or set spark.jars); "
            "`python -m outbox.testing fetch` downloads the pinned drivers"
        )
    return OutboxError(f"reading outbox {url.where()} with Spark JDBC failed: {cause_of(exc, options)}")
