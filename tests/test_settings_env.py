"""Settings from SANDBOXQ_* environment variables: precedence, parsing, and errors that
name the variable."""

from __future__ import annotations

import logging

import pytest

from sandboxq.errors import ConfigError
from sandboxq.settings import WorkerSettings, from_env


def test_from_env_reads_variables_below_flags_and_above_defaults() -> None:
    env = {
        "SANDBOXQ_LEASE_S": "2.5",
        "SANDBOXQ_CONCURRENCY": "3",
        "SANDBOXQ_RETRIES": "4",
        "SANDBOXQ_ALLOW_PICKLE": "true",
        "SANDBOXQ_EXIT_CODES": '{"3": "retry"}',
        "SANDBOXQ_QUEUE": "ignored: the queue is an argument",
    }
    s = from_env(
        WorkerSettings,
        env,
        skip=("queue", "processor", "url"),
        defaults={"concurrency": 8, "retries": 9},
        queue="q",
        processor="a.b:c",
        retries=1,  # a flag: wins over SANDBOXQ_RETRIES
        hard_timeout_s=None,  # a flag left out: the variable or default applies
    )
    assert (s.queue, s.lease_s, s.concurrency, s.retries) == ("q", 2.5, 3, 1)
    assert s.allow_pickle is True and s.exit_codes == {3: "retry"}
    assert s.hard_timeout_s is None


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SANDBOXQ_CONCURRENCY": "four"}, "SANDBOXQ_CONCURRENCY='four': Input should be"),
        ({"SANDBOXQ_LEASE_S": "0.1"}, "SANDBOXQ_LEASE_S='0.1': Input should be greater"),
        ({"SANDBOXQ_LEASE_S": "nan"}, "SANDBOXQ_LEASE_S='nan'"),
        ({"SANDBOXQ_HARD_TIMEOUT_S": "-1"}, "SANDBOXQ_HARD_TIMEOUT_S='-1': Value error, must be"),
        ({"SANDBOXQ_EXIT_CODES": "3=retry"}, "SANDBOXQ_EXIT_CODES='3=retry' is not a JSON"),
        ({"SANDBOXQ_EXIT_CODES": '{"3": "explode"}'}, 'SANDBOXQ_EXIT_CODES=\'{"3"'),
        (
            {"SANDBOXQ_SOFT_TIMEOUT_S": "5", "SANDBOXQ_HARD_TIMEOUT_S": "2"},
            "(from the environment: SANDBOXQ_SOFT_TIMEOUT_S='5', SANDBOXQ_HARD_TIMEOUT_S='2')",
        ),
    ],
)
def test_from_env_errors_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_env(WorkerSettings, env, defaults={"concurrency": 1}, queue="q", processor="a.b:c")
    assert needle in str(info.value)


def test_from_env_warns_about_a_near_miss(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sandboxq.settings"):
        s = from_env(
            WorkerSettings,
            {"SANDBOXQ_CONCURENCY": "9"},
            queue="q",
            processor="a.b:c",
            concurrency=2,
        )
    assert s.concurrency == 2
    assert "SANDBOXQ_CONCURENCY is not a setting (did you mean SANDBOXQ_CONCURRENCY?)" in (
        caplog.text
    )
