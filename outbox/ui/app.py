"""`outbox ui`: the dead-letter console, server-rendered pages and a JSON API over one store.

Every operation goes through the store's own methods (`list_dead`, `count_dead`, `purge_dead`,
`replay_dead`, `redrive_edited`, `trace`, `stats`, the audit log): the console holds no SQL.
The pages are plain HTML forms rendered by Jinja2 with autoescaping, and no script at all, so a
value holding `<script>` is text. See `outbox.ui.security` for the token, host and CSRF rules.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..consumer.headers import consumer_failure
from ..consumer.redrive import redrive_topic
from ..errors import ConfigError, KafkaDeliveryError, KafkaUnavailableError, StoreError, UnknownMessageError
from ..payload import topic_problem
from ..records import DeadLetterFilter, Headers, Status
from ..stores import Outbox
from . import present, security
from .filters import FIELDS, FilterError, describe, describe_json, parse_filter, query_of
from .jobs import Jobs
from .lag import tier_lags

#: Redrive rate (messages/s) when a request names none, and the most one may ask for.
DEFAULT_RATE = 500.0
MAX_RATE = 100_000.0

_ACTION_FIELDS = ("csrf", "do", "action", "scope", "ids", "rate")


class ConsoleError(Exception):
    """A request the console refuses, with its HTTP status and a message for people."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def create_app(
    store: Outbox,
    *,
    token: str | None = None,
    loopback: bool = True,
    location: str | None = None,
    default_rate: float = DEFAULT_RATE,
    kafka: Mapping[str, Any] | None = None,
) -> FastAPI:
    """The console's ASGI application over `store` (serve it with uvicorn).

    Args:
        store: the outbox store (its dead letters, producer's and consumers').
        token: required on every request when given (see `outbox.ui.security`).
        loopback: the server is bound to a loopback address: requests must name a loopback host.
        location: where the store lives, as shown on the pages (never with a password; default
            `store.location`, which has none).
        default_rate: redrive messages/s when a request names none.
        kafka: client settings (`bootstrap.servers`, security) for what needs the cluster: the
            redrive of a consumer's DLQ *topic* (POST /api/redrive-topic). None: not offered.
    """
    app = FastAPI(
        title="kafka-outbox console",
        description="Dead letters of a kafka-outbox store: list, search, redrive, purge, trace.",
        version="1",
        # Swagger UI and ReDoc load their scripts from a CDN: not here (no CDN, no script). The
        # schema itself is served, for any OpenAPI viewer or client generator.
        docs_url=None,
        redoc_url=None,
        openapi_url="/api/openapi.json",
    )
    env = Environment(loader=PackageLoader("outbox.ui", "templates"), autoescape=select_autoescape(default=True))
    env.filters["qs"] = lambda d: urlencode(d, doseq=True)
    env.filters["one_line"] = present.one_line
    jobs = Jobs(store)
    shown_location = location or store.location
    actor = security.who(token)
    app.mount("/static", StaticFiles(packages=[("outbox.ui", "static")]), name="static")

    # -- plumbing: security, errors, rendering ---------------------------------------------------

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        api = request.url.path.startswith("/api/")
        if loopback and not security.is_loopback(request.url.hostname or ""):
            return _refuse(api, 400, "this console answers requests addressed to localhost only")
        if token is not None and request.url.path != "/login":
            given = security.bearer(request.headers.get("authorization")) or request.cookies.get(security.TOKEN_COOKIE)
            if not security.token_matches(token, given):
                return _refuse(api, 401, "a token is required: send 'Authorization: Bearer <token>', "
                                         "or open /login?token=<token> once in the browser")
        if api and request.method not in ("GET", "HEAD", "OPTIONS"):
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return _refuse(True, 415, "API writes must be sent as Content-Type: application/json")
        csrf = request.cookies.get(security.CSRF_COOKIE)
        fresh = not csrf
        request.state.csrf = csrf or security.new_csrf()
        response = await call_next(request)
        for name, value in security.SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        if fresh and not api:
            response.set_cookie(security.CSRF_COOKIE, request.state.csrf, httponly=True, samesite="strict")
        return response

    def _refuse(api: bool, status: int, message: str) -> Response:
        if api:
            response: Response = JSONResponse({"error": message}, status_code=status)
        else:
            response = HTMLResponse(env.get_template("error.html").render(status=status, message=message,
                                                                            location=shown_location),
                                    status_code=status)
        for name, value in security.SECURITY_HEADERS.items():
            response.headers[name] = value
        return response

    def _error(request: Request, status: int, message: str) -> Response:
        return _refuse(request.url.path.startswith("/api/"), status, message)

    @app.exception_handler(ConsoleError)
    async def on_console_error(request: Request, exc: ConsoleError) -> Response:
        return _error(request, exc.status, exc.message)

    @app.exception_handler(FilterError)
    async def on_filter_error(request: Request, exc: FilterError) -> Response:
        return _error(request, 400, str(exc))

    @app.exception_handler(UnknownMessageError)
    async def on_unknown(request: Request, exc: UnknownMessageError) -> Response:
        return _error(request, 404, str(exc))

    @app.exception_handler(StoreError)
    async def on_store_error(request: Request, exc: StoreError) -> Response:
        # Store errors name the store by location (host/database or file), never its password.
        return _error(request, 503, f"the outbox store failed: {exc}")

    @app.exception_handler(ConfigError)
    async def on_config_error(request: Request, exc: ConfigError) -> Response:
        return _error(request, 400, str(exc))  # e.g. a DLQ topic that does not exist

    @app.exception_handler(KafkaUnavailableError)
    async def on_kafka_down(request: Request, exc: KafkaUnavailableError) -> Response:
        return _error(request, 503, f"Kafka: {exc}")

    @app.exception_handler(KafkaDeliveryError)
    async def on_kafka_failed(request: Request, exc: KafkaDeliveryError) -> Response:
        return _error(request, 502, f"Kafka: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(request, exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        # A bug: logged by the server with its traceback, never shown to the client.
        import logging

        logging.getLogger(__name__).exception("console: %s %s failed", request.method, request.url.path)
        return _error(request, 500, f"internal error ({type(exc).__name__}); see the console's log")

    def page(request: Request, name: str, **context: Any) -> HTMLResponse:
        html = env.get_template(name).render(
            csrf=request.state.csrf, location=shown_location, who=actor, **context
        )
        return HTMLResponse(html)

    # -- what the pages and the API share ---------------------------------------------------------

    def dead_page(flt: DeadLetterFilter) -> dict[str, Any]:
        assert flt.limit is not None
        rows = store.list_dead(DeadLetterFilter(**{**_fields(flt), "limit": flt.limit + 1}))
        more = len(rows) > flt.limit
        rows = rows[: flt.limit]
        return {
            "items": [present.summary(r) for r in rows],
            "next_after": rows[-1].id if more and rows else None,
            "filter": describe(flt),
        }

    def overview() -> dict[str, Any]:
        now = time.time()
        s = store.stats(now=now)
        by_group: dict[str, int] = {}
        for topic, n in s.dead_by_topic.items():
            if topic.endswith(".retry-1"):  # a consumer group's dead letters (addressed to its first tier)
                sample = store.list_dead(DeadLetterFilter(topic=topic, limit=1))
                failure = consumer_failure(sample[0].headers) if sample else None
                if failure is not None:
                    by_group[failure.group] = by_group.get(failure.group, 0) + n
        return {
            "outbox": shown_location,
            "pending": s.pending,
            "dead": s.dead,
            "leased": s.leased,
            "oldest_pending_age": None if s.oldest_pending_at is None else max(0.0, now - s.oldest_pending_at),
            "pending_by_topic": dict(sorted(s.pending_by_topic.items())),
            "dead_by_topic": dict(sorted(s.dead_by_topic.items())),
            "dead_by_group": dict(sorted(by_group.items())),
            "dead_by_error": dict(sorted(s.dead_by_error.items(), key=lambda kv: -kv[1])),
            # The circuit lives in each producer process (ResilientProducer.stats()["circuit"]);
            # the store cannot tell it.
            "circuit": None,
            **tiers(),
        }

    def tiers() -> dict[str, Any]:
        """The retry tiers' lag (with -b); a cluster that does not answer is said, not fatal."""
        if kafka is None:
            return {"tier_lag": None, "tier_lag_error": None}
        try:
            lags = tier_lags(kafka, timeout=5.0)
        except KafkaUnavailableError as exc:
            return {"tier_lag": None, "tier_lag_error": str(exc)}
        return {"tier_lag": [dataclasses.asdict(t) for t in lags], "tier_lag_error": None}

    def purge(flt: DeadLetterFilter) -> int:
        removed = store.purge_dead(flt)
        store.add_audit(who=actor, action="purge", filter=describe_json(flt), count=removed, at=time.time())
        return removed

    def redrive_edited(row_id: int, value: bytes | None, headers: Headers) -> int:
        row = store.get(row_id)
        if row.status is not Status.DEAD:
            raise ConsoleError(409, f"message {row_id} is {row.status.name.lower()}, not a dead letter")
        if not store.redrive_edited(row_id, value=value, headers=headers, now=time.time()):
            raise ConsoleError(409, f"message {row_id} is no longer a dead letter")
        store.add_audit(who=actor, action="edit-redrive", filter=describe_json(DeadLetterFilter(ids=(row_id,))),
                        count=1, at=time.time())
        return row_id

    def check_ids(flt: DeadLetterFilter) -> DeadLetterFilter:
        """Every id named must be a dead letter: a typo or a row someone else redrove is said, not
        silently skipped (as `outbox dlq --id`)."""
        for i in flt.ids:
            row = store.get(i)  # UnknownMessageError: 404
            if row.status is not Status.DEAD:
                raise ConsoleError(409, f"message {i} is {row.status.name.lower()}, not a dead letter")
        return flt

    def rate_of(value: object) -> float:
        if value is None or value == "":
            return default_rate
        try:
            rate = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise FilterError(f"rate: {value!r} is not a number of messages per second") from None
        if not 0 < rate <= MAX_RATE:
            raise FilterError(f"rate: must be above 0 and at most {MAX_RATE:.0f} messages per second")
        return rate

    # -- JSON API ---------------------------------------------------------------------------------

    @app.get("/api/stats", tags=["api"], summary="Counts: pending and dead by topic, group and error")
    def api_stats() -> dict[str, Any]:
        return overview()

    @app.get("/api/dead-letters", tags=["api"], summary="Dead letters matching a filter, one keyset page")
    def api_dead_letters(request: Request) -> Response:
        """Query: topic, group, error (code or name), key, text (in the error), since, until
        (ISO-8601 or an age such as 2h), after (the previous page's `next_after`), limit (≤ 500)."""
        # A JSONResponse as is: FastAPI's jsonable_encoder would walk the page again, value by value.
        return JSONResponse(dead_page(parse_filter(request.query_params, paging=True)))

    @app.get("/api/dead-letters/{row_id}", tags=["api"], summary="One stored message, every byte shown safely")
    def api_dead_letter(row_id: int) -> dict[str, Any]:
        return present.detail(store.get(row_id))

    @app.post("/api/redrive", tags=["api"], summary="Redrive dead letters: dry-run count, or start a job")
    async def api_redrive(request: Request) -> Response:
        """Body: filter fields and/or `ids`, `dry_run` (count only), `rate` (messages/s).
        Answers 202 with the job; follow it at /api/jobs/{id}."""
        body = await _json(request)
        flt = check_ids(parse_filter(body, ids=_ids(body), allow=("ids", "dry_run", "rate")))
        rate = rate_of(body.get("rate"))
        if body.get("dry_run"):
            return JSONResponse({"count": store.count_dead(flt), "filter": describe(flt)})
        job = jobs.redrive(flt, rate=rate, who=actor)
        return JSONResponse({"job": job.as_dict(), "url": f"/api/jobs/{job.id}"}, status_code=202)

    @app.get("/api/jobs/{job_id}", tags=["api"], summary="A redrive job's progress")
    def api_job(job_id: int) -> dict[str, Any]:
        job = jobs.get(job_id)
        if job is None:
            raise ConsoleError(404, f"no job {job_id} (jobs are kept in memory while the console runs)")
        return job.as_dict()

    @app.post("/api/purge", tags=["api"], summary="Delete dead letters: dry-run count, or purge with confirm")
    async def api_purge(request: Request) -> Response:
        """Body: filter fields and/or `ids`; `dry_run` to count; `confirm: true` to delete."""
        body = await _json(request)
        flt = check_ids(parse_filter(body, ids=_ids(body), allow=("ids", "dry_run", "confirm")))
        if body.get("dry_run"):
            return JSONResponse({"count": store.count_dead(flt), "filter": describe(flt)})
        if body.get("confirm") is not True:
            raise ConsoleError(400, 'a purge cannot be undone: send "confirm": true (count first with "dry_run": true)')
        return JSONResponse({"removed": purge(flt), "filter": describe(flt)})

    @app.post("/api/dead-letters/{row_id}/redrive", tags=["api"], summary="Edit one dead letter, then redrive it")
    async def api_redrive_edited(row_id: int, request: Request) -> dict[str, Any]:
        """Body: `value` (text, or hex with `value_encoding: "hex"`, or null) and `headers`
        (a list of [name, text-or-null], or of {name, value, encoding} as GET shows them, with
        encoding "utf-8", "hex" or null); both optional (kept as they are when absent). What GET
        /api/dead-letters/{id} shows, posted back unchanged, stores the same bytes."""
        body = await _json(request)
        unknown = sorted(set(body) - {"value", "value_encoding", "headers"})
        if unknown:
            raise FilterError(f"unknown field(s): {', '.join(unknown)}")
        row = store.get(row_id)
        value = _value(body["value"], body.get("value_encoding", "utf-8")) if "value" in body else row.value
        headers = _headers_json(body["headers"]) if "headers" in body else row.headers
        redrive_edited(row_id, value, headers)
        return present.detail(store.get(row_id))

    @app.post("/api/redrive-topic", tags=["api"], summary="Republish a consumer's DLQ topic into its retry tier")
    async def api_redrive_topic(request: Request) -> dict[str, Any]:
        """Body: `dlq_topic` (e.g. orders.billing.dlq), optional `limit`. Each message goes to its
        group's first retry tier (`outbox dlq replay-topic`); progress is kept by the consumer group
        outbox-redrive.<dlq_topic>, so a second call republishes only what came later."""
        if kafka is None:
            raise ConsoleError(409, "the console was started without --bootstrap-servers: it cannot reach Kafka")
        body = await _json(request)
        unknown = sorted(set(body) - {"dlq_topic", "limit"})
        if unknown:
            raise FilterError(f"unknown field(s): {', '.join(unknown)}")
        topic = body.get("dlq_topic")
        problem = topic_problem(topic)
        if problem is not None or not isinstance(topic, str):  # (isinstance: for the type checker)
            raise FilterError(f"dlq_topic: {problem}")
        limit = _int_param(str(body["limit"]), "limit", None, 1, 10_000_000) if body.get("limit") is not None else None
        # Blocking Kafka calls: run in the thread pool, not on the event loop.
        result = await run_in_threadpool(redrive_topic, kafka, topic, limit=limit)
        store.add_audit(who=actor, action="redrive-topic", filter=json.dumps({"dlq_topic": topic, "limit": limit}),
                        count=result.replayed, at=time.time())
        return {"dlq_topic": topic, "replayed": result.replayed, "by_topic": result.by_topic}

    @app.get("/api/trace/{msg_id}", tags=["api"], summary="Every row of one message, by its outbox-id")
    def api_trace(msg_id: str) -> dict[str, Any]:
        rows = store.trace(msg_id)
        if not rows:
            raise ConsoleError(404, f"no row with outbox-id {msg_id!r} in the outbox (delivered rows are deleted)")
        return {"msg_id": msg_id, "rows": [present.detail(r) for r in rows]}

    @app.get("/api/audit", tags=["api"], summary="The audit log, newest first")
    def api_audit(request: Request) -> dict[str, Any]:
        q = request.query_params
        limit = _int_param(q.get("limit"), "limit", 100, 1, 1000)
        before = _int_param(q.get("before"), "before", None, 1, 2**63 - 1)
        return {"entries": [present.audit(e) for e in store.audit_log(limit=limit, before_id=before)]}

    # -- pages --------------------------------------------------------------------------------------

    @app.get("/login", include_in_schema=False)
    def login(request: Request) -> Response:
        given = request.query_params.get("token")
        if token is None:
            return RedirectResponse("/", status_code=303)
        if not security.token_matches(token, given):
            return _refuse(False, 401, "wrong or missing token: open /login?token=<token>")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(security.TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def overview_page(request: Request) -> HTMLResponse:
        audit = [present.audit(e) for e in store.audit_log(limit=10)]
        return page(request, "overview.html", o=overview(), audit=audit)

    @app.get("/dead-letters", response_class=HTMLResponse, include_in_schema=False)
    def list_page(request: Request) -> HTMLResponse:
        values = {k: v for k, v in request.query_params.items() if k != "notice"}
        flt = parse_filter(values, paging=True)
        return page(request, "list.html", result=dead_page(flt), query=query_of(flt), fields=FIELDS,
                    limit=flt.limit, after=flt.after_id, notice=request.query_params.get("notice"))

    @app.get("/dead-letters/{row_id}", response_class=HTMLResponse, include_in_schema=False)
    def detail_page(request: Request, row_id: int) -> HTMLResponse:
        row = store.get(row_id)
        doc = present.detail(row)
        edit_text, edit_encoding = present.edit_value(row.value)
        return page(request, "detail.html", m=doc, headers_text=present.headers_as_text(row.headers),
                    edit_text=edit_text, edit_encoding=edit_encoding,
                    notice=request.query_params.get("notice"))

    @app.post("/dead-letters/{row_id}/redrive", include_in_schema=False)
    async def edit_redrive_form(request: Request, row_id: int) -> Response:
        form = await _form(request)
        try:
            headers = present.parse_headers(str(form.get("headers", "")))
            value = present.form_value(str(form.get("value", "")), str(form.get("value_encoding", "utf-8")))
        except ValueError as exc:
            raise FilterError(str(exc)) from None
        redrive_edited(row_id, value, headers)
        notice = "Edited and redriven: pending again, attempts reset; the drain sends it."
        return RedirectResponse(f"/dead-letters/{row_id}?{urlencode({'notice': notice})}", status_code=303)

    @app.post("/actions", response_class=HTMLResponse, include_in_schema=False)
    async def action_form(request: Request) -> HTMLResponse:
        """Step 1 of a bulk action: what it would touch (a dry-run count), and a confirmation."""
        form = await _form(request)
        action, scope, flt = _action(form)
        count = store.count_dead(flt)
        return page(request, "confirm.html", action=action, scope=scope, count=count,
                    described=describe(flt), query=query_of(flt), ids=flt.ids, rate=default_rate)

    @app.post("/actions/confirm", include_in_schema=False)
    async def action_confirm(request: Request) -> Response:
        form = await _form(request)
        action, _scope, flt = _action(form)
        if action == "redrive":
            job = jobs.redrive(flt, rate=rate_of(form.get("rate")), who=actor)
            return RedirectResponse(f"/jobs/{job.id}", status_code=303)
        removed = purge(flt)
        back = {**query_of(flt), "notice": f"Purged {removed} dead letter(s)."}
        return RedirectResponse(f"/dead-letters?{urlencode(back)}", status_code=303)

    @app.get("/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
    def job_page(request: Request, job_id: int) -> HTMLResponse:
        job = jobs.get(job_id)
        if job is None:
            raise ConsoleError(404, f"no job {job_id} (jobs are kept in memory while the console runs)")
        return page(request, "job.html", job=job.as_dict(), query=query_of(job.filter))

    @app.get("/trace", response_class=HTMLResponse, include_in_schema=False)
    def trace_page(request: Request) -> HTMLResponse:
        msg_id = (request.query_params.get("msg_id") or "").strip()
        rows = [present.detail(r) for r in store.trace(msg_id)] if msg_id else []
        return page(request, "trace.html", msg_id=msg_id, rows=rows)

    @app.get("/audit", response_class=HTMLResponse, include_in_schema=False)
    def audit_page(request: Request) -> HTMLResponse:
        before = _int_param(request.query_params.get("before"), "before", None, 1, 2**63 - 1)
        entries = [present.audit(e) for e in store.audit_log(limit=100, before_id=before)]
        return page(request, "audit.html", entries=entries)

    def _action(form: FormData) -> tuple[str, str, DeadLetterFilter]:
        # The list page's buttons say both at once ("redrive:selected"); the confirmation, apart.
        action, _, scope = str(form.get("do") or "").partition(":")
        if not action:
            action, scope = str(form.get("action") or ""), str(form.get("scope") or "")
        if action not in ("redrive", "purge"):
            raise FilterError("action: must be redrive or purge")
        if scope not in ("selected", "filter"):
            raise FilterError("scope: must be selected or filter")
        ids = list(form.getlist("ids"))
        if scope == "selected" and not ids:
            raise FilterError("nothing selected: tick the dead letters to act on, or act on the whole filter")
        values = {k: v for k, v in form.multi_items() if k not in _ACTION_FIELDS}
        flt = parse_filter(values, ids=ids if scope == "selected" else ())
        return action, scope, check_ids(flt)

    return app


# -- request bodies -------------------------------------------------------------------------------


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise FilterError("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise FilterError("the body must be a JSON object")
    return body


async def _form(request: Request) -> FormData:
    """The posted form, after its CSRF token was checked against the cookie."""
    form = await request.form()
    if not security.csrf_ok(request.cookies.get(security.CSRF_COOKIE), form.get(security.CSRF_FIELD)):
        raise ConsoleError(403, "the form's CSRF token does not match this browser's: reload the page and try again")
    return form


def _ids(body: Mapping[str, Any]) -> list[object]:
    ids = body.get("ids", [])
    if not isinstance(ids, list):
        raise FilterError("ids: must be a list of row ids")
    return ids


def _int_param(value: str | None, name: str, default: int | None, low: int, high: int) -> Any:
    if value is None or value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        raise FilterError(f"{name}: {value!r} is not a whole number") from None
    if not low <= n <= high:
        raise FilterError(f"{name}: {n} is not between {low} and {high}")
    return n


def _value(value: object, encoding: object) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise FilterError("value: must be text or null")
    if encoding == "utf-8":
        return value.encode("utf-8")
    if encoding == "hex":
        try:
            return present.from_hex(value, "value")
        except ValueError as exc:
            raise FilterError(str(exc)) from None
    raise FilterError("value_encoding: must be utf-8 or hex")


def _headers_json(value: object) -> Headers:
    if not isinstance(value, list):
        raise FilterError("headers: must be a list of [name, value] pairs")
    out: Headers = []
    for n, h in enumerate(value):
        if isinstance(h, dict) and set(h) <= {"name", "value", "encoding"}:
            name, text, encoding = h.get("name"), h.get("value"), h.get("encoding", "utf-8")
        elif isinstance(h, list) and len(h) == 2:
            (name, text), encoding = h, "utf-8"
        else:
            name = None
        if not (isinstance(name, str) and name and (text is None or isinstance(text, str))):
            raise FilterError(f"headers[{n}]: must be [name, text or null] or {{name, value, encoding}}"
                              " with a non-empty name")
        if text is None:
            out.append((name, None))
        elif encoding in ("utf-8", None):
            out.append((name, text.encode("utf-8")))
        elif encoding == "hex":
            try:
                out.append((name, present.from_hex(text, f"headers[{n}]")))
            except ValueError as exc:
                raise FilterError(str(exc)) from None
        else:
            raise FilterError(f"headers[{n}]: encoding must be utf-8, hex or null")
    return out


def _fields(flt: DeadLetterFilter) -> dict[str, Any]:
    return {f: getattr(flt, f) for f in DeadLetterFilter.__dataclass_fields__}
