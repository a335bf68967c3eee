"""The pages: plain HTML rendered by Jinja2, and forms that post back here, with no script.

Each page shows what its API twin answers (`outbox.ui.operations` computes both), masked. A
form carries the browser's CSRF token (`outbox.ui.inputs.posted_form` checks it); a write answers
with a redirect (303) to the page that shows its outcome. A page shows only the buttons and forms
of what the request's role may do, and each write checks the role again (`outbox.ui.roles`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.datastructures import FormData

from outbox.records import DeadLetterFilter, OutboxMessage
from outbox.ui import present, security
from outbox.ui.console import Console, ConsoleDep, IdentityDep
from outbox.ui.errors import ConsoleError, refuse
from outbox.ui.filters import FIELDS, FilterError, describe, parse_filter, query_of
from outbox.ui.inputs import int_param, posted_form, rate_of
from outbox.ui.masking import NO_MASKS, Masker
from outbox.ui.operations import check_ids, dead_page, overview, purge, redrive_edited, reveal
from outbox.ui.roles import Role, identity_of, need

# The pages are for people: not part of the API's schema.
router = APIRouter(include_in_schema=False)

#: A bulk action's form fields that are not filter fields.
_ACTION_FIELDS = ("csrf", "do", "action", "scope", "ids", "rate")


def render(request: Request, console: Console, name: str, **context: Any) -> HTMLResponse:
    """The page `name`, with what every page shows: where the store is, who asks and what their
    role may do (`can_act`: redrive, purge; `can_reveal`), the form token."""
    me = identity_of(request)
    html = console.templates.get_template(name).render(
        csrf=request.state.csrf, location=console.location, me=me, can_act=me.may(Role.OPERATOR),
        can_reveal=me.may(Role.ADMIN), **context
    )
    return HTMLResponse(html)


@router.get("/login")
def login(request: Request, console: ConsoleDep) -> Response:
    # Trades ?token= for a cookie, and redirects: the token leaves the address bar at once.
    given = request.query_params.get("token")
    if not console.access.tokens:
        return RedirectResponse("/", status_code=303)
    if given is None or not any(security.token_matches(t, given) for t in console.access.tokens):
        return refuse(console, False, 401, "wrong or missing token: open /login?token=<token>")
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(security.TOKEN_COOKIE, given, httponly=True, samesite="strict")
    return response


@router.get("/", response_class=HTMLResponse)
def overview_page(request: Request, console: ConsoleDep) -> HTMLResponse:
    audit = [present.audit(e) for e in console.store.audit_log(limit=10)]
    return render(request, console, "overview.html", o=overview(console), audit=audit)


@router.get("/dead-letters", response_class=HTMLResponse)
def list_page(request: Request, console: ConsoleDep) -> HTMLResponse:
    values = {k: v for k, v in request.query_params.items() if k != "notice"}
    flt = parse_filter(values, paging=True)
    return render(request, console, "list.html", result=dead_page(console, flt), query=query_of(flt),
                  fields=FIELDS, limit=flt.limit, after=flt.after_id, notice=request.query_params.get("notice"))


@router.get("/dead-letters/{row_id}", response_class=HTMLResponse)
def detail_page(request: Request, row_id: int, console: ConsoleDep) -> HTMLResponse:
    return _detail(request, console, console.store.get(row_id), console.masker,
                   notice=request.query_params.get("notice"))


@router.post("/dead-letters/{row_id}/reveal", response_class=HTMLResponse,
             dependencies=[Depends(need(Role.ADMIN, "revealing a message unmasked"))])
async def reveal_form(request: Request, row_id: int, console: ConsoleDep, me: IdentityDep) -> HTMLResponse:
    # A form posted with its CSRF token, answered with the page itself: a reveal is an audited
    # action, which a link from another site must not be able to make (as a GET could).
    await posted_form(request)
    return _detail(request, console, reveal(console, row_id, me), NO_MASKS, revealed=True)


def _detail(request: Request, console: Console, row: OutboxMessage, masker: Masker, *, notice: str | None = None,
            revealed: bool = False) -> HTMLResponse:
    """The page of one message as `masker` shows it; its edit form holds what is shown (with
    masks, which an edit keeps as stored: `outbox.ui.masking.Masker.restore`)."""
    shown = masker.row(row).row
    edit_text, edit_encoding = present.edit_value(shown.value)
    return render(request, console, "detail.html", m=present.detail(row, masker), revealed=revealed,
                  headers_text=present.headers_as_text(shown.headers), edit_text=edit_text,
                  edit_encoding=edit_encoding, notice=notice)


@router.post("/dead-letters/{row_id}/redrive", dependencies=[Depends(need(Role.OPERATOR, "redriving a dead letter"))])
async def edit_redrive_form(request: Request, row_id: int, console: ConsoleDep, me: IdentityDep) -> Response:
    form = await posted_form(request)
    try:
        headers = present.parse_headers(str(form.get("headers", "")))
        value = present.form_value(str(form.get("value", "")), str(form.get("value_encoding", "utf-8")))
    except ValueError as exc:
        raise FilterError(str(exc)) from None
    redrive_edited(console, row_id, value, headers, me)
    notice = "Edited and redriven: pending again, attempts reset; the drain sends it."
    return RedirectResponse(f"/dead-letters/{row_id}?{urlencode({'notice': notice})}", status_code=303)


_ACT = Depends(need(Role.OPERATOR, "redriving or purging dead letters"))


@router.post("/actions", response_class=HTMLResponse, dependencies=[_ACT])
async def action_form(request: Request, console: ConsoleDep) -> HTMLResponse:
    """Step 1 of a bulk action: what it would touch (a dry-run count), and a confirmation."""
    form = await posted_form(request)
    action, scope, flt = _bulk_action(console, form)
    count = console.store.count_dead(flt)
    return render(request, console, "confirm.html", action=action, scope=scope, count=count,
                  described=describe(flt), query=query_of(flt), ids=flt.ids, rate=console.default_rate)


@router.post("/actions/confirm", dependencies=[_ACT])
async def action_confirm(request: Request, console: ConsoleDep, me: IdentityDep) -> Response:
    # Step 2: the action itself. A redrive goes on as a job, and its page follows it.
    form = await posted_form(request)
    action, _scope, flt = _bulk_action(console, form)
    if action == "redrive":
        job = console.jobs.redrive(flt, rate=rate_of(form.get("rate"), console.default_rate), who=me.who)
        return RedirectResponse(f"/jobs/{job.id}", status_code=303)
    removed = purge(console, flt, me.who)
    back = {**query_of(flt), "notice": f"Purged {removed} dead letter(s)."}
    return RedirectResponse(f"/dead-letters?{urlencode(back)}", status_code=303)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: int, console: ConsoleDep) -> HTMLResponse:
    job = console.jobs.get(job_id)
    if job is None:
        raise ConsoleError(404, f"no job {job_id} (jobs are kept in memory while the console runs)")
    return render(request, console, "job.html", job=job.as_dict(), query=query_of(job.filter))


@router.get("/trace", response_class=HTMLResponse)
def trace_page(request: Request, console: ConsoleDep) -> HTMLResponse:
    msg_id = (request.query_params.get("msg_id") or "").strip()
    rows = [present.detail(r, console.masker) for r in console.store.trace(msg_id)] if msg_id else []
    return render(request, console, "trace.html", msg_id=msg_id, rows=rows)


@router.get("/audit", response_class=HTMLResponse)
def audit_page(request: Request, console: ConsoleDep) -> HTMLResponse:
    before = int_param(request.query_params.get("before"), "before", None, 1, 2**63 - 1)
    entries = [present.audit(e) for e in console.store.audit_log(limit=100, before_id=before)]
    return render(request, console, "audit.html", entries=entries)


def _bulk_action(console: Console, form: FormData) -> tuple[str, str, DeadLetterFilter]:
    """The action (redrive or purge), its scope (selected or filter) and what it acts on."""
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
    return action, scope, check_ids(console, flt)
