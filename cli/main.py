"""The `outbox` click group and the console-script entry point."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

import click

from . import drain as drain_command
from .audit import audit
from .common import EXIT_CODES_HELP, TIME_HELP, OutboxGroup
from .dlq import dlq
from .drain import drain
from .erase import erase
from .keys import keys
from .metrics import metrics
from .status import status
from .ui import ui


def _version() -> str:
    try:
        return _dist_version("kafka-outbox")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


@click.group(
    "outbox",
    cls=OutboxGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=f"""\b
Examples:
  export OUTBOX_URL=sqlite:////var/lib/app/outbox.db KAFKA_BOOTSTRAP_SERVERS=kafka:9092
  outbox status
  outbox drain                       # deliver everything due, then stop
  outbox drain --follow --workers 2  # keep delivering until Ctrl-C
  outbox dlq list --since 1d
  outbox dlq show 42
  outbox dlq replay --error _MSG_TIMED_OUT && outbox drain
  outbox dlq purge --topic orders --older-than 7d --yes
  outbox erase --key customer-42 --dry-run
  outbox keys rotate --key-file new.key --key-file old.key
  outbox audit --action erase --since 30d

\b
An encrypted outbox (docs/encryption.md) needs its keys wherever stored values
are read or written (drain, dlq, erase, ui, keys rotate): --key-file PATH,
repeatable, newest first, or $OUTBOX_ENCRYPTION_KEYS.

\b
Every command but `dlq replay-topic` (which reads a Kafka topic, not an outbox)
takes --outbox URL (or $OUTBOX_URL). URLs: sqlite:///relative.db,
sqlite:////abs/path.db, a plain path, jdbc:sqlite:/path.db,
postgresql://user:pass@host/db, jdbc:postgresql://host/db. An outbox that does
not exist is an error: the CLI never creates one.

\b
Every command that prints data takes --json (all but `ui`, which serves): one
JSON document on stdout. With --json an error is a document on stdout too,
{{"error": {{"type": "usage", "message": "...", "exit_code": 2}}}}, where type
names the exit code (below); the exit code is the same as without --json.

{TIME_HELP}

{EXIT_CODES_HELP}""",
)
@click.version_option(_version(), "--version", "-V", prog_name="outbox")
def cli() -> None:
    """Look at and act on a kafka-outbox store: drain it, check it, manage its dead letters, erase a key,
    read its audit log."""


cli.add_command(drain)
cli.add_command(status)
cli.add_command(dlq)
cli.add_command(erase)
cli.add_command(metrics)
cli.add_command(ui)
cli.add_command(keys)
cli.add_command(audit)


def main() -> None:
    """Console-script entry point (`outbox = outbox_cli.main:main`)."""
    drain_command.STANDALONE = True
    cli.main(prog_name="outbox")
