"""`outbox keys`: the encryption keys of an outbox. `outbox keys rotate` re-encrypts every stored
message with the newest key (`Outbox.rotate_keys`), so that older keys can be dropped."""

from __future__ import annotations

import time

import click

from outbox.stores.base import Rotation

from . import format as fmt
from .common import (
    EXIT_CODES_HELP,
    CliError,
    OutboxCommand,
    OutboxGroup,
    json_option,
    key_file_option,
    key_ring,
    open_store,
    outbox_option,
)


@click.group(cls=OutboxGroup)
def keys() -> None:
    """Encryption keys of an encrypted outbox (docs/encryption.md)."""


@keys.command(
    "rotate",
    cls=OutboxCommand,
    epilog=f"""\b
Examples:
  outbox keys rotate --outbox app.db --key-file new.key --key-file old.key
  OUTBOX_ENCRYPTION_KEYS=NEW,OLD outbox keys rotate --outbox app.db --json

{EXIT_CODES_HELP}""",
)
@outbox_option
@key_file_option
@click.option("--batch", type=click.IntRange(min=1), default=1000, show_default=True, metavar="N",
              help="Messages re-encrypted per transaction (about: a row of several is taken whole).")
@json_option
def rotate(outbox_url: str, batch: int, as_json: bool) -> None:
    """Re-encrypt every stored message (pending or dead) with the newest key, the first given.

    Messages under an older key, or stored in clear, are encrypted again with the newest key,
    about N messages per short transaction (a row of several messages whole), while producers
    and drains keep running. A message leased to a sender meanwhile is left as it is and counted
    as left: run the rotation again later. Once none is left, the older keys can be dropped.
    """
    with open_store(outbox_url) as (store, url):
        ring = key_ring(click.get_current_context())
        if ring is None:
            raise CliError(
                "give the keys: --key-file NEW --key-file OLD ... (or $OUTBOX_ENCRYPTION_KEYS), newest first"
            )
        done: Rotation = store.rotate_keys(now=time.time(), batch=batch)
    if as_json:
        click.echo(fmt.dumps({
            "outbox": url.redacted(), "key_id": ring.current, "reencrypted": done.reencrypted, "left": done.left,
        }))
        return
    click.echo(f"Re-encrypted {done.reencrypted} message(s) with key {ring.current}; {done.left} left.")
    if done.left:
        click.echo("Those left were leased to a sender or written meanwhile under another key: run it again later.")
