"""An application with no logging configuration sees nothing on stderr during an outage.

Real subprocesses against the real cluster with every broker stopped: a ResilientProducer with
two drain workers (three librdkafka clients, each failing to connect several times a second).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from outbox.testing import KafkaCluster

APP = textwrap.dedent(
    """
    import logging, sys, time
    from outbox import ResilientProducer
    bootstrap, path, topic, configure = sys.argv[1:5]
    if configure == "yes":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    p = ResilientProducer(
        {"bootstrap.servers": bootstrap, "message.timeout.ms": 2000},
        outbox=f"sqlite:///{path}", drain_workers=2, drain_poll_interval=0.2,
    )
    deadline = time.monotonic() + 8
    i = 0
    while time.monotonic() < deadline:
        p.produce(topic, b"v%d" % i, key=b"k%d" % (i % 5))
        i += 1
        time.sleep(0.01)
    p.close(timeout=5)
    from outbox import SQLiteOutbox
    print(SQLiteOutbox(path).stats(now=time.time()).pending, flush=True)  # the outage is in the outbox
    """
)


def run_app(bootstrap: str, path: Path, topic: str, configure: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", APP, bootstrap, str(path), topic, "yes" if configure else "no"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_no_logging_config_means_nothing_on_stderr_during_an_outage(
    chaos_cluster: KafkaCluster, topic: str, tmp_path: Path
) -> None:
    chaos_cluster.stop_all()
    quiet = run_app(chaos_cluster.bootstrap_servers, tmp_path / "quiet.db", topic, configure=False)
    loud = run_app(chaos_cluster.bootstrap_servers, tmp_path / "loud.db", topic, configure=True)
    q_out, q_err = quiet.communicate(timeout=120)
    l_out, l_err = loud.communicate(timeout=120)
    assert quiet.returncode == 0 and loud.returncode == 0, (q_err, l_err)
    assert int(q_out) > 0 and int(l_out) > 0
    assert q_err == ""
    # The same outage with logging configured: the first connection failure is one WARNING,
    # the rest are counted in summary lines, never one ERROR line per attempt.
    lines = l_err.splitlines()
    fail_lines = [ln for ln in lines if ln.startswith("WARNING outbox.librdkafka FAIL ")]
    assert len(fail_lines) == 1, l_err
    assert "Connection refused" in fail_lines[0]
    assert not [ln for ln in lines if "outbox.librdkafka" in ln and not ln.startswith("WARNING")], l_err
