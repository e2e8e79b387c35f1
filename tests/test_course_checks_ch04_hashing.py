"""Every exercise check accepts the reference and rejects the typical mistakes.

Each wrong implementation below is a mistake a learner makes; the check must
raise AssertionError on it (and say something useful)."""

from __future__ import annotations

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
