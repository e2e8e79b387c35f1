"""Showing the package's own code and small tables inside the notebooks.

``show_source(obj)`` renders the real source of a class or function, so the
text of a chapter and the code it explains cannot drift apart.
"""

from __future__ import annotations

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

    def __init__(self, where: str, source: str) -> None:
        self.where = where
        self.source = source
        super().__init__(f"From {where}:\n\n```python\n{source}\n```")

    def _repr_html_(self) -> str:
        return source_html(self.where, self.source)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {"text/plain": self.text, "text/markdown": self.text, "text/html": self._repr_html_()}


def source_html(where: str, source: str) -> str:
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
    return (
        f'<div class="mv-source">From <code style="font-family:{CODE_FONT}">{label}</code>:'
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
