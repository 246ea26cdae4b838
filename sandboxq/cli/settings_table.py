"""The README's settings table, made from the settings models and the worker's parser:
``python -m sandboxq.cli.settings_table`` prints it; tests/test_settings_docs.py checks that
the README holds exactly this.

    settings.py fields ─┬─ name, default, bounds, description ─┐
    `sandboxq worker` ──┴─ its flag, SANDBOXQ_<NAME> ───────────┴─► one row per setting

Rows come layer by layer: the worker's own settings, the bare pool's own, then those the
two share (settings.py draws the layers).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Literal, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sandboxq.cli import worker
from sandboxq.cli.options import default_text, unit, value_type
from sandboxq.settings import (
    POSITIVE,
    ChildSettings,
    ContainmentSettings,
    PoolSettings,
    WorkerSettings,
    env_var,
)

LAYERS: tuple[type[BaseModel], ...] = (WorkerSettings, PoolSettings, ChildSettings)
HEADER = (
    "| setting | for | values | default | `sandboxq worker` flag, variable | what it does |\n"
    "|---|---|---|---|---|---|\n"
)


def table() -> str:
    doors = _worker_doors()
    rows = []
    for layer in LAYERS:
        declared = vars(layer)["__annotations__"]
        if layer is ChildSettings:  # the shared layer includes containment's fields
            declared = {**declared, **vars(ContainmentSettings)["__annotations__"]}
        for name in declared:
            field = layer.model_fields[name]
            cells = (
                f"`{name}`",
                _users(name),
                _values(name, field),
                default_text(name, field),
                doors.get(name, ""),
                str(field.description),
            )
            rows.append("| " + " | ".join(cells) + " |\n")
    return HEADER + "".join(rows)


def _users(name: str) -> str:
    users: dict[str, type[BaseModel]] = {"pool": PoolSettings, "worker": WorkerSettings}
    return ", ".join(user for user, model in users.items() if name in model.model_fields)


def _values(name: str, field: FieldInfo) -> str:
    kind = value_type(field)
    if get_origin(kind) is Literal:
        return ", ".join(f"`{choice}`" for choice in get_args(kind))
    if get_origin(kind) is dict:
        return "exit code 0-255: `complete`, `retry` or `fail`"
    # what a value is: the unit its name carries, else its type
    words = {bool: "true / false", int: "integer", float: "number", str: "text"}
    return " ".join([unit(name) or words.get(kind, str(kind)), *_bounds(field)])


def _bounds(field: FieldInfo) -> list[str]:
    """``> 0, ≤ 86400``: the field's bounds, the lower one first."""
    marks = {
        type(b): f"{sign} {_number(getattr(b, attr))}"
        for b in field.metadata
        for kind, (sign, attr) in _SIGNS.items()
        if isinstance(b, kind)
    }
    if POSITIVE in field.metadata and not marks.keys() & {Gt, Ge}:
        marks[Gt] = "> 0"
    ordered = [marks[kind] for kind in _SIGNS if kind in marks]
    return [", ".join(ordered)] if ordered else []


#: Bound type -> its sign and the attribute holding its value, lower bounds first.
_SIGNS: dict[type, tuple[str, str]] = {
    Gt: (">", "gt"),
    Ge: ("≥", "ge"),
    Lt: ("<", "lt"),
    Le: ("≤", "le"),
}


def _number(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)


def _worker_doors() -> dict[str, str]:
    """Setting name -> how ``sandboxq worker`` takes it: its flag and its variable."""
    verbs = argparse.ArgumentParser().add_subparsers()
    worker.add_parser(verbs)
    doors: dict[str, list[str]] = {}
    for action in verbs.choices["worker"]._actions:
        if action.dest in WorkerSettings.model_fields:
            option = action.option_strings[0] if action.option_strings else action.dest.upper()
            metavar = f" {action.metavar}" if action.metavar and action.option_strings else ""
            doors[action.dest] = [f"`{option}{metavar}`"]
    for name in WorkerSettings.model_fields:
        if name not in worker.NOT_FROM_ENV or name == "url":  # SANDBOXQ_URL: the backend's
            doors.setdefault(name, []).append(f"`{env_var(name)}`")
    return {name: ", ".join(ways) for name, ways in doors.items()}


if __name__ == "__main__":
    print(table(), end="")
