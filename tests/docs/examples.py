"""The Python examples of README.md and docs/*.md, and how the tests run them.

Conventions (CONTRIBUTING.md, "The documentation's examples are tests"):

* every ```python block runs, in order, each in a fresh interpreter, all of one document in one
  fresh temporary directory (so `outbox.db` files land there);
* ``localhost:9092`` is replaced by the test cluster's bootstrap servers, ``"orders"`` by a fresh
  topic per document (seeded with one message), and ``PG_PLACEHOLDER`` by a fresh test database;
* a block preceded by ``<!-- test: stop with SIGTERM once it printed -->`` runs until it printed
  a line, then gets SIGTERM and must exit cleanly (a consumer's ``run()``);
* a block whose fence carries ``title="not run: REASON"`` is not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP_PLACEHOLDER = "localhost:9092"
TOPIC_PLACEHOLDER = '"orders"'
PG_PLACEHOLDER = "postgresql://app:secret@localhost:5432/app"
STOP_MARKER = "<!-- test: stop with SIGTERM once it printed -->"
NOT_RUN = 'title="not run'

_FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    """One ```python block of a document."""

    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    run: bool  # False: marked "not run"
    until_sigterm: bool

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    """README.md and every page of the docs site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def examples(path: Path) -> list[Example]:
    text = path.read_text(encoding="utf-8")
    found = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        found.append(
            Example(
                path=path,
                line=text.count("\n", 0, m.start()) + 1,
                code=m.group("code"),
                run=NOT_RUN not in m.group("info"),
                until_sigterm=before == STOP_MARKER,
            )
        )
    return found


def with_test_services(code: str, *, bootstrap: str, topic: str, postgres_url: str | None) -> str:
    code = code.replace(BOOTSTRAP_PLACEHOLDER, bootstrap).replace(TOPIC_PLACEHOLDER, repr(topic))
    if postgres_url is not None:
        code = code.replace(PG_PLACEHOLDER, postgres_url)
    return code
