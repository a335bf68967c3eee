"""The Spark drain job: pre-flight checks, read, (replay,) send, report.

Runs three ways: `run_job(spark, options)` inside an existing pipeline, `python -m spark_drain`,
and `spark-submit spark_drain/job.py` (a plain script: no package context, see the top).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a script (spark-submit spark_drain/job.py): make `spark_drain` importable from the
    # checkout this file is in, unless an installed kafka-outbox already provides it.
    try:
        import spark_drain  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools  # noqa: E402
import logging  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from confluent_kafka import KafkaException  # noqa: E402
from confluent_kafka.admin import AdminClient  # noqa: E402

from outbox import exitcodes  # noqa: E402
from outbox.errors import ConfigError, KafkaUnavailableError, MissingDependencyError, OutboxError  # noqa: E402
from outbox.logs import with_librdkafka_log  # noqa: E402
from outbox.records import DeadLetterFilter  # noqa: E402
from outbox.stores import open_outbox  # noqa: E402
from outbox.stores.bulk import BulkRead  # noqa: E402
from outbox.stores.encryption import KEYS_ENV  # noqa: E402
from spark_drain.classcache import DRIVER_JAVA_OPTIONS, ClassCache, class_cache, driver_options_given  # noqa: E402
from spark_drain.options import JobOptions, parse_args  # noqa: E402
from spark_drain.report import JobReport  # noqa: E402
from spark_drain.stages import changed_messages, count_would_send, jdbc_error, send_stage  # noqa: E402

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from outbox.stores.bulk import Selected
    from spark_drain.read import Reader

log = logging.getLogger("spark_drain")
#: The driver JVM compiles with its quick compiler only. Its optimising one spent 5-7 s of CPU
#: per launch, on two cores beside the tasks it delays: at 1,000,000 rows in `local[2]` the job
#: took 15 % less CPU and its first message came 2 s sooner without it; at 4,000,000, 7 % more
#: CPU, still less wall time. A cluster's driver runs no task and only gains.
DRIVER_JIT = "-XX:TieredStopAtLevel=1"
#: Spark's encryption of its local files (shuffle, spills, cached blocks).
IO_ENCRYPTION = "spark.io.encryption.enabled"

_REPLAY_CHUNK = 500  # ids per replay statement: well under SQLite's bound-variable limit

#: Producer settings that also configure an AdminClient (security, addresses), for the check.
_ADMIN_PREFIXES = ("security.", "sasl.", "ssl.", "socket.", "client.", "broker.")


def check_outbox(options: JobOptions) -> None:
    """Fail unless the outbox exists and answers (it is never created here).

    Raises:
        OutboxError: with one line naming the outbox, never its password.
    """
    store = open_outbox(options.store_url(), create=False)
    store.close()


def check_cluster(options: JobOptions) -> None:
    """Fail unless a Kafka broker answers within `options.check_timeout` seconds.

    Raises:
        KafkaUnavailableError: no broker answered.
    """
    conf: dict[str, str | int | float | bool] = {
        k: v for k, v in options.producer_config().items() if k.startswith(_ADMIN_PREFIXES)
    }
    conf["bootstrap.servers"] = options.bootstrap_servers
    admin = AdminClient(with_librdkafka_log(conf))
    try:
        md = admin.list_topics(timeout=options.check_timeout)
    except KafkaException as exc:
        raise KafkaUnavailableError(
            f"no Kafka broker answered at {options.bootstrap_servers} within {options.check_timeout:g}s "
            f"({exc.args[0].name() if exc.args else exc})"
        ) from exc
    if not md.brokers:
        raise KafkaUnavailableError(f"no Kafka broker is up at {options.bootstrap_servers}")


def preflight(options: JobOptions) -> None:
    """The checks before any Spark stage: outbox reachable (unless the messages come from an
    archive), and cluster up (unless a dry run or an export: nothing is sent)."""
    if options.from_parquet is None:
        check_outbox(options)
    if not options.dry_run and options.export is None:
        check_cluster(options)


def run_job(spark: SparkSession, options: JobOptions, *, check: bool = True) -> JobReport:
    """Drain an outbox (or replay its dead letters) into Kafka on the given Spark session.

    Args:
        spark: a `pyspark.sql.SparkSession` whose executors can import kafka-outbox and load the
            JDBC driver of the outbox's database.
        options: what to read and where to send it.
        check: run `preflight` first (the CLI entry points already did).

    Returns:
        The per-topic counts; `report.ok` is False when rows were left pending or dead-lettered.

    Raises:
        OutboxError: the outbox or the cluster is unreachable, or an option is invalid.
    """
    _require_pyspark()
    from outbox.stores.bulk import BulkSelection
    from spark_drain.read import Reader, id_waves, only_ids

    if check:
        preflight(options)
    if options.keys is not None and spark.conf.get(IO_ENCRYPTION, "false") != "true":
        log.warning("%s is off: the decrypted messages Spark shuffles or caches are written to the executors' "
                    "local disks in clear; set it to true", IO_ENCRYPTION)
    if options.changes:
        from spark_drain.transform import DECODED, apply_sql

        # Their SQL checked on no rows: a bad expression stops the job before anything is read.
        apply_sql(spark.createDataFrame([], DECODED), options.where, options.sets, options.to_topic)
    started = time.time()
    selection = "dead-letters" if options.dead_letters else "pending"
    if options.from_parquet is not None:
        from spark_drain.archive import replay

        report = JobReport(mode="archive", dry_run=options.dry_run, outbox=options.from_parquet,
                           partitions=options.partitions)
        replay(spark, options, report)
        report.elapsed_seconds = time.time() - started
        return report
    url = options.store_url()
    report = JobReport(
        mode="export" if options.export is not None else selection,
        dry_run=options.dry_run,
        outbox=url.redacted(),
        partitions=options.partitions,
    )
    bulk = _bulk_read(options)
    reader = Reader(spark, url, bulk)
    sel = bulk.selection(
        BulkSelection(
            dead_letters=options.dead_letters, topics=tuple(options.topics), error=options.error,
            since=options.since, until=options.until,
            # An export archives every pending row, due or not: nothing is sent.
            include_not_due=options.include_not_due or options.export is not None,
        ),
        now=started,
    )
    if options.export is not None:
        from spark_drain.archive import export

        report.exported_from = selection
        export(spark, options, report, reader, bulk, sel)
        report.elapsed_seconds = time.time() - started
        return report
    if options.changes:
        return _run_changed(spark, options, report, bulk, reader, sel, started)
    pending = None
    try:
        if options.dry_run:
            _count_dry_run(options, report, bulk, reader, sel)
            report.elapsed_seconds = time.time() - started
            return report

        if options.dead_letters:
            ids = reader.ids(sel.where)
            report.replayed = _replay(options, ids)
            if not ids:
                report.elapsed_seconds = time.time() - started
                return report
            rows = only_ids(spark, reader.rows("status = 0", min(ids), max(ids), options.partitions), ids)
        else:
            pending = _read_pending(reader, sel)
            if pending is None:
                report.elapsed_seconds = time.time() - started
                return report
    except Exception as exc:
        raise jdbc_error(exc, options) from exc

    if pending is None:  # the dead letters just put back to pending
        send_stage(options, report, bulk.grouped, _messages(rows, options, bulk), {})
    else:
        lo, hi, selected, blockers = pending
        _send_waves(options, report, bulk, reader, sel.where, id_waves(lo, hi, selected, options.first_wave),
                    blockers)
        report.held_back = max(0, selected - report.total.read)
    report.elapsed_seconds = time.time() - started
    return report


def _count_dry_run(options: JobOptions, report: JobReport, bulk: BulkRead, reader: Reader, sel: Selected) -> None:
    """What a run would send, per topic. Dead letters are all sent (put back to pending first).
    Pending rows behind an earlier row of their key that is not selected or not due are held
    back, as the run holds them (`count_would_send`); when no such row exists (the usual case),
    the counts come from SQL alone."""
    blockers: dict[tuple[str, bytes], int] = {}
    if not options.dead_letters:
        pending = _read_pending(reader, sel)
        if pending is None:
            return
        lo, hi, _, blockers = pending
        if blockers:
            count_would_send(report, _messages(reader.rows(sel.where, lo, hi, options.partitions), options, bulk),
                             blockers)
            return
    for topic, n in reader.counts_by_topic(sel.where).items():
        report.add_rows([(topic, n, 0, 0, 0, 0)])


def _send_waves(
    options: JobOptions, report: JobReport, bulk: BulkRead, reader: Reader, where: str,
    waves: list[tuple[int, int]], blockers: dict[tuple[str, bytes], int],
) -> None:
    """Pending rows, read and sent one id range after the other (`spark_drain.read.id_waves`).

    A key's messages of one wave are all sent before the next wave is read, so each key leaves in
    outbox order. A wave that leaves a row pending (a retriable failure, or unacknowledged) ends
    the run: its key's later messages would otherwise overtake it. The later waves' rows stay
    pending for the next run, counted as left (`report.not_sent`).
    """
    for n, (lo, hi) in enumerate(waves):
        send_stage(options, report, bulk.grouped, _messages(reader.rows(where, lo, hi, options.partitions),
                                                            options, bulk), blockers)
        t = report.total
        if t.failed + t.left and n + 1 < len(waves):
            start = waves[n + 1][0]
            try:
                rest = reader.counts_by_topic(f"({where}) AND id BETWEEN {start} AND {waves[-1][1]}")
            except Exception as exc:
                raise jdbc_error(exc, options) from exc
            report.add_rows((topic, k, 0, 0, 0, k) for topic, k in rest.items())
            report.not_sent = sum(rest.values())
            log.warning("a wave left %d row(s) pending after a failure: %d later row(s) were not sent and stay "
                        "pending, in order; run the job again", t.failed + t.left, report.not_sent)
            return


def _messages(rows: DataFrame, options: JobOptions, bulk: BulkRead) -> DataFrame:
    """The rows read as messages (`spark_drain.batches.MESSAGES`, sealed payloads still sealed)."""
    from pyspark.sql import functions as F

    from spark_drain.batches import GROUPED_MESSAGES, MESSAGES, SEALED

    # Rows become messages on the executors (a group row: its messages), as Arrow batches; the
    # driver never holds a message's bytes.
    return rows.mapInArrow(_exploder(options), GROUPED_MESSAGES) if bulk.grouped \
        else rows.select(*(F.col(c).cast(t) for c, t in (col.split() for col in (MESSAGES + SEALED).split(", "))))


def _exploder(options: JobOptions) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The `mapInArrow` body that turns a grouped store's rows into messages (`spark_drain.batches`).

    An encrypted outbox's key ring travels inside it, pickled into the tasks (docs/encryption.md,
    "Spark"): never in the Spark conf, the arguments or a log.
    """
    from spark_drain.batches import explode_batches

    return functools.partial(explode_batches, options.keys)


def _run_changed(
    spark: SparkSession, options: JobOptions, report: JobReport, bulk: BulkRead, reader: Reader,
    sel: Selected, started: float,
) -> JobReport:
    """`run_job` when messages are selected or changed on the executors (`spark_drain.transform`).

    Pending rows: the changes run in the stage before the shuffle that gives each key its send
    task, and Spark starts no send task until every task of that stage succeeded, so a failing
    expression or transform stops the job with nothing sent and no row changed. Dead letters: the
    changed messages are computed and kept on the executors (memory, then local disk) first,
    because the selected ones are put back to pending before any is sent. A dead letter not
    selected stays dead; a pending row not selected stays pending and holds back its key's later
    messages.
    """
    try:
        pending = _read_pending(reader, sel)
    except Exception as exc:
        raise jdbc_error(exc, options) from exc
    if pending is None:
        report.elapsed_seconds = time.time() - started
        return report
    lo, hi, selected, blockers = pending
    rows = reader.rows(sel.where, lo, hi, options.partitions)
    # A grouped store's rows are exploded in the first Python pass of the changes (`prepare`).
    messages, explode = (rows, _exploder(options)) if bulk.grouped else (_messages(rows, options, bulk), None)
    if not options.dry_run and not options.dead_letters:
        from spark_drain.transform import prepare

        prepared = prepare(messages, options.keys, options.where, options.sets, options.to_topic, options.transform,
                           replay=False, explode=explode)
        send_stage(options, report, bulk.grouped, prepared, blockers)
        report.held_back = max(0, selected - report.skipped - report.total.read)
        report.elapsed_seconds = time.time() - started
        return report
    # A dry run (changed_messages counts what would be sent), or dead letters.
    with changed_messages(messages, options, report, replay=options.dead_letters, explode=explode,
                          blockers=None if options.dead_letters else blockers) as (prepared, _):
        if not options.dry_run:
            ids = [int(r[0]) for r in prepared.where("keep").select("id").collect()]
            report.replayed = _replay(options, ids)
            if ids:
                send_stage(options, report, bulk.grouped, prepared.where("keep"), {})
    report.elapsed_seconds = time.time() - started
    return report


def _read_pending(reader: Reader, sel: Selected) -> tuple[int, int, int, dict[tuple[str, bytes], int]] | None:
    """The id bounds of the selected pending rows, how many messages, and the keys an unselected
    earlier message holds back (`Reader.blockers`, usually none: nothing backs off); None when
    nothing is selected."""
    lo, hi, selected, blocking = reader.bounds(sel.where, sel.blocked_where)
    if selected == 0:
        return None
    blockers = reader.blockers(sel.blocked_where) if blocking and sel.blocked_where is not None else {}
    return lo, hi, selected, blockers


def _bulk_read(options: JobOptions) -> BulkRead:
    """How the store describes its table to a bulk reader (`Outbox.bulk_read`).

    Raises:
        ConfigError: the store has no table a JDBC reader can read, or it holds rows encrypted
            with a key the job was not given (checked before anything is sent).
    """
    store = open_outbox(options.store_url(), create=False)
    try:
        if not store.capabilities.bulk_read:
            raise ConfigError(f"outbox {store.location} cannot be read by Spark (no database table)")
        given = options.keys.ids if options.keys is not None else ()
        missing = sorted(set(store.encrypted_key_ids()) - set(given))
        if missing:
            raise ConfigError(
                f"outbox {store.location} holds messages encrypted with key(s) {', '.join(missing)}, "
                f"which {'are not among the given keys' if given else 'no key was given for'}: pass each "
                f"with --key-file PATH (or list them in ${KEYS_ENV}); nothing was sent"
            )
        return store.bulk_read()
    finally:
        store.close()


def _replay(options: JobOptions, ids: Sequence[int]) -> int:
    """Put the selected dead letters back to PENDING (attempts reset) before they are sent.

    Done first and on the driver through the store API: a crash after this point leaves them
    pending, where a re-run (or any drain) sends them. Nothing is lost either way.
    """
    if not ids:
        return 0
    n = 0
    now = time.time()
    store = open_outbox(options.store_url(), create=False, encryption=options.keys)
    try:
        for i in range(0, len(ids), _REPLAY_CHUNK):
            n += store.replay_dead(DeadLetterFilter(ids=tuple(ids[i : i + _REPLAY_CHUNK])), now=now)
    finally:
        store.close()
    return n


#: Set by spark-submit for the Python driver it starts (PySpark joins that JVM through it).
SUBMIT_GATEWAY_ENV = "PYSPARK_GATEWAY_PORT"

#: What to do when PySpark is missing (it is an optional dependency of kafka-outbox).
PYSPARK_HINT = "PySpark is not installed: pip install 'kafka-outbox[spark]'"


def _require_pyspark() -> None:
    """Fail with the install hint, not a ModuleNotFoundError traceback, when PySpark is missing.

    Raises:
        OutboxError: PySpark cannot be imported.
    """
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise OutboxError(PYSPARK_HINT) from None


def build_session(options: JobOptions) -> tuple[SparkSession, ClassCache | None]:
    """A SparkSession for the command-line entry points, with the JDBC driver jar configured, and
    the driver JVM's class archive when this launch starts that JVM (`spark_drain.classcache`).

    Under spark-submit the master and jars come from spark-submit; `python -m spark_drain` runs
    `local[*]` unless `--master` says otherwise.
    """
    _require_pyspark()
    from pyspark.sql import SparkSession

    from spark_drain.read import default_jars, jar_exists

    # An archive's replay reads Parquet only: no JDBC driver unless given. Under spark-submit the
    # driver is spark-submit's business (--jars, --packages, spark.jars): a default here would
    # replace what it put on the classpath.
    submitted = SUBMIT_GATEWAY_ENV in os.environ
    needs_driver = options.from_parquet is None and not submitted
    jars = options.jars or (default_jars(options.store_url()) if needs_driver else "")
    if jars and not jar_exists(jars):
        raise ConfigError(f"JDBC driver jar not found: {jars} (run `python -m outbox.testing fetch` or pass --jars)")
    master = options.master or os.environ.get("MASTER")
    if master is None or master.startswith("local"):
        # Local executors are forks of this interpreter's PySpark workers: use this Python so
        # that they import the same kafka-outbox.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("kafka-outbox spark_drain")
    if options.master:
        builder = builder.master(options.master)
    if jars:
        builder = builder.config("spark.jars", jars)
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    if options.keys is not None:
        # An encrypted outbox's messages cross the shuffle (and the changes' cache) in clear:
        # Spark encrypts those local files, so nothing decrypted lands on an executor's disk.
        builder = builder.config(IO_ENCRYPTION, "true")
    cache = None
    if not submitted and not _driver_options_given():
        java = [DRIVER_JIT]
        cache = class_cache() if options.class_cache else None
        if cache is not None:
            java.append(cache.java_options)
        builder = builder.config(DRIVER_JAVA_OPTIONS, " ".join(java))
    return builder.getOrCreate(), cache


def _driver_options_given() -> bool:
    """Whether the Spark configuration this launch reads already sets the driver's Java options."""
    from pathlib import Path

    conf_dir = os.environ.get("SPARK_CONF_DIR") or (
        os.path.join(os.environ["SPARK_HOME"], "conf") if "SPARK_HOME" in os.environ else None
    )
    if conf_dir is None:
        import pyspark

        conf_dir = os.path.join(os.path.dirname(pyspark.__file__), "conf")
    return driver_options_given(os.environ.get("PYSPARK_SUBMIT_ARGS"), Path(conf_dir))


def _driver_jvm() -> subprocess.Popen[bytes] | None:
    """The driver JVM this process launched (PySpark keeps its Popen on the gateway)."""
    from pyspark import SparkContext

    return getattr(SparkContext._gateway, "proc", None)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns an exit status of `outbox.exitcodes` (as `outbox drain`).

    0: every selected row was delivered (or dead-lettered); 1: error; 2: bad command line;
    3: rows are still pending (the cluster did not answer, or rows failed or were held back):
    run the job again later.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        options = parse_args(argv)
    except ConfigError as exc:  # a MissingDependencyError too (--key-file without `cryptography`): exit 1
        return _fail(exc, exitcodes.ERROR if isinstance(exc, MissingDependencyError) else exitcodes.USAGE)
    try:
        preflight(options)
        spark, cache = build_session(options)
    except KafkaUnavailableError as exc:
        return _fail(exc, exitcodes.PENDING)  # nothing was sent: every selected row is still pending
    except OutboxError as exc:
        return _fail(exc, exitcodes.ERROR)
    try:
        return _run_and_report(spark, options)
    finally:
        if cache is not None:
            cache.keep(_driver_jvm())  # after the report: the first run's JVM writes its archive as it exits


def _run_and_report(spark: SparkSession, options: JobOptions) -> int:
    """`main`'s job on its session: run, stop the session, print the report; the exit status."""
    try:
        report = run_job(spark, options, check=False)
    except OutboxError as exc:
        return _fail(exc, exitcodes.ERROR)
    finally:
        spark.stop()
    print(report.format_table(), flush=True)
    if options.report_path:
        report.write_json(options.report_path)
    if options.from_parquet is not None and not report.ok:
        # Nothing keeps an archive's message that was not delivered: say so, and fail.
        t = report.total
        print(f"spark_drain: error: {t.failed + t.left} of {t.read} messages of the archive were not delivered "
              f"({t.failed} failed, {t.left} not sent after a failure of their key): run the replay again "
              "(consumers dedup on outbox-id)", file=sys.stderr, flush=True)
        return exitcodes.ERROR
    return exitcodes.OK if report.ok else exitcodes.PENDING


def _fail(exc: OutboxError, code: int) -> int:
    print(f"spark_drain: error: {exc}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
