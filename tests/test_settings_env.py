"""Settings from SANDBOXQ_* environment variables: precedence, parsing, and errors that
name the variable."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, BeforeValidator, ConfigDict

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
        (
            {"SANDBOXQ_CONCURRENCY": "four"},
            "SANDBOXQ_CONCURRENCY='four': Value error, expected a number",
        ),
        ({"SANDBOXQ_LEASE_S": "0.1"}, "SANDBOXQ_LEASE_S='0.1': Input should be greater"),
        ({"SANDBOXQ_LEASE_S": "nan"}, "SANDBOXQ_LEASE_S='nan'"),
        ({"SANDBOXQ_HARD_TIMEOUT_S": "-1"}, "SANDBOXQ_HARD_TIMEOUT_S='-1': Value error, must be"),
        ({"SANDBOXQ_EXIT_CODES": "3=retry"}, "SANDBOXQ_EXIT_CODES='3=retry' is not a JSON"),
        ({"SANDBOXQ_EXIT_CODES": '{"3": "explode"}'}, 'SANDBOXQ_EXIT_CODES=\'{"3"'),
        (
            {"SANDBOXQ_SOFT_TIMEOUT_S": "5", "SANDBOXQ_HARD_TIMEOUT_S": "2"},
            "(from the environment: SANDBOXQ_SOFT_TIMEOUT_S='5', SANDBOXQ_HARD_TIMEOUT_S='2')",
        ),
        ({"SANDBOXQ_CONTAINMENT": "jail"}, "SANDBOXQ_CONTAINMENT='jail': Input should be 'auto'"),
        ({"SANDBOXQ_CPU_TIME_S": "0"}, "SANDBOXQ_CPU_TIME_S='0': Value error, must be a pos"),
        ({"SANDBOXQ_MAX_PROCESSES": "0"}, "SANDBOXQ_MAX_PROCESSES='0': Input should be greater"),
        ({"SANDBOXQ_CORE_DUMPS": "1"}, "SANDBOXQ_CORE_DUMPS='1': Input should be a valid bool"),
        (
            {"SANDBOXQ_MAX_ADDRESS_SPACE_MB": "100", "SANDBOXQ_MAX_MEMORY_MB": "200"},
            "max_address_space_mb (100) is below max_memory_mb (200)",
        ),
    ],
)
def test_from_env_errors_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_env(WorkerSettings, env, defaults={"concurrency": 1}, queue="q", processor="a.b:c")
    assert needle in str(info.value)


@pytest.mark.timeout(30)
def test_a_check_of_two_settings_names_only_the_variables_it_is_about() -> None:
    env = {"SANDBOXQ_RENEW_INTERVAL_S": "100", "SANDBOXQ_CONCURRENCY": "2", "SANDBOXQ_RETRIES": "1"}
    with pytest.raises(ConfigError) as info:
        from_env(WorkerSettings, env, queue="q", processor="a.b:c", lease_s=30)
    message = str(info.value)
    assert "renew_interval_s (100.0) must be at most lease_s / 3 (10)" in message
    assert message.endswith("(from the environment: SANDBOXQ_RENEW_INTERVAL_S='100')"), message


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


def _no_text(value: object) -> object:
    if isinstance(value, str):
        raise ValueError(f"expected a number, got str {value!r}")
    return value


NumberOnly = BeforeValidator(_no_text)


class NumbersOnly(BaseModel):
    """Settings that refuse numbers written as text, as strict settings models do."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    lease_s: Annotated[float, NumberOnly] = 30.0
    concurrency: Annotated[int, NumberOnly] = 1
    allow_pickle: bool = False
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    exit_codes: dict[Annotated[int, NumberOnly], str] = {}


def test_from_env_hands_numbers_to_a_model_that_takes_numbers_only() -> None:
    env = {
        "SANDBOXQ_LEASE_S": "2.5",
        "SANDBOXQ_CONCURRENCY": "4",
        "SANDBOXQ_ALLOW_PICKLE": "true",
        "SANDBOXQ_START_METHOD": "spawn",
        "SANDBOXQ_EXIT_CODES": '{"3": "retry"}',
    }
    s = from_env(NumbersOnly, env)
    assert (s.lease_s, s.concurrency, s.allow_pickle) == (2.5, 4, True)
    assert s.start_method == "spawn" and s.exit_codes == {3: "retry"}
    with pytest.raises(ConfigError, match="SANDBOXQ_LEASE_S='soon': Value error, expected a num"):
        from_env(NumbersOnly, {"SANDBOXQ_LEASE_S": "soon"})


def test_containment_settings_come_from_the_environment_and_are_checked() -> None:
    env = {
        "SANDBOXQ_CONTAINMENT": "process_tree",
        "SANDBOXQ_MAX_PROCESSES": "64",
        "SANDBOXQ_CPU_TIME_S": "2.5",
        "SANDBOXQ_MAX_OPEN_FILES": "256",
        "SANDBOXQ_MAX_FILE_SIZE_MB": "10",
        "SANDBOXQ_CORE_DUMPS": "true",
    }
    s = from_env(WorkerSettings, env, queue="q", processor="a.b:c", concurrency=1)
    assert (s.containment, s.max_processes, s.cpu_time_s) == ("process_tree", 64, 2.5)
    assert (s.max_open_files, s.max_file_size_mb, s.core_dumps) == (256, 10, True)
    assert s.max_address_space_mb is None  # opt-in only
    # their errors: test_from_env_errors_name_the_variable
