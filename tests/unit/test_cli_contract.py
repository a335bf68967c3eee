"""The contract every `outbox` command keeps: help, --json (errors too), exit codes, --outbox.

The command tree is walked, so a command added later is held to the same rules. Outboxes are
real SQLite files filled through the store API.
"""

from __future__ import annotations

import ast
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result
from outbox_cli.main import cli

from outbox import exitcodes
from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox

ROOT = Path(__file__).resolve().parents[2]
#: Commands that serve rather than print (a web server): no --json.
SERVES = {"ui"}
#: Commands that read no outbox (a Kafka topic): no --outbox.
NO_OUTBOX = {"dlq replay-topic"}


def commands(group: click.Group = cli, prefix: str = "") -> dict[str, click.Command]:
    """Every leaf command by its path ("dlq show"), sub-groups walked."""
    out: dict[str, click.Command] = {}
    for name, cmd in group.commands.items():
        path = f"{prefix}{name}"
        if isinstance(cmd, click.Group):
            out.update(commands(cmd, path + " "))
        else:
            out[path] = cmd
    return out


def options(cmd: click.Command) -> set[str]:
    return {opt for p in cmd.params for opt in p.opts}


def run(*args: str) -> Result:
    env = {"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""}
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def json_error(result: Result) -> dict[str, object]:
    """The `--json` error document: alone on stdout, nothing on stderr, no traceback."""
    assert result.stderr == "", result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) == {"error"}
    error: dict[str, object] = doc["error"]
    assert set(error) == {"type", "message", "exit_code"}
    assert error["exit_code"] == result.exit_code and error["type"] == exitcodes.name(result.exit_code)
    return error


@pytest.fixture
def outbox(tmp_path: Path) -> str:
    """An outbox with one pending message (id 1) and one dead letter (id 2)."""
    path = str(tmp_path / "outbox.db")
    store = SQLiteOutbox(path)
    store.enqueue([NewMessage(topic="orders", value=b"pending", msg_id="p1")])
    dead = NewMessage(topic="orders", value=b"dead", msg_id="d1", error_code=-192, error_name="_MSG_TIMED_OUT",
                      last_error="_MSG_TIMED_OUT (-192): Local: Message timed out")
    store.add_dead([dead], failed_at=time.time())
    store.close()
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the command tree -------------------------------------------------------------------------


def test_the_walk_finds_every_command() -> None:
    assert set(commands()) == {
        "drain", "status", "metrics", "ui", "dlq list", "dlq show", "dlq purge", "dlq replay", "dlq replay-topic",
        "erase", "keys rotate", "audit",
    }


@pytest.mark.parametrize("path", sorted(commands()))
def test_every_command_has_help_and_the_options_the_top_help_promises(path: str) -> None:
    cmd = commands()[path]
    assert cmd.help and cmd.get_short_help_str().strip(), path
    opts = options(cmd)
    assert ("--json" in opts) is (path not in SERVES), path
    assert ("--outbox" in opts) is (path not in NO_OUTBOX), path
    page = run(*path.split(), "--help")
    assert page.exit_code == 0 and page.output.startswith(f"Usage: outbox {path} ")


def test_the_top_help_names_the_exceptions_it_makes() -> None:
    top = " ".join(run("--help").output.split())
    assert "Every command but `dlq replay-topic` (which reads a Kafka topic, not an outbox) takes --outbox URL" in top
    assert "Every command that prints data takes --json (all but `ui`, which serves)" in top


# -- exit codes: one table ----------------------------------------------------------------------


def test_the_exit_code_table_is_in_the_help_and_in_the_docs() -> None:
    top = run("--help").output
    docs = (ROOT / "docs" / "exit-codes.md").read_text()
    for e in exitcodes.TABLE:
        assert re.search(rf"^\s+{e.code}\s+{re.escape(e.meaning.split()[0])}", top, re.MULTILINE), e
        assert re.search(rf"^\| {e.code}\s+\| `{e.name}`\s+\|", docs, re.MULTILINE), e
    codes = [e.code for e in exitcodes.TABLE]
    assert len(set(codes)) == len(codes) and len({e.name for e in exitcodes.TABLE}) == len(codes)


# -- --json, errors included --------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(p for p in commands() if p not in SERVES | NO_OUTBOX))
def test_every_json_command_reports_a_missing_outbox_as_json(path: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    args = ["1"] if path == "dlq show" else []
    extra = {"drain": ["-b", "127.0.0.1:9"], "dlq purge": ["--yes"], "erase": ["--key", "k", "--yes"]}.get(path, [])
    result = run(*path.split(), *args, "--outbox", str(missing), *extra, "--json")
    assert result.exit_code == exitcodes.ERROR
    assert json_error(result)["message"] == f"outbox file {missing} does not exist"
    assert not missing.exists()


@pytest.mark.parametrize("path", sorted(p for p in commands() if p not in SERVES))
def test_a_bad_command_line_with_json_is_a_json_usage_error(path: str) -> None:
    result = run(*path.split(), "--no-such-option", "--json")
    assert result.exit_code == exitcodes.USAGE
    assert json_error(result)["message"] == "No such option '--no-such-option'."


def test_without_json_errors_stay_one_line_on_stderr(tmp_path: Path) -> None:
    result = run("status", "--outbox", str(tmp_path / "nope.db"))
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == f"Error: outbox file {tmp_path / 'nope.db'} does not exist\n"


def test_json_after_double_dash_is_an_argument_not_the_flag(outbox: str) -> None:
    result = run("dlq", "show", "--outbox", outbox, "--", "--json")
    assert result.exit_code == exitcodes.USAGE and result.stdout == ""
    assert "'--json' is not a message id" in result.stderr


def test_replay_topic_with_no_broker_is_kafka_unavailable_as_json() -> None:
    port = closed_port()
    result = run("dlq", "replay-topic", "orders.g.dlq", "-b", f"127.0.0.1:{port}", "--timeout", "1", "--json")
    assert result.exit_code == exitcodes.KAFKA_UNAVAILABLE
    error = json_error(result)
    assert error["type"] == "kafka_unavailable"
    message = str(error["message"])
    assert message.startswith(f"no Kafka broker answered at 127.0.0.1:{port} within 1s (_TRANSPORT: "), message
    assert "KafkaError{" not in message  # the error's sentence, not its repr


def test_metrics_json_prints_the_gauges_once(outbox: str) -> None:
    result = run("metrics", "--outbox", outbox, "--label", "outbox=orders", "--json")
    assert result.exit_code == 0, result.output
    samples = {(s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in json.loads(result.stdout)}
    assert samples[("outbox_pending_messages", (("outbox", "orders"),))] == 1
    assert samples[("outbox_dead_letters", (("outbox", "orders"),))] == 1
    assert samples[("outbox_store_up", (("outbox", "orders"),))] == 1


# -- dlq: only dead letters, only real error names ------------------------------------------------


def test_dlq_show_refuses_a_row_that_is_not_a_dead_letter(outbox: str) -> None:
    result = run("dlq", "show", "1", "--outbox", outbox, "--json")
    assert result.exit_code == exitcodes.ERROR
    assert json_error(result)["message"] == (
        "message 1 is pending, not a dead letter (`outbox status` shows what is pending)"
    )
    shown = json.loads(run("dlq", "show", "2", "--outbox", outbox, "--json").stdout)
    assert (shown["id"], shown["status"]) == (2, "dead")


@pytest.mark.parametrize("command", [["list"], ["purge", "--yes"], ["replay"]])
def test_an_unknown_error_name_is_a_usage_error(outbox: str, command: list[str]) -> None:
    result = run("dlq", *command, "--outbox", outbox, "--error", "NOT_A_CODE")
    assert result.exit_code == exitcodes.USAGE and result.stdout == ""
    line = result.stderr.strip()
    assert line.startswith("Error: --error: 'NOT_A_CODE' is not a librdkafka error code or name")
    assert "`outbox status` lists the errors of this outbox's dead letters" in line
    store = SQLiteOutbox(outbox)
    assert [r.id for r in store.list_dead()] == [2]  # nothing purged, nothing replayed
    store.close()


@pytest.mark.parametrize("value", ["-192", "_MSG_TIMED_OUT", "msg_timed_out", "builtins.ValueError"])
def test_error_codes_names_and_exception_classes_are_accepted(outbox: str, value: str) -> None:
    result = run("dlq", "list", "--outbox", outbox, "--error", value, "--json")
    assert result.exit_code == 0, result.output
    ids = [d["id"] for d in json.loads(result.stdout)]
    assert ids == ([] if value == "builtins.ValueError" else [2])


# -- product code never needs the test bed --------------------------------------------------------


def imported_modules(path: Path) -> list[str]:
    """Every module an `import` or `from ... import` statement of the file names, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return found


def test_product_modules_do_not_import_the_test_bed() -> None:
    # Module names from the files: pkgutil.walk_packages would import every package, the test bed too.
    names = []
    lazy = []  # imports inside functions run only on some paths: read them from the source
    packages = (("outbox", ROOT / "outbox"), ("outbox_cli", ROOT / "cli"), ("spark_drain", ROOT / "spark_drain"))
    for package, folder in packages:
        for f in sorted(folder.rglob("*.py")):
            parts = [package, *f.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if name.startswith("outbox.testing"):
                continue
            lazy += [f"{name}: {m}" for m in imported_modules(f) if m.split(".")[:2] == ["outbox", "testing"]]
            if parts[-1] != "__main__":
                names.append(name)
    assert lazy == []
    program = f"""
import sys
for name in {names!r}:
    __import__(name)
print(len({names!r}), sorted(n for n in sys.modules if n.startswith("outbox.testing")))
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    count, testing = proc.stdout.split(" ", 1)
    assert int(count) > 60  # the walk really imported the product
    assert testing.strip() == "[]"
