"""The checks of chapters 07 and 08 accept the reference and reject the typical mistakes.

Each wrong implementation below is a mistake a learner makes; the check must
raise AssertionError on it and name the mistake (matched on a word of the hint).
"""

from __future__ import annotations

import collections
import math

import pytest
from course_fixtures import rejects
import torch

from mini_vllm import kernels
from mini_vllm.course import check_paged_decode, check_schedule_waiting, check_store_kv
from mini_vllm.events import ComputedBlocksFound
from mini_vllm.request import RequestStatus
from mini_vllm.scheduler import Scheduler

needs_triton = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason=kernels.UNAVAILABLE_MESSAGE)


# -- chapter 07: store_kv ------------------------------------------------------------
if kernels.TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    def _launch(kernel, key, value, k_cache, v_cache, slot_mapping, grid=None, **constexprs):
        """The launcher the exercise gives the learner (``grid``: a learner's own grid instead of one program a token)."""
        num_tokens = key.shape[0]
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        kernel[grid or (num_tokens,)](
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
            **constexprs,
        )

    # The learner's typical mistakes, as values of the MISTAKE constexpr below.
    MISTAKES = {
        "none": 0,
        "-1 not skipped": 1,
        "int32 offsets": 2,
        "K written into V's cache": 3,
        "slot used as an element offset": 4,
        "slot treated as a block id": 5,
        "key/value strides ignored": 6,
        "no mask on the loads and stores": 7,
        "head_dim left out of the mask": 8,
        "heads left out of the mask": 9,
        "slot * stride_cache_offset": 10,
        "cache strides worked out from the shape": 11,
        "tile mask & slot >= 0": 12,
        "value loaded with the key's strides": 13,
        "offset and head strides from the shape": 14,
        "no mask on the loads (the stores masked)": 15,
        "no heads * stride_cache_head": 16,
        "program id as the slot": 17,
        "slot > 0": 18,
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
        """A correct store_kv (MISTAKE == 0), or one with exactly one typical mistake."""
        token = tl.program_id(0)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
        in_tile = (heads < num_kv_heads) & (dims < head_dim)
        if MISTAKE == 8:
            in_tile = (heads < num_kv_heads) & (dims < HEAD_DIM_PAD)  # "the padded width is the row"
        if MISTAKE == 9:
            in_tile = (heads < HEADS_PAD) & (dims < head_dim)
        if MISTAKE == 2:
            slot = tl.load(slot_mapping_ptr + token)  # int32 when slot_mapping is int32
        else:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if MISTAKE == 12:
            in_tile = in_tile & (slot >= 0)  # the pitfall the exercise warns of (no early return)
        elif MISTAKE == 18:
            if slot <= 0:  # "skip the padding tokens" with slot > 0 taken as a real slot
                return
        elif MISTAKE != 1:
            if slot < 0:
                return
        if MISTAKE == 17:
            slot = token.to(tl.int64)  # the program id where slot_mapping[token] belongs
        if MISTAKE == 4:
            row = slot + heads * stride_cache_head + dims  # the slot, not slot * row stride
        elif MISTAKE == 5:
            row = slot * stride_cache_block + heads * stride_cache_head + dims  # the slot as a block id
        elif MISTAKE == 10:
            row = slot * stride_cache_offset + heads * stride_cache_head + dims  # no block/offset split
        elif MISTAKE == 11:  # "the cache is [num_blocks, block_size, heads, head_dim]": its strides from the shape
            row = (slot // BLOCK_SIZE) * (BLOCK_SIZE * num_kv_heads * head_dim)
            row = row + (slot % BLOCK_SIZE) * (num_kv_heads * head_dim) + heads * head_dim + dims
        elif MISTAKE == 14:  # the block stride taken, the rest "known" from the shape
            row = (slot // BLOCK_SIZE) * stride_cache_block
            row = row + (slot % BLOCK_SIZE) * (num_kv_heads * head_dim) + heads * head_dim + dims
        elif MISTAKE == 16:  # no heads * stride_cache_head: a [1, HEAD_DIM_PAD] address tile
            row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset + dims
        else:
            row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
            row = row + heads * stride_cache_head + dims
        if MISTAKE == 6:
            source = token * num_kv_heads * head_dim + heads * head_dim + dims  # ignores the strides
            key = tl.load(key_ptr + source, mask=in_tile)
            value = tl.load(value_ptr + source, mask=in_tile)
        elif MISTAKE == 7:  # no mask anywhere: every lane of the padded tile is loaded and stored
            key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims)
            value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims)
            tl.store(k_cache_ptr + row, key)
            tl.store(v_cache_ptr + row, value)
            return
        elif MISTAKE == 15:  # the stores are masked, the loads are not
            key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims)
            value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims)
        elif MISTAKE == 13:
            key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=in_tile)
            value = tl.load(value_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=in_tile)
        else:
            key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=in_tile)
            value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=in_tile)
        tl.store(k_cache_ptr + row, key, mask=in_tile)
        if MISTAKE == 3:
            tl.store(v_cache_ptr + row, key, mask=in_tile)  # K where V belongs
        else:
            tl.store(v_cache_ptr + row, value, mask=in_tile)

    @triton.jit
    def _stub_kernel(
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
    ):
        token = tl.program_id(0)  # noqa: F841 (a learner's untouched stub)
        raise NotImplementedError("your code here: see the instructions above")


def _store_kv_with(mistake: str):
    def store_kv(key, value, k_cache, v_cache, slot_mapping):
        _launch(_store_kv_kernel, key, value, k_cache, v_cache, slot_mapping, MISTAKE=MISTAKES[mistake])

    return store_kv


def _store_kv_with_a_power_of_two_grid(key, value, k_cache, v_cache, slot_mapping):
    """A correct kernel launched on a grid rounded up to a power of two ("Triton likes powers of two")."""
    grid = (triton.next_power_of_2(key.shape[0]),)
    _launch(_store_kv_kernel, key, value, k_cache, v_cache, slot_mapping, grid=grid, MISTAKE=0)


def _stub_store_kv(key, value, k_cache, v_cache, slot_mapping):
    _launch(_stub_kernel, key, value, k_cache, v_cache, slot_mapping)


@needs_triton
def test_ch07_store_kv_accepts_a_correct_kernel(capsys):
    check_store_kv(_store_kv_with("none"))
    assert "✓ store_kv" in capsys.readouterr().out


@needs_triton
def test_ch07_store_kv_accepts_the_packaged_kernel(capsys):
    check_store_kv(kernels.store_kv)
    assert "✓ store_kv" in capsys.readouterr().out


@needs_triton
@pytest.mark.parametrize(
    "mistake, expected_message",
    [
        ("-1 not skipped", "slot -1"),
        ("int32 offsets", "int64"),
        ("K written into V's cache", "v_cache"),
        ("slot used as an element offset", "element offset"),
        ("slot treated as a block id", "block stride"),
        ("key/value strides ignored", "stride_key_token"),
    ],
)
def test_ch07_store_kv_rejects_typical_mistakes(mistake, expected_message):
    rejects(check_store_kv, _store_kv_with(mistake), expected_message, regex=True)


@needs_triton
@pytest.mark.parametrize(
    "mistake, case, lanes",
    [
        ("no mask on the loads and stores", "one KV head, head_dim 12", "dims 12..15 of every head"),
        ("head_dim left out of the mask", "one KV head, head_dim 12", "dims 12..15 of every head"),
        ("heads left out of the mask", "three KV heads", "head 3: 3 KV heads are padded to 4"),
    ],
)
def test_ch07_store_kv_a_missing_mask_is_named(mistake, case, lanes):
    """The old message blamed the slot arithmetic ("a slot is block_id * block_size + offset") or said
    only that other slots changed; the stores past each head's row are the padding lanes of the tile."""
    message = rejects(check_store_kv, _store_kv_with(mistake), "where the tile's padding lanes fall")
    assert case in message and lanes in message and "mask=in_tile" in message
    assert "slot // BLOCK_SIZE" not in message


@needs_triton
@pytest.mark.parametrize("mistake", ["slot * stride_cache_offset", "cache strides worked out from the shape"])
def test_ch07_store_kv_a_cache_whose_blocks_are_not_packed_needs_stride_cache_block(mistake):
    """Both passed: every cache of the check was contiguous, where slot * stride_cache_offset is right."""
    message = rejects(check_store_kv, _store_kv_with(mistake), "you ignored stride_cache_block")
    assert "views into one [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor" in message
    assert "landed at element 80 of k_cache instead of 144" in message  # token 0, slot 5
    assert "blocks are 128 elements apart, not block_size * stride_cache_offset = 64" in message


@needs_triton
def test_ch07_store_kv_offset_and_head_strides_from_the_shape_are_named():
    """Passed: the interleaved case changes only the block stride; the heads-first case changes the other two."""
    message = rejects(check_store_kv, _store_kv_with("offset and head strides from the shape"), "its heads are")
    assert "views of [num_blocks, num_kv_heads, block_size, head_dim] tensors" in message
    assert "token 0's key (slot 5 = block 1, offset 1) was written as one run of 16 elements" in message
    assert "heads are 32 elements apart (stride_cache_head) and its slots 8 (stride_cache_offset)" in message
    assert "worked out the offset and head strides from the shape" in message


@needs_triton
def test_ch07_store_kv_a_value_loaded_with_the_keys_strides_is_named():
    message = rejects(check_store_kv, _store_kv_with("value loaded with the key's strides"), "key is right")
    assert "value is a view with other strides than key" in message
    assert "stride_value_token" in message and "landed at element" not in message


@needs_triton
def test_ch07_store_kv_a_tile_mask_anded_with_the_slot_condition_is_named():
    """The old hint said only "build it from comparisons combined with & and |", which the learner had done."""
    message = rejects(check_store_kv, _store_kv_with("tile mask & slot >= 0"), "in_tile & (slot >= 0)")
    assert "if slot < 0: return" in message and "tl.where(slot >= 0, in_tile, False)" in message


@needs_triton
def test_ch07_store_kv_a_store_past_num_tokens_is_named():
    """Without the bait slot after slot_mapping, the extra programs read garbage slots (the process could crash)."""
    message = rejects(check_store_kv, _store_kv_with_a_power_of_two_grid, "stored a token past num_tokens")
    assert "five tokens in scattered slots" in message and "slot 15 changed" in message
    assert "grid = (num_tokens,)" in message


@needs_triton
@pytest.mark.skipif(
    not kernels.TRITON_INTERPRETED, reason="a compiled kernel's reads cannot be seen; the interpreter's can"
)
def test_ch07_store_kv_unmasked_loads_behind_masked_stores_are_named():
    """Passed: the stores' mask kept every wrong lane out of the caches. The interpreter's loads are recorded."""
    message = rejects(check_store_kv, _store_kv_with("no mask on the loads (the stores masked)"), "tl.load has no mask")
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


@needs_triton
def test_ch07_store_kv_reports_the_stub_as_not_implemented():
    with pytest.raises(NotImplementedError):
        check_store_kv(_stub_store_kv)


# -- chapter 07: paged decode ----------------------------------------------------------
def _paged_decode(query, k_cache, v_cache, block_table, seq_len, scale=None, *, mistake=None):
    """The exercise's solution, with one optional mistake switched on."""
    num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if mistake in ("group upside down", "group upside down, repeat_interleave"):
        group = num_kv_heads // num_q_heads  # 0 when the query has more heads
    if scale is None and mistake == "default scale 1/head_dim":
        scale = 1.0 / head_dim
    if scale is None or mistake == "ignores scale":
        scale = head_dim**-0.5
    if mistake == "no scale":
        scale = 1.0
    if mistake == "gqa modulo":
        kv_head_of = torch.arange(num_q_heads) % num_kv_heads
    elif mistake != "group upside down, repeat_interleave":
        kv_head_of = torch.arange(num_q_heads) // group
    # "computes in the query's dtype": float16/bfloat16 arithmetic throughout, where float32 is asked.
    dtype = query.dtype if mistake == "computes in the query's dtype" else torch.float32
    running_max = torch.full((num_q_heads,), float("-inf"), dtype=dtype)
    running_sum = torch.zeros(num_q_heads, dtype=dtype)
    acc = torch.zeros(num_q_heads, head_dim, dtype=dtype)
    if mistake == "block_size 16":
        block_size = 16
    num_blocks = seq_len // block_size if mistake == "floor division" else math.ceil(seq_len / block_size)
    for i in range(num_blocks + (mistake == "one block too many")):
        block = i if mistake == "logical ids" else int(block_table[i])
        valid = min(block_size, seq_len - i * block_size)
        if mistake == "every block partial":
            valid = seq_len % block_size or block_size
        if mistake == "last block seq_len % block_size" and i == num_blocks - 1:
            valid = seq_len % block_size  # 0 when the last block is full
            if valid == 0:
                continue
        if mistake in ("no mask", "masks scores only"):
            valid_rows = block_size
        else:
            valid_rows = valid
        if mistake == "group upside down, repeat_interleave":  # the solution's way to give K the query's heads
            k = k_cache[block, :valid_rows].to(dtype).repeat_interleave(group, dim=1)
            v = v_cache[block, :valid_rows].to(dtype).repeat_interleave(group, dim=1)
        else:
            k = k_cache[block, :valid_rows, kv_head_of].to(dtype)  # [n, Hq, D]
            v = v_cache[block, :valid_rows, kv_head_of].to(dtype)
        if mistake == "query scaled in place":
            query.mul_(scale)
            scale = 1.0
        scores = torch.einsum("hd,nhd->hn", query.to(dtype), k) * scale
        if mistake == "masks scores only":
            scores[:, valid:] = float("-inf")
        new_max = torch.maximum(running_max, scores.max(dim=1).values)
        weights = torch.exp(scores - new_max[:, None])
        rescale = torch.exp(running_max - new_max)
        if mistake in ("no rescale of the sum", "no rescale"):
            running_sum = running_sum + weights.sum(dim=1)  # the old terms keep their old max
        else:
            running_sum = running_sum * rescale + weights.sum(dim=1)
        if mistake in ("no rescale of acc", "no rescale"):
            acc = acc + torch.einsum("hn,nhd->hd", weights, v)
        else:
            acc = acc * rescale[:, None] + torch.einsum("hn,nhd->hd", weights, v)
        running_max = new_max
    return (acc / running_sum[:, None]).to(query.dtype)


def test_ch07_paged_decode_accepts_the_solution(capsys):
    check_paged_decode(_paged_decode)
    assert "✓ paged_decode" in capsys.readouterr().out


def test_ch07_paged_decode_accepts_a_gather_then_softmax_version(capsys):
    from mini_vllm.kernels import reference

    def gather_then_softmax(query, k_cache, v_cache, block_table, seq_len, scale=None):
        out = reference.paged_attention(
            query[None],
            k_cache,
            v_cache,
            block_table[None].to(torch.int32),
            torch.tensor([seq_len], dtype=torch.int32),
            scale,
        )
        return out[0]

    check_paged_decode(gather_then_softmax)
    assert "✓ paged_decode" in capsys.readouterr().out


@pytest.mark.parametrize(
    "mistake, expected_message",
    [
        ("no mask", "mask|past seq_len"),
        ("masks scores only", "0 \\* NaN"),
        ("logical ids", "physical block"),
        ("no scale", "sqrt"),
        ("ignores scale", "`scale` argument"),
        ("gqa modulo", "h // 2"),
    ],
)
def test_ch07_paged_decode_rejects_typical_mistakes(mistake, expected_message):
    def wrong(*args, **kwargs):
        return _paged_decode(*args, mistake=mistake, **kwargs)

    rejects(check_paged_decode, wrong, expected_message, regex=True)


@pytest.mark.parametrize(
    "mistake, left_out",
    [
        ("no rescale of acc", "never rescales the accumulator acc"),
        ("no rescale of the sum", "never rescales the running sum"),
        ("no rescale", "never rescales the accumulator and the running sum"),
    ],
)
def test_ch07_paged_decode_a_missing_rescale_is_named(mistake, left_out):
    """The old message was only "compare your loop with mini_vllm.kernels.reference.paged_attention on this case"."""

    def wrong(*args, **kwargs):
        return _paged_decode(*args, mistake=mistake, **kwargs)

    message = rejects(check_paged_decode, wrong, "the online-softmax rescale is missing")
    assert left_out in message
    assert "three full blocks in shuffled physical blocks (seq_len=12" in message  # the input it failed on
    # the separating inputs: right when the max never changes, wrong where it grows
    assert "(the running max never changes) your output is right" in message
    assert "max grows in the sequence's block" in message and "exp(old_max - new_max)" in message


@pytest.mark.parametrize(
    "mistake, case, expected_message",
    [
        (
            "last block seq_len % block_size",
            "one full block, block_table [0]",
            "last block is full here (seq_len 4 is a multiple of block_size 4), and your loop took none of its tokens",
        ),
        ("default scale 1/head_dim", "one full block, block_table [0]", "your default scale is 1/head_dim (1/8)"),
        (
            "floor division",
            "a partial last block (unused slots hold 100.0)",
            "you left out the partial last block: its 2 token(s) (positions 8..9)",
        ),
    ],
)
def test_ch07_paged_decode_names_the_last_block_and_scale_mistakes(mistake, case, expected_message):
    """The old messages: "slots past seq_len ... hold NaN" for a full last block counted as 0 tokens (there
    are no such slots), and "compare your loop with the reference" for the other two."""

    def wrong(*args, **kwargs):
        return _paged_decode(*args, mistake=mistake, **kwargs)

    message = rejects(check_paged_decode, wrong, expected_message)
    assert case in message and "compare your loop" not in message and "past seq_len" not in message


@pytest.mark.parametrize(
    "mistake, expected_message",
    [
        (
            "block_size 16",
            "(?s)three full blocks in shuffled physical blocks.*your loop read only the sequence's first 1 block\\(s\\) "
            "\\(4 tokens\\) of its 3.*a block_size of 16 gives",
        ),
        (
            "every block partial",
            "(?s)a partial last block.*you took 2 token\\(s\\) \\(seq_len % block_size\\) from EVERY block",
        ),
        (
            "one block too many",
            "(?s)one full block, block_table \\[0\\].*raised IndexError.*\\n.*\\n.*likely mistake: an index past the end of "
            "the block table or of a block: the sequence has ceil\\(seq_len / block_size\\) = 1 blocks",
        ),
    ],
)
def test_ch07_paged_decode_names_mistakes_learner_passes_got_general_hints_for(mistake, expected_message):
    """A learner pass got "compare your loop with the reference" for the first two and exercise 01's
    hint about sizing a KV cache for len(prompt) + max_new_tokens for the third."""

    def wrong(*args, **kwargs):
        return _paged_decode(*args, mistake=mistake, **kwargs)

    message = rejects(check_paged_decode, wrong, expected_message, regex=True)
    assert "compare your loop" not in message and "max_new_tokens" not in message


@pytest.mark.parametrize(
    "mistake, told",
    [
        ("group upside down", "here 4 query heads share 2 KV heads"),
        ("group upside down, repeat_interleave", "your K has 0 heads where the query has 4"),
    ],
)
def test_ch07_paged_decode_a_group_upside_down_is_named(mistake, told):
    """group = num_kv_heads // num_q_heads (0): the hint was "RuntimeError: read the traceback below"."""

    def wrong(*args, **kwargs):
        return _paged_decode(*args, mistake=mistake, **kwargs)

    message = rejects(check_paged_decode, wrong, f"{told}: group = num_q_heads // num_kv_heads = 2")
    assert "grouped-query attention: 4 query heads share 2 KV heads" in message
    assert "read the traceback" not in message


def test_ch07_paged_decode_a_query_scaled_in_place_is_named():
    """The hint spoke of the caches only ("read them, never write them")."""

    def wrong(*args, **kwargs):
        return _paged_decode(*args, mistake="query scaled in place", **kwargs)

    message = rejects(check_paged_decode, wrong, "changed the query it was given")
    assert "query.mul_(scale)" in message and "q = query.float() * scale" in message
    assert "the caches are shared" not in message


def test_ch07_paged_decode_half_precision_arithmetic_is_told_to_accumulate_in_float32():
    """float16/bfloat16 arithmetic passed the old 2e-2 tolerance; it is several ulps off the float32 result."""

    def wrong(*args, **kwargs):
        return _paged_decode(*args, mistake="computes in the query's dtype", **kwargs)

    message = rejects(check_paged_decode, wrong, "accumulate in float32")
    assert "float16 query and caches" in message and "dtype=torch.float16" in message  # the case
    assert "ulps of float16 away from the float32 result" in message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ch07_paged_decode_ulp_tolerance_separates_float32_from_half_accumulation(dtype):
    """On the check's long half-precision case: float32 accumulation is within 1 ulp, half arithmetic is not."""
    from mini_vllm.course.kernel_checks import _DecodeCase, _ulps

    case = _DecodeCase(
        seq_len=64,
        block_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        table=[3, 0, 2, 1],
        num_blocks=4,
        dtype=dtype,
    )
    exact = case.dense(32**-0.5)
    args = (case.query, case.k_cache, case.v_cache, case.block_table, case.seq_len)
    assert _ulps(_paged_decode(*args), exact, case.values, dtype) <= 0.55
    assert _ulps(_paged_decode(*args, mistake="computes in the query's dtype"), exact, case.values, dtype) > 2


# -- chapter 08: schedule_waiting ------------------------------------------------------
def _schedule_waiting(scheduler, token_budget, output, *, mistake=None):
    """The exercise's solution, with one optional mistake switched on."""
    manager = scheduler.kv_cache_manager
    skipped = []
    while scheduler.waiting and (token_budget > 0 or mistake == "no budget guard"):
        if len(scheduler.running) >= scheduler.max_num_seqs and mistake != "ignores max_num_seqs":
            break
        request = scheduler.waiting[-1 if mistake == "looks at the back, takes the front" else 0]
        if mistake == "takes it off the queue before allocating":
            scheduler.waiting.popleft()
        if mistake == "running before allocating":
            request.status = RequestStatus.RUNNING
        if mistake == "no lookup on re-admission" and request.num_cached_tokens >= 0:
            # "it was looked up on its first admission"
            computed_blocks, num_computed_tokens = manager.empty_kv_cache_blocks, 0
        else:
            computed_blocks, num_computed_tokens = manager.get_computed_blocks(request)
        if mistake == "dashboard event before the None check" and scheduler.events.active:
            hit_ids = manager.block_ids_of(computed_blocks)
            scheduler.events.emit(ComputedBlocksFound(request.request_id, hit_ids, num_computed_tokens))
        if mistake == "ignores hits":
            computed_blocks, num_computed_tokens = manager.empty_kv_cache_blocks, 0
        if mistake == "counts the lookup by hand":
            manager.prefix_cache_stats.requests += 1
        num_new_tokens = request.num_tokens - num_computed_tokens
        if mistake == "new tokens worked out before the hit":
            num_new_tokens = request.num_tokens - request.num_computed_tokens  # 0 computed yet: the hit not counted
        if mistake != "no chunking":
            num_new_tokens = min(num_new_tokens, token_budget)
        if mistake == "num_prompt_tokens for num_tokens":
            num_new_tokens = min(request.num_prompt_tokens - num_computed_tokens, token_budget)
        if mistake == "cached set before allocating" and request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        if mistake == "hits not passed to allocate_slots":
            new_blocks = manager.allocate_slots(request, num_new_tokens)
        elif mistake == "asks for the hit's tokens too":
            new_blocks = manager.allocate_slots(
                request, num_new_tokens + num_computed_tokens, num_computed_tokens, computed_blocks
            )
        elif mistake == "hit blocks passed with a count of 0":
            new_blocks = manager.allocate_slots(request, num_new_tokens, 0, computed_blocks)
        else:
            new_blocks = manager.allocate_slots(request, num_new_tokens, num_computed_tokens, computed_blocks)
        if new_blocks is None and mistake != "no None check":
            if mistake == "skips what does not fit":
                skipped.append(scheduler.waiting.popleft())
                continue
            if mistake == "requeues what does not fit at the end":
                scheduler.waiting.append(scheduler.waiting.popleft())
            if mistake == "rotates and tries the next":
                scheduler.waiting.rotate(-1)
                continue
            break
        if mistake == "replaces the waiting queue":
            scheduler.waiting = collections.deque(list(scheduler.waiting)[1:])
        elif mistake != "takes it off the queue before allocating":
            scheduler.waiting.popleft()
        scheduler.running.append(request)
        request.status = RequestStatus.RUNNING
        if mistake in DASHBOARD_LINES and scheduler.events.active:
            hit = {
                "dashboard lines": (request.request_id, manager.block_ids_of(computed_blocks)),
                "dashboard event with the request": (request, manager.block_ids_of(computed_blocks)),
                "dashboard event with the blocks": (request.request_id, computed_blocks),
            }[mistake]
            scheduler.events.emit(ComputedBlocksFound(*hit, num_computed_tokens))
        if request.num_cached_tokens < 0 or mistake == "overwrites num_cached_tokens":
            request.num_cached_tokens = num_computed_tokens
        scheduler.schedule_request(request, num_computed_tokens, num_new_tokens, output)
        token_budget -= num_new_tokens + (num_computed_tokens if mistake == "budget charged for the hit" else 0)
        _MODULE_BUDGET[0] -= num_new_tokens
    scheduler.waiting.extendleft(reversed(skipped))
    return _MODULE_BUDGET[0] if mistake == "a module-level budget" else token_budget


# A learner pass: a budget kept at module level (it only ever goes down) got "cached tokens cost no budget".
_MODULE_BUDGET = [10_000]
DASHBOARD_LINES = ("dashboard lines", "dashboard event with the request", "dashboard event with the blocks")


def _with_mistake(mistake):
    """``schedule_waiting`` with one mistake switched on, as a learner would pass it to the check."""
    return lambda scheduler, token_budget, output: _schedule_waiting(scheduler, token_budget, output, mistake=mistake)


def test_ch08_schedule_waiting_accepts_the_solution(capsys):
    check_schedule_waiting(_schedule_waiting)
    assert "✓ schedule_waiting" in capsys.readouterr().out


def test_ch08_schedule_waiting_accepts_the_scheduler_method(capsys):
    check_schedule_waiting(lambda scheduler, budget, output: Scheduler.schedule_waiting(scheduler, budget, output))
    assert "✓ schedule_waiting" in capsys.readouterr().out


@pytest.mark.parametrize(
    "mistake, expected_message",
    [
        ("ignores hits", "cached tokens"),
        ("hits not passed to allocate_slots", "pass the hit blocks"),
        ("skips what does not fit", "FIFO"),
        ("ignores max_num_seqs", "max_num_seqs"),
        ("no chunking", "budget"),
        ("overwrites num_cached_tokens", "FIRST admission"),
    ],
)
def test_ch08_schedule_waiting_rejects_typical_mistakes(mistake, expected_message):
    rejects(check_schedule_waiting, _with_mistake(mistake), expected_message, regex=True)


@pytest.mark.parametrize(
    "mistake, expected_message",
    [
        (
            "new tokens worked out before the hit",
            "'B' has 11 tokens, 8 of them found in the prefix cache: only 3 are left to compute, and you scheduled "
            "11. Count the hit's tokens as computed before you work out the new ones",
        ),
        ("no budget guard", "the token budget was spent (or was 0 to begin with) and your loop went on admitting"),
    ],
)
def test_ch08_schedule_waiting_names_the_hit_counted_as_new_and_the_missing_budget_guard(mistake, expected_message):
    """The old hints: "chunked prefill: ... min(remaining tokens, token_budget)" (the budget was not the problem)
    and "a ValueError: ... your code asked for more than there is, or did the same thing twice"."""

    message = rejects(check_schedule_waiting, _with_mistake(mistake), expected_message)
    assert "chunked prefill" not in message and "did the same thing twice" not in message


@pytest.mark.parametrize(
    "mistake, expected_message",
    [
        (
            "looks at the back, takes the front",
            "Use one end of the queue for both: scheduler.waiting[0], then popleft()",
        ),
        ("no None check", "allocate_slots returned None for it, and None means nothing was allocated"),
        ("running before allocating", "was not admitted (it did not fit), so it stays waiting"),
        ("takes it off the queue before allocating", "did not fit, so it must stay at the front of scheduler.waiting"),
        ("requeues what does not fit at the end", "yours put it back at the end (append)"),
        ("hit blocks passed with a count of 0", "Pass the hit's token count as allocate_slots' third argument"),
        ("budget charged for the hit", "cached tokens cost no budget"),
    ],
)
def test_ch08_schedule_waiting_names_mistakes_learner_passes_got_other_hints_for(mistake, expected_message):
    """Found by learner passes: each got a generic hint, one about another mistake, or an engine assert."""

    rejects(check_schedule_waiting, _with_mistake(mistake), expected_message)


@pytest.mark.parametrize("look_inside", [len, list, lambda blocks: blocks[0]], ids=["len", "list", "index"])
def test_ch08_schedule_waiting_names_a_hit_treated_as_a_list(look_inside):
    """A learner pass: len(), list() or [0] of the KVCacheBlocks hit got "make a list first" and "wrap it,
    [block]", hints that contradict each other and name neither the hit nor its token count."""

    def counts_the_hit_itself(scheduler, token_budget, output):
        request = scheduler.waiting[0]
        look_inside(scheduler.kv_cache_manager.get_computed_blocks(request)[0])
        return _schedule_waiting(scheduler, token_budget, output)

    message = rejects(check_schedule_waiting, counts_the_hit_itself, "new_computed_blocks is a KVCacheBlocks")
    assert "num_new_local_computed_tokens" in message and "wrap it" not in message and "make a list" not in message


def test_ch08_a_fixed_scenario_catches_the_missing_budget_guard():
    """Not left to a random scenario: the fixed one in which a prompt spends the whole budget catches it."""

    rejects(check_schedule_waiting, _with_mistake("no budget guard"), "an 8-token prompt spends the whole budget of 8")


def test_ch08_schedule_waiting_rejects_a_wrong_return_value():
    def returns_the_budget_it_got(scheduler, token_budget, output):
        _schedule_waiting(scheduler, token_budget, output)
        return token_budget

    rejects(check_schedule_waiting, returns_the_budget_it_got, "budget left", regex=True)


def test_ch08_schedule_waiting_a_loop_that_never_ends_is_stopped_and_a_generator_named():
    """A learner pass: rotating the queue past a request that does not fit hung the check cell forever;
    a `yield` got "schedule_waiting admitted nothing" and "read the traceback below" with none below."""
    rejects(check_schedule_waiting, _with_mistake("rotates and tries the next"), "a loop that never ends")

    def generator(scheduler, token_budget, output):
        yield _schedule_waiting(scheduler, token_budget, output)

    rejects(check_schedule_waiting, generator, "returned a generator: your function has a `yield`")


def test_ch08_schedule_waiting_accepts_the_optional_dashboard_lines(capsys):
    check_schedule_waiting(_with_mistake("dashboard lines"))
    assert "✓ schedule_waiting" in capsys.readouterr().out


@pytest.mark.parametrize(
    "mistake, expected_message, not_expected",
    [
        ("replaces the waiting queue", "replaced scheduler.waiting with a new deque", "cached tokens cost no budget"),
        (
            "dashboard event with the request",
            "request_id must be the request's id (a str), got Request",
            "cached tokens cost no budget",
        ),
        (
            "dashboard event with the blocks",
            "block_ids must be a tuple of the hit blocks' ids (ints), got KVCacheBlocks",
            "cached tokens cost no budget",
        ),
        (
            "dashboard event before the None check",
            "your optional dashboard lines announced the hits",
            "cached tokens cost no budget",
        ),
        ("a module-level budget", "counted from that argument alone", "cached tokens cost no budget"),
        ("asks for the hit's tokens too", "the table is long", "allocated a second time"),
        ("num_prompt_tokens for num_tokens", "num_new_tokens came out negative", "did the same thing twice"),
        ("cached set before allocating", "has not been admitted yet", "on first admission, set"),
    ],
)
def test_ch08_schedule_waiting_names_what_learner_passes_found_passing_or_misnamed(
    mistake, expected_message, not_expected
):
    """Learner passes: replacing scheduler.waiting and wrong dashboard events passed; a budget kept at module
    level was told that cached tokens cost no budget; other hints blamed something else (hits not passed,
    when they were; running out of blocks; a bare rule)."""
    message = rejects(check_schedule_waiting, _with_mistake(mistake), expected_message)
    assert not_expected not in message, message


def test_ch08_schedule_waiting_counting_lookups_by_hand_is_told_to_leave_them_to_the_engine():
    """A learner pass: the hint said "it counts every lookup", which the exercise's text says it does not."""
    message = rejects(check_schedule_waiting, _with_mistake("counts the lookup by hand"), "leave the counters")
    assert "it counts every lookup" not in message


def test_ch08_schedule_waiting_a_re_admission_without_a_lookup_is_named_as_such():
    """Issue 41: a function that skips the lookup when a preempted request comes back was told "get_computed_blocks
    found 16 cached tokens: start from there", a lookup it never made."""
    message = rejects(
        check_schedule_waiting, _with_mistake("no lookup on re-admission"), "your function did not look 'B' up"
    )
    assert "it was preempted and comes back now" in message and "get_computed_blocks found" not in message, message
