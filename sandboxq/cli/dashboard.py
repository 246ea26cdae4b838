"""The ``dashboard`` verb: the web dashboard (``sandboxq.web``) served by uvicorn.

    sandboxq dashboard [--url U] [--host H] [--port P] [--token-file F] [--read-only]
                       [--allowed-host NAME]...
        ──► create_app(url, queues, token) ──► H:P bound ──► announced
        ──► uvicorn on that socket until Ctrl-C / SIGTERM, which also ends the open
            pages' event streams (else uvicorn would wait for each, up to STREAM_S)

Starlette and uvicorn are imported only here and only when the verb runs (the ``web``
extra): no other verb, and no producer, loads them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from sandboxq.cli.options import EXIT_OK, add_url, shared_url
from sandboxq.errors import ConfigError

if TYPE_CHECKING:
    from sandboxq.web.hub import Hub

#: Longest wait for the responses in progress at a stop (the event streams end at once).
SHUTDOWN_S = 3


def add_parser(verbs: Any) -> None:
    text = "serve the web dashboard: queues, jobs, attempts and workers"
    parser: argparse.ArgumentParser = verbs.add_parser("dashboard", help=text, description=text)
    add_url(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8686, help="port to listen on")
    parser.add_argument(
        "--token-file",
        help="file holding the token that allows retry, cancel and purge (without it the "
        "dashboard is read-only)",
    )
    parser.add_argument("--read-only", action="store_true", help="no actions, token or not")
    parser.add_argument(
        "--queue",
        action="append",
        dest="queues",
        metavar="NAME",
        help="show this queue, and serve no other (repeatable; default: every queue found)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        default=[],
        metavar="NAME",
        help="also answer to this Host name (repeatable; loopback names and --host always "
        "are): any other Host header gets 400, which stops DNS-rebinding pages",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from sandboxq.web import create_app
        from sandboxq.web.auth import read_token_file
    except ImportError as exc:
        raise ConfigError(
            f"the dashboard needs the web extra: pip install 'sandboxq[web]' ({exc})"
        ) from None
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1-65535, got {args.port}")
    token = read_token_file(args.token_file) if args.token_file else None
    app = create_app(
        shared_url(args.url),
        queues=args.queues,
        token=token,
        read_only=args.read_only,
        allowed_hosts=[args.host, *args.allowed_hosts],
    )
    sock = _listen(args.host, args.port)  # before any line says it serves
    mode = "read-only" if token is None or args.read_only else "actions need the token"
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"sandboxq dashboard: listening on {args.host}: anyone who can reach it can read "
            "every job's arguments, results and errors (put it behind your own access control; "
            "name the hosts it is reached by with --allowed-host)",
            file=sys.stderr,
        )
    print(f"sandboxq dashboard on http://{args.host}:{args.port}/ ({mode})", file=sys.stderr)
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=SHUTDOWN_S,
        # The peer's address, never what a request says in X-Forwarded-For: uvicorn trusts
        # that header from a local peer, and the audit line of a refused action is the
        # address it names. Behind a proxy, the proxy's own log has the client's.
        proxy_headers=False,
    )
    server = _stopping_ends_streams(uvicorn.Server(config), app.state.dashboard.hub)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return EXIT_OK


def _stopping_ends_streams(server: Any, hub: Hub) -> Any:
    """``server`` (a uvicorn.Server) with a signal handler that also ends the open pages'
    event streams: uvicorn waits for every response to end before it stops, and a stream
    lasts up to STREAM_S. The hub is told on the event loop, not in the handler, which
    may have interrupted the loop's thread while it held the hub's lock."""
    stop = server.handle_exit

    def handle_exit(sig: int, frame: FrameType | None) -> None:
        stop(sig, frame)
        with contextlib.suppress(RuntimeError):  # no loop yet: no stream either
            asyncio.get_running_loop().call_soon_threadsafe(hub.end_streams)

    server.handle_exit = handle_exit
    return server


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (as uvicorn binds one): a port in use or a host
    that does not resolve is a ``ConfigError`` here, not uvicorn's log line and exit 3
    after the banner."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:  # socket.gaierror (an unknown host) included
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
