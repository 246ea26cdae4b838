"""The dashboard: queues, jobs, attempts and workers in a web page (``sandboxq[web]``).

    create_app(url) ──► a Starlette app: standalone (``sandboxq dashboard``) or mounted in
                        a FastAPI / Starlette service (``app.mount("/admin/queues", ...)``)

    app.py    create_app: route table, headers     routes.py the endpoints and actions
    views.py  the pages' HTML                      html.py   escaping, links, layout
    job_view.py, batch_views.py                    the job page, the batch pages
    hub.py    one events reader, SSE fan-out       auth.py   token, cookie, CSRF, Origin
    state.py  backends, the queues shown, the hub  static/   app.js, style.css (no CDN)

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
