"""Validated settings for the pool and the worker (pydantic, frozen, unknown names rejected).

Errors come out as ``ConfigError`` naming the setting, whichever door they came in by
(Python keyword, CLI flag, environment variable).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Annotated, Any, Literal, TypeVar

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

#: Longest interval between two background checks: ``threading.Event.wait`` overflows on
#: absurd timeouts, and a check that never comes is a setting nobody meant.
MAX_INTERVAL_S = 24 * 3600.0

#: A process exit status: what a handler's exit code can be mapped from.
ExitCode = Annotated[int, NUMBER_ONLY, Field(ge=0, le=255)]

M = TypeVar("M", bound=BaseModel)


def build(model: type[M], **values: Any) -> M:
    """Validate ``values`` into ``model``, turning pydantic's error into a ConfigError."""
    values = {k: _seconds(v) for k, v in values.items()}
    try:
        return model(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or model.__name__}: {e['msg']}"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid {model.__name__}: {problems}") from None


def _seconds(value: Any) -> Any:
    """Accept ``timedelta`` wherever a ``*_s`` duration is expected; convert once, here."""
    return value.total_seconds() if isinstance(value, timedelta) else value


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PoolSettings(_Settings):
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


class WorkerSettings(_Settings):
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
