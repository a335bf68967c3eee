"""The `outbox` command's exit codes where docs/exit-codes.md defines them, run as a real process
(its stdout a real pipe, a real port, a module that cannot be imported)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = str(Path(sys.executable).with_name("outbox"))


def outbox(*args: str, without: str | None = None, stdout: int | None = subprocess.PIPE,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`outbox ARGS` in a child process; `without`: a module made unimportable, as if not installed."""
    hide = f"sys.modules[{without!r}] = None; " if without else ""
    program = f"import sys; {hide}from outbox_cli.main import main; main()"
    env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_URL", "KAFKA_BOOTSTRAP_SERVERS")}
    return subprocess.run([sys.executable, "-c", program, *args], cwd=ROOT, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, check=False)


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def empty_db(tmp_path: Path) -> str:
    """An outbox with nothing pending: one dead letter only."""
    path = str(tmp_path / "empty.db")
    store = SQLiteOutbox(path)
    store.add_dead([NewMessage("orders", b"v", msg_id="d1", attempts=3, last_error="x")], failed_at=0.0)
    store.close()
    return path


@pytest.mark.parametrize(("args", "module", "message"), [
    (("status", "--outbox", "postgresql://app@127.0.0.1:1/none"), "psycopg",
     "Error: a PostgreSQL outbox needs psycopg: pip install 'kafka-outbox[postgres]'"),
    (("metrics", "--outbox", "{db}"), "prometheus_client",
     "Error: outbox metrics needs prometheus-client: pip install 'kafka-outbox[metrics]'"),
    (("ui", "--outbox", "{db}"), "uvicorn", "Error: the console needs uvicorn: pip install 'kafka-outbox[ui]'"),
])
def test_a_missing_optional_dependency_is_exit_1(
    empty_db: str, args: tuple[str, ...], module: str, message: str
) -> None:
    proc = outbox(*(a.format(db=empty_db) for a in args), without=module)
    assert (proc.returncode, proc.stderr.strip()) == (1, message)


def test_ui_on_a_taken_port_is_exit_1_and_never_says_it_serves(empty_db: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = outbox("ui", "--outbox", empty_db, "--port", str(port))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"Error: cannot listen on 127.0.0.1:{port}: the address is already in use "
                                   "(--port, --host)")


def test_stdout_closed_early_stops_quietly_with_141(empty_db: str) -> None:
    """`outbox status | head -0`: the reader is gone before the first line. As a tool killed by
    SIGPIPE: no message, exit 141 (128 + SIGPIPE)."""
    read, write = os.pipe()
    os.close(read)
    try:
        for args in (("status", "--outbox", empty_db), ("status", "--outbox", empty_db, "--json"),
                     ("dlq", "list", "--outbox", empty_db), ("--help",)):
            proc = outbox(*args, stdout=write)
            assert (proc.returncode, proc.stderr) == (141, ""), args
    finally:
        os.close(write)


def test_drain_with_nothing_pending_and_kafka_down_is_not_pending(empty_db: str) -> None:
    """Exit 3 means "still pending": with nothing pending, an unreachable cluster ends the
    documented retry loop with 0 (and a warning), instead of spinning forever."""
    port = closed_port()
    proc = outbox("drain", "--outbox", empty_db, "-b", f"127.0.0.1:{port}", "--connect-timeout", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["delivered"], doc["remaining"], doc["interrupted"]) == (0, 0, False)
    # With --json the warning is in the document: stderr stays empty.
    assert proc.stderr == ""
    [warning] = doc["warnings"]
    assert warning.startswith(f"cannot reach Kafka: no Kafka broker answered at 127.0.0.1:{port}")
    assert warning.endswith("nothing is pending, so nothing was sent")
    text = outbox("drain", "--outbox", empty_db, "-b", f"127.0.0.1:{port}", "--connect-timeout", "1")
    assert text.returncode == 0
    assert text.stderr.startswith(f"warning: cannot reach Kafka: no Kafka broker answered at 127.0.0.1:{port}")
    assert text.stderr.rstrip().endswith("nothing is pending, so nothing was sent")

    loop = 'until "$@"; do [ $? -eq 3 ] || exit 1; echo again >&2; sleep 1; done; echo done'
    shell = subprocess.run(["sh", "-c", loop, "sh", OUTBOX, "drain", "--outbox", empty_db, "-b",
                            f"127.0.0.1:{port}", "--connect-timeout", "1"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert (shell.returncode, shell.stdout.splitlines()[-1], "again" in shell.stderr) == (0, "done", False)


def test_drain_follow_with_nothing_pending_and_kafka_down_is_kafka_unavailable(empty_db: str) -> None:
    port = closed_port()
    proc = outbox("drain", "--follow", "--outbox", empty_db, "-b", f"127.0.0.1:{port}", "--connect-timeout", "1")
    assert proc.returncode == 4
    assert proc.stderr.strip().startswith(f"Error: cannot reach Kafka: no Kafka broker answered at 127.0.0.1:{port}")
    assert proc.stderr.strip().endswith(f"nothing is pending in sqlite:///{empty_db}")


def test_a_postgresql_url_whose_host_is_not_a_host_name_is_one_line_not_a_traceback() -> None:
    # `,.` is the URL's host (the authority ends at the first "/"): libpq's host list of "" and
    # ".", which the resolver's IDNA encoding refuses with a UnicodeError.
    done = outbox("status", "--outbox", "postgresql://,./@127.0.0.1:1/db")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: PostgreSQL outbox ,.:5432/@127.0.0.1:1/db: host ',.' is not a valid host name"
    ]
