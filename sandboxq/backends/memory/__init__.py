"""The in-process backend: the embedded default (``memory://``) and the reference the Redis
backend is held to by the contract suite (``tests.support.contract``) and the
model-based test (tests/test_backend_model.py).

    backend.py   MemoryBackend: enqueue, claim, renew, release, finish, progress, workers
    store.py     the jobs, their heaps and state transitions, under one lock
    manage.py    recover_stalled, cancel, retry_failed, confirm_dead, purge
    reads.py     get, counts, list_jobs, job_page, job_detail
    waits.py     wait_for_finish, events, watch_cancellations

Where the protocol leaves a choice open, this backend makes the Redis backend's choice, so
code tested on one behaves the same on the other: options are validated at enqueue, a
requeued or recovered job keeps its place in line, a stalled attempt leaves a record, and
the rules both must share (texts, limits, time boundaries) come from ``backends.rules``.
"""

from sandboxq.backends.memory.backend import MemoryBackend

__all__ = ["MemoryBackend"]
