"""Redrive jobs: put dead letters back to pending in the background, at a bounded rate.

A redrive of a whole filter can name a million rows. The job walks them in keyset pages (id
order), replays each page with the store's own `replay_dead` (what `outbox dlq replay` does:
pending again, attempts reset, due now; a consumer's dead letter is addressed to its group's
first retry tier, so its drain sends it there), and sleeps so as not to exceed `rate` messages a
second: the drain workers and the brokers see a steady trickle, not a flood. Only rows that
existed when the job started are redriven (ids up to the largest one then).

A job's thread never dies silently: a failure ends the job as "failed" with the error's text
(which names the store, never its password), logged, and written to the audit log with the
count done so far.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from outbox.records import DeadLetterFilter
from outbox.stores import Outbox
from outbox.ui.filters import describe, describe_json

log = logging.getLogger(__name__)

#: Rows replayed per store transaction (at most; fewer at low rates).
BATCH = 500
#: Finished jobs kept for GET /api/jobs/{id}.
KEEP = 200


@dataclass
class Job:
    """A redrive in progress or done (what GET /api/jobs/{id} shows)."""

    id: int
    action: str
    who: str
    filter: DeadLetterFilter
    total: int
    rate: float
    done: int = 0
    state: str = "running"  # running, done, failed, cancelled
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "action": self.action,
            "who": self.who,
            "filter": describe(self.filter),
            "total": self.total,
            "done": self.done,
            "rate": self.rate,
            "state": self.state,
            "error": self.error,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


class Jobs:
    """The console's background jobs (one thread each; they share the store)."""

    def __init__(self, store: Outbox) -> None:
        self._store = store
        self._ids = itertools.count(1)
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()

    def get(self, job_id: int) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def redrive(self, flt: DeadLetterFilter, *, rate: float, who: str) -> Job:
        """Start redriving what `flt` names now (at most as many as match now); returns at once."""
        total = self._store.count_dead(flt)
        job = Job(next(self._ids), "redrive", who, flt, total, rate)
        with self._lock:
            self._jobs[job.id] = job
            finished = [i for i, j in self._jobs.items() if j.state != "running"]
            for old in sorted(finished)[: max(0, len(self._jobs) - KEEP)]:
                del self._jobs[old]
        threading.Thread(target=self._run, args=(job,), name=f"outbox-ui-job-{job.id}", daemon=True).start()
        return job

    def _run(self, job: Job) -> None:
        # The walk is by id, forwards: a row redriven here that fails again keeps its id, behind
        # the cursor, so a job never loops; and it stops at the count of its dry run, so dead
        # letters arriving meanwhile cannot keep it going.
        batch = max(1, min(BATCH, int(job.rate)))
        after = 0
        started = time.monotonic()
        # The outcome is published (job.state) only after its audit entry is written: whoever
        # sees the job finished also finds it in the audit log.
        state, error = "failed", None  # kept if a BaseException (not caught below) ends the job
        try:
            while not job.cancel.is_set() and job.done < job.total:
                page = self._store.list_dead(
                    dataclasses.replace(job.filter, after_id=after, limit=min(batch, job.total - job.done))
                )
                if not page:
                    break
                ids = tuple(r.id for r in page)
                job.done += self._store.replay_dead(DeadLetterFilter(ids=ids), now=time.time())
                after = ids[-1]
                # Rate limit: done/elapsed never above `rate` (sleep until the next batch is allowed).
                ahead = job.done / job.rate - (time.monotonic() - started)
                if ahead > 0:
                    job.cancel.wait(ahead)
            state = "cancelled" if job.cancel.is_set() else "done"
        except Exception as exc:  # the job ends, visibly: state, log and audit
            state, error = "failed", str(exc)
            log.exception("redrive job %d failed after %d message(s)", job.id, job.done)
        finally:
            finished_at = time.time()
            try:
                self._store.add_audit(
                    who=job.who, action=f"redrive ({state})", filter=describe_json(job.filter),
                    count=job.done, at=finished_at,
                )
            except Exception:
                log.exception("redrive job %d: could not write the audit log", job.id)
            job.finished_at, job.error, job.state = finished_at, error, state
