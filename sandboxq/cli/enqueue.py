"""``sandboxq enqueue QUEUE``: add one job; with ``--wait``, wait for it and print its result.

Output: the job id on stdout; with ``--wait`` the result follows as one line of JSON.
A failed job prints its cause on stderr and exits 1; ``--json`` prints one object either
way (``id``, ``state`` and ``result``, or ``outcome``, ``attempts`` and ``error``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sandboxq import text
from sandboxq.cli import render
from sandboxq.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    Exit,
    add_allow_pickle,
    add_json,
    add_setting_flags,
    add_url,
    bounded,
    open_queue,
    parse_json,
    setting_flags,
)
from sandboxq.errors import ConfigError, JobFailed
from sandboxq.models import MAX_SECONDS, JobOptions

#: The JobOptions that have a flag, made from the model's fields (the rest take the
#: queue's defaults).
JOB_OPTIONS = (
    "job_id",
    "soft_timeout_s",
    "hard_timeout_s",
    "retries",
    "priority",
    "delay_s",
    "result_ttl_s",
    "failure_ttl_s",
    "max_queue_s",
    "deadline_s",
    "progress_timeout_s",
)


def add_parser(verbs: Any) -> None:
    e = verbs.add_parser(
        "enqueue",
        help="add a job to QUEUE (prints its id); --wait prints its result",
        description="Add a job: the worker calls its processor with --args and --kwargs.",
    )
    e.add_argument("queue")
    e.add_argument("--args", metavar="JSON", help="positional arguments, a JSON array")
    e.add_argument("--kwargs", metavar="JSON", help="keyword arguments, a JSON object")
    add_setting_flags(e, JobOptions, JOB_OPTIONS)
    add_url(e)
    e.add_argument("--wait", action="store_true", help="wait for the job and print its result")
    e.add_argument(
        "--timeout-s",
        type=bounded(float, 0, MAX_SECONDS),
        help="with --wait: give up after this many seconds (default: wait until it ends)",
    )
    add_json(e)
    add_allow_pickle(e)
    e.set_defaults(run=run, words_hint=_args_hint)


def run(args: argparse.Namespace) -> int:
    call_args = parse_json("--args", args.args, list, '[1, "two"]')
    call_kwargs = parse_json("--kwargs", args.kwargs, dict, '{"size": 256}')
    options = {k: v for k, v in setting_flags(args, JOB_OPTIONS).items() if v is not None}
    if args.timeout_s is not None and not args.wait:
        raise ConfigError("--timeout-s is how long --wait waits: give --wait too")
    if args.wait and options.get("result_ttl_s") == 0:
        raise ConfigError(
            "--wait reads the job's result, and --result-ttl-s 0 removes the job as it "
            "completes: give it 1 or more"
        )
    with open_queue(args) as queue:
        target = queue.options(**options) if options else queue
        job = target.enqueue(*call_args, **call_kwargs)
        if job.created is False:  # the id is printed all the same: a script reads it
            print(
                f"sandboxq: job {text.visible(job.id)} already exists: nothing was added, "
                "and these arguments and options were not used",
                file=sys.stderr,
            )
        if not args.wait:
            if args.json:
                render.print_json({"id": job.id})
            else:
                print(job.id)
            return EXIT_OK
        if not args.json:
            print(job.id, flush=True)  # known at once, even if the wait is long
        try:
            value = job.result(timeout_s=args.timeout_s)
        except JobFailed as exc:
            if args.json:
                render.print_json(
                    {
                        "id": job.id,
                        "state": job.state().value,
                        "outcome": exc.outcome,
                        "attempts": exc.attempts,
                        "error": exc.error,
                    }
                )
            raise Exit(
                f"job {job.id} failed after {exc.attempts} attempt(s): "
                f"{text.clip(exc.error or exc.outcome, 500)}",
                EXIT_FAILED,
            ) from None
        except TimeoutError:
            raise Exit(
                f"job {job.id} did not finish within {args.timeout_s} s "
                f"(it is {job.state().value}; it stays queued)",
                EXIT_TIMEOUT,
            ) from None
    if args.json:
        render.print_json({"id": job.id, "state": "completed", "result": value})
    else:
        print(json.dumps(value, ensure_ascii=False))
    return EXIT_OK


def _args_hint(words: list[str]) -> str:
    example, flag = json.dumps(words), "--args"
    if len(words) == 1:  # already JSON ('[1, 2]' or '{"size": 2}'): only the flag is missing
        try:
            given = json.loads(words[0])
        except ValueError:
            given = None
        if isinstance(given, list | dict):
            example, flag = words[0], "--args" if isinstance(given, list) else "--kwargs"
    quoted = f"'{example}'" if "'" not in example else "'[...]'"
    if flag == "--kwargs":
        return f"a job's keyword arguments go in --kwargs, as a JSON object: --kwargs {quoted}"
    return f"a job's arguments go in --args, as a JSON array: --args {quoted}"
