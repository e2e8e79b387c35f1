"""hash_block_tokens / hash_request_tokens (DESIGN.md: mini_vllm/hashing.py; chapter 04)."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

import pytest

from mini_vllm import hashing
from mini_vllm.hashing import NONE_HASH, hash_block_tokens, hash_request_tokens


def test_only_full_blocks_are_hashed():
    assert len(hash_request_tokens(list(range(15)), 16)) == 0
    assert len(hash_request_tokens(list(range(16)), 16)) == 1
    assert len(hash_request_tokens(list(range(47)), 16)) == 2
    assert len(hash_request_tokens(list(range(48)), 16)) == 3


def test_hash_is_sha256_of_parent_tokens_and_extra_keys():
    tokens = list(range(16))
    expected = hashlib.sha256(pickle.dumps((NONE_HASH, tuple(tokens), None), protocol=5)).digest()
    assert hash_block_tokens(None, tokens) == expected
    assert len(expected) == 32


def test_first_block_parent_is_none_hash():
    tokens = list(range(16))
    assert hash_block_tokens(None, tokens) == hash_block_tokens(NONE_HASH, tokens)


def test_hashes_are_chained():
    tokens = list(range(48))
    hashes = hash_request_tokens(tokens, 16)
    parent = None
    for i, block_hash in enumerate(hashes):
        assert block_hash == hash_block_tokens(parent, tokens[i * 16 : (i + 1) * 16])
        parent = block_hash


def test_same_block_content_at_another_position_hashes_differently():
    block = [7] * 16
    hashes = hash_request_tokens(block + block, 16)
    assert hashes[0] != hashes[1]
    other = hash_request_tokens([1] * 16 + block, 16)
    assert other[1] != hashes[0] and other[1] != hashes[1]


def test_a_different_early_token_changes_every_later_hash():
    a = list(range(64))
    b = list(a)
    b[3] = 999
    ha, hb = hash_request_tokens(a, 16), hash_request_tokens(b, 16)
    assert all(x != y for x, y in zip(ha, hb))


def test_a_different_late_token_keeps_earlier_hashes():
    a = list(range(64))
    b = list(a)
    b[40] = 999  # in block 2
    ha, hb = hash_request_tokens(a, 16), hash_request_tokens(b, 16)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]


def test_serialization_is_unambiguous():
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    assert hash_block_tokens(None, [1], (("x", "1"),)) != hash_block_tokens(None, [1], (("x1",),))


def test_cache_salt_enters_block_zero_only():
    tokens = list(range(48))
    plain = hash_request_tokens(tokens, 16)
    salted = hash_request_tokens(tokens, 16, cache_salt="tenant-a")
    assert all(p != s for p, s in zip(plain, salted))  # the salt reaches later blocks through the chain
    assert salted[0] == hash_block_tokens(None, tokens[:16], (("cache_salt", "tenant-a"),))
    assert salted[1] == hash_block_tokens(salted[0], tokens[16:32], None)


def test_lora_name_enters_every_block():
    tokens = list(range(32))
    hashes = hash_request_tokens(tokens, 16, lora_name="pirate")
    assert hashes[0] == hash_block_tokens(None, tokens[:16], (("lora", "pirate"),))
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[16:], (("lora", "pirate"),))


def test_salt_and_lora_name_of_the_same_text_never_collide():
    tokens = list(range(32))
    assert hash_request_tokens(tokens, 16, cache_salt="x") != hash_request_tokens(tokens, 16, lora_name="x")


def test_different_salts_give_different_hashes():
    tokens = list(range(16))
    assert hash_request_tokens(tokens, 16, cache_salt="a") != hash_request_tokens(tokens, 16, cache_salt="b")


def _none_hash_in_subprocess(env_seed):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    code = "from mini_vllm.hashing import NONE_HASH; print(NONE_HASH.hex())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_none_hash_is_the_same_in_every_process_by_default():
    assert _none_hash_in_subprocess(None) == _none_hash_in_subprocess(None)


def test_none_hash_follows_pythonhashseed_when_set():
    assert _none_hash_in_subprocess("1") != _none_hash_in_subprocess("2")
    assert _none_hash_in_subprocess("1") == _none_hash_in_subprocess("1")
    assert _none_hash_in_subprocess("1") != _none_hash_in_subprocess(None)


def test_xxhash_is_selectable_and_differs_from_sha256():
    pytest.importorskip("xxhash")
    tokens = list(range(32))
    fast = hash_request_tokens(tokens, 16, hash_algo="xxhash")
    assert len(fast) == 2 and len(fast[0]) == 16
    assert fast != hash_request_tokens(tokens, 16)


def test_unknown_hash_algo_is_a_value_error():
    with pytest.raises(ValueError, match="hash_algo"):
        hashing.get_hash_function("md5")
    with pytest.raises(ValueError, match="block_size"):
        hash_request_tokens([1, 2], 0)
