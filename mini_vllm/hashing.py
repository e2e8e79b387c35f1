"""Block hashes: how a prefix of tokens gets a name (chapter 04).

A block's hash names the block's tokens *and every token before them*: it is
computed from the parent block's hash, the block's own token ids and a few
"extra keys" (a per-tenant ``cache_salt``, a LoRA adapter name). Two requests
therefore get the same hash for block ``i`` exactly when their first
``(i + 1) * block_size`` tokens (and extra keys) are equal — which is exactly
when the K/V stored in that block are equal, because a causal model's K/V at a
position depend only on the tokens up to that position.

Only *full* blocks are hashed: a partial block may still change.

vLLM equivalents (0.33): ``vllm/v1/core/kv_cache_utils.py`` (``NONE_HASH``,
``init_none_hash``, ``hash_block_tokens``, ``generate_block_hash_extra_keys``, and
``get_request_block_hasher``, which replaced the ``hash_request_tokens`` of older
releases) and ``--prefix-caching-hash-algo`` (``sha256``, ``sha256_cbor``,
``xxhash``, ``xxhash_cbor``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

BlockHash = bytes
"""A block hash: 32 bytes of SHA-256 (16 with xxhash)."""

ExtraKeys = tuple[Any, ...] | None

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


# vLLM 0.33's seed for NONE_HASH when PYTHONHASHSEED is unset and the hash is
# cryptographic (``DEFAULT_NONE_HASH_SEED`` in ``vllm/v1/core/kv_cache_utils.py``).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def resolve_none_hash_seed() -> str:
    """The seed ``NONE_HASH`` is derived from: ``PYTHONHASHSEED`` if set, else the fixed default."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def _make_none_hash() -> bytes:
    """The parent of every request's first block, derived as vLLM 0.33 derives it.

    vLLM 0.33 (``init_none_hash``) hashes the seed *string* with the same
    function it hashes blocks with, i.e. ``sha256(pickle.dumps(seed))``. The
    seed is fixed by default, so the hashes the course prints are the ones
    vLLM computes, in every process and on every machine; with
    ``PYTHONHASHSEED`` set it is that value instead, so a deployment can share
    it across its replicas (or keep it secret).

    One difference: for xxhash vLLM 0.33 uses a *random* per-process seed when
    ``PYTHONHASHSEED`` is unset (a guessable seed would let an attacker
    precompute collisions); here ``NONE_HASH`` is always the SHA-256 one, so
    only the default algorithm is byte-identical to vLLM.
    """
    return none_hash_for(resolve_none_hash_seed())


def none_hash_for(seed: str) -> BlockHash:
    """``NONE_HASH`` of a process started with ``PYTHONHASHSEED=seed`` (a router hashing for its replicas)."""
    return sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL))


NONE_HASH: BlockHash = _make_none_hash()


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
    hash_fn: Callable[[bytes], bytes] = sha256,
) -> BlockHash:
    """Hash one full block, chained to its parent.

    The input is serialized with pickle, which is unambiguous: ``(1, 23)`` and
    ``(12, 3)`` serialize differently, as do a salt and a LoRA name of the
    same text (their tags differ). A first block passes ``parent_block_hash=None``
    and gets ``NONE_HASH`` as its parent.

    Byte-identical to vLLM 0.33's ``hash_block_tokens`` with ``sha256``: the
    same tuple ``(parent, tuple(token_ids), extra_keys)``, pickled with
    ``pickle.HIGHEST_PROTOCOL`` (protocol 5), then SHA-256.
    """
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    payload = pickle.dumps((parent_block_hash, tuple(token_ids), extra_keys), protocol=pickle.HIGHEST_PROTOCOL)
    return hash_fn(payload)


def block_extra_keys(
    block_index: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
) -> ExtraKeys:
    """The extra keys of block ``block_index``, or None when it has none.

    As vLLM 0.33's ``generate_block_hash_extra_keys``: each key is a tagged
    tuple, LoRA first, then the salt.

    * The LoRA key ``("lora", lora_name, lora_path)`` enters every block (the
      same tokens through another adapter give other K/V). The path is part of
      it so that re-pointing a name at another adapter does not reuse old K/V.
      mini-vLLM's engine serves no adapters and never passes a LoRA name: the
      key is here for the lesson (chapter 04) and to hash exactly as vLLM does.
    * The salt key ``("cache_salt", cache_salt)`` enters block 0 only: every
      later block inherits it through the chain of parent hashes. An empty
      salt ``""`` is no salt, as in vLLM.
    """
    keys: list[tuple[str | None, ...]] = []
    if lora_name is not None:
        keys.append((LORA_TAG, lora_name, lora_path))
    if cache_salt and block_index == 0:
        keys.append((SALT_TAG, cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(block_index: int, cache_salt: str | None = None) -> tuple | None:
    """Block ``block_index``'s extra keys as vLLM's KV events publish them: without their tags.

    vLLM's ``to_event_extra_keys``: a router reading the events gets the salt
    (or LoRA name) itself, e.g. ``("tenant-a",)`` for a salted request's first
    block, None for a block with no extra key.
    """
    keys = block_extra_keys(block_index, cache_salt)
    return None if keys is None else tuple(key[1] for key in keys)


def hash_new_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    block_hashes: Sequence[BlockHash],
    cache_salt: str | None = None,
    lora_name: str | None = None,
    hash_fn: Callable[[bytes], bytes] = sha256,
    lora_path: str | None = None,
    *,
    none_hash: BlockHash | None = None,
) -> list[BlockHash]:
    """Hash the full blocks of ``token_ids`` that ``block_hashes`` does not cover yet.

    ``block_hashes`` are the hashes already computed for the first blocks; only
    blocks after them are hashed, so a request that grows by one token pays for
    at most one hash, never for its whole prompt again. ``none_hash``: the first
    block's parent (None: this process's ``NONE_HASH``; a router hashing for
    replicas started with another ``PYTHONHASHSEED`` passes theirs, ``none_hash_for``).
    """
    new_hashes: list[BlockHash] = []
    parent = block_hashes[-1] if block_hashes else none_hash
    first_block = len(block_hashes)
    num_full_blocks = len(token_ids) // block_size
    for index in range(first_block, num_full_blocks):
        start = index * block_size
        block_tokens = token_ids[start : start + block_size]
        parent = hash_block_tokens(
            parent, block_tokens, block_extra_keys(index, cache_salt, lora_name, lora_path), hash_fn
        )
        new_hashes.append(parent)
    return new_hashes


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    hash_algo: str = "sha256",
    lora_path: str | None = None,
    *,
    none_hash: BlockHash | None = None,
) -> list[BlockHash]:
    """One chained hash per *full* block of ``token_ids`` (a partial tail gets none).

    ``lora_name`` / ``lora_path`` hash as vLLM does for a request served
    through a LoRA adapter (``block_extra_keys``); mini-vLLM's engine serves
    no adapters, so its requests never set them. ``none_hash``: the first
    block's parent, as in ``hash_new_full_blocks`` (None: ``NONE_HASH``).
    """
    from .validation import check_block_size  # here, not at the top: this module loads alone (standard library only)

    check_block_size(block_size)
    hash_fn = get_hash_function(hash_algo)
    return hash_new_full_blocks(
        token_ids, block_size, [], cache_salt, lora_name, hash_fn, lora_path, none_hash=none_hash
    )


BlockHasher = Callable[[Sequence[int], int, Sequence[BlockHash], "str | None"], list[BlockHash]]
"""What a ``Request`` calls when tokens fill blocks: ``(token_ids, block_size, block_hashes, cache_salt)``
-> the hashes of the full blocks after ``block_hashes`` (vLLM's ``Request`` takes a ``block_hasher`` too)."""

_REFERENCE_BLOCK_HASHERS: dict[str, BlockHasher] = {}


def make_block_hasher(
    hash_algo: str = "sha256",
    hash_block_tokens: Callable[..., BlockHash] = hash_block_tokens,
    hash_request_tokens: Callable[..., list[BlockHash]] = hash_request_tokens,
) -> BlockHasher:
    """The block hasher of the hashing extension points (``EngineParts.hash_block_tokens`` / ``hash_request_tokens``).

    With this module's own functions it is ``hash_new_full_blocks`` with
    ``hash_algo``'s hash function bound (a ``functools.partial``: nothing in
    between). Otherwise the hashes come from the given functions, which hash
    with SHA-256 as chapter 04's exercise does:

    * ``hash_request_tokens(token_ids, block_size, cache_salt, lora_name)``, when
      it is not the reference, hashes the whole token list and the hasher
      keeps the new blocks' hashes;
    * else ``hash_block_tokens(parent_block_hash, token_ids, extra_keys)``
      hashes each new full block, chained to the one before it.
    """
    own_block, own_request = hash_block_tokens is _hash_block_tokens, hash_request_tokens is _hash_request_tokens
    if own_block and own_request:
        hasher = _REFERENCE_BLOCK_HASHERS.get(hash_algo)
        if hasher is None:
            hasher = functools.partial(hash_new_full_blocks, hash_fn=get_hash_function(hash_algo))
            _REFERENCE_BLOCK_HASHERS[hash_algo] = hasher
        return hasher
    if hash_algo != "sha256":
        raise ValueError(
            f"hash_algo={hash_algo!r}, but the given hash_block_tokens / hash_request_tokens hash with SHA-256: "
            "use hash_algo='sha256' with them"
        )
    if not own_request:

        def hash_with_request_tokens(token_ids, block_size, block_hashes, cache_salt=None) -> list[BlockHash]:
            return list(hash_request_tokens(list(token_ids), block_size, cache_salt, None))[len(block_hashes) :]

        return hash_with_request_tokens

    def hash_with_block_tokens(token_ids, block_size, block_hashes, cache_salt=None) -> list[BlockHash]:
        parent = block_hashes[-1] if block_hashes else None
        new_hashes = []
        for index in range(len(block_hashes), len(token_ids) // block_size):
            block_tokens = list(token_ids[index * block_size : (index + 1) * block_size])
            parent = hash_block_tokens(parent, block_tokens, block_extra_keys(index, cache_salt))
            new_hashes.append(parent)
        return new_hashes

    return hash_with_block_tokens


_hash_block_tokens, _hash_request_tokens = hash_block_tokens, hash_request_tokens  # the references, by identity
