"""Showing the package's own code and small tables inside the notebooks.

``show_source(obj)`` renders the real source of a class or function, so the
text of a chapter and the code it explains cannot drift apart.
"""

from __future__ import annotations

import inspect
import textwrap


class _Markdown:
    """A tiny Markdown display object (renders in Jupyter, prints as plain text elsewhere)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _repr_markdown_(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text


def show_source(obj, start: str | None = None, end: str | None = None) -> _Markdown:
    """The source of ``obj`` as a Python code block.

    ``start`` / ``end``: show only the lines from the first one containing
    ``start`` up to and including the first following one containing ``end``.
    """
    source = textwrap.dedent(inspect.getsource(obj))
    if start is not None:
        lines = source.splitlines()
        first = next(i for i, line in enumerate(lines) if start in line)
        last = len(lines) - 1
        if end is not None:
            last = next(i for i in range(first, len(lines)) if end in lines[i])
        source = textwrap.dedent("\n".join(lines[first : last + 1]))
    module = inspect.getmodule(obj)
    where = f"`{module.__name__}`" if module else ""
    return _Markdown(f"From {where}:\n\n```python\n{source.rstrip()}\n```")
