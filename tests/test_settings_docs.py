"""Each setting is stated once, as a field of its settings model; everything that names a
setting again is held equal to the field here: the keywords of ``Pool`` and
``SandboxWorker``, the README's tables and variables, and the flags of ``sandboxq worker``,
``sandboxq run`` and ``sandboxq enqueue``. A setting added in one place and not the others
fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from sandboxq import Pool, SandboxWorker
from sandboxq.backends import URL_ENV
from sandboxq.cli import build_parser
from sandboxq.cli.options import setting_flags
from sandboxq.cli.settings_table import table
from sandboxq.cli.worker import NOT_FROM_ENV, WORKER_FLAGS, parse_exit_codes, settings
from sandboxq.processor import IMPORT_TIMEOUT_ENV
from sandboxq.pytest_plugin import URL_ENV as TEST_URL_ENV
from sandboxq.settings import PoolSettings, WorkerSettings, env_var

README = (Path(__file__).parent.parent / "README.md").read_text()

#: Keywords that are no setting: how the worker opens its backend.
NOT_SETTINGS = {"self", "backend_options"}


@pytest.mark.parametrize(
    ("constructor", "model"), [(Pool, PoolSettings), (SandboxWorker, WorkerSettings)]
)
def test_each_constructor_keyword_is_a_setting_with_its_default(
    constructor: type, model: type[BaseModel]
) -> None:
    parameters = {
        name: p
        for name, p in inspect.signature(constructor).parameters.items()
        if name not in NOT_SETTINGS
    }
    assert set(parameters) == set(model.model_fields), "a setting without a keyword"
    for name, parameter in parameters.items():
        field = model.model_fields[name]
        if field.is_required():
            assert parameter.default is inspect.Parameter.empty, name
        else:
            assert parameter.default == field.get_default(call_default_factory=True), name


def test_the_readme_settings_table_is_the_generated_one() -> None:
    """Regenerate it with ``python -m sandboxq.cli.settings_table`` after changing a field."""
    found = re.search(
        r"<!-- settings table: python -m sandboxq.cli.settings_table -->\n(.*?)"
        r"<!-- end of settings table -->",
        README,
        re.S,
    )
    assert found, "the README lost its settings table"
    assert found[1] == table()


def _readme_value(text: str) -> Any:
    text = text.strip("` ").lower()
    words = {"none": None, "false": False, "true": True}
    if text in words:
        return words[text]
    try:
        return float(text)
    except ValueError:
        return text


def test_the_readmes_other_setting_tables_give_the_models_defaults() -> None:
    """The Containment and Pool sections explain some settings at length, by hand."""
    by_hand = re.sub(
        r"<!-- settings table:.*?<!-- end of settings table -->", "", README, flags=re.S
    )
    fields = {**PoolSettings.model_fields, **WorkerSettings.model_fields}
    rows = [
        (name, default)
        for name, default in re.findall(r"^\| `(\w+)` \| ([^|]+) \|", by_hand, re.M)
        if name in fields
    ]
    assert len(rows) >= 10, "the hand-written tables were not found"
    for name, default in rows:
        assert _readme_value(default) == fields[name].get_default(call_default_factory=True), name


def test_every_variable_the_readme_names_is_a_setting() -> None:
    known = {env_var(name) for name in WorkerSettings.model_fields if name not in NOT_FROM_ENV}
    assert env_var("url") == URL_ENV and env_var("import_timeout_s") == IMPORT_TIMEOUT_ENV
    known |= {URL_ENV, TEST_URL_ENV}
    named = set(re.findall(r"SANDBOXQ_[A-Z0-9_]+", README))
    assert named - known == set()


def _flags(verb: str) -> set[str]:
    parser = build_parser()
    [verbs] = [a for a in parser._actions if a.dest == "verb"]
    sub = verbs.choices[verb]  # type: ignore[index]
    return {option for a in sub._actions for option in a.option_strings} - {"-h", "--help"}


def test_the_readme_shows_the_flags_of_worker_run_and_enqueue() -> None:
    [row] = re.findall(r"^\| `sandboxq worker QUEUE PROCESSOR ([^`]*)`", README, re.M)
    # --url: every verb that reaches Redis takes it, as the README says above the table
    assert set(re.findall(r"--[a-z-]+", row)) == _flags("worker") - {"--url"}
    [usage] = re.findall(r"^sandboxq run PROCESSOR INPUT.jsonl (.*?)```", README, re.M | re.S)
    assert set(re.findall(r"--[a-z-]+", usage)) <= _flags("run")
    [row] = re.findall(r"^\| `sandboxq enqueue QUEUE ([^`]*)`", README, re.M)
    assert set(re.findall(r"--[a-z-]+", row)) == _flags("enqueue") - {"--url", "--json"}


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SANDBOXQ_LEASE_S", "5")
    monkeypatch.setenv("SANDBOXQ_RETRIES", "4")
    monkeypatch.setenv("SANDBOXQ_ALLOW_PICKLE", "false")
    argv = "worker q a.b:c --lease-s 2 --allow-pickle --exit-code 3=retry --exit-code 4=fail"
    args = build_parser().parse_args(argv.split())
    flags = setting_flags(args, WORKER_FLAGS)
    flags["exit_codes"] = parse_exit_codes(flags["exit_codes"])
    s = settings(args, queue="q", url="redis://unused", **flags)
    assert (s.lease_s, s.retries, s.allow_pickle) == (2.0, 4, True)
    assert s.exit_codes == {3: "retry", 4: "fail"}
    assert (s.stop_timeout_s, s.metrics_port) == (30.0, None)  # the model's defaults
