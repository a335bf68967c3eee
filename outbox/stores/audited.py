"""Deletions written to the store's audit log: dead letters purged in bounded batches, and every
stored message of one key erased.

Shared by `outbox dlq purge`, `outbox erase`, the console's erase and the producer's dead-letter
retention, so that each deletes the same way and leaves the same entries:

* a purge is one short transaction per `PURGE_BATCH` dead letters, never one long one, and each
  batch is an entry of its own (action "purge"): a purge stopped half-way says what it did;
* an erasure is one entry (action "erase", or "erase (failed)" with what was done when it
  failed part-way) naming the key by `key_digest`, never by its bytes.

Each entry is written after its deletion commits, in a transaction of its own: a crash between
the two loses the entry, not the deletion's effect.

The log is read the same way by `outbox audit` and the console's audit routes: `read_audit`
with an `AuditQuery`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass

from outbox.records import AuditEntry, DeadLetterFilter
from outbox.stores.base import Erased, StoreAdmin
from outbox.stores.filters import describe_json

log = logging.getLogger(__name__)

#: Dead letters one purge transaction deletes, at most.
PURGE_BATCH = 1000


def purge_in_batches(
    store: StoreAdmin, flt: DeadLetterFilter, *, who: str, stop: threading.Event | None = None,
    batch: int = PURGE_BATCH,
) -> int:
    """Delete the dead letters `flt` names, `batch` at a time, each batch audited as `who`; how
    many were deleted. A set `stop` ends it between two batches."""
    text = describe_json(flt)
    total = 0
    while stop is None or not stop.is_set():
        n = store.purge_dead(flt, at_most=batch)
        if n:
            store.add_audit(who=who, action="purge", filter=text, count=n, at=time.time())
        total += n
        if n < batch:
            break
    return total


def key_digest(key: bytes) -> str:
    """How the audit log and the command line name a key: the first 16 hex digits of its SHA-256.

    Enough to match an erasure to a request later without storing the key again. It is a
    pseudonym, not a secret: whoever can guess a short key (a customer number) can hash it too.
    """
    return hashlib.sha256(key).hexdigest()[:16]


def erase_key(store: StoreAdmin, key: bytes, *, topic: str | None, who: str, dry_run: bool = False) -> Erased:
    """Delete every pending message and dead letter of `key` (of `topic` only, when given) with
    `StoreAdmin.erase_key`, and record it as `who`; `dry_run` counts and records nothing."""
    if dry_run:
        return store.erase_key(key, topic=topic, dry_run=True, now=time.time())
    named = {"key_sha256": key_digest(key)} | ({} if topic is None else {"topic": topic})
    text = json.dumps(named, sort_keys=True)
    done: list[Erased] = []
    try:
        erased = store.erase_key(key, topic=topic, now=time.time(), on_batch=done.append)
    except BaseException:
        so_far = sum(done, Erased())
        try:
            store.add_audit(who=who, action="erase (failed)", filter=text, count=so_far.total, at=time.time())
        except Exception:  # the store is failing: the erasure's own error is the one to raise
            log.exception("could not record a failed erasure (%d message(s) erased) in the audit log", so_far.total)
        raise
    store.add_audit(who=who, action="erase", filter=text, count=erased.total, at=time.time())
    return erased


@dataclass(frozen=True)
class AuditQuery:
    """Which audit entries to read: `outbox audit`'s options and the console's `GET /api/audit`
    parameters, read the same way by both (`read_audit`).

    Attributes:
        who: entries by this actor: its full name (`cli:alice`), or the part before the colon
            for every actor of a kind (`cli`, `token`, `proxy`).
        actions: entries of these actions ("purge", "erase", "reveal", ...); empty: every action.
        since: entries written at or after this time (epoch seconds).
        until: entries written before this time.
        before_id: entries with an id below this one (paging: the last id of a page).
        limit: the most entries returned, newest first.
    """

    who: str | None = None
    actions: tuple[str, ...] = ()
    since: float | None = None
    until: float | None = None
    before_id: int | None = None
    limit: int = 100

    def matches(self, e: AuditEntry) -> bool:
        """Whether the entry is one this query asks for (`before_id` and `limit` aside)."""
        return (
            (self.who is None or e.who == self.who or e.who.partition(":")[0] == self.who)
            and (not self.actions or e.action in self.actions)
            and (self.since is None or e.at >= self.since)
            and (self.until is None or e.at < self.until)
        )


#: Entries read from the store per page while a query filters them.
AUDIT_PAGE = 500


def read_audit(store: StoreAdmin, query: AuditQuery) -> list[AuditEntry]:
    """The entries `query` asks for, newest first, read through `StoreAdmin.audit_log` a page at
    a time (every store keeps the log in id order and pages it by id; none filters it itself,
    so the filter is this one function for every store)."""
    out: list[AuditEntry] = []
    before = query.before_id
    while len(out) < query.limit:
        page = store.audit_log(limit=AUDIT_PAGE, before_id=before)
        out += [e for e in page if query.matches(e)]
        if len(page) < AUDIT_PAGE:
            break
        before = page[-1].id
    return out[: query.limit]
