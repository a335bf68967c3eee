"""`drain_in="process"`: what is refused, and how a drain process that cannot start is reported.

No Kafka is needed: the child process starts and opens the outbox whether or not a broker
answers (its producers point at a closed port here).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from outbox import ConfigError, NewMessage, ResilientProducer, RetryPolicy, SQLiteOutbox

from ..waiting import wait_until

NO_BROKER = {"bootstrap.servers": "127.0.0.1:1"}


def test_an_unknown_drain_in_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"drain_in must be one of \('threads', 'process'\), got 'fork'"):
        ResilientProducer(NO_BROKER, outbox=f"sqlite:///{tmp_path / 'o.db'}", drain_in="fork")


def test_a_drain_process_needs_the_outbox_as_a_url(tmp_path: Path) -> None:
    store = SQLiteOutbox(str(tmp_path / "o.db"))
    try:
        with pytest.raises(ConfigError, match="drain_in='process' needs the outbox as a URL"):
            ResilientProducer(NO_BROKER, outbox=store, drain_in="process")
    finally:
        store.close()


def test_settings_that_cannot_be_pickled_are_named(tmp_path: Path) -> None:
    policy = RetryPolicy(is_retriable=lambda code: None)
    with pytest.raises(ConfigError, match=r"cannot be pickled: retry \(use module-level functions"):
        ResilientProducer(NO_BROKER, outbox=f"sqlite:///{tmp_path / 'o.db'}", retry=policy, drain_in="process")


def test_a_drain_process_that_cannot_import_the_policy_fails_the_constructor(tmp_path: Path) -> None:
    """The policy pickles here but its module is not importable in the child: a ConfigError
    with the child's reason, and nothing keeps running."""
    (tmp_path / "policy_only_here.py").write_text(
        textwrap.dedent(
            """
            def never(code):
                return None
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import policy_only_here
    finally:
        sys.path.remove(str(tmp_path))  # the child's import path is this process's: it lacks it now
    policy = RetryPolicy(is_retriable=policy_only_here.never)
    with pytest.raises(
        ConfigError, match="the drain process could not start: ModuleNotFoundError: No module named 'policy_only_here'"
    ):
        ResilientProducer(NO_BROKER, outbox=f"sqlite:///{tmp_path / 'o.db'}", retry=policy, drain_in="process")
    sys.modules.pop("policy_only_here", None)


def test_a_drain_process_starts_stops_and_hands_back_its_leases(tmp_path: Path) -> None:
    """Rows the drain process holds (leased, sent to a broker that never answers) are pending
    again, unleased, once the producer closed: a next drain need not wait for the leases to expire."""
    db = tmp_path / "o.db"
    store = SQLiteOutbox(str(db))
    try:
        store.enqueue([NewMessage("t", b"v%d" % i, msg_id=f"m{i}") for i in range(5)])
        p = ResilientProducer(NO_BROKER, outbox=f"sqlite:///{db}", drain_in="process", drain_poll_interval=0.1)
        pid = p.drainer.pid
        assert pid is not None
        wait_until(lambda: store.stats(now=0).leased > 0, 60, "the drain process leases the stored rows")
        assert p.close(30) is True
        assert p.drainer.pid is None
        with pytest.raises(ProcessLookupError):  # stopped and reaped
            os.kill(pid, 0)
        st = store.stats(now=0)
        assert (st.pending, st.leased) == (5, 0)
    finally:
        store.close()


def test_the_drain_process_ends_when_the_application_is_killed(tmp_path: Path) -> None:
    """kill -9 of the application: the child reads end of file on its command pipe and stops."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from outbox import ResilientProducer
        p = ResilientProducer({NO_BROKER!r}, outbox="sqlite:///{tmp_path / 'o.db'}", drain_in="process")
        print(p.drainer.pid, flush=True)
        time.sleep(600)
        """
    )
    app = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert app.stdout is not None
        child = int(app.stdout.readline())
        os.kill(child, 0)  # running
        app.kill()
        app.wait()
        wait_until(lambda: not _alive(child), 30, "the drain process stops after its application died")
    finally:
        app.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; its parent (the killed application) is gone, so init reaps it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_the_drain_process_log_lines_come_out_of_the_application_loggers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stored message sends the child's drain producer to 127.0.0.1:1, where no broker is;
    librdkafka's WARNING about it is logged here, under the child's logger name and marked as
    the drain process's."""
    caplog.set_level(logging.WARNING, logger="outbox")
    config = {**NO_BROKER, "message.timeout.ms": 1000}  # the first send fails fast: stored
    p = ResilientProducer(config, outbox=f"sqlite:///{tmp_path / 'o.db'}", drain_in="process")
    try:
        p.produce("t", b"v")
        wait_until(
            lambda: any(
                r.name == "outbox.librdkafka" and r.getMessage().startswith("[drain process] FAIL")
                for r in caplog.records
            ),
            30,
            "the drain process's connection failure is logged in this process",
        )
    finally:
        p.close(10)
