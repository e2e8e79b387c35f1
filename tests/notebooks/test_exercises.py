"""The exercise mechanics: exercises/ is generated from solutions/ (no drift), and every
exercise notebook, executed as shipped, fails exactly at its check cells."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from mini_vllm.course import build

ROOT = Path(__file__).resolve().parents[2]
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]*_*.ipynb"))  # 05_…, 08b_…


def test_strip_solutions_keeps_indentation_and_everything_outside_the_markers():
    source = "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n\nprint(f)"
    assert build.strip_solutions(source) == ("def f(x):\n    '''doc'''\n    " + build.STUB + "\n\nprint(f)")


@pytest.mark.parametrize(
    "source", ["### BEGIN SOLUTION\nx = 1", "x = 1\n### END SOLUTION", "### BEGIN SOLUTION\n### BEGIN SOLUTION"]
)
def test_unbalanced_solution_markers_are_errors(source):
    with pytest.raises(ValueError):
        build.strip_solutions(source)


def test_exercises_are_generated_from_solutions_without_drift():
    assert build.drifted() == []
    assert len(EXERCISES) == len(build.solution_notebooks())


def test_drift_check_notices_an_edited_exercise(tmp_path, monkeypatch):
    solutions = tmp_path / "solutions"
    exercises = tmp_path / "exercises"
    solutions.mkdir()
    exercises.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")]
    nbformat.write(nb, solutions / "01_x.ipynb")
    monkeypatch.setattr(build, "ROOT", tmp_path)
    build.write_exercises()
    assert build.drifted() == []
    text = (exercises / "01_x.ipynb").read_text().replace("NotImplementedError", "NotImplemented")
    (exercises / "01_x.ipynb").write_text(text)
    assert build.drifted() != []


def _is_check_cell(cell) -> bool:
    return "check" in cell.metadata.get("tags", [])


@pytest.mark.parametrize("path", EXERCISES, ids=[p.name for p in EXERCISES])
def test_exercise_fails_exactly_at_its_check_cells(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    check_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and _is_check_cell(c)]
    assert check_cells, f"{path.name} has no cell tagged 'check'"
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    failed = {}
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                failed[index] = output["ename"]
    assert sorted(failed) == check_cells, (
        f"{path.name}: cells that failed {sorted(failed)} != check cells {check_cells}"
    )
    assert set(failed.values()) == {"NotImplementedError"}, failed
