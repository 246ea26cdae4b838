"""The Host check: the dashboard answers only to the names it is served under.

    request ── Host: evil.example ──► 400 "host ... is not served here" (nothing read)
            ── Host: 127.0.0.1:8686 ──► the app

Why: a page on any site can make the operator's browser resolve its own name to
127.0.0.1 (DNS rebinding) and then read the dashboard as same-origin, every job's
arguments and results included. The browser still sends the attacker's name as
``Host``, so refusing names the dashboard does not serve closes that door. Loopback
names are always allowed; the CLI adds its bind address and ``--allowed-host`` names.
``"*"`` turns the check off (a service that mounts the dashboard and checks Host itself).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from sandboxq.errors import ConfigError

LOOPBACK = ("localhost", "127.0.0.1", "::1")
MAX_HOST_CHARS = 253  # the longest DNS name


def host_name(header: str) -> str:
    """The name part of a ``Host`` header, lower-cased, without port or IPv6 brackets."""
    value = header.strip().lower()
    if value.startswith("["):  # [::1]:8686
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def allowed_names(hosts: Iterable[str] | None) -> frozenset[str] | None:
    """The names to answer to: loopback plus ``hosts`` (None: any name, for ``"*"``)."""
    names = set(LOOPBACK)
    for host in hosts or ():
        if host == "*":
            return None
        name = host_name(host)
        if not name or len(name) > MAX_HOST_CHARS or not name.isascii():
            raise ConfigError(f"allowed host {host!r} is not a host name or address")
        names.add(name)
    names.discard("0.0.0.0")  # a wildcard bind address is not a name anyone is reached by
    names.discard("::")
    return frozenset(names)


class HostCheck:
    """ASGI middleware: 400 for a request whose ``Host`` is not one of ``names``."""

    def __init__(self, app: ASGIApp, names: frozenset[str] | None) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.names is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers") or []).get(b"host", b"")
        header = raw.decode("latin-1")
        if host_name(header) in self.names:
            await self.app(scope, receive, send)
            return
        shown = header[:80].encode("ascii", "backslashreplace").decode()
        reason = (
            f"host {shown!r} is not served here: start the dashboard with "
            "--allowed-host NAME to answer to it\n"
        )
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": reason.encode()})
