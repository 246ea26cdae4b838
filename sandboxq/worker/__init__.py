"""The worker: claims jobs under leases and runs them in the sandboxed pool.

worker.py       ``SandboxWorker``: wires the parts below and owns their lifetime
dispatch.py     the main thread: claimed jobs to the pool, ended attempts to acks
events.py       what the other threads tell the main thread (named events)
fetcher.py      the claim loop, on its own thread
inflight.py     the jobs held, keyed by lease token; slots reserved before a claim
heartbeat.py    lease renewal on its own thread; moves each attempt's fence
reaper.py       recovery of expired leases (any worker's)
progress.py     progress reports, written on their own thread
drain.py        the graceful stop, step by step
tasks.py        from a claimed job to the pool's ``Task``
outcomes.py     what an ended attempt means to the queue: the exit policy, the ack
bounded.py      backend calls that may not outlast the stop deadline
"""

from sandboxq.worker.worker import SandboxWorker

__all__ = ["SandboxWorker"]
