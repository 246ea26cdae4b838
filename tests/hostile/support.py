"""Helpers of the hostile-Redis suite: forging job records by hand, the way anyone with
write access to a shared Redis could, and running CLI verbs in-process."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import redis

from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.cli import main


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
