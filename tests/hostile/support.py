"""Helpers of the hostile-Redis suite: forging job records by hand, the way anyone with
write access to a shared Redis could, and running CLI verbs in-process."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings

from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.cli import main

H = "sandboxq.testing.handlers:"

#: Workers are slow to start, so a fuzz test builds one in a fixture and shares it across
#: its examples (hence the function-scoped fixture health check is off).
SHARED_ACROSS_EXAMPLES = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Planted:
    """Unpickling this creates ``path``: the attacker's code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def bomb(marker: Path) -> bytes:
    return pickle.dumps(Planted(marker))


def forge_completed(
    raw: redis.Redis, queue: str, job_id: str, *, result: bytes, codec: bytes | str | None
) -> None:
    """Rewrite a job's record as completed with ``result`` claimed to be ``codec``
    (None: the codec field removed)."""
    key = QueueKeys(queue).job(job_id)
    with raw.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={"state": "completed", "result": result, "finished_ms": 1})
        if codec is None:
            pipe.hdel(key, "codec")
        else:
            pipe.hset(key, "codec", codec)
        pipe.execute()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``sandboxq argv`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
