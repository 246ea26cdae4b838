"""The design document and the comments that cite it agree, and so do errors.py's drawn
tree and the classes it draws.

Comments say "design invariant N" (or "design invariants N and M"); N must be one of the
invariants docs/design.md numbers, and every test the document names as holding one must
exist, so neither side can drift from the other unnoticed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import sandboxq
import sandboxq.errors
from sandboxq.errors import SandboxqError

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"

#: Where comments may cite an invariant, and the files there that can hold one.
CITING = {
    "sandboxq": ("*.py", "*.lua"),
    "tests": ("*.py",),
    "bench": ("*.py",),
    "examples": ("*.py", "*.md"),
}

#: Any mention of a numbered invariant ("invariant N", "invariants N and M", "invariants K,
#: N and M", any case), and whether it is written the one way: "design invariant N".
MENTION = re.compile(
    r"(?P<design>\bdesign\s+)?\binvariants?\s+(?P<numbers>\d+(?:(?:\s*,\s*|\s+and\s+)\d+)*)",
    re.IGNORECASE,
)
HEADING = re.compile(r"^### (\d+)\. \S", re.MULTILINE)
TEST_REF = re.compile(r"`((?:tests|sandboxq/testing)/[\w/]+\.py)(?:::(\w+))?`")


def citing_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top, patterns in CITING.items():
        for pattern in patterns:
            files.extend(sorted((ROOT / top).rglob(pattern)))
    return [f for f in files if f.is_file()]


def mentions() -> list[tuple[str, str, bool, list[int]]]:
    """(where, as written, in the one form, the numbers) of every invariant cited."""
    found = []
    for path in citing_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in MENTION.finditer(line):
                numbers = [int(n) for n in re.findall(r"\d+", m["numbers"])]
                where = f"{path.relative_to(ROOT)}:{lineno}"
                found.append((where, m[0], m["design"] is not None, numbers))
    return found


def invariant_sections() -> dict[int, str]:
    """The document's invariants: number → the text of its section."""
    text = DESIGN.read_text(encoding="utf-8")
    starts = list(HEADING.finditer(text))
    assert starts, "docs/design.md numbers no invariant (### N. Title)"
    sections = {}
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        body = text[m.start() : end]
        sections[int(m[1])] = body.split("\n## ", 1)[0]  # the last one ends at the next part
    return sections


def test_the_document_numbers_its_invariants_one_to_n_each_held_and_tested() -> None:
    sections = invariant_sections()
    assert sorted(sections) == list(range(1, len(sections) + 1))
    for number, body in sections.items():
        assert "- Held by:" in body, f"invariant {number} names no code that holds it"
        assert "- Tested by:" in body, f"invariant {number} names no test"


def test_every_cited_invariant_is_in_the_document_and_cited_one_way() -> None:
    known = set(invariant_sections())
    found = mentions()
    assert len(found) > 30, "the search for citations found almost nothing: is it broken?"
    unknown = [(where, n) for where, _, _, numbers in found for n in numbers if n not in known]
    assert not unknown, f"invariants docs/design.md does not number: {unknown}"
    # One form everywhere, "design invariant N", so a reader knows where to look.
    bad = [(where, text) for where, text, one_form, _ in found if not one_form]
    assert not bad, f"write these as 'design invariant N': {bad}"


def test_the_readme_and_the_package_say_where_design_invariants_are() -> None:
    assert "docs/design.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/design.md" in (sandboxq.__doc__ or "")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_every_test_the_document_names_exists() -> None:
    named = 0
    for number, body in invariant_sections().items():
        tested_by = body.split("- Tested by:", 1)[1]
        refs = TEST_REF.findall(tested_by)
        assert refs, f"invariant {number}: no test path in its 'Tested by' line"
        for path, name in refs:
            where = ROOT / path
            assert where.exists(), f"invariant {number} names a missing test: {path}"
            if name:
                assert name in _test_names(where), f"invariant {number}: {path}::{name}?"
            named += 1
    assert named >= 13


# -- errors.py's drawn tree ----------------------------------------------------------------

#: A class in the drawing: at the left margin (a root) or after a branch (├── / └──).
TREE_NAME = re.compile(
    r"^(?P<indent>(?:[│ ]   )*(?:[├└]── )?)(?P<name>[A-Z]\w+)(?:\s+(?P<text>.*))?$"
)


def drawn_tree() -> dict[str, tuple[str | None, str]]:
    """errors.py's docstring tree: class name → (the parent drawn, its description, with
    the lines that continue it)."""
    drawn: dict[str, tuple[str | None, str]] = {}
    stack: list[tuple[int, str]] = []  # (column of a name, the name)
    last = None
    for line in (sandboxq.errors.__doc__ or "").splitlines():
        if not line.startswith("    ") or not line.strip():
            last = None  # a paragraph of prose ends the drawing
            continue
        m = TREE_NAME.match(line[4:])
        if m is None:
            if last is not None:  # a description that goes on
                parent, text = drawn[last]
                drawn[last] = (parent, text + " " + line.strip(" │"))
            continue
        column = len(m["indent"])
        while stack and stack[-1][0] >= column:
            stack.pop()
        last = m["name"]
        drawn[last] = (stack[-1][1] if stack else None, m["text"] or "")
        stack.append((column, last))
    return drawn


def test_errors_tree_in_the_docstring_is_the_class_hierarchy() -> None:
    drawn = drawn_tree()
    real = {
        name: cls
        for name, cls in vars(sandboxq.errors).items()
        if isinstance(cls, type)
        and issubclass(cls, BaseException)
        and cls.__module__ == "sandboxq.errors"
    }
    assert set(drawn) == set(real)
    for name, (parent, text) in drawn.items():
        cls = real[name]
        ours = [b for b in cls.__bases__ if b.__module__ == "sandboxq.errors"]
        assert [b.__name__ for b in ours] == ([parent] if parent else []), name
        # A builtin base besides ours is what `except ValueError` in user code catches:
        # the drawing says so ("also a ValueError").
        for base in cls.__bases__:
            if base.__module__ == "builtins" and ours:
                assert f"also an {base.__name__}" in text or f"also a {base.__name__}" in text, (
                    f"{name} is also a {base.__name__}: say so in errors.py's tree"
                )
    assert issubclass(real["SandboxqError"], Exception)
    assert not issubclass(real["SoftTimeout"], SandboxqError)
