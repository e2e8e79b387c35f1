"""The argument checks that modules at every level share (standard library only).

``config.py`` re-exports them with the settings; ``hashing.py``, the lowest
module, imports them from here, so that neither of the two imports the other.
"""

from __future__ import annotations


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
