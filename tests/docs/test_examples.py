"""Every Python example of the README and the docs runs against the test cluster and succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

from tests.docs.examples import PG_PLACEHOLDER, ROOT, Example, documents, examples, with_test_services

RUN_TIMEOUT = 300.0  # seconds for one example; a consumer's first line included
DOCS_WITH_EXAMPLES = [p for p in documents() if any(e.run for e in examples(p))]


def _seed(bootstrap: str, topic: str) -> None:
    """One message in the document's topic, so that a consumer example has something to print."""
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, b'{"id": 1}', b"seed")
    assert producer.flush(30) == 0


def _run(example: Example, code: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", code]
    if not example.until_sigterm:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert done.returncode == 0, f"{example} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done.stdout
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_line: list[str] = []
    printed = threading.Event()

    def read_first_line() -> None:
        assert proc.stdout is not None
        first_line.append(proc.stdout.readline())
        printed.set()

    threading.Thread(target=read_first_line, daemon=True).start()
    try:
        assert printed.wait(RUN_TIMEOUT) and first_line[0], f"{example} printed nothing in {RUN_TIMEOUT:.0f} s"
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{example} exited {proc.returncode} on SIGTERM:\n{err[-3000:]}"
    return first_line[0] + rest


@pytest.mark.parametrize("doc", DOCS_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run_against_the_test_cluster(
    doc: Path,
    kafka_bootstrap: str,
    make_topic: Callable[..., str],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    runnable = [e for e in examples(doc) if e.run]
    topic = make_topic()
    _seed(kafka_bootstrap, topic)
    needs_pg = any(PG_PLACEHOLDER in e.code for e in runnable)
    pg = str(request.getfixturevalue("fresh_postgres_url")) if needs_pg else None
    for example in runnable:
        code = with_test_services(example.code, bootstrap=kafka_bootstrap, topic=topic, postgres_url=pg)
        _run(example, code, tmp_path)


def test_the_readme_consumer_prints_what_the_readme_producer_sent(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    produce, consume = [e for e in examples(ROOT / "README.md") if e.run][:2]
    topic = make_topic()
    for example in (produce, consume):
        code = with_test_services(example.code, bootstrap=kafka_bootstrap, topic=topic, postgres_url=None)
        out = _run(example, code, tmp_path)
    assert out.splitlines()[0] == repr(b"customer-42") + " " + repr(b'{"id": 42}')


def test_examples_not_run_are_few_and_say_why() -> None:
    not_run = [e for p in documents() for e in examples(p) if not e.run]
    assert len(not_run) <= 3, [str(e) for e in not_run]
    for e in not_run:
        fence = e.path.read_text(encoding="utf-8").splitlines()[e.line - 1]
        assert 'title="not run: ' in fence, f"{e}: say why it is not run"


def test_the_readme_stays_short_and_names_its_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    for text in ("pip install kafka-outbox", "make demo", "make test", "CONTRIBUTING.md"):
        assert text in readme, text
