"""Helpers shared by the bad-input tests (fixtures live in conftest.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

H = "sandboxq.testing.handlers:"

#: Hypothesis runs many examples per test, but workers and pools are slow to start, so a
#: test builds them once (in fixtures) and shares them across its examples. That is
#: deliberate, hence the ``function_scoped_fixture`` health check is off where this is used.
SHARED_ACROSS_EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
