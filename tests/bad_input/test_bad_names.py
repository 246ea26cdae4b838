"""Queue names and job ids, on both backends: any name is either a working queue or a
``ConfigError`` that names it; any job id a user may choose (unicode, ``{``, ``}``, ``:``,
512 characters) names exactly one job, whatever other ids exist; a bad id is refused
with an error naming ``job_id``. On Redis every key of a queue stays in one Cluster slot.
"""

from __future__ import annotations

import re
import uuid

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from sandboxq import ConfigError, Queue, SandboxqError
from sandboxq.models import JobState
from sandboxq.testing.workers import StartWorker

from .support import SHARED_ACROSS_EXAMPLES

pytestmark = pytest.mark.timeout(120)

_VALID_QUEUE = re.compile(r"[A-Za-z0-9_.:\-]{1,200}")

# Text that leans towards what breaks key layouts: braces, colons, the history suffix.
tricky_text = st.text(
    alphabet=st.sampled_from("{}:ab\u00e9\u4e2d\U0001f600 \x00/*\\") | st.characters(codec="utf-8"),
    min_size=1,
    max_size=40,
) | st.sampled_from(["x:attempts", ":attempts", "x:history", "{x}", "}{", ":", "job:x"])


@SHARED_ACROSS_EXAMPLES
@given(name=tricky_text | st.text(max_size=210) | st.text(alphabet="ab:.-_", max_size=210))
def test_a_queue_name_is_a_working_queue_or_an_error_naming_it(url: str, name: str) -> None:
    if not _VALID_QUEUE.fullmatch(name):
        with pytest.raises(ConfigError) as refused:
            Queue(name, url=url)
        assert f"queue name {name!r} is invalid" in str(refused.value)
        return
    name = f"{name[:150]}-{uuid.uuid4().hex[:8]}"  # a fresh queue: examples never meet
    with Queue(name, url=url) as q:
        job = q.enqueue("payload")
        assert q.counts()[JobState.WAITING] == 1
        assert job.info().queue == name


@pytest.mark.parametrize(
    "name", ["", "a" * 201, "caf\u00e9", "a{b", "a}b", "{a}", "a b", "a\nb", "a/b", None, 7, b"q"]
)
def test_queue_names_that_cannot_be_keys_are_refused(url: str, name: object) -> None:
    with pytest.raises(ConfigError, match=r"queue name .* is invalid"):
        Queue(name, url=url)  # type: ignore[arg-type]


# -- job ids ---------------------------------------------------------------------------------

job_ids = (
    tricky_text
    | st.text(st.characters(codec="utf-8"), min_size=1, max_size=512)
    | st.text(alphabet="x:{}", min_size=500, max_size=512)
)


@pytest.fixture
def seen() -> set[str]:
    """The ids one test function enqueued so far (hypothesis may draw an id twice)."""
    return set()


@settings(SHARED_ACROSS_EXAMPLES, max_examples=60)
@given(job_id=job_ids)
def test_any_user_chosen_job_id_names_exactly_one_job(
    queue: Queue, seen: set[str], job_id: str
) -> None:
    """The id itself, and ids that extend it the way Redis keys are built (``<id>:attempts``,
    ``<id>:history``...), are each their own job, created once."""
    family = [job_id, f"{job_id}:attempts", f"{job_id}:history", f"history:{job_id}"]
    family = [i for i in family if len(i) <= 512]
    for n, member in enumerate(family):
        job = queue.options(job_id=member).enqueue(n)
        assert job.id == member
        info = job.info()
        assert info.id == member and info.state is JobState.WAITING
        if member not in seen:
            assert info.history == []
        seen.add(member)
    # enqueueing an existing id again returns that job; nothing new is added
    waiting = queue.counts()[JobState.WAITING]
    assert queue.options(job_id=job_id).enqueue("again").id == job_id
    assert queue.counts()[JobState.WAITING] == waiting == len(seen)


def test_every_key_stays_in_the_queue_slot_whatever_the_job_ids(
    redis_url: str, queue_name: str, raw: redis.Redis
) -> None:
    with Queue(queue_name, url=redis_url) as q:
        for job_id in ["{other}", "}{", "a:{b}:c", "\u4e2d{\u00e9}", "x:attempts", "x"]:
            q.options(job_id=job_id).enqueue(job_id)
        slots = {key_slot(k) for k in raw.scan_iter(match=f"sq:{{{queue_name}}}:*")}
        assert slots == {key_slot(f"sq:{{{queue_name}}}:waiting".encode())}


@pytest.mark.parametrize(
    ("job_id", "needle"),
    [
        ("", "job_id: String should have at least 1 character"),
        ("x" * 513, "job_id: String should have at most 512 characters"),
        ("bad \ud800 id", "job_id: Input should be a valid string"),
        (7, "job_id: Input should be a valid string"),
        (None, None),  # None means "let the backend choose": allowed
    ],
)
def test_job_ids_that_cannot_name_a_job_are_refused(
    queue: Queue, job_id: object, needle: str | None
) -> None:
    if needle is None:
        assert queue.options(job_id=job_id).enqueue().id
        return
    with pytest.raises(ConfigError) as refused:
        queue.options(job_id=job_id)
    assert needle in str(refused.value)


@pytest.mark.parametrize("job_id", ["", "bad \ud800 id", "x" * 513, 7])
def test_a_job_handle_for_an_impossible_id_is_refused(queue: Queue, job_id: object) -> None:
    with pytest.raises(ConfigError, match=r"job id .* is invalid"):
        queue.job(job_id)  # type: ignore[arg-type]


def test_a_job_that_does_not_exist_says_so(queue: Queue) -> None:
    with pytest.raises(SandboxqError, match=r"job 'x:attempts' of queue .* does not exist"):
        queue.job("x:attempts").info()


# -- ids that extend each other, through a real worker --------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["x", "x:attempts"])
def test_jobs_x_and_x_attempts_both_run_with_their_own_history(
    queue: Queue, start_worker: StartWorker, first: str
) -> None:
    """Regression: on Redis the history list of job ``x`` was the key
    ``sq:{q}:job:x:attempts``, the very hash of job ``x:attempts``. Whichever came second
    was either taken for an existing job (and read as a list: WRONGTYPE), or broke the
    other's finish half-way."""
    start_worker("echo")
    second = "x:attempts" if first == "x" else "x"
    a = queue.options(job_id=first).enqueue(first)
    assert a.result(timeout_s=30) == first
    b = queue.options(job_id=second).enqueue(second)
    assert b.id == second
    assert b.result(timeout_s=30) == second
    for job in (a, b):
        info = job.info()
        assert info.state is JobState.COMPLETED and len(info.history) == 1
    assert queue.counts()[JobState.COMPLETED] == 2
