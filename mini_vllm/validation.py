"""The argument checks that modules at every level share (standard library only).

``config.py`` re-exports them with the settings; ``hashing.py``, the lowest
module, imports them from here, so that neither of the two imports the other.
"""

from __future__ import annotations

import numbers


def check_positive_int(name: str, value: int) -> None:
    """TypeError unless ``value`` is an int (bool refused), ValueError unless it is positive; both name ``name``."""
    # bool is an int subclass in Python: True is refused where a number is meant.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive integer, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_block_size(block_size: int) -> None:
    """The one check of a block size: the engine's settings, ``Request``, the
    KV-cache manager, the hash functions and the profiler all call it."""
    check_positive_int("block_size", block_size)


def check_sliding_window(sliding_window: object) -> int | None:
    """A sliding window as an int, or None (full attention); ValueError unless None or a positive
    whole number of tokens (a bool refused). The attention backends and the kernels both call it."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window <= 0:
        raise ValueError(f"sliding_window must be None (full attention) or a positive int, got {sliding_window!r}")
    return int(sliding_window)


def one_of(names) -> str:
    """``'auto', 'torch' or 'triton'``: valid names, quoted, for an error message."""
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def check_text(text: str, what: str) -> None:
    """ValueError unless ``text`` is valid Unicode: a lone surrogate (``"\\ud800"``, e.g. from a JSON
    escape) cannot be encoded as UTF-8, and a tokenizer fails on it with an unhelpful TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} is not valid Unicode text: character {error.start} is a lone surrogate "
            f"({text[error.start]!r}), which no UTF-8 text holds"
        ) from None
