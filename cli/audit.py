"""`outbox audit`: the store's audit log (every purge, erasure, retention pass, redrive and
reveal), listed and filtered without starting the console.

The filter is `outbox.stores.audited.read_audit`, the console's too, so both show the same
entries for the same question.
"""

from __future__ import annotations

import json
from typing import Any

import click

from outbox.records import AuditEntry
from outbox.stores.audited import AuditQuery, read_audit

from . import format as fmt
from .common import EXIT_CODES_HELP, TIME, TIME_HELP, OutboxCommand, json_option, open_store, outbox_option


def entry_json(e: AuditEntry) -> dict[str, Any]:
    """One entry for `--json`: `filter` as the JSON object it is stored as (a bare string if an
    older entry holds text that is not JSON)."""
    try:
        named: Any = json.loads(e.filter)
    except ValueError:
        named = e.filter
    return {"id": e.id, "at": fmt.iso(e.at), "who": e.who, "action": e.action, "filter": named, "count": e.count}


@click.command(
    "audit",
    cls=OutboxCommand,
    epilog=f"""\b
Examples:
  outbox audit --outbox app.db
  outbox audit --outbox app.db --action erase --since 30d
  outbox audit --outbox app.db --who cli --action purge --action erase --json

{TIME_HELP}

{EXIT_CODES_HELP}""",
)
@outbox_option
@click.option("--who", metavar="WHO",
              help="Only entries by this actor: cli:alice, local, token:1a2b3c4d, retention, or the part "
              "before the colon for every actor of a kind (cli, token, proxy, spark_drain).")
@click.option("--action", "actions", multiple=True, metavar="ACTION",
              help="Only entries of this action (repeatable): purge, erase, erase (failed), redrive, "
              "redrive-topic, edit-redrive, reveal.")
@click.option("--since", type=TIME, metavar="TIME", help="Only entries written at or after TIME.")
@click.option("--until", type=TIME, metavar="TIME", help="Only entries written before TIME.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True, metavar="N",
              help="At most N entries, the newest first.")
@json_option
def audit(outbox_url: str, who: str | None, actions: tuple[str, ...], since: float | None,
          until: float | None, limit: int, as_json: bool) -> None:
    """List the audit log, newest first: when, who, what (the action and what it named) and how
    many messages it changed.

    Every purge (one entry per batch), erasure, retention pass, redrive, edit and reveal is in
    it, whoever did it: this command, the console, a producer's retention, the Spark job. An
    erasure names its key by a digest (key_sha256), never by its bytes.
    """
    query = AuditQuery(who=who, actions=actions, since=since, until=until, limit=limit)
    with open_store(outbox_url) as (store, url):
        entries = read_audit(store, query)
    if as_json:
        click.echo(fmt.dumps({"outbox": url.redacted(), "entries": [entry_json(e) for e in entries]}))
        return
    if not entries:
        click.echo(f"No audit entries in {url.redacted()} match.")
        return
    rows = [[str(e.id), fmt.when(e.at), e.who, e.action, str(e.count), e.filter] for e in entries]
    click.echo(fmt.table(["id", "when", "who", "action", "count", "what"], rows))
