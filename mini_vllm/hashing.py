"""Block hashes: how a prefix of tokens gets a name (chapter 04).

A block's hash names the block's tokens *and every token before them*: it is
computed from the parent block's hash, the block's own token ids and a few
"extra keys" (a per-tenant ``cache_salt``, a LoRA adapter name). Two requests
therefore get the same hash for block ``i`` exactly when their first
``(i + 1) * block_size`` tokens (and extra keys) are equal — which is exactly
when the K/V stored in that block are equal, because a causal model's K/V at a
position depend only on the tokens up to that position.

Only *full* blocks are hashed: a partial block may still change.

vLLM equivalents: ``vllm/v1/core/kv_cache_utils.py`` (``NONE_HASH``,
``hash_block_tokens``, ``hash_request_tokens``, ``generate_block_hash_extra_keys``)
and ``--prefix-caching-hash-algo`` (``sha256``, ``sha256_cbor``, ``xxhash``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Optional

BlockHash = bytes
"""A block hash: 32 bytes of SHA-256 (16 with xxhash)."""

ExtraKeys = Optional[tuple[Any, ...]]

# Tags keep the kinds of extra key apart: a cache_salt "x" and a LoRA named "x"
# must never produce the same hash.
SALT_TAG = "cache_salt"
LORA_TAG = "lora"


def sha256(data: bytes) -> bytes:
    """The default hash: SHA-256 (collision-resistant; vLLM's default since 0.10.2)."""
    return hashlib.sha256(data).digest()


def xxhash128(data: bytes) -> bytes:
    """A fast non-cryptographic hash (xxh3, 128 bits).

    Much faster than SHA-256, but an attacker who can choose prompts can craft
    collisions on purpose: a collision makes one tenant's request reuse another
    tenant's K/V. Only choose it when every prompt is trusted.
    """
    try:
        import xxhash
    except ImportError as err:  # optional dependency (the course extra installs it)
        raise ValueError("hash_algo='xxhash' needs the 'xxhash' package: pip install xxhash") from err
    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {"sha256": sha256, "xxhash": xxhash128}


def get_hash_function(hash_algo: str) -> Callable[[bytes], bytes]:
    """Return the hash function called ``hash_algo`` (ValueError for unknown names)."""
    try:
        return HASH_FUNCTIONS[hash_algo]
    except KeyError:
        raise ValueError(f"unknown hash_algo {hash_algo!r}; expected one of {sorted(HASH_FUNCTIONS)}") from None


def _make_none_hash() -> bytes:
    """The parent of every request's first block.

    Fixed by default, so the hashes the course prints are the same in every
    process and on every machine. When ``PYTHONHASHSEED`` is set it is derived
    from that instead, as vLLM does, so a deployment can make its hashes
    unpredictable to outsiders.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return sha256(b"mini-vllm: NONE_HASH")
    return sha256(seed.encode())


NONE_HASH: BlockHash = _make_none_hash()


def hash_block_tokens(
    parent_block_hash: Optional[BlockHash],
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
    hash_fn: Callable[[bytes], bytes] = sha256,
) -> BlockHash:
    """Hash one full block, chained to its parent.

    The input is serialized with pickle, which is unambiguous: ``(1, 23)`` and
    ``(12, 3)`` serialize differently, as do a salt and a LoRA name of the
    same text (their tags differ). A first block passes ``parent_block_hash=None``
    and gets ``NONE_HASH`` as its parent.
    """
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    payload = pickle.dumps((parent_block_hash, tuple(token_ids), extra_keys), protocol=5)
    return hash_fn(payload)


def block_extra_keys(block_index: int, cache_salt: Optional[str] = None, lora_name: Optional[str] = None) -> ExtraKeys:
    """The extra keys of block ``block_index``, or None when it has none.

    The LoRA name enters every block (the same tokens through another adapter
    give other K/V). The salt enters block 0 only: every later block inherits
    it through the chain of parent hashes.
    """
    keys: list[tuple[str, str]] = []
    if lora_name is not None:
        keys.append((LORA_TAG, lora_name))
    if cache_salt is not None and block_index == 0:
        keys.append((SALT_TAG, cache_salt))
    return tuple(keys) if keys else None


def hash_new_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    block_hashes: Sequence[BlockHash],
    cache_salt: Optional[str] = None,
    lora_name: Optional[str] = None,
    hash_fn: Callable[[bytes], bytes] = sha256,
) -> list[BlockHash]:
    """Hash the full blocks of ``token_ids`` that ``block_hashes`` does not cover yet.

    ``block_hashes`` are the hashes already computed for the first blocks; only
    blocks after them are hashed, so a request that grows by one token pays for
    at most one hash, never for its whole prompt again.
    """
    new_hashes: list[BlockHash] = []
    parent = block_hashes[-1] if block_hashes else None
    first_block = len(block_hashes)
    num_full_blocks = len(token_ids) // block_size
    for index in range(first_block, num_full_blocks):
        start = index * block_size
        block_tokens = token_ids[start : start + block_size]
        parent = hash_block_tokens(parent, block_tokens, block_extra_keys(index, cache_salt, lora_name), hash_fn)
        new_hashes.append(parent)
    return new_hashes


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: Optional[str] = None,
    lora_name: Optional[str] = None,
    hash_algo: str = "sha256",
) -> list[BlockHash]:
    """One chained hash per *full* block of ``token_ids`` (a partial tail gets none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return hash_new_full_blocks(token_ids, block_size, [], cache_salt, lora_name, get_hash_function(hash_algo))
