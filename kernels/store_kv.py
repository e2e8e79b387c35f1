"""``store_kv``: write each new token's key and value into its cache slot (chapter 07).

The model runner gives every new token a *slot*, ``block_id * block_size +
offset`` (chapter 03). This kernel is the scatter that puts the token's K/V rows
there, for all KV heads at once:

    k_cache[slot // block_size, slot % block_size, :, :] = key[token]

One program handles one token. It loads the token's ``[num_kv_heads, head_dim]``
tile, converts it to the cache's element type and stores it. A slot of ``-1``
means "no slot" (vLLM uses it for padding tokens): that program stores nothing.

Two habits this small kernel already needs:

- **64-bit offsets.** A slot times the cache's row stride can pass 2**31
  elements in a large cache (a 16 GB bf16 cache has 2**33 elements), and a
  32-bit offset would wrap around and write somewhere else. So the slot is
  converted to int64 *before* it is multiplied by a stride.
- **Masks instead of branches.** Triton programs work on whole tiles; "skip
  this token" is a mask that is false everywhere, not an early ``return``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import TRITON_INTERPRETED
from ._validate import check_store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_key_dim,
    stride_value_token,
    stride_value_head,
    stride_value_dim,
    stride_k_block,
    stride_k_offset,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_offset,
    stride_v_head,
    stride_v_dim,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)

    # int64 first, then the block/offset split and the multiplications by strides.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE

    # The tile covers every KV head and the whole head_dim. Both are padded to a
    # power of two (tl.arange needs one), so a head_dim of 80 becomes 128 columns
    # of which the last 48 are masked off.
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    in_tile = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    # A token without a slot stores nothing: its mask is false everywhere.
    # (tl.where rather than `in_tile & (slot >= 0)`: Triton 3.9's interpreter
    # gives `tile & scalar` an integer type that tl.load rejects as a mask.)
    mask = tl.where(slot >= 0, in_tile, False)

    key_ptrs = key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :] * stride_key_dim
    value_ptrs = (
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :] * stride_value_dim
    )
    k_slot_ptrs = (
        k_cache_ptr
        + block_id * stride_k_block
        + offset_in_block * stride_k_offset
        + heads[:, None] * stride_k_head
        + dims[None, :] * stride_k_dim
    )
    v_slot_ptrs = (
        v_cache_ptr
        + block_id * stride_v_block
        + offset_in_block * stride_v_offset
        + heads[:, None] * stride_v_head
        + dims[None, :] * stride_v_dim
    )

    key = tl.load(key_ptrs, mask=mask)
    value = tl.load(value_ptrs, mask=mask)
    # Convert to the cache's element type (e.g. float32 activations into a bf16 cache).
    tl.store(k_slot_ptrs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_slot_ptrs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``i``'s key/value into cache slot ``slot_mapping[i]`` (in place).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 (or int32); ``-1`` skips a token.

    Same result as :func:`mini_vllm.kernels.reference.store_kv`. Slots must be below
    ``num_blocks * block_size`` (not checked: that would read GPU memory).
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping, TRITON_INTERPRETED)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
