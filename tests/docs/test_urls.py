"""The outbox URLs the docs and the help texts show mean what they seem to: `sqlite:///var/…` is
the relative path `var/…` (docs/cli.md's URL rules), so an example meant for a system directory
must write `sqlite:////var/…`."""

from __future__ import annotations

import re
from pathlib import Path

from outbox.stores.urls import parse_url
from tests.docs.examples import ROOT

#: Top-level directories of a Unix system: an example's path under one of them is meant absolute.
SYSTEM_DIRS = {"var", "tmp", "srv", "opt", "home", "data", "mnt", "etc", "usr", "run", "root"}
#: A URL with a path (`sqlite://` alone, the wrong form an error message shows, has none).
URL = re.compile(r"""(?:jdbc:)?sqlite:/{1,4}[^\s'"`)\]/][^\s'"`)\]]*""")


def texts() -> list[Path]:
    pages = [*sorted((ROOT / "docs").glob("**/*.md")), ROOT / "README.md"]
    code = [p for d in ("outbox", "cli", "spark_drain") for p in sorted((ROOT / d).glob("**/*.py"))]
    return pages + code


def test_the_walk_finds_the_examples() -> None:
    found = [u for p in texts() for u in URL.findall(p.read_text(encoding="utf-8"))]
    assert "sqlite:////var/lib/app/outbox.db" in found and len(found) > 20


def test_no_example_url_names_a_system_directory_as_a_relative_path() -> None:
    wrong = []
    for page in texts():
        for url in URL.findall(page.read_text(encoding="utf-8")):
            path = parse_url(url.rstrip(".,:;")).path
            if not path.startswith("/") and path.split("/")[0] in SYSTEM_DIRS:
                wrong.append(f"{page.relative_to(ROOT)}: {url} is the relative path {path}")
    assert wrong == []
