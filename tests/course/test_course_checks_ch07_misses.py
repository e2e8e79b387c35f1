"""Exercise 07's wrong answers that a learner's pass found missed or badly named by its checks.

Each wrong answer below passed ``check_store_kv`` / ``check_paged_decode``, or failed with a message
that named another mistake; the check must now reject it and name the mistake it is.
"""

from __future__ import annotations

import math

import pytest
from course_fixtures import rejects
import torch

from mini_vllm import kernels
from mini_vllm.course import check_paged_decode, check_store_kv

needs_triton = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason=kernels.UNAVAILABLE_MESSAGE)

if kernels.TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    # The wrong answers, as values of the MISTAKE constexpr below (0: the exercise's solution).
    MISTAKES = {
        "none": 0,
        "no mask on the loads": 1,
        "no heads * stride_cache_head": 2,
        "program id as the slot": 3,
        "slot > 0": 4,
    }

    @triton.jit
    def _store_kv_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        stride_key_token,
        stride_key_head,
        stride_value_token,
        stride_value_head,
        stride_cache_block,
        stride_cache_offset,
        stride_cache_head,
        num_kv_heads,
        head_dim,
        BLOCK_SIZE: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        MISTAKE: tl.constexpr,
    ):
        """The exercise's kernel, with the wrong answer MISTAKE in it."""
        token = tl.program_id(0)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
        in_tile = (heads < num_kv_heads) & (dims < head_dim)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if MISTAKE == 4:
            if slot <= 0:  # "skip the padding tokens": slot > 0 taken as a real slot
                return
        else:
            if slot < 0:
                return
        if MISTAKE == 3:
            slot = token.to(tl.int64)  # the program id where slot_mapping[token] belongs
        row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
        if MISTAKE == 2:
            row = row + dims  # no heads * stride_cache_head: a [1, HEAD_DIM_PAD] address tile
        else:
            row = row + heads * stride_cache_head + dims
        key_at = key_ptr + token * stride_key_token + heads * stride_key_head + dims
        value_at = value_ptr + token * stride_value_token + heads * stride_value_head + dims
        if MISTAKE == 1:  # the stores are masked, the loads are not
            key = tl.load(key_at)
            value = tl.load(value_at)
        else:
            key = tl.load(key_at, mask=in_tile)
            value = tl.load(value_at, mask=in_tile)
        tl.store(k_cache_ptr + row, key, mask=in_tile)
        tl.store(v_cache_ptr + row, value, mask=in_tile)


def _store_kv_with(mistake: str):
    """The launcher the exercise gives the learner, launching the kernel above with ``mistake``."""

    def store_kv(key, value, k_cache, v_cache, slot_mapping):
        num_tokens = key.shape[0]
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        _store_kv_kernel[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            num_kv_heads,
            head_dim,
            BLOCK_SIZE=block_size,
            HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            MISTAKE=MISTAKES[mistake],
        )

    return store_kv


@needs_triton
def test_ch07_store_kv_accepts_the_kernel_the_wrong_answers_start_from(capsys):
    check_store_kv(_store_kv_with("none"))
    assert "✓ store_kv" in capsys.readouterr().out


@needs_triton
@pytest.mark.skipif(
    not kernels.TRITON_INTERPRETED, reason="a compiled kernel's reads cannot be seen; the interpreter's can"
)
def test_ch07_store_kv_unmasked_loads_behind_masked_stores_are_named():
    """Passed: the stores' mask kept every wrong lane out of the caches. The interpreter's loads are recorded."""
    message = rejects(check_store_kv, _store_kv_with("no mask on the loads"), "your tl.load has no mask")
    assert "one KV head, head_dim 12" in message
    assert "lanes outside in_tile read past the token's row" in message
    assert "(past the end of key for the last token: an illegal address on a GPU)" in message
    assert "mask=in_tile to both tl.load calls" in message


@needs_triton
def test_ch07_store_kv_an_address_without_the_heads_term_is_named():
    """The hint was the general ValueError guess, about the engine ("No free blocks available")."""
    message = rejects(check_store_kv, _store_kv_with("no heads * stride_cache_head"), "lacks heads * stride_cache_head")
    assert (
        "the address tile is [1, HEAD_DIM_PAD] = [1, 8] but the value is [HEADS_PAD, HEAD_DIM_PAD] = [2, 8]" in message
    )
    assert "No free blocks" not in message


@needs_triton
def test_ch07_store_kv_the_program_id_as_the_slot_is_named():
    """The hint was "token 0's key landed at element 0 instead of 96", which does not say why."""
    message = rejects(check_store_kv, _store_kv_with("program id as the slot"), "landed where slot 0 goes")
    assert "address by slot_mapping[token] (here slot 6), not the program id" in message
    assert "instead of" not in message


@needs_triton
def test_ch07_store_kv_slot_0_skipped_is_named():
    """The hint was "token 1's key is nowhere in k_cache"."""
    message = rejects(
        check_store_kv, _store_kv_with("slot > 0"), "slot 0 is a real slot; only negative slots are skipped"
    )
    assert "token 1 (slot 0 = block 0, offset 0) is not in its slot" in message
    assert "nowhere" not in message


# -- paged_decode ---------------------------------------------------------------------------------
def _paged_decode_with(mistake: str):
    """The exercise's solution (the template's lines first), with the wrong answer ``mistake`` in it."""

    def paged_decode(query, k_cache, v_cache, block_table, seq_len, scale=None):
        num_q_heads, head_dim = query.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_q_heads // num_kv_heads
        if mistake.startswith("group = num_kv // num_q"):
            group = num_kv_heads // num_q_heads  # 0 when the query has more heads
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        if mistake == "query scaled in place":
            q = query.mul_(scale).float()
        else:
            q = query.float() * scale
        running_max = torch.full((num_q_heads,), float("-inf"))
        running_sum = torch.zeros(num_q_heads)
        acc = torch.zeros(num_q_heads, head_dim)
        for i in range(math.ceil(seq_len / block_size)):
            physical = int(block_table[i])
            valid = min(block_size, seq_len - i * block_size)
            k, v = k_cache[physical, :valid].float(), v_cache[physical, :valid].float()
            if mistake != "group = num_kv // num_q, no repeat when group <= 1" or group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q, k)
            new_max = torch.maximum(running_max, scores.max(dim=1).values)
            rescale = torch.exp(running_max - new_max)
            weights = torch.exp(scores - new_max[:, None])
            running_sum = running_sum * rescale + weights.sum(dim=1)
            acc = acc * rescale[:, None] + torch.einsum("hn,nhd->hd", weights, v)
            running_max = new_max
        return (acc / running_sum[:, None]).to(query.dtype)

    return paged_decode


def test_ch07_paged_decode_accepts_the_solution_the_wrong_answers_start_from(capsys):
    check_paged_decode(_paged_decode_with("none"))
    assert "✓ paged_decode" in capsys.readouterr().out


@pytest.mark.parametrize(
    "mistake, k_heads",
    [("group = num_kv // num_q", 0), ("group = num_kv // num_q, no repeat when group <= 1", 2)],
)
def test_ch07_paged_decode_a_group_upside_down_is_named(mistake, k_heads):
    """The hint was "RuntimeError: read the traceback below, it starts at your code"."""
    message = rejects(
        check_paged_decode, _paged_decode_with(mistake), f"your K has {k_heads} heads where the query has 4"
    )
    assert "grouped-query attention: 4 query heads share 2 KV heads" in message
    assert "group = num_q_heads // num_kv_heads = 2" in message
    assert "read the traceback" not in message


def test_ch07_paged_decode_a_query_scaled_in_place_is_named():
    """The hint spoke of the caches only ("read them, never write them")."""
    message = rejects(check_paged_decode, _paged_decode_with("query scaled in place"), "changed the query it was given")
    assert "query.mul_(scale)" in message and "q = query.float() * scale" in message
    assert "the caches are shared" not in message
