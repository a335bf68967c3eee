"""docs/exit-codes.md's tables are the source of this test: the codes (checked against
`outbox.exitcodes`), and per command the state that gives each code. Every command of the
`outbox` CLI and `python -m spark_drain` is driven into every state the table names, as a real
process, and must exit with that cell's code. A command missing from the table, a cell with no
driver here, or a driver whose command exits otherwise fails the test."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from outbox_cli.main import cli

from outbox import exitcodes
from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox

from ..unit.test_cli_contract import commands
from ..waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "exit-codes.md").read_text(encoding="utf-8")
SPARK = "python -m spark_drain"
#: The stderr of the latest command run, for a failure's message.
last_stderr: list[str] = [""]


def table_rows(heading: str | None) -> list[list[str]]:
    """The cells of the first table after `heading` (None: the page's first table)."""
    text = PAGE if heading is None else PAGE.split(heading, 1)[1]
    lines = [ln for ln in text.split("\n\n| ", 1)[1].splitlines()]
    rows = []
    for line in ["| " + lines[0], *lines[1:]]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return [r for r in rows[2:]]  # the header row and its rule left out


def by_command() -> dict[tuple[str, int], str]:
    """(command, code) -> the state the table names for it."""
    head = [c.strip() for c in PAGE.split("## By command", 1)[1].split("\n| ", 1)[1].split("\n", 1)[0].split("|")]
    codes = [int(c) for c in head[1:] if c]
    out = {}
    for cells in table_rows("## By command"):
        command = cells[0].strip("`").removeprefix("outbox ")
        for code, state in zip(codes, cells[1:], strict=True):
            if state:
                out[(command, code)] = state
    return out


class Env:
    """What the drivers share: an outbox with pending messages and dead letters, a Kafka cluster."""

    def __init__(self, tmp: Path, bootstrap: str, topic: str) -> None:
        self.tmp, self.bootstrap, self.topic = tmp, bootstrap, topic
        self.db = str(tmp / "o.db")
        store = SQLiteOutbox(self.db)
        self.dead = store.add_dead([NewMessage(topic, b"d%d" % i, b"k", msg_id=f"d{i}") for i in range(2)],
                                   failed_at=time.time())
        store.enqueue([NewMessage(topic, b"p", b"k", msg_id="p0")])
        store.close()
        self.missing = str(tmp / "missing.db")

    def empty(self) -> str:
        path = str(self.tmp / f"empty-{time.monotonic_ns()}.db")
        SQLiteOutbox(path).close()
        return path


def run(*args: str, stdout: int | None = subprocess.PIPE, without: str | None = None,
        program: str | None = None) -> subprocess.CompletedProcess[str]:
    hide = f"sys.modules[{without!r}] = None; " if without else ""
    code = program or f"import sys; {hide}from outbox_cli.main import main; main()"
    env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_URL", "KAFKA_BOOTSTRAP_SERVERS",
                                                              "OUTBOX_ENCRYPTION_KEYS")}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=600, check=False)
    last_stderr[0] = done.stderr
    return done


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def piped_shut(*args: str) -> int:
    """The command with its stdout a pipe whose reader is gone (`| head -0`)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return run(*args, stdout=write).returncode
    finally:
        os.close(write)


def interrupted(args: list[str], started: Callable[[subprocess.Popen[str]], bool]) -> int:
    """The command, sent SIGINT (Ctrl-C) once `started` says it is at work."""
    env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_URL", "KAFKA_BOOTSTRAP_SERVERS")}
    proc = subprocess.Popen([sys.executable, "-c", "from outbox_cli.main import main; main()", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_until(lambda: started(proc), 60, f"{args[0]} to be at work", every=0.01)
        proc.send_signal(signal.SIGINT)
        last_stderr[0] = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode


def drain_interrupted(e: Env) -> int:
    db = str(e.tmp / "big.db")
    n = 60000
    store = SQLiteOutbox(db)
    store.enqueue([NewMessage(topic=e.topic, value=b"x" * 100, msg_id=f"m{i}") for i in range(n)])
    try:
        return interrupted(["drain", "--outbox", db, "-b", e.bootstrap, "--json"],
                           lambda _: store.stats(now=time.time()).pending < n)
    finally:
        store.close()


def ui_interrupted(e: Env) -> int:
    port = closed_port()

    def serving(_: subprocess.Popen[str]) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    return interrupted(["ui", "--outbox", e.db, "--port", str(port)], serving)


def ui_port_taken(e: Env) -> int:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        return run("ui", "--outbox", e.db, "--port", str(taken.getsockname()[1])).returncode


def both(*codes: int) -> int:
    """The code of a cell that names two states: each must give it."""
    assert len(set(codes)) == 1, codes
    return codes[0]


def spark(e: Env, *args: str) -> int:
    done = run(*args, program="import sys, runpy; sys.argv[0] = 'spark_drain'; "
                              "runpy.run_module('spark_drain', run_name='__main__')")
    return done.returncode


def held_back(e: Env) -> int:
    db = str(e.tmp / "held.db")
    store = SQLiteOutbox(db)
    store.enqueue([NewMessage(e.topic, b"a0", b"a")], lease_owner="elsewhere", lease_until=time.time() + 600)
    store.enqueue([NewMessage(e.topic, b"a%d" % i, b"a") for i in range(1, 4)])
    store.close()
    return spark(e, "--master", "local[1]", "--partitions", "1", "--outbox", db, "-b", e.bootstrap)


def key_file(e: Env, data: bytes) -> str:
    path = e.tmp / f"k-{time.monotonic_ns()}.key"
    path.write_bytes(data)
    return str(path)


DRIVERS: dict[tuple[str, int], Callable[[Env], int]] = {
    ("status", 0): lambda e: run("status", "--outbox", e.db).returncode,
    ("status", 1): lambda e: run("status", "--outbox", e.missing).returncode,
    ("status", 2): lambda e: run("status", "--bogus").returncode,
    ("status", 141): lambda e: piped_shut("status", "--outbox", e.db),
    ("drain", 0): lambda e: run("drain", "--outbox", e.db, "-b", e.bootstrap).returncode,
    ("drain", 1): lambda e: run("drain", "--outbox", e.missing, "-b", e.bootstrap).returncode,
    ("drain", 2): lambda e: run("drain", "--outbox", e.db, "-b", e.bootstrap, "-X", "oops").returncode,
    ("drain", 3): lambda e: run("drain", "--outbox", e.db, "-b", f"127.0.0.1:{closed_port()}",
                                "--connect-timeout", "1").returncode,
    ("drain", 4): lambda e: run("drain", "--follow", "--outbox", e.empty(), "-b", f"127.0.0.1:{closed_port()}",
                                "--connect-timeout", "1").returncode,
    ("drain", 130): drain_interrupted,
    ("drain", 141): lambda e: piped_shut("drain", "--outbox", e.empty(), "-b", e.bootstrap),
    ("dlq list", 0): lambda e: run("dlq", "list", "--outbox", e.db).returncode,
    ("dlq list", 1): lambda e: run("dlq", "list", "--outbox", e.missing).returncode,
    ("dlq list", 2): lambda e: run("dlq", "list", "--outbox", e.db, "--error", "NOT_A_CODE").returncode,
    ("dlq list", 141): lambda e: piped_shut("dlq", "list", "--outbox", e.db),
    ("dlq show", 0): lambda e: run("dlq", "show", str(e.dead[0]), "--outbox", e.db).returncode,
    ("dlq show", 1): lambda e: run("dlq", "show", str(e.dead[-1] + 1), "--outbox", e.db).returncode,
    ("dlq show", 2): lambda e: run("dlq", "show", "1", "--bogus").returncode,
    ("dlq show", 141): lambda e: piped_shut("dlq", "show", str(e.dead[0]), "--outbox", e.db),
    ("dlq purge", 0): lambda e: run("dlq", "purge", "--outbox", e.empty(), "--yes").returncode,
    ("dlq purge", 1): lambda e: run("dlq", "purge", "--outbox", e.missing, "--yes").returncode,
    ("dlq purge", 2): lambda e: run("dlq", "purge", "--outbox", e.db, "--older-than", "soon").returncode,
    ("dlq purge", 141): lambda e: piped_shut("dlq", "purge", "--outbox", e.empty(), "--yes"),
    ("dlq replay", 0): lambda e: run("dlq", "replay", "--outbox", e.empty()).returncode,
    ("dlq replay", 1): lambda e: run("dlq", "replay", "--outbox", e.missing).returncode,
    ("dlq replay", 2): lambda e: run("dlq", "replay", "--outbox", e.db, "--since", "someday").returncode,
    ("dlq replay", 141): lambda e: piped_shut("dlq", "replay", "--outbox", e.empty()),
    ("dlq replay-topic", 0): lambda e: run("dlq", "replay-topic", e.topic, "-b", e.bootstrap, "--timeout",
                                           "5").returncode,
    ("dlq replay-topic", 2): lambda e: run("dlq", "replay-topic", f"{e.topic}-none", "-b", e.bootstrap).returncode,
    ("dlq replay-topic", 4): lambda e: run("dlq", "replay-topic", e.topic, "-b", f"127.0.0.1:{closed_port()}",
                                           "--timeout", "2").returncode,
    ("dlq replay-topic", 141): lambda e: piped_shut("dlq", "replay-topic", e.topic, "-b", e.bootstrap,
                                                    "--timeout", "5"),
    ("erase", 0): lambda e: run("erase", "--outbox", e.db, "--key", "k", "--dry-run").returncode,
    ("erase", 1): lambda e: run("erase", "--outbox", e.missing, "--key", "k", "--dry-run").returncode,
    ("erase", 2): lambda e: run("erase", "--outbox", e.db, "--dry-run").returncode,
    ("erase", 141): lambda e: piped_shut("erase", "--outbox", e.db, "--key", "k", "--dry-run"),
    ("keys rotate", 0): lambda e: run("keys", "rotate", "--outbox", e.empty(), "--key-file",
                                      key_file(e, bytes(32))).returncode,
    ("keys rotate", 1): lambda e: run("keys", "rotate", "--outbox", e.db).returncode,
    ("keys rotate", 2): lambda e: run("keys", "rotate", "--outbox", e.db, "--key-file",
                                      key_file(e, b"\xff" * 16)).returncode,
    ("keys rotate", 141): lambda e: piped_shut("keys", "rotate", "--outbox", e.empty(), "--key-file",
                                               key_file(e, bytes(32))),
    ("metrics", 0): lambda e: run("metrics", "--outbox", e.db, "--once").returncode,
    ("metrics", 1): lambda e: run("metrics", "--outbox", e.db, "--once", without="prometheus_client").returncode,
    ("metrics", 2): lambda e: run("metrics", "--bogus").returncode,
    ("metrics", 141): lambda e: piped_shut("metrics", "--outbox", e.db, "--once"),
    ("ui", 0): ui_interrupted,
    ("ui", 1): lambda e: both(run("ui", "--outbox", e.db, without="uvicorn").returncode, ui_port_taken(e)),
    ("ui", 2): lambda e: run("ui", "--bogus").returncode,
    ("audit", 0): lambda e: run("audit", "--outbox", e.db).returncode,
    ("audit", 1): lambda e: run("audit", "--outbox", e.missing).returncode,
    ("audit", 2): lambda e: run("audit", "--outbox", e.db, "--since", "someday").returncode,
    ("audit", 141): lambda e: piped_shut("audit", "--outbox", e.db),
    (SPARK, 0): lambda e: spark(e, "--master", "local[1]", "--partitions", "1", "--outbox", e.empty(), "-b",
                                e.bootstrap),
    (SPARK, 1): lambda e: spark(e, "--outbox", e.missing, "-b", e.bootstrap),
    (SPARK, 2): lambda e: spark(e, "--bogus"),
    (SPARK, 3): held_back,
}


def test_the_code_table_is_outbox_exitcodes() -> None:
    rows = table_rows(None)
    assert [(int(r[0]), r[1].strip("`")) for r in rows] == [(e.code, e.name) for e in exitcodes.TABLE]


def test_every_command_is_in_the_table_with_codes_the_table_defines() -> None:
    cells = by_command()
    assert {c for c, _ in cells} == set(commands(cli)) | {SPARK}
    assert {code for _, code in cells} <= {e.code for e in exitcodes.TABLE}
    assert set(DRIVERS) == set(cells)  # a driver per cell, and no code the table does not give


@pytest.mark.parametrize("cell", sorted(DRIVERS, key=lambda c: (c[0], c[1])), ids=lambda c: f"{c[0]}-{c[1]}")
def test_each_command_exits_as_the_table_says_in_each_state(
    cell: tuple[str, int], tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str]
) -> None:
    command, code = cell
    state = by_command().get(cell)
    assert state is not None, f"{command} exits {code} in a state docs/exit-codes.md does not name"
    env = Env(tmp_path, kafka_bootstrap, make_topic(name=f"exit-{re.sub(r'[^a-z]', '-', command)}-{code}"))
    assert DRIVERS[cell](env) == code, f"{command}, {state}: {last_stderr[0][-2000:]}"
