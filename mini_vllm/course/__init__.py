"""Exercise checks for the course notebooks (``exercises/`` and ``solutions/``).

One ``check_<what you wrote>`` per exercise. Each compares your function with
the package's reference on fixed edge cases and random inputs, raises
``AssertionError`` with a message that helps, and prints a pass line.
"""

from .hashing_checks import check_hash_block_tokens, check_hash_request_tokens

__all__ = ["check_hash_block_tokens", "check_hash_request_tokens"]
