"""Whole workers die or freeze mid-run: SIGKILL of a parent (restarted later), SIGSTOP of
a parent and its children for longer than the lease, then SIGCONT; SIGSTOP of the
parent alone, and of its process group (Ctrl-Z)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from harness import Scene, alive, assert_cut_off, assert_within_leases, lease_ends, unfinished

from sandboxq.testing.waiting import wait_for
from tests.support.ledger import read_ledger

pytestmark = pytest.mark.timeout(180)

LEASE_S = 1.5


def test_sigkill_of_worker_parents_kills_their_children_and_loses_nothing(scene: Scene) -> None:
    """Two of three workers are SIGKILLed mid-run, one after the other, and replaced two
    seconds later. Each killed worker's whole family (fork server, children) dies within
    about a second; its jobs are recovered once their leases expire and complete exactly
    once; nothing runs twice at the same time."""
    fleet = scene.fleet("--concurrency", "2", "--lease-s", str(LEASE_S))
    fleet.start(3, children=2)
    producer = scene.producer(200, batch=20, seconds=lambda rng: rng.uniform(0.1, 0.4))
    held: list[str] = []
    death_s: list[float] = []
    for victim in fleet.workers[:2]:
        family = victim.family()
        held += wait_for(
            lambda f=family: unfinished(scene.ledger, set(f)), 20, f"{victim.name} to run a job"
        )
        victim.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.proc.wait(10)
        wait_for(lambda f=family: not any(alive(p) for p in f), 10, "the family to die")
        death_s.append(time.monotonic() - killed_at)
        time.sleep(2.0)  # the subject: the fleet runs a worker short for more than a lease
        fleet.wait_ready(fleet.spawn(), 2)
    result = scene.finish(producer)
    print(f"\nfamilies dead {[f'{s:.2f}' for s in death_s]} s after the kill; {result.line()}")
    assert len(producer.accepted) == 200 and not result.failed
    assert all(s < 2.0 for s in death_s), death_s
    # The killed workers held running jobs; each came back through stalled recovery.
    assert held, "the killed workers were running nothing: the test proved nothing"
    assert result.stalls >= len(set(held)) and scene.tally.total("stalled") == result.stalls
    assert not fleet.errors()


def test_a_worker_frozen_past_its_lease_is_fenced_when_it_thaws(scene: Scene) -> None:
    """One of three workers is SIGSTOPped (parent and children) for twice its lease while
    jobs flow. The others recover and finish its jobs. When it thaws (SIGCONT, parent
    first), it kills its frozen children before they run on, acks none of their jobs, and
    goes back to work."""
    fleet = scene.fleet("--concurrency", "2", "--lease-s", str(LEASE_S))
    frozen = fleet.start(3, children=2)[0]
    producer = scene.producer(100, batch=10, seconds=lambda rng: rng.uniform(0.2, 0.6))
    wait_for(lambda: unfinished(scene.ledger, set(frozen.family())), 20, "the worker to run a job")
    family = frozen.signal_family(signal.SIGSTOP)
    stopped_at = time.time()
    time.sleep(2 * LEASE_S)  # the subject: frozen for longer than the lease
    held = unfinished(scene.ledger, set(family))
    # Someone else has taken over (and maybe finished) the frozen worker's jobs.
    wait_for(
        lambda: all(
            any(e.pid not in family for e in read_ledger(scene.ledger).get(key, [])) for key in held
        ),
        20,
        "the other workers to take over the frozen jobs",
    )
    frozen.proc.send_signal(signal.SIGCONT)
    # The parent fences first (SIGKILL reaches a stopped child); then the rest may wake.
    wait_for(lambda: not any(alive(p) for p in held.values()), 5, "the parent to fence")
    for pid in family:  # the pool's guard first (frozen_order), the parent already
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    thawed_at = time.time()
    wait_for(lambda: not any(alive(p) for p in held.values()), 5, "frozen children to die")
    result = scene.finish(producer)
    print(f"\n{len(held)} jobs frozen mid-run; {result.line()}")
    assert held, "the frozen worker was running nothing: the test proved nothing"
    runs = read_ledger(scene.ledger)
    for key, pid in held.items():
        (frozen_run,) = [e for e in runs[key] if e.pid == pid]
        # Its last sign of life is from before the freeze: it never ran on after thawing.
        assert frozen_run.last < stopped_at and not frozen_run.finished, frozen_run
    # The thawed worker is alive and working again, with fresh children.
    assert frozen.proc.poll() is None, fleet.tail(frozen)
    newer = {p.pid for p in frozen.children()}
    assert any(e.started > thawed_at and e.pid in newer for r in runs.values() for e in r)
    assert not result.failed and not fleet.errors()


@pytest.mark.parametrize("group", [True, False], ids=["its-group", "the-parent-alone"])
def test_a_worker_parent_stopped_alone_cannot_let_its_children_outlive_their_leases(
    scene: Scene, group: bool
) -> None:
    """Ctrl-Z on a worker in a terminal stops its process group: the parent and its fork
    server, but not its children, which run in sessions of their own (one killpg takes a
    child's whole tree); ``kill -STOP`` of the parent stops it alone. The stopped parent
    can neither renew nor fence; the pool's guard must stop the children with it and kill
    them before their leases can expire, or another worker would run their jobs at the
    same time. When the parent resumes, the worker goes back to work."""
    fleet = scene.fleet("--concurrency", "2", "--lease-s", str(LEASE_S))
    stopped, _other = fleet.start(2, children=2)
    producer = scene.producer(8, batch=8, seconds=lambda rng: rng.uniform(2.0, 3.0))
    wait_for(
        lambda: len(unfinished(scene.ledger, set(stopped.family()))) == 2,
        20,
        "both children of the worker to be running jobs",
    )
    family = set(stopped.family())
    signal_it = os.killpg if group else os.kill
    signal_it(stopped.pid, signal.SIGSTOP)
    stopped_at = time.time()
    held = unfinished(scene.ledger, family)
    # Those with more than a lease left (every job takes 2 s at least) are the guard's to
    # kill; one that ends on its own first is not (the stop may come late on a busy
    # machine), and is held to its lease like the others.
    fenced = unfinished(scene.ledger, family, stopped_at - (2.0 - LEASE_S))
    ends = lease_ends(scene, held)  # the stopped parent renews nothing from now on
    try:
        time.sleep(2 * LEASE_S)  # the subject: the parent stays stopped past the lease
        # The guard fenced the children while their parent could not.
        assert not any(alive(pid) for pid in fenced.values()), fenced
    finally:
        signal_it(stopped.pid, signal.SIGCONT)
    resumed_at = time.time()
    result = scene.finish(producer)
    print(f"\n{len(held)} jobs running when the parent stopped; {result.line()}")
    assert fenced, "no job had a lease left to outlive when the parent stopped"
    runs = read_ledger(scene.ledger)
    assert_within_leases(runs, held, ends)
    assert_cut_off(scene, runs, fenced, stopped_at, LEASE_S)
    assert stopped.proc.poll() is None, fleet.tail(stopped)
    newer = {p.pid for p in stopped.children()}
    assert any(e.started > resumed_at and e.pid in newer for r in runs.values() for e in r)
    assert not result.failed and not fleet.errors()
