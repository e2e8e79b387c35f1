"""nbval markers are written so that nbval sees them.

nbval matches a marker comment only when it stands alone on its line
(``# NBVAL_IGNORE_OUTPUT``): ``# NBVAL_IGNORE_OUTPUT  (timings)`` is silently
ignored, and the cell's varying output is then compared strictly.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
KNOWN = {"NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_CHECK_OUTPUT", "NBVAL_RAISES_EXCEPTION"}
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))


def malformed_markers(source: str) -> list[str]:
    """Comment lines that mention an nbval marker but that nbval would not recognise."""
    bad = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and "NBVAL_" in stripped and stripped.lstrip("#").strip() not in KNOWN:
            bad.append(stripped)
    return bad


def test_malformed_markers_are_found():
    assert malformed_markers("# NBVAL_IGNORE_OUTPUT  (timings)\nx = 1") == ["# NBVAL_IGNORE_OUTPUT  (timings)"]
    assert malformed_markers("# NBVAL_IGNORE_OUTPUT\n# (timings)\nx = 1") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_nbval_marker_stands_alone_on_its_line(path):
    notebook = nbformat.read(path, as_version=4)
    bad = [
        (index, line)
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for line in malformed_markers(cell.source)
    ]
    assert not bad, f"{path.name}: nbval does not recognise these marker lines (cell index, line): {bad}"
