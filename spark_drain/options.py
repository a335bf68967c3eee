"""Command-line options of the Spark drain job, parsed into a typed `JobOptions`."""

from __future__ import annotations

import argparse
import datetime as dt
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
        max_attempts: failed sends before a row is dead-lettered (the SDK's RetryPolicy).
        retry_delay: seconds before a failed row is due again.
        backoff: "fixed" or "exponential".
        check_timeout: seconds the pre-flight checks wait for the outbox and the cluster.
        master: Spark master when the job builds its own session (`python -m spark_drain`).
        jars: JDBC driver jar(s) when the job builds its own session; default: the URL's pinned
            driver (`spark_drain.jars.cached_jdbc_jar`: the Maven-fetched copy, else Debian's).
        keys: the keys of an encrypted outbox (`--key-file`, else `$OUTBOX_ENCRYPTION_KEYS`), newest
            first; None: none given. Never printed (its repr names key ids only).
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
    max_attempts: int = 3
    retry_delay: float = 3.0
    backoff: str = "fixed"
    check_timeout: float = 10.0
    master: str | None = None
    jars: str | None = None
    keys: KeyRing | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ConfigError(f"--partitions must be at least 1, got {self.partitions}")
        if self.mark_batch < 1:
            raise ConfigError(f"--mark-batch must be at least 1, got {self.mark_batch}")
        if not self.bootstrap_servers.strip():
            raise ConfigError("--bootstrap-servers is empty")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ConfigError("--since must be earlier than --until")
        if self.error is not None and not self.dead_letters:
            raise ConfigError("--error filters dead letters: use it with --dead-letters")
        self.store_url()  # validates the URL now, with the parser's own message

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
        "--outbox", required=True, help="outbox URL (sqlite:///x.db, jdbc:postgresql://host/db, ...)"
    )
    p.add_argument("--bootstrap-servers", "-b", required=True, help="Kafka bootstrap servers")
    p.add_argument("--partitions", type=int, default=4, help="read slices and send tasks (default 4)")
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
        "--jars",
        help=f"JDBC driver jar(s), comma-separated (default: the URL's driver in {JDBC.libs}, fetched by "
        "`python -m outbox.testing fetch`, else Debian's in /usr/share/java)",
    )
    p.add_argument(
        "--key-file", dest="key_files", action="append", default=[], metavar="PATH",
        help="a key of an encrypted outbox (32 bytes, or hex or base64 text); repeatable, the newest first. "
        f"Default: the keys in ${KEYS_ENV} (hex or base64, comma-separated, newest first)",
    )
    return p


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
        max_attempts=ns.max_attempts,
        retry_delay=ns.retry_delay,
        backoff=ns.backoff,
        check_timeout=ns.check_timeout,
        master=ns.master,
        jars=ns.jars,
        keys=given_keys(ns.key_files),
    )
