"""Exercise checks and helpers for the course notebooks (``exercises/`` and ``solutions/``).

One ``check_<what you wrote>`` per exercise, exported here by its name
(decorating it with ``@guarded_check`` in a ``<topic>_checks`` module is all it
takes to add one). Each compares your function with the package's reference on
fixed edge cases and random inputs, raises ``AssertionError`` with a message
that helps, and prints a pass line.

An implementation that passes its check is kept as a part of the learner's
own engine (:mod:`mini_vllm.course.parts`); :func:`learner_engine` builds an
``LLM`` from every part kept so far, the reference filling in the rest, and
:func:`reset_parts` goes back to the reference. :func:`parts_line` says in one
line which parts of an engine are yours (your code) and which the reference's;
:func:`learner_engine` prints it for every engine it builds.
"""

import importlib
import pkgutil

from ._harness import CHECKS
from .comparisons import against_vllm, compare_observables, compare_with_reference, run_against_reference
from .display import show_interface, show_source, side_by_side
from .learner_engine import (
    ENGINE_PARTS,
    LearnerLLM,
    PartsTable,
    course_parts,
    learner_engine,
    parts_line,
    scattered_free_queue,
    show_parts,
    use_parts,
)
from .parts import kept_parts, learner_parts, load_part, parts_dir, reset_parts

# Every ``<topic>_checks`` module registers its checks (``@guarded_check``) when imported;
# each registered ``check_*`` is then exported from here by its name.
for _module in pkgutil.iter_modules(__path__):
    if _module.name.endswith("_checks"):
        importlib.import_module(f"{__name__}.{_module.name}")
globals().update(CHECKS)

__all__ = [
    "show_source",
    "side_by_side",
    "show_interface",
    "learner_engine",
    "learner_parts",
    "use_parts",
    "course_parts",
    "parts_line",
    "show_parts",
    "PartsTable",
    "LearnerLLM",
    "ENGINE_PARTS",
    "scattered_free_queue",
    "compare_with_reference",
    "compare_observables",
    "run_against_reference",
    "against_vllm",
    "kept_parts",
    "load_part",
    "parts_dir",
    "reset_parts",
    *CHECKS,
]
