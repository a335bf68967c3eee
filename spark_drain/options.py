"""Command-line options of the Spark drain job, parsed into a typed `JobOptions`."""

from __future__ import annotations

import argparse
import datetime as dt
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from outbox.errors import ConfigError
from outbox.stores.encryption import KEYS_ENV, KeyRing, given_keys
from outbox.stores.urls import StoreURL, parse_url
from spark_drain.jars import JDBC

#: Producer settings the job uses unless `-X` overrides them; the same as the SDK's drain
#: (idempotent + acks=all: resends inside one producer neither reorder nor duplicate; a 30 s
#: message timeout so a dead cluster turns into retriable failures quickly, not after 300 s).
#: The executors' `SendLoop` lingers at least `outbox.drain.sendloop.RESEND_MIN_LINGER_MS`, as the SDK's.
PRODUCER_DEFAULTS: dict[str, str] = {
    "enable.idempotence": "true",
    "acks": "all",
    "message.timeout.ms": "30000",
}


@dataclass(frozen=True)
class JobOptions:
    """What the job reads, where it sends it, and how.

    Attributes:
        outbox: outbox URL (sqlite:///x.db, jdbc:sqlite:/x.db, postgresql://..., jdbc:postgresql://...).
        bootstrap_servers: Kafka `bootstrap.servers`.
        partitions: JDBC read slices (by id range) and send tasks.
        dead_letters: replay dead letters (they are first put back to pending) instead of draining
            pending rows.
        topics: only these topics (empty: all).
        since: epoch seconds, inclusive lower bound on created_at (pending) / last_failed_at (dead).
        until: epoch seconds, exclusive upper bound, same columns.
        error: dead letters whose last error has this name or code (e.g. MSG_SIZE_TOO_LARGE or 10).
        include_not_due: also send pending rows whose next attempt is in the future.
        dry_run: count per topic, send nothing, change nothing.
        report_path: write the report as JSON here.
        kafka_config: producer settings (`-X key=value`), over `PRODUCER_DEFAULTS`.
        mark_batch: acknowledged ids per mark-delivered transaction on an executor.
        first_wave: messages in the first wave of a drain of pending rows (`spark_drain.read.id_waves`):
            the first send waits for that wave's read and shuffle only. 0: the whole selection in
            one wave.
        max_attempts: failed sends before a row is dead-lettered (the SDK's RetryPolicy).
        retry_delay: seconds before a failed row is due again.
        backoff: "fixed" or "exponential".
        check_timeout: seconds the pre-flight checks wait for the outbox and the cluster.
        master: Spark master when the job builds its own session (`python -m spark_drain`).
        jars: JDBC driver jar(s) when the job builds its own session; default: the URL's pinned
            driver (`spark_drain.jars.cached_jdbc_jar`: the Maven-fetched copy, else Debian's).
        class_cache: when the job launches its own driver JVM, map (or first write) an archive of
            its classes so that it starts faster (`spark_drain.classcache`).
        keys: the keys of an encrypted outbox (`--key-file`, else `$OUTBOX_ENCRYPTION_KEYS`), newest
            first; None: none given. Never printed (its repr names key ids only).
        where: Spark SQL condition over `spark_drain.transform.VIEW` (and `header`): only the
            messages it holds for are sent; the others are left in the outbox untouched.
        sets: (column, Spark SQL expression) pairs, applied in order to the messages selected:
            `value` (a string result is sent as its UTF-8 bytes) or `topic`.
        to_topic: send every selected message to this topic.
        transform: `package.module:function`, an Arrow batch function run on the executors over
            the selected messages (`spark_drain.transform`).
        export: write the selected rows to Parquet at this path (`spark_drain.archive`) instead of
            sending them; nothing in the outbox changes unless `purge_after_export`.
        purge_after_export: delete the exported dead letters once the files are committed.
        from_parquet: send the messages of an archive `export` wrote (no outbox is read: `outbox`
            is empty) instead of an outbox's rows.
    """

    outbox: str
    bootstrap_servers: str
    partitions: int = 4
    dead_letters: bool = False
    topics: tuple[str, ...] = ()
    since: float | None = None
    until: float | None = None
    error: str | None = None
    include_not_due: bool = False
    dry_run: bool = False
    report_path: str | None = None
    kafka_config: dict[str, str] = field(default_factory=dict)
    mark_batch: int = 5000
    first_wave: int = 50_000
    max_attempts: int = 3
    retry_delay: float = 3.0
    backoff: str = "fixed"
    check_timeout: float = 10.0
    master: str | None = None
    jars: str | None = None
    class_cache: bool = True
    keys: KeyRing | None = field(default=None, repr=False, compare=False)
    where: str | None = None
    sets: tuple[tuple[str, str], ...] = ()
    to_topic: str | None = None
    transform: str | None = None
    export: str | None = None
    purge_after_export: bool = False
    from_parquet: str | None = None

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ConfigError(f"--partitions must be at least 1, got {self.partitions}")
        if self.mark_batch < 1:
            raise ConfigError(f"--mark-batch must be at least 1, got {self.mark_batch}")
        if self.first_wave < 0:
            raise ConfigError(f"--first-wave must be 0 or more, got {self.first_wave}")
        if not self.bootstrap_servers.strip() and self.export is None:
            raise ConfigError("--bootstrap-servers is required (it is empty)")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ConfigError("--since must be earlier than --until")
        if self.error is not None and not self.dead_letters:
            raise ConfigError("--error filters dead letters: use it with --dead-letters")
        self._check_changes()
        _check_archive(self)
        if self.from_parquet is None:
            if not self.outbox.strip():
                raise ConfigError("--outbox is required")
            self.store_url()  # validates the URL now, with the parser's own message

    def _check_changes(self) -> None:
        """What can be checked of `where`, `sets`, `to_topic` and `transform` before Spark starts
        (their SQL is checked by Spark, before any row is read)."""
        from spark_drain.transform import SETTABLE, load_transform

        if self.where is not None and not self.where.strip():
            raise ConfigError("--where is empty")
        for name, expr in self.sets:
            if name not in SETTABLE:
                raise ConfigError(f"--set {name}={expr}: cannot set column {name!r}; only "
                                  f"{' and '.join(SETTABLE)} can be set")
            if not expr.strip():
                raise ConfigError(f"--set {name}= has no expression")
        if [n for n, _ in self.sets].count("topic") and self.to_topic is not None:
            raise ConfigError("--to-topic and --set topic=... both set the topic: use one")
        if self.to_topic is not None and not self.to_topic.strip():
            raise ConfigError("--to-topic is empty")
        if self.transform is not None:
            load_transform(self.transform)  # importable on the driver, or a clear error now

    @property
    def changes(self) -> bool:
        """Messages are selected or changed on the executors (`spark_drain.transform`)."""
        return bool(self.where is not None or self.sets or self.to_topic is not None or self.transform)

    def store_url(self) -> StoreURL:
        """The parsed outbox URL."""
        return parse_url(self.outbox)

    def producer_config(self) -> dict[str, str]:
        """The executors' producer configuration (defaults, then `-X` overrides)."""
        conf = dict(PRODUCER_DEFAULTS)
        conf.update(self.kafka_config)
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf


def parse_time(text: str) -> float:
    """Epoch seconds from a number or an ISO-8601 time (naive times are UTC).

    Raises:
        ConfigError: neither form.
    """
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise ConfigError(f"not a time: {text!r} (use epoch seconds or ISO-8601)") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _kv(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return name.strip(), value


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser shared by `python -m spark_drain` and `spark-submit spark_drain/job.py`."""
    p = argparse.ArgumentParser(
        prog="spark_drain",
        description="Drain a kafka-outbox (or replay its dead letters) into Kafka with Spark.",
    )
    p.add_argument(
        "--outbox", default="", help="outbox URL (sqlite:///x.db, jdbc:postgresql://host/db, ...); required unless "
        "--from-parquet"
    )
    p.add_argument("--bootstrap-servers", "-b", default="", help="Kafka bootstrap servers (not for --export)")
    p.add_argument("--partitions", type=int, default=4, help="read slices and send tasks (default 4)")
    p.add_argument(
        "--first-wave", type=int, default=50_000, metavar="MESSAGES",
        help="pending rows are sent in waves of growing size, this many messages first, so that the first send "
        "waits for one small wave's read and shuffle (default 50000; 0: one wave)",
    )
    p.add_argument(
        "--dead-letters", action="store_true", help="replay dead letters instead of pending rows"
    )
    p.add_argument("--topic", action="append", default=[], help="only this topic (repeatable)")
    p.add_argument(
        "--since", help="epoch seconds or ISO-8601: created_at (pending) / last failure (dead) >= this"
    )
    p.add_argument("--until", help="epoch seconds or ISO-8601: created_at / last failure < this")
    p.add_argument("--error", help="dead letters whose last error has this name or code")
    p.add_argument("--include-not-due", action="store_true", help="also send rows still backing off")
    p.add_argument("--dry-run", action="store_true", help="count per topic; send and change nothing")
    p.add_argument("--report", dest="report_path", help="write the report as JSON to this path")
    p.add_argument("-X", dest="kafka", action="append", default=[], type=_kv, metavar="KEY=VALUE",
                   help="producer setting passed to confluent_kafka (repeatable)")
    p.add_argument("--mark-batch", type=int, default=5000, help="acknowledged ids per delete (default 5000)")
    p.add_argument(
        "--max-attempts", type=int, default=3, help="failed sends before dead-lettering (default 3)"
    )
    p.add_argument("--retry-delay", type=float, default=3.0, help="seconds until a failed row is due again")
    p.add_argument("--backoff", choices=("fixed", "exponential"), default="fixed")
    p.add_argument("--check-timeout", type=float, default=10.0, help="pre-flight check timeout, seconds")
    p.add_argument("--master", help="Spark master when not run by spark-submit (default local[*])")
    p.add_argument(
        "--no-class-cache", dest="class_cache", action="store_false",
        help="start the driver JVM without the archive of Spark's classes (spark_drain.classcache) "
        "that makes later launches faster",
    )
    p.add_argument(
        "--jars",
        help=f"JDBC driver jar(s), comma-separated (default: the URL's driver in {JDBC.libs}, fetched by "
        "`python -m outbox.testing fetch`, else Debian's in /usr/share/java)",
    )
    p.add_argument(
        "--key-file", dest="key_files", action="append", default=[], metavar="PATH",
        help="a key of an encrypted outbox (32 bytes, or hex or base64 text); repeatable, the newest first. "
        f"Default: the keys in ${KEYS_ENV} (hex or base64, comma-separated, newest first)",
    )
    p.add_argument(
        "--where", metavar="SQL",
        help="send only the messages this Spark SQL condition holds for (columns topic, key, value, headers, "
        "timestamp, id, attempts, and header['NAME'], a header's value as text); the others stay untouched",
    )
    p.add_argument(
        "--set", dest="sets", action="append", default=[], type=_set, metavar="COLUMN=SQL",
        help="rewrite value or topic of each selected message with a Spark SQL expression, before sending "
        "(repeatable, in order; a string value is sent as UTF-8)",
    )
    p.add_argument("--to-topic", metavar="TOPIC", help="send every selected message to this topic")
    p.add_argument(
        "--transform", metavar="MODULE:FUNCTION",
        help="a function over the selected messages as Arrow record batches (Iterator[pyarrow.RecordBatch] -> "
        "Iterator[pyarrow.RecordBatch], as mapInArrow), run on the executors before sending",
    )
    p.add_argument(
        "--export", metavar="PATH",
        help="write the selected rows (pending, or dead letters with --dead-letters) to Parquet at PATH, a new "
        "directory, partitioned by topic and day, values as stored; send nothing, change nothing",
    )
    p.add_argument(
        "--purge-after-export", action="store_true",
        help="with --export --dead-letters: delete the exported dead letters once the files are written "
        "(audited)",
    )
    p.add_argument(
        "--from-parquet", metavar="PATH",
        help="send the messages of an archive written by --export (no --outbox); sealed ones opened with --key-file",
    )
    return p


def _set(text: str) -> tuple[str, str]:
    from spark_drain.transform import parse_set

    try:
        return parse_set(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> JobOptions:
    """Parse command-line arguments into `JobOptions`.

    Raises:
        ConfigError: a value is invalid (argparse itself exits on unknown flags).
    """
    ns = build_parser().parse_args(argv)
    return JobOptions(
        outbox=ns.outbox,
        bootstrap_servers=ns.bootstrap_servers,
        partitions=ns.partitions,
        dead_letters=ns.dead_letters,
        topics=tuple(ns.topic),
        since=parse_time(ns.since) if ns.since else None,
        until=parse_time(ns.until) if ns.until else None,
        error=ns.error,
        include_not_due=ns.include_not_due,
        dry_run=ns.dry_run,
        report_path=ns.report_path,
        kafka_config=dict(ns.kafka),
        mark_batch=ns.mark_batch,
        first_wave=ns.first_wave,
        max_attempts=ns.max_attempts,
        retry_delay=ns.retry_delay,
        backoff=ns.backoff,
        check_timeout=ns.check_timeout,
        master=ns.master,
        jars=ns.jars,
        class_cache=ns.class_cache,
        keys=given_keys(ns.key_files),
        where=ns.where,
        sets=tuple(ns.sets),
        to_topic=ns.to_topic,
        transform=ns.transform,
        export=ns.export,
        purge_after_export=ns.purge_after_export,
        from_parquet=ns.from_parquet,
    )


def _local(path: str) -> str | None:
    """The local file system path of `path` (None: another file system, e.g. s3a://, hdfs://)."""
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if "://" in path else path


def _check_archive(o: JobOptions) -> None:
    """What can be checked of `--export`, `--purge-after-export` and `--from-parquet` before Spark starts.

    Raises:
        ConfigError: a combination that makes no sense, or a local path that exists (export) or
            does not (replay).
    """
    if o.export is not None and o.from_parquet is not None:
        raise ConfigError("--export and --from-parquet: use one")
    if o.purge_after_export and o.export is None:
        raise ConfigError("--purge-after-export deletes what --export wrote: use it with --export")
    if o.export is not None:
        if not o.export.strip():
            raise ConfigError("--export is empty")
        for flag, given in (("--set", bool(o.sets)), ("--to-topic", o.to_topic is not None),
                            ("--transform", o.transform is not None), ("--dry-run", o.dry_run)):
            if given:
                raise ConfigError(f"--export writes rows as stored and sends nothing: {flag} cannot be used with it "
                                  "(--where chooses the rows)")
        if o.purge_after_export and not o.dead_letters:
            raise ConfigError("--purge-after-export deletes dead letters only: add --dead-letters (pending rows "
                              "are still to be delivered)")
        local = _local(o.export)
        if local is not None and os.path.exists(local):
            raise ConfigError(f"--export {o.export}: already exists; each export writes a new directory")
    if o.from_parquet is not None:
        for flag, given in (("--outbox", bool(o.outbox)), ("--dead-letters", o.dead_letters),
                            ("--since", o.since is not None), ("--until", o.until is not None),
                            ("--include-not-due", o.include_not_due)):
            if given:
                raise ConfigError(f"--from-parquet reads no outbox: {flag} cannot be used with it "
                                  "(--topic and --where choose the messages)")
        local = _local(o.from_parquet)
        if local is not None and not os.path.isdir(local):
            raise ConfigError(f"--from-parquet {o.from_parquet}: no such directory")
