"""``create_app(url, ...)``: the dashboard as an ASGI app, standalone or mounted.

    create_app ──► Dashboard (state.py) in app.state.dashboard
               ──► the route table: the endpoints in routes.py, static/ under /static
               ──► the security headers on every response, the backends closed at shutdown

Links are built from the request's ``root_path``, so the app works under any mount
point (``app.mount("/admin/queues", create_app(url))``). Every response carries a strict
Content-Security-Policy: scripts and styles from this app only, nothing inline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from importlib import resources

from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandboxq.errors import ConfigError, DamagedRecord, SandboxqError
from sandboxq.observe.quiet import install as quiet_outage_warnings
from sandboxq.web import routes
from sandboxq.web.hosts import HostCheck, allowed_names
from sandboxq.web.state import Dashboard

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


def create_app(
    url: str | None = None,
    *,
    queues: Sequence[str] | None = None,
    token: str | None = None,
    read_only: bool = False,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The dashboard for the queues at ``url`` (None: ``$SANDBOXQ_URL``, else memory://).

    ``queues``: the queues to show (default: every queue found, looked for in the
    background). ``token``: enables retry, cancel and purge for whoever presents it (a
    ``Authorization: Bearer`` header or the login form's cookie); without it, or with
    ``read_only``, the dashboard only shows. ``app.state.dashboard.close()`` stops its
    reader thread and closes its backends (done by the app's lifespan when it runs
    standalone; call it at shutdown when the app is mounted in another). ``allowed_hosts``:
    the names it answers to besides loopback (``Host`` header; ``["*"]``: any, for a
    service that checks Host itself); any other gets 400 before anything is read.
    """
    hosts = allowed_names(allowed_hosts)
    # an outage: every page and the events reader would log the same line every 2 s
    quiet_outage_warnings(("sandboxq.web",))
    dash = Dashboard(url, queues, token, read_only)
    static = resources.files("sandboxq.web") / "static"
    app = Starlette(
        routes=[
            Route("/", routes.overview),
            Route("/queue", routes.queue),
            Route("/job", routes.job),
            Route("/workers", routes.workers),
            Route("/batches", routes.batches),
            Route("/batch", routes.batch),
            Route("/events", routes.events),
            Route("/login", routes.login, methods=["GET", "POST"]),
            Route("/logout", routes.logout, methods=["POST"]),
            Route("/action", routes.action, methods=["POST"]),
            Mount("/static", StaticFiles(directory=str(static)), name="static"),
        ],
        lifespan=_lifespan,
        # a parameter refused where it entered is 400; a damaged record 502 naming it;
        # any other failure of the backend (Redis down) is 503 with a banner
        exception_handlers={
            ConfigError: routes.bad_request,
            DamagedRecord: routes.damaged,
            SandboxqError: routes.unavailable,
        },
    )
    app.state.dashboard = dash
    app.add_middleware(_SecurityHeaders)
    app.add_middleware(HostCheck, names=hosts)  # outermost: refused before anything runs
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    yield
    dash: Dashboard = app.state.dashboard
    await asyncio.to_thread(dash.close)


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
