"""`outbox status`: what an outbox holds, without reading any message bytes."""

from __future__ import annotations

import os
import time
from typing import Any

import click

from outbox.stores.registry import backend
from outbox.stores.urls import StoreURL

from . import backlog
from . import format as fmt
from .common import EXIT_CODES_HELP, OutboxCommand, json_option, open_store, outbox_option


def _file_sizes(url: StoreURL) -> dict[str, int] | None:
    """Sizes of a file-backed outbox's files (a SQLite WAL can hold much of the data between
    checkpoints); None for a store that is no file."""
    files = backend(url.kind).files
    if files is None:
        return None
    sizes = {}
    for name, path in files(url).items():
        try:
            sizes[name] = os.path.getsize(path)
        except OSError:
            sizes[name] = 0
    return sizes


@click.command(
    "status",
    cls=OutboxCommand,
    epilog=f"""\b
Examples:
  outbox status --outbox sqlite:////var/lib/app/outbox.db
  OUTBOX_URL=/var/lib/app/outbox.db outbox status --json

{EXIT_CODES_HELP}""",
)
@outbox_option
@json_option
def status(outbox_url: str, as_json: bool) -> None:
    """Counts by state and by topic, oldest pending age, next due time, dead letters by error.

    For a SQLite outbox the file size (and its write-ahead log's) is shown too. "What is left"
    says why each pending message is still there: due now, backing off until a time, leased by
    an owner (alive, or gone: the next drain takes its rows at once) or waiting behind an earlier
    message of its key. "Leases by owner" lists who holds what.
    """
    with open_store(outbox_url) as (store, url):
        now = time.time()
        st = store.stats(now=now)
        left = store.backlog(now=now)
    next_due = backlog.next_move(left, now)
    sizes = _file_sizes(url)
    oldest_age = None if st.oldest_pending_at is None else max(0.0, now - st.oldest_pending_at)
    if as_json:
        doc: dict[str, Any] = {
            "outbox": url.redacted(),
            "pending": st.pending,
            "leased": st.leased,
            "dead": st.dead,
            "oldest_pending_at": fmt.iso(st.oldest_pending_at),
            "oldest_pending_age_seconds": None if oldest_age is None else round(oldest_age, 3),
            # When a drain can next send something: rows that wait behind a lease or a back-off
            # are not "due now" even if their own time has come.
            "next_due_at": fmt.iso(next_due),
            "next_due_in_seconds": None if next_due is None else round(next_due - now, 3),
            "pending_by_topic": dict(sorted(st.pending_by_topic.items())),
            "dead_by_topic": dict(sorted(st.dead_by_topic.items())),
            "dead_by_error": dict(sorted(st.dead_by_error.items())),
            "backlog": backlog.as_json(left),
            "file_bytes": None if sizes is None else sizes["file"],
            "wal_bytes": None if sizes is None else sizes.get("wal", 0),
        }
        click.echo(fmt.dumps(doc))
        return

    lines = [("outbox", url.redacted())]
    if sizes is not None:
        lines.append(("file size", f"{fmt.size(sizes['file'])} (+ {fmt.size(sizes.get('wal', 0))} write-ahead log)"))
    leased = f" ({st.leased} leased now)" if st.leased else ""
    lines.append(("pending", f"{st.pending}{leased}"))
    lines.append(("dead letters", str(st.dead)))
    if st.oldest_pending_at is not None and oldest_age is not None:
        lines.append(("oldest pending", f"{fmt.when(st.oldest_pending_at)} ({fmt.duration(oldest_age)} ago)"))
    if next_due is not None:
        wait = next_due - now
        lines.append(("next due", "now" if wait <= 0 else f"{fmt.when(next_due)} (in {fmt.duration(wait)})"))
    width = len("oldest pending")  # fixed, so the layout does not shift with what is shown
    for k, v in lines:
        click.echo(f"{k.ljust(width)}  {v}")
    what = backlog.lines(left)
    if what:
        click.echo("\nwhat is left:")
        click.echo("\n".join(f"  {line}" for line in what))
    if left.leases:
        click.echo("\nleases by owner:")
        click.echo(backlog.lease_table(left))
    for title, counts in (
        ("pending by topic", st.pending_by_topic),
        ("dead letters by topic", st.dead_by_topic),
        ("dead letters by error", st.dead_by_error),
    ):
        if counts:
            click.echo(f"\n{title}:")
            ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            click.echo(fmt.table(None, [[name or "?", str(n)] for name, n in ranked], indent="  "))
