"""How to test a processor that can hang, with sandboxq's pytest plugin.

    pytest examples/test_my_processor.py

The plugin comes with sandboxq (no conftest needed). Its fixtures run the real thing:
``sandboxq_queue`` is a queue of this test's own on a real Redis (a throwaway
redis-server started once per session, or the one named by --sandboxq-redis-url or
$SANDBOXQ_TEST_REDIS_URL); ``sandboxq_worker(...)`` runs a SandboxWorker with real
sandboxed children in the background and stops it when the test ends, pass or fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxq import JobFailed, Queue
from sandboxq.testing.cases import HandlerCase

pytestmark = pytest.mark.timeout(60)

CONVERT = "jobs_convert:convert"  # the processor under test (examples/jobs_convert.py)
MALFORMED = "bad\x00document"  # makes the converter hang


def test_converts_a_document(sandboxq_queue: Queue, sandboxq_worker, tmp_path: Path) -> None:
    sandboxq_worker(CONVERT, soft_timeout_s=5, hard_timeout_s=10)
    out = sandboxq_queue.enqueue("memo", "hello", str(tmp_path)).result(timeout_s=30)
    assert Path(out).read_text() == "HELLO"


# sandboxq_no_orphans fails the test if any process it started, the hung converter
# included, is still alive after the test.
@pytest.mark.sandboxq_no_orphans
def test_a_hung_conversion_stops_at_the_soft_timeout_and_cleans_up(
    sandboxq_queue: Queue, sandboxq_worker, tmp_path: Path
) -> None:
    sandboxq_worker(CONVERT, soft_timeout_s=0.5, hard_timeout_s=5)
    job = sandboxq_queue.enqueue("broken", MALFORMED, str(tmp_path))
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=30)
    assert failed.value.outcome == "soft_timeout"
    assert list(tmp_path.iterdir()) == []  # the half-written file was removed


@pytest.mark.sandboxq_no_orphans
def test_without_a_soft_timeout_the_hard_kill_takes_the_converter_too(
    sandboxq_queue: Queue, sandboxq_worker, tmp_path: Path
) -> None:
    sandboxq_worker(CONVERT, hard_timeout_s=0.5, retries=1)
    job = sandboxq_queue.options(backoff_s=0.1).enqueue("broken", MALFORMED, str(tmp_path))
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=30)
    assert [a.outcome for a in job.info().history] == ["hard_timeout", "hard_timeout"]
    assert failed.value.attempts == 2
    # A kill leaves no chance to clean up: that is what the soft timeout is for.
    assert [p.name for p in tmp_path.iterdir()] == ["broken.part"]


# The catalogue of misbehaving handlers checks worker settings (retries, timeouts, exit
# codes) against each way a handler can hang. Without parametrize, every case runs.
@pytest.mark.parametrize(
    "sandboxq_hung_handler", ["sleep_forever-soft", "hold_gil-soft"], indirect=True
)
def test_every_kind_of_hang_gets_one_retry(
    sandboxq_hung_handler: HandlerCase, sandboxq_memory_queue: Queue, sandboxq_worker
) -> None:
    case = sandboxq_hung_handler
    sandboxq_worker(case.processor, retries=1, **case.worker_options)
    job = sandboxq_memory_queue.options(backoff_s=0.1).enqueue(*case.args)
    with pytest.raises(JobFailed):
        job.result(timeout_s=30)
    assert [a.outcome for a in job.info().history] == [case.outcome] * 2
