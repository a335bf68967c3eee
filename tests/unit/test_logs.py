"""librdkafka's repeated connection failures are summarised (outbox.logs), with a fake clock."""

from __future__ import annotations

import logging

import pytest

from outbox.logs import QUIET, SUMMARY_EVERY, LibrdkafkaLog

FAIL = ("FAIL", "rdkafka#producer-1", "127.0.0.1:9/bootstrap: Connect to ipv4#127.0.0.1:9 failed: Connection refused")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "test.rdkafka"]


def test_first_failure_warns_then_counts_every_few_seconds(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = LibrdkafkaLog(logging.getLogger("test.rdkafka"), clock=clock)
    caplog.set_level(logging.DEBUG, logger="test.rdkafka")
    for _ in range(4):  # 4 failures a second for 25 s, from two producers
        for _ in range(25):
            log.log(logging.ERROR, "%s [%s] %s", *FAIL)
            clock.now += 0.25
    got = records(caplog)
    warnings = [m for lvl, m in got if lvl == logging.WARNING]
    assert warnings[0] == (
        f"FAIL [rdkafka#producer-1] {FAIL[2]} (repeated connection failures are summarised every "
        f"{SUMMARY_EVERY:.0f}s; DEBUG shows each)"
    )
    # 99 repeats over 25 s: a summary at 10 s and 20 s, each counting what it summarises.
    assert warnings[1:] == [
        f"librdkafka: 40 more broker connection failure(s) in the last 10s (last: {FAIL[2]})",
        f"librdkafka: 40 more broker connection failure(s) in the last 10s (last: {FAIL[2]})",
    ]
    assert [lvl for lvl, _ in got].count(logging.DEBUG) == 99
    assert not [lvl for lvl, _ in got if lvl >= logging.ERROR]


def test_a_quiet_spell_starts_a_new_episode_and_other_lines_pass_through(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = LibrdkafkaLog(logging.getLogger("test.rdkafka"), clock=clock)
    caplog.set_level(logging.DEBUG, logger="test.rdkafka")
    log.log(logging.ERROR, "%s [%s] %s", *FAIL)
    clock.now += QUIET
    log.log(logging.ERROR, "%s [%s] %s", *FAIL)
    log.log(logging.WARNING, "%s [%s] %s", "SSL", "rdkafka#producer-1", "no matching issuer found")  # counted
    log.log(logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "a consumer property")
    log.log(logging.INFO, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "info-level fail line")
    assert [lvl for lvl, _ in records(caplog)] == [
        logging.WARNING, logging.WARNING, logging.DEBUG, logging.WARNING, logging.INFO
    ]


def test_a_secret_is_redacted_in_the_named_loggers_and_their_children() -> None:
    import io

    from outbox.logs import redact_in_logs

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger("redact-test")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    child = logging.getLogger("redact-test.app")  # exists before, as an imported module's logger
    try:
        redact_in_logs("s3cret", ("redact-test",))
        root.info("dsn postgresql://u:%s@h/db", "s3cret")
        child.error("failed on postgresql://u:s3cret@h/db")
        assert "s3cret" not in stream.getvalue()
        assert stream.getvalue().count("postgresql://u:***@h/db") == 2
    finally:
        root.removeHandler(handler)
