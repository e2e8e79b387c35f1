"""Registering a check is one decorator: every check a notebook imports is registered and exported,
and every part a check keeps belongs to a chapter."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

import mini_vllm.course as course
from mini_vllm.course._harness import CHECKS, guarded_check
from mini_vllm.course.parts import PARTS, PARTS_BY_KEY

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for folder in ("notebooks", "solutions", "exercises") for p in (ROOT / folder).glob("*.ipynb"))


def checks_imported(source: str) -> set[str]:
    """The ``check_*`` names a cell's code imports from ``mini_vllm.course``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "mini_vllm.course":
            names |= {alias.name for alias in node.names if alias.name.startswith("check_")}
    return names


def unregistered_checks(source: str) -> set[str]:
    return {name for name in checks_imported(source) if name not in CHECKS or not hasattr(course, name)}


def notebook_code(path: Path) -> str:
    cells = nbformat.read(path, as_version=4).cells
    code = [cell.source for cell in cells if cell.cell_type == "code" and not cell.source.lstrip().startswith("%")]
    return "\n".join(line for line in "\n".join(code).splitlines() if not line.lstrip().startswith(("%", "!")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_check_a_notebook_imports_is_registered_and_exported(path):
    assert unregistered_checks(notebook_code(path)) == set()


def test_the_notebook_scan_finds_an_unregistered_check():
    # The known-wrong case: an import of a check nobody registered is reported.
    source = "from mini_vllm.course import check_free_queue, check_that_does_not_exist, show_source"
    assert checks_imported(source) == {"check_free_queue", "check_that_does_not_exist"}
    assert unregistered_checks(source) == {"check_that_does_not_exist"}


def test_the_notebooks_import_checks_at_all():
    assert set().union(*(checks_imported(notebook_code(path)) for path in NOTEBOOKS)) == set(CHECKS)


def test_every_registered_check_is_exported_and_named_in_all():
    assert CHECKS, "no check registered: the *_checks modules were not imported"
    for name, check in CHECKS.items():
        assert getattr(course, name) is check
        assert name in course.__all__


def test_every_part_a_check_keeps_has_a_chapter_and_every_part_a_check():
    kept = {check.part for check in CHECKS.values() if check.part is not None}
    assert kept == set(PARTS_BY_KEY)
    for part in PARTS:
        assert re.fullmatch(r"\d\d[a-z]?", part.chapter), part  # 05, or a split chapter such as 08b


def test_guarded_check_refuses_an_unknown_part():
    with pytest.raises(ValueError, match="part='no_such_part'"):
        guarded_check(part="no_such_part")


def test_guarded_check_refuses_a_name_that_is_not_a_check():
    with pytest.raises(ValueError, match="'verify_something' must be named check_"):

        def verify_something():
            pass

        guarded_check()(verify_something)
