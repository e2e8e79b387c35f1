"""Exercise checks and helpers for the course notebooks (``exercises/`` and ``solutions/``).

One ``check_<what you wrote>`` per exercise. Each compares your function with
the package's reference on fixed edge cases and random inputs, raises
``AssertionError`` with a message that helps, and prints a pass line.

An implementation that passes its check is kept as a part of the learner's
own engine (:mod:`mini_vllm.course.parts`); :func:`learner_engine` builds an
``LLM`` from every part kept so far, the reference filling in the rest, and
:func:`reset_parts` goes back to the reference.
"""

from . import (
    eviction_checks,
    free_queue_checks,
    hashing_checks,
    kernel_checks,
    kv_cache_checks,
    lookup_checks,
    prompt_checks,
    scheduler_checks,
    slot_mapping_checks,
)
from .display import show_source
from .learner_engine import (
    against_vllm,
    compare_with_reference,
    learner_engine,
    run_against_reference,
    show_parts,
    use_parts,
)
from .parts import kept_parts, parts_dir, reset_parts
from .eviction_checks import *  # noqa: F401,F403
from .free_queue_checks import *  # noqa: F401,F403
from .hashing_checks import *  # noqa: F401,F403
from .kernel_checks import *  # noqa: F401,F403
from .kv_cache_checks import *  # noqa: F401,F403
from .lookup_checks import *  # noqa: F401,F403
from .prompt_checks import *  # noqa: F401,F403
from .scheduler_checks import *  # noqa: F401,F403
from .slot_mapping_checks import *  # noqa: F401,F403

__all__ = [
    "show_source",
    "learner_engine",
    "use_parts",
    "show_parts",
    "compare_with_reference",
    "run_against_reference",
    "against_vllm",
    "kept_parts",
    "parts_dir",
    "reset_parts",
]
for _module in (
    kv_cache_checks,
    free_queue_checks,
    slot_mapping_checks,
    hashing_checks,
    lookup_checks,
    eviction_checks,
    kernel_checks,
    scheduler_checks,
    prompt_checks,
):
    __all__ += list(_module.__all__)
