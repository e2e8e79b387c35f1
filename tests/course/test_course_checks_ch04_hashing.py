"""Every exercise check accepts the reference and rejects the typical mistakes.

Each wrong implementation below is a mistake a learner makes; the check must
raise AssertionError on it (and say something useful)."""

from __future__ import annotations

import functools
import hashlib
import pickle

import pytest
from course_fixtures import rejects

from mini_vllm import hashing
from mini_vllm.course import check_hash_block_tokens, check_hash_request_tokens


def test_ch04_hash_block_tokens_accepts_the_reference(capsys):
    check_hash_block_tokens(hashing.hash_block_tokens)
    assert "✓ hash_block_tokens" in capsys.readouterr().out


def _hash_without_parent(parent, token_ids, extra_keys=None):
    return hashlib.sha256(pickle.dumps((tuple(token_ids), extra_keys), protocol=5)).digest()


def _hash_without_extra_keys(parent, token_ids, extra_keys=None):
    return hashing.hash_block_tokens(parent, token_ids, None)


def _hash_of_joined_digits(parent, token_ids, extra_keys=None):
    parent = parent or hashing.NONE_HASH
    return hashlib.sha256(parent + "".join(map(str, token_ids)).encode() + repr(extra_keys).encode()).digest()


def _hash_with_none_parent_kept_as_none(parent, token_ids, extra_keys=None):
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)).digest()


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_hash_without_parent, "parent"),
        (_hash_without_extra_keys, "extra_keys"),
        (_hash_of_joined_digits, "unambiguous"),
        (_hash_with_none_parent_kept_as_none, "NONE_HASH"),
    ],
)
def test_ch04_hash_block_tokens_rejects_typical_mistakes(wrong, expected_message):
    rejects(check_hash_block_tokens, wrong, expected_message, regex=True)


def test_ch04_hash_request_tokens_accepts_the_reference(capsys):
    check_hash_request_tokens(hashing.hash_request_tokens)
    assert "✓ hash_request_tokens" in capsys.readouterr().out


def _hashes_partial_tail_too(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent = [], None
    for start in range(0, len(token_ids), block_size):
        index = start // block_size
        parent = hashing.hash_block_tokens(
            parent, token_ids[start : start + block_size], hashing.block_extra_keys(index, cache_salt, lora_name)
        )
        hashes.append(parent)
    return hashes


def _unchained(token_ids, block_size, cache_salt=None, lora_name=None):
    return [
        hashing.hash_block_tokens(
            None, token_ids[i * block_size : (i + 1) * block_size], hashing.block_extra_keys(i, cache_salt, lora_name)
        )
        for i in range(len(token_ids) // block_size)
    ]


def _salt_in_every_block(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = hashing.block_extra_keys(0, cache_salt, lora_name)  # block 0's keys everywhere
        parent = hashing.hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_hashes_partial_tail_too, "FULL"),
        (_unchained, "chain"),
        (_salt_in_every_block, "salt"),
    ],
)
def test_ch04_hash_request_tokens_rejects_typical_mistakes(wrong, expected_message):
    rejects(check_hash_request_tokens, wrong, expected_message, regex=True)


def _hexdigest_instead_of_digest(parent, token_ids, extra_keys=None):
    return hashing.hash_block_tokens(parent, token_ids, extra_keys).hex()


def _python_builtin_hash(parent, token_ids, extra_keys=None):
    return hash((parent or hashing.NONE_HASH, tuple(token_ids), extra_keys))


def _pickles_the_list(parent, token_ids, extra_keys=None):
    parent = parent or hashing.NONE_HASH
    return hashlib.sha256(pickle.dumps((parent, list(token_ids), extra_keys), protocol=5)).digest()


def _default_protocol(parent, token_ids, extra_keys=None):
    parent = parent or hashing.NONE_HASH
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra_keys))).digest()


def _tokens_first(parent, token_ids, extra_keys=None):
    parent = parent or hashing.NONE_HASH
    return hashlib.sha256(pickle.dumps((tuple(token_ids), parent, extra_keys), protocol=5)).digest()


def _empty_tuple_for_no_extra_keys(parent, token_ids, extra_keys=None):
    parent = parent or hashing.NONE_HASH
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra_keys or ()), protocol=5)).digest()


# Found by a learner: these three got the whole recipe as their hint, not the one difference.
@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        pytest.param(
            _default_protocol,
            "without protocol=5",
            marks=pytest.mark.skipif(pickle.DEFAULT_PROTOCOL == 5, reason="pickle's default is protocol 5 here"),
        ),
        (_tokens_first, r"you hashed \(tuple\(token_ids\), parent, extra_keys\)"),
        (_empty_tuple_for_no_extra_keys, "not \\(\\)"),
    ],
)
def test_ch04_hash_block_tokens_names_the_one_difference_from_the_recipe(wrong, expected_message):
    rejects(check_hash_block_tokens, wrong, expected_message, regex=True)


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_hexdigest_instead_of_digest, "digest"),
        (_python_builtin_hash, "bytes"),
        (_pickles_the_list, "tuple"),
    ],
)
def test_ch04_hash_block_tokens_rejects_the_wrong_output_type_and_serialization(wrong, expected_message):
    rejects(check_hash_block_tokens, wrong, expected_message, regex=True)


def _lora_only_in_block_zero(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = hashing.block_extra_keys(i, cache_salt, lora_name if i == 0 else None)
        parent = hashing.hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes


def _untagged_extra_keys(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = [k for k in (lora_name, cache_salt if i == 0 else None) if k is not None]
        parent = hashing.hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], tuple(keys) or None
        )
        hashes.append(parent)
    return hashes


def _salt_ignored(token_ids, block_size, cache_salt=None, lora_name=None):
    return hashing.hash_request_tokens(token_ids, block_size, None, lora_name)


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_lora_only_in_block_zero, "LoRA name goes into every block"),
        (_untagged_extra_keys, "tag each key"),
        (_salt_ignored, "salt"),
    ],
)
def test_ch04_hash_request_tokens_rejects_extra_key_mistakes(wrong, expected_message):
    rejects(check_hash_request_tokens, wrong, expected_message, regex=True)


def test_ch04_hash_request_tokens_names_the_first_differing_block():
    with pytest.raises(AssertionError, match=r"block 1 \(tokens 16\.\.31\) is the first whose hash differs"):
        check_hash_request_tokens(_lora_only_in_block_zero)


def _md5_digest(parent, token_ids, extra_keys=None):
    """A 128-bit hash (xxh3-128 gives 16 bytes too): bytes, but not 32 of them."""
    parent = hashing.NONE_HASH if parent is None else parent
    return hashlib.md5(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)).digest()


def test_ch04_hash_block_tokens_names_a_16_byte_digest_by_its_length():
    """The old message said "returned b'...' (bytes), not 32 bytes", with a hint about .hexdigest() and hash()."""
    message = rejects(check_hash_block_tokens, _md5_digest, "returned 16 bytes, not 32: SHA-256's digest is 32 bytes")
    assert "hexdigest" not in message


def _block_extra_keys_arguments_swapped(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = hashing.block_extra_keys(i, lora_name, cache_salt)  # (index, lora_name, cache_salt)
        parent = hashing.hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes


def _extra_keys_as_a_list(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = []
        if lora_name is not None:
            keys.append(("lora", lora_name, None))
        if cache_salt and i == 0:
            keys.append(("cache_salt", cache_salt))
        parent = hashing.hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], keys or None)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_block_extra_keys_arguments_swapped, "you passed lora_name before cache_salt"),
        (_extra_keys_as_a_list, "your extra keys are a list; they must be a tuple"),
    ],
)
def test_ch04_hash_request_tokens_names_the_extra_keys_misuse(wrong, expected_message):
    """Both got "the salt goes into block 0's extra keys only", which each of them did."""
    message = rejects(check_hash_request_tokens, wrong, expected_message)
    assert "block 0's extra keys only" not in message


def test_ch04_hash_request_tokens_blames_the_learners_own_hash_block_tokens_when_it_is_wrong():
    """The exercise's loop calls the notebook's hash_block_tokens: a right loop over a wrong hash was told
    "block 0 is hash_block_tokens(None, token_ids[0:16], None)", which is what it did."""
    notebook = {}
    exec(  # the two exercise cells: a hash without NONE_HASH (it failed its own check), a right loop
        "import hashlib, pickle\n"
        "from mini_vllm.hashing import block_extra_keys\n"
        "def hash_block_tokens(parent_block_hash, token_ids, extra_keys=None):\n"
        "    payload = pickle.dumps((parent_block_hash, tuple(token_ids), extra_keys), protocol=5)\n"
        "    return hashlib.sha256(payload).digest()\n"
        "def hash_request_tokens(token_ids, block_size, cache_salt=None, lora_name=None):\n"
        "    hashes, parent = [], None\n"
        "    for i in range(len(token_ids) // block_size):\n"
        "        block = token_ids[i * block_size : (i + 1) * block_size]\n"
        "        parent = hash_block_tokens(parent, block, block_extra_keys(i, cache_salt, lora_name))\n"
        "        hashes.append(parent)\n"
        "    return hashes\n",
        notebook,
    )
    message = rejects(check_hash_request_tokens, notebook["hash_request_tokens"], "does not pass its check yet")
    assert "fix hash_block_tokens first" in message and "hash_block_tokens(None, range(16))" in message
    assert "block 0 is hash_block_tokens(None" not in message


def _chain(token_ids, block_size, cache_salt=None, lora_name=None, *, blocks=None, block=None, keys=True, chained=True):
    """A learner's hash_request_tokens; ``blocks``, ``block``, ``keys``, ``chained`` switch one mistake on."""
    hashes, parent = [], None
    num_blocks = len(token_ids) // block_size if blocks is None else blocks(len(token_ids) // block_size)
    for i in range(num_blocks):
        tokens = token_ids[i * block_size : (i + 1) * block_size] if block is None else block(token_ids, i, block_size)
        extra = hashing.block_extra_keys(i, cache_salt, lora_name) if keys else None
        parent = hashing.hash_block_tokens(parent if chained else None, tokens, extra)
        hashes.append(parent)
    return hashes


def _inline_list_pickle(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent = [], hashing.NONE_HASH
    for i in range(len(token_ids) // block_size):
        payload = (parent, token_ids[i * block_size : (i + 1) * block_size], None)  # the slice is a list
        parent = hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize(
    "wrong, expected_message",
    [
        (functools.partial(_chain, blocks=lambda n: n - 1), "one hash short.*without a - 1"),
        (_inline_list_pickle, "you hashed the slice as a list"),
        (functools.partial(_chain, block=lambda t, i, b: t[i * b : (i + 1) * b + 1]), "your block 0 holds 17 tokens"),
        (functools.partial(_chain, keys=False), "the salt changed no hash: pass each block's extra keys"),
        (
            functools.partial(_chain, block=lambda t, i, b: t[: (i + 1) * b], chained=False),
            "block 0's hash changed with the salt but later ones did not: hash each later block with its parent",
        ),
    ],
    ids=["drops the last block", "list slice", "slice one too long", "no extra keys", "whole prefix, no chain"],
)
def test_ch04_hash_request_tokens_names_mistakes_a_learner_pass_got_general_hints_for(wrong, expected_message):
    rejects(check_hash_request_tokens, wrong, expected_message, regex=True)
