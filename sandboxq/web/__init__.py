"""The dashboard: queues, jobs, attempts and workers in a web page (``sandboxq[web]``).

    create_app(url) ──► a Starlette app: standalone (``sandboxq dashboard``) or mounted in
                        a FastAPI / Starlette service (``app.mount("/admin/queues", ...)``)

    app.py    routes, actions, security headers     views.py  the pages' HTML
    hub.py    one events reader, SSE fan-out         html.py   escaping, links, layout
    state.py  backends, the queues shown, the hub     auth.py   token, cookie, CSRF, Origin
    static/   app.js and style.css (no CDN)

Nothing here is imported by ``import sandboxq``: a producer never loads Starlette.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandboxq.web.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from sandboxq.web.app import create_app

        return create_app
    raise AttributeError(f"module 'sandboxq.web' has no attribute {name!r}")
