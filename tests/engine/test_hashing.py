"""hash_block_tokens / hash_request_tokens (mini_vllm/hashing.py; chapter 04)."""

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
    # vLLM 0.33's LoRA key is ("lora", name, path); mini-vLLM has no adapters, so the path is None by default.
    tokens = list(range(32))
    hashes = hash_request_tokens(tokens, 16, lora_name="pirate")
    assert hashes[0] == hash_block_tokens(None, tokens[:16], (("lora", "pirate", None),))
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[16:], (("lora", "pirate", None),))


def test_lora_path_is_part_of_the_key():
    tokens = list(range(16))
    one = hash_request_tokens(tokens, 16, lora_name="pirate", lora_path="/adapters/v1")
    two = hash_request_tokens(tokens, 16, lora_name="pirate", lora_path="/adapters/v2")
    assert one != two
    assert one[0] == hash_block_tokens(None, tokens, (("lora", "pirate", "/adapters/v1"),))


def test_lora_key_comes_before_the_salt_key():
    tokens = list(range(16))
    both = hash_request_tokens(tokens, 16, cache_salt="s", lora_name="l", lora_path="p")
    assert both[0] == hash_block_tokens(None, tokens, (("lora", "l", "p"), ("cache_salt", "s")))


def test_empty_cache_salt_is_no_salt():
    tokens = list(range(48))
    assert hash_request_tokens(tokens, 16, cache_salt="") == hash_request_tokens(tokens, 16)
    assert hashing.block_extra_keys(0, cache_salt="") is None
    assert hash_request_tokens(tokens, 16, cache_salt=" ") != hash_request_tokens(tokens, 16)


def test_salt_and_lora_name_of_the_same_text_never_collide():
    tokens = list(range(32))
    assert hash_request_tokens(tokens, 16, cache_salt="x") != hash_request_tokens(tokens, 16, lora_name="x")


def test_different_salts_give_different_hashes():
    tokens = list(range(16))
    assert hash_request_tokens(tokens, 16, cache_salt="a") != hash_request_tokens(tokens, 16, cache_salt="b")


def _none_hash_in_subprocess(env_seed):
    return _none_hash_of_the_module_alone(env_seed)


def test_none_hash_is_the_same_in_every_process_by_default():
    assert _none_hash_in_subprocess(None) == _none_hash_in_subprocess(None)


def test_none_hash_is_derived_as_vllm_derives_it():
    # vLLM 0.33 init_none_hash(sha256): sha256(pickle.dumps(seed)), seed "vllm-none-hash" or PYTHONHASHSEED.
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    assert NONE_HASH == hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()


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


# -- golden values computed by vLLM 0.33 itself ------------------------------------------------
# Computed once by running vLLM 0.33.0's own code (vllm.v1.core.kv_cache_utils: init_none_hash(sha256),
# get_request_block_hasher(4, sha256) on a vllm.v1.request.Request with cache_salt / LoRARequest("pirate",
# 1, "/adapters/pirate")), for the tokens 100..111 in blocks of 4. vLLM 0.32.0 gives the same values.
GOLDEN_TOKENS = list(range(100, 112))
GOLDEN_BLOCK_SIZE = 4
GOLDEN_NONE_HASH = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
GOLDEN_NONE_HASH_PYTHONHASHSEED_1 = "6c68956344ba470573100725dc4e012955decf0d9a09c837566a98f69f9162c9"
GOLDEN_BLOCK_HASHES = {
    "plain": [
        "007f699eb7d4928d9961af00e454b36a0a0a4098a8d565689dc54be60c72d352",
        "7067919812d6ecf8ea6b4199b9c36fc7afe48233e61604824281af633744a7d8",
        "6910c68aa4e180c2f9750095acc2dd53e6fea460f0c1aa835c4c2942a367378d",
    ],
    "salt": [
        "749184ef43d40d21d4804393c2861535202b942ed016446cb8c2e5427ce513de",
        "47f98c3a70f8ecb1a95a78ab60e95f2004eef1bfe167a216864d8851a07a4de6",
        "417eba3eb42820154a6e698e133fb6a38cc5468a8abb1947a3ed49440dc736e4",
    ],
    "lora": [
        "34e000355c663a80d2e9e0f6b6e3320fb350e97506956c4cbd822a7faf59f145",
        "b312cdd607a72b809bb3d7d320583de688b560fb10f9ccac523e107e938169a0",
        "0ab3a067aa927be1e57b69d367ab34ff322b81e209e78b3c899386ca3a00039c",
    ],
    "lora_and_salt": [
        "7cd3f7bbed70939471e4f07248b5426a6fefb8c0a8128ed6a726a0e10f00430d",
        "ec36871cca2ac8c4852a7161e2563f22b2ce9746e261e38b75f44ad74a9b647d",
        "eb732bc5120940df4092901755633e06260f4e23b919181e6a3c09e33de823a9",
    ],
}
GOLDEN_KEYS = {
    "plain": {},
    "salt": {"cache_salt": "tenant-a"},
    "lora": {"lora_name": "pirate", "lora_path": "/adapters/pirate"},
    "lora_and_salt": {"cache_salt": "tenant-a", "lora_name": "pirate", "lora_path": "/adapters/pirate"},
}


def _none_hash_of_the_module_alone(env_seed):
    """NONE_HASH from hashing.py loaded by path in a fresh interpreter (standard library only: fast)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    code = (
        "import importlib.util as u; "
        f"s = u.spec_from_file_location('h', {hashing.__file__!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.NONE_HASH.hex())"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_none_hash_equals_vllm_0_33s():
    assert _none_hash_of_the_module_alone(None) == GOLDEN_NONE_HASH
    assert _none_hash_of_the_module_alone("1") == GOLDEN_NONE_HASH_PYTHONHASHSEED_1
    if "PYTHONHASHSEED" not in os.environ:
        assert NONE_HASH.hex() == GOLDEN_NONE_HASH


@pytest.mark.parametrize("kind", sorted(GOLDEN_BLOCK_HASHES))
def test_block_hashes_equal_vllm_0_33s(kind):
    if "PYTHONHASHSEED" in os.environ:
        pytest.skip("PYTHONHASHSEED is set: every hash follows it")
    hashes = hash_request_tokens(GOLDEN_TOKENS, GOLDEN_BLOCK_SIZE, **GOLDEN_KEYS[kind])
    assert [h.hex() for h in hashes] == GOLDEN_BLOCK_HASHES[kind]


def test_golden_hashes_catch_a_wrong_serialization():
    # Known-wrong variants of the old code: another NONE_HASH seed, pickle protocol 4, untagged keys.
    tokens = GOLDEN_TOKENS[:GOLDEN_BLOCK_SIZE]
    wrong_parent = hashlib.sha256(b"mini-vllm: NONE_HASH").digest()
    wrong = [
        hashlib.sha256(pickle.dumps((wrong_parent, tuple(tokens), None), protocol=5)).digest(),
        hashlib.sha256(pickle.dumps((bytes.fromhex(GOLDEN_NONE_HASH), tuple(tokens), None), protocol=4)).digest(),
    ]
    assert all(h.hex() != GOLDEN_BLOCK_HASHES["plain"][0] for h in wrong)
    untagged_salt = hash_block_tokens(bytes.fromhex(GOLDEN_NONE_HASH), tokens, ("tenant-a",))
    assert untagged_salt.hex() != GOLDEN_BLOCK_HASHES["salt"][0]
    lora_without_path = hash_block_tokens(bytes.fromhex(GOLDEN_NONE_HASH), tokens, (("lora", "pirate"),))
    assert lora_without_path.hex() != GOLDEN_BLOCK_HASHES["lora"][0]


def test_none_hash_keyword_hashes_as_a_process_with_that_seed():
    """``none_hash=none_hash_for(seed)`` gives the hashes of a process started with ``PYTHONHASHSEED=seed``
    (a router hashing for its replicas); left out, this process's ``NONE_HASH``."""
    tokens, seed = list(range(40)), "7"
    code = (
        "import importlib.util as u; "
        f"s = u.spec_from_file_location('h', {hashing.__file__!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); "
        f"print(*[h.hex() for h in m.hash_new_full_blocks({tokens!r}, 16, [], 'tenant')])"
    )
    env = dict(os.environ, PYTHONHASHSEED=seed)
    theirs = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    mine = hash_request_tokens(tokens, 16, "tenant", none_hash=hashing.none_hash_for(seed))
    assert [h.hex() for h in mine] == theirs.stdout.split()
    assert mine != hash_request_tokens(tokens, 16, "tenant")  # the seed's NONE_HASH is not this process's
    assert hash_request_tokens(tokens, 16, none_hash=None) == hash_request_tokens(tokens, 16)
    assert hashing.hash_new_full_blocks(tokens, 16, [], none_hash=NONE_HASH) == hash_request_tokens(tokens, 16)
