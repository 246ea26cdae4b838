"""HTML building blocks: escaping, links under the mount prefix, the page layout.

Everything a job carries (ids, arguments, results, errors, worker names) reaches HTML
only through ``esc`` (text and attribute values alike) or ``Safe`` pieces built from
escaped parts, so a job id holding ``<script>`` shows as those characters. The pages run
no inline script: the one script is ``static/app.js``, which the Content-Security-Policy
allows alone.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

from sandboxq.models import now_ms
from sandboxq.text import BIDI_CONTROLS, PREVIEW_CHARS, clip, duration, when

__all__ = ["PREVIEW_CHARS", "Safe", "clip", "duration", "esc", "now_ms", "when"]

#: Pages that re-read themselves every 2 s (app.js): what they list can change without
#: an event (a new queue, a worker that registered).
POLLED_PAGES = ("overview", "workers", "outage")


class Safe(str):
    """HTML that is already escaped (built here from escaped parts)."""


#: Shown as their escapes, as the terminal shows them (text.BIDI_CONTROLS says why).
_BIDI = re.compile(f"[{BIDI_CONTROLS}]")


def esc(value: object) -> Safe:
    if isinstance(value, Safe):
        return value
    text = "" if value is None else str(value)
    if _BIDI.search(text):
        text = _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return Safe(html.escape(text, quote=True))


def join(parts: Iterable[object]) -> Safe:
    return Safe("".join(esc(part) for part in parts))


def url(root: str, path: str, **query: object) -> str:
    """A URL under the app's mount point (``root``), its query encoded."""
    pairs = {k: str(v) for k, v in query.items() if v is not None and v != ""}
    return f"{root}{path}" + (f"?{urlencode(pairs)}" if pairs else "")


def href(root: str, path: str, **query: object) -> Safe:
    """``url`` escaped for an HTML attribute."""
    return esc(url(root, path, **query))


def link(url: Safe, text: object, cls: str = "") -> Safe:
    attr = f' class="{esc(cls)}"' if cls else ""
    return Safe(f'<a href="{url}"{attr}>{esc(text)}</a>')


def table(columns: list[str], rows: Iterable[Iterable[object]], cls: str = "") -> Safe:
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>" for row in rows)
    if not body:
        body = f'<tr><td colspan="{len(columns)}" class="empty">none</td></tr>'
    attr = f' class="{esc(cls)}"' if cls else ""
    return Safe(f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def fields(pairs: Iterable[tuple[str, object]]) -> Safe:
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in pairs)
    return Safe(f'<table class="fields"><tbody>{rows}</tbody></table>')


def pre(text: object, cls: str = "") -> Safe:
    attr = f' class="{esc(cls)}"' if cls else ""
    return Safe(f"<pre{attr}>{esc(text)}</pre>")


def ago(ms: int | None, now: int) -> Safe:
    if ms is None:
        return Safe("")
    took = duration(max(0, now - ms) / 1000)
    return Safe(f'<span title="{esc(when(ms))}">{esc(took)} ago</span>')


def hidden(values: Mapping[str, object]) -> Safe:
    return Safe(
        "".join(
            f'<input type="hidden" name="{esc(k)}" value="{esc(v)}">'
            for k, v in values.items()
            if v is not None
        )
    )


def button_form(
    action_url: Safe, label: str, values: Mapping[str, object], confirm: str = ""
) -> Safe:
    """A POST form of one button (with its CSRF field among ``values``)."""
    ask = f' data-confirm="{esc(confirm)}"' if confirm else ""
    return Safe(
        f'<form method="post" action="{action_url}" class="action"{ask}>{hidden(values)}'
        f'<button type="submit">{esc(label)}</button></form>'
    )


def pretty(value: Any) -> str:
    """JSON on one line when short, indented when not."""
    line = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return line if len(line) <= 100 else json.dumps(value, indent=2, ensure_ascii=False)


def layout(
    root: str,
    title: str,
    body: Safe,
    *,
    page: str,
    events: Safe | None = None,
    session_line: str = "",
    job: str | None = None,
) -> str:
    """A whole page: head (one stylesheet, one deferred script), nav, ``body``."""
    live = f' data-events="{events}"' if events is not None else ""
    poll = ' data-poll="1"' if page in POLLED_PAGES else ""
    job_attr = f' data-job="{esc(job)}"' if job is not None else ""
    nav = join(
        [
            link(href(root, "/"), "Overview"),
            Safe(" "),
            link(href(root, "/workers"), "Workers"),
        ]
    )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · sandboxq</title>"
        f'<link rel="stylesheet" href="{href(root, "/static/style.css")}">'
        f'<script src="{href(root, "/static/app.js")}" defer></script>'
        '<noscript><meta http-equiv="refresh" content="30"></noscript>'
        f'</head><body data-page="{esc(page)}"{live}{job_attr}{poll}>'
        f'<header><a class="brand" href="{href(root, "/")}">sandboxq</a><nav>{nav}</nav>'
        f'<span id="live" class="live">static</span>'
        f'<a class="refresh" href="">refresh</a>{Safe(session_line)}</header>'
        f'<main id="main">{body}</main></body></html>'
    )
