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
    # argparse wraps lines after a hyphen too, inside the path: compare without any whitespace.
    assert f"theURL'sdriverin{JDBC.libs}" in "".join(text.split())
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


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--export", "{new}", "--to-topic", "t"], "--export writes rows as stored and sends nothing: --to-topic"),
        (["--export", "{new}", "--set", "value='x'"], "--set cannot be used with it"),
        (["--export", "{new}", "--transform", "tests.integration.spark_transforms:poison"], "--transform cannot"),
        (["--export", "{new}", "--dry-run"], "--dry-run cannot be used with it"),
        (["--export", "{new}", "--purge-after-export"], "--purge-after-export deletes dead letters only"),
        (["--purge-after-export", "--dead-letters"], "--purge-after-export deletes what --export wrote"),
        (["--export", "{old}"], "already exists; each export writes a new directory"),
        (["--export", "{new}", "--from-parquet", "{old}"], "--export and --from-parquet: use one"),
        (["--from-parquet", "{old}"], "--from-parquet reads no outbox: --outbox cannot be used with it"),
        (["--from-parquet", "{old}", "--dead-letters", "-"], "--dead-letters cannot be used with it"),
        (["--from-parquet", "{old}", "--since", "2026-01-01", "-"], "--since cannot be used with it"),
        (["--from-parquet", "{new}", "-"], "no such directory"),
        (["--bootstrap-servers", ""], "--bootstrap-servers is required"),
    ],
)
def test_archive_options_that_make_no_sense_are_refused_before_spark_starts(
    outbox: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], named: str,
) -> None:
    """`--export`, `--purge-after-export` and `--from-parquet`: each bad combination is one usage line."""
    (tmp_path / "old").mkdir()
    args = [a.format(new=tmp_path / "new", old=tmp_path / "old") for a in args]
    # A trailing "-": no --outbox (an archive's replay reads none).
    argv = ["-b", "k:9092", *args[:-1]] if args[-1] == "-" else ["--outbox", outbox, "-b", "k:9092", *args]
    assert main(argv) == exitcodes.USAGE
    err = capsys.readouterr().err
    assert err.startswith("spark_drain: error: ") and named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "new").exists()


def test_an_export_needs_no_cluster_and_a_replay_no_outbox(outbox: str, tmp_path: Path) -> None:
    export = parse_args(["--outbox", outbox, "--export", str(tmp_path / "a"), "--dead-letters", "--purge-after-export"])
    assert export.export == str(tmp_path / "a") and export.purge_after_export and not export.bootstrap_servers
    (tmp_path / "a").mkdir()
    replay = parse_args(["-b", "k:9092", "--from-parquet", str(tmp_path / "a"), "--where", "id > 3"])
    assert replay.from_parquet == str(tmp_path / "a") and replay.outbox == ""
    with pytest.raises(Exception, match="--outbox is required"):
        parse_args(["-b", "k:9092"])
