"""Reading the outbox with Spark's JDBC reader: the selection SQL, id bounds, partitioned reads.

Spark's JDBC reader cannot bind parameters, so values are written into the SQL as literals;
every literal goes through `_str` / `_num`, which quote or validate it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from outbox.errors import ConfigError
from outbox.logs import redact_in_logs
from outbox.records import Status
from outbox.urls import StoreURL

from .options import JobOptions

#: What the executors need of a row, in this order (`partition` is a keyword in both databases).
COLUMNS = (
    "id",
    "msg_id",
    "topic",
    "key",
    "value",
    "headers",
    '"partition" AS part',
    "attempts",
    "first_failed_at",
    "last_error",
    "timestamp",
)


def default_jars(url: StoreURL) -> str:
    """The JDBC driver jar for the URL's database on this machine.

    The pinned driver fetched from Maven Central by `python -m outbox.testing fetch` wins, then
    Debian's package (libpostgresql-jdbc-java, libxerial-sqlite-jdbc-java).

    Raises:
        ConfigError: Neither is there.
    """
    from outbox.jars import cached_jdbc_jar

    jar = cached_jdbc_jar(url.kind)
    if jar is None:
        raise ConfigError(
            f"no JDBC driver jar for {url.kind} on this machine: run `python -m outbox.testing fetch` "
            "(downloads the pinned drivers from Maven Central) or pass --jars"
        )
    return jar


def table_ref(url: StoreURL) -> str:
    """The quoted table name (schema-qualified for PostgreSQL)."""
    for ident in (url.schema, url.table):
        if not ident.replace("_", "").isalnum():  # parse_url checks too; this SQL depends on it
            raise ConfigError(f"schema and table names must be letters, digits and _: {ident!r}")
    if url.kind == "sqlite":
        return f'"{url.table}"'
    return f'"{url.schema}"."{url.table}"'


def _str(text: str) -> str:
    if "\x00" in text:
        raise ConfigError("filter values cannot contain NUL characters")
    return "'" + text.replace("'", "''") + "'"


def _num(x: float) -> str:
    if not math.isfinite(x):
        raise ConfigError(f"not a finite time: {x}")
    return repr(float(x))


@dataclass(frozen=True)
class Selection:
    """The rows one run works on.

    Attributes:
        where: SQL condition over the outbox table selecting the rows.
        blocked_where: SQL condition naming PENDING rows that are *not* selected but hold back the
            later rows of their key (per-key order), or None when nothing can block.
    """

    where: str
    blocked_where: str | None


def selection(opts: JobOptions, now: float) -> Selection:
    """The SQL conditions for the run's rows (pending, or dead with `--dead-letters`)."""
    conds: list[str] = []
    outside: list[str] = []  # why a pending row of a selected key may be left out
    if opts.topics:
        conds.append(f"topic IN ({', '.join(_str(t) for t in opts.topics)})")
    if opts.dead_letters:
        conds.insert(0, f"status = {int(Status.DEAD)}")
        column = "last_failed_at"
        if opts.error is not None:
            # The store's own rule (`dead_letter_where`): a code or a name, on its own column.
            if opts.error.lstrip("-").isdigit():
                conds.append(f"error_code = {int(opts.error)}")
            else:
                conds.append(f"error_name = {_str(opts.error.upper())}")
    else:
        conds.insert(0, f"status = {int(Status.PENDING)}")
        column = "created_at"
        if not opts.include_not_due:
            # Due also means "not leased": a running drainer's rows are left to it.
            conds.append(f"next_attempt_at <= {_num(now)}")
            outside.append(f"next_attempt_at > {_num(now)}")
    if opts.since is not None:
        conds.append(f"{column} >= {_num(opts.since)}")
        outside.append(f"{column} < {_num(opts.since)}")
    if opts.until is not None:
        conds.append(f"{column} < {_num(opts.until)}")
        outside.append(f"{column} >= {_num(opts.until)}")
    blocked = None
    if outside and not opts.dead_letters:
        blocked = f"status = {int(Status.PENDING)} AND key IS NOT NULL AND ({' OR '.join(outside)})"
    return Selection(where=" AND ".join(conds), blocked_where=blocked)


class Reader:
    """Spark JDBC reads of one outbox."""

    def __init__(self, spark: SparkSession, url: StoreURL, *, fetch_size: int = 10000) -> None:
        self.spark = spark
        self.url = url
        self.table = table_ref(url)
        self._props = dict(url.jdbc_properties())
        # py4j logs each JVM command, JDBC properties included, at DEBUG.
        redact_in_logs(url.password or "", ("py4j.clientserver", "py4j.java_gateway"))
        # PostgreSQL's driver otherwise buffers a whole partition's result in memory.
        self._props["fetchsize"] = str(fetch_size)

    def _jdbc_url(self) -> str:
        return self.url.jdbc_url()

    def query(self, sql: str, schema: str | None = None) -> DataFrame:
        """One unpartitioned query; `schema` ("name TYPE, ...") fixes the column types.

        sqlite-jdbc reports no type for an expression column (MIN(id), COUNT(*)) when the result
        is empty, which Spark reads as NullType and then fails on; a custom schema avoids that.
        """
        props = dict(self._props)
        if schema is not None:
            props["customSchema"] = schema
        return self.spark.read.jdbc(self._jdbc_url(), f"({sql}) AS q", properties=props)

    def no_groups(self) -> str:
        """SQLite: the condition "a one-message row before the first group" (outbox.stores.grouped)."""
        return (
            f"n = 1 AND id < (SELECT COALESCE(MIN(id), {2**63 - 1}) FROM {self.table} WHERE n > 1)"
        )

    def _count(self) -> str:
        """How a selection counts messages: a SQLite row may hold several (its `n`)."""
        return "SUM(n)" if self.url.kind == "sqlite" else "COUNT(*)"

    def bounds(self, where: str) -> tuple[int, int, int]:
        """(min id, max id, row count) of the selection; (0, 0, 0) when it is empty."""
        sql = f"SELECT MIN(id) AS lo, MAX(id) AS hi, COUNT(*) AS n FROM {self.table} WHERE {where}"
        row = self.query(sql, "lo LONG, hi LONG, n LONG").first()
        if row is None or row["n"] is None or int(row["n"]) == 0:
            return 0, 0, 0
        return int(row["lo"]), int(row["hi"]), int(row["n"])

    def rows(self, where: str, lo: int, hi: int, partitions: int) -> DataFrame:
        """The selected rows, read in `partitions` slices of the id range [lo, hi]."""
        sql = f"SELECT {', '.join(COLUMNS)} FROM {self.table} WHERE {where} AND id BETWEEN {lo} AND {hi}"
        n = max(1, min(partitions, hi - lo + 1))
        # sqlite-jdbc reports a BIGINT column as DECIMAL, which reaches the executors as Decimal.
        props = {**self._props, "customSchema": "timestamp LONG"}
        return self.spark.read.jdbc(
            self._jdbc_url(),
            f"({sql}) AS q",
            column="id",
            lowerBound=lo,
            upperBound=hi + 1,
            numPartitions=n,
            properties=props,
        )

    def blockers(self, blocked_where: str) -> DataFrame:
        """(topic, key, block_id): the first not-selected pending row of each key."""
        return self.query(
            f"SELECT topic AS b_topic, key AS b_key, MIN(id) AS block_id FROM {self.table} "
            f"WHERE {blocked_where} GROUP BY topic, key",
            "b_topic STRING, b_key BINARY, block_id LONG",
        )

    def ids(self, where: str) -> list[int]:
        """The ids of the selection, collected on the driver."""
        df = self.query(f"SELECT id FROM {self.table} WHERE {where}", "id LONG")
        return [int(r[0]) for r in df.collect()]

    def counts_by_topic(self, where: str) -> dict[str, int]:
        """Messages per topic of a selection (dry runs)."""
        sql = f"SELECT topic, {self._count()} AS n FROM {self.table} WHERE {where} GROUP BY topic"
        df = self.query(sql, "topic STRING, n LONG")
        return {r["topic"]: int(r["n"]) for r in df.collect()}


def keep_key_order(rows: DataFrame, blockers: DataFrame) -> DataFrame:
    """Drop rows that an earlier, not-selected pending row of the same key must precede.

    The SDK's claim() follows the same rule: a key's messages leave in id order, so a row waiting
    behind a backing-off one stays in the outbox for a later drain.
    """
    joined = rows.join(
        F.broadcast(blockers),
        (rows["topic"] == blockers["b_topic"]) & (rows["key"] == blockers["b_key"]),
        "left",
    )
    kept = joined.where(F.col("block_id").isNull() | (F.col("id") < F.col("block_id")))
    return kept.select(*rows.columns)


def only_ids(spark: SparkSession, rows: DataFrame, ids: Sequence[int]) -> DataFrame:
    """The rows whose id is in `ids` (the dead letters this run put back to pending)."""
    id_df = spark.createDataFrame([(int(i),) for i in ids], "sel_id LONG")
    right = F.broadcast(id_df) if len(ids) <= 1_000_000 else id_df
    joined = rows.join(right, rows["id"] == id_df["sel_id"], "inner")
    return joined.select(*rows.columns)


def jar_exists(path: str) -> bool:
    """Whether every comma-separated jar path exists (local paths only)."""
    return all(os.path.exists(p) for p in path.split(",") if p and "://" not in p)
