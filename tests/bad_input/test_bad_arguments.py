"""Job arguments and results, on both backends: what JSON carries arrives exactly as sent,
through a real worker and a real child; what it cannot carry is refused at ``enqueue``
with a ``SerializationError`` that says where the value sits and what it is, and nothing
is enqueued. A result JSON cannot carry fails that one job with the same kind of cause.
"""

from __future__ import annotations

import datetime
import decimal
import logging
import math
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandboxq import JobFailed, Queue, SerializationError
from sandboxq.models import JobState
from sandboxq.testing.handlers import echo
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import StartWorker

from .support import SHARED_ACROSS_EXAMPLES

pytestmark = pytest.mark.timeout(120)

# -- what JSON carries --------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (``1 == 1.0 == True`` is not enough),
    with dict keys in the same order and the sign of zero kept."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.fixture
def echo_worker(start_worker: StartWorker) -> None:
    """One worker per test function, serving every example hypothesis runs."""
    start_worker("echo")


@SHARED_ACROSS_EXAMPLES
@given(
    args=st.lists(json_values, max_size=4),
    kwargs=st.dictionaries(st.text(max_size=10), json_values, max_size=4),
)
def test_json_arguments_round_trip_exactly_through_a_real_worker(
    queue: Queue, echo_worker: None, args: list[Any], kwargs: dict[str, Any]
) -> None:
    job = queue.enqueue(*args, **kwargs)
    result = job.result(timeout_s=30)
    expected = echo(*args, **kwargs)
    assert same(result, expected), (result, expected)


def test_keyword_arguments_may_have_any_name(queue: Queue, echo_worker: None) -> None:
    """``self`` or ``job_id`` are the handler's business, not the queue's."""
    kwargs = {"self": 1, "args": 2, "kwargs": 3, "job_id": 4, "": 5}
    assert queue.enqueue(**kwargs).result(timeout_s=30) == [[], kwargs]
    assert queue.enqueue_many([((), kwargs)])[0].result(timeout_s=30) == [[], kwargs]


# -- what JSON cannot carry: refused at enqueue, naming where and what ----------------------


class _Thing:
    def __repr__(self) -> str:
        return "<a thing>"


#: (value, words the error must contain besides the path)
BAD_VALUES: list[tuple[Any, tuple[str, ...]]] = [
    ({1, 2}, ("is a set",)),
    (frozenset({3}), ("is a frozenset",)),
    (b"raw bytes", ("is a bytes",)),
    (bytearray(b"x"), ("is a bytearray",)),
    (1 + 2j, ("is a complex",)),
    (decimal.Decimal("1.5"), ("is a decimal.Decimal",)),
    (datetime.date(2024, 1, 1), ("is a datetime.date",)),
    (_Thing(), ("_Thing", "<a thing>")),
    (threading.Lock(), ("lock",)),
    (print, ("builtin_function_or_method",)),
    (float("nan"), ("is nan", "no NaN or infinity")),
    (float("inf"), ("is inf", "no NaN or infinity")),
    (float("-inf"), ("is -inf", "no NaN or infinity")),
    ("ok \ud800 not ok", ("lone surrogate", "\\ud800")),
    (10**5000, ("is an integer", "too long")),
    ({1: "one"}, ("has the key 1 (int)", "keys must be strings")),
    ({1: "a", "1": "b"}, ("has the key 1 (int)",)),
    ({None: 0}, ("has the key None (NoneType)",)),
    ({True: 0}, ("has the key True (bool)",)),
    ({2.5: 0}, ("has the key 2.5 (float)",)),
    ({(1, 2): 0}, ("has the key (1, 2) (tuple)",)),
]
# dicts with a bad key report the dict itself; every other bad value reports its own path
_KEY_PROBLEM = "has the key"


@st.composite
def planted(draw: st.DrawFn) -> tuple[list[Any], dict[str, Any], str, tuple[str, ...]]:
    """Good arguments with one bad value planted somewhere inside; returns the args, the
    kwargs, the path the error must name (``args[1]['a'][0]``) and the words it must say."""
    bad, words = draw(st.sampled_from(BAD_VALUES))
    value: Any = bad
    steps: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            before = draw(st.lists(json_scalars, max_size=2))
            after = draw(st.lists(json_scalars, max_size=2))
            steps.append(f"[{len(before)}]")
            value = [*before, value, *after]
        else:
            key = draw(st.text(max_size=6))
            others = draw(st.dictionaries(st.text(max_size=6), json_scalars, max_size=2))
            others.pop(key, None)
            steps.append(f"[{key!r}]")
            value = {**others, key: value}
    steps.reverse()
    if draw(st.booleans()):
        args = draw(st.lists(json_scalars, max_size=2))
        at = draw(st.integers(0, len(args)))
        args.insert(at, value)
        kwargs = draw(st.dictionaries(st.text(max_size=6), json_scalars, max_size=2))
        path = f"args[{at}]" + "".join(steps)
    else:
        args = draw(st.lists(json_scalars, max_size=2))
        name = draw(st.text(max_size=6))
        kwargs = {**draw(st.dictionaries(st.text(max_size=6), json_scalars, max_size=2))}
        kwargs[name] = value
        path = f"kwargs[{name!r}]" + "".join(steps)
    return args, kwargs, path, words


@SHARED_ACROSS_EXAMPLES
@given(case=planted())
def test_unencodable_arguments_are_refused_at_enqueue_naming_where(
    queue: Queue, case: tuple[list[Any], dict[str, Any], str, tuple[str, ...]]
) -> None:
    args, kwargs, path, words = case
    before = queue.counts()
    with pytest.raises(SerializationError) as refused:
        queue.enqueue(*args, **kwargs)
    message = str(refused.value)
    assert message.startswith("arguments cannot be encoded as json: "), message
    assert f": {path} " in message, (path, message)
    for word in words:
        assert word in message, (word, message)
    assert queue.counts() == before  # nothing was enqueued


def test_a_refusal_names_the_type_in_words(queue: Queue) -> None:
    """ "is a object" read as a slip of the product's, not as the handler's value."""
    for value, words in ((object(), "is an object ("), ({1, 2}, "is a set (")):
        with pytest.raises(SerializationError) as refused:
            queue.enqueue(value)
        assert f"args[0] {words}" in str(refused.value), refused.value


def test_a_dict_with_a_non_string_key_is_refused_instead_of_silently_changed(
    queue: Queue,
) -> None:
    """Python's json writes ``{1: "a", "1": "b"}`` as ``{"1": "a", "1": "b"}``: the worker
    would get ``{"1": "b"}``, one value lost and the key changed. Refused instead."""
    with pytest.raises(SerializationError, match=r"args\[0\] has the key 1 \(int\)"):
        queue.enqueue({1: "a", "1": "b"})
    with pytest.raises(SerializationError, match=r"kwargs\['table'\]\[0\] has the key 2"):
        queue.enqueue(table=[{2: "two"}])
    assert sum(queue.counts().values()) == 0


def test_a_circular_or_oversized_argument_is_refused(queue: Queue) -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(SerializationError, match=r"args\[0\]\[1\] contains itself"):
        queue.enqueue(loop)
    with pytest.raises(SerializationError, match="over the limit of 16777216 bytes"):
        queue.enqueue("x" * (16 * 1024 * 1024 + 1))
    assert sum(queue.counts().values()) == 0


@pytest.mark.parametrize(
    ("calls", "needle"),
    [
        ([1], "call #0 is 1"),
        ([((1,), {}), ("ab", {})], "call #1 is ('ab', {})"),
        ([((1,), [("a", 1)])], "call #0 is ((1,), [('a', 1)])"),
        ([((1,), {}, "extra")], "call #0 is ((1,), {}, 'extra')"),
    ],
)
def test_enqueue_many_names_the_call_that_is_not_an_args_kwargs_pair(
    queue: Queue, calls: list[Any], needle: str
) -> None:
    with pytest.raises(SerializationError) as refused:
        queue.enqueue_many(calls)
    assert needle in str(refused.value)
    assert "(args, kwargs) pair" in str(refused.value)
    assert sum(queue.counts().values()) == 0


# -- results JSON cannot carry fail that one job, and the worker goes on ---------------------


@pytest.mark.parametrize(
    ("handler", "cause"),
    [
        ("return_int_keys", "result cannot be encoded as json: result has the key 1 (int)"),
        ("return_unserializable", "result cannot be encoded as json: result is a _thread.lock"),
    ],
)
def test_a_result_json_cannot_carry_fails_that_job_with_the_cause(
    queue: Queue, start_worker: StartWorker, handler: str, cause: str
) -> None:
    worker = start_worker(handler)
    jobs = [queue.enqueue() for _ in range(2)]
    for job in jobs:  # the second proves the worker (and its child) went on
        with pytest.raises(JobFailed) as failed:
            job.result(timeout_s=30)
        assert cause in str(failed.value)
        info = job.info()
        assert info.state is JobState.FAILED and info.attempts == 1
        assert info.history[-1].error is not None and cause in info.history[-1].error
    # counted once the finish is acknowledged, which can be after the waiter woke
    wait_for(lambda: worker.stats["failed"] == 2, 10, "both failures to be counted")


@pytest.mark.parametrize(
    ("handler", "codec", "cause"),
    [
        ("return_unserializable", "json", "result cannot be encoded as json: result is a _"),
        ("return_unserializable", "pickle", "result cannot be encoded as pickle: "),
    ],
)
def test_a_result_that_cannot_be_encoded_is_logged_in_one_line_without_sandboxq_frames(
    url: str,
    queue_name: str,
    start_worker: StartWorker,
    caplog: pytest.LogCaptureFixture,
    handler: str,
    codec: str,
    cause: str,
) -> None:
    """The handler returned: the encoder's frames (codec.py, json) say nothing about its
    code, so the attempt keeps no traceback and the worker logs its one line only."""
    queue = Queue(queue_name, url=url, codec=codec)
    with caplog.at_level(logging.INFO, logger="sandboxq.worker"):
        start_worker(handler, allow_pickle=codec == "pickle")
        job = queue.enqueue()
        with pytest.raises(JobFailed, match=cause):
            job.result(timeout_s=30)
        info = job.info()
        assert info.state is JobState.FAILED and info.history[-1].traceback is None
        wait_for(lambda: job.id in caplog.text, 10, "the attempt's line to be logged")
    queue.close()
    said = [r.getMessage() for r in caplog.records if job.id in r.getMessage()]
    assert len(said) == 1 and cause in said[0], said
    assert "\n" not in said[0] and "Traceback" not in said[0], said[0]
