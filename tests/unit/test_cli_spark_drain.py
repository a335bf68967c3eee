"""`python -m spark_drain`'s command line: the shared exit codes, its hints, its --help.

No Spark session is started: every case here ends in the pre-flight checks or before them.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from outbox import exitcodes
from outbox.stores import SQLiteOutbox
from outbox.stores.encryption import KEYS_ENV, Key
from outbox.stores.urls import parse_url
from spark_drain import main
from spark_drain.jars import JDBC, cached_jdbc_jar
from spark_drain.options import build_parser, parse_args


@pytest.fixture
def outbox(tmp_path: Path) -> str:
    path = tmp_path / "outbox.db"
    SQLiteOutbox(str(path)).close()
    return f"sqlite:///{path}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_bad_value_is_a_usage_error(outbox: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--outbox", outbox, "-b", "k:9092", "--partitions", "0"]) == exitcodes.USAGE
    assert capsys.readouterr().err == "spark_drain: error: --partitions must be at least 1, got 0\n"


def test_an_unknown_flag_is_a_usage_error(outbox: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--outbox", outbox, "-b", "k:9092", "--no-such-flag"])
    assert exc.value.code == exitcodes.USAGE


def test_a_missing_outbox_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.db"
    assert main(["--outbox", f"sqlite:///{missing}", "-b", "k:9092"]) == exitcodes.ERROR
    assert capsys.readouterr().err == f"spark_drain: error: outbox file {missing} does not exist\n"
    assert not missing.exists()


def test_an_unreachable_cluster_leaves_the_rows_pending(outbox: str) -> None:
    """Exit 3, as `outbox drain`: nothing was sent; and librdkafka's lines stay off stderr."""
    port = closed_port()
    proc = subprocess.run(
        [sys.executable, "-m", "spark_drain", "--outbox", outbox, "-b", f"127.0.0.1:{port}", "--check-timeout", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == exitcodes.PENDING
    assert proc.stderr.startswith(f"spark_drain: error: no Kafka broker answered at 127.0.0.1:{port} within 1s (")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stdout == ""


def test_without_pyspark_the_error_says_how_to_install_it(outbox: str) -> None:
    # PySpark made unimportable for this one process (None in sys.modules: `import pyspark` fails).
    program = "import sys; sys.modules['pyspark'] = None; from spark_drain import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", program, "--outbox", outbox, "-b", "k:9092", "--dry-run"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == exitcodes.ERROR
    assert proc.stderr == "spark_drain: error: PySpark is not installed: pip install 'kafka-outbox[spark]'\n"


def test_help_names_the_default_jar_the_job_really_uses(outbox: str) -> None:
    from spark_drain.read import default_jars

    text = " ".join(build_parser().format_help().split())
    assert f"the URL's driver in {JDBC.libs}" in text
    assert "Debian's" in text and "/usr/share/java" in text
    found = cached_jdbc_jar("sqlite")
    assert found is not None, "no SQLite JDBC jar: run `python -m outbox.testing fetch`"
    assert default_jars(parse_url(outbox)) == found
    if JDBC.is_cached():
        assert found.startswith(str(JDBC.libs))


def _key_file(tmp_path: Path, name: str) -> tuple[Path, bytes]:
    secret = os.urandom(32)
    path = tmp_path / name
    path.write_text(secret.hex())
    return path, secret


def test_key_files_make_a_ring_newest_first(
    outbox: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new, new_secret = _key_file(tmp_path, "new.key")
    old, old_secret = _key_file(tmp_path, "old.key")
    monkeypatch.setenv(KEYS_ENV, os.urandom(32).hex())  # --key-file wins over the environment
    options = parse_args(["--outbox", outbox, "-b", "k:9092", "--key-file", str(new), "--key-file", str(old)])
    assert options.keys is not None
    assert options.keys.ids == (Key(new_secret).id, Key(old_secret).id)
    assert options.keys.current == Key(new_secret).id
    for secret in (new_secret, old_secret):
        for spelled in (secret.hex(), base64.b64encode(secret).decode()):
            assert spelled not in repr(options) and spelled not in repr(options.keys)


def test_keys_come_from_the_environment_without_a_key_file(
    outbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = os.urandom(32), os.urandom(32)
    monkeypatch.setenv(KEYS_ENV, f"{a.hex()}, {base64.b64encode(b).decode()}")
    options = parse_args(["--outbox", outbox, "-b", "k:9092"])
    assert options.keys is not None and options.keys.ids == (Key(a).id, Key(b).id)
    monkeypatch.delenv(KEYS_ENV)
    assert parse_args(["--outbox", outbox, "-b", "k:9092"]).keys is None


def test_a_bad_key_file_is_a_usage_error_that_does_not_print_it(
    outbox: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not-a-key-but-a-secret")
    assert main(["--outbox", outbox, "-b", "k:9092", "--key-file", str(bad)]) == exitcodes.USAGE
    err = capsys.readouterr().err
    assert err.startswith("spark_drain: error: ") and str(bad) in err and "not-a-key-but-a-secret" not in err
    missing = tmp_path / "missing.key"
    assert main(["--outbox", outbox, "-b", "k:9092", "--key-file", str(missing)]) == exitcodes.USAGE
    assert str(missing) in capsys.readouterr().err
