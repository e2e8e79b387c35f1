"""The instructors' progress table: generated learner folders, one all solved, one partly wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from mini_vllm.entrypoints.cli import main as cli_main
from mini_vllm.course import grade

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["03_block_tables.ipynb", "05_prefix_hits.ipynb"]  # quick to run up to their check cells


def _with_a_miss_skipped(source: Path, target: Path) -> None:
    """The chapter 05 solution with the classic mistake: continue past a miss instead of stopping."""
    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        if "def find_longest_cache_hit" in cell.source:
            assert "break  # the first miss ends the prefix" in cell.source
            cell.source = cell.source.replace("break  # the first miss ends the prefix", "continue")
    nbformat.write(nb, target)


@pytest.fixture(scope="module")
def submissions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submitted")
    alice = folder / "alice" / "week1"  # nbgrader's submitted/<learner>/<assignment>/ layout
    bob = folder / "bob"
    alice.mkdir(parents=True)
    bob.mkdir()
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "solutions" / name, alice / name)
    shutil.copy(ROOT / "exercises" / NOTEBOOKS[0], bob / NOTEBOOKS[0])  # not started: the stub
    _with_a_miss_skipped(ROOT / "solutions" / NOTEBOOKS[1], bob / NOTEBOOKS[1])
    return folder


@pytest.fixture(scope="module")
def graded(submissions, tmp_path_factory):
    """One run of the command, as an instructor types it; its table and its JSON."""
    json_path = tmp_path_factory.mktemp("out") / "progress.json"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["grade", str(submissions), "--json", str(json_path), "--timeout", "300"]) == 0
    return out.getvalue(), json.loads(json_path.read_text())


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
def test_every_check_of_the_solved_notebooks_passes(graded):
    table, results = graded
    alice = [r for r in results if r["learner"] == "alice"]
    assert [(r["notebook"], r["check"], r["status"]) for r in alice] == [
        ("03_block_tables.ipynb", "check_slot_mapping", "pass"),
        ("05_prefix_hits.ipynb", "check_find_longest_cache_hit", "pass"),
    ]
    assert "alice: 2 of 2 checks pass" in table


def test_a_stub_and_a_wrong_implementation_are_told_apart(graded):
    table, results = graded
    bob = {r["notebook"]: r for r in results if r["learner"] == "bob"}
    assert bob["03_block_tables.ipynb"]["status"] == "not done"
    wrong = bob["05_prefix_hits.ipynb"]
    assert wrong["status"] == "FAIL"
    assert "a miss at block 2" in wrong["message"]  # the first line of the check's message
    assert "bob: 0 of 2 checks pass" in table and "not done" in table and "FAIL" in table


def test_learners_are_found_in_either_layout(submissions, tmp_path):
    learners = grade.learners_in(submissions)
    assert sorted(learners) == ["alice", "bob"] and all(len(paths) == 2 for paths in learners.values())
    single = tmp_path / "carol"
    single.mkdir()
    shutil.copy(ROOT / "exercises" / NOTEBOOKS[0], single / NOTEBOOKS[0])
    assert list(grade.learners_in(single)) == ["carol"]
    with pytest.raises(ValueError, match="FOLDER"):
        grade.learners_in(tmp_path / "missing")


def test_the_table_format_is_one_block_per_learner():
    results = [
        grade.CheckResult("ann", "02_x.ipynb", "check_free_queue", 5, "pass"),
        grade.CheckResult("ann", "03_y.ipynb", "check_slot_mapping", 5, "FAIL", "compute_slot_mapping: " + "x" * 300),
    ]
    table = grade.format_table(results, width=100)
    lines = table.splitlines()
    assert lines[0] == "ann: 1 of 2 checks pass"
    assert all(len(line) <= 100 for line in lines) and lines[2].endswith("…")
