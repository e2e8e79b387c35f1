"""Build the course notebooks: ``python -m mini_vllm.course.build {exercises,execute,check-drift,chapter-tables}``.

* ``exercises``: write ``exercises/NN_*.ipynb`` from ``solutions/NN_*.ipynb``.
  Solutions are the single source: every region between ``### BEGIN SOLUTION``
  and ``### END SOLUTION`` becomes ``raise NotImplementedError(...)`` at the
  same indentation, and all outputs are cleared.
* ``execute PATH...``: run notebooks top to bottom in place (``make
  notebooks``), then clean them for committing: widget state is stripped from
  the metadata and the live-widget output is dropped from each display, so the
  committed notebook shows the static HTML snapshot every widget also carries
  (GitHub, nbviewer, and JupyterLab before the cell is re-run).
* ``check-drift``: exit 1 if ``exercises/`` is not what ``exercises`` would write.
* ``chapter-tables``: rewrite the chapter table of README.md, notebooks/README.md
  and chapter 00 from ``mini_vllm/course/chapters.py`` (``make exercises`` runs it).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import nbformat

from ..tools.paths import REPO_ROOT
from ._harness import STUB_MESSAGE

ROOT = REPO_ROOT
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STUB = f'raise NotImplementedError("{STUB_MESSAGE}: see the instructions above")'


def strip_solutions(source: str) -> str:
    """Replace each solution region (markers included) by a stub at the marker's indentation."""
    out: list[str] = []
    inside = False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError("nested ### BEGIN SOLUTION")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + STUB)
        elif stripped.startswith(END):
            if not inside:
                raise ValueError("### END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("### BEGIN SOLUTION without END")
    return "\n".join(out)


def make_exercise(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    exercise = copy.deepcopy(solution)
    for cell in exercise.cells:
        if cell.cell_type != "code":
            continue
        cell.source = strip_solutions(cell.source)
        cell.outputs = []
        cell.execution_count = None
    exercise.metadata.pop("widgets", None)
    return exercise


def exercise_path(solution_path: Path) -> Path:
    return ROOT / "exercises" / solution_path.name


def solution_notebooks() -> list[Path]:
    return sorted((ROOT / "solutions").glob("[0-9][0-9]*_*.ipynb"))  # 05_…, 08b_…


def write_exercises() -> None:
    for path in solution_notebooks():
        exercise = make_exercise(nbformat.read(path, as_version=4))
        target = exercise_path(path)
        target.parent.mkdir(exist_ok=True)
        nbformat.write(exercise, target)
        print(f"wrote {target.relative_to(ROOT)}")


def drifted() -> list[str]:
    problems = []
    for path in solution_notebooks():
        target = exercise_path(path)
        # nbformat.write ends the file with a newline; writes() does not.
        expected = nbformat.writes(make_exercise(nbformat.read(path, as_version=4))) + "\n"
        if not target.exists():
            problems.append(f"{target.relative_to(ROOT)} is missing")
        elif target.read_text() != expected:
            problems.append(f"{target.relative_to(ROOT)} differs from what {path.relative_to(ROOT)} generates")
    return problems


def clean_for_commit(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Strip what must not be committed: widget state, live-widget views, timing metadata."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        for output in cell.outputs:
            data = output.get("data")
            if data and WIDGET_VIEW in data and len(data) > 1:
                del data[WIDGET_VIEW]
        # A display whose only content was the live view would render as an error without a kernel.
        cell.outputs = [o for o in cell.outputs if not (o.get("data") and set(o["data"]) == {WIDGET_VIEW})]
    return nb


def execute(paths: list[Path], timeout: int = 900) -> None:
    """Run ``paths`` in order, in place. The learner's parts (``MINI_VLLM_PARTS``) go to one fresh
    folder for the whole run, as in the nbval run: what the solutions keep never depends on
    what an earlier session left behind."""
    import os
    import tempfile

    from .parts import PARTS_ENV

    with tempfile.TemporaryDirectory(prefix="mini-vllm-parts-") as parts_folder:
        previous = os.environ.get(PARTS_ENV)
        os.environ[PARTS_ENV] = parts_folder
        try:
            _execute(paths, timeout)
        finally:
            if previous is None:
                os.environ.pop(PARTS_ENV, None)
            else:
                os.environ[PARTS_ENV] = previous


def _execute(paths: list[Path], timeout: int) -> None:
    from nbclient import NotebookClient

    for path in paths:
        nb = nbformat.read(path, as_version=4)
        print(f"executing {path} ...", flush=True)
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
        nbformat.write(clean_for_commit(nb), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.course.build")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("exercises")
    sub.add_parser("check-drift")
    sub.add_parser("chapter-tables")
    run = sub.add_parser("execute")
    run.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "exercises":
        write_exercises()
    elif args.command == "check-drift":
        problems = drifted()
        for problem in problems:
            print(problem)
        return 1 if problems else 0
    elif args.command == "chapter-tables":
        from .chapters import write_chapter_tables

        for name in write_chapter_tables():
            print(f"wrote the chapter table of {name}")
    else:
        execute(args.paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
