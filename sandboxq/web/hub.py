"""One reader of the queues' events streams per dashboard process, fanned out to browsers.

    backend.events() ──► reader thread ──┬─► Throughput: outcomes per minute, per queue
      (every queue,     (one, daemon)    └─► loop.call_soon_threadsafe ──► each client's
       one at a time)                          bounded asyncio.Queue ──► its SSE response

Every message gets a number (``seq``). A page notes the hub's number before it reads the
backend and its stream asks for everything after it (``since``; ``Last-Event-ID`` on a
reconnect), replayed from the last ``REPLAY`` messages: an event that lands between the
page's read and its stream's start still reaches it. When the gap is wider than the
replay buffer, the stream says ``reload`` instead.

A stream of one job gets each of its events (its progress bar moves with every one). A
queue-wide stream only tells its page that something changed: it holds at most one
unsent message and sends at most one every ``COALESCE_S``, so a page watching a queue
that runs thousands of jobs a second costs a message a second, not thousands.

When the reader cannot read (the server is down) every stream is told ``outage``, and
``recovered`` once a round reads again; a stream that starts meanwhile hears ``outage``
first. Those carry no number: they are the backend's state, not events to replay. The
pages that refresh only on events learn of the outage that way (the others poll).

``end_streams`` ends every stream now and any that starts later: a server that is asked
to stop waits for its responses to end, and a stream would last ``STREAM_S``.

The reader is the only thing that reads events, however many browsers watch: a page left
open costs one parked HTTP response and a queue of at most ``CLIENT_BUFFER`` messages. A
client that does not keep up (its queue is full) is dropped: its stream ends and its
browser reconnects with a fresh one, instead of the hub buffering for it without end.

Reading: with one queue the reader blocks on its stream (``events(block_s=...)``); with
several it reads all of them in one read without blocking (``Backend.new_events``) and
pauses ``POLL_S`` when none had news. A queue that cannot be read (a key changed by hand)
is passed over, not the whole round.
At start it reads back the last ``WINDOW_MIN`` minutes (a Redis stream id is the entry's
time in ms), so the throughput figures are whole at once; those old events are counted,
and only those since the hub started are sent to browsers.

An id is a time only while nobody forges one: stream ids only increase, so after an
entry added by hand at a time in the future every entry the scripts add carries that
time too. An event read as it comes is counted no later than when it was read; one read
back at start with an id past ``SKEW_MS`` ahead cannot be dated and is not counted. The
queue's stream is then noted as damaged (``Throughput.damage``), and the overview says so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sandboxq.backends.base import Backend, Event
from sandboxq.errors import SandboxqError
from sandboxq.models import Outcome, now_ms

log = logging.getLogger("sandboxq.web")

CLIENT_BUFFER = 256  # messages queued for one browser before it is dropped
REPLAY = 1000  # recent messages kept for streams that start after the page was read
COALESCE_S = 1.0  # a queue-wide stream sends at most one message this often
WINDOW_MIN = 60  # minutes of throughput kept (the overview's chart shows them all)
POLL_S = 0.5  # pause between rounds over several queues when nothing happened
BLOCK_S = 1.0  # longest blocking read on a single queue's stream
EVENTS_READ = 1000  # most events of one queue read in one round of several queues
ROUND_S = 5.0  # re-read the list of queues at least this often
ERROR_PAUSE_S = 2.0  # after a failed read (Redis down), before trying again
#: How far ahead of this host's clock an entry's id may be and still date it: the Redis
#: server's clock may run a little ahead of the dashboard's, a forged id runs far ahead.
SKEW_MS = 5 * 60_000

#: The backend's state, told to every stream: unreadable, readable again.
OUTAGE, RECOVERED = "outage", "recovered"

#: Events that end an attempt, and the outcome they count under.
_ENDINGS = {"completed", "failed", "retried", "requeued", "cancelled", "stalled"}
#: What an attempt's end can be counted as.
_OUTCOMES = {o.value for o in Outcome} | _ENDINGS | {"lease_lost"}


def event_ms(event: Event) -> int | None:
    """When a Redis stream entry was added (its id is ``<ms>-<n>``); None for memory://."""
    head, dash, _ = event.id.partition("-")
    return int(head) if dash and head.isdigit() else None


def forged_ms(event: Event, now: int) -> int | None:
    """The time an entry's id claims when it is past ``SKEW_MS`` ahead of ``now`` (added
    by hand, or after an entry that was), else None."""
    at_ms = event_ms(event)
    return at_ms if at_ms is not None and at_ms > now + SKEW_MS else None


def outcome_of(event: Event) -> str | None:
    if event.kind not in _ENDINGS:
        return None
    if event.kind == "cancelled":
        return "cancelled"
    if event.kind == "stalled":
        # a stall that failed the job is counted by the "failed" event that follows it
        return None if event.data.get("state") == "failed" else "lease_lost"
    if event.kind == "retried" and event.data.get("manual"):
        return None  # a user's retry, not an attempt's end
    outcome = event.data.get("outcome") or event.kind
    # an outcome no attempt can have is a forged entry: 30 of a megabyte each made every
    # overview 92 MB for the hour the throughput keeps (each names a chart's series)
    return outcome if outcome in _OUTCOMES else "other"


class Throughput:
    """Attempts ended per minute and outcome, for the last ``WINDOW_MIN`` minutes."""

    def __init__(self) -> None:
        self._minutes: dict[str, dict[int, Counter[str]]] = {}
        self._damage: dict[str, str] = {}
        self._lock = threading.Lock()

    def damaged(self, queue: str, why: str) -> None:
        """Note why ``queue``'s figures cannot be whole (for as long as this process runs:
        its place in the stream stays past a forged entry)."""
        with self._lock:
            self._damage[queue] = why

    def damage(self, queue: str) -> str | None:
        """Why ``queue``'s figures are not whole, in one line; None when they are."""
        with self._lock:
            return self._damage.get(queue)

    def add(self, queue: str, outcome: str, at_ms: int) -> None:
        """Count an attempt that ended at ``at_ms``: never in the future (the minutes kept
        run back from the newest, so one far ahead would drop every real one)."""
        minute = min(at_ms, now_ms()) // 60_000
        with self._lock:
            minutes = self._minutes.setdefault(queue, {})
            if minute not in minutes:
                for old in [m for m in minutes if m <= minute - WINDOW_MIN]:
                    del minutes[old]
                minutes[minute] = Counter()
            minutes[minute][outcome] += 1

    def per_minute(self, queue: str, now_ms: int, minutes: int) -> list[Counter[str]]:
        """Outcomes per minute for the last ``minutes`` (this one last), oldest first."""
        last = now_ms // 60_000
        with self._lock:
            kept = self._minutes.get(queue, {})
            return [Counter(kept.get(m, {})) for m in range(last - minutes + 1, last + 1)]

    def recent(self, queue: str, now_ms: int, minutes: int) -> Counter[str]:
        """Outcomes of the attempts that ended in the last ``minutes`` (this one included)."""
        last = now_ms // 60_000
        first = last - minutes + 1
        total: Counter[str] = Counter()
        with self._lock:
            for minute, counter in self._minutes.get(queue, {}).items():
                if first <= minute <= last:
                    total.update(counter)
        return total


@dataclass(eq=False)
class Client:
    """One browser's stream: what it watches and its bounded queue of messages."""

    queue: str | None  # None: every queue
    job: str | None  # None: every job
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue[dict[str, Any] | None] = field(
        default_factory=lambda: asyncio.Queue(CLIENT_BUFFER)
    )
    dropped: bool = False

    @property
    def coalesce(self) -> bool:
        """A queue-wide stream: its page only needs to know that something changed."""
        return self.job is None

    def wants(self, message: dict[str, Any]) -> bool:
        return (self.queue is None or self.queue == message["queue"]) and (
            self.job is None or self.job == message["job"]
        )


class Hub:
    """The reader thread and its subscribers. Started by the first ``subscribe`` or
    ``start``; ``close`` stops it (idempotent)."""

    def __init__(self, queues: Callable[[], list[str]], backend: Callable[[str], Backend]) -> None:
        self._queues = queues
        self._backend = backend
        self.throughput = Throughput()
        self._clients: set[Client] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._after: dict[str, str | None] = {}
        self._seq = 0
        self._recent: deque[dict[str, Any]] = deque(maxlen=REPLAY)
        self._ending = False  # end_streams was called: a new stream ends at once
        self.outage: str | None = None  # why the last round failed (None: it did not)
        self.started_ms = now_ms()
        self.dropped = 0  # clients dropped for falling behind, since start

    # -- subscribers (on the event loop) --------------------------------------------------

    def position(self) -> int:
        """The number of the last message published: a page's ``since``."""
        with self._lock:
            return self._seq

    def subscribe(self, queue: str | None, job: str | None, since: int | None = None) -> Client:
        """A new stream for ``queue`` / ``job`` (None: all); with ``since``, the retained
        messages after it are queued first (or one ``reload`` when some are gone)."""
        self.start()
        client = Client(queue, job, asyncio.get_running_loop())
        with self._lock:
            self._clients.add(client)
            if self._ending:
                client.inbox.put_nowait(None)
                return client
            if self.outage is not None:
                client.inbox.put_nowait(_state(OUTAGE, self.outage))
            if since is None:
                return client
            oldest = self._recent[0]["seq"] if self._recent else self._seq + 1
            if since > self._seq or since < oldest - 1:
                missed = [{"seq": self._seq, "kind": "reload", "queue": queue, "job": job}]
            else:
                missed = [m for m in self._recent if m["seq"] > since and client.wants(m)]
        if len(missed) >= CLIENT_BUFFER:
            missed = [{"seq": missed[-1]["seq"], "kind": "reload", "queue": queue, "job": job}]
        elif client.coalesce:
            missed = missed[-1:]
        for message in missed:
            client.inbox.put_nowait(message)
        return client

    def unsubscribe(self, client: Client) -> None:
        with self._lock:
            self._clients.discard(client)

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._clients)

    def _deliver(self, clients: list[Client], message: dict[str, Any]) -> None:
        """On the clients' loop: queue ``message``, or drop a client that fell behind."""
        for client in clients:
            if client.dropped:
                continue
            if client.coalesce and not client.inbox.empty() and "seq" in message:
                continue  # a queue-wide stream already has a change to tell its page
            try:
                client.inbox.put_nowait(message)
            except asyncio.QueueFull:
                client.dropped = True
                self.dropped += 1
                while not client.inbox.empty():  # make room for the end-of-stream mark
                    client.inbox.get_nowait()
                client.inbox.put_nowait(None)
                self.unsubscribe(client)
                log.info("dropped a dashboard stream that fell %d events behind", CLIENT_BUFFER)

    def _publish(self, queue: str, event: Event) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[Client]] = {}
        with self._lock:
            self._seq += 1
            message = {"seq": self._seq, "queue": queue, "kind": event.kind, "job": event.job_id}
            message["data"] = event.data
            self._recent.append(message)
            for client in self._clients:
                if client.wants(message):
                    by_loop.setdefault(client.loop, []).append(client)
        for loop, clients in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, clients, message)
            except RuntimeError:  # that loop has closed: its clients are gone
                with self._lock:
                    self._clients.difference_update(clients)

    def _tell(self, error: SandboxqError | None) -> None:
        """Note the backend's state after a round; every stream is told when it changes."""
        with self._lock:
            if (self.outage is None) == (error is None):
                return
            self.outage = None if error is None else str(error)
            message = _state(RECOVERED if error is None else OUTAGE, self.outage)
            by_loop: dict[asyncio.AbstractEventLoop, list[Client]] = {}
            for client in self._clients:
                by_loop.setdefault(client.loop, []).append(client)
        for loop, clients in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, clients, message)
            except RuntimeError:  # that loop has closed: its clients are gone
                pass

    # -- the reader thread ----------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self.started_ms = now_ms()
            self._thread = threading.Thread(
                target=self._run, name="sandboxq-dashboard-events", daemon=True
            )
            self._thread.start()

    def end_streams(self) -> None:
        """End every stream (from any thread; not from a signal handler, which may have
        interrupted a holder of the lock): each gets its end mark on its own loop."""
        with self._lock:
            self._ending = True
            clients = list(self._clients)
        for client in clients:
            try:
                client.loop.call_soon_threadsafe(self._end, client)
            except RuntimeError:  # that loop has closed: its stream is gone
                pass

    @staticmethod
    def _end(client: Client) -> None:
        while not client.inbox.empty():  # make room for the end-of-stream mark
            client.inbox.get_nowait()
        client.inbox.put_nowait(None)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=BLOCK_S + 5)
        self.end_streams()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                queues = self._queues()
                news = self._round(queues)
                self._tell(None)
                if not news and len(queues) != 1:
                    self._stop.wait(POLL_S)
            except SandboxqError as exc:
                log.warning("dashboard events reader: %s", exc)
                self._tell(exc)
                self._stop.wait(ERROR_PAUSE_S)
            except Exception:
                log.exception("dashboard events reader failed; trying again")
                self._stop.wait(ERROR_PAUSE_S)

    def _round(self, queues: list[str]) -> bool:
        """Read each queue's new events; True if there were any. A queue that cannot be
        read (a key of the wrong type, changed by hand) is skipped: it costs only its own
        events. When none can be read (the server is down), the first error is raised."""
        if len(queues) == 1:
            return self._read(queues[0], BLOCK_S)
        news = False
        failed: dict[str, SandboxqError] = {}
        for queue in [q for q in queues if q not in self._after]:
            try:
                self._backfill(queue, self._backend(queue))
                news = True
            except SandboxqError as exc:
                failed[queue] = exc
        known = {q: self._after[q] for q in queues if q in self._after}
        # One read for every queue (Backend.new_events), through any queue's backend
        read = self._backend(queues[0]).new_events(known, EVENTS_READ) if known else {}
        for queue, got in read.items():
            if isinstance(got, SandboxqError):
                failed[queue] = got
                continue
            for event in got:
                self._take(queue, event)
            news |= bool(got)
        if failed and len(failed) == len(queues):
            raise next(iter(failed.values()))
        for queue, error in failed.items():
            log.warning("dashboard events reader, queue %s: %s", queue, error)
        return news

    def _read(self, queue: str, block_s: float) -> bool:
        """Read ``queue``'s new events, blocking up to ``block_s`` for the first; True if
        there were any."""
        backend = self._backend(queue)
        if queue not in self._after:
            self._backfill(queue, backend)
            return True
        news = False
        round_end = time.monotonic() + ROUND_S
        for event in backend.events(self._after[queue], block_s):
            news = True
            self._take(queue, event)
            if self._stop.is_set() or time.monotonic() > round_end:
                break
        return news

    def _take(self, queue: str, event: Event) -> None:
        """Count a new event and send it on. It ended no later than now, whatever its id
        says: read as it comes, an entry after a forged one is still counted when read."""
        self._after[queue] = event.id
        now = now_ms()
        if (forged := forged_ms(event, now)) is not None:
            self._damaged(queue, forged, undated=0)
        if (outcome := outcome_of(event)) is not None:
            self.throughput.add(queue, outcome, min(event_ms(event) or now, now))
        self._publish(queue, event)

    def _damaged(self, queue: str, forged: int, undated: int) -> None:
        """Note that ``queue``'s stream holds ids dated ``forged`` (ms, in the future);
        ``undated``: ended attempts read back at start that are not counted for it."""
        if undated == 0 and self.throughput.damage(queue) is not None:
            return  # already noted: what the backfill said still holds
        when = time.strftime("%Y-%m-%d", time.gmtime(min(forged // 1000, 253402300799)))
        why = (
            f"events stream sq:{{{queue}}}:events holds entries dated {when}, in the future "
            "(one added by hand, and every one after it): each is counted when read"
        )
        if undated:
            why += f"; {undated} ended attempts after it could not be dated and are not counted"
        # new entries are dated again once the key is gone; this reader's place in the
        # stream is past them until the dashboard restarts
        why += "; deleting that key and restarting the dashboard repairs it"
        log.warning("dashboard: %s", why)
        self.throughput.damaged(queue, why)

    def _backfill(self, queue: str, backend: Backend) -> None:
        """Count the retained events of the last WINDOW_MIN minutes; send on those that
        came after the hub started (a page read before may be waiting for them)."""
        now = now_ms()
        since_ms = now - WINDOW_MIN * 60_000
        after: str | None = None
        probe = next(iter(backend.events(None, None)), None)
        if probe is not None and event_ms(probe) is not None:
            after = f"{since_ms}-0"  # Redis: start at the window, not at the oldest entry
        last, forged, undated = after, None, 0
        for event in backend.events(after, None):
            last = event.id
            at_ms = event_ms(event)
            outcome = outcome_of(event)
            if (future := forged_ms(event, now)) is not None:
                # an id past any clock's skew: when this attempt ended is unknown
                forged, undated = future, undated + (outcome is not None)
                continue
            if at_ms is not None and at_ms >= since_ms and outcome:
                self.throughput.add(queue, outcome, at_ms)
            if at_ms is not None and at_ms >= self.started_ms:
                self._publish(queue, event)
        self._after[queue] = last
        if forged is not None:
            self._damaged(queue, forged, undated)


def _state(kind: str, error: str | None) -> dict[str, Any]:
    """A message about the backend (no ``seq``: never replayed, never coalesced away)."""
    return {"kind": kind, "queue": None, "job": None, "data": {"error": error}}
