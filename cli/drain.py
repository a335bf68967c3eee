"""`outbox drain`: deliver an outbox's due messages by hand (after an outage, or as a service).

The work is done by `outbox.drain.workers.Drainer`, the same code the SDK's background drainer runs:
rows are claimed with a lease, sent, and deleted only once Kafka acknowledged them, so this
command can run beside a live application on the same outbox.

Ctrl-C: the drainer runs in a worker thread and the main thread only waits and draws the
progress bar, so the interrupt never lands inside a send or a transaction. It sets the stop
event; the drainer settles the batch in flight and releases the leases it still holds.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import click
from confluent_kafka import KafkaError, KafkaException

from outbox.drain.workers import Drainer, DrainResult
from outbox.errors import KafkaUnavailableError
from outbox.retry import RetryPolicy
from outbox.stores import Outbox

from . import backlog
from . import format as fmt
from .common import (
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    EXIT_KAFKA_UNAVAILABLE,
    EXIT_PENDING,
    EXIT_USAGE,
    CliError,
    OutboxCommand,
    bootstrap_option,
    json_option,
    kafka_error_text,
    key_file_option,
    open_store,
    outbox_option,
    settings_option,
    stdout_is_terminal,
)

_DEFAULT_POLICY = RetryPolicy()  # the library's defaults, shown in --help

@click.command(
    "drain",
    cls=OutboxCommand,
    epilog=f"""\b
Examples:
  outbox drain --outbox sqlite:////var/lib/app/outbox.db -b kafka1:9092,kafka2:9092
  OUTBOX_URL=/var/lib/app/outbox.db KAFKA_BOOTSTRAP_SERVERS=kafka:9092 outbox drain --follow
  outbox drain --outbox app.db -b kafka:9093 -X security.protocol=SASL_SSL \\
      -X sasl.mechanism=PLAIN -X sasl.username=app -X sasl.password=...
  outbox drain --outbox app.db -b kafka:9092 --topic orders --max-messages 10000 --json

{EXIT_CODES_HELP}""",
)
@outbox_option
@key_file_option
@bootstrap_option("Kafka brokers to send to.")
@settings_option(
    "A librdkafka producer setting (repeatable), e.g. -X security.protocol=SSL. "
    "Overrides the drain defaults (acks=all, idempotence, message.timeout.ms=30000)."
)
@click.option(
    "--until-empty/--follow",
    "until_empty",
    default=True,
    help="--until-empty (default): stop when no pending message is due; the exit code says whether "
    "any is left. --follow: keep draining new messages until Ctrl-C or SIGTERM (then exit 0).",
)
@click.option("--topic", metavar="TOPIC", help="Drain only this topic's messages.")
@click.option(
    "--max-messages",
    type=click.IntRange(min=1),
    metavar="N",
    help="Stop after about N messages (whole batches are settled, so it may send up to one batch more).",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    metavar="N",
    help="Sending threads, each with its own producer.",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    metavar="N",
    default=_DEFAULT_POLICY.max_attempts,
    show_default=True,
    help="Failed sends (counted in the stored row, across runs) before a message is dead-lettered.",
)
@click.option(
    "--backoff",
    type=click.Choice(["fixed", "exponential"]),
    default=_DEFAULT_POLICY.backoff,
    show_default=True,
    help="Delay between retries of one message.",
)
@click.option(
    "--initial-delay",
    type=click.FloatRange(min=0),
    default=_DEFAULT_POLICY.initial_delay,
    show_default=True,
    metavar="SECONDS",
    help="Delay before the first retry (the fixed delay, or the first exponential step).",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for a broker to answer before giving up (nothing is sent then).",
)
@click.option(
    "--verbose", "-v", is_flag=True, help="Log each failing batch and librdkafka's own messages to stderr."
)
@json_option
def drain(
    outbox_url: str,
    bootstrap_servers: str,
    settings: dict[str, str],
    until_empty: bool,
    topic: str | None,
    max_messages: int | None,
    workers: int,
    max_attempts: int,
    backoff: str,
    initial_delay: float,
    connect_timeout: float,
    verbose: bool,
    as_json: bool,
) -> None:
    """Send the outbox's due messages to Kafka, under the retry policy.

    Each message is leased while it is sent and deleted only after Kafka acknowledged it, so
    drain can run beside a live application using the same outbox, and an interrupted drain
    loses nothing. The cluster is checked first: if no broker answers, nothing is touched and
    the exit code is 3 when messages are pending (0 when none are; 4 with --follow). Messages
    that keep failing are retried later and dead-lettered after --max-attempts failed sends
    (see `outbox dlq`). A progress bar with rate and ETA is shown
    when stdout is a terminal.
    """
    ctx = click.get_current_context()
    config: dict[str, Any] = {"bootstrap.servers": bootstrap_servers, **settings}
    # With --json (and no -v) the SDK's warnings go into the document, so stderr stays empty.
    warnings: list[str] | None = [] if as_json and not verbose else None
    config["logger"] = ctx.with_resource(_routed_logging(verbose, warnings))
    policy = RetryPolicy(max_attempts=max_attempts, backoff=backoff, initial_delay=initial_delay)
    with open_store(outbox_url) as (store, url):
        drainer = Drainer(store, config, retry=policy, workers=workers, topic=topic)
        reached = True
        try:
            drainer.check_cluster(connect_timeout)
        except KafkaUnavailableError as exc:
            pending = _pending(store, topic)
            if pending:
                raise CliError(
                    f"cannot reach Kafka: {exc}; nothing was sent, {pending} message(s) stay pending in "
                    f"{url.redacted()}",
                    EXIT_PENDING,
                ) from exc
            # Exit 3 promises that something is still pending: a retry loop on it would never end.
            # --until-empty has nothing left to do, so it succeeds; --follow cannot follow.
            if not until_empty:
                raise CliError(f"cannot reach Kafka: {exc}; nothing is pending in {url.redacted()}",
                               EXIT_KAFKA_UNAVAILABLE) from exc
            _warn(f"cannot reach Kafka: {exc}; nothing is pending, so nothing was sent", warnings)
            reached = False
        except KafkaException as exc:
            code = EXIT_USAGE if _is_config_error(exc) else EXIT_PENDING
            raise CliError(f"Kafka producer: {kafka_error_text(exc)}", code) from exc

        started = time.time()
        if reached:
            result, interrupted = _run(drainer, store, topic, until_empty, max_messages, as_json)
        else:
            result, interrupted = DrainResult(), False
        remaining = result.remaining  # read once the run ended (for `topic`, if given)
        now = time.time()
        left = store.backlog(now=now, topic=topic) if remaining else None
        next_due = backlog.next_move(left, now) if left is not None else None
        elapsed = time.time() - started

    if as_json:
        click.echo(
            fmt.dumps(
                {
                    "outbox": url.redacted(),
                    "topic": topic,
                    "delivered": result.delivered,
                    "retried": result.retried,
                    "dead": result.dead,
                    "released": result.released,
                    "remaining": remaining,
                    "next_due_at": fmt.iso(next_due),
                    "backlog": None if left is None else backlog.as_json(left),
                    "interrupted": interrupted,
                    "seconds": round(elapsed, 3),
                    "warnings": warnings if warnings is not None else [],
                }
            )
        )
    else:
        rate = result.delivered / elapsed if elapsed > 0 else 0.0
        click.echo(
            f"Delivered {result.delivered}, retried {result.retried}, dead-lettered {result.dead} "
            f"in {fmt.duration(elapsed)} ({rate:.0f} msg/s)."
        )
        if remaining and left is not None:
            click.echo(f"{remaining} message(s) still pending in {url.redacted()}:")
            click.echo("\n".join(f"  {line}" for line in backlog.lines(left)))
        else:
            scope = f" for topic {topic}" if topic else ""
            click.echo(f"Nothing left pending in {url.redacted()}{scope}.")
        if result.dead:
            click.echo("See them with: outbox dlq list", err=True)
    if interrupted and until_empty:
        ctx.exit(EXIT_INTERRUPTED)
    if until_empty and remaining:
        ctx.exit(EXIT_PENDING)


class _OneLine(logging.Formatter):
    """`warning: message` without tracebacks: the command's own error line says the rest."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


class _Collected(logging.Handler):
    """Keeps each record's message in a list: the `warnings` of the --json document."""

    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _warn(text: str, collected: list[str] | None) -> None:
    """A warning of the command's own: on stderr, or into the --json document."""
    if collected is None:
        click.echo(f"warning: {text}", err=True)
    else:
        collected.append(text)


@contextmanager
def _routed_logging(verbose: bool, collected: list[str] | None = None) -> Iterator[logging.Logger]:
    """Route the SDK's and librdkafka's logs to stderr while the command runs: everything with -v,
    else warnings only (into `collected` instead, when given: --json keeps stderr empty).

    librdkafka logs every failed connection attempt (many a second while the cluster is down);
    given a Python logger it logs there instead of straight to fd 2, so without -v those lines
    are dropped and the command's own one-line report is all the operator sees. The loggers are
    put back as they were at the end: a command run inside an application (or a test) leaves
    that process's logging as it found it.
    """
    handler: logging.Handler = logging.StreamHandler(sys.stderr) if collected is None else _Collected(collected)
    verbose_format = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    handler.setFormatter(verbose_format if verbose else _OneLine())
    sdk = logging.getLogger("outbox")
    kafka = logging.getLogger("outbox_cli.librdkafka")
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in (sdk, kafka)]
    sdk.handlers = [handler]
    sdk.setLevel(logging.INFO if verbose else logging.WARNING)
    sdk.propagate = False
    kafka.handlers = [handler] if verbose else [logging.NullHandler()]
    kafka.setLevel(logging.DEBUG if verbose else logging.CRITICAL + 1)
    kafka.propagate = False
    try:
        yield kafka
    finally:
        for lg, handlers, level, propagate in saved:
            lg.handlers = handlers
            lg.setLevel(level)
            lg.propagate = propagate


def _is_config_error(exc: KafkaException) -> bool:
    arg = exc.args[0] if exc.args else None
    return isinstance(arg, KafkaError) and arg.code() == KafkaError._INVALID_ARG


def _pending(store: Outbox, topic: str | None) -> int:
    st = store.stats(now=time.time())
    return st.pending_by_topic.get(topic, 0) if topic is not None else st.pending


#: Set by the `outbox` console script (`outbox_cli.main.main`): the process is ours.
STANDALONE = False


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (systemd, docker stop, kill) stops a drain the same clean way as Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(
    drainer: Drainer,
    store: Outbox,
    topic: str | None,
    until_empty: bool,
    max_messages: int | None,
    as_json: bool,
) -> tuple[DrainResult, bool]:
    """Run the drainer in a worker thread; this thread waits, draws the bar and catches Ctrl-C."""
    stop = threading.Event()
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = drainer.run(until_empty=until_empty, max_messages=max_messages, stop=stop)
        except BaseException as exc:  # re-raised in the main thread, where click handles it
            outcome["error"] = exc
        finally:
            done.set()

    # Waiting on an Event, not Thread.join(): a join() interrupted by Ctrl-C can leave the thread
    # marked as finished while it still runs (CPython < 3.12), and we must wait for the release.
    worker = threading.Thread(target=target, name="outbox-cli-drain", daemon=True)
    interrupted = False
    with _sigterm_as_interrupt():
        bar = None
        if stdout_is_terminal() and not as_json:  # the count (a scan of the store) only for the bar
            pending = _pending(store, topic)
            bar = _Progress(pending if max_messages is None else min(pending, max_messages), follow=not until_empty)
        try:
            worker.start()
            try:
                while not done.wait(0.25):
                    if bar is not None:
                        bar.update(drainer.result, store, topic)
            except KeyboardInterrupt:
                interrupted = True
                stop.set()
                if not as_json:  # with --json the document says it ("interrupted": true)
                    click.echo(
                        "\nStopping: settling the batch in flight and releasing leases "
                        "(Ctrl-C again to quit at once; leases then expire on their own)…",
                        err=True,
                    )
                try:
                    done.wait()
                except KeyboardInterrupt:
                    # Asked twice: quit now. Every store write is one transaction, so nothing is
                    # half-written; rows still leased become due again when the lease expires.
                    click.echo(f"Quit; unreleased leases expire within {drainer.lease_seconds:g}s.", err=True)
                    sys.stderr.flush()
                    os._exit(EXIT_INTERRUPTED)
            if bar is not None:
                bar.update(drainer.result, store, topic)
        finally:
            if bar is not None:
                bar.close()
    if STANDALONE and threading.current_thread() is threading.main_thread():
        # The drain is over: a Ctrl-C now would only kill the report and the clean shutdown (a
        # signal that landed in the interpreter's shutdown ended the command with -SIGINT).
        # Only in the `outbox` process itself: a command invoked in-process leaves signals alone.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"], interrupted


class _Progress:
    """A click progress bar fed from the drainer's running counts (drawn by the main thread)."""

    def __init__(self, total: int, *, follow: bool) -> None:
        self.follow = follow
        self.shown = 0
        self.last_refresh = time.monotonic()
        self.bar = click.progressbar(
            length=max(total, 1),
            label="Draining",
            show_pos=True,
            show_eta=True,
            item_show_func=lambda s: s,
        )
        self.bar.__enter__()

    def update(self, result: DrainResult, store: Outbox, topic: str | None) -> None:
        done = result.delivered + result.dead + result.retried
        if self.follow and time.monotonic() - self.last_refresh > 2.0:
            # New messages keep arriving in follow mode: grow the bar to what is now known.
            self.last_refresh = time.monotonic()
            self.bar.length = max(self.bar.length or 1, done + _pending(store, topic))
        if self.bar.length is not None and done > self.bar.length:
            self.bar.length = done
        step = done - self.shown
        self.shown = done
        self.bar.update(max(step, 0), f"{result.rate:.0f} msg/s")

    def close(self) -> None:
        self.bar.__exit__(None, None, None)
