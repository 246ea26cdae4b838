"""Validated settings for the pool and the worker (pydantic, frozen, unknown names rejected).

Each setting is stated once, as a model field: name, type, default, bounds, and a one-line
``description`` (``none=`` says what a default of None stands for; the unit is the name's
suffix: ``_s``, ``_mb``, ``_bytes``). One model per layer; the rest derives from the fields:

    ContainmentSettings      how a child is contained (control groups, rlimits)
     └─ ChildSettings        + the processor, how children start, an attempt's limits
         ├─ PoolSettings     + a bare pool's own  ◄─ Pool(...) keywords
         └─ WorkerSettings   + a worker's own     ◄─ SandboxWorker(...) keywords,
                                                     SANDBOXQ_<NAME> variables (from_env),
                                                     `sandboxq worker` / `run` flags
                                                     (cli/options.py), the README's table
                                                     (cli/settings_table.py)

The constructors keep explicit typed keywords (for users' type checkers and IDEs) and hand
their arguments over whole (``from_call``); tests/test_settings_docs.py holds their names
and defaults, the README and the flags equal to the fields.

Errors come out as ``ConfigError`` naming the setting, whichever door they came in by
(Python keyword, CLI flag, environment variable).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
from collections.abc import Collection, Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    model_validator,
)

from sandboxq.codec import DEFAULT_MAX_BYTES
from sandboxq.errors import ConfigError
from sandboxq.models import (
    DEFAULT_MAX_INFRA_DEATHS,
    FAILURE_TTL_S,
    MAX_MB,
    MAX_SECONDS,
    NUMBER_ONLY,
    RESULT_TTL_S,
    RETAIN_COMPLETED,
    RETAIN_FAILED,
    Action,
    check_budgets,
    check_timeouts,
    setting_field,
)

StartMethod = Literal["forkserver", "spawn"]
#: How children are contained (README "Containment"): control groups where the machine
#: allows them, else the process tree; or one of the two, forced.
ContainmentSetting = Literal["auto", "cgroup", "process_tree"]
#: Processes (threads included) one child and everything it starts may hold at once.
DEFAULT_MAX_PROCESSES = 1024

#: Longest interval between two background checks: ``threading.Event.wait`` overflows on
#: absurd timeouts, and a check that never comes is a setting nobody meant.
MAX_INTERVAL_S = 24 * 3600.0
#: The least ``pool_memory_mb`` may be: twice the pool's smallest margin (pool/budget.py,
#: MIN_MARGIN_MB = 16). Below it every attempt starts inside the margin, and with control
#: groups the kernel kills children as they start (1.5 MB: ``crashed``, not
#: ``memory_pressure``).
MIN_POOL_MEMORY_MB = 32.0

#: A process exit status: what a handler's exit code can be mapped from.
ExitCode = Annotated[int, NUMBER_ONLY, Field(ge=0, le=255)]

M = TypeVar("M", bound=BaseModel)

#: The worker settings that are its backend's retention options (README "Retention").
RETENTION_SETTINGS = ("result_ttl_s", "failure_ttl_s", "retain_completed", "retain_failed")

log = logging.getLogger("sandboxq.settings")


def build(model: type[M], **values: Any) -> M:
    """Validate ``values`` into ``model``, turning pydantic's error into a ConfigError."""
    values = {k: _seconds(v) for k, v in values.items()}
    try:
        return model(**values)
    except ValidationError as exc:
        raise invalid(model, exc) from None


def from_call(model: type[M], arguments: Mapping[str, Any]) -> M:
    """``model`` from a constructor's ``locals()``, taken as its first statement: every
    parameter that names a setting, as given or defaulted (the others, ``self`` included,
    are left out). tests/test_settings_docs.py holds the keywords and the fields equal."""
    return build(model, **{k: v for k, v in arguments.items() if k in model.model_fields})


#: Errors whose message already gives the value (the checks of this package say "got
#: ..."), or that have no one value to give.
_SHOWS_ITS_INPUT = frozenset({"value_error", "assertion_error", "missing", "extra_forbidden"})


def invalid(
    model: type[BaseModel], exc: ValidationError, names: Mapping[str, str] | None = None
) -> ConfigError:
    """One line listing every problem, each with the value given (a flag's value is known
    here only), and no link to pydantic's pages: what every reader of settings and options
    shows (a stored job's options too, read back). ``names`` renames a setting where a
    user knows it by another name (the environment variable it came from, shown with its
    value)."""
    names = names or {}
    problems = []
    for e in exc.errors():
        loc = [str(p) for p in e["loc"]]
        msg = e["msg"]
        if loc and loc[0] in names:  # the variable's name shows its value
            loc[0] = names[loc[0]]
        elif loc and e["type"] not in _SHOWS_ITS_INPUT:
            msg = f"{msg} (got {e['input']!r:.80})"
        # a check of the whole model (two settings together) names its settings itself
        problems.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
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
        error = invalid(model, exc, names)
        # A check of two settings together names its settings in its message: of the
        # variables set, those are the ones it is about (any other is beside the point).
        checks = " ".join(e["msg"] for e in exc.errors() if not e["loc"])
        named = [var for name, var in names.items() if re.search(rf"\b{name}\b", checks)]
        if named:
            error = ConfigError(f"{error} (from the environment: {', '.join(named)})")
        raise error from None


def _env_value(var: str, raw: str, annotation: Any) -> Any:
    """A variable's text as a setting's value: JSON where it parses (numbers, true/false,
    objects), else the text itself (names such as ``spawn``). The model then checks it as
    it checks a Python value, so a setting that takes numbers only is given a number."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to read as JSON
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


def _positive_finite(value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise ValueError(f"must be a positive, finite number, got {value!r}")
    return value


#: Put on a setting that must be a positive, finite number when it is given.
POSITIVE = AfterValidator(_positive_finite)


def _one_per_cpu(value: Any) -> Any:
    return (os.cpu_count() or 1) if value is None else value


#: None stands for the machine's CPU count (``concurrency``, ``size``); 0 stays an error.
ONE_PER_CPU = BeforeValidator(_one_per_cpu)
#: None stands for "no exit code mapped", so a keyword may default to None, not ``{}``.
NONE_IS_EMPTY = BeforeValidator(lambda value: {} if value is None else value)

Number = Annotated[float, NUMBER_ONLY]
Count = Annotated[int, NUMBER_ONLY]
CountOrNone = Annotated[int | None, NUMBER_ONLY]
#: A limit, when given: a positive, finite number. NaN and the infinities are refused
#: before a field's upper bound is checked, so they are not said to be too large.
Limit = Annotated[float | None, Field(allow_inf_nan=False), NUMBER_ONLY, POSITIVE]
#: An opt-in: only a real True turns it on, never 1 or "yes".
Switch = Annotated[bool, Strict()]


#: The largest uid or gid (``uid_t`` is 32 bits, and its all-ones value means "none").
MAX_ACCOUNT_ID = 2**32 - 2


def _named(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise ValueError("must name a user or group (a name or a number), got an empty text")
    if value is not None and value.isdecimal() and int(value) > MAX_ACCOUNT_ID:
        raise ValueError(f"a number must be at most {MAX_ACCOUNT_ID}, got {value:.40}")
    return value


#: A user or group, by name or number (a number from JSON or Python becomes its text).
Account = Annotated[
    str | None,
    BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v),
    AfterValidator(_named),
]
#: On by default: only a real False turns it off.
NetworkSwitch = Annotated[bool, Strict()]
#: How many children a pool keeps (a worker's ``concurrency``, a pool's ``size``).
Children = Annotated[int, NUMBER_ONLY, ONE_PER_CPU, Field(ge=1, le=1024)]


class ContainmentSettings(_Settings):
    """What the pool and the worker share about containing a child (README "Containment")."""

    containment: ContainmentSetting = setting_field(
        "auto",
        "control groups where writable, else process_tree (auto); groups or an error "
        "(cgroup); never groups (process_tree)",
    )
    max_processes: CountOrNone = setting_field(
        DEFAULT_MAX_PROCESSES,
        "pids limit of a child's control group, threads included (cgroup modes only)",
        none="no limit",
        ge=1,
        le=4_194_304,
    )
    cpu_time_s: Limit = setting_field(
        None,
        "CPU time per attempt (RLIMIT_CPU, whole seconds rounded up): outcome cpu_limit",
        none="no limit",
        le=MAX_INTERVAL_S,
    )
    max_open_files: CountOrNone = setting_field(
        None, "RLIMIT_NOFILE of a child", none="inherited", ge=16, le=2**20
    )
    max_file_size_mb: Limit = setting_field(
        None,
        "RLIMIT_FSIZE of a child: a larger write fails (EFBIG)",
        none="no limit",
        le=MAX_MB,
    )
    # RLIMIT_AS: address space is not memory; OpenBLAS reserves a buffer of it per thread
    max_address_space_mb: Limit = setting_field(
        None,
        "RLIMIT_AS of a child; opt-in only: it breaks numpy/OpenBLAS",
        none="no limit",
        le=MAX_MB,
    )
    core_dumps: Switch = setting_field(False, "let children write core files (for debugging)")
    keep_strays: Switch = setting_field(
        False, "let processes and threads an attempt started outlive it (they end with their child)"
    )
    max_child_growth_mb: Limit = setting_field(
        None,
        "replace a child whose resident memory grew by more than this since it started",
        none="never",
        le=MAX_MB,
    )
    user: Account = setting_field(
        None,
        "run children as this user (name or uid; the worker must run as root)",
        none="the worker's",
    )
    group: Account = setting_field(
        None, "run children with this group (name or gid)", none="the user's, else the worker's"
    )
    network: NetworkSwitch = setting_field(
        True,
        "children use the worker's network (off: each runs in a network namespace with "
        "loopback only; root)",
    )
    pid_namespace: Switch = setting_field(
        False,
        "children run in PID namespaces of their own: the kernel ends what each started "
        "when it dies",
    )


class ChildSettings(ContainmentSettings):
    """What the pool and the worker share: the processor, how its children start, and an
    attempt's limits (a job's own options win over these in the worker)."""

    #: Its form is checked where it is imported (processor.split_path), in one place.
    processor: str = setting_field(..., "the handler, as package.module:function")
    soft_timeout_s: Limit = setting_field(
        None,
        "an attempt's soft timeout: SoftTimeout raised in the handler",
        none="none",
        le=MAX_SECONDS,
    )
    hard_timeout_s: Limit = setting_field(
        None,
        "an attempt's hard timeout: the child's process tree killed",
        none="none",
        le=MAX_SECONDS,
    )
    max_memory_mb: Limit = setting_field(
        None,
        "the most an attempt's process tree may grow: outcome memory_limit",
        none="no limit",
        le=MAX_MB,
    )
    max_jobs_per_child: CountOrNone = setting_field(
        None, "replace a child after this many attempts", none="never", ge=1
    )
    pool_memory_mb: Limit = setting_field(
        None,
        "the children's memory together: near it the newest attempt ends (memory_pressure)",
        none="no budget",
        ge=MIN_POOL_MEMORY_MB,
        le=MAX_MB,
    )
    start_method: StartMethod = setting_field(
        "forkserver", "how children start: forkserver (the processor preloaded) or spawn"
    )
    capture_output: Switch = setting_field(
        True,
        "keep the last 8 KiB a child wrote to stdout and stderr with each attempt, and "
        "show it live as before (off: children write straight to the worker's own)",
    )
    import_timeout_s: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None,
        "how long importing the processor may take",
        none="$SANDBOXQ_IMPORT_TIMEOUT_S, else 60",
        gt=0,
        le=MAX_INTERVAL_S,
    )

    @model_validator(mode="after")
    def _consistent_limits(self) -> ChildSettings:
        memory, space = self.max_memory_mb, self.max_address_space_mb
        if space is not None and memory is not None and space < memory:
            raise ConfigError(
                f"max_address_space_mb ({space:g}) is below max_memory_mb ({memory:g}): "
                "the memory limit could never be reached"
            )
        check_timeouts(self.soft_timeout_s, self.hard_timeout_s)
        return self


class PoolSettings(ChildSettings):
    """``Pool``'s keywords: the shared settings and what only a bare pool has."""

    size: Children = setting_field(
        None, "children running attempts at once", none="one per CPU", validate_default=True
    )
    max_result_bytes: Count = setting_field(
        DEFAULT_MAX_BYTES, "the largest result a child may send back", ge=1
    )
    memory_check_interval_s: Number = setting_field(
        0.05, "how often a child's tree memory is sampled (process_tree mode)", gt=0, le=60
    )


class WorkerSettings(ChildSettings):
    """``SandboxWorker``'s keywords, ``sandboxq worker``'s flags and ``SANDBOXQ_*``
    variables: the shared settings and what only a worker has."""

    queue: str = setting_field(..., "the queue to work on", min_length=1)
    url: str | None = setting_field(None, "the backend's URL", none="$SANDBOXQ_URL, else memory://")
    concurrency: Children = setting_field(
        None, "children running jobs at once", none="one per CPU", validate_default=True
    )
    lease_s: Number = setting_field(
        30.0,
        "how long a claim holds a job unless renewed (then it is recovered elsewhere)",
        ge=0.3,
        le=24 * 3600,
        allow_inf_nan=False,
    )
    renew_interval_s: Limit = setting_field(
        None, "how often held leases are renewed", none="lease_s / 3", ge=0.01, le=MAX_INTERVAL_S
    )
    stall_check_s: Limit = setting_field(
        None,
        "how often expired leases (of any worker) are looked for and recovered",
        none="min(lease_s / 2, 5)",
        ge=0.01,
        le=MAX_INTERVAL_S,
    )
    retries: Count = setting_field(0, "retries after a failed attempt", ge=0, le=1000)
    max_infra_deaths: Count = setting_field(
        DEFAULT_MAX_INFRA_DEATHS,
        "deaths of the pool's helpers or of a worker while a job ran before it fails as poison",
        ge=1,
        le=1000,
    )
    max_queue_s: Limit = setting_field(
        None,
        "a job not started this long after it became runnable never starts: outcome expired",
        none="no limit",
        le=MAX_SECONDS,
    )
    deadline_s: Limit = setting_field(
        None,
        "a job's whole budget from enqueue, every attempt and backoff: outcome deadline",
        none="no limit",
        le=MAX_SECONDS,
    )
    progress_timeout_s: Limit = setting_field(
        None,
        "end an attempt that did not call progress() for this long: outcome progress_timeout",
        none="no watchdog",
        le=MAX_SECONDS,
    )
    memory_retry_factor: Limit = setting_field(
        None,
        "after a memory_limit attempt, retry with the limit times this (> 1)",
        none="off: memory_limit fails",
    )
    memory_retry_max_mb: Limit = setting_field(
        None,
        "the most memory_retry_factor may raise a job's limit to",
        none="no cap",
        le=MAX_MB,
    )
    exit_codes: Annotated[dict[ExitCode, Action], NONE_IS_EMPTY] = setting_field(
        None,
        "map a handler's exit code to complete, retry or fail",
        none="unknown codes fail",
        validate_default=True,
    )
    prefetch: CountOrNone = setting_field(
        None, "jobs claimed beyond the children", none="adaptive", ge=0, le=1000
    )
    stop_timeout_s: Number = setting_field(
        30.0,
        "how long a drain (SIGTERM, Ctrl-C) lets running jobs finish before they are "
        "killed; their soft signal comes half of it (at most 5 s) before",
        ge=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
    )
    allow_pickle: Switch = setting_field(
        False, "accept pickle payloads (only if every writer to the queue is trusted)"
    )
    # Prometheus metrics (sandboxq/observe/metrics.py). Loopback unless a host says otherwise: no
    # port opened on every interface.
    metrics_port: CountOrNone = setting_field(
        None,
        "serve Prometheus metrics on this port (0: a free one, logged)",
        none="off",
        ge=0,
        le=65535,
    )
    metrics_host: str = setting_field(
        "127.0.0.1", "the address metrics are served on", min_length=1
    )
    # Retention (README "Retention"; backends/rules.py): what the queue keeps of the jobs
    # this worker finishes. A job's own result_ttl_s / failure_ttl_s wins.
    result_ttl_s: Number = setting_field(
        RESULT_TTL_S,
        "keep a completed job (its result) this long",
        ge=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
    )
    failure_ttl_s: Number = setting_field(
        FAILURE_TTL_S,
        "keep a failed or cancelled job this long",
        ge=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
    )
    retain_completed: Count = setting_field(
        RETAIN_COMPLETED,
        "most completed jobs the queue keeps, whatever their age (trims are logged)",
        ge=0,
    )
    retain_failed: Count = setting_field(
        RETAIN_FAILED,
        "most failed jobs, and most cancelled ones, the queue keeps (trims are logged)",
        ge=0,
    )

    @property
    def retention(self) -> dict[str, float]:
        """The retention settings as backend options (``backends.rules.Retention``)."""
        return {name: getattr(self, name) for name in RETENTION_SETTINGS}

    @model_validator(mode="after")
    def _renew_within_lease(self) -> WorkerSettings:
        if self.renew_interval_s is not None and self.renew_interval_s > self.lease_s / 3:
            raise ConfigError(
                f"renew_interval_s ({self.renew_interval_s}) must be at most lease_s / 3 "
                f"({self.lease_s / 3:g}) so a lease survives a missed renewal"
            )
        check_budgets(
            self.max_queue_s, self.deadline_s, self.progress_timeout_s, self.hard_timeout_s
        )
        self._check_memory_retries()
        return self

    def _check_memory_retries(self) -> None:
        factor, cap, limit = self.memory_retry_factor, self.memory_retry_max_mb, self.max_memory_mb
        if factor is not None and factor <= 1:
            raise ConfigError(
                f"memory_retry_factor ({factor:g}) must be above 1: a retry after "
                "memory_limit needs more memory than max_memory_mb gave it"
            )
        if cap is not None and limit is not None and cap < limit:
            raise ConfigError(
                f"memory_retry_max_mb ({cap:g}) is under max_memory_mb ({limit:g}): "
                "the cap would lower the limit it raises"
            )

    @property
    def renew_every_s(self) -> float:
        return self.renew_interval_s or self.lease_s / 3

    @property
    def stall_every_s(self) -> float:
        return self.stall_check_s or min(self.lease_s / 2, 5.0)
