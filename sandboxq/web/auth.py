"""Who may act: the token, the session cookie, CSRF and the Origin check.

    no token (or read_only)  ── every action refused: the dashboard only shows
    Authorization: Bearer T  ── a script's request; T compared in constant time
    POST /login (form: T)    ── cookie  <sid>.<issued s>.<mac>  HttpOnly, SameSite=Strict,
                                Path=<mount>
    POST /action             ── authenticated, same origin (Sec-Fetch-Site, Origin), and with
                                a cookie session also its CSRF field = HMAC(key, "csrf:" + sid)
    POST /logout             ── same origin; the session's id is ended here (``Auth.end``)

The cookie never holds the token: it holds a random session id, when it was issued, and an
HMAC of both keyed by the token, so a stolen cookie cannot be turned into the token,
changing the token ends every session, and a session ends ``SESSION_S`` after its login
whatever the browser keeps. A logout is kept in memory until that session would have
ended anyway: a restart of the dashboard forgets logouts, not the expiry.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

from sandboxq.errors import ConfigError

COOKIE = "sandboxq_session"
SESSION_S = 12 * 3600  # how long a login cookie lasts


def read_token_file(path: str | Path) -> str:
    """The token in ``path`` (surrounding whitespace dropped); refused if short or absent."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the dashboard token file {str(path)!r}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"the dashboard token file {str(path)!r} is not UTF-8 text: {exc}"
        ) from None
    if len(token) < 16:
        raise ConfigError(
            f"the dashboard token in {str(path)!r} is {len(token)} characters long: "
            "use at least 16 (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    return token


@dataclass(frozen=True, slots=True)
class Session:
    via: str  # "header" or "cookie"
    sid: str | None  # the cookie session's id (None for a bearer header)


class Auth:
    """Checks credentials; ``enabled`` is False when the dashboard is read-only."""

    def __init__(self, token: str | None, *, read_only: bool = False) -> None:
        self.enabled = token is not None and not read_only
        self._token = (token or "").encode()
        # a key of its own, so no HMAC this module makes is ever a hash of the bare token
        self._key = hashlib.sha256(b"sandboxq-dashboard\0" + self._token).digest()
        #: Sessions logged out, by id, with when each would have ended anyway.
        self._ended: dict[str, float] = {}
        self._ended_lock = threading.Lock()

    def _mac(self, purpose: str, sid: str) -> str:
        return hmac.new(self._key, f"{purpose}:{sid}".encode(), hashlib.sha256).hexdigest()

    def token_matches(self, candidate: str) -> bool:
        return self.enabled and hmac.compare_digest(candidate.encode(), self._token)

    def new_cookie(self) -> str:
        sid, issued = secrets.token_urlsafe(18), str(int(time.time()))
        return f"{sid}.{issued}.{self._mac('session', f'{sid}.{issued}')}"

    def end(self, session: Session | None) -> None:
        """Log ``session`` out: its cookie is refused from now on, wherever it was copied."""
        if session is None or session.sid is None:
            return
        now = time.time()
        with self._ended_lock:
            self._ended = {sid: until for sid, until in self._ended.items() if until > now}
            self._ended[session.sid] = now + SESSION_S

    def csrf(self, session: Session | None) -> str:
        return self._mac("csrf", session.sid) if session and session.sid else ""

    def wrong_bearer(self, request: Request) -> bool:
        """Whether ``request`` presents a bearer token that is not the token: its refusal
        waits like a wrong login does, so guessing is as slow through either door."""
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return self.enabled and scheme.lower() == "bearer" and not self.token_matches(value.strip())

    def session(self, request: Request) -> Session | None:
        if not self.enabled:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and self.token_matches(value.strip()):
            return Session("header", None)
        sid, _, rest = request.cookies.get(COOKIE, "").partition(".")
        issued, _, mac = rest.partition(".")
        signed = f"{sid}.{issued}"
        if not (sid and hmac.compare_digest(mac.encode(), self._mac("session", signed).encode())):
            return None
        if not issued.isdecimal() or time.time() - int(issued) > SESSION_S:
            return None  # past its life, however long the browser kept it
        with self._ended_lock:
            if sid in self._ended:
                return None
        return Session("cookie", sid)

    def refuse_post(self, request: Request, session: Session | None, csrf: str) -> str | None:
        """Why this POST is refused (None: allowed). Checks the origin for every POST, and
        the CSRF field for a cookie session (a bearer header cannot be sent cross-site)."""
        if reason := cross_site(request):
            return reason
        if session is None:
            return "log in with the dashboard token first"
        if session.via == "cookie" and not hmac.compare_digest(
            csrf.encode(), self.csrf(session).encode()
        ):
            return "the form's CSRF token is missing or wrong: reload the page and try again"
        return None


def cross_site(request: Request) -> str | None:
    """Why ``request`` looks cross-site (None: it does not). Browsers send ``Origin`` on
    every POST and ``Sec-Fetch-Site`` on every request; a script sends neither."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return f"cross-site request refused (Sec-Fetch-Site: {site})"
    origin = request.headers.get("origin")
    if origin is not None:
        host = request.headers.get("host", "")
        if origin == "null" or origin.partition("://")[2].rstrip("/") != host:
            return f"cross-origin request refused (Origin {origin!r} is not {host!r})"
    return None
