"""Showing the package's own code and small tables inside the notebooks.

``show_source(obj)`` renders the real source of a class or function, so the
text of a chapter and the code it explains cannot drift apart.
``show_interface(obj)`` renders only its interface (signatures and docstrings,
no bodies): what a chapter shows of the code its exercise asks the learner to
write, so that the chapter does not give the answer away.
"""

from __future__ import annotations

import ast
import html
import inspect
import textwrap

# One monospace stack, set inline: exported HTML and GitHub do not load JupyterLab's code font.
CODE_FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', 'Liberation Mono', monospace"


class _Markdown:
    """A tiny Markdown display object (renders in Jupyter, prints as plain text elsewhere)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _repr_markdown_(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text


class SourceListing(_Markdown):
    """A piece of the package's source: Markdown for Jupyter, HTML in a fixed-width font for exports.

    JupyterLab and ``nbconvert --to html`` prefer the ``text/html`` rendering,
    whose inline ``font-family`` keeps the columns aligned wherever the
    notebook is shown; ``text/markdown`` and ``text/plain`` carry the same code.
    """

    def __init__(self, where: str, source: str, note: str = "") -> None:
        self.where = where
        self.source = source
        self.note = note
        suffix = f" ({note})" if note else ""
        super().__init__(f"From {where}{suffix}:\n\n```python\n{source}\n```")

    def _repr_html_(self) -> str:
        return source_html(self.where, self.source, self.note)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {"text/plain": self.text, "text/markdown": self.text, "text/html": self._repr_html_()}


def source_html(where: str, source: str, note: str = "") -> str:
    """``source`` highlighted (Pygments, inline styles) in a ``<pre>`` with a monospace font."""
    pre_style = (
        f"font-family:{CODE_FONT};font-size:12.5px;line-height:1.4;background:#f7f7f7;"
        "border:1px solid #e0e0e0;border-radius:4px;padding:6px 8px;overflow-x:auto;white-space:pre;margin:4px 0"
    )
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        # nowrap: only the coloured <span>s, inside our own <pre>.
        code = highlight(source, PythonLexer(), HtmlFormatter(noclasses=True, nowrap=True, style="default"))
    except ImportError:  # Pygments comes with Jupyter; without it, plain text
        code = html.escape(source)
    label = html.escape(where.strip("`"))
    suffix = f" ({html.escape(note)})" if note else ""
    return (
        f'<div class="mv-source">From <code style="font-family:{CODE_FONT}">{label}</code>{suffix}:'
        f'<pre style="{pre_style}">{code.rstrip()}</pre></div>'
    )


def show_source(obj, start: str | None = None, end: str | None = None) -> SourceListing:
    """The source of ``obj`` as a Python code block.

    ``start`` / ``end``: show only the lines from the first one containing
    ``start`` (default: the first line) up to and including the first
    following one containing ``end`` (default: the last line). A marker that
    is not in the source raises ValueError naming it.
    """
    source = textwrap.dedent(inspect.getsource(obj))
    if start is not None or end is not None:
        lines = source.splitlines()
        first = 0
        if start is not None:
            first = next((i for i, line in enumerate(lines) if start in line), None)
            if first is None:
                raise ValueError(f"start={start!r} is not in the source of {obj!r}")
        last = len(lines) - 1
        if end is not None:
            last = next((i for i in range(first, len(lines)) if end in lines[i]), None)
            if last is None:
                raise ValueError(f"end={end!r} is not in the source of {obj!r} after line {first + 1}")
        source = textwrap.dedent("\n".join(lines[first : last + 1]))
    module = inspect.getmodule(obj)
    where = f"`{module.__name__}`" if module else ""
    return SourceListing(where, source.rstrip())


INTERFACE_NOTE = "interface only: the body is yours to write in the exercise"


def show_interface(obj, note: str = INTERFACE_NOTE) -> SourceListing:
    """The interface of ``obj`` as a Python code block: no implementation.

    ``note`` is the line shown above it; a chapter names there what its exercise asks
    for when that is not the whole of ``obj``.

    For a function (or a ``@triton.jit`` kernel): its decorators, its ``def``
    line(s) and its docstring, then ``...`` for the body. For a class: its
    ``class`` line, its docstring and class-level attributes, then the same for
    each public method (``__init__`` and other dunders included, ``_private``
    helpers left out). A chapter shows this for what its exercise asks the
    learner to write; :func:`show_source` shows everything else.
    """
    fn = getattr(obj, "fn", None)  # a @triton.jit kernel wraps its function
    target = fn if inspect.isfunction(fn) else obj
    source = textwrap.dedent(inspect.getsource(target))
    lines = source.splitlines()
    tree = ast.parse(source)
    node = tree.body[0]
    out: list[str] = []
    if isinstance(node, ast.ClassDef):
        out += _header_and_docstring(node, lines)
        members: list[str] = []
        for statement in node.body[1 if _docstring_node(node) else 0 :]:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = statement.name
                if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                    continue
                members += [""] + _function_interface(statement, lines)
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                members += lines[statement.lineno - 1 : statement.end_lineno]
        out += members or [" " * (node.col_offset + 4) + "..."]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out += _function_interface(node, lines)
    else:
        raise TypeError(f"show_interface needs a class or a function, not {obj!r}")
    module = inspect.getmodule(target)
    where = f"`{module.__name__}`" if module else ""
    return SourceListing(where, textwrap.dedent("\n".join(out)).rstrip(), note)


def _docstring_node(node) -> ast.Expr | None:
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def _header_and_docstring(node, lines: list[str]) -> list[str]:
    """Decorators, the ``def``/``class`` line(s) up to the body, and the docstring."""
    top = min([decorator.lineno for decorator in getattr(node, "decorator_list", [])] + [node.lineno])
    docstring = _docstring_node(node)
    body_start = node.body[0].lineno
    if body_start == node.lineno:  # a one-line definition: `def f(x): return x`
        raise ValueError(f"show_interface cannot cut the one-line definition of {node.name!r}")
    last = docstring.end_lineno if docstring else body_start - 1
    return lines[top - 1 : last]


def _function_interface(node, lines: list[str]) -> list[str]:
    header = _header_and_docstring(node, lines)
    indent = " " * node.body[0].col_offset
    return header + [indent + "..."]


class SideBySide:
    """The learner's kept code next to the engine's implementation: HTML in two columns, text one after the other."""

    def __init__(self, panes: list[tuple[str, str, str, str]], not_yet: list[str]) -> None:
        # (part key, the learner's source, whose the other is, its sources, each headed by its name)
        self.panes = panes
        self.not_yet = not_yet  # the parts whose check has not passed: nothing of the answer is shown for them

    def _not_yet_text(self) -> str:
        if not self.not_yet:
            return ""
        return (
            f"Not yet: your check for {', '.join(repr(key) for key in self.not_yet)} has not passed here, so it "
            "is not kept, and the engine's implementation stays hidden. Run its check cell until it passes, "
            "then this one."
        )

    def __repr__(self) -> str:
        blocks = [
            f"== {key}: yours ==\n{yours}\n== {key}: {whose} ==\n{reference}"
            for key, yours, whose, reference in self.panes
        ]
        return "\n\n".join(blocks + ([self._not_yet_text()] if self.not_yet else []))

    def _repr_html_(self) -> str:
        column = "flex:1 1 0;min-width:0"
        rows = [
            f'<div style="display:flex;gap:12px;align-items:flex-start">'
            f'<div style="{column}">{source_html(f"your kept part {key!r}", yours)}</div>'
            f'<div style="{column}">{source_html(whose, reference)}</div></div>'
            for key, yours, whose, reference in self.panes
        ]
        if self.not_yet:
            rows.append(f"<p>{html.escape(self._not_yet_text())}</p>")
        return f'<div class="mv-side-by-side">{"".join(rows)}</div>'


def side_by_side(*keys: str) -> SideBySide:
    """Your passing code for the parts ``keys`` next to the engine's own, once your check has passed.

    Each exercise ends with this. The engine's implementation is shown only for
    a part that is kept (its check passed, ``mini_vllm.course.parts.keep``);
    for one that is not, it says so and shows nothing of that answer. Each of
    the engine's functions is headed by its module and name, the one with the
    exercise's signature first.
    """
    from .parts import PARTS_BY_KEY, parts_dir, reference_objects

    unknown = [key for key in keys if key not in PARTS_BY_KEY]
    if not keys or unknown:
        raise ValueError(f"side_by_side needs part names, got unknown {unknown}; the parts are {list(PARTS_BY_KEY)}")
    panes, not_yet = [], []
    for key in keys:
        path = parts_dir() / f"{key}.py"
        if not path.exists():
            not_yet.append(key)
            continue
        reference = "\n\n".join(
            f"# {inspect.getmodule(obj).__name__}: {obj.__qualname__}\n"
            + textwrap.dedent(inspect.getsource(obj)).rstrip()
            for obj in reference_objects(key)
        )
        whose = "the engine" if PARTS_BY_KEY[key].in_engine else "the course's answer"
        panes.append((key, path.read_text().rstrip(), whose, reference))
    return SideBySide(panes, not_yet)
