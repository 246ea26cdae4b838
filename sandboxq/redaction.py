"""The one function that shows a backend URL: passwords and secret options hidden.

    redis://user:pw@host:6379/0?ssl_password=x  ->  redis://user:***@host:6379/0?ssl_password=***

Every error message, log line, ``repr`` and worker record that names a server goes
through ``redact_url``; nothing else in sandboxq formats a URL it was given. What a
handler says of itself (an attempt's error, traceback and output) goes through
``redact_text``, which hides the password of every URL written in it: a handler that
fails to connect somewhere often prints the URL it was given. Imports nothing heavy, so
the backend chooser can use it before any backend is loaded.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

#: Query options that hold secrets (shown as ``***``).
_SECRET_OPTION = re.compile(r"(pass|secret|token|key_?data|auth)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` fit to show: its password, and any query option that holds a secret, as
    ``***``. A string that does not parse as a URL has whatever sits between ``user:`` and
    ``@`` hidden all the same."""
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed (an open IPv6 bracket)
        return _hide_userinfo(url)
    if "@" in url and "@" not in parts.netloc:
        # A password holding '#', '?' or '/' unencoded ends the netloc early, and the
        # parse no longer sees it as one: hide up to the last '@' instead (too much,
        # rather than too little).
        return _hide_userinfo(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    hidden = False
    if at and ":" in userinfo:
        parts = parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{hosts}")
        hidden = True
    if parts.query:
        shown = []
        for item in parts.query.split("&"):
            name, eq, _ = item.partition("=")
            secret = bool(eq) and _SECRET_OPTION.search(name) is not None
            shown.append(f"{name}=***" if secret else item)
            hidden = hidden or secret
        parts = parts._replace(query="&".join(shown))
    # Nothing to hide: the string as given (urlunsplit would tidy odd ones, "a?" -> "a").
    return urlunsplit(parts) if hidden else url


def _hide_userinfo(url: str) -> str:
    """Hide what sits between ``scheme://user:`` and the last ``@``, and the values of
    secret query options after it."""
    url = re.sub(r"^([A-Za-z][\w+.-]*://[^/@:]*):.*@", r"\1:***@", url, flags=re.DOTALL)
    return _SECRET_VALUE.sub(r"\1***", url)


_SECRET_VALUE = re.compile(r"([?&][^=&]*" + _SECRET_OPTION.pattern + r"[^=&]*=)[^&]*", re.I)


#: ``scheme://user:password@`` anywhere in a text; the password ends at the last '@' before
#: the next blank, quote or bracket.
_URL_USERINFO = re.compile(r"([A-Za-z][\w+.-]*://[^\s/@:'\"<>()\[\]]*):[^\s'\"<>()\[\]]*@")


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it (and the values of secret query
    options) shown as ``***``: for what a handler wrote, which no one checked."""
    if "://" not in text and "=" not in text:
        return text  # the common case, at no cost
    return _SECRET_VALUE.sub(r"\1***", _URL_USERINFO.sub(r"\1:***@", text))
