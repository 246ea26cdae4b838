"""``sandboxq batch QUEUE ID`` against a real redis-server: progress, failures grouped by
outcome, --json, --retry-failed, --cancel, and the errors of a batch that does not exist.

In-process (``main([...])`` with capsys): only the output and the exit status matter."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from sandboxq import Queue
from sandboxq.backends.rules import TRIM_BUDGET
from sandboxq.batch_failures import failures
from sandboxq.cli import main
from sandboxq.errors import BatchNotFound, DamagedRecord, JobFailed, JobNotFound
from sandboxq.testing.workers import BackgroundWorkers

H = "sandboxq.testing.handlers:"

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def sq(capsys: pytest.CaptureFixture[str]) -> Run:
    def run(line: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(shlex.split(line))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def q(redis_url: str, queue_name: str) -> Iterator[Queue]:
    with Queue(queue_name, redis_url) as queue:
        yield queue


@pytest.mark.timeout(60)
def test_progress_and_failures_grouped_by_outcome_then_retry(
    sq: Run, q: Queue, redis_url: str, workers: BackgroundWorkers
) -> None:
    at = f"{q.name} {{}} --url {redis_url}"
    calls = [([0, i], {}) for i in range(4)]  # succeed_after(0, i) returns i
    calls += [(["x"], {}) for _ in range(3)]  # TypeError: error
    batch = q.options(hard_timeout_s=0.5).batch([*calls, ([5, "late"], {})])  # hard_timeout
    code, out, _ = sq(f"batch {at.format(batch.id)} --json")
    data = json.loads(out)
    assert code == 0 and (data["total"], data["waiting"], data["done"]) == (8, 8, False)
    assert data["failures"] == []
    workers.start(q, H + "succeed_after", concurrency=2)
    batch.wait(timeout_s=40)
    code, out, _ = sq(f"batch {at.format(batch.id)} --json")
    data = json.loads(out)
    assert code == 0 and (data["completed"], data["failed"], data["done"]) == (4, 4, True)
    groups = {g["outcome"]: g for g in data["failures"]}
    assert set(groups) == {"error", "hard_timeout"}
    assert groups["error"]["count"] == 3 and len(groups["error"]["job_ids"]) == 3
    assert groups["hard_timeout"]["job_ids"] == [f"{batch.id}.7"]
    assert data["failures"][0]["outcome"] == "error"  # most first
    code, out, _ = sq(f"batch {at.format(batch.id)}")
    assert code == 0 and f"batch {batch.id}" in out and "done" in out
    assert "hard_timeout" in out and f"{batch.id}.7" in out and "error" in out
    code, out, _ = sq(f"batch {at.format(batch.id)} --retry-failed")
    assert code == 0 and f"retried 4 member(s) of batch {batch.id}" in out
    assert batch.wait(timeout_s=40).failed == 4
    code, out, err = sq(f"batch {at.format(batch.id)} --cancel")
    assert code == 1 and "has no unfinished members" in err


def test_cancel_and_the_errors_of_a_batch_that_does_not_exist(
    sq: Run, q: Queue, redis_url: str
) -> None:
    batch = q.batch([([i], {}) for i in range(3)])
    code, out, _ = sq(f"batch {q.name} {batch.id} --url {redis_url} --cancel --json")
    assert code == 0 and json.loads(out) == {"cancelled": 3, "batch_id": batch.id}
    code, out, err = sq(f"batch {q.name} {batch.id} --url {redis_url}")
    assert code == 0 and "no failed" not in out and "cancelled" in out
    code, out, err = sq(f"batch {q.name} {batch.id} --url {redis_url} --retry-failed")
    assert code == 0 and "retried 3" in out
    code, out, err = sq(f"batch {q.name} 0123456789abcdef --url {redis_url}")
    assert (code, out) == (1, "") and "no batch '0123456789abcdef'" in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = sq(f"batch {q.name} 0123456789abcdef --url {redis_url} --cancel")
    assert code == 1 and "no batch" in err
    code, out, err = sq(f"batch {q.name} 'a.b<x>' --url {redis_url}")
    assert code == 2 and err.startswith("sandboxq: error: batch id") and "Traceback" not in err
    code, out, err = sq(f"batch {q.name} {batch.id} --url {redis_url} --cancel --retry-failed")
    assert code == 2 and "not allowed with" in err


@pytest.mark.timeout(90)
def test_an_expired_batch_half_deleted_by_retention_is_gone_for_every_reader(
    sq: Run, redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path
) -> None:
    """Retention deletes an expired batch TRIM_BUDGET members per finish (or stalled
    recovery) on its queue, so on a quiet queue it stays half-deleted: it was read as done
    with every count, results() held JobNotFound slots, as_completed streamed every
    member, `sandboxq batch` grouped fewer failures than it counted, and --resume wrote
    the deleted members' lines as not_run "deleted by hand?"."""
    with Queue(queue_name, redis_url, batch_ttl_s=1) as q:
        total = TRIM_BUDGET + 50
        calls = [(["x"], {}) if i % 10 == 0 else ([0, i], {}) for i in range(total)]
        batch = q.batch(calls, label="expiring")
        workers.start(q, H + "succeed_after", concurrency=2)
        assert batch.wait(timeout_s=60).failed == total // 10
        workers.stop_all()  # a quiet queue: nothing sweeps but the call below
        time.sleep(1.2)
        q.backend.recover_stalled()  # one sweep round: TRIM_BUDGET members go
        r = redis.Redis.from_url(redis_url)
        member = f"sq:{{{queue_name}}}:job:{batch.id}."
        assert not r.exists(member + "0") and r.exists(member + str(total - 1)), "not half-swept"
        readers = {
            "get_batch": lambda: q.get_batch(batch.id),
            "progress": batch.progress,
            "results": batch.results,
            "as_completed": lambda: list(batch.as_completed(timeout_s=5)),
            "wait": lambda: batch.wait(timeout_s=5),
            "retry_failed": batch.retry_failed,
            "failures": lambda: failures(q.backend, batch.id),
        }
        leaked: dict[str, str] = {}
        for name, read in readers.items():
            try:
                leaked[name] = repr(read())[:160]
            except BatchNotFound as exc:
                assert "expired at" in str(exc) and "batch_ttl_s 1 s" in str(exc), exc
        assert not leaked, f"read from a half-deleted batch: {leaked}"
        assert batch.id not in [b.batch_id for b in q.backend.list_batches()]
    for form in ("", " --json", " --retry-failed"):
        code, out, err = sq(f"batch {queue_name} {batch.id} --url {redis_url}{form}")
        assert (code, out) == (1, "") and "expired at" in err and "batch_ttl_s 1 s" in err, err
    out_file = tmp_path / "out.jsonl"
    code, out, err = sq(
        f"run --resume {batch.id} --url {redis_url} --queue {queue_name} --output {out_file}"
    )
    assert code == 1 and "expired at" in err, err
    assert not out_file.exists() or "not_run" not in out_file.read_text()


@pytest.mark.timeout(60)
def test_failures_add_up_when_a_members_record_is_missing_or_damaged(
    sq: Run, q: Queue, redis_url: str, workers: BackgroundWorkers
) -> None:
    """A failed member whose record was deleted, or whose state is no state, was left out
    of the groups (failed 4, groups adding up to error 2) with nothing saying why, and the
    damaged one made results() raise for the whole batch."""
    calls = [(["x"], {}) if i % 3 == 0 else ([0, i], {}) for i in range(12)]  # 0, 3, 6, 9 fail
    batch = q.batch(calls)
    workers.start(q, H + "succeed_after", concurrency=2)
    assert batch.wait(timeout_s=40).failed == 4
    r = redis.Redis.from_url(redis_url)
    job = f"sq:{{{q.name}}}:job:{batch.id}."
    r.delete(job + "0")
    r.hset(job + "3", "state", "bogus")
    code, out, _ = sq(f"batch {q.name} {batch.id} --url {redis_url} --json")
    data = json.loads(out)
    groups = {g["outcome"]: g for g in data["failures"]}
    assert code == 0 and sum(g["count"] for g in groups.values()) == data["failed"] == 4
    assert groups["record missing"]["job_ids"] == [f"{batch.id}.0"]
    assert groups["record damaged"]["job_ids"] == [f"{batch.id}.3"]
    assert groups["error"]["count"] == 2
    code, out, _ = sq(f"batch {q.name} {batch.id} --url {redis_url}")
    assert code == 0 and "record missing" in out and "record damaged" in out
    found = failures(q.backend, batch.id)
    assert {g.outcome: g.count for g in found.groups} == {
        "error": 2,
        "record missing": 1,
        "record damaged": 1,
    }
    results = batch.results()  # one damaged member costs its own slot, not the others
    assert isinstance(results[0], JobNotFound) and isinstance(results[3], DamagedRecord)
    assert isinstance(results[6], JobFailed) and results[1] == 1
