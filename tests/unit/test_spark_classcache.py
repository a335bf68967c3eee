"""`spark_drain.classcache`: which JVM options a launch gets, and how the archive is put in place
(the launches themselves are in tests/integration/test_spark_drain.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from spark_drain.classcache import ClassCache, class_cache, driver_options_given

#: A stand-in for the gateway JVM: it writes its "archive" once its input ends, as the JVM does.
WRITE_AT_END = "import sys; sys.stdin.read(); open(sys.argv[1], 'w').write('classes')"


def test_the_first_launch_writes_the_archive_under_its_own_name(tmp_path: Path) -> None:
    cache = class_cache(tmp_path)
    assert cache is not None and cache.writing is not None
    assert cache.writing.name.endswith(f".{os.getpid()}.writing") and cache.writing.parent == tmp_path
    assert cache.java_options.startswith(f"-XX:ArchiveClassesAtExit={cache.writing} ")
    assert "-Xlog:cds=off" in cache.java_options


def test_a_later_launch_maps_the_archive(tmp_path: Path) -> None:
    first = class_cache(tmp_path)
    assert first is not None
    first.archive.write_text("classes")
    later = class_cache(tmp_path)
    assert later is not None and later.writing is None
    assert later.java_options.startswith(f"-XX:SharedArchiveFile={first.archive} ")


def test_keep_waits_for_the_jvm_to_write_then_puts_the_archive_in_place(tmp_path: Path) -> None:
    cache = class_cache(tmp_path)
    assert cache is not None and cache.writing is not None
    jvm = subprocess.Popen([sys.executable, "-c", WRITE_AT_END, str(cache.writing)], stdin=subprocess.PIPE)
    cache.keep(jvm)
    assert jvm.returncode == 0
    assert cache.archive.read_text() == "classes" and not cache.writing.exists()


def test_the_archive_of_a_jvm_that_did_not_exit_cleanly_is_thrown_away(tmp_path: Path) -> None:
    cache = class_cache(tmp_path)
    assert cache is not None and cache.writing is not None
    interrupted = WRITE_AT_END + "; sys.exit(130)"
    jvm = subprocess.Popen([sys.executable, "-c", interrupted, str(cache.writing)], stdin=subprocess.PIPE)
    cache.keep(jvm)
    assert jvm.returncode == 130
    assert not cache.archive.exists() and not cache.writing.exists()


def test_nothing_is_kept_when_the_jvm_wrote_nothing_or_the_launch_mapped_an_archive(tmp_path: Path) -> None:
    cache = class_cache(tmp_path)
    assert cache is not None and cache.writing is not None
    jvm = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    cache.keep(jvm)
    assert not cache.archive.exists()
    mapped = ClassCache("-XX:SharedArchiveFile=x", None, tmp_path / "x.jsa")
    mapped.keep(jvm)  # nothing to wait for or rename
    mapped.keep(None)


def test_an_unusable_cache_directory_means_no_archive(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert class_cache(blocker / "spark-cds") is None


def test_driver_java_options_set_elsewhere_are_left_alone(tmp_path: Path) -> None:
    assert not driver_options_given(None, None)
    assert not driver_options_given("--conf spark.sql.adaptive.enabled=false pyspark-shell", tmp_path)
    assert driver_options_given("--conf spark.driver.extraJavaOptions=-Xss4m pyspark-shell", None)
    defaults = tmp_path / "spark-defaults.conf"
    defaults.write_text("# spark.driver.extraJavaOptions -Xss4m\nspark.executor.memory 2g\n")
    assert not driver_options_given(None, tmp_path)
    defaults.write_text("spark.driver.defaultJavaOptions   -XX:+UseG1GC\n")
    assert driver_options_given(None, tmp_path)
