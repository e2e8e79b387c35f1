"""Exercise checks and helpers for the course notebooks (``exercises/`` and ``solutions/``).

One ``check_<what you wrote>`` per exercise. Each compares your function with
the package's reference on fixed edge cases and random inputs, raises
``AssertionError`` with a message that helps, and prints a pass line.
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
from .eviction_checks import *  # noqa: F401,F403
from .free_queue_checks import *  # noqa: F401,F403
from .hashing_checks import *  # noqa: F401,F403
from .kernel_checks import *  # noqa: F401,F403
from .kv_cache_checks import *  # noqa: F401,F403
from .lookup_checks import *  # noqa: F401,F403
from .prompt_checks import *  # noqa: F401,F403
from .scheduler_checks import *  # noqa: F401,F403
from .slot_mapping_checks import *  # noqa: F401,F403

__all__ = ["show_source"]
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
