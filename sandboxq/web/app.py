"""``create_app(url, ...)``: the dashboard as an ASGI app, standalone or mounted.

    browser ──GET──► page endpoints (sync, in the threadpool) ──► backend reads ──► HTML
            ──GET /events──► SSE: the hub's fan-out (hub.py), filtered by queue / job
            ──POST /action──► auth.py checks ──► backend.retry_failed / cancel / purge,
                                                 logged ──► 303 back
            ──POST /login, /logout──► the session cookie set (auth.py) or deleted ──► 303

Links are built from the request's ``root_path``, so the app works under any mount
point (``app.mount("/admin/queues", create_app(url))``). Every response carries a strict
Content-Security-Policy: scripts and styles from this app only, nothing inline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandboxq.errors import ConfigError, SandboxqError
from sandboxq.models import JobState, check_job_id
from sandboxq.web import views
from sandboxq.web.auth import COOKIE, SESSION_S, cross_site
from sandboxq.web.html import Safe, esc, href, layout, now_ms
from sandboxq.web.html import url as url_
from sandboxq.web.hub import COALESCE_S
from sandboxq.web.state import Dashboard

log = logging.getLogger("sandboxq.web")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
]
STREAM_S = 600.0  # an SSE response ends after this; the browser reconnects at once
KEEPALIVE_S = 15.0
MAX_FORM_BYTES = 16 * 1024
REFUSED_PAUSE_S = 0.5  # a wrong token's answer waits this long: guessing stays slow


def _ctx(dash: Dashboard, request: Request) -> views.Ctx:
    """The request's context; the hub's position is taken first, before the page reads
    anything, so its stream replays whatever happens from here on."""
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


def create_app(
    url: str | None = None,
    *,
    queues: Sequence[str] | None = None,
    token: str | None = None,
    read_only: bool = False,
) -> Starlette:
    """The dashboard for the queues at ``url`` (None: ``$SANDBOXQ_URL``, else memory://).

    ``queues``: the queues to show (default: every queue found, looked for in the
    background). ``token``: enables retry, cancel and purge for whoever presents it (a
    ``Authorization: Bearer`` header or the login form's cookie); without it, or with
    ``read_only``, the dashboard only shows. ``app.state.dashboard.close()`` stops its
    reader thread and closes its backends (done by the app's lifespan when it runs
    standalone; call it at shutdown when the app is mounted in another).
    """
    dash = Dashboard(url, queues, token, read_only)

    def overview(request: Request) -> Response:
        ctx = _ctx(dash, request)
        pairs = [(q, dash.backend(q)) for q in dash.queues()]
        body = views.overview(ctx, pairs, dash.hub.throughput)
        return _page(dash, ctx, "Overview", body, "overview")

    def queue(request: Request) -> Response:
        ctx = _ctx(dash, request)
        params = request.query_params
        name = params.get("name", "")
        try:
            backend = dash.backend(name)
            state = JobState(params.get("state") or "waiting")
        except (ConfigError, ValueError) as exc:
            return _message(dash, ctx, "Bad request", str(exc), 400)
        missing = None
        if job_id := params.get("id", "").strip():
            if backend.job_detail(job_id) is not None:
                return RedirectResponse(url_(ctx.root, "/job", queue=name, id=job_id), 303)
            missing = job_id
        outcome = params.get("outcome") or None
        if outcome is not None and outcome not in views.OUTCOMES:
            return _message(dash, ctx, "Bad request", f"unknown outcome {outcome!r}", 400)
        cursor = params.get("cursor") or None
        try:
            page = backend.job_page(state, cursor, views.PAGE_SIZE, outcome)
        except ConfigError as exc:
            return _message(dash, ctx, "Bad request", str(exc), 400)
        body = views.queue_page(ctx, name, backend, state, page, cursor, outcome, missing)
        return _page(dash, ctx, f"Queue {name}", body, "queue", queue=name)

    def job(request: Request) -> Response:
        ctx = _ctx(dash, request)
        name, job_id = request.query_params.get("queue", ""), request.query_params.get("id", "")
        try:
            detail = dash.backend(name).job_detail(check_job_id(job_id))
        except ConfigError as exc:
            return _message(dash, ctx, "Bad request", str(exc), 400)
        if detail is None:
            text = f"No job {job_id!r} in queue {name!r} (unknown, or trimmed)."
            return _message(dash, ctx, "No such job", text, 404)
        full = request.query_params.get("full") == "1"
        body = views.job_page(ctx, name, detail, full)
        return _page(dash, ctx, f"Job {job_id}", body, "job", queue=name, job=job_id)

    def workers(request: Request) -> Response:
        ctx = _ctx(dash, request)
        only = request.query_params.get("queue")
        names = [only] if only else dash.queues()
        try:
            pairs = [(q, dash.backend(q)) for q in names]
        except ConfigError as exc:
            return _message(dash, ctx, "Bad request", str(exc), 400)
        return _page(dash, ctx, "Workers", views.workers_page(ctx, pairs), "workers", queue=only)

    async def events(request: Request) -> Response:
        name = request.query_params.get("queue") or None
        job_id = request.query_params.get("job") or None
        since_text = request.headers.get("last-event-id") or request.query_params.get("since")
        since = int(since_text) if since_text and since_text.isdigit() else None

        async def stream() -> AsyncIterator[str]:
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
                    yield f"id: {message['seq']}\nevent: job\ndata: {data}\n\n"
                    if client.coalesce:  # what comes meanwhile is one message, sent next
                        await asyncio.sleep(COALESCE_S)
            finally:
                dash.hub.unsubscribe(client)

        headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    async def form(request: Request) -> dict[str, str]:
        body = await request.body()
        if len(body) > MAX_FORM_BYTES:
            raise ConfigError("form too large")
        pairs = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        return {k: v[0] for k, v in pairs.items()}

    async def login(request: Request) -> Response:
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
        data = await form(request)
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
        ctx = _ctx(dash, request)
        response = RedirectResponse(url_(ctx.root, "/"), 303)
        response.delete_cookie(COOKIE, path=(ctx.root or "") + "/")
        return response

    async def action(request: Request) -> Response:
        ctx = _ctx(dash, request)
        if not dash.auth.enabled:
            log.warning("dashboard action refused (read-only) from %s", _client(request))
            text = "This dashboard is read-only: actions need a token file."
            return _message(dash, ctx, "Refused", text, 403)
        data = await form(request)
        reason = dash.auth.refuse_post(request, ctx.session, data.get("csrf", ""))
        what, name = data.get("action", ""), data.get("queue", "")
        target = data.get("id") or data.get("state") or ""
        if reason is not None:
            log.warning(
                "dashboard %s of %r in queue %r refused from %s: %s",
                what, target, name, _client(request), reason,
            )  # fmt: skip
            return _message(dash, ctx, "Refused", reason, 401 if ctx.session is None else 403)
        try:
            done, back = await asyncio.to_thread(_act, dash, ctx, what, name, data)
        except (ConfigError, ValueError) as exc:
            return _message(dash, ctx, "Bad request", str(exc), 400)
        log.warning(
            "dashboard %s of %r in queue %r by %s (%s): %s",
            what, target, name, _client(request), ctx.session.via if ctx.session else "", done,
        )  # fmt: skip
        return RedirectResponse(back, 303)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(dash.close)

    def unavailable(request: Request, exc: Exception) -> Response:
        """A backend that cannot answer (Redis down): say so, as a page, not a traceback."""
        log.warning("dashboard page %s: %s", request.url.path, exc)
        return _message(dash, _ctx(dash, request), "Unavailable", str(exc), 503)

    static = resources.files("sandboxq.web") / "static"
    app = Starlette(
        routes=[
            Route("/", overview),
            Route("/queue", queue),
            Route("/job", job),
            Route("/workers", workers),
            Route("/events", events),
            Route("/login", login, methods=["GET", "POST"]),
            Route("/logout", logout, methods=["POST"]),
            Route("/action", action, methods=["POST"]),
            Mount("/static", StaticFiles(directory=str(static)), name="static"),
        ],
        lifespan=lifespan,
        exception_handlers={SandboxqError: unavailable},
    )
    app.state.dashboard = dash
    app.add_middleware(_SecurityHeaders)
    return app


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
    job_id = check_job_id(data.get("id", ""))
    back = url_(ctx.root, "/job", queue=name, id=job_id)
    if what == "retry":
        return ("retried" if backend.retry_failed(job_id) else "not retried: not failed"), back
    if what == "cancel":
        return ("cancelled" if backend.cancel(job_id) else "not cancelled: finished"), back
    raise ConfigError(f"unknown action {what!r}: use retry, cancel or purge")


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


class _SecurityHeaders:
    """Adds the CSP and friends to every response, static files included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)
