"""The exit codes of the `outbox` command and of `python -m spark_drain`: one table for both.

Both command-line tools import it (neither defines a code of its own), `outbox --help` prints
`help_text()`, and docs/exit-codes.md says the same in prose. It imports nothing, so the Spark
job can use it without click.
"""

from __future__ import annotations

import textwrap
from typing import NamedTuple


class ExitCode(NamedTuple):
    code: int
    name: str  # the `type` of a `--json` error document
    meaning: str


OK = 0
ERROR = 1
USAGE = 2
PENDING = 3
KAFKA_UNAVAILABLE = 4
INTERRUPTED = 130
BROKEN_PIPE = 141

TABLE: tuple[ExitCode, ...] = (
    ExitCode(OK, "ok", "success"),
    ExitCode(
        ERROR, "error", "error: missing or unreadable outbox, unknown id, not a dead letter, store or Kafka failure"
    ),
    ExitCode(USAGE, "usage", "bad command line: unknown option, bad URL, malformed -X, bad TIME, unknown --error"),
    ExitCode(
        PENDING,
        "pending",
        "messages are still pending: run again later (drain, spark_drain: cluster unreachable, "
        "retries scheduled for later, --max-messages reached, rows held back)",
    ),
    ExitCode(
        KAFKA_UNAVAILABLE, "kafka_unavailable", "no Kafka broker answered; nothing was changed (dlq replay-topic)"
    ),
    ExitCode(INTERRUPTED, "interrupted", "drain --until-empty interrupted by Ctrl-C (leases released)"),
    ExitCode(
        BROKEN_PIPE, "broken_pipe", "stdout closed by its reader (| head): stopped quietly, as a tool SIGPIPE ends"
    ),
)

_NAMES = {e.code: e.name for e in TABLE}


def name(code: int) -> str:
    """The table's name of `code` ("error" for a code the table does not have)."""
    return _NAMES.get(code, "error")


def help_text(width: int = 80) -> str:
    """The table as a help epilog block (click's ``\\b`` keeps its lines as they are)."""
    lines = ["\b", "Exit codes:"]
    for e in TABLE:
        wrapped = textwrap.wrap(e.meaning, width - 7)
        lines.append(f"  {e.code:<4} {wrapped[0]}")
        lines += [f"       {more}" for more in wrapped[1:]]
    return "\n".join(lines)
