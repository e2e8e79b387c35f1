"""Checks for chapter 04: ``hash_block_tokens`` and ``hash_request_tokens``.

Properties come first: whatever bytes a learner's hash produces, a property
that fails names the mistake (the parent is ignored, the result is a hex
string, a partial block got a hash...). Then the exact bytes are compared with
the reference, because the learner's hashes must meet the engine's in one
cache (chapter 04 looks them up in a running engine's map).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import pickle
from collections.abc import Callable, Sequence

from ..hashing import NONE_HASH, block_extra_keys
from ..hashing import hash_block_tokens as reference_hash_block_tokens
from ..hashing import hash_request_tokens as reference_hash_request_tokens
from ._harness import CheckFailure, Checker, Mistake, guarded_check, snapshot, unequal

EXACT_HINT = (
    "hash hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)).digest(), "
    "with NONE_HASH as the parent of a first block"
)


def _recipe_mistake(got: object, parent: bytes | None, token_ids: Sequence[int], extra_keys: object) -> str:
    """The one difference from the recipe that gives ``got``, if it is a known one ("" otherwise)."""
    parent = NONE_HASH if parent is None else parent
    tokens = tuple(token_ids)

    def digest(obj: object, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=protocol)).digest()

    if pickle.DEFAULT_PROTOCOL != pickle.HIGHEST_PROTOCOL and got == digest(
        (parent, tokens, extra_keys), pickle.DEFAULT_PROTOCOL
    ):
        return (
            f"pickle.dumps(...) without protocol=5 pickles with protocol {pickle.DEFAULT_PROTOCOL}, whose bytes "
            "differ: pass protocol=5 (pickle.HIGHEST_PROTOCOL), as vLLM does"
        )
    parts = {"parent": parent, "tuple(token_ids)": tokens, "extra_keys": extra_keys}
    for order in itertools.permutations(parts):
        if order != tuple(parts) and got == digest(tuple(parts[name] for name in order)):
            return (
                f"you hashed ({', '.join(order)}): the tuple is (parent, tuple(token_ids), extra_keys), in that order"
            )
    if extra_keys is None and got == digest((parent, tokens, ())):
        return "a block without extra keys hashes extra_keys=None as it is, not () (None and () pickle differently)"
    return ""


def _exact_hint(got: object, expected: bytes, *args: object) -> str:
    """The hint for a hash that should be ``expected`` ("" when it is: the recipe check costs pickles)."""
    if got == expected:
        return ""
    return _recipe_mistake(got, *args) or EXACT_HINT


@guarded_check(part="hash_block_tokens")
def check_hash_block_tokens(hash_block_tokens: Callable) -> None:
    """The learner's ``hash_block_tokens(parent_block_hash, token_ids, extra_keys=None)``."""
    check = Checker("hash_block_tokens")
    hash_block_tokens = check.wrap(hash_block_tokens, "hash_block_tokens", "32 bytes (a SHA-256 digest)")
    block = list(range(16))
    other_parent = reference_hash_block_tokens(None, [9] * 16)
    salt = (("cache_salt", "alice"),)

    # Properties first: they name the mistake whatever bytes your hash produces.
    given = list(block)
    first = hash_block_tokens(None, given)
    check.expect_unchanged(
        list(block),
        given,
        "hash_block_tokens(None, range(16))",
        "token_ids",
        "the token ids are the request's own: hash a copy (tuple(token_ids)), never append to or sort the list",
    )
    if isinstance(first, bytes) and len(first) != 32:  # counted with the case below: the same pass line
        check.fail(
            f"hash_block_tokens(None, range(16)) returned {len(first)} bytes, not 32: SHA-256's digest is 32 bytes",
            f"hash with hashlib.sha256(...).digest(): a {8 * len(first)}-bit hash (xxhash, MD5, a truncated "
            f"digest) gives {len(first)} bytes, and the engine's block hashes are SHA-256",
        )
    check.expect(
        isinstance(first, bytes) and len(first) == 32,
        f"hash_block_tokens(None, range(16)) returned {first!r} ({type(first).__name__}), not 32 bytes",
        "return the raw digest: hashlib.sha256(...).digest() (bytes), not .hexdigest() (a str) "
        "and not Python's hash() (an int)",
    )
    check.expect(
        hash_block_tokens(None, list(block)) == first,
        "hashing the same block twice gave two different hashes",
        "the hash must depend only on its inputs (no random salt, no id(), no time)",
    )
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
    check.expect(
        hash_block_tokens(None, tuple(block)) == first,
        "a tuple and a list of the same token ids hash differently",
        "convert token_ids with tuple(token_ids) before serializing: callers pass lists and slices",
    )
    # Then the exact bytes, so your hashes can meet the engine's in one cache.
    for case, args in [
        ("a first block", (None, block, None)),
        ("a block under a parent", (other_parent, block, None)),
        ("a block with extra keys", (None, block, salt)),
    ]:
        got, expected = hash_block_tokens(*args), reference_hash_block_tokens(*args)
        check.expect_equal(got, expected, case, _exact_hint(got, expected, *args))
    for _ in range(100):
        parent = check.rng.choice([None, other_parent, reference_hash_block_tokens(None, [check.rng.randrange(50)])])
        tokens = [check.rng.randrange(5000) for _ in range(check.rng.randint(1, 16))]
        extra = check.rng.choice([None, (("lora", "x"),), (("cache_salt", "s"),)])
        got, expected = hash_block_tokens(parent, tokens, extra), reference_hash_block_tokens(parent, tokens, extra)
        check.expect_equal(
            got,
            expected,
            f"random block {tokens} with extra_keys={extra}",
            _exact_hint(got, expected, parent, tokens, extra),
            random_case=True,
        )
    check.passed()


def _first_difference(got: Sequence[bytes], expected: Sequence[bytes]) -> int | None:
    for index, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return index
    return None


def _chain(
    token_ids: list,
    block_size: int,
    keys_of: Callable[[int], object],
    hash_block_tokens: Callable = reference_hash_block_tokens,
) -> list[bytes]:
    """The chain a right loop builds with ``hash_block_tokens``, block i's extra keys being ``keys_of(i)``."""
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], keys_of(i))
        hashes.append(parent)
    return hashes


def _extra_keys_mistake(got: list, args: tuple) -> str:
    """A hint when ``got`` is the chain that a known misuse of the extra keys gives ("" if none is)."""
    token_ids, block_size, cache_salt, lora_name = args
    if cache_salt is None and lora_name is None:
        return ""
    swapped = _chain(token_ids, block_size, lambda i: block_extra_keys(i, lora_name, cache_salt))
    if got == swapped:
        return (
            "block_extra_keys takes (block_index, cache_salt, lora_name), in that order: you passed lora_name "
            "before cache_salt, so the salt became a LoRA key (in every block) and the LoRA name a salt"
        )

    def as_list(i: int):
        keys = block_extra_keys(i, cache_salt, lora_name)
        return None if keys is None else list(keys)

    if got == _chain(token_ids, block_size, as_list):
        return (
            "your extra keys are a list; they must be a tuple (block_extra_keys returns one): pickle writes a "
            "list differently from a tuple, so the hash differs from the engine's for the same keys. Build a "
            "tuple (tuple(keys)), or call block_extra_keys(index, cache_salt, lora_name)"
        )
    return ""


def _broken_block_hasher(hash_request_tokens: Callable) -> str:
    """How the ``hash_block_tokens`` that the learner's loop calls differs from the reference ("" if it does not).

    The exercise's loop calls the learner's own ``hash_block_tokens`` (a global of the notebook):
    when that one is wrong, every chain is, however right the loop.
    """
    mine = getattr(hash_request_tokens, "__globals__", {}).get("hash_block_tokens")
    if not callable(mine) or mine is reference_hash_block_tokens:
        return ""
    parent = reference_hash_block_tokens(None, [9] * 16)
    block = list(range(16))
    for shown, args in (
        ("hash_block_tokens(None, range(16))", (None, block, None)),
        ("hash_block_tokens(parent, range(16))", (parent, block, None)),
        ("hash_block_tokens(None, range(16), extra_keys)", (None, block, (("cache_salt", "s"),))),
    ):
        try:
            same = mine(*args) == reference_hash_block_tokens(*args)
        except Exception:  # noqa: BLE001 - a crash is as wrong as another hash
            same = False
        if not same:
            return shown
    return ""


def _compare_chains(
    check: Checker,
    got: list,
    expected: list,
    case: str,
    block_size: int,
    hint: str,
    random_case: bool = False,
    args: tuple | None = None,
) -> None:
    """Equal lists, or a message naming the first block whose hash differs."""
    if got != expected and args is not None and len(got) == len(expected):
        hint = _extra_keys_mistake(got, args) or hint
    if len(got) != len(expected):
        hint = (
            f"only FULL blocks get a hash: len(token_ids) // block_size = {len(expected)} of them here "
            f"(block_size={block_size}); you returned {len(got)}. Use the block_size you are given, never a "
            "fixed 16"
        )
    index = _first_difference(got, expected) if len(got) == len(expected) else None
    if index is not None:
        start = index * block_size
        case = f"{case}: block {index} (tokens {start}..{start + block_size - 1}) is the first whose hash differs"
    check.expect_equal(got, expected, case, hint, random_case=random_case)


def _block_zero_hint(got: bytes, tokens: list[int]) -> str:
    """What a wrong hash of block 0 (16 tokens, no extra keys) is, when it is a known mistake."""

    def digest(payload: tuple) -> bytes:
        return hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()

    known = [
        (
            digest((NONE_HASH, tokens[:16], None)),
            "you hashed the slice as a list: hash_block_tokens pickles tuple(token_ids) (a list pickles to "
            "other bytes, so your hashes would never match the engine's): call hash_block_tokens",
        ),
        (reference_hash_block_tokens(None, tokens[:17]), "your block 0 holds 17 tokens: token_ids[0:16] is 16"),
        (reference_hash_block_tokens(None, tokens[:15]), "your block 0 holds 15 tokens: token_ids[0:16] is 16"),
        (
            reference_hash_block_tokens(None, tokens[1:17]),
            "your block 0 starts at token 1: block i is token_ids[i * 16 : (i + 1) * 16]",
        ),
    ]
    return next(
        (hint for digest_of_mistake, hint in known if got == digest_of_mistake),
        "block 0 is hash_block_tokens(None, token_ids[0:16], None)",
    )


@guarded_check(part="hash_request_tokens")
def check_hash_request_tokens(hash_request_tokens: Callable) -> None:
    """The learner's ``hash_request_tokens(token_ids, block_size, cache_salt=None, lora_name=None)``."""
    try:
        _check_hash_request_tokens(hash_request_tokens)
    except CheckFailure as failure:
        broken = _broken_block_hasher(hash_request_tokens)
        if not broken:
            raise
        yours = hash_request_tokens.__globals__["hash_block_tokens"]
        case, _, hint = failure.message.partition("\n    hint: ")
        first_block = f"{broken} differs from the engine's hash"
        if _loop_is_right_with(hash_request_tokens, yours):
            hint = (
                f"your loop calls your hash_block_tokens, which does not pass its check yet ({first_block}); "
                "with it, your loop gives the chain it should: fix hash_block_tokens first (run "
                "check_hash_block_tokens until it passes), then run this check again"
            )
        else:
            hint += (
                f"{'; ' if hint else ''}and your hash_block_tokens does not pass its check yet ({first_block}): "
                "fix it first"
            )
        raise CheckFailure(f"{case}\n    hint: {hint}", failure.learner_traceback) from None


def _loop_is_right_with(hash_request_tokens: Callable, hash_block_tokens: Callable) -> bool:
    """True when the learner's loop gives the chain a right loop gives with ``hash_block_tokens``."""
    cases = ((list(range(48)), 16, None, None), (list(range(23)), 5, "s", None), (list(range(12)), 4, None, "l"))
    try:
        for token_ids, block_size, cache_salt, lora_name in cases:
            keys_of = functools.partial(block_extra_keys, cache_salt=cache_salt, lora_name=lora_name)
            expected = _chain(token_ids, block_size, keys_of, hash_block_tokens)
            if list(hash_request_tokens(list(token_ids), block_size, cache_salt, lora_name)) != expected:
                return False
    except Exception:  # noqa: BLE001 - no verdict on the loop
        return False
    return True


class _Properties:
    """The learner's hash_request_tokens on the prompts that show its properties (48 tokens, block_size 16).

    Each call is made once, when a row of PROPERTY_MISTAKES first needs its result, so the rows call
    the learner in the order they are read.
    """

    def __init__(self, hash_request_tokens: Callable, tokens: list[int]) -> None:
        self.hash_request_tokens = hash_request_tokens
        self.tokens = tokens
        self._full: dict[int, list] = {}

    @functools.cached_property
    def once(self) -> list:
        return self.hash_request_tokens(list(range(32)), 16, None, None)

    @functools.cached_property
    def twice(self) -> list:
        """The same 32 tokens again: state kept between calls (a mutable default, a global list) adds the last
        call's hashes."""
        return self.hash_request_tokens(list(range(32)), 16, None, None)

    def full(self, num_tokens: int) -> list:
        """The hashes of the prompt 0..num_tokens-1."""
        if num_tokens not in self._full:
            self._full[num_tokens] = self.hash_request_tokens(list(range(num_tokens)), 16, None, None)
        return self._full[num_tokens]

    def count(self, num_tokens: int) -> int | None:
        """How many hashes ``num_tokens`` tokens got (None: not a list)."""
        got = self.full(num_tokens)
        return len(got) if isinstance(got, list) else None

    @functools.cached_property
    def repeated(self) -> list:
        return self.hash_request_tokens([5] * 32, 16, None, None)

    @functools.cached_property
    def first(self) -> bytes:
        """Block 0's hash."""
        return self.hash_request_tokens(self.tokens, 16, None, None)[0]

    @functools.cached_property
    def unsalted(self) -> list:
        return self.hash_request_tokens(self.tokens, 16, None, None)

    @functools.cached_property
    def other_start(self) -> list:
        """The same prompt with another block 0."""
        return self.hash_request_tokens([t + 1 for t in self.tokens[:16]] + self.tokens[16:], 16, None, None)

    @functools.cached_property
    def later_blocks_differ(self) -> bool:
        """True when every block after block 0 has another hash once block 0 changes."""
        unsalted, other_start = self.unsalted, self.other_start
        return all(a != b for a, b in zip(other_start[1:], unsalted[1:]))

    @functools.cached_property
    def salted(self) -> list:
        return self.hash_request_tokens(self.tokens, 16, "tenant-a", None)

    @functools.cached_property
    def salted_unchanged(self) -> list[int]:
        """The blocks whose hash a cache_salt leaves unchanged."""
        return [i for i, (a, b) in enumerate(zip(self.salted, self.unsalted)) if a == b]


def _full_blocks_row(num_tokens: int) -> Mistake:
    """A row of PROPERTY_MISTAKES: ``num_tokens`` tokens with block_size 16 get one hash per FULL block."""
    num_full = num_tokens // 16
    return Mistake(
        lambda seen: seen.count(num_tokens) != num_full,
        lambda seen: (
            f"{num_tokens} tokens with block_size 16 make {num_full} FULL blocks, but you returned "
            f"{seen.count(num_tokens) if seen.count(num_tokens) is not None else repr(seen.full(num_tokens))} "
            "hashes"
        ),
        lambda seen: (
            "one hash short: every full block gets one, the last full block too: range(len(token_ids) // "
            "block_size), without a - 1"
            if seen.count(num_tokens) == num_full - 1
            else "only FULL blocks get a hash (len(token_ids) // block_size of them); a partial tail may still "
            "change, so it gets none"
        ),
    )


# hash_request_tokens's properties, as a table of mistakes: each row is one of the check's cases, read in
# order before the exact bytes are compared.
PROPERTY_MISTAKES = (
    Mistake(
        lambda seen: seen.once != seen.twice,
        lambda seen: (
            f"the same 32 tokens hashed twice gave {len(seen.once)} and then {len(seen.twice)} hashes"
            + (" (the second call returned the first call's hashes too)" if len(seen.twice) > len(seen.once) else "")
        ),
        "build a fresh list in every call (hashes = [] inside the function): a mutable default argument "
        "(def hash_request_tokens(..., hashes=[])) or a module-level list keeps the previous call's hashes",
    ),
    *(_full_blocks_row(num_tokens) for num_tokens in (0, 15, 16, 47, 48, 49)),
    Mistake(
        lambda seen: seen.repeated[0] == seen.repeated[1],
        "the same 16 tokens in block 0 and in block 1 got the same hash",
        "chain each block to the previous block's hash: equal tokens at another position (after another "
        "prefix) have other K/V, so they must have another hash",
    ),
    Mistake(
        lambda seen: seen.first != reference_hash_block_tokens(None, seen.tokens[:16]),
        lambda seen: unequal(
            "block 0 of a prompt without extra keys", reference_hash_block_tokens(None, seen.tokens[:16]), seen.first
        ),
        lambda seen: _block_zero_hint(seen.first, seen.tokens),
    ),
    Mistake(
        lambda seen: not seen.later_blocks_differ,
        "two prompts that differ only in block 0 got the same hash for a later block",
        "pass each block's parent, the previous block's hash, to hash_block_tokens: a hash must name the "
        "whole prefix, because a block's K/V depend on every token before it",
    ),
    Mistake(
        lambda seen: bool(seen.salted_unchanged),
        lambda seen: f"a cache_salt leaves the hashes of blocks {seen.salted_unchanged} unchanged",
        lambda seen: (
            "the salt changed no hash: pass each block's extra keys, block_extra_keys(i, cache_salt, lora_name), "
            "to hash_block_tokens"
            if len(seen.salted_unchanged) == len(seen.salted)
            else "block 0's hash changed with the salt but later ones did not: hash each later block with its "
            "parent, the previous block's hash (hash_block_tokens(parent, ...)); that is how the salt in block 0's "
            "extra keys reaches every later hash"
        ),
    ),
    Mistake(
        lambda seen: (
            seen.hash_request_tokens(seen.tokens, 16, "x", None)[0]
            == seen.hash_request_tokens(seen.tokens, 16, None, "x")[0]
        ),
        "a cache_salt 'x' and a LoRA adapter named 'x' give block 0 the same hash",
        "tag each key with its kind: use block_extra_keys(index, cache_salt, lora_name)",
    ),
)


def _check_hash_request_tokens(hash_request_tokens: Callable) -> None:
    check = Checker("hash_request_tokens")
    learner = check.wrap(hash_request_tokens, "hash_request_tokens", "a list with one hash per full block")

    def hash_request_tokens(token_ids, block_size, cache_salt=None, lora_name=None):
        given = list(token_ids)
        before = snapshot(given)
        case = f"hash_request_tokens({len(given)} tokens, block_size={block_size})"
        result = check.expect_list(learner(given, block_size, cache_salt, lora_name), case, bytes, "bytes hashes")
        check.expect_unchanged(
            before,
            given,
            case,
            "token_ids",
            "the prompt's token ids belong to the request: slice them (token_ids[a:b] is a copy), do not "
            "pop, extend or sort the list",
        )
        return result

    tokens = list(range(48))
    check.expect_no_mistakes(PROPERTY_MISTAKES, _Properties(hash_request_tokens, tokens))
    # Then the exact bytes, block by block.
    cases = [
        ("48 tokens: three blocks", (tokens, 16, None, None), "chain each block to the previous block's hash"),
        (
            "47 tokens: the partial tail is not hashed",
            (tokens[:47], 16, None, None),
            "len(token_ids) // block_size blocks",
        ),
        ("a cache salt", (tokens, 16, "tenant-a", None), "the salt goes into block 0's extra keys only"),
        (
            'an empty cache_salt ""',
            (tokens, 16, "", None),
            'an empty cache_salt is no salt, as in vLLM: "" adds no key (block_extra_keys tests `if cache_salt:`, '
            "not `is not None`)",
        ),
        ("a LoRA name", (tokens, 16, None, "pirate"), "the LoRA name goes into every block's extra keys"),
        ("salt and LoRA", (list(range(32)), 4, "s", "l"), "use block_extra_keys(index, cache_salt, lora_name)"),
        (
            "block_size 5 (not a power of two): 23 tokens, 4 full blocks",
            (list(range(23)), 5, None, None),
            "block i holds token_ids[i * block_size : (i + 1) * block_size], for any block_size",
        ),
        (
            "block_size 12, a cache salt",
            (list(range(40)), 12, "t", None),
            "block i holds token_ids[i * block_size : (i + 1) * block_size], for any block_size",
        ),
    ]
    for case, args, hint in cases:
        _compare_chains(
            check, hash_request_tokens(*args), reference_hash_request_tokens(*args), case, args[1], hint, args=args
        )
    for _ in range(60):
        random_tokens = [check.rng.randrange(3) for _ in range(check.rng.randint(1, 70))]
        block_size = check.rng.choice([2, 3, 4, 6, 16])
        salt = check.rng.choice([None, "a"])
        lora = check.rng.choice([None, None, "b"])
        _compare_chains(
            check,
            hash_request_tokens(random_tokens, block_size, salt, lora),
            reference_hash_request_tokens(random_tokens, block_size, salt, lora),
            f"random prompt of {len(random_tokens)} tokens, block_size={block_size}, "
            f"cache_salt={salt!r}, lora_name={lora!r}",
            block_size,
            "compare with block_extra_keys(index, cache_salt, lora_name) and the chain",
            random_case=True,
            args=(random_tokens, block_size, salt, lora),
        )
    check.passed()
