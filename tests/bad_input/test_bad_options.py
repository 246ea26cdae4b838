"""Option values for ``Queue.options``, ``SandboxWorker`` and ``Pool``: whatever a value
is (negative, zero, huge, NaN, infinite, a bool, a string, a list), it is either refused
with a ``ConfigError`` naming the option, or accepted as exactly the number given; soft
must be below hard; unknown names are refused by name. Huge but valid timeouts really
work, through a real pool and a real worker.
"""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from annotated_types import Le
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxq import ConfigError, Pool, Queue
from sandboxq.models import MAX_SECONDS, JobOptions
from sandboxq.pool.containment import probe
from sandboxq.settings import MAX_MB, PoolSettings, WorkerSettings
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import StartWorker
from sandboxq.worker import SandboxWorker

from .support import SHARED_ACROSS_EXAMPLES, H

pytestmark = pytest.mark.timeout(120)

odd_numbers = (
    st.sampled_from(
        [0, -0.0, -1, 1e-300, 1e300, -1e300, 2**63, -(2**63), 1001, 255, 256, 7 * 24 * 3600 + 1]
    )
    | st.floats()
)  # NaN and both infinities included
odd_values = (
    odd_numbers
    | st.integers()
    | st.booleans()
    | st.sampled_from(["5", "1e3", "", "soon", b"5", [1], {"s": 1}, (2,), None, object()])
)

# numeric options and whether None is a valid value for each
JOB_OPTIONS = {
    "soft_timeout_s": True,
    "hard_timeout_s": True,
    "retries": True,
    "backoff_s": False,
    "priority": False,
    "delay_s": False,
    "max_memory_mb": True,
    "max_stalls": False,
}
WORKER_OPTIONS = {
    "concurrency": True,
    "lease_s": False,
    "renew_interval_s": True,
    "stall_check_s": True,
    "soft_timeout_s": True,
    "hard_timeout_s": True,
    "retries": False,
    "max_memory_mb": True,
    "max_jobs_per_child": True,
    "prefetch": True,
    "stop_timeout_s": False,
}
POOL_OPTIONS = [
    "size",
    "soft_timeout_s",
    "hard_timeout_s",
    "max_memory_mb",
    "max_jobs_per_child",
    "max_result_bytes",
    "memory_check_interval_s",
]


def assert_sane(name: str, given_value: Any, stored: Any, none_ok: bool) -> None:
    """What an accepted value must look like: the number given, finite, not a bool."""
    if given_value is None:
        assert none_ok, f"{name} accepted None"
        if name == "concurrency":  # None: one child per CPU
            assert isinstance(stored, int) and stored >= 1
        else:
            assert stored is None, (name, stored)
        return
    assert type(given_value) in (int, float), f"{name} accepted {given_value!r}"
    assert math.isfinite(given_value), f"{name} accepted {given_value!r}"
    # A float setting keeps the float nearest the number given (2**53 + 1 becomes 2**53).
    assert stored == (float(given_value) if isinstance(stored, float) else given_value), (
        name,
        given_value,
        stored,
    )
    if name.endswith("_s") and name not in ("delay_s", "backoff_s", "stop_timeout_s"):
        assert given_value > 0, f"{name} accepted {given_value!r}"


@settings(SHARED_ACROSS_EXAMPLES, max_examples=150)
@given(name=st.sampled_from(sorted(JOB_OPTIONS)), value=odd_values)
def test_a_job_option_is_the_number_given_or_an_error_naming_it(
    queue: Queue, name: str, value: Any
) -> None:
    try:
        view = queue.options(**{name: value})
    except ConfigError as exc:
        assert f"invalid JobOptions: {name}: " in str(exc), str(exc)
        return
    stored = getattr(view.enqueue().info().options, name)  # as the backend keeps it
    assert_sane(name, value, stored, JOB_OPTIONS[name])


@settings(SHARED_ACROSS_EXAMPLES, max_examples=150)
@given(name=st.sampled_from(sorted(WORKER_OPTIONS)), value=odd_values)
def test_a_worker_setting_is_the_number_given_or_an_error_naming_it(
    url: str, queue_name: str, name: str, value: Any
) -> None:
    try:
        worker = SandboxWorker(queue_name, H + "echo", url=url, **{name: value})
    except ConfigError as exc:
        assert f"invalid WorkerSettings: {name}: " in str(exc) or name in str(exc), str(exc)
        return
    worker.backend.close()  # never run: only the settings are looked at
    assert_sane(name, value, getattr(worker.settings, name), WORKER_OPTIONS[name])


never_valid = st.sampled_from(
    [True, False, "5", "", b"1", [1], {"a": 1}, float("nan"), float("inf"), float("-inf"), -1, 0]
)


@settings(deadline=None, max_examples=60)
@given(name=st.sampled_from(POOL_OPTIONS), value=never_valid)
def test_a_bad_pool_setting_is_refused_by_name_before_any_child_starts(
    name: str, value: Any
) -> None:
    with pytest.raises(ConfigError) as refused:
        Pool(H + "echo", **{"size": 1, name: value})
    assert f"invalid PoolSettings: {name}: " in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"hard_timeout_s": True}, "hard_timeout_s: Value error, expected a number, got bool"),
        ({"soft_timeout_s": "5"}, "soft_timeout_s: Value error, expected a number, got str '5'"),
        ({"retries": True}, "retries: Value error, expected a number, got bool"),
        ({"priority": False}, "priority: Value error, expected a number, got bool"),
        ({"hard_timeout_s": float("nan")}, "hard_timeout_s: Value error, hard_timeout_s must be"),
        ({"soft_timeout_s": float("inf")}, "soft_timeout_s: Value error, soft_timeout_s must be"),
        ({"hard_timeout_s": -1}, "positive, finite number of seconds, got -1"),
        ({"hard_timeout_s": 0}, "positive, finite number of seconds, got 0"),
        ({"delay_s": float("inf")}, "delay_s: Input should be a finite number"),
        ({"priority": 1001}, "priority: Input should be less than or equal to 1000"),
        ({"retries": 1.5}, "retries: Input should be a valid integer"),
        ({"max_memory_mb": [64]}, "max_memory_mb: Input should be a valid number"),
        ({"hard_timeout_s": timedelta(seconds=-3)}, "got -3.0"),
        # the bounds every setting has (README "Settings"), a job's own too
        ({"hard_timeout_s": 1e300}, "hard_timeout_s must be at most 315360000 seconds, got"),
        ({"soft_timeout_s": 3.2e8}, "soft_timeout_s must be at most 315360000 seconds"),
        ({"max_queue_s": 1e300}, "max_queue_s must be at most 315360000 seconds"),
        ({"deadline_s": 1e300}, "deadline_s must be at most 315360000 seconds"),
        ({"progress_timeout_s": 1e300}, "progress_timeout_s must be at most 315360000 seconds"),
        ({"max_memory_mb": 1e300}, "max_memory_mb must be at most 1073741824 MB, got"),
        ({"max_memory_mb": 0}, "max_memory_mb must be a positive, finite number of MB, got 0"),
    ],
)
def test_job_options_say_what_is_wrong(queue: Queue, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as refused:
        queue.options(**kwargs)
    assert needle in str(refused.value)


def test_a_timedelta_is_accepted_wherever_seconds_are(queue: Queue) -> None:
    view = queue.options(soft_timeout_s=timedelta(seconds=2), hard_timeout_s=timedelta(minutes=1))
    options = view.enqueue().info().options
    assert (options.soft_timeout_s, options.hard_timeout_s) == (2.0, 60.0)


# -- soft must be below hard, wherever the two meet ----------------------------------------

positive = st.floats(min_value=1e-6, max_value=MAX_SECONDS, allow_nan=False, allow_infinity=False)


@SHARED_ACROSS_EXAMPLES
@given(soft=positive, hard=positive, split=st.booleans())
def test_soft_at_or_above_hard_is_refused_everywhere(
    queue: Queue, queue_name: str, url: str, soft: float, hard: float, split: bool
) -> None:
    """Set together or one view at a time, on a queue or a worker: soft >= hard is an
    error that gives both values; soft < hard is accepted as given."""
    refused = soft >= hard

    def set_both() -> JobOptions:
        if split:
            view = queue.options(soft_timeout_s=soft).options(hard_timeout_s=hard)
        else:
            view = queue.options(soft_timeout_s=soft, hard_timeout_s=hard)
        return view.enqueue().info().options

    if refused:
        with pytest.raises(ConfigError, match="must be less than hard_timeout_s") as exc:
            set_both()
        assert f"soft_timeout_s ({soft})" in str(exc.value)
        with pytest.raises(ConfigError, match="must be less than hard_timeout_s"):
            SandboxWorker(queue_name, H + "echo", url=url, soft_timeout_s=soft, hard_timeout_s=hard)
        with pytest.raises(ConfigError, match="must be less than hard_timeout_s"):
            Pool(H + "echo", 1, soft_timeout_s=soft, hard_timeout_s=hard)
    else:
        options = set_both()
        assert (options.soft_timeout_s, options.hard_timeout_s) == (soft, hard)


# -- unknown names ---------------------------------------------------------------------------

_KNOWN = {
    *JobOptions.model_fields,
    *inspect.signature(SandboxWorker).parameters,
    *inspect.signature(Pool).parameters,
}
option_names = st.text(min_size=1, max_size=20).filter(lambda n: n not in _KNOWN)


@SHARED_ACROSS_EXAMPLES
@given(name=option_names)
def test_an_unknown_option_name_is_refused_by_name(
    queue: Queue, queue_name: str, url: str, name: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        queue.options(**{name: 1})
    assert f"{name}: Extra inputs are not permitted" in str(refused.value)
    named = re.escape(f"unexpected keyword argument '{name}'")  # Python quotes it as is
    with pytest.raises(TypeError, match=named):
        SandboxWorker(queue_name, H + "echo", url=url, **{name: 1})
    with pytest.raises(TypeError, match=named):
        Pool(H + "echo", 1, **{name: 1})


# -- odd but valid values, and the settings that only looked valid ---------------------------


@pytest.mark.timeout(60)
def test_a_thirty_day_hard_timeout_runs_jobs_instead_of_breaking_the_pool() -> None:
    """Regression: the supervisor waited for the nearest deadline in one select(), and
    epoll cannot wait longer than 2**31 ms (about 25 days): the pool crashed."""
    month = 30 * 24 * 3600.0
    with Pool(H + "echo", 1, soft_timeout_s=month - 1, hard_timeout_s=month) as pool:
        assert pool.submit(41).result(timeout=30) == 41
        assert pool.submit({"still": "serving"}).result(timeout=30) == {"still": "serving"}


@pytest.mark.timeout(60)
def test_huge_job_timeouts_run_through_a_worker(queue: Queue, start_worker: StartWorker) -> None:
    """The largest durations a worker takes work too, its stop (at teardown) included."""
    most = {"hard_timeout_s": MAX_SECONDS, "stop_timeout_s": MAX_SECONDS}
    worker = start_worker("echo", **most, deadline_s=MAX_SECONDS, max_queue_s=MAX_SECONDS)
    job = queue.options(soft_timeout_s=MAX_SECONDS / 2, hard_timeout_s=MAX_SECONDS).enqueue("big")
    assert job.result(timeout_s=30) == "big"
    assert queue.enqueue("next").result(timeout_s=30) == "next"
    # the worker counts an ack once its finish call returns, just after the result shows
    wait_for(lambda: worker.stats["completed"] == 2, 10, "the worker to count both")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"concurrency": 0}, "concurrency: Input should be greater than or equal to 1 (got 0)"),
        ({"concurrency": True}, "concurrency: Value error, expected a number, got bool"),
        ({"stall_check_s": 1e300}, "stall_check_s: Input should be less than or equal to 86400"),
        ({"stall_check_s": 1e-9}, "stall_check_s: Input should be greater than or equal to 0.01"),
        ({"renew_interval_s": 1e-9}, "renew_interval_s: Input should be greater than or equal"),
        ({"exit_codes": {-1: "fail"}}, "exit_codes.-1.[key]: Input should be greater than or"),
        ({"exit_codes": {256: "retry"}}, "exit_codes.256.[key]: Input should be less than or"),
        ({"exit_codes": {True: "fail"}}, "expected a number, got bool"),
        ({"exit_codes": {3: "explode"}}, "exit_codes.3: Input should be 'complete'"),
        ({"allow_pickle": 1}, "allow_pickle: Input should be a valid boolean"),
        ({"allow_pickle": "yes"}, "allow_pickle: Input should be a valid boolean"),
        ({"start_method": "fork"}, "start_method: Input should be 'forkserver' or 'spawn'"),
        (  # a check of two settings together: named by them, not by the model again
            {"soft_timeout_s": 5, "hard_timeout_s": 5},
            "invalid WorkerSettings: Value error, soft_timeout_s (5.0) must be less than",
        ),
    ],
)
def test_worker_settings_that_only_looked_valid_are_refused(
    url: str, queue_name: str, kwargs: dict[str, Any], needle: str
) -> None:
    """Each of these was accepted once: concurrency 0 quietly meant "one per CPU", an
    enormous stall_check_s crashed the reaper thread (Event.wait overflows), exit code 256
    can never happen, and allow_pickle=1 opened the door to pickle."""
    with pytest.raises(ConfigError) as refused:
        SandboxWorker(queue_name, H + "echo", url=url, **kwargs)
    assert needle in str(refused.value)


def _upper_bound(model: type[WorkerSettings | PoolSettings], name: str) -> float | None:
    return min((b.le for b in model.model_fields[name].metadata if isinstance(b, Le)), default=None)


#: Every setting in seconds or in MB, of the pool and of the worker.
SIZED = sorted(
    {
        (m, n)
        for m in (PoolSettings, WorkerSettings)
        for n in m.model_fields
        if n.endswith(("_s", "_mb"))
    },
    key=lambda pair: (pair[0].__name__, pair[1]),
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("model", "name"), SIZED, ids=[f"{m.__name__}.{n}" for m, n in SIZED])
def test_every_setting_in_seconds_or_mb_is_bounded_by_the_one_bound_of_its_unit(
    url: str, queue_name: str, model: type[WorkerSettings | PoolSettings], name: str
) -> None:
    """Regression: stop_timeout_s=1e10 was accepted, and the worker's stop crashed (a
    thread's wait overflowed); max_file_size_mb=1e13 made every child's setrlimit fail
    (a C long overflowed), so the pool could run nothing; pool_memory_mb=1e30 failed the
    pool's start with a raw OSError. A setting may be bounded closer than its unit's
    bound, never further."""
    most = MAX_SECONDS if name.endswith("_s") else MAX_MB
    bound = _upper_bound(model, name)
    assert bound is not None and bound <= most, (name, bound)
    with pytest.raises(ConfigError) as refused:
        if model is PoolSettings:
            Pool(H + "echo", 1, **{name: most * 10})
        else:
            SandboxWorker(queue_name, H + "echo", url=url, **{name: most * 10})
    assert f"invalid {model.__name__}: {name}: Input should be less than or equal to" in str(
        refused.value
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"group": 10**30}, "invalid PoolSettings: group: Value error, a number must be at most"),
        ({"user": str(2**32)}, "invalid PoolSettings: user: Value error, a number must be at most"),
        ({"user": "\u00b2"}, "user='\u00b2': no such user on this machine"),
    ],
)
def test_a_user_or_group_no_account_can_have_is_refused_by_name(
    kwargs: dict[str, Any], needle: str
) -> None:
    """Regression: a gid past 32 bits raised OverflowError from the group lookup, and a
    digit that is no decimal digit (a superscript two) a ValueError from int()."""
    with pytest.raises(ConfigError) as refused:
        Pool(H + "echo", 1, **kwargs)
    assert needle in str(refused.value)


#: A pool that fails to start once its control groups are made: under a one-byte file size
#: limit the kernel refuses to size the fence guard's table (EFBIG). It prints the error,
#: then the groups its process still has (a pool's group is named after its owner's pid).
FAILED_START = f"""
import os, resource, signal
from pathlib import Path
from sandboxq import Pool
from sandboxq.pool.containment import _below, _mounts, _own_paths
from {H.rstrip(":")} import echo  # imported before the limit, which would refuse its .pyc
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    Pool({H + "echo"!r}, 1, containment="cgroup")
except OSError as exc:
    print("refused:", exc)
own = _own_paths("/proc/self/cgroup")
for root, point, fs, options in _mounts("/proc/self/mountinfo"):
    for controller, path in own.items():
        if (fs == "cgroup2") == (controller == "") and (not controller or controller in options):
            for group in Path(_below(root, point, path)).glob(f"sandboxq.{{os.getpid()}}.*"):
                print("left:", group)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(probe()[0] == "process_tree", reason="no writable control groups here")
def test_a_pool_whose_start_fails_after_its_groups_are_made_removes_them() -> None:
    """Regression: pool_memory_mb=1e30 failed the pool's start with an OSError once its
    control groups were made, and they stayed until another pool started."""
    done = subprocess.run(
        [sys.executable, "-c", FAILED_START], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    assert "refused: [Errno 27] File too large" in done.stdout, done.stdout
    assert "left:" not in done.stdout, done.stdout


@pytest.mark.parametrize("timeout_s", [float("nan"), "5", True, [1]])
def test_result_refuses_a_timeout_that_is_not_a_number(queue: Queue, timeout_s: Any) -> None:
    """Regression: ``result(timeout_s=nan)`` waited forever (NaN is never <= 0)."""
    job = queue.enqueue()
    started = time.monotonic()
    with pytest.raises(ConfigError, match="timeout_s must be a number of seconds or None"):
        job.result(timeout_s=timeout_s)
    assert time.monotonic() - started < 5


def test_result_with_a_negative_timeout_does_not_wait(queue: Queue) -> None:
    job = queue.enqueue()
    with pytest.raises(TimeoutError, match="did not finish within -1 s"):
        job.result(timeout_s=-1)


@pytest.mark.parametrize(
    ("since", "block_s", "needle"),
    [
        ("garbage", None, "since must be an event id"),
        ("-1", None, "since must be an event id"),
        (5, None, "since must be an event id such as '12' or '1700000000000-0', got 5"),
        (None, float("nan"), "block_s must be a number of seconds or None, got nan"),
        (None, "1", "block_s must be a number of seconds or None, got '1'"),
    ],
)
def test_events_refuse_an_id_or_a_wait_they_cannot_use(
    queue: Queue, since: Any, block_s: Any, needle: str
) -> None:
    """Before: a ValueError from int() on memory://, a BackendError ("invalid stream ID")
    on Redis, a TypeError for a string wait."""
    queue.enqueue()
    with pytest.raises(ConfigError) as refused:
        list(queue.events(since, block_s))
    assert needle in str(refused.value)
    [added] = list(queue.events())
    assert list(queue.events(since=added.id)) == []  # a real id still works
