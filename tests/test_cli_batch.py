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
from sandboxq.batch_failures import Failures, failures
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
        member = f"sq:{{{queue_name}}}:job:{batch.id}."
        with redis.Redis.from_url(redis_url) as r:  # closed: not a socket for the collector
            swept = not r.exists(member + "0") and r.exists(member + str(total - 1))
        assert swept, "not half-swept"
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
    job = f"sq:{{{q.name}}}:job:{batch.id}."
    with redis.Redis.from_url(redis_url) as r:  # closed here: a socket left to the collector
        r.delete(job + "0")  # failed whichever later test collected it
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


@pytest.mark.timeout(60)
def test_failures_of_an_outcome_are_grouped_by_the_type_the_handler_raised(
    sq: Run, q: Queue, redis_url: str, workers: BackgroundWorkers
) -> None:
    """ValueError, KeyError and TypeError all read "error 6": which members raised what
    took opening each job."""
    calls = [(["use_memory", -1], {}) for _ in range(3)]  # ValueError: negative count
    calls += [(["no_such_handler"], {}) for _ in range(2)]  # KeyError
    calls += [(["succeed_after", "x"], {})]  # TypeError
    calls += [(["os_exit", 3], {}), (["succeed_after", 0, 1], {})]  # exit, ok
    batch = q.batch(calls)
    workers.start(q, H + "call", concurrency=2)
    assert batch.wait(timeout_s=40).failed == 7
    code, out, _ = sq(f"batch {q.name} {batch.id} --url {redis_url} --json")
    data = json.loads(out)
    groups = {g["outcome"]: g for g in data["failures"]}
    assert code == 0 and set(groups) == {"error", "exit"} and groups["error"]["count"] == 6
    kinds = [(k["kind"], k["count"], set(k["job_ids"])) for k in groups["error"]["kinds"]]
    member = [f"{batch.id}.{i}" for i in range(len(calls))]
    assert (
        kinds
        == [  # ids in the order they finished
            ("ValueError", 3, set(member[:3])),
            ("KeyError", 2, set(member[3:5])),
            ("TypeError", 1, set(member[5:6])),
        ]
    )
    assert groups["exit"]["kinds"] == [{"kind": "exit", "count": 1, "job_ids": [member[6]]}]
    assert len(groups["error"]["job_ids"]) == 5  # the fields readers had stay as they were
    code, out, _ = sq(f"batch {q.name} {batch.id} --url {redis_url}")
    lines = out.splitlines()
    assert code == 0 and "failures by outcome and kind" in out
    assert any("error" in ln and "ValueError" in ln and " 3 " in ln for ln in lines), out
    assert any("KeyError" in ln and " 2 " in ln and member[3] in ln for ln in lines), out
    assert any("exit" in ln and member[6] in ln for ln in lines), out
    found = failures(q.backend, batch.id)
    assert [(k.kind, k.count) for k in found.groups[0].kinds] == [
        ("ValueError", 3),
        ("KeyError", 2),
        ("TypeError", 1),
    ]


@pytest.mark.timeout(60)
def test_a_forged_error_costs_a_bounded_read_and_leaves_the_groups_whole(
    sq: Run, q: Queue, redis_url: str, workers: BackgroundWorkers
) -> None:
    """The kind is read from a text anyone with access to Redis can write: a 1 MB error is
    not read (nor sent), bytes that are not UTF-8 name no type, and the groups still add
    up to the failed count."""
    batch = q.batch([(["use_memory", -1], {}) for _ in range(5)])
    workers.start(q, H + "call", concurrency=2)
    assert batch.wait(timeout_s=40).failed == 5
    with redis.Redis.from_url(redis_url) as r:
        sent, found = forge_then_group(r, q, batch.id)
    assert sent < 64 * 1024, sent  # the 1 MB error stayed in Redis
    assert [(g.outcome, g.count) for g in found.groups] == [("error", 5)]
    assert [(k.kind, k.count, set(k.job_ids)) for k in found.groups[0].kinds] == [
        ("other", 3, {f"{batch.id}.{i}" for i in (0, 1, 3)}),
        ("KeyError", 1, {f"{batch.id}.2"}),
        ("ValueError", 1, {f"{batch.id}.4"}),
    ]
    code, out, _ = sq(f"batch {q.name} {batch.id} --url {redis_url} --json")
    data = json.loads(out)
    assert code == 0 and sum(k["count"] for k in data["failures"][0]["kinds"]) == 5


def forge_then_group(r: redis.Redis, q: Queue, batch_id: str) -> tuple[int, Failures]:
    """Writes four members' errors by hand, then groups: the bytes Redis sent meanwhile."""
    job = f"sq:{{{q.name}}}:job:{batch_id}."
    r.hset(job + "0", "error", b"builtins.KeyError: " + b"k" * (1 << 20))
    r.hset(job + "1", "error", b"\xff\xfeValueError: not UTF-8")
    r.hset(job + "2", "error", b"builtins.KeyError: \xff\xfe message not UTF-8")
    r.hset(job + "3", "error", b"Value\xc3\x28Error: broken UTF-8 in the name")
    before = int(r.info("stats")["total_net_output_bytes"])
    found = failures(q.backend, batch_id)
    return int(r.info("stats")["total_net_output_bytes"]) - before, found
