"""No chapter shows the answer to the exercise that follows it (issue 23).

A chapter teaches the idea, the invariants and the interface of what its
exercise asks for (signature, docstring, pictures, vLLM's names); it does not
show the engine's implementation of it, in a cell's source or in an output
(``show_source`` of the whole function, a printed ``inspect.getsource``, a
Markdown copy). For every part a learner writes (``mini_vllm.course.parts.PARTS``)
this takes the body of the engine's reference implementation, keeps its
telling lines, and looks for them in every committed chapter up to and
including the exercise's own chapter.
"""

from __future__ import annotations

import ast
import html
import inspect
import re
import textwrap
from pathlib import Path

import nbformat
import pytest

from mini_vllm import kernels  # noqa: F401  (first: sets TRITON_INTERPRET=1 on a machine without a GPU)
from mini_vllm.block_pool import FreeKVCacheBlockQueue
from mini_vllm.course.parts import PARTS, reference_objects
from mini_vllm.model_runner import compute_slot_mapping
from mini_vllm.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))

MIN_LINE = 25  # shorter body lines (`return blocks`, `else:`) say nothing about the answer
MAX_RUN = 2  # consecutive body lines a chapter may show (a run of 3 is a piece of the answer)
MAX_FRACTION = 0.25  # of the body's telling lines, in one chapter, in total

# Each part's reference implementation: what its check compares with, and what that delegates the work to
# (``Part.reference``, the same objects ``side_by_side`` shows once the learner's check passed).
REFERENCES = {part.key: reference_objects(part.key) for part in PARTS}


def _normalized(line: str) -> str:
    """A line without its indentation and its trailing comment."""
    return re.sub(r"\s+#\s.*$", "", line.strip())


def _telling(line: str) -> bool:
    return len(line) >= MIN_LINE and not line.startswith("#") and line not in {"return", "pass"}


def body_lines(obj) -> list[str]:
    """The telling lines of ``obj``'s bodies, in order: every function's body (every method's, for a class)
    without signatures, docstrings, comments, blank and short lines."""
    fn = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps its function
    source = textwrap.dedent(inspect.getsource(fn))
    lines = source.splitlines()
    numbers: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring is the interface: a chapter shows it
        for statement in body:
            numbers.extend(range(statement.lineno, statement.end_lineno + 1))
    kept = []
    for number in sorted(set(numbers)):
        line = _normalized(lines[number - 1])
        if _telling(line) and line not in kept:
            kept.append(line)
    return kept


def _html_text(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def notebook_texts(notebook) -> list[str]:
    """Every cell's source and every output's text (stream, plain, Markdown, HTML without its tags)."""
    texts = []
    for cell in notebook["cells"]:
        source = cell["source"]
        texts.append("".join(source) if isinstance(source, list) else source)
        for output in cell.get("outputs", []):
            if "text" in output:
                text = output["text"]
                texts.append("".join(text) if isinstance(text, list) else text)
            for mime, value in output.get("data", {}).items():
                value = "".join(value) if isinstance(value, list) else value
                if mime == "text/html":
                    texts.append(_html_text(value))
                elif mime.startswith("text/"):
                    texts.append(value)
    return texts


def shown_answer(notebook, body: list[str]) -> str | None:
    """Why ``notebook`` shows the implementation whose telling lines are ``body``; None when it does not."""
    if not body:
        return None
    shown: set[str] = set()
    for text in notebook_texts(notebook):
        present = [line in {_normalized(raw) for raw in text.splitlines()} for line in body]
        shown.update(line for line, is_there in zip(body, present) if is_there)
        run = longest = 0
        for is_there in present:
            run = run + 1 if is_there else 0
            longest = max(longest, run)
        if longest > MAX_RUN:
            first = next(i for i in range(len(body)) if all(present[i : i + longest]))
            return f"{longest} consecutive lines of the body in one cell, from {body[first]!r}"
    if len(shown) > MAX_FRACTION * len(body):
        return f"{len(shown)} of the body's {len(body)} lines, e.g. {sorted(shown)[0]!r}"
    return None


def _chapter(path: Path) -> str:
    return path.name.split("_", 1)[0]


def _cases():
    for part in PARTS:
        for path in CHAPTERS:
            if _chapter(path) <= part.chapter:
                yield pytest.param(part.key, path, id=f"{part.key}-{path.stem}")


def test_every_part_has_a_reference():
    assert set(REFERENCES) == {part.key for part in PARTS}
    for key, objects in REFERENCES.items():
        assert sum(len(body_lines(obj)) for obj in objects) >= 1, key


@pytest.mark.parametrize("key, path", list(_cases()))
def test_no_chapter_shows_the_answer_to_a_later_exercise(key, path):
    notebook = nbformat.read(path, as_version=4)
    for obj in REFERENCES[key]:
        why = shown_answer(notebook, body_lines(obj))
        assert why is None, (
            f"{path.name} shows {obj.__qualname__}, the answer to the exercise '{key}' after it: {why}. "
            "Show its interface instead (mini_vllm.course.show_interface)."
        )


# -- the checker itself ---------------------------------------------------------------
def _fake_notebook(*cells: tuple[str, str]) -> dict:
    """A notebook of (source, plain-text output) code cells."""
    return {
        "cells": [
            {"cell_type": "code", "source": source, "outputs": [{"output_type": "stream", "text": output}]}
            for source, output in cells
        ]
    }


def test_a_printed_getsource_is_flagged():
    shown = _fake_notebook(
        ("import inspect\nprint(inspect.getsource(FreeKVCacheBlockQueue))", inspect.getsource(FreeKVCacheBlockQueue))
    )
    assert shown_answer(shown, body_lines(FreeKVCacheBlockQueue)) is not None


def test_a_markdown_copy_and_a_show_source_listing_are_flagged():
    from mini_vllm.course import show_source

    source = textwrap.dedent(inspect.getsource(Scheduler.schedule_waiting))
    copied = {"cells": [{"cell_type": "markdown", "source": f"```python\n{source}```"}]}
    assert shown_answer(copied, body_lines(Scheduler.schedule_waiting)) is not None
    bundle = show_source(Scheduler.schedule_waiting)._repr_mimebundle_()
    html_only = {
        "cells": [{"cell_type": "code", "source": "", "outputs": [{"data": {"text/html": bundle["text/html"]}}]}]
    }
    assert shown_answer(html_only, body_lines(Scheduler.schedule_waiting)) is not None


def test_a_one_line_answer_is_flagged_and_its_interface_is_not():
    from mini_vllm.course import show_interface

    listing = show_interface(compute_slot_mapping)._repr_mimebundle_()
    interface = _fake_notebook(("show_interface(compute_slot_mapping)", listing["text/plain"]))
    assert shown_answer(interface, body_lines(compute_slot_mapping)) is None
    answer = _fake_notebook(("", inspect.getsource(compute_slot_mapping)))
    assert "1 of the body's 1 lines" in shown_answer(answer, body_lines(compute_slot_mapping))


def test_the_interface_alone_passes():
    from mini_vllm.course import show_interface

    for objects in REFERENCES.values():
        for obj in objects:
            bundle = show_interface(obj)._repr_mimebundle_()
            notebook = {
                "cells": [
                    {
                        "cell_type": "code",
                        "source": "show_interface(obj)",
                        "outputs": [{"output_type": "display_data", "data": bundle}],
                    }
                ]
            }
            assert shown_answer(notebook, body_lines(obj)) is None, obj


def test_using_the_engine_is_not_showing_it():
    # A chapter calls the engine's functions and prints what they return: that is no answer.
    calls = _fake_notebook(
        ("pool.free_blocks(reversed(blocks))\nprint(compute_slot_mapping([3, 7], 0, 20, 16))", "[48, 49]"),
    )
    for objects in REFERENCES.values():
        for obj in objects:
            assert shown_answer(calls, body_lines(obj)) is None, obj
