"""No librdkafka line reaches stderr raw: every client the package creates logs through `outbox.*`.

librdkafka writes its log lines (``%3|1700000000.123|FAIL|rdkafka#producer-1| ...``) straight to
fd 2 unless the client is given a ``logger``; an outage then floods the application's stderr
around its logging configuration. Each test runs real clients in a subprocess against a cluster
that does not answer (every broker stopped, or a closed local port) and reads that subprocess's
stderr.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from outbox.logs import LIBRDKAFKA_LOG, with_librdkafka_log
from outbox.testing import KafkaCluster

#: librdkafka's own stderr format: %<syslog level>|<seconds>.<ms>|<facility>|<client>| ...
RAW_LINE = re.compile(r"^%\d\|\d+\.\d+\|", re.MULTILINE)

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


# A ResilientConsumer built while the cluster is up, then polled for a few seconds with every
# broker stopped: its consumer, its hop producer and (ordering="key") its ladder reader.
CONSUMER_APP = textwrap.dedent(
    """
    import logging, os, sys, threading, time
    from outbox.consumer import ResilientConsumer, RetryTopics
    bootstrap, path, topic, group = sys.argv[1:5]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    c = ResilientConsumer(
        {"bootstrap.servers": bootstrap, "group.id": group, "session.timeout.ms": 6000},
        topics=[topic], handler=lambda m: None, outbox=f"sqlite:///{path}",
        strategy=RetryTopics(delays=[1]), ordering="key",
    )
    print("ready", flush=True)
    sys.stdin.readline()  # the test stops the brokers, then says go
    c.run(timeout=8)
    closer = threading.Thread(target=c.close, daemon=True)
    closer.start()
    closer.join(30)
    print("done", flush=True)
    sys.stderr.flush()
    os._exit(0)
    """
)


def test_no_logging_config_means_nothing_on_stderr_during_an_outage(
    chaos_cluster: KafkaCluster, topic: str, tmp_path: Path
) -> None:
    consumer = subprocess.Popen(
        [sys.executable, "-c", CONSUMER_APP, chaos_cluster.bootstrap_servers, str(tmp_path / "c.db"), topic,
         f"quiet-{os.getpid()}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert consumer.stdout is not None and consumer.stdin is not None
    assert consumer.stdout.readline() == "ready\n", consumer.stderr.read() if consumer.stderr else ""
    chaos_cluster.stop_all()
    consumer.stdin.write("go\n")
    consumer.stdin.flush()
    quiet = run_app(chaos_cluster.bootstrap_servers, tmp_path / "quiet.db", topic, configure=False)
    loud = run_app(chaos_cluster.bootstrap_servers, tmp_path / "loud.db", topic, configure=True)
    q_out, q_err = quiet.communicate(timeout=120)
    l_out, l_err = loud.communicate(timeout=120)
    c_out, c_err = consumer.communicate(timeout=120)
    chaos_cluster.start_all()
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
    # The consumer's clients: their lines went through logging (summarised), none raw.
    assert consumer.returncode == 0 and c_out == "done\n", c_err
    assert not RAW_LINE.findall(c_err), c_err
    assert [ln for ln in c_err.splitlines() if ln.startswith("WARNING outbox.librdkafka ")], c_err


# -- every client against a closed port ---------------------------------------------------------

#: One program per librdkafka client the package creates; argv: bootstrap, a scratch directory.
CLIENTS: dict[str, str] = {
    "producer and drain workers": """
        from outbox import ResilientProducer
        p = ResilientProducer({"bootstrap.servers": BOOTSTRAP, "message.timeout.ms": 2000},
                              outbox=f"sqlite:///{TMP}/p.db", drain_workers=2, drain_poll_interval=0.2)
        for i in range(50):
            p.produce("orders", b"v%d" % i)
        time.sleep(6)
        p.close(timeout=3)
    """,
    "re-sender (spark_drain's executors)": """
        from outbox.retry import RetryPolicy
        from outbox.drain.sendloop import SendLoop
        loop = SendLoop({"bootstrap.servers": BOOTSTRAP}, RetryPolicy())
        loop.producer.produce("orders", b"v")
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            loop.producer.poll(0.5)
    """,
    "drain process": """
        from outbox import ResilientProducer
        p = ResilientProducer({"bootstrap.servers": BOOTSTRAP, "message.timeout.ms": 2000},
                              outbox=f"sqlite:///{TMP}/d.db", drain_in="process", drain_poll_interval=0.2)
        for i in range(50):
            p.produce("orders", b"v%d" % i)
        time.sleep(6)
        p.close(timeout=3)
    """,
    "consumer tier admin client": """
        from outbox.consumer import ResilientConsumer
        from outbox.errors import KafkaUnavailableError
        try:
            ResilientConsumer({"bootstrap.servers": BOOTSTRAP, "group.id": "g"}, topics=["orders"],
                              handler=print, outbox=f"sqlite:///{TMP}/c.db")
        except KafkaUnavailableError as exc:
            print("unavailable:", exc)
    """,
    "ladder reader": """
        from confluent_kafka import KafkaException, TopicPartition
        from outbox.consumer.ordering import KeyOrder, scan_ladder
        from outbox.consumer.tiers import Place
        try:
            scan_ladder({"bootstrap.servers": BOOTSTRAP}, [TopicPartition("orders.g.retry-1", 0, -1)],
                        {"orders.g.retry-1": Place("orders", 1)}, KeyOrder(), timeout=6)
        except KafkaException as exc:
            print("unavailable:", exc)
    """,
    "console lag reader": """
        from outbox.errors import KafkaUnavailableError
        from outbox.ui.lag import tier_lags
        try:
            tier_lags({"bootstrap.servers": BOOTSTRAP}, timeout=6)
        except KafkaUnavailableError as exc:
            print("unavailable:", exc)
    """,
    "outbox dlq replay-topic": """
        from outbox_cli.main import cli
        cli.main(["dlq", "replay-topic", "orders.g.dlq", "-b", BOOTSTRAP, "--timeout", "6"], prog_name="outbox")
    """,
    "outbox drain": """
        from outbox import SQLiteOutbox
        from outbox.records import NewMessage
        SQLiteOutbox(f"{TMP}/o.db").enqueue([NewMessage("orders", b"v")])
        from outbox_cli.main import cli
        cli.main(["drain", "--outbox", f"{TMP}/o.db", "-b", BOOTSTRAP, "--connect-timeout", "6"], prog_name="outbox")
    """,
    "spark_drain cluster check": """
        from outbox import SQLiteOutbox
        SQLiteOutbox(f"{TMP}/s.db").close()
        from spark_drain import main
        sys.exit(main(["--outbox", f"sqlite:///{TMP}/s.db", "-b", BOOTSTRAP, "--check-timeout", "6"]))
    """,
}

#: What each program ends with: its exit code and a line it prints (the outage was really met).
EXPECTED: dict[str, tuple[int, str]] = {
    "producer and drain workers": (0, ""),
    "re-sender (spark_drain's executors)": (0, ""),
    "drain process": (0, ""),
    "consumer tier admin client": (0, "unavailable: could not read the cluster's topics"),
    "ladder reader": (0, "unavailable:"),
    "console lag reader": (0, "unavailable: could not read the retry tiers' offsets"),
    "outbox dlq replay-topic": (4, ""),
    "outbox drain": (3, ""),
    "spark_drain cluster check": (3, ""),
}


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_client(name: str, bootstrap: str, tmp: Path) -> subprocess.Popen[str]:
    program = "import sys, time\nBOOTSTRAP, TMP = sys.argv[1:3]\n" + textwrap.dedent(CLIENTS[name])
    return subprocess.Popen(
        [sys.executable, "-c", program, bootstrap, str(tmp)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_every_client_keeps_librdkafka_off_stderr(tmp_path: Path) -> None:
    bootstrap = f"127.0.0.1:{closed_port()}"
    procs = {}
    for name in CLIENTS:  # all at once: each mostly waits for a broker that never answers
        (tmp_path / name.replace(" ", "-")).mkdir()
        procs[name] = start_client(name, bootstrap, tmp_path / name.replace(" ", "-"))
        time.sleep(0.2)
    outcomes = {name: (p, *p.communicate(timeout=180)) for name, p in procs.items()}
    for name, (proc, out, err) in outcomes.items():
        code, printed = EXPECTED[name]
        assert proc.returncode == code, (name, out, err)
        assert printed in out, (name, out, err)
        assert "Traceback" not in err, (name, err)
    raw = {name: len(RAW_LINE.findall(err)) for name, (_, _, err) in outcomes.items()}
    assert raw == dict.fromkeys(CLIENTS, 0), {n: outcomes[n][2][-2000:] for n, c in raw.items() if c}


def test_an_application_logger_wins() -> None:
    """An application's own `logger` setting is kept: the package only fills one in."""
    mine = logging.getLogger("app.kafka")
    assert with_librdkafka_log({"logger": mine})["logger"] is mine
    assert with_librdkafka_log({"bootstrap.servers": "x"}) == {"logger": LIBRDKAFKA_LOG, "bootstrap.servers": "x"}
