"""The built wheel and sdist, installed (not editable) into a fresh virtual environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.examples import ROOT, examples, with_test_services

# As on Windows, where there is no fcntl: importing must not need it.
_IMPORT_WITHOUT_FCNTL = "import sys; sys.modules['fcntl'] = None; import {}; print('ok')"


@dataclass(frozen=True)
class Installed:
    wheel: Path
    sdist: Path
    python: Path
    bin: Path
    build_output: str

    def pip_install(self, *args: str) -> None:
        subprocess.run([str(self.python), "-m", "pip", "install", "-q", *args], check=True, timeout=600)

    def run(self, *args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """`python -m build` of the project, its wheel installed into a new venv (no extras)."""
    tmp = tmp_path_factory.mktemp("packaging")
    dist = tmp / "dist"
    # Without PYTHONDONTWRITEBYTECODE, which only makes setuptools say it skips byte-compiling.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = Installed(next(dist.glob("kafka_outbox-*.whl")), next(dist.glob("kafka_outbox-*.tar.gz")),
                          venv / "bin" / "python", venv / "bin", build.stdout + build.stderr)  # fmt: skip
    installed.pip_install(str(installed.wheel))
    yield installed


def test_the_wheel_holds_every_package_and_its_data(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        wheel_files = set(zf.namelist())
        entry_points = zf.read(next(n for n in wheel_files if n.endswith("entry_points.txt"))).decode()
        metadata = zf.read(next(n for n in wheel_files if n.endswith(".dist-info/METADATA"))).decode()
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
    assert any(n.endswith("/licenses/LICENSE") for n in wheel_files)
    assert "pytest11" not in entry_points  # the plugin is opt-in
    # What a user sees on the package index: the license, the project's home, no contributor extras.
    assert "License-Expression: Apache-2.0" in metadata
    assert "Project-URL: Homepage, https://github.com/kafka-outbox/kafka-outbox" in metadata
    extras = {line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Provides-Extra: ")}
    assert extras == {
        "postgres", "mysql", "spark", "metrics", "encryption", "otel", "ui", "testing", "sqlalchemy", "django"
    }  # fmt: skip
    with tarfile.open(installed.sdist) as tf:
        sdist_files = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"pyproject.toml", "LICENSE", "outbox/testing/jdbc-pom.xml", "cli/main.py"} <= sdist_files


def test_the_build_has_no_warnings(installed: Installed) -> None:
    warnings = [line for line in installed.build_output.splitlines() if re.search(r"(?i)\bwarnings?\b", line)]
    assert warnings == []


def test_the_installed_commands_start(installed: Installed) -> None:
    cli = installed.run(str(installed.bin / "outbox"), "--help")
    assert cli.returncode == 0 and "drain" in cli.stdout and "dlq" in cli.stdout and "ui" in cli.stdout
    spark = installed.run(str(installed.python), "-m", "spark_drain", "--help")
    assert spark.returncode == 0 and "--outbox" in spark.stdout, spark.stderr
    imports = installed.run(
        str(installed.python), "-c", _IMPORT_WITHOUT_FCNTL.format("outbox, spark_drain, outbox.testing")
    )
    assert imports.returncode == 0 and imports.stdout.strip() == "ok", imports.stderr


def test_the_readme_quickstart_delivers_from_the_installed_wheel(
    installed: Installed, kafka_bootstrap: str, make_topic: Callable[..., str],
    consume_all: Callable[..., list], tmp_path: Path,
) -> None:  # fmt: skip
    quickstart = next(e for e in examples(ROOT / "README.md") if e.run)
    topic = make_topic()
    code = with_test_services(quickstart.code, bootstrap=kafka_bootstrap, topic=topic, postgres_url=None)
    done = installed.run(str(installed.python), "-c", code, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [msg] = consume_all(topic, 1)
    assert (msg.key(), msg.value()) == (b"customer-42", b'{"id": 42}')
    assert (tmp_path / "outbox.db").is_file()  # the default outbox, in the working directory


def test_the_extras_bring_what_they_name(installed: Installed, tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    make_store = f"from outbox.stores import SQLiteOutbox; SQLiteOutbox({str(db)!r}).close()"
    made = installed.run(str(installed.python), "-c", make_store)
    assert made.returncode == 0, made.stderr
    no_ui = installed.run(str(installed.bin / "outbox"), "ui", "--outbox", str(db))
    assert no_ui.returncode == 1 and "pip install 'kafka-outbox[ui]'" in no_ui.stderr  # the extra brings it
    no_pg = installed.run(str(installed.python), "-c", "import psycopg")
    assert no_pg.returncode != 0  # the extra is what brings it
    installed.pip_install(f"{installed.wheel}[postgres]")
    pg = installed.run(str(installed.python), "-c", "import psycopg, psycopg_pool")
    assert pg.returncode == 0, pg.stderr
    no_mysql = installed.run(str(installed.bin / "outbox"), "status", "--outbox", "mysql://u@127.0.0.1:1/db")
    assert no_mysql.returncode != 0 and "kafka-outbox[mysql]" in no_mysql.stderr, no_mysql.stderr
    installed.pip_install(f"{installed.wheel}[mysql]")
    mysql = installed.run(str(installed.python), "-c", "import pymysql")
    assert mysql.returncode == 0, mysql.stderr
