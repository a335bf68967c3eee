"""`outbox dlq`: list, show, purge and replay dead letters.

Everything goes through the `Outbox` store methods (`list_dead`, `get`, `purge_dead`,
`replay_dead`), the same ones the SDK uses: the CLI holds no SQL of its own. A purge goes in
bounded batches, each recorded in the store's audit log (`outbox.stores.audited`). What `list`
and `show` print is masked as the console masks it (`outbox.ui.masking`) unless `--reveal` is given,
which the audit log records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
from confluent_kafka import KafkaError

from outbox.consumer.headers import ConsumerFailure, consumer_failure
from outbox.consumer.redrive import redrive_topic
from outbox.message import topic_problem
from outbox.records import DeadLetterFilter, OutboxMessage, Status
from outbox.stores import Outbox
from outbox.stores.audited import purge_in_batches
from outbox.stores.filters import error_filter
from outbox.ui.masking import MASK, NO_MASKS, Masker, MaskRules

from . import format as fmt
from .common import (
    DURATION,
    EXIT_CODES_HELP,
    EXIT_USAGE,
    TIME,
    TIME_HELP,
    CliError,
    OutboxGroup,
    bootstrap_option,
    json_option,
    key_file_option,
    open_store,
    outbox_option,
    settings_option,
    who,
)
from .masks import mask_options, record_reveal, reveal_option

F = TypeVar("F", bound=Callable[..., Any])

def _check_to_topic(to_topic: str | None) -> None:
    """Kafka's own rule, checked here so a typo is not replayed into new dead letters."""
    problem = None if to_topic is None else topic_problem(to_topic)
    if problem is not None:
        raise CliError(f"--to-topic: {problem}", EXIT_USAGE)


def _check_error(value: str | None) -> str | None:
    """`--error` as the store matches it; a name that can match nothing is a usage error, not 'none found'."""
    matched = error_filter(value)
    if matched is None or matched.lstrip("+-").isdigit() or hasattr(KafkaError, matched) or "." in matched:
        return matched
    raise CliError(
        f"--error: {value!r} is not a librdkafka error code or name (e.g. -192, _MSG_TIMED_OUT, "
        "MSG_SIZE_TOO_LARGE) nor a consumer exception class (module.Class, e.g. builtins.ValueError); "
        "`outbox status` lists the errors of this outbox's dead letters",
        EXIT_USAGE,
    )


def filter_options(f: F) -> F:
    """--topic, --error, --since, --until (shared by list, purge and replay)."""
    f = click.option(
        "--until", type=TIME, metavar="TIME", help="Only dead letters whose last failure is before TIME."
    )(f)
    f = click.option(
        "--since", type=TIME, metavar="TIME", help="Only dead letters whose last failure is at or after TIME."
    )(f)
    f = click.option(
        "--error",
        metavar="CODE|NAME",
        help="Only dead letters that failed with this librdkafka error: a code (-192) or a name "
        "(_MSG_TIMED_OUT, MSG_SIZE_TOO_LARGE; case-insensitive), or a consumer's exception class "
        "(builtins.ValueError). `outbox status` lists the errors of an outbox's dead letters.",
    )(f)
    f = click.option("--topic", metavar="TOPIC", help="Only dead letters of this topic.")(f)
    return f


#: The largest row id a store holds: SQLite's INTEGER and PostgreSQL's bigint are 64-bit signed.
MAX_ROW_ID = 2**63 - 1


class RowIdParam(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """A message id, as `outbox dlq list` shows it: a bad one is said as such (exit 2), not as
    click's "not a valid integer range"."""

    name = "ID"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_ROW_ID:
            self.fail(
                f"{value!r} is not a message id: ids are whole numbers from 1 to {MAX_ROW_ID}, "
                "as `outbox dlq list` shows",
                param, ctx,
            )
        return int(text)


ROW_ID = RowIdParam()


def id_option(f: F) -> F:
    """--id ID (repeatable)."""
    return click.option(
        "--id",
        "ids",
        type=ROW_ID,
        multiple=True,
        metavar="ID",
        help="Only this dead letter (repeatable). Not with the filters: either ids or filters.",
    )(f)


def _ids_alone(ids: Sequence[int], **filters: object) -> None:
    """--id names dead letters exactly: a filter beside it could only narrow it, silently, to
    fewer than were named (often none), so the combination is refused."""
    given = [name.replace("_", "-") for name, value in filters.items() if value is not None]
    if ids and given:
        raise CliError(
            f"--id cannot be combined with --{given[0]}: give either ids or filters (--topic, --error, --since, "
            "--until, --group)",
            EXIT_USAGE,
        )


def _filter(
    topic: str | None,
    error: str | None,
    since: float | None,
    until: float | None,
    ids: Sequence[int] = (),
    limit: int | None = None,
    group: str | None = None,
    older_than: float | None = None,
) -> DeadLetterFilter:
    """The filter the options name. `older_than` (seconds) bounds the last failure as `until`
    does: both given, the earlier bound holds."""
    _ids_alone(ids, topic=topic, error=error, since=since, until=until, group=group, older_than=older_than)
    bound = "--until"
    if older_than is not None:
        cutoff = time.time() - older_than
        if until is None or cutoff < until:
            until, bound = cutoff, "--older-than"
    if since is not None and until is not None and since >= until:
        raise CliError(
            f"--since ({fmt.when(since)}) is not before {bound} ({fmt.when(until)}): no dead letter can match "
            "an empty range",
            EXIT_USAGE,
        )
    return DeadLetterFilter(
        ids=tuple(ids), topic=topic, error=_check_error(error), since=since, until=until, limit=limit, group=group
    )


def group_option(f: F) -> F:
    """--group GROUP: only a ResilientConsumer group's dead letters."""
    return click.option(
        "--group", metavar="GROUP", help="Only dead letters of this consumer group (ResilientConsumer)."
    )(f)


def _origin_text(o: ConsumerFailure) -> str:
    return f"{o.group}: {o.origin.topic} [{o.origin.partition}] @{o.origin.offset}"


def _message_json(stored: OutboxMessage, masker: Masker, encoding: str = "auto") -> dict[str, Any]:
    """A message for --json, masked: `masked` says whether anything is; `size` is the stored value's."""
    shown = masker.row(stored)
    doc = fmt.message_json(shown.row, encoding)
    doc["size"] = len(stored.value) if stored.value is not None else 0
    doc["masked"] = shown.masked
    o = consumer_failure(shown.row.headers)
    if o is not None:
        doc["consumer"] = o.as_dict()
    return doc


def _masker(masking: MaskRules, reveal: bool, store: Outbox, rows: Sequence[OutboxMessage]) -> Masker:
    """The masker of what is printed; with --reveal none, recorded in the audit log first."""
    if not reveal:
        return Masker(masking)
    record_reveal(store, [r.id for r in rows], who())
    return NO_MASKS


_MASKED_NOTE = f"(masked parts show {MASK}; --reveal shows every byte, recorded in the audit log)"


def _describe(flt: DeadLetterFilter) -> str:
    """The filter in words, for confirmations and messages."""
    parts = []
    if flt.group is not None:
        parts.append(f"group {flt.group}")
    if flt.ids:
        parts.append("id " + ", ".join(str(i) for i in flt.ids))
    if flt.topic is not None:
        parts.append(f"topic {flt.topic}")
    if flt.error is not None:
        parts.append(f"error {flt.error}")
    if flt.since is not None:
        parts.append(f"failed since {fmt.when(flt.since)}")
    if flt.until is not None:
        parts.append(f"failed before {fmt.when(flt.until)}")
    return " matching " + ", ".join(parts) if parts else ""


def _check_ids(store: Outbox, ids: Sequence[int]) -> None:
    """Every --id must name a dead letter: a typo is an error, not a silent 'removed 0'."""
    for i in ids:
        row = store.get(i)  # UnknownMessageError → exit 1
        if row.status is not Status.DEAD:
            raise CliError(f"message {i} is {row.status.name.lower()}, not a dead letter")


@click.group("dlq", cls=OutboxGroup)
def dlq() -> None:
    """Dead letters: messages that will not be retried any more.

    \b
    Examples:
      outbox dlq list --outbox app.db --since 2h
      outbox dlq show 42 --outbox app.db
      outbox dlq replay --outbox app.db --error MSG_SIZE_TOO_LARGE --to-topic orders-large
      outbox dlq purge --outbox app.db --topic orders --until 2024-05-01 --yes
      outbox dlq replay-topic orders.billing.dlq -b kafka:9092
    """


@dlq.command(
    "list",
    epilog=f"""\b
Examples:
  outbox dlq list --outbox app.db
  outbox dlq list --outbox app.db --topic orders --error _MSG_TIMED_OUT --since 1d
  outbox dlq list --outbox app.db --since 2024-05-01T00:00 --until 2024-05-02 --json

{TIME_HELP}

{EXIT_CODES_HELP}""",
)
@outbox_option
@key_file_option
@filter_options
@group_option
@click.option(
    "--limit", type=click.IntRange(min=1), metavar="N", help="At most N dead letters (oldest first)."
)
@mask_options
@reveal_option
@json_option
def list_cmd(
    outbox_url: str,
    topic: str | None,
    error: str | None,
    since: float | None,
    until: float | None,
    group: str | None,
    limit: int | None,
    masking: MaskRules,
    reveal: bool,
    as_json: bool,
) -> None:
    """One line per dead letter: id, topic, key, size, attempts, first/last failure, error.

    Dead letters of a ResilientConsumer also show where they came from (ORIGIN: group, original
    topic [partition] @ offset); their TOPIC is the group's first retry tier, where a replay
    sends them. Values (--json), headers and errors are masked unless --reveal is given.
    """
    flt = _filter(topic, error, since, until, limit=limit, group=group)
    with open_store(outbox_url) as (store, _url):
        rows = store.list_dead(flt)
        masker = _masker(masking, reveal, store, rows)
    if as_json:
        click.echo(fmt.dumps([_message_json(r, masker) for r in rows]))
        return
    if not rows:
        click.echo(f"No dead letters{_describe(flt)}.")
        return
    origins = [consumer_failure(r.headers) for r in rows]
    with_origin = any(o is not None for o in origins)
    columns = ["ID", "TOPIC", "KEY", "SIZE", "ATTEMPTS", "FIRST FAILED", "LAST FAILED", "ERROR"]
    if with_origin:
        columns.insert(2, "ORIGIN")
    lines = []
    for r, o in zip(rows, origins, strict=True):
        line = [
            str(r.id),
            r.topic,
            fmt.short_bytes(r.key),
            str(len(r.value) if r.value is not None else 0),
            str(r.attempts),
            fmt.when(r.first_failed_at),
            fmt.when(r.last_failed_at),
            " ".join((masker.text(r.last_error) or "-").split()),
        ]
        if with_origin:
            line.insert(2, "-" if o is None else _origin_text(o))
        lines.append(line)
    click.echo(fmt.table(columns, lines))


@dlq.command(
    "show",
    epilog=f"""\b
Examples:
  outbox dlq show 42 --outbox app.db
  outbox dlq show 42 --outbox app.db --encoding base64 --json

{EXIT_CODES_HELP}""",
)
@click.argument("message_id", metavar="ID", type=ROW_ID)
@outbox_option
@key_file_option
@click.option(
    "--encoding",
    type=click.Choice(["auto", "hex", "base64"]),
    default="auto",
    show_default=True,
    help="How to print keys, values and headers: auto = text when it is printable UTF-8, else hex "
    f"(up to {fmt.HEX_LIMIT} bytes) or base64.",
)
@mask_options
@reveal_option
@json_option
def show(message_id: int, outbox_url: str, encoding: str, masking: MaskRules, reveal: bool, as_json: bool) -> None:
    """Everything about one dead letter: metadata, error, headers and the value, printed safely.

    Binary data is never written raw to the terminal: keys, values and headers that are not
    printable UTF-8 text are shown as hex or base64, labelled. Secrets are masked (the console's
    rules: --mask-* options, --mask-config) unless --reveal is given, which the audit log records.
    """
    with open_store(outbox_url) as (store, _url):
        stored = store.get(message_id)
        if stored.status is not Status.DEAD:
            raise CliError(
                f"message {message_id} is {stored.status.name.lower()}, not a dead letter "
                "(`outbox status` shows what is pending)"
            )
        masker = _masker(masking, reveal, store, [stored])
    doc = _message_json(stored, masker, encoding)
    if as_json:
        click.echo(fmt.dumps(doc))
        return
    row = masker.row(stored).row
    fields = [
        ("id", str(row.id)),
        ("message id", row.msg_id or "-"),
        ("status", doc["status"]),
        ("topic", row.topic),
        ("partition", "any" if row.partition < 0 else str(row.partition)),
        ("attempts", str(row.attempts)),
        ("created", fmt.when(row.created_at)),
        ("first failed", fmt.when(row.first_failed_at)),
        ("last failed", fmt.when(row.last_failed_at)),
    ]
    fields.append(("last error", " ".join((row.last_error or "-").split())))
    origin = consumer_failure(row.headers)
    if origin is not None:
        fields += [
            ("consumer group", origin.group),
            ("original topic", origin.origin.topic),
            ("original partition", str(origin.origin.partition)),
            ("original offset", str(origin.origin.offset)),
            ("exception", origin.error_class or "-"),
            ("exception message", " ".join((origin.error_message or "-").split())),
        ]
    fields.append(("key", _labelled(doc["key"], doc["key_encoding"], row.key)))
    click.echo(fmt.table(None, fields))
    click.echo(f"headers ({len(row.headers)}):")
    for h in doc["headers"]:
        raw = None if h["value"] is None else h["value"]
        click.echo(f"  {_safe_name(h['name'])}: {_labelled(raw, h['encoding'], None)}")
    n = len(stored.value) if stored.value is not None else 0
    if row.value is None:
        click.echo("value: null")
    else:
        click.echo(f"value ({doc['value_encoding']}, {n} bytes):")
        click.echo(doc["value"])
    if doc["masked"]:
        click.echo(_MASKED_NOTE, err=True)


def _labelled(text: str | None, encoding: str | None, raw: bytes | None) -> str:
    if text is None:
        return "null"
    size = f", {len(raw)} bytes" if raw is not None else ""
    if encoding == "utf-8":
        return text if "\n" not in text else repr(text)
    return f"{text} ({encoding}{size})"


def _safe_name(name: str) -> str:
    return name if name.isprintable() else repr(name)


@dlq.command(
    "purge",
    epilog=f"""\b
Examples:
  outbox dlq purge --outbox app.db --id 17 --id 18
  outbox dlq purge --outbox app.db --topic orders --error TOPIC_AUTHORIZATION_FAILED --yes
  outbox dlq purge --outbox app.db --older-than 30d --yes
  outbox dlq purge --outbox app.db --topic orders --older-than 12h --yes

{TIME_HELP}

\b
DURATION is a number above 0 and a unit: 90s, 30m, 12h, 7d, 2w.

{EXIT_CODES_HELP}""",
)
@outbox_option
@key_file_option
@filter_options
@click.option(
    "--older-than",
    type=DURATION,
    metavar="DURATION",
    help="Only dead letters whose last failure is older than DURATION (what a producer's dead_letter_retention "
    "deletes). With --until, the earlier of the two holds.",
)
@group_option
@id_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
def purge(
    outbox_url: str,
    topic: str | None,
    error: str | None,
    since: float | None,
    until: float | None,
    older_than: float | None,
    group: str | None,
    ids: tuple[int, ...],
    yes: bool,
    as_json: bool,
) -> None:
    """Delete dead letters for good: all of them, those the filters match, or those --id names.

    Asks for confirmation (on stderr) unless --yes is given; without a terminal to answer, a
    purge without --yes is aborted (exit 1), and --json needs --yes (exit 2). Only dead letters
    are ever deleted, never pending messages. They are deleted 1,000 at a time, each batch its
    own transaction and its own entry in the store's audit log (who: cli:USER).
    """
    if as_json and not yes:
        raise CliError("--json needs --yes: a purge asks for confirmation, and a JSON reader cannot answer it",
                       EXIT_USAGE)
    flt = _filter(topic, error, since, until, ids, group=group, older_than=older_than)
    with open_store(outbox_url) as (store, url):
        _check_ids(store, ids)
        described = _describe(flt)
        matching = store.count_dead(flt)
        if matching and not yes:
            click.confirm(
                f"Delete {matching} dead letter(s){described} from {url.redacted()}? "
                "This cannot be undone",
                abort=True,
                err=True,
            )
        removed = purge_in_batches(store, flt, who=who()) if matching else 0
    if as_json:
        click.echo(fmt.dumps({"outbox": url.redacted(), "removed": removed}))
    elif removed:
        click.echo(f"Removed {removed} dead letter(s).")
    else:
        click.echo(f"No dead letters{described}; removed 0.")


@dlq.command(
    "replay",
    epilog=f"""\b
Examples:
  outbox dlq replay --outbox app.db --id 17
  outbox dlq replay --outbox app.db --error _MSG_TIMED_OUT --since 1d
  outbox dlq replay --outbox app.db --topic orders --to-topic orders-retry
  then: outbox drain --outbox app.db -b kafka:9092

{TIME_HELP}

{EXIT_CODES_HELP}""",
)
@outbox_option
@key_file_option
@filter_options
@group_option
@id_option
@click.option(
    "--to-topic", metavar="TOPIC", help="Send the replayed messages to this topic instead of their own."
)
@json_option
def replay(
    outbox_url: str,
    topic: str | None,
    error: str | None,
    since: float | None,
    until: float | None,
    group: str | None,
    ids: tuple[int, ...],
    to_topic: str | None,
    as_json: bool,
) -> None:
    """Put dead letters back into the pending queue, attempts reset, so the next drain sends them.

    Key, value and headers are kept byte for byte; --to-topic only changes where they go.
    Either --id or filters; with neither, every dead letter is replayed. A ResilientConsumer's dead letter
    goes to its group's first retry tier (<topic>.<group>.retry-1), never to the main topic that
    other groups read as well.
    """
    _check_to_topic(to_topic)
    flt = _filter(topic, error, since, until, ids, group=group)
    with open_store(outbox_url) as (store, url):
        _check_ids(store, ids)
        described = _describe(flt)
        replayed = store.replay_dead(flt, now=time.time(), to_topic=to_topic)
    if as_json:
        click.echo(fmt.dumps({"outbox": url.redacted(), "replayed": replayed, "to_topic": to_topic}))
    elif replayed:
        where = f" addressed to topic {to_topic}" if to_topic else ""
        click.echo(
            f"Replayed {replayed} dead letter(s) into the pending queue{where}, attempts reset; "
            "`outbox drain` sends them."
        )
    else:
        click.echo(f"No dead letters{described}; replayed 0.")


@dlq.command(
    "replay-topic",
    epilog=f"""\b
Examples:
  outbox dlq replay-topic orders.billing.dlq -b kafka:9092
  outbox dlq replay-topic orders.billing.dlq -b kafka:9092 --limit 100 --json
  outbox dlq replay-topic legacy-dlq -b kafka:9092 --to-topic orders.billing.retry-1

{EXIT_CODES_HELP}""",
)
@click.argument("dlq_topic", metavar="DLQ_TOPIC")
@bootstrap_option("Kafka brokers.")
@settings_option("A librdkafka client setting (repeatable), e.g. -X security.protocol=SSL.")
@click.option(
    "--to-topic", metavar="TOPIC", help="Send every message here instead of its group's first retry tier."
)
@click.option("--limit", type=click.IntRange(min=1), metavar="N", help="At most N messages.")
@click.option("--timeout", type=click.FloatRange(min=1), default=30.0, show_default=True, help="Seconds per step.")
@json_option
def replay_topic(
    dlq_topic: str,
    bootstrap_servers: str,
    settings: dict[str, str],
    to_topic: str | None,
    limit: int | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Republish a ResilientConsumer's DLQ topic into its group's first retry tier.

    Each message goes to <original topic>.<group>.retry-1 (from its outbox-original-topic and
    outbox-group headers), never to the main topic that other groups read too; headers are
    kept, except outbox-due-at (due at once). Progress is remembered by the consumer group
    outbox-redrive.<DLQ_TOPIC> and committed only after Kafka acknowledged every republished
    message, so running it again replays only what came later (or what an interrupted run did
    not finish).
    """
    _check_to_topic(to_topic)
    config = {"bootstrap.servers": bootstrap_servers, **settings}
    result = redrive_topic(config, dlq_topic, to_topic=to_topic, limit=limit, timeout=timeout)
    if as_json:
        click.echo(fmt.dumps({"dlq_topic": dlq_topic, "replayed": result.replayed, "by_topic": result.by_topic}))
    elif result.replayed:
        where = ", ".join(f"{n} to {t}" for t, n in sorted(result.by_topic.items()))
        click.echo(f"Replayed {result.replayed} message(s) from {dlq_topic}: {where}.")
    else:
        click.echo(f"Nothing to replay in {dlq_topic}.")
