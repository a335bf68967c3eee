"""The per-key order rule, in Python: one function for every reader that applies it outside SQL
(the memory store, the Spark job's executors, the SQL core's claims, `outbox.stores.sqlcore`).

The rule: a PENDING message is not sent while an earlier PENDING message of the same topic and
key is held elsewhere (leased to another sender, backing off, or left out of this selection), so
one key's messages leave in id order. Messages without a key never wait. The SQL dialects state
the same rule in their claims (`SQLiteOutbox._keep_key_order`, `PostgresOutbox._keep_key_order`)
and in `outbox.stores.backlog.backlog_sql`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Key = tuple[str, bytes]


def first_blockers(held: Iterable[tuple[str, bytes | None, int]]) -> dict[Key, int]:
    """The first id of each key among the (topic, key, id) of messages held elsewhere."""
    first: dict[Key, int] = {}
    for topic, key, id_ in held:
        if key is not None and first.get((topic, key), id_ + 1) > id_:
            first[(topic, key)] = id_
    return first


def waits(topic: str, key: bytes | None, id_: int, blockers: Mapping[Key, int]) -> bool:
    """Whether this message must wait: an earlier message of its key is held elsewhere."""
    return key is not None and blockers.get((topic, key), id_) < id_
