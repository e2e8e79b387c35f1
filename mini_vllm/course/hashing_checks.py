"""Checks for chapter 04: ``hash_block_tokens`` and ``hash_request_tokens``."""

from __future__ import annotations

from collections.abc import Callable

from ..hashing import NONE_HASH, block_extra_keys
from ..hashing import hash_block_tokens as reference_hash_block_tokens
from ..hashing import hash_request_tokens as reference_hash_request_tokens
from ._harness import Checker


def check_hash_block_tokens(hash_block_tokens: Callable) -> None:
    """The learner's ``hash_block_tokens(parent_block_hash, token_ids, extra_keys=None)``."""
    check = Checker("hash_block_tokens")
    block = list(range(16))
    other_parent = reference_hash_block_tokens(None, [9] * 16)
    salt = (("cache_salt", "alice"),)

    # Properties first: they name the mistake whatever bytes your hash produces.
    check.expect(
        hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3]),
        "tokens (1, 23) and (12, 3) hash the same",
        "serialize unambiguously: pickle the tuple of token ids; never join digits into a string",
    )
    check.expect(
        hash_block_tokens(NONE_HASH, block) != hash_block_tokens(other_parent, block),
        "the same tokens under two different parents hash the same",
        "the parent hash must be part of what you hash: it is what chains a block to its prefix",
    )
    check.expect(
        hash_block_tokens(None, block, salt) != hash_block_tokens(None, block, None),
        "extra_keys (a cache salt) do not change the hash",
        "extra_keys must be part of what you hash",
    )
    check.expect(
        hash_block_tokens(None, block) == hash_block_tokens(NONE_HASH, block),
        "parent None and parent NONE_HASH hash differently",
        "a first block (parent None) must use NONE_HASH as its parent",
    )
    # Then the exact bytes, so your hashes can meet the engine's in one cache.
    for case, args in [
        ("a first block", (None, block, None)),
        ("a block under a parent", (other_parent, block, None)),
        ("a block with extra keys", (None, block, salt)),
    ]:
        check.expect_equal(
            hash_block_tokens(*args),
            reference_hash_block_tokens(*args),
            case,
            "hash sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)).digest()",
        )
    for _ in range(100):
        parent = check.rng.choice([None, other_parent, reference_hash_block_tokens(None, [check.rng.randrange(50)])])
        tokens = [check.rng.randrange(5000) for _ in range(check.rng.randint(1, 16))]
        extra = check.rng.choice([None, (("lora", "x"),), (("cache_salt", "s"),)])
        check.expect_equal(
            hash_block_tokens(parent, tokens, extra),
            reference_hash_block_tokens(parent, tokens, extra),
            f"random block {tokens} with extra_keys={extra}",
            random_case=True,
        )
    check.passed()


def check_hash_request_tokens(hash_request_tokens: Callable) -> None:
    """The learner's ``hash_request_tokens(token_ids, block_size, cache_salt=None, lora_name=None)``."""
    check = Checker("hash_request_tokens")
    cases = [
        ("15 tokens: no full block", (list(range(15)), 16, None, None), "only FULL blocks get a hash"),
        ("48 tokens: three blocks", (list(range(48)), 16, None, None), "chain each block to the previous block's hash"),
        ("47 tokens: the partial tail is not hashed", (list(range(47)), 16, None, None), "len(token_ids) // block_size blocks"),
        ("the same block twice", ([5] * 32, 16, None, None), "equal blocks at different positions must hash differently"),
        ("a cache salt", (list(range(48)), 16, "tenant-a", None), "the salt goes into block 0's extra keys only"),
        ("a LoRA name", (list(range(48)), 16, None, "pirate"), "the LoRA name goes into every block's extra keys"),
        ("salt and LoRA", (list(range(32)), 4, "s", "l"), "use block_extra_keys(index, cache_salt, lora_name)"),
    ]
    for case, args, hint in cases:
        check.expect_equal(hash_request_tokens(*args), reference_hash_request_tokens(*args), case, hint)
    for _ in range(60):
        tokens = [check.rng.randrange(3) for _ in range(check.rng.randint(1, 70))]
        block_size = check.rng.choice([2, 4, 16])
        salt = check.rng.choice([None, "a"])
        check.expect_equal(
            hash_request_tokens(tokens, block_size, salt, None),
            reference_hash_request_tokens(tokens, block_size, salt, None),
            f"random prompt of {len(tokens)} tokens, block_size={block_size}, cache_salt={salt!r}",
            random_case=True,
        )
    check.passed()


__all__ = ["check_hash_block_tokens", "check_hash_request_tokens"]
