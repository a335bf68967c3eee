"""Executor side: the job's rows as Arrow record batches (`DataFrame.mapInArrow`), never as Row objects.

Why: a Spark `Row` (and a pickled RDD element) costs Python objects and calls per value on the
way in and out of every Python stage. With Arrow, Spark hands each Python worker whole column
batches, and the shuffle that puts each key's messages in one send task runs in the JVM on
Arrow-converted rows. Python touches a message twice: once to explode a SQLite group (when the
store groups rows) and once to send it.

Columns of a message batch (`MESSAGES`), as `outbox.stores.bulk.BulkRead.rows` reads a
one-message row: headers stay encoded (`outbox.codec`) until the sender decodes them. Messages of
a grouped store also say which row they were read from (`GROUPED_MESSAGES`: `grp`, the row's id,
and `grp_n`, its messages), so that a group is settled whole (`spark_drain.send`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from outbox.codec import decode_headers, encode_headers
from outbox.headers import ID_HEADER
from outbox.stores import grouped
from outbox.stores.bulk import BulkMessage
from outbox.stores.keyrule import waits

if TYPE_CHECKING:
    import pyarrow as pa

#: A message row, in `BulkMessage` order (Spark DDL). `headers` is `outbox.codec`-encoded, and
#: empty (never null) for the common message's `outbox-id` header alone, its value the msg_id:
#: neither encoded nor decoded per message.
MESSAGES = (
    "id LONG, msg_id STRING, topic STRING, key BINARY, value BINARY, headers BINARY, part INT, "
    "attempts INT, first_failed_at DOUBLE, last_error STRING, timestamp LONG"
)
_ID_ALONE = b""  # `headers` of a message whose only header is `outbox-id`, its value the msg_id
#: Names of `MESSAGES`' columns.
MESSAGE_NAMES = tuple(c.split()[0] for c in MESSAGES.split(", "))
#: A message of a grouped store: `MESSAGES`, and the row it was read from and that row's messages.
GROUPED_MESSAGES = MESSAGES + ", grp LONG, grp_n LONG"
#: What the job returns, per topic (`spark_drain.send.COUNTERS`).
COUNTS = "topic STRING, read LONG, delivered LONG, failed LONG, dead LONG, left LONG"
#: Names of `COUNTS`' columns.
COUNT_NAMES = tuple(c.split()[0] for c in COUNTS.split(", "))
#: What a send task returns: per-topic counts (`grp` null), and for each group it did not see
#: whole, the ids of its messages delivered (`done`) for the settle stage (`COUNTS` columns null).
SENT = COUNTS + ", grp LONG, grp_n LONG, done ARRAY<LONG>"


def explode_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body over `BulkRead.rows` of a grouped store (`GROUPED_MESSAGES`): one-message
    rows pass as they are (column selection only); each group row becomes its messages."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    for batch in batches:
        body = batch.column("body")
        singles = batch.filter(pc.is_null(body))
        if singles.num_rows:
            schema = _schema()
            # The reader's column types vary by driver (sqlite-jdbc reads an INTEGER as DECIMAL).
            cols = [singles.column(f.name).cast(f.type) for f in list(schema)[: len(MESSAGE_NAMES)]]
            cols += [cols[0], pa.array(np.ones(singles.num_rows, np.int64))]  # each its own row
            yield pa.RecordBatch.from_arrays(cols, schema=schema)
        groups = batch.filter(pc.is_valid(body))
        if groups.num_rows:
            yield _group_messages(groups)


def _schema() -> pa.Schema:
    """`GROUPED_MESSAGES` as an Arrow schema."""
    import pyarrow as pa

    types = (pa.int64(), pa.string(), pa.string(), pa.binary(), pa.binary(), pa.binary(), pa.int32(), pa.int32(),
             pa.float64(), pa.string(), pa.int64(), pa.int64(), pa.int64())
    return pa.schema(list(zip((*MESSAGE_NAMES, "grp", "grp_n"), types, strict=True)))


def _group_messages(groups: pa.RecordBatch) -> pa.RecordBatch:
    """The messages of group rows as one message batch (headers encoded again: the common
    `outbox-id` alone costs one short bytes join)."""
    import pyarrow as pa

    cols: list[list[object]] = [[] for _ in range(len(MESSAGE_NAMES) + 2)]
    ids, msg_ids, topics, keys, values, headers, parts, attempts, firsts, errors, stamps, gids, sizes = cols
    for gid, topic, body in zip(
        groups.column("id").to_pylist(), groups.column("topic").to_pylist(), groups.column("body").to_pylist(),
        strict=True,
    ):
        found = grouped.decode(body, gid, topic, 0.0)
        gids += [gid] * len(found)
        sizes += [len(found)] * len(found)
        for m in found:
            h = m.headers
            ids.append(m.id)
            msg_ids.append(m.msg_id)
            topics.append(topic)
            keys.append(m.key)
            values.append(m.value)
            headers.append(_ID_ALONE if len(h) == 1 and h[0][0] == ID_HEADER and h[0][1] == m.msg_id.encode()
                           else encode_headers(h))
            parts.append(m.partition)
            attempts.append(m.attempts)
            firsts.append(m.first_failed_at)
            errors.append(m.last_error)
            stamps.append(m.timestamp)
    schema = _schema()
    arrays = [pa.array(c, type=f.type) for c, f in zip(cols, schema, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def messages(
    batches: Iterator[pa.RecordBatch], blockers: Mapping[tuple[str, bytes], int] | None = None
) -> Iterator[BulkMessage]:
    """The messages of message batches, in order, as plain tuples; those an earlier message of
    their key holds back elsewhere (`outbox.stores.keyrule`) are left out."""
    new = tuple.__new__
    id_header = ID_HEADER
    for b in batches:
        cols = [b.column(i).to_pylist() for i in range(len(MESSAGE_NAMES))]
        for id_, msg_id, topic, key, value, hs, part, att, first, err, ts in zip(*cols, strict=True):
            if blockers and waits(topic, key, id_, blockers):
                continue
            yield new(BulkMessage, (
                id_, msg_id, topic, key, value,
                [(id_header, msg_id.encode())] if hs == _ID_ALONE else decode_headers(hs),
                -1 if part is None else part, att, first, err, ts or 0,
            ))
