"""Every chapter in notebooks/ is listed in the three chapter tables (README.md,
notebooks/README.md, chapter 00), the tables are the one written from
``mini_vllm/course/chapters.py``, and a chapter's closing "Next: chapter NN" names the
chapter that follows it. Adding or splitting a chapter (06b, 08b, 09b): add it to
``chapters.py`` and run ``python -m mini_vllm.course.build chapter-tables``."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9A-Z][0-9_]*.ipynb"))  # the Makefile's NOTEBOOKS glob


def chapter_number(path: Path) -> str:
    """``09b_sharing_a_cache_safely.ipynb`` -> ``09b``; ``A_from_...`` -> ``A``."""
    return path.name.split("_", 1)[0]


def table_numbers(markdown: str) -> set[str]:
    """The first column of every ``| 09b | ... |`` row of a chapter table."""
    return set(re.findall(r"^\| (\d\d[a-z]?|[A-Z]) \|", markdown, flags=re.MULTILINE))


def welcome_markdown() -> str:
    nb = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def closing_next(path: Path) -> str | None:
    """The chapter named by "Next: chapter NN" / "Next, chapter NN" in the last markdown cell."""
    nb = nbformat.read(path, as_version=4)
    last = [c.source for c in nb.cells if c.cell_type == "markdown"][-1]
    found = re.search(r"Next[:,] \**chapter (\w+)\**", last)
    return found.group(1) if found else None


def test_the_glob_finds_the_split_chapters():
    numbers = [chapter_number(p) for p in CHAPTERS]
    assert numbers.index("09") + 1 == numbers.index("09b")  # sorted: "_" < "b"
    assert numbers.index("08") + 1 == numbers.index("08b")
    assert {"00", "06b", "08b", "09", "09b", "10", "A"} <= set(numbers)


@pytest.mark.parametrize("table", ["README.md", "notebooks/README.md", "00_welcome"])
def test_every_chapter_is_in_every_chapter_table(table):
    markdown = welcome_markdown() if table == "00_welcome" else (ROOT / table).read_text()
    listed = table_numbers(markdown)
    missing = [chapter_number(p) for p in CHAPTERS if chapter_number(p) not in listed]
    assert not missing, f"{table} has no row for chapter(s) {missing}"


def test_a_missing_row_is_caught():
    table = "| # | chapter |\n|---|---|\n| 09 | prompt caching |\n| 10 | benchmarks |\n"
    assert "09b" not in table_numbers(table)  # so the test above would fail without the 09b row
    assert table_numbers(table + "| 09b | sharing |\n") == {"09", "10", "09b"}


@pytest.mark.parametrize("index", range(len(CHAPTERS) - 1), ids=[p.stem for p in CHAPTERS[:-1]])
def test_next_names_the_following_chapter(index):
    named = closing_next(CHAPTERS[index])
    if named is not None:
        assert named == chapter_number(CHAPTERS[index + 1]), f"{CHAPTERS[index].name} says Next: chapter {named}"


def test_a_wrong_next_is_caught(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 09"), nbformat.v4.new_markdown_cell("Next: **chapter 10** measures.")]
    path = tmp_path / "09_x.ipynb"
    nbformat.write(nb, path)
    assert closing_next(path) == "10" != "09b"  # 09's Next must name 09b, so this one would fail


def test_the_chapter_list_is_the_notebooks_folder():
    from mini_vllm.course import chapters as manifest

    assert [c.notebook for c in manifest.CHAPTERS] == [p.name for p in CHAPTERS]
    assert all(c.notebook.split("_", 1)[0] == c.number for c in manifest.CHAPTERS)


def test_every_table_is_the_one_written_from_the_chapter_list():
    from mini_vllm.course.chapters import tables_out_of_date

    stale = tables_out_of_date()
    assert not stale, f"{stale}: run `python -m mini_vllm.course.build chapter-tables`"


def test_a_table_edited_by_hand_is_caught(tmp_path):
    import shutil

    from mini_vllm.course.chapters import TABLE_FILES, tables_out_of_date, write_chapter_tables

    for name in TABLE_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    assert tables_out_of_date(tmp_path) == []
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("| 08b | hybrid models", "| 08b | Hybrid models", 1))
    assert tables_out_of_date(tmp_path) == ["README.md"]
    assert write_chapter_tables(tmp_path) == ["README.md"] and tables_out_of_date(tmp_path) == []
