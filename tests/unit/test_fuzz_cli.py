"""hypothesis over the `outbox` command line: every command, generated options and values.

Whatever the arguments (malformed URLs and TIMEs, numbers out of range, NUL bytes, odd unicode,
unknown options), the result is success or a clear error with a documented exit code: never a
traceback, never an uncaught exception. Each example runs on a fresh copy of a real SQLite
outbox; drain points at a closed port, so it stops at its cluster check.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from outbox_cli.main import cli

from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox

EXIT_CODES = {0, 1, 2, 3}
RUN_LIMIT = 60  # seconds; a command that runs longer on these inputs hangs (a failure)

_ODD = ["a", "é", "\u200d", "\u202e", "\x00", "\ud800", "🙂", "\n", " ", "-", "=", ":", "/", "%", "?", "@"]


def _text(max_size: int = 20) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=max_size), st.text(st.sampled_from(_ODD), max_size=max_size), st.from_regex(r"-?[0-9.e]{0,8}")
    )


_NUMBER = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["0", "-1", "1", "0.1", "inf", "-inf", "nan", "1e400", "", " 1", "0x10"]),
    _text(6),
)
_TIME = st.one_of(
    st.sampled_from(
        ["30m", "2h", "1d", "0s", "1w ago", "1e400d", "99999999999999999999d", "2024-05-01", "2024-05-01T12:00",
         "2024-05-01T12:00+02:00", "9999-12-31T23:59:59", "0001-01-01", "2024-13-45", "now", "", "-5m"]
    ),
    st.from_regex(r"[0-9]{1,25}(\.[0-9]{1,3})?(s|m|h|d|w)( ago)?", fullmatch=True),
    _text(),
)
_PORT = 1  # nothing listens there


def _url(db: str) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(
            [db, f"sqlite:///{db}", f"jdbc:sqlite:{db}", "sqlite:///does/not/exist.db", "/does/not/exist.db",
             "sqlite://", "sqlite:////", "postgresql://", "postgresql://u:s3cr3t@127.0.0.1:1/db",
             "postgresql://127.0.0.1:99999/db", "postgresql://[::1/db", "jdbc:postgresql://127.0.0.1:1/db?password=x",
             "postgresql://u@127.0.0.1:1/db?sslmode=bogus", "mysql://u:p@127.0.0.1:1/db",
             "oracle://u:p@h/db", "http://x", "", " ", "\x00", "/",
             f"{db}\x00x", "sqlite:///" + "a" * 5000]
        ),
        _text(40),
        _text(20).map(lambda t: f"sqlite:///{t}"),
        _text(20).map(lambda t: f"postgresql://{t}@127.0.0.1:1/db"),
    )


def _options(db: str) -> dict[str, st.SearchStrategy[list[str]]]:
    """Per command: a strategy of extra argv tokens (options with generated values)."""

    def opt(name: str, values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
        return values.map(lambda v: [name, v])

    def flag(name: str) -> st.SearchStrategy[list[str]]:
        return st.just([name])

    common = [opt("--outbox", _url(db)), flag("--json"), opt("--bogus", _text(5)), _text(10).map(lambda t: [t])]
    filters = [opt("--topic", _text()), opt("--error", _text(10)), opt("--since", _TIME), opt("--until", _TIME),
               opt("--id", _NUMBER)]
    return {
        "status": st.lists(st.one_of(*common), max_size=4),
        "drain": st.lists(
            st.one_of(
                *common,
                opt("-b", st.one_of(st.just(f"127.0.0.1:{_PORT}"), _text(15))),
                opt("-X", st.one_of(_text(15), st.sampled_from(["acks=all", "bogus.setting=1", "acks=", "=x",
                                                                "message.timeout.ms=-5", "sasl.password=p"]))),
                opt("--topic", _text()),
                opt("--max-messages", _NUMBER),
                opt("--workers", _NUMBER),
                opt("--max-attempts", _NUMBER),
                opt("--backoff", _text(12)),
                opt("--initial-delay", _NUMBER),
                # Bounded by construction: the closed port makes the check wait this long.
                opt("--connect-timeout", st.one_of(st.sampled_from(["0.1", "0.2", "0", "-1", "nan", "inf", "x"]))),
                flag("--follow"),
                flag("-v"),
            ),
            max_size=6,
        ),
        "dlq list": st.lists(st.one_of(*common, *filters, opt("--limit", _NUMBER)), max_size=5),
        "dlq show": st.lists(
            st.one_of(*common, opt("--encoding", st.one_of(st.sampled_from(["hex", "base64", "auto"]), _text(6))),
                      _NUMBER.map(lambda n: [n])),
            max_size=4,
        ),
        "dlq purge": st.lists(st.one_of(*common, *filters, flag("--yes")), max_size=5),
        "dlq replay": st.lists(st.one_of(*common, *filters, flag("--yes"), opt("--to-topic", _text())), max_size=5),
    }


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli-fuzz") / "template.db"
    store = SQLiteOutbox(str(path))
    now = time.time()
    store.enqueue([NewMessage("orders", b"v%d" % i, b"k%d" % (i % 2), [("h", b"x")], -1, f"p{i}") for i in range(3)])
    store.add_dead(
        [NewMessage("orders", b"\x00\xff", b"k", [], -1, "d1", attempts=3, first_failed_at=now - 60,
                    last_error="_MSG_TIMED_OUT (-192): Local: Message timed out")],
        failed_at=now - 60,
    )
    store.close()
    return path


class Hung(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Hung(f"the command ran longer than {RUN_LIMIT}s")


@pytest.fixture
def work(template: Path, tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


# 200 examples in the suite (~20 s); 1,500 were run while fixing what they found.
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data(), command=st.sampled_from(["status", "drain", "dlq list", "dlq show", "dlq purge", "dlq replay"]))
def test_cli_never_shows_a_traceback(template: Path, work: Path, data: st.DataObject, command: str) -> None:
    db = work / "o.db"
    shutil.copy(template, db)
    extra = data.draw(_options(str(db))[command])
    argv: list[str] = command.split()
    # Mostly a valid outbox first (so the generated options are what gets judged), sometimes none.
    if data.draw(st.booleans()):
        argv += ["--outbox", str(db)]
    if command == "drain" and data.draw(st.booleans()):
        argv += ["-b", f"127.0.0.1:{_PORT}", "--connect-timeout", "0.1"]
    for tokens in extra:
        argv += tokens
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(RUN_LIMIT)
    try:
        result = CliRunner().invoke(
            cli, argv, input="n\n", env={"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""}, catch_exceptions=True
        )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), (argv, repr(exc), result.output)
    assert result.exit_code in EXIT_CODES, (argv, result.exit_code, result.output)
    assert "Traceback" not in result.output, (argv, result.output)
    if result.exit_code not in (0, 3) and "--json" in (argv[: argv.index("--")] if "--" in argv else argv):
        # With --json the error is the JSON document on stdout.
        assert json.loads(result.stdout)["error"]["exit_code"] == result.exit_code, (argv, result.output)
    elif result.exit_code not in (0, 3):
        # click's usage errors and ours both end with "Error: <one line>" (which may itself hold
        # a generated line-break character, so no line splitting here).
        assert "Error: " in result.stderr or "Aborted" in result.stderr, (argv, result.stderr)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["dlq", "purge", "--since", "800000d"], "--since: cannot read the time '800000d': use ISO-8601"),
        (["dlq", "list", "--error", "\udc85"], "--error: '\\udc85' is not valid UTF-8 text"),
        (["dlq", "list", "--topic", "a\udcff"], "--topic: 'a\\udcff' is not valid UTF-8 text"),
    ],
)
def test_what_the_fuzzer_found_is_one_clear_line(template: Path, tmp_path: Path, argv: list[str], error: str) -> None:
    db = tmp_path / "o.db"
    shutil.copy(template, db)
    result = CliRunner().invoke(cli, [*argv, "--outbox", str(db)], env={"OUTBOX_URL": ""}, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: " + error), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_malformed_postgresql_url_is_one_clear_line_without_its_password() -> None:
    result = CliRunner().invoke(
        cli, ["status", "--outbox", "postgresql://app:s3cr3t@[::1/db"], env={"OUTBOX_URL": ""}, catch_exceptions=False
    )
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: PostgreSQL outbox URL is malformed (Invalid IPv6 URL): use postgresql://user@host:port/db\n"
    )
