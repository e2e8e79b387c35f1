"""For instructors: run a folder of learners' exercise notebooks headless and print their progress.

    python -m mini_vllm grade SUBMISSIONS        (or: make grade DIR=SUBMISSIONS)

``SUBMISSIONS`` holds one folder per learner (``SUBMISSIONS/alice/...``), each
with exercise notebooks anywhere below it (nbgrader's
``submitted/<learner>/<assignment>/`` layout works as it is). A folder that
holds notebooks directly is graded as one learner.

Each notebook runs in a fresh kernel, from its own folder, top to bottom up to
its last check cell (a cell tagged ``check`` that calls a ``check_*``
function; the cells after it are demos; ``--all-cells`` runs them too and
reports every tagged cell, the engine runs with the learner's code included). Every learner gets a fresh, private parts folder
(``$MINI_VLLM_PARTS``), so one learner's kept parts never reach another's
engine. The table has one row per check cell: ``pass``, ``FAIL`` with the first
line of the check's message, ``not done`` (still the exercise stub),
``error`` (a cell before it failed, with that cell's error) or ``timeout``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat

from .parts import PARTS_ENV

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A course check is called by its bare name (imported from mini_vllm.course); a method such as
# manager.check_invariants() in an engine cell is not one.
_CHECK_CALL = re.compile(r"(?<![.\w])(check_\w+)\s*\(")


@dataclass
class CheckResult:
    learner: str
    notebook: str
    check: str  # the check function the cell calls (check_free_queue, ...)
    cell: int
    status: str  # pass | FAIL | not done | error | timeout | not run
    message: str = ""


def _is_check_cell(cell, all_cells: bool = False) -> bool:
    """A cell tagged 'check' that calls a ``check_*`` function (with ``all_cells``: any tagged cell,
    e.g. the cells that run the engine with the learner's code)."""
    tagged = cell.cell_type == "code" and "check" in cell.metadata.get("tags", [])
    return tagged and (all_cells or _CHECK_CALL.search(cell.source) is not None)


def _check_name(cell, index: int) -> str:
    match = _CHECK_CALL.search(cell.source)
    return match.group(1) if match else f"cell {index} (engine run)"


def _first_line(text: str) -> str:
    text = _ANSI.sub("", text).strip()
    return text.splitlines()[0] if text else ""


def _cell_error(cell) -> dict | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            return output
    return None


@contextlib.contextmanager
def _environment(**values: str):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def grade_notebook(
    path: Path, learner: str, parts_folder: Path, timeout: int = 600, all_cells: bool = False
) -> list[CheckResult]:
    """Execute one notebook (a copy, in memory) and return one result per check cell."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    check_indices = [i for i, cell in enumerate(nb.cells) if _is_check_cell(cell, all_cells)]
    if not check_indices:
        return []
    if not all_cells:
        nb.cells = nb.cells[: check_indices[-1] + 1]
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(path.parent)}},
    )
    stopped = ""
    with _environment(**{PARTS_ENV: str(parts_folder)}):
        try:
            client.execute()
        except CellTimeoutError:
            stopped = "timeout"
        except DeadKernelError as error:
            stopped = f"the kernel died: {_first_line(str(error))}"
    results = []
    earlier_error = ""  # the first error in a cell that is not a check cell
    for index, cell in enumerate(nb.cells):
        error = _cell_error(cell) if cell.cell_type == "code" else None
        if not _is_check_cell(cell, all_cells):
            if error and not earlier_error:
                earlier_error = f"cell {index} raised {error['ename']}: {_first_line(error.get('evalue', ''))}"
            continue
        result = CheckResult(learner, path.name, _check_name(cell, index), index, "pass")
        ran = cell.get("execution_count") is not None or bool(cell.get("outputs"))
        if error is not None:
            if error["ename"] == "NotImplementedError":
                result.status = "not done"
                if earlier_error:
                    result.message = earlier_error
            else:
                result.status = "FAIL"
                result.message = _first_line(error.get("evalue", "")) or error["ename"]
                if error["ename"] not in ("CheckFailure", "AssertionError"):
                    result.status = "error"
                    result.message = f"{error['ename']}: {result.message}"
        elif not ran:
            result.status = "timeout" if stopped == "timeout" else "not run"
            result.message = stopped if stopped and stopped != "timeout" else earlier_error
        results.append(result)
    return results


def learners_in(folder: Path) -> dict[str, list[Path]]:
    """learner name -> their exercise notebooks (sorted), for a submissions folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"FOLDER must be a directory of learners' notebooks, got {str(folder)!r}")

    def notebooks(root: Path) -> list[Path]:
        return sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)

    direct = sorted(folder.glob("*.ipynb"))
    if direct:
        return {folder.name: notebooks(folder)}
    learners = {sub.name: notebooks(sub) for sub in sorted(folder.iterdir()) if sub.is_dir()}
    return {name: paths for name, paths in learners.items() if paths}


def grade(folder: Path, timeout: int = 600, all_cells: bool = False) -> list[CheckResult]:
    results = []
    for learner, paths in learners_in(folder).items():
        with tempfile.TemporaryDirectory(prefix=f"parts-{learner}-") as parts_folder:
            for path in paths:
                results.extend(grade_notebook(path, learner, Path(parts_folder), timeout, all_cells))
    return results


def format_table(results: list[CheckResult], width: int = 110) -> str:
    """One table per learner: notebook, check, result, the first failure message; then a summary line."""
    lines = []
    learners = list(dict.fromkeys(r.learner for r in results))
    for learner in learners:
        mine = [r for r in results if r.learner == learner]
        passed = sum(r.status == "pass" for r in mine)
        lines.append(f"{learner}: {passed} of {len(mine)} checks pass")
        nb_width = max(len(r.notebook) for r in mine)
        check_width = max(len(r.check) for r in mine)
        for r in mine:
            row = f"  {r.notebook:<{nb_width}}  {r.check:<{check_width}}  {r.status:<8}"
            if r.message:
                room = max(20, width - len(row) - 2)
                message = r.message if len(r.message) <= room else r.message[: room - 1] + "…"
                row += f"  {message}"
            lines.append(row)
        lines.append("")
    return "\n".join(lines).rstrip() if lines else "no exercise notebooks with check cells found"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm grade", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="one folder per learner, their exercise notebooks inside")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    parser.add_argument("--all-cells", action="store_true", help="also run the cells after the last check")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    try:
        results = grade(args.folder, args.timeout, args.all_cells)
    except ValueError as error:
        parser.error(str(error))
    print(format_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
