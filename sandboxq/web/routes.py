"""The dashboard's endpoints: each one ``(request) -> Response``, its state from the app.

    request.app.state.dashboard ──► Dashboard (state.py): backends, queues, auth, hub

    GET  /  /queue  /job  /workers   pages (sync, threadpool) ──► backend reads ──► HTML
    GET  /batches  /batch            a queue's batches, one batch (batch_views.py)
    GET  /events                     SSE: the hub's fan-out (hub.py), filtered by queue / job,
                                     and the backend's outage and recovery
    POST /action                     auth.py checks ──► retry_failed / cancel / purge /
                                     batch_retry / batch_cancel,
                                     logged ──► 303 back
    GET, POST /login   POST /logout  the session cookie set (auth.py) or deleted ──► 303

The state is read from the request, never captured when the app is built, so every
endpoint is a plain module-level function and app.py only lists them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from sandboxq.errors import ConfigError
from sandboxq.models import JobState, check_batch_id, check_job_id, now_ms
from sandboxq.web import batch_views, job_view, views
from sandboxq.web.auth import COOKIE, SESSION_S, cross_site
from sandboxq.web.html import Safe, esc, href, layout
from sandboxq.web.html import url as url_
from sandboxq.web.hub import COALESCE_S
from sandboxq.web.params import (
    batch_param,
    cursor_param,
    flag_param,
    job_param,
    queue_param,
    since_param,
)
from sandboxq.web.state import Dashboard

log = logging.getLogger("sandboxq.web")

STREAM_S = 600.0  # an SSE response ends after this; the browser reconnects at once
KEEPALIVE_S = 15.0
MAX_FORM_BYTES = 16 * 1024
REFUSED_PAUSE_S = 0.5  # a wrong token's answer waits this long: guessing stays slow


def _dash(request: Request) -> Dashboard:
    """The dashboard of the app serving ``request`` (set by ``create_app``)."""
    dash: Dashboard = request.app.state.dashboard
    return dash


def _ctx(dash: Dashboard, request: Request, check: bool = True) -> views.Ctx:
    """The request's context; the hub's position is taken first, before the page reads
    anything, so its stream replays whatever happens from here on. ``check``: read the
    queue index first (cached), so an unreachable server is a 503 on every page."""
    if check:
        dash.index()
    dash.hub.start()
    since = dash.hub.position()
    session = dash.auth.session(request)
    return views.Ctx(
        since=since,
        root=request.scope.get("root_path", "").rstrip("/"),
        now=now_ms(),
        actions=dash.auth.enabled,
        session=session,
        csrf=dash.auth.csrf(session),
    )


def _page(
    dash: Dashboard,
    ctx: views.Ctx,
    title: str,
    body: Safe,
    page: str,
    status: int = 200,
    queue: str | None = None,
    job: str | None = None,
) -> HTMLResponse:
    if not dash.auth.enabled:
        who = Safe('<span class="session">read-only</span>')
    elif ctx.session is not None:
        who = Safe(
            f'<form method="post" action="{href(ctx.root, "/logout")}" class="logout">'
            '<button type="submit">log out</button></form>'
        )
    else:
        who = Safe(f'<a class="session" href="{href(ctx.root, "/login")}">log in</a>')
    events = href(ctx.root, "/events", queue=queue, job=job, since=ctx.since)
    text = layout(ctx.root, title, body, page=page, events=events, session_line=who, job=job)
    return HTMLResponse(text, status_code=status, headers={"cache-control": "no-store"})


def _message(dash: Dashboard, ctx: views.Ctx, title: str, text: str, status: int) -> HTMLResponse:
    body = Safe(f'<h1>{esc(title)}</h1><p class="notice" id="message">{esc(text)}</p>')
    return _page(dash, ctx, title, body, "message", status)


def overview(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    pairs = [(q, dash.backend(q)) for q in dash.queues()]
    body = views.overview(ctx, pairs, dash.hub.throughput, dash.note())
    return _page(dash, ctx, "Overview", body, "overview")


def queue(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    params = request.query_params
    name = str(queue_param(params, "name"))
    state_text = params.get("state") or "waiting"
    if state_text not in views.STATES:
        raise ConfigError(f"parameter 'state': {state_text[:40]!r} is not one of {views.STATES}")
    state = JobState(state_text)
    cursor = cursor_param(params, "cursor")
    backend = dash.backend(name)
    missing = None
    if job_id := params.get("id", "").strip():
        if backend.job_detail(check_job_id(job_id)) is not None:
            return RedirectResponse(url_(ctx.root, "/job", queue=name, id=job_id), 303)
        missing = job_id
    outcome = params.get("outcome") or None
    if outcome is not None and outcome not in views.OUTCOMES:
        return _message(dash, ctx, "Bad request", f"unknown outcome {outcome[:40]!r}", 400)
    try:
        page = backend.job_page(state, cursor, views.PAGE_SIZE, outcome)
    except ConfigError as exc:
        return _message(dash, ctx, "Bad request", str(exc), 400)
    body = views.queue_page(ctx, name, backend, state, page, cursor, outcome, missing)
    return _page(dash, ctx, f"Queue {name}", body, "queue", queue=name)


def job(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    params = request.query_params
    name, job_id = str(queue_param(params, "queue")), str(job_param(params, "id"))
    full = flag_param(params, "full")
    detail = dash.backend(name).job_detail(job_id)
    if detail is None:
        text = f"No job {job_id!r} in queue {name!r} (unknown, or trimmed)."
        return _message(dash, ctx, "No such job", text, 404)
    body = job_view.job_page(ctx, name, detail, full)
    return _page(dash, ctx, f"Job {job_id}", body, "job", queue=name, job=job_id)


def batches(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    name = str(queue_param(request.query_params, "queue"))
    found = dash.backend(name).list_batches(batch_views.BATCHES_SHOWN)
    body = batch_views.batches_page(ctx, name, found)
    return _page(dash, ctx, f"Batches of {name}", body, "batches", queue=name)


def batch(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    params = request.query_params
    name, batch_id = str(queue_param(params, "queue")), batch_param(params, "id")
    backend = dash.backend(name)
    progress = backend.batch_progress(batch_id)
    if progress is None:
        text = f"No batch {batch_id!r} in queue {name!r} (unknown, forgotten, or expired)."
        return _message(dash, ctx, "No such batch", text, 404)
    body = batch_views.batch_page(ctx, name, backend, progress)
    return _page(dash, ctx, f"Batch {batch_id}", body, "batch", queue=name)


def workers(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    only = queue_param(request.query_params, "queue", required=False)
    names = [only] if only else dash.queues()
    pairs = [(q, dash.backend(q)) for q in names]
    return _page(dash, ctx, "Workers", views.workers_page(ctx, pairs), "workers", queue=only)


async def events(request: Request) -> Response:
    dash = _dash(request)
    params = request.query_params
    name = queue_param(params, "queue", required=False)
    if name is not None:
        dash.check_shown(str(name))  # before the stream starts: a 400, not a silent stream
    job_id = job_param(params, "job", required=False)
    if header := request.headers.get("last-event-id"):
        since = since_param(header, "header 'Last-Event-ID'")
    else:
        since = since_param(params.get("since"), "parameter 'since'")
    headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
    body = _stream(dash, name, job_id, since)
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def _stream(
    dash: Dashboard, name: str | None, job_id: str | None, since: int | None
) -> AsyncIterator[str]:
    # subscribed here, not before: a response that never starts leaves nothing behind
    client = dash.hub.subscribe(name, job_id, since)
    loop = asyncio.get_running_loop()
    ends = loop.time() + STREAM_S
    try:
        yield "retry: 2000\n\n"
        while (left := ends - loop.time()) > 0:
            try:
                message = await asyncio.wait_for(client.inbox.get(), min(KEEPALIVE_S, left))
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            if message is None:  # dropped for falling behind, or closing
                break
            # shared with other streams and the replay buffer: read, never change
            data = json.dumps({k: v for k, v in message.items() if k != "seq"})
            if "seq" not in message:  # the backend's state (hub.py): no id, not replayed
                yield f"event: backend\ndata: {data}\n\n"
                continue
            yield f"id: {message['seq']}\nevent: job\ndata: {data}\n\n"
            if client.coalesce:  # what comes meanwhile is one message, sent next
                await asyncio.sleep(COALESCE_S)
    finally:
        dash.hub.unsubscribe(client)


async def _form(request: Request) -> dict[str, str]:
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise ConfigError("form too large")
    pairs = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in pairs.items()}


async def login(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    if not dash.auth.enabled:
        text = "This dashboard is read-only: it was started without a token file."
        return _message(dash, ctx, "Read-only", text, 403)
    if request.method == "GET":
        body = Safe(
            f'<h1>Log in</h1><form method="post" action="{href(ctx.root, "/login")}" '
            'class="login"><label>dashboard token <input type="password" name="token" '
            'id="token" autocomplete="current-password" required></label>'
            '<button type="submit" id="login">Log in</button></form>'
        )
        return _page(dash, ctx, "Log in", body, "login")
    data = await _form(request)
    if (reason := cross_site(request)) or not dash.auth.token_matches(data.get("token", "")):
        log.warning("dashboard login refused from %s", _client(request))
        await asyncio.sleep(REFUSED_PAUSE_S)
        return _message(dash, ctx, "Refused", reason or "wrong token", 403)
    log.info("dashboard login from %s", _client(request))
    response = RedirectResponse(url_(ctx.root, "/"), 303)
    response.set_cookie(
        COOKIE,
        dash.auth.new_cookie(),
        max_age=int(SESSION_S),
        path=(ctx.root or "") + "/",
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


async def logout(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    if reason := cross_site(request):  # another site's page may not log the operator out
        log.warning("dashboard logout refused from %s: %s", _client(request), reason)
        return _message(dash, ctx, "Refused", reason, 403)
    dash.auth.end(ctx.session)
    response = RedirectResponse(url_(ctx.root, "/"), 303)
    response.delete_cookie(COOKIE, path=(ctx.root or "") + "/")
    return response


async def action(request: Request) -> Response:
    dash = _dash(request)
    ctx = _ctx(dash, request)
    if not dash.auth.enabled:
        log.warning("dashboard action refused (read-only) from %s", _client(request))
        text = "This dashboard is read-only: actions need a token file."
        return _message(dash, ctx, "Refused", text, 403)
    data = await _form(request)
    reason = dash.auth.refuse_post(request, ctx.session, data.get("csrf", ""))
    what, name = data.get("action", ""), data.get("queue", "")
    target = data.get("id") or data.get("state") or ""
    if reason is not None:
        log.warning(  # every field as a repr: a newline in one cannot forge a log line
            "dashboard %r of %r in queue %r refused from %s: %s",
            what, target, name, _client(request), reason,
        )  # fmt: skip
        if dash.auth.wrong_bearer(request):
            await asyncio.sleep(REFUSED_PAUSE_S)  # awaited: other requests go on meanwhile
        return _message(dash, ctx, "Refused", reason, 401 if ctx.session is None else 403)
    try:
        done, back = await asyncio.to_thread(_act, dash, ctx, what, name, data)
    except (ConfigError, ValueError) as exc:
        return _message(dash, ctx, "Bad request", str(exc), 400)
    log.warning(
        "dashboard %r of %r in queue %r by %s (%s): %s",
        what, target, name, _client(request), ctx.session.via if ctx.session else "", done,
    )  # fmt: skip
    return RedirectResponse(back, 303)


def _act(
    dash: Dashboard, ctx: views.Ctx, what: str, name: str, data: dict[str, str]
) -> tuple[str, str]:
    """Do one action; returns what happened and where to send the browser next."""
    backend = dash.backend(name)
    if what == "purge":
        state = JobState(data.get("state", ""))
        if state is JobState.ACTIVE:
            raise ConfigError("active jobs cannot be purged: cancel them")
        n = backend.purge(state)
        return f"purged {n}", url_(ctx.root, "/queue", name=name, state=state.value)
    if what in ("batch_retry", "batch_cancel"):
        batch_id = check_batch_id(data.get("id", ""))
        acted = backend.batch_each(batch_id, "retry" if what == "batch_retry" else "cancel")
        if acted is None:
            raise ConfigError(f"no batch {batch_id!r} in queue {name!r}")
        verb = "retried" if what == "batch_retry" else "cancelled"
        return f"{verb} {acted} member(s)", url_(ctx.root, "/batch", queue=name, id=batch_id)
    job_id = check_job_id(data.get("id", ""))
    back = url_(ctx.root, "/job", queue=name, id=job_id)
    if what == "retry":
        return ("retried" if backend.retry_failed(job_id) else "not retried: not failed"), back
    if what == "cancel":
        return ("cancelled" if backend.cancel(job_id) else "not cancelled: finished"), back
    raise ConfigError(
        f"unknown action {what!r}: use retry, cancel, purge, batch_retry or batch_cancel"
    )


def unavailable(request: Request, exc: Exception) -> Response:
    """A backend that cannot answer (Redis down): say so, as a page with a banner naming
    the server (credentials redacted), not a traceback."""
    log.warning("dashboard page %s: %s", request.url.path, exc)
    dash = _dash(request)
    ctx = _ctx(dash, request, check=False)
    body = Safe(
        f'<div class="banner outage" id="outage" role="alert">The backend at '
        f"{esc(dash.where)} cannot be read, so nothing here is current: {esc(exc)}</div>"
        "<h1>Unavailable</h1>"
        '<p class="notice" id="message">This page will show the queues again as soon as '
        "the server answers.</p>"
    )
    return _page(dash, ctx, "Unavailable", body, "outage", 503)


def damaged(request: Request, exc: Exception) -> Response:
    """A record or key the page needed is damaged (changed by hand, forged): the server
    answers, so this is no outage banner; 502, as a gateway's upstream that answered
    something invalid, with what is damaged in one line."""
    log.warning("dashboard page %s: %s", request.url.path, exc)
    dash = _dash(request)
    ctx = _ctx(dash, request, check=False)
    return _message(dash, ctx, "Damaged record", str(exc), 502)


def bad_request(request: Request, exc: Exception) -> Response:
    """A parameter that was checked where it entered (params.py) and refused: 400 with
    its one-line reason."""
    dash = _dash(request)
    return _message(dash, _ctx(dash, request, check=False), "Bad request", str(exc), 400)


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"
