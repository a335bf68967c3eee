"""The JSON API, under /api/: what the pages show and do, for programs (schema: /api/openapi.json).

Writes take a JSON body (the middleware refuses any other content type: see
`outbox.ui.security`); errors answer `{"error": "..."}` with their status (`outbox.ui.errors`).
Messages are masked (`outbox.ui.masking`); each write names the role it needs (`outbox.ui.roles`),
and a request below it gets a 403 with `{"error", "needs"}`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from outbox.consumer.redrive import redrive_topic
from outbox.message import topic_problem
from outbox.stores.audited import AuditQuery, key_digest, read_audit
from outbox.stores.filters import parse_time
from outbox.ui import present
from outbox.ui.console import ConsoleDep, IdentityDep
from outbox.ui.errors import ConsoleError
from outbox.ui.filters import FilterError, describe, parse_filter
from outbox.ui.inputs import body_ids, headers_of, int_param, json_body, key_of, rate_of, value_of
from outbox.ui.masking import NO_MASKS
from outbox.ui.operations import check_ids, dead_page, erase, overview, purge, redrive_edited, reveal
from outbox.ui.roles import Role, need

router = APIRouter(prefix="/api", tags=["api"])


@router.get("/stats", summary="Counts: pending and dead by topic, group and error")
def api_stats(console: ConsoleDep) -> dict[str, Any]:
    return overview(console)


@router.get("/dead-letters", summary="Dead letters matching a filter, one keyset page")
def api_dead_letters(request: Request, console: ConsoleDep) -> Response:
    """Query: topic, group, error (code or name), key, text (in the error), since, until
    (ISO-8601 or an age such as 2h), after (the previous page's `next_after`), limit (≤ 500)."""
    # A JSONResponse as is: FastAPI's jsonable_encoder would walk the page again, value by value.
    return JSONResponse(dead_page(console, parse_filter(request.query_params, paging=True)))


@router.get("/dead-letters/{row_id}", summary="One stored message, every byte shown safely")
def api_dead_letter(row_id: int, console: ConsoleDep) -> dict[str, Any]:
    return present.detail(console.store.get(row_id), console.masker)


@router.post("/dead-letters/{row_id}/reveal", summary="One stored message unmasked (admin; audited)",
             dependencies=[Depends(need(Role.ADMIN, "revealing a message unmasked"))])
def api_reveal(row_id: int, console: ConsoleDep, me: IdentityDep) -> dict[str, Any]:
    """What GET /api/dead-letters/{id} shows, without masks; the audit log records who saw it."""
    return present.detail(reveal(console, row_id, me), NO_MASKS)


@router.post("/redrive", summary="Redrive dead letters: dry-run count, or start a job (operator)",
             dependencies=[Depends(need(Role.OPERATOR, "redriving dead letters"))])
async def api_redrive(request: Request, console: ConsoleDep, me: IdentityDep) -> Response:
    """Body: filter fields and/or `ids`, `dry_run` (count only), `rate` (messages/s).
    Answers 202 with the job; follow it at /api/jobs/{id}."""
    body = await json_body(request)
    flt = check_ids(console, parse_filter(body, ids=body_ids(body), allow=("ids", "dry_run", "rate")))
    rate = rate_of(body.get("rate"), console.default_rate)
    if body.get("dry_run"):
        return JSONResponse({"count": console.store.count_dead(flt), "filter": describe(flt)})
    job = console.jobs.redrive(flt, rate=rate, who=me.who)
    return JSONResponse({"job": job.as_dict(), "url": f"/api/jobs/{job.id}"}, status_code=202)


@router.get("/jobs/{job_id}", summary="A redrive job's progress")
def api_job(job_id: int, console: ConsoleDep) -> dict[str, Any]:
    job = console.jobs.get(job_id)
    if job is None:
        raise ConsoleError(404, f"no job {job_id} (jobs are kept in memory while the console runs)")
    return job.as_dict()


@router.post("/purge", summary="Delete dead letters: dry-run count, or purge with confirm (operator)",
             dependencies=[Depends(need(Role.OPERATOR, "purging dead letters"))])
async def api_purge(request: Request, console: ConsoleDep, me: IdentityDep) -> Response:
    """Body: filter fields and/or `ids`; `dry_run` to count; `confirm: true` to delete."""
    body = await json_body(request)
    flt = check_ids(console, parse_filter(body, ids=body_ids(body), allow=("ids", "dry_run", "confirm")))
    if body.get("dry_run"):
        return JSONResponse({"count": console.store.count_dead(flt), "filter": describe(flt)})
    if body.get("confirm") is not True:
        raise ConsoleError(400, 'a purge cannot be undone: send "confirm": true (count first with "dry_run": true)')
    return JSONResponse({"removed": purge(console, flt, me.who), "filter": describe(flt)})


@router.post("/erase", summary="Delete every stored message of one key: dry-run count, or erase with confirm "
             "(operator)", dependencies=[Depends(need(Role.OPERATOR, "erasing a key's messages"))])
async def api_erase(request: Request, console: ConsoleDep, me: IdentityDep) -> Response:
    """Body: `key` (text) or `key_hex`, optional `topic`; `dry_run` to count; `confirm: true` to
    delete every pending message and dead letter of the key (`outbox erase`). The answer and the
    audit log name the key by the first 16 hex digits of its SHA-256, never by its bytes."""
    body = await json_body(request)
    unknown = sorted(set(body) - {"key", "key_hex", "topic", "dry_run", "confirm"})
    if unknown:
        raise FilterError(f"unknown field(s): {', '.join(unknown)}")
    key = key_of(body)
    topic = body.get("topic")
    if topic is not None and (not isinstance(topic, str) or not topic):
        raise FilterError("topic: must be a topic's name")
    dry_run = bool(body.get("dry_run"))
    if not dry_run and body.get("confirm") is not True:
        raise ConsoleError(400, 'an erasure cannot be undone: send "confirm": true (count first with "dry_run": true)')
    # Blocking store work (a group rewritten per transaction): in the thread pool, not on the event loop.
    done = await run_in_threadpool(erase, console, key, topic, who=me.who, dry_run=dry_run)
    return JSONResponse({
        "key_sha256": key_digest(key), "topic": topic, "dry_run": dry_run,
        "pending": done.pending, "dead": done.dead, "leased": done.leased, "total": done.total,
    })


@router.post("/dead-letters/{row_id}/redrive", summary="Edit one dead letter, then redrive it (operator)",
             dependencies=[Depends(need(Role.OPERATOR, "redriving a dead letter"))])
async def api_redrive_edited(row_id: int, request: Request, console: ConsoleDep, me: IdentityDep) -> dict[str, Any]:
    """Body: `value` (text, or hex with `value_encoding: "hex"`, or null) and `headers`
    (a list of [name, text-or-null], or of {name, value, encoding} as GET shows them, with
    encoding "utf-8", "hex" or null); both optional (kept as they are when absent). What GET
    /api/dead-letters/{id} shows, posted back unchanged, stores the same bytes: masked parts
    left as GET shows them keep their stored bytes. Changing a masked part needs the admin
    role (who posts the revealed text); masked text changed with its mask still in it is a 400."""
    body = await json_body(request)
    unknown = sorted(set(body) - {"value", "value_encoding", "headers"})
    if unknown:
        raise FilterError(f"unknown field(s): {', '.join(unknown)}")
    row = console.store.get(row_id)
    value = value_of(body["value"], body.get("value_encoding", "utf-8")) if "value" in body else row.value
    headers = headers_of(body["headers"]) if "headers" in body else row.headers
    redrive_edited(console, row_id, value, headers, me)
    return present.detail(console.store.get(row_id), console.masker)


@router.post("/redrive-topic", summary="Republish a consumer's DLQ topic into its retry tier (operator)",
             dependencies=[Depends(need(Role.OPERATOR, "redriving a DLQ topic"))])
async def api_redrive_topic(request: Request, console: ConsoleDep, me: IdentityDep) -> dict[str, Any]:
    """Body: `dlq_topic` (e.g. orders.billing.dlq), optional `limit`. Each message goes to its
    group's first retry tier (`outbox dlq replay-topic`); progress is kept by the consumer group
    outbox-redrive.<dlq_topic>, so a second call republishes only what came later."""
    if console.kafka is None:
        raise ConsoleError(409, "the console was started without --bootstrap-servers: it cannot reach Kafka")
    body = await json_body(request)
    unknown = sorted(set(body) - {"dlq_topic", "limit"})
    if unknown:
        raise FilterError(f"unknown field(s): {', '.join(unknown)}")
    topic = body.get("dlq_topic")
    problem = topic_problem(topic)
    if problem is not None or not isinstance(topic, str):  # (isinstance: for the type checker)
        raise FilterError(f"dlq_topic: {problem}")
    limit = int_param(str(body["limit"]), "limit", None, 1, 10_000_000) if body.get("limit") is not None else None
    # Blocking Kafka calls: run in the thread pool, not on the event loop.
    result = await run_in_threadpool(redrive_topic, console.kafka, topic, limit=limit)
    console.store.add_audit(who=me.who, action="redrive-topic",
                            filter=json.dumps({"dlq_topic": topic, "limit": limit}),
                            count=result.replayed, at=time.time())
    return {"dlq_topic": topic, "replayed": result.replayed, "by_topic": result.by_topic}


@router.get("/trace/{msg_id}", summary="Every row of one message, by its outbox-id")
def api_trace(msg_id: str, console: ConsoleDep) -> dict[str, Any]:
    rows = console.store.trace(msg_id)
    if not rows:
        raise ConsoleError(404, f"no row with outbox-id {msg_id!r} in the outbox (delivered rows are deleted)")
    return {"msg_id": msg_id, "rows": [present.detail(r, console.masker) for r in rows]}


@router.get("/audit", summary="The audit log, newest first")
def api_audit(request: Request, console: ConsoleDep) -> dict[str, Any]:
    """`who`, `action` (repeatable), `since` and `until` (TIME) filter it as `outbox audit` does."""
    q = request.query_params
    query = AuditQuery(
        who=q.get("who") or None, actions=tuple(a for a in q.getlist("action") if a),
        since=_time_param(q.get("since"), "since"), until=_time_param(q.get("until"), "until"),
        before_id=int_param(q.get("before"), "before", None, 1, 2**63 - 1),
        limit=int_param(q.get("limit"), "limit", 100, 1, 1000),
    )
    return {"entries": [present.audit(e) for e in read_audit(console.store, query)]}


def _time_param(value: str | None, name: str) -> float | None:
    if not value:
        return None
    try:
        return parse_time(value)
    except ValueError:
        raise ConsoleError(400, f"{name}: cannot read the time {value!r}: use ISO-8601 or an age such as 30m, "
                                "2h, 1d") from None
