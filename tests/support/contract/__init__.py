"""The backend contract: one suite every ``Backend`` must pass, checking each promise the
docstrings of ``sandboxq.backends.base`` make.

Use it from a pytest module by subclassing ``BackendContract`` and providing two fixtures:
``make_backend``, a factory ``make_backend(**options) -> Backend`` that returns a backend
for a fresh queue no other test uses (``options`` are the backend's retention keywords:
``retain_completed``, ``retain_failed``, ``retain_s``) and closes what it made at teardown;
and ``backend``, which is ``make_backend()``::

    @pytest.fixture
    def backend(make_backend):
        return make_backend()

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def make_backend(self, queue_name): ...

The suite is a package, one module per concern (each a mixin ``BackendContract`` combines):

    support    the lease the tests claim with, the waits they allow, helpers
    leases     enqueue, claim, finish, retry, release; ownership (design invariant 1)
    recovery   renewal, stalled recovery, cancellation and its fence, a lost reply
    waiting    waking claims, wait_for_finish, events
    admin      counts, listing, manual retry, purge, retention, workers
    pages      the dashboard's reads
    order      the orders and boundaries both backends share (ties, ready times, limits)
    batches    batch counters, the finished stream, the follow-up, retention of members
    budgets    deadline_s and max_queue_s at claim (outcomes deadline, expired), a job's age

Everything runs on real time: short leases, real sleeps and real waits across threads, no
mocked clock and no stand-in for the backend, so a backend that computes expiry wrongly or
misses a wake-up fails here. Every test takes well under three seconds. Importing this
module does not import pytest.
"""

from __future__ import annotations

from tests.support.contract import support
from tests.support.contract.admin import AdminContract
from tests.support.contract.batches import BatchContract
from tests.support.contract.budgets import BudgetContract
from tests.support.contract.leases import LeaseContract
from tests.support.contract.order import OrderContract
from tests.support.contract.pages import PageContract
from tests.support.contract.recovery import RecoveryContract
from tests.support.contract.support import *  # noqa: F403  (the helpers, for test modules)
from tests.support.contract.waiting import WaitingContract

__all__ = ["BackendContract", *support.__all__]


class BackendContract(
    LeaseContract,
    RecoveryContract,
    WaitingContract,
    AdminContract,
    PageContract,
    OrderContract,
    BatchContract,
    BudgetContract,
):
    """The tests; subclass it and provide the ``make_backend`` and ``backend`` fixtures."""
