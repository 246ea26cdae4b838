"""Validated settings for the pool and the worker (pydantic, frozen, unknown names rejected).

Errors come out as ``ConfigError`` naming the setting, whichever door they came in by
(Python keyword, CLI flag, environment variable).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
from collections.abc import Collection, Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from sandboxq.codec import DEFAULT_MAX_BYTES
from sandboxq.errors import ConfigError
from sandboxq.models import NUMBER_ONLY, Action, check_timeouts

StartMethod = Literal["forkserver", "spawn"]
#: How children are contained (README "Containment"): control groups where the machine
#: allows them, else the process tree; or one of the two, forced.
ContainmentSetting = Literal["auto", "cgroup", "process_tree"]
#: Processes (threads included) one child and everything it starts may hold at once.
DEFAULT_MAX_PROCESSES = 1024

#: Longest interval between two background checks: ``threading.Event.wait`` overflows on
#: absurd timeouts, and a check that never comes is a setting nobody meant.
MAX_INTERVAL_S = 24 * 3600.0

#: A process exit status: what a handler's exit code can be mapped from.
ExitCode = Annotated[int, NUMBER_ONLY, Field(ge=0, le=255)]

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("sandboxq.settings")


def build(model: type[M], **values: Any) -> M:
    """Validate ``values`` into ``model``, turning pydantic's error into a ConfigError."""
    values = {k: _seconds(v) for k, v in values.items()}
    try:
        return model(**values)
    except ValidationError as exc:
        raise _invalid(model, exc) from None


def _invalid(
    model: type[BaseModel], exc: ValidationError, names: Mapping[str, str] | None = None
) -> ConfigError:
    """One line listing every problem; ``names`` renames a setting where a user knows it by
    another name (the environment variable it came from)."""
    names = names or {}
    problems = []
    for e in exc.errors():
        loc = [str(p) for p in e["loc"]]
        if loc and loc[0] in names:
            loc[0] = names[loc[0]]
        problems.append(f"{'.'.join(loc) or model.__name__}: {e['msg']}")
    return ConfigError(f"invalid {model.__name__}: {'; '.join(problems)}")


#: Settings also come from the environment, as ``SANDBOXQ_<SETTING NAME IN CAPITALS>``.
ENV_PREFIX = "SANDBOXQ_"


def env_var(setting: str) -> str:
    """The environment variable that sets ``setting``: ``lease_s`` -> ``SANDBOXQ_LEASE_S``."""
    return ENV_PREFIX + setting.upper()


def from_env(
    model: type[M],
    environ: Mapping[str, str] | None = None,
    *,
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    **values: Any,
) -> M:
    """Build ``model`` from ``values``, else ``SANDBOXQ_*`` variables, else ``defaults``.

    ``values`` that are None count as not given (a CLI flag left out), so the variable or
    the default applies. A variable is read as JSON where it parses (``2.5``, ``true``,
    ``SANDBOXQ_EXIT_CODES='{"3": "retry"}'``) and as text otherwise (``spawn``), and an
    error caused by one names it, with its value. Fields in ``skip`` are never read from
    the environment. A variable one typo away from a setting is logged, not ignored in
    silence (other tools may share the prefix, so it is not an error).
    """
    environ = os.environ if environ is None else environ
    merged = dict(defaults or {})
    names: dict[str, str] = {}
    for name, field in model.model_fields.items():
        raw = environ.get(env_var(name), "").strip()
        if name in skip or not raw:
            continue
        var = env_var(name)
        names[name] = f"{var}={raw!r}"
        merged[name] = _env_value(var, raw, field.annotation)
    _warn_near_misses(model, environ)
    given = {k: v for k, v in values.items() if v is not None}
    for name in given:
        names.pop(name, None)  # a value given outright hides the variable
    merged.update(given)
    try:
        return model(**{k: _seconds(v) for k, v in merged.items()})
    except ValidationError as exc:
        error = _invalid(model, exc, names)
        if names and any(not e["loc"] for e in exc.errors()):  # a cross-field check
            error = ConfigError(f"{error} (from the environment: {', '.join(names.values())})")
        raise error from None


def _env_value(var: str, raw: str, annotation: Any) -> Any:
    """A variable's text as a setting's value: JSON where it parses (numbers, true/false,
    objects), else the text itself (names such as ``spawn``). The model then checks it as
    it checks a Python value, so a setting that takes numbers only is given a number."""
    try:
        value = json.loads(raw)
    except ValueError:
        if get_origin(annotation) is dict:
            raise ConfigError(
                f'{var}={raw!r} is not a JSON object (e.g. {var}=\'{{"3": "retry"}}\')'
            ) from None
        return raw
    if isinstance(value, dict) and _has_int_keys(annotation):
        # JSON object keys are strings: "3" is the exit code 3.
        value = {_int_or_text(k): v for k, v in value.items()}
    return value


def _has_int_keys(annotation: Any) -> bool:
    if get_origin(annotation) is not dict:
        return False
    key = get_args(annotation)[0]
    return key is int or (get_origin(key) is Annotated and get_args(key)[0] is int)


def _int_or_text(key: str) -> int | str:
    try:
        return int(key)
    except ValueError:
        return key  # the model says what is wrong with it


def _warn_near_misses(model: type[BaseModel], environ: Mapping[str, str]) -> None:
    known = [env_var(name) for name in model.model_fields]
    for var in environ:
        if var.startswith(ENV_PREFIX) and var not in known:
            close = difflib.get_close_matches(var, known, n=1, cutoff=0.85)
            if close:
                log.warning("%s is not a setting (did you mean %s?); ignored", var, close[0])


def _seconds(value: Any) -> Any:
    """Accept ``timedelta`` wherever a ``*_s`` duration is expected; convert once, here."""
    return value.total_seconds() if isinstance(value, timedelta) else value


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ContainmentSettings(_Settings):
    """What the pool and the worker share about containing a child (README "Containment")."""

    containment: ContainmentSetting = "auto"
    # the pids limit of a child's control group (cgroup modes only); None: no limit
    max_processes: Annotated[int | None, NUMBER_ONLY] = Field(
        default=DEFAULT_MAX_PROCESSES, ge=1, le=4_194_304
    )
    # RLIMIT_CPU per attempt, in whole seconds rounded up: outcome cpu_limit
    cpu_time_s: Annotated[float | None, NUMBER_ONLY] = Field(default=None, le=MAX_INTERVAL_S)
    max_open_files: Annotated[int | None, NUMBER_ONLY] = Field(default=None, ge=16, le=2**20)
    max_file_size_mb: Annotated[float | None, NUMBER_ONLY] = None
    # RLIMIT_AS: breaks numpy/OpenBLAS, which reserve address space far beyond their use
    max_address_space_mb: Annotated[float | None, NUMBER_ONLY] = None
    # a debugging opt-in: only a real True turns core files back on
    core_dumps: Annotated[bool, Strict()] = False
    # True: processes an attempt started may outlive it (killed when their child ends)
    keep_strays: Annotated[bool, Strict()] = False
    # a child whose resident memory grew by more than this since it started is replaced
    max_child_growth_mb: Annotated[float | None, NUMBER_ONLY] = None

    @field_validator(
        "cpu_time_s", "max_file_size_mb", "max_address_space_mb", "max_child_growth_mb"
    )
    @classmethod
    def _positive_limit(cls, value: float | None, info: Any) -> float | None:
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ValueError(f"must be a positive, finite number, got {value!r}")
        return value

    @model_validator(mode="after")
    def _address_space_above_memory(self) -> ContainmentSettings:
        memory = getattr(self, "max_memory_mb", None)
        space = self.max_address_space_mb
        if space is not None and memory is not None and space < memory:
            raise ConfigError(
                f"max_address_space_mb ({space:g}) is below max_memory_mb ({memory:g}): "
                "the memory limit could never be reached"
            )
        return self


class PoolSettings(ContainmentSettings):
    processor: str = Field(min_length=3)
    size: Annotated[int, NUMBER_ONLY] = Field(ge=1, le=1024)
    soft_timeout_s: Annotated[float | None, NUMBER_ONLY] = None
    hard_timeout_s: Annotated[float | None, NUMBER_ONLY] = None
    max_memory_mb: Annotated[float | None, NUMBER_ONLY] = None
    max_jobs_per_child: Annotated[int | None, NUMBER_ONLY] = Field(default=None, ge=1)
    start_method: StartMethod = "forkserver"
    max_result_bytes: Annotated[int, NUMBER_ONLY] = Field(default=DEFAULT_MAX_BYTES, ge=1)
    memory_check_interval_s: Annotated[float, NUMBER_ONLY] = Field(default=0.05, gt=0, le=60)
    # None: processor.default_import_timeout_s() ($SANDBOXQ_IMPORT_TIMEOUT_S, else 60 s)
    import_timeout_s: Annotated[float | None, NUMBER_ONLY] = Field(
        default=None, gt=0, le=MAX_INTERVAL_S
    )

    @field_validator("soft_timeout_s", "hard_timeout_s", "max_memory_mb")
    @classmethod
    def _positive(cls, value: float | None, info: Any) -> float | None:
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ValueError(f"must be a positive, finite number, got {value!r}")
        return value

    @model_validator(mode="after")
    def _soft_before_hard(self) -> PoolSettings:
        check_timeouts(self.soft_timeout_s, self.hard_timeout_s)
        return self


class WorkerSettings(ContainmentSettings):
    queue: str = Field(min_length=1)
    processor: str = Field(min_length=3)
    url: str | None = None
    concurrency: Annotated[int, NUMBER_ONLY] = Field(ge=1, le=1024)
    lease_s: Annotated[float, NUMBER_ONLY] = Field(
        default=30.0, ge=0.3, le=24 * 3600, allow_inf_nan=False
    )
    # default lease_s / 3
    renew_interval_s: Annotated[float | None, NUMBER_ONLY] = Field(default=None, ge=0.01)
    # default min(lease_s / 2, 5)
    stall_check_s: Annotated[float | None, NUMBER_ONLY] = Field(
        default=None, ge=0.01, le=MAX_INTERVAL_S
    )
    soft_timeout_s: Annotated[float | None, NUMBER_ONLY] = None
    hard_timeout_s: Annotated[float | None, NUMBER_ONLY] = None
    retries: Annotated[int, NUMBER_ONLY] = Field(default=0, ge=0, le=1000)
    max_memory_mb: Annotated[float | None, NUMBER_ONLY] = None
    max_jobs_per_child: Annotated[int | None, NUMBER_ONLY] = Field(default=None, ge=1)
    exit_codes: dict[ExitCode, Action] = Field(default_factory=dict)
    prefetch: Annotated[int | None, NUMBER_ONLY] = Field(
        default=None, ge=0, le=1000
    )  # None: adaptive
    stop_timeout_s: Annotated[float, NUMBER_ONLY] = Field(default=30.0, ge=0, allow_inf_nan=False)
    start_method: StartMethod = "forkserver"
    # a security opt-in: only a real True turns it on, never 1 or "yes"
    allow_pickle: Annotated[bool, Strict()] = False
    import_timeout_s: Annotated[float | None, NUMBER_ONLY] = Field(  # as in PoolSettings
        default=None, gt=0, le=MAX_INTERVAL_S
    )
    # Prometheus metrics (sandboxq/metrics.py): served only when a port is set; 0 picks a
    # free one. Loopback unless a host says otherwise: no port opened on every interface.
    metrics_port: Annotated[int | None, NUMBER_ONLY] = Field(default=None, ge=0, le=65535)
    metrics_host: str = Field(default="127.0.0.1", min_length=1)

    @field_validator(
        "soft_timeout_s", "hard_timeout_s", "max_memory_mb", "renew_interval_s", "stall_check_s"
    )
    @classmethod
    def _positive(cls, value: float | None, info: Any) -> float | None:
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ValueError(f"must be a positive, finite number, got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSettings:
        check_timeouts(self.soft_timeout_s, self.hard_timeout_s)
        if self.renew_interval_s is not None and self.renew_interval_s > self.lease_s / 3:
            raise ConfigError(
                f"renew_interval_s ({self.renew_interval_s}) must be at most lease_s / 3 "
                f"({self.lease_s / 3:g}) so a lease survives a missed renewal"
            )
        return self

    @property
    def renew_every_s(self) -> float:
        return self.renew_interval_s or self.lease_s / 3

    @property
    def stall_every_s(self) -> float:
        return self.stall_check_s or min(self.lease_s / 2, 5.0)
