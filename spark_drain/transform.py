"""Changing the selected messages before they are sent: `--where`, `--set`, `--to-topic`, `--transform`.

The messages pass three steps on the executors, after group rows are exploded and before the
shuffle that puts each key in one send task:

1. `decode_batches` (Arrow, Python): sealed payloads opened, headers decoded into `headers`
   (`VIEW`) and `header`, a map of each header's last value as text for SQL, when a step reads
   them (a transform, or an expression naming them; `uses_headers`).
2. `apply_sql` (Spark SQL, in the JVM): `--where` marks rows not to send (`keep` false),
   `--set value=` / `--set topic=` and `--to-topic` rewrite the rows kept.
3. `finish_batches` (Arrow, Python): the `--transform` function, its output checked, and each
   message back in the send stage's columns (`PREPARED`): headers encoded again (or, when no step
   read them, passed through as stored, column by column), and a message whose topic changed
   given `outbox-original-topic` and no fixed partition.

Every step runs before the shuffle that gives each key its send task (`spark_drain.stages`), and
Spark starts no send task until every task before that shuffle succeeded: a failing transform
stops the job with nothing sent and no row changed (`spark_drain.job`).

Rows not kept (not matched by `--where`, or dropped by the transform) travel on to the send
stage without their payload: they are not sent, not settled and never rewritten, and each holds
back the later messages of its key in this run (`spark_drain.batches.chunks`), so the outbox's
per-key order holds. `topic` is where a message goes; `origin` is its topic in the outbox, which
routes, orders and holds back keys.

A changed message the send stage does not deliver is stored changed, with the header
`CHANGED_HEADER: change_mark(...)` (`spark_drain.send`). A re-run: a message that carries the
mark of this job's changes (`changed`) is kept whatever `--where` says, and passes every step
unchanged: the same job run again sends what the first run left as that run changed it, never
changing it twice. Other changes change it as any message.

Why Arrow for the transform and not a DataFrame function: it runs in the Python worker of the
task that already holds the batch, adds no Spark stage or shuffle, and any Python runs in it
(pandas through `RecordBatch.to_pandas`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from outbox.consumer.headers import ORIGINAL_TOPIC
from outbox.errors import ConfigError, OutboxError
from outbox.headers import ID_HEADER
from outbox.stores import grouped, sealed
from outbox.stores.codec import decode_headers, encode_headers
from spark_drain.batches import GROUPED_MESSAGES, MESSAGE_NAMES

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from outbox.stores.encryption import KeyRing

#: What `--where`, `--set` and a transform see of a message (Spark DDL); a transform gets exactly
#: these columns. `headers` in stored order, a header without a value has a null one; `timestamp`
#: in ms (null: none stored); `attempts`: failed sends so far (a dead letter's, before its replay
#: resets them).
VIEW = (
    "topic STRING, key BINARY, value BINARY, headers ARRAY<STRUCT<key: STRING, value: BINARY>>, "
    "timestamp LONG, id LONG, attempts INT"
)
VIEW_NAMES = ("topic", "key", "value", "headers", "timestamp", "id", "attempts")
#: What a transform must return unchanged: `id` settles the row, `key` orders it, `timestamp` and
#: `attempts` are the stored message's.
READ_ONLY = ("id", "key", "timestamp", "attempts")
#: What `--set` may rewrite.
SETTABLE = ("value", "topic")
#: What SQL sees (`decode_batches`): the message's columns, the view's `headers`, `header` (name ->
#: last value as UTF-8 text), `origin` (its topic in the outbox) and `keep`.
DECODED = (
    "id LONG, msg_id STRING, topic STRING, key BINARY, value BINARY, "
    "headers ARRAY<STRUCT<key: STRING, value: BINARY>>, part INT, attempts INT, first_failed_at DOUBLE, "
    "last_error STRING, timestamp LONG, grp LONG, grp_n LONG, origin STRING, header MAP<STRING, STRING>, "
    "keep BOOLEAN, stored_headers BINARY, changed BOOLEAN"
)
DECODED_NAMES = (
    "id", "msg_id", "topic", "key", "value", "headers", "part", "attempts", "first_failed_at", "last_error",
    "timestamp", "grp", "grp_n", "origin", "header", "keep", "stored_headers", "changed",
)
#: The header a changed message the job did not deliver is stored with (`spark_drain.send`): the
#: `change_mark` of the changes it holds.
CHANGED_HEADER = "outbox-changed"
#: What the send stage reads (`spark_drain.batches.MessageChunk`): a grouped store's message columns
#: (payloads in clear, `enc_key` NULL), the message's topic in the outbox, and whether to send it.
PREPARED = GROUPED_MESSAGES + ", origin STRING, keep BOOLEAN"


class TransformError(OutboxError):
    """A `--transform` function failed or returned what it may not."""


def load_transform(spec: str) -> Callable[[Iterator[pa.RecordBatch]], Iterable[pa.RecordBatch]]:
    """The function `package.module:function` names.

    Raises:
        ConfigError: not of that form, the module cannot be imported, or it has no such function.
    """
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"--transform {spec!r}: expected package.module:function")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the import raised, named in one line
        raise ConfigError(f"--transform {spec}: cannot import module {module}: {type(exc).__name__}: {exc}") from exc
    fn: Any = mod
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"--transform {spec}: module {module} has no {name}")
    if not callable(fn):
        raise ConfigError(f"--transform {spec}: {name} is not a function")
    return fn  # type: ignore[no-any-return]


def change_mark(sets: Sequence[tuple[str, str]], to_topic: str | None, transform: str | None,
                where: str | None) -> str | None:
    """The `CHANGED_HEADER` value of these changes: a digest of the options as given (the same
    options, the same mark). None: nothing is changed (`--where` alone only selects)."""
    if not (sets or to_topic is not None or transform):
        return None
    text = json.dumps([where, [list(s) for s in sets], to_topic, transform])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def marked_by(mark: str) -> bytes:
    """The bytes of the header `CHANGED_HEADER: mark` inside a message's encoded headers."""
    encoded = encode_headers([(CHANGED_HEADER, mark.encode())])
    assert encoded is not None
    return encoded


def parse_set(text: str) -> tuple[str, str]:
    """`COLUMN=EXPRESSION` of `--set`.

    Raises:
        ConfigError: no `=`, an empty expression, or a column other than `SETTABLE`'s.
    """
    name, sep, expr = text.partition("=")
    name = name.strip()
    if not sep or not expr.strip():
        raise ConfigError(f"--set {text!r}: expected COLUMN=EXPRESSION (COLUMN: {' or '.join(SETTABLE)})")
    if name not in SETTABLE:
        raise ConfigError(f"--set {text!r}: cannot set column {name!r}; only {' and '.join(SETTABLE)} can be set")
    return name, expr


# -- step 1: decode ---------------------------------------------------------------------------


def _header_type() -> pa.DataType:
    import pyarrow as pa

    return pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def uses_headers(where: str | None, sets: Sequence[tuple[str, str]], transform: str | None) -> bool:
    """Whether a step reads the messages' headers: a transform sees them, and an expression that
    names `headers` or `header`. A word match, so at worst headers are decoded for nothing."""
    texts = [where or "", *(text for _, text in sets)]
    return transform is not None or any("header" in text.lower() for text in texts)


def _headers_of(stored: bytes | None, msg_id: str) -> list[tuple[str, bytes | None]]:
    """A message's headers from their stored form (the stores' shorthand for the id alone included)."""
    return [(ID_HEADER, msg_id.encode())] if stored == grouped.ID_ALONE_HEADERS else decode_headers(stored)


def decode_batches(
    ring: KeyRing | None, with_headers: bool, mark: str | None, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body: message batches (`MESSAGES` + `SEALED`, or `GROUPED_MESSAGES`) as `DECODED`.

    `stored_headers` carries the headers as stored (opened, when sealed). Only `with_headers` are
    they decoded into `headers` and `header` (else empty): most changes touch values and topics
    only, and then no message is taken apart in Python. `changed`: the message carries the
    `CHANGED_HEADER` of `mark`, these very changes (an earlier run stored it changed), found in
    the stored bytes without decoding them.

    Raises:
        DecryptionError: a message is sealed with a key `ring` does not hold.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    for b in batches:
        names = b.schema.names
        n = b.num_rows
        value, stored_headers = b.column("value"), b.column("headers")
        msg_ids: list[str] = []
        stored: list[bytes | None] = []
        if "enc_key" in names and b.column("enc_key").null_count < n:
            ids = b.column("id").to_pylist()
            msg_ids, values, stored = (b.column(c).to_pylist() for c in ("msg_id", "value", "headers"))
            for i, kid in enumerate(b.column("enc_key").to_pylist()):
                if kid is not None:
                    values[i], stored[i] = sealed.open_payload(kid, ids[i], msg_ids[i], values[i], stored[i], ring)
            value, stored_headers = pa.array(values, pa.binary()), pa.array(stored, pa.binary())
        id_alone = with_headers and not stored and not stored_headers.null_count and pc.all(
            pc.equal(stored_headers, grouped.ID_ALONE_HEADERS)
        ).as_py()
        if id_alone:
            # Every message has the `outbox-id` header alone (the common message): built as columns.
            ones = pa.array(np.arange(n + 1, dtype=np.int32))
            names_ = pa.array([ID_HEADER] * n, pa.string())
            ids_ = b.column("msg_id")
            header_list = pa.ListArray.from_arrays(
                ones, pa.StructArray.from_arrays([names_, ids_.cast(pa.binary())], names=["key", "value"])
            )
            header_map = pa.MapArray.from_arrays(ones, names_, ids_.cast(pa.string()))
        elif with_headers:
            msg_ids = msg_ids or b.column("msg_id").to_pylist()
            stored = stored or b.column("headers").to_pylist()
            headers = [_headers_of(h, m) for h, m in zip(stored, msg_ids, strict=True)]
            by_name = [
                list({k: None if v is None else v.decode("utf-8", "replace") for k, v in hs}.items())
                for hs in headers
            ]
            header_list = pa.array([[{"key": k, "value": v} for k, v in hs] for hs in headers], _header_type())
            header_map = pa.array(by_name, pa.map_(pa.string(), pa.string()))
        else:
            # Empty, not null: Spark reads a column of null lists or maps far more slowly.
            no_offsets = pa.array(np.zeros(n + 1, np.int32))
            header_list = pa.ListArray.from_arrays(no_offsets, pa.array([], _header_type().value_type))
            header_map = pa.MapArray.from_arrays(no_offsets, pa.array([], pa.string()), pa.array([], pa.string()))
        if mark is None:
            changed = pa.array(np.zeros(n, bool))
        else:  # the encoded header is ASCII: its length prefixes are small, its name and mark hex
            changed = pc.fill_null(pc.match_substring(stored_headers, marked_by(mark).decode("ascii")), False)
        yield pa.RecordBatch.from_arrays(
            [
                b.column("id"), b.column("msg_id"), b.column("topic"), b.column("key"), value, header_list,
                b.column("part"), b.column("attempts"), b.column("first_failed_at"), b.column("last_error"),
                b.column("timestamp"),
                b.column("grp") if "grp" in names else b.column("id"),
                b.column("grp_n") if "grp_n" in names else pa.array(np.ones(n, np.int64)),
                b.column("topic"), header_map, pa.array(np.ones(n, bool)), stored_headers, changed,
            ],
            names=list(DECODED_NAMES),
        )


# -- step 2: SQL ------------------------------------------------------------------------------


def _sql_error(exc: Exception) -> str:
    """The first line of a Spark parse or analysis error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:400]


def apply_sql(df: DataFrame, where: str | None, sets: Sequence[tuple[str, str]], to_topic: str | None) -> DataFrame:
    """`--where`, then each `--set` in order, then `--to-topic`, over a `DECODED` DataFrame.

    A string `value` becomes its UTF-8 bytes. Rows `--where` does not match (or matches as null)
    are not kept; `--set` and `--to-topic` change only rows kept, so an expression never fails
    on a row that is not sent. A row an earlier run of these changes stored changed (`changed`)
    is kept and left as it is: it is sent as that run changed it, never changed twice.

    Raises:
        ConfigError: an expression does not parse or resolve, or has the wrong type.
    """
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, BooleanType, NullType, StringType

    keep = F.col("keep")
    fresh = F.col("keep") & ~F.col("changed")  # kept, and not changed yet
    if where is not None:
        try:
            cond = F.expr(where)
            kind = df.select(cond).schema[0].dataType
        except PySparkException as exc:
            raise ConfigError(f"--where {where!r}: {_sql_error(exc)}") from None
        if not isinstance(kind, BooleanType | NullType):
            raise ConfigError(f"--where {where!r}: the expression is {kind.simpleString()}, not a condition")
        df = df.withColumn("keep", keep & (F.col("changed") | F.coalesce(cond, F.lit(False))))
    for name, text in sets:
        try:
            expr = F.expr(text)
            kind = df.select(expr).schema[0].dataType
        except PySparkException as exc:
            raise ConfigError(f"--set {name}={text!r}: {_sql_error(exc)}") from None
        wanted = (StringType, BinaryType, NullType) if name == "value" else (StringType, NullType)
        if not isinstance(kind, wanted):
            raise ConfigError(
                f"--set {name}={text!r}: the expression is {kind.simpleString()}, not "
                + ("a string or binary" if name == "value" else "a string")
            )
        expr = expr.cast("binary" if name == "value" else "string")
        df = df.withColumn(name, F.when(fresh, expr).otherwise(F.col(name)))
    if to_topic is not None:
        df = df.withColumn("topic", F.when(fresh, F.lit(to_topic)).otherwise(F.col("topic")))
    return df


# -- step 3: the transform, and back to the send stage's columns ------------------------------


def _call(fn: Callable[[Iterator[pa.RecordBatch]], Iterable[pa.RecordBatch]], spec: str,
          view: pa.RecordBatch) -> list[pa.RecordBatch]:
    """The transform's output for one batch. When it raises, it is called on each message alone
    to name the first one it fails on (a transform is a function of its input: Spark may run it
    again for a retried task anyway)."""
    import pyarrow as pa

    try:
        out = list(fn(iter([view])))
    except Exception as exc:  # noqa: BLE001 - named with the message it fails on
        for i in range(view.num_rows):
            try:
                list(fn(iter([view.slice(i, 1)])))
            except Exception as one:  # noqa: BLE001
                msg_id = view.column("id")[i].as_py()
                raise TransformError(
                    f"--transform {spec} failed on message id {msg_id}: {type(one).__name__}: {one}"
                ) from one
        ids = view.column("id").to_pylist()
        raise TransformError(
            f"--transform {spec} failed on the messages with ids {min(ids)}..{max(ids)}: {type(exc).__name__}: {exc}"
        ) from exc
    for b in out:
        if not isinstance(b, pa.RecordBatch):
            raise TransformError(f"--transform {spec} returned a {type(b).__name__}, not a pyarrow.RecordBatch")
        unknown = [n for n in b.schema.names if n not in VIEW_NAMES]
        if unknown or "id" not in b.schema.names:
            raise TransformError(
                f"--transform {spec} returned columns {b.schema.names}: they must include id and be among "
                f"{', '.join(VIEW_NAMES)}"
            )
    return out


def _ids_header(headers: Sequence[tuple[str, Any]]) -> list[Any]:
    return [v for k, v in headers if k == ID_HEADER]


def finish_batches(
    spec: str | None, replay: bool, with_headers: bool, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body: `DECODED` batches through the transform `spec` names (if any), as `PREPARED`.

    `replay`: the messages are dead letters that the job puts back to pending before it sends
    them, which resets their attempts. Without `with_headers` (no transform, and no expression
    reads them) the stored headers pass through as they are (`_passed_through`).

    Raises:
        TransformError: the transform raised, or returned a message it was not given, one twice,
            a changed `READ_ONLY` column or `outbox-id` header, or a null topic.
    """
    import pyarrow as pa

    fn = load_transform(spec) if spec else None
    for b in batches:
        if not with_headers:
            yield _passed_through(b, replay)
            continue
        n = b.num_rows
        ids = b.column("id").to_pylist()
        keep = b.column("keep").to_pylist()
        changed = b.column("changed").to_pylist()
        topics = b.column("topic").to_pylist()
        values = b.column("value").to_pylist()
        headers: list[list[tuple[str, bytes | None]]] | None = None  # decoded once a transform returns them
        kept = [i for i in range(n) if keep[i] and not changed[i]]  # changed already: sent as it is
        if fn is not None and kept:
            view = b.take(pa.array(kept)).select(list(VIEW_NAMES))
            at = {ids[i]: p for p, i in enumerate(kept)}  # id -> its row in `view`
            given = {name: view.column(name).to_pylist() for name in READ_ONLY}
            seen: set[int] = set()
            for out in _call(fn, spec or "", view):
                cols = {name: out.column(name).to_pylist() for name in out.schema.names}
                for j, id_ in enumerate(cols["id"]):
                    if id_ not in at or id_ in seen:
                        why = "which it was not given" if id_ not in at else "twice"
                        raise TransformError(f"--transform {spec} returned message id {id_}, {why}")
                    seen.add(id_)
                    p = at[id_]
                    i = kept[p]
                    for name in READ_ONLY[1:]:
                        if name in cols and cols[name][j] != given[name][p]:
                            raise TransformError(
                                f"--transform {spec} changed the {name} of message id {id_}: "
                                f"{', '.join(READ_ONLY)} cannot be changed"
                            )
                    if "topic" in cols:
                        topics[i] = cols["topic"][j]
                    if "value" in cols:
                        values[i] = cols["value"][j]
                    if "headers" in cols:
                        if headers is None:
                            headers = [[(h["key"], h["value"]) for h in hs] for hs in b.column("headers").to_pylist()]
                        new = [(h["key"], h["value"]) for h in cols["headers"][j] or []]
                        if _ids_header(new) != _ids_header(headers[i]):
                            raise TransformError(
                                f"--transform {spec} changed the {ID_HEADER} header of message id {id_}"
                            )
                        headers[i] = new
            for i in kept:
                keep[i] = ids[i] in seen  # a message the transform dropped is not sent
        if headers is None:  # no header changed: the stored ones pass through, column by column
            yield _passed_through(_with(b, topic=pa.array(topics, pa.string()), value=pa.array(values, pa.binary()),
                                        keep=pa.array(keep, pa.bool_())), replay, spec)
        else:
            yield _prepared(b, ids, keep, topics, values, headers, replay, spec)


def _with(b: pa.RecordBatch, **columns: pa.Array) -> pa.RecordBatch:
    """`b` with some of its columns replaced."""
    import pyarrow as pa

    return pa.RecordBatch.from_arrays([columns.get(f, b.column(f)) for f in b.schema.names], names=b.schema.names)


def _prepared(
    b: pa.RecordBatch, ids: list[int], keep: list[bool], topics: list[str | None], values: list[bytes | None],
    headers: list[list[tuple[str, bytes | None]]], replay: bool, spec: str | None,
) -> pa.RecordBatch:
    """One `PREPARED` batch: headers encoded as the stores encode them, and a message sent to
    another topic than its own given `outbox-original-topic` (replacing any) and no partition
    (its stored one is a partition of the other topic)."""
    import numpy as np
    import pyarrow as pa

    origin = b.column("origin").to_pylist()
    msg_ids = b.column("msg_id").to_pylist()
    parts = b.column("part").to_pylist()
    encoded: list[bytes | None] = []
    for i in range(len(ids)):
        if not keep[i]:  # never sent: it only holds its key back
            topics[i], values[i] = origin[i], None
            encoded.append(None)
            continue
        if topics[i] is None:
            raise TransformError(f"{'--transform ' + spec if spec else '--set topic'} gave message id {ids[i]} "
                                 "no topic")
        hs = headers[i]
        if topics[i] != origin[i]:
            hs = [h for h in hs if h[0] != ORIGINAL_TOPIC] + [(ORIGINAL_TOPIC, origin[i].encode())]
            parts[i] = None
        if len(hs) == 1 and hs[0] == (ID_HEADER, msg_ids[i].encode()):
            encoded.append(grouped.ID_ALONE_HEADERS)  # the common message, as the stores carry it
        else:
            encoded.append(encode_headers(hs))
    attempts = pa.array(np.zeros(len(ids), np.int32)) if replay else b.column("attempts")
    return pa.RecordBatch.from_arrays(
        [
            b.column("id"), b.column("msg_id"), pa.array(topics, pa.string()), b.column("key"),
            pa.array(values, pa.binary()), pa.array(encoded, pa.binary()), pa.array(parts, pa.int32()),
            attempts, b.column("first_failed_at"), b.column("last_error"), b.column("timestamp"),
            b.column("grp"), b.column("grp_n"), pa.nulls(len(ids), pa.string()), b.column("origin"),
            pa.array(keep, pa.bool_()),
        ],
        names=[*MESSAGE_NAMES, "grp", "grp_n", "enc_key", "origin", "keep"],
    )


def _passed_through(b: pa.RecordBatch, replay: bool, spec: str | None = None) -> pa.RecordBatch:
    """`_prepared` for messages whose headers no step read, column by column: the stored headers
    are kept as they are; only a message sent to another topic is taken apart, for its
    `outbox-original-topic` header.

    Raises:
        TransformError: `--set topic` (or the transform `spec`) gave a message kept no topic.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    keep, topic, origin = b.column("keep"), b.column("topic"), b.column("origin")
    no_topic = pc.and_(keep, pc.is_null(topic))
    if pc.any(no_topic).as_py():
        raise TransformError(f"{'--transform ' + spec if spec else '--set topic'} gave message id "
                             f"{b.column('id').filter(no_topic)[0].as_py()} no topic")
    moved = pc.fill_null(pc.and_(keep, pc.not_equal(topic, origin)), False)
    encoded = pc.if_else(keep, b.column("stored_headers"), pa.scalar(None, pa.binary()))
    parts = b.column("part")
    if pc.any(moved).as_py():
        headers, part_list = encoded.to_pylist(), parts.to_pylist()
        msg_ids, origins = b.column("msg_id").to_pylist(), origin.to_pylist()
        for i in np.flatnonzero(moved.to_numpy(zero_copy_only=False)).tolist():
            hs = [h for h in _headers_of(headers[i], msg_ids[i]) if h[0] != ORIGINAL_TOPIC]
            headers[i] = encode_headers([*hs, (ORIGINAL_TOPIC, origins[i].encode())])
            part_list[i] = None  # the stored partition is one of the other topic's
        encoded, parts = pa.array(headers, pa.binary()), pa.array(part_list, pa.int32())
    attempts = pa.array(np.zeros(b.num_rows, np.int32)) if replay else b.column("attempts")
    return pa.RecordBatch.from_arrays(
        [
            b.column("id"), b.column("msg_id"), pc.if_else(keep, topic, origin), b.column("key"),
            pc.if_else(keep, b.column("value"), pa.scalar(None, pa.binary())), encoded, parts, attempts,
            b.column("first_failed_at"), b.column("last_error"), b.column("timestamp"), b.column("grp"),
            b.column("grp_n"), pa.nulls(b.num_rows, pa.string()), origin, keep,
        ],
        names=[*MESSAGE_NAMES, "grp", "grp_n", "enc_key", "origin", "keep"],
    )


def prepare(messages: DataFrame, ring: KeyRing | None, where: str | None, sets: Sequence[tuple[str, str]],
            to_topic: str | None, transform: str | None, replay: bool,
            explode: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = None) -> DataFrame:
    """Message batches (`MESSAGES` + `SEALED`, or `GROUPED_MESSAGES`) through the three steps, as `PREPARED`;
    messages that carry these changes' `change_mark` pass as they are. With `explode`, `messages`
    are a grouped store's rows, exploded into message batches in the Python pass that decodes them.

    Raises:
        ConfigError: an expression does not parse or resolve (checked here, before any row is read).
    """
    import functools

    with_headers = uses_headers(where, sets, transform)
    mark = change_mark(sets, to_topic, transform, where)
    finish = functools.partial(finish_batches, transform, replay, with_headers)

    # Each step in Python is a pass of every message from the JVM to Python and back: the steps
    # in a row run in one.
    def decode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return decode_batches(ring, with_headers, mark, batches if explode is None else explode(batches))

    if where is None and not sets and to_topic is None:
        return messages.mapInArrow(lambda batches: finish(decode(batches)), PREPARED)
    shaped = apply_sql(messages.mapInArrow(decode, DECODED), where, sets, to_topic)
    if transform is None and not with_headers and to_topic is None and all(name == "value" for name, _ in sets):
        return _finished_in_sql(shaped, replay)
    return shaped.select(*DECODED_NAMES).mapInArrow(finish, PREPARED)


def _finished_in_sql(df: DataFrame, replay: bool) -> DataFrame:
    """`_passed_through` in Spark SQL, for changes that read no header and send every message to
    its own topic: no Python pass after the SQL."""
    from pyspark.sql import functions as F

    keep = F.col("keep")
    return df.select(
        "id", "msg_id", F.col("origin").alias("topic"), "key", F.when(keep, F.col("value")).alias("value"),
        F.when(keep, F.col("stored_headers")).alias("headers"), "part",
        (F.lit(0).cast("int") if replay else F.col("attempts")).alias("attempts"),
        "first_failed_at", "last_error", "timestamp", "grp", "grp_n", F.lit(None).cast("string").alias("enc_key"),
        "origin", "keep",
    )
