"""`python -m spark_drain.bundle`: what it packs for spark-submit (the cluster run itself is in
tests/integration/test_spark_drain.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from spark_drain.bundle import LAUNCHER, main, write_bundle
from spark_drain.jars import JDBC_DRIVER_JARS, JDBC_DRIVER_PACKAGES

ROOT = Path(__file__).resolve().parents[2]


def test_the_zip_holds_both_packages_sources_and_nothing_else(tmp_path: Path) -> None:
    archive, launcher, _ = write_bundle(tmp_path)
    names = zipfile.ZipFile(archive).namelist()
    expected = {"outbox/__init__.py", "outbox/stores/codec.py", "spark_drain/__init__.py", "spark_drain/job.py"}
    assert expected <= set(names)
    assert all(name.endswith(".py") and "__pycache__" not in name for name in names)
    assert {name.split("/")[0] for name in names} == {"outbox", "spark_drain"}
    assert launcher.name == LAUNCHER and "from spark_drain.job import main" in launcher.read_text()


def test_the_same_code_gives_the_same_bytes(tmp_path: Path) -> None:
    first, _, _ = write_bundle(tmp_path / "a")
    second, _, _ = write_bundle(tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()


def test_the_zip_imports_on_a_path_of_its_own(tmp_path: Path) -> None:
    """zipimport, as the executors import it: the job's modules load from the zip alone."""
    archive, _, _ = write_bundle(tmp_path)
    code = "import spark_drain.job, outbox.stores.codec, sys; print(spark_drain.job.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(archive), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert out.stdout.startswith(str(archive))


def test_the_executors_requirements_name_the_compiled_dependencies_not_kafka_outbox(tmp_path: Path) -> None:
    _, _, requirements = write_bundle(tmp_path)
    names = {re.split(r"[\[<>=!~ ]", line)[0].lower() for line in requirements.read_text().splitlines()}
    assert {"confluent-kafka", "pyspark", "psycopg", "cryptography", "tenacity"} <= names
    assert "kafka-outbox" not in names and "fastapi" not in names


def test_the_packages_coordinates_are_the_pinned_drivers() -> None:
    """`--packages` and the fetched jars name the same versions as the pom Maven fetches."""
    pom = (ROOT / "outbox" / "testing" / "jdbc-pom.xml").read_text()
    pinned = {f"{g}:{a}:{v}" for g, a, v in re.findall(
        r"<groupId>([^<]+)</groupId><artifactId>([^<]+)</artifactId><version>([^<]+)</version>", pom)}
    assert set(JDBC_DRIVER_PACKAGES.values()) <= pinned
    assert JDBC_DRIVER_JARS == {
        "postgresql": "postgresql-42.7.14.jar",
        "sqlite": "sqlite-jdbc-3.54.1.0.jar",
        "mysql": "mariadb-java-client-3.5.6.jar",
    }


def test_the_command_prints_the_submit_line_and_an_unwritable_place_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "--py-files" in out and f"--packages {JDBC_DRIVER_PACKAGES['postgresql']}" in out
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main([str(blocker / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"spark_drain.bundle: error: cannot write the bundle into {blocker / 'out'}")
    assert "\n" not in err
