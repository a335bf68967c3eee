"""An outbox's rows archived to Parquet (`--export`), and an archive's messages sent (`--from-parquet`).

Export: the selected rows (pending, or dead letters), one Parquet row per message (a group row
is exploded into its messages), written by Spark under `topic=T/day=YYYY-MM-DD/` (Hive-style
partition directories). The day is UTC, from `created_at` for a pending row and from
`last_failed_at`, its last failure, for a dead letter: the time `--since`/`--until` select by.
Values and headers are as stored: headers in the stores' encoding (`outbox.stores.codec`), and
an encrypted outbox's still sealed with the key its `enc_key` column names, so the archive is as
protected as the outbox. The messages of a sealed group row are opened on the executor that
explodes them and each sealed again with the newest given key, as a one-message row would be.
Nothing in the outbox changes, unless `--purge-after-export`: once Spark committed the files,
the dead letters they hold (their ids read back from the files) are deleted `PURGE_IDS` at a
time, each batch written to the store's audit log as `outbox dlq purge` writes its own.

Replay: the archive's messages go through the job's send stage (`spark_drain.stages`), in outbox
id order per (topic, key), with their `outbox-id` and record timestamp, attempts reset (the
first re-send is attempt 1, as a dead-letter replay). There is no row to settle: each message
is sent once per run, and one not delivered is counted as failed; the run then fails (exit 1)
saying how many. A message behind a retriable failure of its key is not sent (counted as left),
so a consumer never sees a key's messages out of order.
"""

from __future__ import annotations

import datetime as dt
import functools
import getpass
import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from outbox.errors import ConfigError, OutboxError
from outbox.headers import ID_HEADER
from outbox.records import DeadLetterFilter, Status
from outbox.stores import grouped, sealed
from outbox.stores.codec import decode_headers, encode_headers
from spark_drain.stages import cause_of, changed_messages, jdbc_error, send_stage

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from outbox.stores.bulk import BulkRead, Selected
    from outbox.stores.encryption import KeyRing
    from spark_drain.options import JobOptions
    from spark_drain.read import Reader
    from spark_drain.report import JobReport

#: An archive's columns (Spark DDL), one row per message; `topic` and `day` are its partition
#: directories. `headers` are `outbox.stores.codec`-encoded (NULL: none); `status` is "pending" or
#: "dead"; `enc_key` names the key `value` and `headers` are sealed with (NULL: in clear).
ARCHIVE = (
    "id LONG, msg_id STRING, key BINARY, value BINARY, headers BINARY, `partition` INT, timestamp LONG, "
    "status STRING, attempts INT, created_at DOUBLE, first_failed_at DOUBLE, last_failed_at DOUBLE, "
    "last_error STRING, error_code INT, error_name STRING, enc_key STRING, topic STRING, day STRING"
)
ARCHIVE_NAMES = tuple(c.split()[0].strip("`") for c in ARCHIVE.split(", "))
#: The table's columns an export reads beside the message's own (`spark_drain.read.Reader.rows`).
EXTRA = {"status": "INT", "created_at": "DOUBLE", "last_failed_at": "DOUBLE", "error_code": "INT",
         "error_name": "STRING"}
#: What `--where` sees of an export's messages: the archive's columns, `s_value`/`s_headers` as
#: stored, and `value`, `headers` and `header` opened and decoded (`spark_drain.transform.VIEW`).
_WHERE_VIEW = (
    ARCHIVE.replace("value BINARY, headers BINARY", "s_value BINARY, s_headers BINARY")
    + ", value BINARY, headers ARRAY<STRUCT<key: STRING, value: BINARY>>, header MAP<STRING, STRING>"
)


# -- export -----------------------------------------------------------------------------------


def _arrow_schema() -> pa.Schema:
    import pyarrow as pa

    types = (pa.int64(), pa.string(), pa.binary(), pa.binary(), pa.binary(), pa.int32(), pa.int64(), pa.string(),
             pa.int32(), pa.float64(), pa.float64(), pa.float64(), pa.string(), pa.int32(), pa.string(), pa.string(),
             pa.string(), pa.string())
    return pa.schema(list(zip(ARCHIVE_NAMES, types, strict=True)))


def _day(status: int, created: float | None, failed: float | None) -> str:
    """The partition day (UTC) of a row: a dead letter's last failure, a pending row's creation."""
    at = failed if status == Status.DEAD and failed is not None else created
    return dt.datetime.fromtimestamp(at or 0.0, dt.UTC).strftime("%Y-%m-%d")


def archive_batches(ring: KeyRing | None, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body over `BulkRead.rows` with the `EXTRA` columns: the rows as `ARCHIVE`
    batches. A one-message row passes as stored; a group row becomes its messages, each with
    its headers encoded in full and, when the group is sealed, sealed with `ring`'s newest key.

    Raises:
        DecryptionError: a group is sealed with a key `ring` does not hold.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = _arrow_schema()
    for batch in batches:
        if "body" in batch.schema.names:
            singles = batch.filter(pc.is_null(batch.column("body")))
            groups = batch.filter(pc.is_valid(batch.column("body")))
        else:
            singles, groups = batch, batch.slice(0, 0)
        if singles.num_rows:
            col = singles.column
            cols: dict[str, Any] = {n: col(n) for n in ARCHIVE_NAMES if n in singles.schema.names}
            cols["partition"] = col("part")
            statuses = col("status").cast(pa.int32()).to_pylist()
            created, failed = col("created_at").to_pylist(), col("last_failed_at").to_pylist()
            cols["status"] = pa.array([Status(s).name.lower() for s in statuses], pa.string())
            cols["day"] = pa.array([_day(*r) for r in zip(statuses, created, failed, strict=True)], pa.string())
            yield pa.RecordBatch.from_arrays([cols[f.name].cast(f.type) for f in schema], schema=schema)
        if groups.num_rows:
            yield _group_rows(groups, ring, schema)


def _group_rows(groups: pa.RecordBatch, ring: KeyRing | None, schema: pa.Schema) -> pa.RecordBatch:
    """The messages of group rows as one `ARCHIVE` batch."""
    import pyarrow as pa

    out: dict[str, list[Any]] = {n: [] for n in ARCHIVE_NAMES}
    row_cols = ("id", "topic", "body", "enc_key", "status", "created_at", "last_failed_at", "error_code", "error_name")
    for gid, topic, body, kid, status, created, failed, code, name in zip(
        *(groups.column(c).to_pylist() for c in row_cols), strict=True
    ):
        gid, status = int(gid), int(status)
        ids, msg_ids, keys, values, headers, parts, attempts, firsts, errors, stamps = grouped.columns_of(
            sealed.open_body(body, kid, topic, ring, gid), gid
        )
        for i, msg_id in enumerate(msg_ids):
            if headers[i] == grouped.ID_ALONE_HEADERS:  # the common message: its outbox-id header alone
                headers[i] = encode_headers([(ID_HEADER, msg_id.encode())])
            if kid is not None:
                assert ring is not None  # open_body opened the group with it
                values[i], headers[i] = sealed.seal_payload(ring, msg_id, values[i], headers[i])
        n = len(ids)
        for name_, col in (("id", ids), ("msg_id", msg_ids), ("key", keys), ("value", values), ("headers", headers),
                           ("partition", parts), ("timestamp", stamps), ("attempts", attempts),
                           ("first_failed_at", firsts), ("last_error", errors)):
            out[name_] += col
        for name_, value in (("status", Status(status).name.lower()), ("created_at", created),
                             ("last_failed_at", failed), ("error_code", code), ("error_name", name),
                             ("enc_key", None if kid is None or ring is None else ring.current), ("topic", topic),
                             ("day", _day(status, created, failed))):
            out[name_] += [value] * n
    return pa.RecordBatch.from_arrays([pa.array(out[f.name], f.type) for f in schema], schema=schema)


def where_batches(ring: KeyRing | None, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body: `ARCHIVE` batches as `_WHERE_VIEW`, for `--where` (values opened with `ring`).

    Raises:
        DecryptionError: a message is sealed with a key `ring` does not hold.
    """
    import pyarrow as pa

    from spark_drain.transform import _header_type

    for b in batches:
        ids, msg_ids = b.column("id").to_pylist(), b.column("msg_id").to_pylist()
        values, stored = b.column("value").to_pylist(), b.column("headers").to_pylist()
        for i, kid in enumerate(b.column("enc_key").to_pylist()):
            if kid is not None:
                values[i], stored[i] = sealed.open_payload(kid, ids[i], msg_ids[i], values[i], stored[i], ring)
        headers = [decode_headers(h) for h in stored]
        by_name = [
            list({k: None if v is None else v.decode("utf-8", "replace") for k, v in hs}.items()) for hs in headers
        ]
        names = [{"value": "s_value", "headers": "s_headers"}.get(n, n) for n in ARCHIVE_NAMES]
        yield pa.RecordBatch.from_arrays(
            [*(b.column(n) for n in ARCHIVE_NAMES), pa.array(values, pa.binary()),
             pa.array([[{"key": k, "value": v} for k, v in hs] for hs in headers], _header_type()),
             pa.array(by_name, pa.map_(pa.string(), pa.string()))],
            names=[*names, "value", "headers", "header"],
        )


def _read_back(spark: SparkSession, path: str) -> DataFrame:
    """An archive's files as a DataFrame of `ARCHIVE` (the schema given: a topic named like a number stays text)."""
    return spark.read.schema(ARCHIVE).parquet(path)


def export(
    spark: SparkSession, options: JobOptions, report: JobReport, reader: Reader, bulk: BulkRead, sel: Selected,
) -> None:
    """`--export`: write the selection to Parquet; then, with `--purge-after-export`, delete the
    dead letters the committed files hold. Counts go into `report` (`read`: messages written).

    Raises:
        OutboxError: the read or the write failed (nothing was purged), or the purge failed
            part-way (the audit log says what it deleted).
    """
    from pyspark.sql import functions as F


    assert options.export is not None
    report.archive = options.export
    try:
        lo, hi, selected, _ = reader.bounds(sel.where)
        if selected == 0:
            return  # nothing to write: no directory is made
        rows = reader.rows(sel.where, lo, hi, options.partitions, EXTRA)
    except Exception as exc:
        raise jdbc_error(exc, options) from exc
    messages = rows.mapInArrow(functools.partial(archive_batches, options.keys), ARCHIVE)
    if options.where is not None:
        from pyspark.errors import PySparkException

        from spark_drain.transform import _sql_error

        view = messages.mapInArrow(functools.partial(where_batches, options.keys), _WHERE_VIEW)
        try:
            kept = view.where(F.coalesce(F.expr(options.where), F.lit(False)))
        except PySparkException as exc:  # a column an export's messages do not have
            raise ConfigError(f"--where {options.where!r}: {_sql_error(exc)}") from None
        messages = kept.select(*(F.col("s_" + n).alias(n) if n in ("value", "headers") else F.col(n)
                                 for n in ARCHIVE_NAMES))
    # Each (topic, day) from one task, in id order: one file per directory, rows in outbox order.
    out = messages.repartition(options.partitions, "topic", "day").sortWithinPartitions("topic", "day", "id")
    try:
        out.write.partitionBy("topic", "day").mode("errorifexists").parquet(options.export)
    except Exception as exc:
        raise OutboxError(f"writing the archive to {options.export} failed, nothing was purged: "
                          f"{cause_of(exc, options)}") from exc
    written = _read_back(spark, options.export)
    report.add_rows([(t, int(n), 0, 0, 0, 0) for t, n in written.groupBy("topic").count().collect()])
    if options.purge_after_export:
        ids = sorted(int(r[0]) for r in written.select("id").collect())
        report.purged = purge(options, ids)


#: Dead letters one purge transaction deletes, at most (ids bound in one statement: well under
#: SQLite's bound-variable limit, and fewer than `outbox dlq purge`'s `PURGE_BATCH`).
PURGE_IDS = 500


def purge(options: JobOptions, ids: list[int]) -> int:
    """Delete the dead letters `ids` (those still dead), `PURGE_IDS` per transaction, each batch
    an entry of the audit log (action "purge", who `spark_drain:USER`); how many."""
    from outbox.stores import open_outbox

    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = ""
    who = f"spark_drain:{user}" if user else "spark_drain"
    named = {"export": options.export, "dead_letters": True, "topics": list(options.topics), "error": options.error,
             "since": options.since, "until": options.until, "where": options.where}
    total = 0
    with open_outbox(options.store_url(), create=False, encryption=options.keys) as store:
        for i in range(0, len(ids), PURGE_IDS):
            chunk = tuple(ids[i:i + PURGE_IDS])
            n = store.purge_dead(DeadLetterFilter(ids=chunk))
            if n:
                text = json.dumps({**named, "ids": f"{chunk[0]}..{chunk[-1]}"}, sort_keys=True)
                store.add_audit(who=who, action="purge", filter=text, count=n, at=time.time())
            total += n
    return total


# -- replay -----------------------------------------------------------------------------------


def replay(spark: SparkSession, options: JobOptions, report: JobReport) -> None:
    """`--from-parquet`: send an archive's messages (`--topic`, and `--where`/`--set`/`--to-topic`/
    `--transform` as for an outbox); counts go into `report`, nothing is settled.

    Raises:
        ConfigError: the archive holds messages sealed with a key that was not given.
        OutboxError: reading the archive, or a change, failed (nothing was sent); or the send
            stage failed.
    """
    from pyspark.sql import functions as F


    assert options.from_parquet is not None
    archive = _read_back(spark, options.from_parquet)
    if options.topics:
        archive = archive.where(F.col("topic").isin(list(options.topics)))
    try:
        kids = {r[0] for r in archive.where(F.col("enc_key").isNotNull()).select("enc_key").distinct().collect()}
    except Exception as exc:
        raise OutboxError(f"reading the archive {options.from_parquet} failed: {cause_of(exc, options)}") from exc
    missing = sorted(kids - set(options.keys.ids if options.keys is not None else ()))
    if missing:
        raise ConfigError(f"the archive {options.from_parquet} holds messages encrypted with key(s) "
                          f"{', '.join(missing)}: pass each with --key-file PATH; nothing was sent")
    messages = archive.select(
        "id", "msg_id", "topic", "key", "value", "headers", F.col("partition").alias("part"),
        F.lit(0).cast("int").alias("attempts"), "first_failed_at", "last_error", "timestamp", "enc_key",
    )
    if not options.changes:
        if options.dry_run:
            report.add_rows([(t, int(n), 0, 0, 0, 0) for t, n in messages.groupBy("topic").count().collect()])
        else:
            send_stage(options, report, False, messages, {})
        return
    with changed_messages(messages, options, report, replay=True) as (prepared, kept):
        if kept and not options.dry_run:
            send_stage(options, report, False, prepared.where("keep"), {})
