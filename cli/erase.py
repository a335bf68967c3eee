"""`outbox erase`: delete every stored message of one key (a data subject's request to be
forgotten), pending and dead.

Through `outbox.stores.audited.erase_key`, as the console's erase: the store's `erase_key` in
short transactions, and one audit entry that names the key by a digest, never by its bytes. The
CLI holds no SQL of its own.
"""

from __future__ import annotations

import click

from outbox.stores.audited import erase_key, key_digest
from outbox.stores.base import Erased

from . import format as fmt
from .common import (
    EXIT_CODES_HELP,
    EXIT_USAGE,
    CliError,
    OutboxCommand,
    json_option,
    key_file_option,
    open_store,
    outbox_option,
    who,
)


def _key(text: str | None, hex_text: str | None) -> bytes:
    """The key one of --key and --key-hex gives (never echoed in an error: it is the data to forget)."""
    if (text is None) == (hex_text is None):
        raise CliError("give the key once: --key TEXT, or --key-hex HEX for a key that is not text", EXIT_USAGE)
    if text is not None:
        return text.encode("utf-8")
    assert hex_text is not None
    try:
        return bytes.fromhex(hex_text)
    except ValueError:
        raise CliError("--key-hex: not hex (two hex digits per byte, e.g. 00ff10; the value is not echoed)",
                       EXIT_USAGE) from None


def _counts(e: Erased) -> str:
    return f"{e.pending} pending, {e.dead} dead letter(s), {e.leased} of them leased"


@click.command(
    "erase",
    cls=OutboxCommand,
    epilog=f"""\b
Examples:
  outbox erase --outbox app.db --key customer-42 --dry-run
  outbox erase --outbox app.db --key customer-42 --topic orders --yes
  outbox erase --outbox app.db --key-hex 00ff10 --yes --json

{EXIT_CODES_HELP}""",
)
@outbox_option
@key_file_option
@click.option("--key", "key_text", metavar="KEY", help="The key, as UTF-8 text.")
@click.option("--key-hex", metavar="HEX", help="The key as hex, for a key that is not text (00ff10).")
@click.option("--topic", metavar="TOPIC", help="Only the key's messages of this topic.")
@click.option("--dry-run", is_flag=True, help="Count what would be erased; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
def erase(
    outbox_url: str,
    key_text: str | None,
    key_hex: str | None,
    topic: str | None,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Delete every pending message and dead letter of one key from the outbox, for good.

    Messages stored several to a row are split so that other keys' messages keep their ids and
    their order. Rows leased to a sender are deleted too and counted as leased: their send may
    be in flight and still reach Kafka. What Kafka already holds is not touched. A producer
    that queues the key's new messages behind its stored ones sends them on within seconds.

    The erasure is recorded in the store's audit log (action erase, who cli:USER) with the
    first 16 hex digits of the key's SHA-256, never the key itself; the output names the key
    the same way. Asks for confirmation (on stderr) unless --yes or --dry-run is given; --json
    needs one of them (exit 2).
    """
    key = _key(key_text, key_hex)
    if as_json and not (yes or dry_run):
        raise CliError("--json needs --yes (or --dry-run): an erasure asks for confirmation, and a JSON reader "
                       "cannot answer it", EXIT_USAGE)
    named = f"key sha256:{key_digest(key)}" + ("" if topic is None else f" of topic {topic}")
    with open_store(outbox_url) as (store, url):
        found = erase_key(store, key, topic=topic, who=who(), dry_run=True)
        if found.total and not (yes or dry_run):
            click.confirm(
                f"Erase {found.total} message(s) of {named} ({_counts(found)}) from {url.redacted()}? "
                "This cannot be undone",
                abort=True,
                err=True,
            )
        # Even with nothing found the erasure runs: it is recorded, and catches what came since the count.
        done = found if dry_run else erase_key(store, key, topic=topic, who=who())
    if as_json:
        click.echo(fmt.dumps({
            "outbox": url.redacted(), "key_sha256": key_digest(key), "topic": topic, "dry_run": dry_run,
            "pending": done.pending, "dead": done.dead, "leased": done.leased, "total": done.total,
        }))
    elif dry_run:
        click.echo(f"Would erase {done.total} message(s) of {named}: {_counts(done)}.")
    elif not done.total:
        click.echo(f"No message of {named} in the outbox; erased 0.")
    else:
        click.echo(f"Erased {done.total} message(s) of {named}: {_counts(done)}.")
        if done.leased:
            click.echo(f"{done.leased} were leased to a sender: their send may have been in flight, and they may "
                       "still reach Kafka.")
