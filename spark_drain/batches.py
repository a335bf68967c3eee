"""Executor side: the job's rows as Arrow record batches (`DataFrame.mapInArrow`), never as Row objects.

Why: a Spark `Row` (and a pickled RDD element) costs Python objects and calls per value on the
way in and out of every Python stage. With Arrow, Spark hands each Python worker whole column
batches, and the shuffle that puts each key's messages in one send task runs in the JVM on
Arrow-converted rows. Python touches a message twice: once to explode a group row (when the
store groups rows) and once to send it.

Columns of a message batch (`MESSAGES`), as `outbox.stores.bulk.BulkRead.rows` reads a
one-message row: headers stay encoded (`outbox.stores.codec`) until the sender decodes them. Messages of
a grouped store also say which row they were read from (`GROUPED_MESSAGES`: `grp`, the row's id,
and `grp_n`, its messages), so that a group is settled whole (`spark_drain.send`).

Messages changed before they are sent (`spark_drain.transform.PREPARED`) also carry `origin`,
their topic in the outbox (`topic` is where they go), and `keep`: false for a message not to send.

An encrypted outbox (`outbox.stores.sealed`): a message batch ends with `enc_key`, the key a
one-message row's value and headers are sealed with (NULL: in clear). A group's body is opened
where the group is exploded (its messages leave that stage in clear, `enc_key` NULL); a
one-message row's payload crosses the shuffle sealed and is opened by its send task
(`MessageChunk.of`). Both call `outbox.stores.sealed`, the store's own functions, with the key
ring the job pickled into the stage's function (`spark_drain.send.SendConfig.keys`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from outbox.headers import ID_HEADER, resent_once
from outbox.stores import grouped, sealed
from outbox.stores.bulk import BulkMessage
from outbox.stores.claimed import LazyClaim, Resend
from outbox.stores.codec import decode_headers
from outbox.stores.keyrule import first_blockers, waits

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from outbox.stores.encryption import KeyRing

#: A message row, in `BulkMessage` order (Spark DDL). `headers` is `outbox.stores.codec`-encoded, and
#: empty (never null) for the common message's `outbox-id` header alone, its value the msg_id:
#: neither encoded nor decoded per message.
MESSAGES = (
    "id LONG, msg_id STRING, topic STRING, key BINARY, value BINARY, headers BINARY, part INT, "
    "attempts INT, first_failed_at DOUBLE, last_error STRING, timestamp LONG"
)
_ID_ALONE = grouped.ID_ALONE_HEADERS  # `headers` of a message whose only header is `outbox-id`, its value the msg_id
#: Names of `MESSAGES`' columns.
MESSAGE_NAMES = tuple(c.split()[0] for c in MESSAGES.split(", "))
#: What a message batch carries after its `MESSAGES`: the key its payload is sealed with.
SEALED = ", enc_key STRING"
#: A message of a grouped store: `MESSAGES`, the row it was read from and that row's messages,
#: and its key (`SEALED`).
GROUPED_MESSAGES = MESSAGES + ", grp LONG, grp_n LONG" + SEALED
#: What the job returns, per topic (`spark_drain.send.COUNTERS`): `skipped`, the messages not to
#: send (`keep` false), per topic in the outbox.
COUNTS = "topic STRING, read LONG, delivered LONG, failed LONG, dead LONG, left LONG, skipped LONG"
#: Names of `COUNTS`' columns.
COUNT_NAMES = tuple(c.split()[0] for c in COUNTS.split(", "))
#: What a send task returns: per-topic counts (`grp` null), and for each group it did not see
#: whole, the ids of its messages delivered (`done`) for the settle stage (`COUNTS` columns null).
SENT = COUNTS + ", grp LONG, grp_n LONG, done ARRAY<LONG>"


def explode_batches(ring: KeyRing | None, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body over `BulkRead.rows` of a grouped store (`GROUPED_MESSAGES`): one-message
    rows pass as they are (column selection only, still sealed); each group row becomes its
    messages (its body opened with `ring` when it is sealed).

    Raises:
        DecryptionError: a group is sealed with a key `ring` does not hold.
    """
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
            cols.append(singles.column("enc_key").cast(pa.string()))
            yield pa.RecordBatch.from_arrays(cols, schema=schema)
        groups = batch.filter(pc.is_valid(body))
        if groups.num_rows:
            yield _group_messages(groups, ring)


def _schema() -> pa.Schema:
    """`GROUPED_MESSAGES` as an Arrow schema."""
    import pyarrow as pa

    types = (pa.int64(), pa.string(), pa.string(), pa.binary(), pa.binary(), pa.binary(), pa.int32(), pa.int32(),
             pa.float64(), pa.string(), pa.int64(), pa.int64(), pa.int64(), pa.string())
    return pa.schema(list(zip((*MESSAGE_NAMES, "grp", "grp_n", "enc_key"), types, strict=True)))


def _group_messages(groups: pa.RecordBatch, ring: KeyRing | None) -> pa.RecordBatch:
    """The messages of group rows as one message batch, in clear (`grouped.columns_of`: the
    common message's headers are not encoded again)."""
    import pyarrow as pa

    cols: list[list[Any]] = [[] for _ in range(len(MESSAGE_NAMES) + 3)]
    ids, msg_ids, topics, keys, values, headers, parts, attempts, firsts, errors, stamps, gids, sizes, kids = cols
    for gid, topic, body, kid, size in zip(
        groups.column("id").to_pylist(), groups.column("topic").to_pylist(), groups.column("body").to_pylist(),
        groups.column("enc_key").to_pylist(), groups.column("n").to_pylist(), strict=True,
    ):
        body = sealed.open_body(body, kid, topic, ring, gid, int(size))
        i, m, k, v, h, p, a, f, e, t = grouped.columns_of(body, gid)
        n = len(i)
        ids += i
        msg_ids += m
        topics += [topic] * n
        keys += k
        values += v
        headers += h
        parts += p
        attempts += a
        firsts += f
        errors += e
        stamps += t
        gids += [gid] * n
        sizes += [n] * n
        kids += [None] * n
    schema = _schema()
    arrays = [pa.array(c, type=f.type) for c, f in zip(cols, schema, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


class MessageChunk(LazyClaim[BulkMessage]):
    """Messages of one send task, as a batch's columns in Python lists (`MESSAGES` order), with
    each message's group row and its size as arrays (`grp`, `grp_n`; a one-message row is its own),
    and its topic in the outbox (`origin`: the `topic` column unless the message goes elsewhere),
    which its key's order is kept by.

    Why: a send task re-sends every message once and settles a healthy chunk by id alone, so it
    needs no `BulkMessage` for most: `resends()` gives the common message's re-send straight from
    the columns (`outbox-id` header alone, never failed), and a message is made only when one is
    read (a chunk with failures, `outbox.drain.sendloop.SendLoop.decide`).
    """

    __slots__ = ("cols", "id_array", "groups", "sizes", "origin")

    def __init__(
        self, cols: Sequence[list[Any]], id_array: np.ndarray, groups: np.ndarray, sizes: np.ndarray,
        origin: list[str] | None = None,
    ) -> None:
        self.cols = cols
        self.id_array = id_array
        self.groups = groups
        self.sizes = sizes
        self.origin: list[str] = cols[2] if origin is None else origin

    @classmethod
    def of(cls, batch: pa.RecordBatch, ring: KeyRing | None = None) -> MessageChunk:
        """The messages of one batch of `MESSAGES` or `GROUPED_MESSAGES`, sealed payloads opened
        with `ring` (a batch's `enc_key` column, `SEALED`).

        Raises:
            DecryptionError: a message is sealed with a key `ring` does not hold.
        """
        import numpy as np

        ids = batch.column("id").to_numpy()
        grouped_ = "grp" in batch.schema.names
        cols = [batch.column(i).to_pylist() for i in range(len(MESSAGE_NAMES))]
        if "enc_key" in batch.schema.names and batch.column("enc_key").null_count < batch.num_rows:
            id_list, msg_ids, values, headers = cols[0], cols[1], cols[4], cols[5]
            for i, kid in enumerate(batch.column("enc_key").to_pylist()):
                if kid is not None:
                    values[i], headers[i] = sealed.open_payload(
                        kid, id_list[i], msg_ids[i], values[i], headers[i], ring
                    )
        return cls(
            cols, ids,
            batch.column("grp").to_numpy() if grouped_ else ids,
            batch.column("grp_n").to_numpy() if grouped_ else np.ones(len(ids), np.int64),
            batch.column("origin").to_pylist() if "origin" in batch.schema.names else None,
        )

    def __len__(self) -> int:
        return len(self.id_array)

    def _read(self, i: int) -> BulkMessage:
        id_, msg_id, topic, key, value, hs, part, att, first, err, ts = (c[i] for c in self.cols)
        return BulkMessage(
            id_, msg_id, topic, key, value,
            [(ID_HEADER, msg_id.encode())] if hs == _ID_ALONE else decode_headers(hs),
            -1 if part is None else part, att, first, err, ts or 0,
        )

    def ids(self) -> list[int]:
        return list(self.cols[0])

    def resends(self, resend: Callable[[BulkMessage], Resend]) -> Iterator[Resend]:
        id_header = ID_HEADER
        rows = zip(*self.cols[1:], strict=True)
        for i, (msg_id, topic, key, value, hs, part, att, first, err, ts) in enumerate(rows):
            if hs == _ID_ALONE and not att and first is None:  # `resend_headers`' common message
                yield topic, value, key, -1 if part is None else part, ts or 0, resent_once(
                    (id_header, msg_id.encode()), err
                )
            else:
                yield resend(self._read(i))

    def part(self, start: int, stop: int) -> MessageChunk:
        """Messages [start, stop)."""
        return MessageChunk(
            [c[start:stop] for c in self.cols], self.id_array[start:stop], self.groups[start:stop],
            self.sizes[start:stop], None if self.origin is self.cols[2] else self.origin[start:stop],
        )

    def only(self, keep: Sequence[bool]) -> MessageChunk:
        """The messages whose `keep` is true, in order."""
        import numpy as np

        mask = np.asarray(keep, dtype=bool)
        return MessageChunk(
            [list(itertools.compress(c, keep)) for c in self.cols], self.id_array[mask], self.groups[mask],
            self.sizes[mask], None if self.origin is self.cols[2] else list(itertools.compress(self.origin, keep)),
        )


def chunks(
    batches: Iterator[pa.RecordBatch], size: int, blockers: Mapping[tuple[str, bytes], int] | None = None,
    ring: KeyRing | None = None, held_back: Callable[[MessageChunk], None] | None = None,
    skipped: Callable[[list[str]], None] | None = None,
) -> Iterator[MessageChunk]:
    """The messages of message batches, in order, in chunks of at most `size`, opened with `ring`;
    those an earlier message of their key holds back elsewhere (`outbox.stores.keyrule`) are left
    out, and given to `held_back`.

    A message not to send (`keep` false) is left out too, its topic in the outbox given to
    `skipped`, and holds back the later messages of its key (of that topic) as a blocker would:
    it stays in the outbox before them.
    """
    held = dict(blockers or {})
    for b in batches:
        chunk = MessageChunk.of(b, ring)
        if "keep" in b.schema.names and b.column("keep").false_count:
            keep = b.column("keep").to_pylist()
            left_out = (
                (t, k, i) for i, t, k, kept in zip(chunk.cols[0], chunk.origin, chunk.cols[3], keep, strict=True)
                if not kept
            )
            for key, first in first_blockers(left_out).items():
                held[key] = min(first, held.get(key, first))
            if skipped is not None:
                skipped(list(itertools.compress(chunk.origin, (not k for k in keep))))
            chunk = chunk.only(keep)
        if held:
            ids, topics, keys = chunk.cols[0], chunk.origin, chunk.cols[3]
            waiting = [waits(t, k, i, held) for i, t, k in zip(ids, topics, keys, strict=True)]
            if held_back is not None and any(waiting):
                held_back(chunk.only(waiting))
            chunk = chunk.only([not w for w in waiting])
        for start in range(0, len(chunk), size):
            yield chunk.part(start, start + size)
