"""No secret reaches any text the product prints or returns.

Secrets: `sasl.password`, `ssl.key.password`, and the password of a PostgreSQL URL (a private
server of our own, whose superuser really has it). Every path that produces text is driven and
collected — DEBUG logs of every logger (librdkafka's `debug=all` included), `stats()`, `repr()`
of the producer, drainer and stores, exceptions with their tracebacks, every CLI command and its
errors (in process and as the installed script), the Spark job's output and report — and no
secret may appear in any of it.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from outbox_cli.main import cli

from outbox import Drainer, NewMessage, OutboxError, ResilientProducer, RetryPolicy
from outbox.stores import open_outbox
from outbox.stores.postgres import PostgresOutbox

from .private_pg import PrivatePostgres
from .test_cli_kafka import OUTBOX

SASL_PW = "sasl-S3cret-7f3a9"
KEY_PW = "sslkey-S3cret-91b2e"
PG_PW = "Pg-S3cret-4c1d8"
SECRETS = (SASL_PW, KEY_PW, PG_PW)

SASL = {
    "security.protocol": "SASL_PLAINTEXT",
    "sasl.mechanism": "PLAIN",
    "sasl.username": "app",
    "sasl.password": SASL_PW,
    "ssl.key.password": KEY_PW,
}


class Collected:
    """Every piece of text the test saw, checked at the end."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str]] = []

    def add(self, where: str, text: object) -> None:
        self.texts.append((where, str(text)))

    def exception(self, where: str, exc: BaseException) -> None:
        self.add(where, "".join(traceback.format_exception(exc)))
        self.add(where + " repr", repr(exc))

    def assert_clean(self) -> None:
        leaks = [(where, s) for where, text in self.texts for s in SECRETS if s in text]
        assert not leaks, f"secrets in: {sorted({w for w, _ in leaks})}"
        assert len(self.texts) > 20  # the test really collected what it claims


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres(PG_PW)
    pg.start()
    yield pg
    pg.close()


@pytest.fixture
def all_logs() -> Iterator[io.StringIO]:
    """Every log record of every logger, at DEBUG, formatted with tracebacks."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield buf
    root.removeHandler(handler)
    root.setLevel(old)


def cli_run(seen: Collected, *argv: str) -> int:
    result = CliRunner().invoke(cli, list(argv), env={"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""})
    seen.add(f"cli {argv[:2]} output", result.output)
    seen.add(f"cli {argv[:2]} stderr", result.stderr)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        seen.exception(f"cli {argv[:2]} exception", result.exception)
    return result.exit_code


def test_no_secret_in_sdk_text_logs_or_cli(
    private_pg: PrivatePostgres, kafka_bootstrap: str, topic: str, all_logs: io.StringIO, tmp_path: Path
) -> None:
    seen = Collected()
    url = private_pg.url
    assert PG_PW in url

    # The SDK: a producer whose SASL handshake cannot succeed (the cluster speaks PLAINTEXT), so
    # everything goes through failures, the circuit and the PostgreSQL outbox.
    p = ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap, "message.timeout.ms": 2000, "debug": "all", **SASL},
        outbox=url, drain_workers=1, drain_poll_interval=0.2, circuit_reset_timeout=0.5,
        retry=RetryPolicy(max_attempts=2, initial_delay=0.1),
    )
    for i in range(20):
        p.produce(topic, b"v%d" % i, key=b"k%d" % (i % 3), headers=[("h", b"x")])
    time.sleep(6)  # let sends fail, the circuit open, drain attempts fail and dead-letter
    seen.add("producer repr", repr(p))
    seen.add("producer stats", p.stats())
    seen.add("store repr", repr(p.store))
    seen.add("store location", p.store.location)
    seen.add("store stats", p.store.stats(now=time.time()))
    seen.add("store backlog", p.store.backlog(now=time.time()))
    for row in p.store.list_dead():
        seen.add("dead letter", row)
    p.close(timeout=5)

    store = open_outbox(url)
    d = Drainer(
        store, {"bootstrap.servers": kafka_bootstrap, "debug": "all", "message.timeout.ms": 2000, **SASL},
        retry=RetryPolicy(max_attempts=1),
    )
    seen.add("drainer repr", repr(d))
    seen.add("drain result", d.run(until_empty=True))
    store.replay_dead(now=time.time())
    seen.add("drain result 2", d.run(until_empty=True))
    store.close()

    # Store errors: wrong database, unreachable server, closed store.
    for bad in (url.replace("/postgres", "/nope"), url.replace(f":{private_pg.port}/", ":1/")):
        try:
            PostgresOutbox(bad)
        except OutboxError as exc:
            seen.exception("store error", exc)
        else:
            raise AssertionError(f"{bad!r} opened")
    closed = PostgresOutbox(url)
    closed.close()
    try:
        closed.enqueue([NewMessage(topic, b"v")])
    except OutboxError as exc:
        seen.exception("closed store error", exc)

    # Every CLI command, and its errors, with the password in the URL and in -X settings.
    x = [a for k, v in SASL.items() for a in ("-X", f"{k}={v}")]
    cli_run(seen, "status", "--outbox", url)
    cli_run(seen, "status", "--outbox", url, "--json")
    cli_run(seen, "dlq", "list", "--outbox", url)
    cli_run(seen, "dlq", "list", "--outbox", url, "--json")
    cli_run(seen, "dlq", "show", "1", "--outbox", url)
    cli_run(seen, "dlq", "replay", "--outbox", url, "--yes")
    x += ["-X", "message.timeout.ms=2000"]
    cli_run(seen, "drain", "--outbox", url, "-b", kafka_bootstrap, *x, "-v", "--connect-timeout", "2")
    cli_run(seen, "drain", "--outbox", url, "-b", kafka_bootstrap, *x, "--json", "--connect-timeout", "2")
    cli_run(seen, "drain", "--outbox", url, "-b", kafka_bootstrap, "-X", f"sasl.password{SASL_PW}")  # malformed -X
    cli_run(seen, "drain", "--outbox", url, "-b", kafka_bootstrap, "-X", f"no.such.setting={SASL_PW}")
    cli_run(seen, "dlq", "purge", "--outbox", url, "--yes")
    cli_run(seen, "status", "--outbox", url.replace("/postgres", "/nope"))
    cli_run(seen, "status", "--outbox", url.replace(f":{private_pg.port}/", ":1/"))
    cli_run(seen, "status", "--outbox", url.replace("@127.0.0.1", "@[::1"))
    cli_run(seen, "status", "--outbox", f"jdbc:postgresql://127.0.0.1:{private_pg.port}/postgres?user=admin&password={PG_PW}")
    cli_run(seen, "status", "--outbox", f"mysql://admin:{PG_PW}@127.0.0.1/db")
    # The installed script, as an operator runs it (its own logging setup, real stderr).
    for argv in (
        ["status", "--outbox", url],
        ["drain", "--outbox", url, "-b", kafka_bootstrap, *x, "-v", "--connect-timeout", "2"],
        ["status", "--outbox", url.replace("/postgres", "/nope")],
    ):
        proc = subprocess.run([str(OUTBOX), *argv], capture_output=True, text=True, timeout=120, check=False)
        seen.add(f"script {argv[0]} stdout", proc.stdout)
        seen.add(f"script {argv[0]} stderr", proc.stderr)
        assert "Traceback" not in proc.stderr

    logs = all_logs.getvalue()
    assert "rdkafka" in logs and "outbox" in logs  # librdkafka's debug lines and ours were captured
    seen.add("logs", logs)
    seen.assert_clean()


def test_no_secret_in_the_spark_jobs_output_and_report(
    private_pg: PrivatePostgres, spark: Any, kafka_bootstrap: str, topic: str, tmp_path: Path,
    all_logs: io.StringIO,
) -> None:
    from spark_drain import JobOptions, run_job

    # A table of its own: the module's private server keeps the other tests' outbox rows.
    url = private_pg.url + ("&" if "?" in private_pg.url else "?") + "table=spark_secrets"
    store = PostgresOutbox(url)
    store.enqueue([NewMessage(topic, b"v%d" % i, b"k", [], -1, f"m{i}") for i in range(10)])
    store.close()
    report_path = tmp_path / "report.json"
    report = run_job(
        spark, JobOptions(outbox=url, bootstrap_servers=kafka_bootstrap, partitions=1, report_path=str(report_path),
                          kafka_config={"sasl.username": "app", "ssl.key.password": KEY_PW})
    )
    assert report.total.delivered == 10
    report.write_json(str(report_path))  # what `python -m spark_drain --report` writes
    texts = {
        "report file": report_path.read_text(),
        "report table": report.format_table(),
        "report dict": json.dumps(report.to_dict()),
        "report repr": repr(report),
        "logs": all_logs.getvalue(),
    }
    # The command line's error path (pre-flight, before any Spark session): one line, no secret.
    failed = subprocess.run(
        [sys.executable, "-m", "spark_drain", "--outbox", url.replace(f":{private_pg.port}/", ":1/"),
         "--bootstrap-servers", kafka_bootstrap, "-X", f"sasl.password={SASL_PW}"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert failed.returncode == 1 and "spark_drain: error: " in failed.stderr, failed.stderr
    texts.update({"error stdout": failed.stdout, "error stderr": failed.stderr})
    for name, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} in the Spark job's {name}"
