"""The documentation site builds with `mkdocs build --strict`: a warning or a broken link fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.docs.examples import ROOT


def test_the_site_builds_strictly_with_every_page_and_the_api_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert "WARNING" not in done.stderr, done.stderr[-5000:]
    for page in ("index.html", "producer/index.html", "consumer/index.html", "cli/index.html",
                 "confluent-compatibility/index.html", "changelog/index.html"):  # fmt: skip
        assert (site / page).is_file(), page
    reference = (site / "reference" / "outbox" / "index.html").read_text(encoding="utf-8")
    # mkdocstrings rendered the docstrings, not just the headings.
    assert "ResilientProducer" in reference and "message.timeout.ms" in reference
    assert "DeadLetter" in (site / "reference" / "records" / "index.html").read_text(encoding="utf-8")
    assert "SQLiteOutbox" in (site / "reference" / "stores" / "index.html").read_text(encoding="utf-8")
    assert (site / "img" / "recovery.png").stat().st_size > 10_000  # the benchmark curves are there
