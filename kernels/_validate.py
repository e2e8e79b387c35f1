"""Argument checks for the kernels: fail early, in Python, with a clear message.

A Triton kernel trusts its pointers. Give it a cache of the wrong shape or a
block table of the wrong integer type and it reads the wrong bytes: at best a
wrong answer, at worst a crash far from the cause. So every public kernel
function first checks shapes, dtypes and devices here and raises ``ValueError``
naming the argument at fault.

The checks only look at metadata (shapes, dtypes, devices), never at values:
reading a value of a GPU tensor would make the CPU wait for the GPU. (The
sliding window's check is the engine's, ``mini_vllm.validation.check_sliding_window``.)
"""

from __future__ import annotations

import torch

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Element types the kernels load and store (arithmetic is float32 inside)."""


def check_floating(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in CACHE_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}")


def check_int_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = " or ".join(str(dtype).removeprefix("torch.") for dtype in allowed)
        raise ValueError(
            f"{name} must be {names}, got {tensor.dtype} "
            f"(convert it with .to(torch.{str(allowed[0]).removeprefix('torch.')}))"
        )


def check_same_device(tensors: dict[str, torch.Tensor], interpreted: bool) -> None:
    """All tensors on one device; a compiled kernel also needs that device to be a GPU."""
    devices = {name: tensor.device for name, tensor in tensors.items()}
    first_name, first_device = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first_device:
            raise ValueError(
                f"all tensors must be on one device: {first_name} is on {first_device}, {name} is on {device}"
            )
    if not interpreted and first_device.type == "cpu":
        raise ValueError(
            "the Triton kernels are compiled for the GPU here, but the tensors are on the CPU; "
            "move them to the GPU, or use mini_vllm.kernels.reference / the torch attention backend"
        )


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, same shape."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_ndim("k_cache", k_cache, 4, layout)
    check_ndim("v_cache", v_cache, 4, layout)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    check_floating("k_cache", k_cache)
    check_floating("v_cache", v_cache)
    if min(k_cache.shape) <= 0:
        raise ValueError(f"the caches must not be empty, got shape {tuple(k_cache.shape)}")


def check_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interpreted: bool,
) -> None:
    check_cache(k_cache, v_cache)
    layout = "[num_tokens, num_kv_heads, head_dim]"
    check_ndim("key", key, 3, layout)
    check_ndim("value", value, 3, layout)
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key's (num_kv_heads, head_dim) = {tuple(key.shape[1:])} does not match the "
            f"cache's {tuple(k_cache.shape[2:])}"
        )
    check_floating("key", key)
    check_floating("value", value)
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_int_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but there are {key.shape[0]} tokens")
    tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    check_same_device(tensors, interpreted)


def check_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    interpreted: bool,
    cu_seqlens_q: torch.Tensor | None = None,
) -> None:
    """Checks shared by paged_attention (``cu_seqlens_q`` None) and unified_attention."""
    check_cache(k_cache, v_cache)
    check_ndim("query", query, 3, "[num_tokens, num_q_heads, head_dim]")
    check_floating("query", query)
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} does not match the cache's head_dim {cache_head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"grouped-query attention needs num_q_heads ({num_q_heads}) to be a multiple of "
            f"num_kv_heads ({num_kv_heads})"
        )
    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_num_blocks]")
    check_int_dtype("block_tables", block_tables, (torch.int32,))
    check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    check_int_dtype("seq_lens", seq_lens, (torch.int32,))
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has {num_seqs} entries")
    tensors = {
        "query": query,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
    }
    if cu_seqlens_q is None:
        if query.shape[0] != num_seqs:
            raise ValueError(
                f"paged_attention is decode: one query token per sequence, but query has "
                f"{query.shape[0]} tokens for {num_seqs} sequences (use unified_attention)"
            )
    else:
        check_ndim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
        check_int_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
        if cu_seqlens_q.shape[0] != num_seqs + 1:
            raise ValueError(
                f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, got {cu_seqlens_q.shape[0]}"
            )
        tensors["cu_seqlens_q"] = cu_seqlens_q
    check_same_device(tensors, interpreted)
