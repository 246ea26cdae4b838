"""The fetcher's wait for a free slot (``InFlight.wait_for_room``): woken when a slot frees,
by a discard or an unreserve, and left asleep by the ones that free none (a finish that
refilled the slots it freed)."""

from __future__ import annotations

import threading

import pytest

from sandboxq.backends.base import Claimed
from sandboxq.models import JobOptions
from sandboxq.worker.heartbeat import Lease
from sandboxq.worker.inflight import Held, InFlight

pytestmark = pytest.mark.timeout(15)


def held(token: str) -> Held:
    job = Claimed(token, token, b"[[],{}]", "json", JobOptions(), attempt=1, claimed_at=0.0)
    return Held(job, Lease(token, token, 0, 0.0))


def full(stopping: threading.Event) -> InFlight:
    """Two slots (one child, prefetch one), both held."""
    inflight = InFlight(children=1, prefetch=1, stopping=stopping)
    assert inflight.reserve() == 2
    inflight.add(held("a"))
    inflight.add(held("b"))
    return inflight


def waiter(inflight: InFlight) -> tuple[threading.Thread, threading.Event]:
    """A fetcher in ``wait_for_room``; the event is set once it returned."""
    returned = threading.Event()

    def wait() -> None:
        inflight.wait_for_room()
        returned.set()

    thread = threading.Thread(target=wait, name="fetcher", daemon=True)
    thread.start()
    return thread, returned


def test_a_discard_that_frees_a_slot_wakes_the_fetcher() -> None:
    inflight = full(threading.Event())
    thread, returned = waiter(inflight)
    inflight.discard(["a"])
    assert returned.wait(5)
    thread.join(5)


def test_an_unreserve_that_frees_a_slot_wakes_the_fetcher() -> None:
    inflight = full(threading.Event())
    inflight.discard(["a"])  # a free slot: now taken by a finish's refill reservation
    assert inflight.reserve() == 1
    thread, returned = waiter(inflight)
    inflight.unreserve(1)  # the refill claimed nothing
    assert returned.wait(5)
    thread.join(5)


def test_a_finish_that_refills_its_slots_wakes_nobody() -> None:
    inflight = full(threading.Event())
    wakes: list[int] = []  # wake-ups sent, with the jobs held then
    notify_all = inflight._cond.notify_all

    def counted() -> None:
        wakes.append(len(inflight._held))
        notify_all()

    inflight._cond.notify_all = counted  # type: ignore[method-assign]
    # A finish of "a": its slot reserved for the refill, acked, refilled by "c".
    assert inflight.reserve(finishing=1) == 1
    inflight.discard(["a"])
    inflight.add(held("c"))
    inflight.unreserve(0)
    assert len(inflight) == 2 and wakes == []  # never any room: a wake-up would be wasted
    inflight.discard(["b"])  # a slot does free now
    assert wakes == [1]
