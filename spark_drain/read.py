"""Reading the outbox with Spark's JDBC reader: id bounds, partitioned reads, blockers.

The SQL is the store's own (`outbox.stores.bulk.BulkRead`, from the store's `bulk_read()`): this
module knows how Spark runs it, not the table's layout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from outbox.errors import ConfigError
from outbox.logs import redact_in_logs
from outbox.stores.bulk import BulkRead, explode_keys
from outbox.stores.keyrule import first_blockers
from outbox.stores.registry import jdbc_of
from outbox.stores.urls import StoreURL


def default_jars(url: StoreURL) -> str:
    """The JDBC driver jar for the URL's database on this machine.

    The pinned driver fetched from Maven Central by `python -m outbox.testing fetch` wins, then
    Debian's package (libpostgresql-jdbc-java, libxerial-sqlite-jdbc-java).

    Raises:
        ConfigError: Neither is there.
    """
    from spark_drain.jars import cached_jdbc_jar

    jar = cached_jdbc_jar(url.kind)
    if jar is None:
        raise ConfigError(
            f"no JDBC driver jar for {url.kind} on this machine: run `python -m outbox.testing fetch` "
            "(downloads the pinned drivers from Maven Central) or pass --jars"
        )
    return jar


class Reader:
    """Spark JDBC reads of one outbox."""

    def __init__(self, spark: SparkSession, url: StoreURL, bulk: BulkRead, *, fetch_size: int = 10000) -> None:
        self.spark = spark
        self.url = url
        self.bulk = bulk
        self._jdbc = jdbc_of(url)
        self._props = self._jdbc.properties(url)
        # py4j logs each JVM command, JDBC properties included, at DEBUG.
        redact_in_logs(url.password or "", ("py4j.clientserver", "py4j.java_gateway"))
        # PostgreSQL's driver otherwise buffers a whole partition's result in memory.
        self._props["fetchsize"] = str(fetch_size)

    def _jdbc_url(self) -> str:
        return self._jdbc.url(self.url)

    def query(self, sql: str, schema: str | None = None) -> DataFrame:
        """One unpartitioned query; `schema` ("name TYPE, ...") fixes the column types.

        sqlite-jdbc reports no type for an expression column (MIN(id), COUNT(*)) when the result
        is empty, which Spark reads as NullType and then fails on; a custom schema avoids that.
        """
        props = dict(self._props)
        if schema is not None:
            props["customSchema"] = schema
        return self.spark.read.jdbc(self._jdbc_url(), f"({sql}) AS q", properties=props)

    def bounds(self, where: str, blocked_where: str | None = None) -> tuple[int, int, int, bool]:
        """(min id, max id, messages) of the selection, (0, 0, 0) when it is empty, and whether
        any row matches `blocked_where` (asked in the same query: usually none does, and then
        `blockers` need not run)."""
        sql = self.bulk.bounds(where)
        if blocked_where is not None:
            sql = (
                f"SELECT b.lo, b.hi, b.n, CASE WHEN EXISTS (SELECT 1 FROM {self.bulk.table} WHERE {blocked_where}) "
                f"THEN 1 ELSE 0 END AS blocked FROM ({sql}) AS b"
            )
        else:
            sql = f"SELECT b.lo, b.hi, b.n, 0 AS blocked FROM ({sql}) AS b"
        row = self.query(sql, "lo LONG, hi LONG, n LONG, blocked INT").first()
        blocked = row is not None and bool(row["blocked"])
        if row is None or row["n"] is None or int(row["n"]) == 0:
            return 0, 0, 0, blocked
        return int(row["lo"]), int(row["hi"]), int(row["n"]), blocked

    def rows(
        self, where: str, lo: int, hi: int, partitions: int, extra: dict[str, str] | None = None
    ) -> DataFrame:
        """The selected rows, read in `partitions` slices of the id range [lo, hi] (a group
        is one row with its body: `outbox.stores.bulk.explode` turns it into messages), and the
        table's `extra` columns (name -> Spark type)."""
        n = max(1, min(partitions, hi - lo + 1))
        schema = ", ".join([self.bulk.schema, *(f"{c} {t}" for c, t in (extra or {}).items())])
        return self.spark.read.jdbc(
            self._jdbc_url(),
            f"({self.bulk.rows(where, lo, hi, tuple(extra or ()))}) AS q",
            column="id",
            lowerBound=lo,
            upperBound=hi + 1,
            numPartitions=n,
            properties={**self._props, "customSchema": schema},
        )

    def blockers(self, blocked_where: str) -> dict[tuple[str, bytes], int]:
        """The first not-selected pending message of each key that has one (`outbox.stores.keyrule`):
        one-message rows by SQL, the keys of groups exploded on the executors."""
        rows = self.query(self.bulk.blockers(blocked_where), "b_topic STRING, b_key BINARY, block_id LONG")
        found = [(r[0], bytes(r[1]), int(r[2])) for r in rows.collect()]
        groups_sql = self.bulk.blocking_groups(blocked_where)
        if groups_sql is not None:
            groups = self.query(groups_sql, "id LONG, topic STRING, keys BINARY")
            found += groups.rdd.flatMap(explode_keys).collect()
        return first_blockers(found)

    def ids(self, where: str) -> list[int]:
        """The ids of the selection, collected on the driver."""
        df = self.query(self.bulk.ids(where), "id LONG")
        return [int(r[0]) for r in df.collect()]

    def counts_by_topic(self, where: str) -> dict[str, int]:
        """Messages per topic of a selection (dry runs)."""
        df = self.query(self.bulk.counts_by_topic(where), "topic STRING, n LONG")
        return {r["topic"]: int(r["n"]) for r in df.collect()}


def id_waves(lo: int, hi: int, selected: int, first: int) -> list[tuple[int, int]]:
    """[lo, hi] cut into consecutive id ranges, sent one after the other: the first about `first`
    of the `selected` messages (ids taken as evenly spread), each next one twice the one before,
    the last the rest. One range when `first` is 0 or the selection is not more than twice it.

    Why: a send task starts only once the shuffle before it is complete, so the first message of
    one wave over a large backlog waits for the whole backlog to be read and shuffled.
    """
    if first <= 0 or selected <= 2 * first:
        return [(lo, hi)]
    per_id = (hi - lo + 1) / selected
    waves, start, size = [], lo, first
    while hi - start + 1 > int(size * per_id * 1.5):  # a last wave at least half its size
        end = start + max(1, int(size * per_id)) - 1
        waves.append((start, end))
        start, size = end + 1, size * 2
    waves.append((start, hi))
    return waves


def only_ids(spark: SparkSession, rows: DataFrame, ids: Sequence[int]) -> DataFrame:
    """The rows whose id is in `ids` (the dead letters this run put back to pending)."""
    id_df = spark.createDataFrame([(int(i),) for i in ids], "sel_id LONG")
    right = F.broadcast(id_df) if len(ids) <= 1_000_000 else id_df
    joined = rows.join(right, rows["id"] == id_df["sel_id"], "inner")
    return joined.select(*rows.columns)


def jar_exists(path: str) -> bool:
    """Whether every comma-separated jar path exists (local paths only)."""
    return all(os.path.exists(p) for p in path.split(",") if p and "://" not in p)
