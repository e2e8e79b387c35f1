"""The mistake catalogue: what learners really get wrong, and the message each check gives.

Every entry is (a wrong implementation, a fragment of the message that names
the mistake). Each must be rejected with a ``CheckFailure`` (an
``AssertionError``: never a raw IndexError, TypeError or the engine's own
error) whose message holds the fragment. Correct implementations written in
other styles must pass. The classes of mistakes: inputs mutated, state
shared through mutable defaults or class attributes, O(n) where O(1) is
required (measured in the check on a large instance), block sizes that are not
powers of two, pools with caching off or partly in use, non-float32 dtypes and
extreme values, scenario data that varies, the learner's own exceptions,
generators where lists are expected, and the scheduler admitting the right
requests in the wrong order.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle

import pytest

from mini_vllm.events import BlockRemoved
import torch
from course_fixtures import make_decode, rejects
from known_mistakes import free_one_at_a_time

from mini_vllm import kernels
from mini_vllm import hashing
from mini_vllm.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from mini_vllm.course import (
    check_find_longest_cache_hit,
    check_find_sliding_window_cache_hit,
    check_free_blocks,
    check_free_queue,
    check_free_request_blocks,
    check_get_new_blocks,
    check_hash_block_tokens,
    check_hash_request_tokens,
    check_paged_decode,
    check_prompt_fix,
    check_schedule_waiting,
    check_slot_mapping,
    check_store_kv,
)
from mini_vllm.course._harness import CHECKS, CheckFailure
from mini_vllm.course.lookup_checks import reference_find_longest_cache_hit
from mini_vllm.course.prompt_checks import reference_build_messages
from mini_vllm.model_runner import compute_slot_mapping
from mini_vllm.request import RequestStatus
from mini_vllm.scheduler import Scheduler
from mini_vllm.single_type_kv_cache_manager import find_sliding_window_cache_hit


# -- chapter 02: the free queue --------------------------------------------------------
class Queue:
    """A correct queue in another style than the reference: no sentinels, head/tail pointers."""

    def __init__(self, blocks):
        self.head = self.tail = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self):
        if self.head is None:
            raise ValueError("No free blocks available")
        block = self.head
        self.remove(block)
        return block

    def remove(self, block):
        if block.prev_free_block is None:
            self.head = block.next_free_block
        else:
            block.prev_free_block.next_free_block = block.next_free_block
        if block.next_free_block is None:
            self.tail = block.prev_free_block
        else:
            block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block):
        block.prev_free_block, block.next_free_block = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next_free_block = block
        self.tail = block
        self.num_free_blocks += 1

    def appendleft(self, block):
        block.prev_free_block, block.next_free_block = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.head.prev_free_block = block
        self.head = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self):
        blocks, block = [], self.head
        while block is not None:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class SentinelsInTheClassBody(FreeKVCacheBlockQueue):
    """State shared by every queue: the sentinels and the count live on the class."""

    fake_head = KVCacheBlock(-1)
    fake_tail = KVCacheBlock(-1)

    def __init__(self, blocks):
        cls = type(self)
        cls.fake_head.next_free_block, cls.fake_tail.prev_free_block = cls.fake_tail, cls.fake_head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)


class RemoveWalksTheList(Queue):
    def remove(self, block):
        walker = self.head
        while walker is not block:  # "make sure it is in the queue" first: O(n)
            walker = walker.next_free_block
        super().remove(block)


class CountsByWalking(Queue):
    """num_free_blocks computed by walking the list: O(n) for every read."""

    def __init__(self, blocks):
        super().__init__(blocks)

    @property
    def num_free_blocks(self):
        return len(self.get_all_free_blocks())

    @num_free_blocks.setter
    def num_free_blocks(self, value):
        pass


class YieldsTheFreeBlocks(Queue):
    def get_all_free_blocks(self):
        block = self.head
        while block is not None:
            yield block
            block = block.next_free_block


class AppendCallsItself(Queue):
    def append(self, block):
        if self.tail is block:
            return
        self.append(block)  # meant super().append


class ConsumesTheBlocks(Queue):
    """__init__ pops the blocks off the caller's list (the pool's BlockPool.blocks)."""

    def __init__(self, blocks):
        super().__init__([])
        while blocks:
            self.append(blocks.pop(0))


class ListsTheSentinels(FreeKVCacheBlockQueue):
    """Found by a learner: the sentinels in get_all_free_blocks got a hint about __init__'s order."""

    def get_all_free_blocks(self):
        blocks, block = [], self.fake_head
        while block is not None:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class AppendleftSecond(FreeKVCacheBlockQueue):
    """Found by a learner: inserted after the first free block; the hint blamed a stale head."""

    def appendleft(self, block):
        first = self.fake_head.next_free_block
        self._insert_run_after(first if first is not self.fake_tail else self.fake_head, (block,))


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (ListsTheSentinels, "leave the sentinels out"),
        (AppendleftSecond, "appendleft put the block second"),
        (SentinelsInTheClassBody, "two queues alive at once interfere"),
        (ConsumesTheBlocks, "must never change the list of blocks __init__ is given"),
        (RemoveWalksTheList, "O(1)"),
        (CountsByWalking, "keep num_free_blocks as a counter"),
        (YieldsTheFreeBlocks, "returned a generator, not a list"),
        (AppendCallsItself, "calls itself"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch02_free_queue_catalogue(wrong, fragment):
    rejects(check_free_queue, wrong, fragment)


def test_ch02_free_queue_accepts_a_queue_without_sentinels(capsys):
    check_free_queue(Queue)
    assert "✓ FreeKVCacheBlockQueue" in capsys.readouterr().out


# -- chapter 03: slot mapping ----------------------------------------------------------
def _bit_tricks(block_ids, start, end, block_size):
    shift = block_size.bit_length() - 1
    return [block_ids[p >> shift] * block_size + (p & (block_size - 1)) for p in range(start, end)]


def _extends_the_table(block_ids, start, end, block_size):
    block_ids.append(block_ids[-1])  # "a spare block for the next token"
    return compute_slot_mapping(block_ids, start, end, block_size)


def _yields_slots(block_ids, start, end, block_size):
    for p in range(start, end):
        yield block_ids[p // block_size] * block_size + p % block_size


def _slots_as_text(block_ids, start, end, block_size):
    return [str(block_ids[p // block_size] * block_size + p % block_size) for p in range(start, end)]


def _reads_one_block_too_far(block_ids, start, end, block_size):
    return [block_ids[p // block_size + 1] * block_size + p % block_size for p in range(start, end)]


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (_bit_tricks, "power of two"),
        (_extends_the_table, "changed the block table"),
        (_yields_slots, "returned a generator, not a list"),
        (_slots_as_text, "the list holds a str ('112'); expected int slot numbers"),
        (_reads_one_block_too_far, "raised IndexError"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch03_slot_mapping_catalogue(wrong, fragment):
    rejects(check_slot_mapping, wrong, fragment)


def test_ch03_slot_mapping_names_the_input_and_points_at_the_learners_line():
    message = rejects(check_slot_mapping, _reads_one_block_too_far, "compute_slot_mapping([7], 0, 10, 16)")
    assert "likely mistake: an index past the end" in message
    traceback_text = message.split("Traceback (your code first):", 1)[1]
    first_frame = traceback_text.strip().splitlines()[0]
    assert __file__ in first_frame and "_reads_one_block_too_far" in first_frame  # the checker's frames are cut
    assert "slot_mapping_checks.py" not in traceback_text


def test_ch03_slot_mapping_accepts_divmod_in_a_tuple(capsys):
    def with_divmod(block_ids, start, end, block_size):
        slots = []
        for position in range(start, end):
            logical, offset = divmod(position, block_size)
            slots.append(block_ids[logical] * block_size + offset)
        return tuple(slots)

    check_slot_mapping(with_divmod)
    assert "✓ compute_slot_mapping" in capsys.readouterr().out


# -- chapter 04: hashing -------------------------------------------------------------
def _hashes_kept_in_a_default(token_ids, block_size, cache_salt=None, lora_name=None, hashes=[]):  # noqa: B006
    parent = hashes[-1] if hashes else None
    for index in range(len(token_ids) // block_size):
        block = token_ids[index * block_size : (index + 1) * block_size]
        parent = hashing.hash_block_tokens(parent, block, hashing.block_extra_keys(index, cache_salt, lora_name))
        hashes.append(parent)
    return hashes


def _consumes_the_tokens(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent, index = [], None, 0
    while len(token_ids) >= block_size:
        block = token_ids[:block_size]
        del token_ids[:block_size]  # eats the caller's prompt
        parent = hashing.hash_block_tokens(parent, block, hashing.block_extra_keys(index, cache_salt, lora_name))
        hashes.append(parent)
        index += 1
    return hashes


def _yields_hashes(token_ids, block_size, cache_salt=None, lora_name=None):
    yield from hashing.hash_request_tokens(token_ids, block_size, cache_salt, lora_name)


def _sixteen_token_blocks(token_ids, block_size, cache_salt=None, lora_name=None):
    return hashing.hash_request_tokens(token_ids, 16, cache_salt, lora_name)


def _empty_salt_is_a_salt(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes, parent = [], None
    for index in range(len(token_ids) // block_size):
        keys = [("lora", lora_name, None)] if lora_name is not None else []
        if cache_salt is not None and index == 0:  # "" too
            keys.append(("cache_salt", cache_salt))
        block = token_ids[index * block_size : (index + 1) * block_size]
        parent = hashing.hash_block_tokens(parent, block, tuple(keys) or None)
        hashes.append(parent)
    return hashes


def _position_instead_of_parent(token_ids, block_size, cache_salt=None, lora_name=None):
    hashes = []
    for index in range(len(token_ids) // block_size):
        block = token_ids[index * block_size : (index + 1) * block_size]
        keys = hashing.block_extra_keys(index, cache_salt, lora_name) or ()
        keys += (("position", index),) if index else ()  # tells equal blocks apart, but not their prefixes
        hashes.append(hashing.hash_block_tokens(None, block, keys or None))  # no parent: the prefix is not in it
    return hashes


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (_empty_salt_is_a_salt, "empty cache_salt is no salt"),
        (_position_instead_of_parent, "pass each block's parent"),
        (_hashes_kept_in_a_default, "mutable default"),
        (_consumes_the_tokens, "changed the token_ids"),
        (_yields_hashes, "returned a generator, not a list"),
        (_sixteen_token_blocks, "never a fixed 16"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch04_hash_request_tokens_catalogue(wrong, fragment):
    rejects(check_hash_request_tokens, wrong, fragment)


def _concatenates_the_tokens(parent, token_ids, extra_keys=None):
    parent = parent or hashing.NONE_HASH
    return hashlib.sha256(pickle.dumps((parent, token_ids + [0], extra_keys), protocol=5)).digest()


def _appends_the_parent(parent, token_ids, extra_keys=None):
    token_ids.append(len(parent or b""))  # folds the parent in by changing the caller's list
    return hashing.hash_block_tokens(parent, token_ids[:-1], extra_keys)


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (_concatenates_the_tokens, "raised TypeError"),  # a range or a tuple has no + [0]
        (_appends_the_parent, "changed the token_ids"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch04_hash_block_tokens_catalogue(wrong, fragment):
    rejects(check_hash_block_tokens, wrong, fragment)


def test_ch04_hashing_accepts_other_styles(capsys):
    def with_highest_protocol(parent, token_ids, extra_keys=None):
        payload = (hashing.NONE_HASH if parent is None else parent, tuple(token_ids), extra_keys)
        return hashlib.sha256(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    def with_a_while_loop(token_ids, block_size, cache_salt=None, lora_name=None):
        hashes, start = [], 0
        while start + block_size <= len(token_ids):
            parent = hashes[-1] if hashes else None
            keys = hashing.block_extra_keys(len(hashes), cache_salt, lora_name)
            hashes.append(with_highest_protocol(parent, token_ids[start : start + block_size], keys))
            start += block_size
        return hashes

    check_hash_block_tokens(with_highest_protocol)
    check_hash_request_tokens(with_a_while_loop)
    out = capsys.readouterr().out
    assert "✓ hash_block_tokens" in out and "✓ hash_request_tokens" in out


# -- chapter 05: the prefix lookup ---------------------------------------------------------
def _scans_every_block(block_pool, block_hashes, max_num_blocks):
    hits = []
    for block_hash in block_hashes[:max_num_blocks]:
        block = next((b for b in block_pool.blocks if b.block_hash == block_hash), None)
        if block is None:
            break
        hits.append(block)
    return hits


def _pops_the_hashes(block_pool, block_hashes, max_num_blocks):
    hits = []
    while block_hashes and len(hits) < max_num_blocks:
        block = block_pool.get_cached_block(block_hashes.pop(0))
        if block is None:
            break
        hits.append(block)
    return hits


def _hits_in_a_default(block_pool, block_hashes, max_num_blocks, hits=[]):  # noqa: B006
    for block_hash in block_hashes[:max_num_blocks]:
        block = block_pool.get_cached_block(block_hash)
        if block is None:
            break
        hits.append(block)
    return hits


def _assumes_every_hash_is_cached(block_pool, block_hashes, max_num_blocks):
    return [
        block_pool.get_cached_block(h)
        for h in block_hashes[:max_num_blocks]
        if block_pool.get_cached_block(h).ref_cnt >= 0
    ]


def _looks_every_hash_up(block_pool, block_hashes, max_num_blocks):
    return [block_pool.get_cached_block(h) for h in block_hashes[:max_num_blocks]]  # a miss's None kept


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (_scans_every_block, "grows with the size of the pool"),
        (_looks_every_hash_up, "A hit stops at the first miss"),
        (_pops_the_hashes, "changed the block_hashes list"),
        (_hits_in_a_default, "very list object an earlier call returned"),
        (_assumes_every_hash_is_cached, "get_cached_block(...) for a hash that is not cached"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch05_find_longest_cache_hit_catalogue(wrong, fragment):
    rejects(check_find_longest_cache_hit, wrong, fragment)


def test_ch05_find_longest_cache_hit_accepts_takewhile(capsys):
    from itertools import takewhile

    def with_takewhile(block_pool, block_hashes, max_num_blocks):
        found = map(block_pool.get_cached_block, block_hashes[:max_num_blocks])
        return list(takewhile(lambda block: block is not None, found))

    check_find_longest_cache_hit(with_takewhile)
    check_find_longest_cache_hit(reference_find_longest_cache_hit)
    assert capsys.readouterr().out.count("✓ find_longest_cache_hit") == 2


# -- chapter 06: free and evict -------------------------------------------------------------
def _free_blocks(pool, ordered_blocks):
    """Correct, in another style: the two groups, as vLLM 0.33 does it."""
    to_the_head, to_the_tail = [], []
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            (to_the_head if block.block_hash is None else to_the_tail).append(block)
    for block in reversed(to_the_head):
        pool.free_block_queue.appendleft(block)
    for block in to_the_tail:
        pool.free_block_queue.append(block)


def _checks_the_queue_first(pool, ordered_blocks):
    to_the_head = []
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0 and block not in pool.free_block_queue.get_all_free_blocks():  # O(n)
            if block.block_hash is None:
                to_the_head.append(block)
            else:
                pool.free_block_queue.append(block)
    pool.free_block_queue.prepend_n(to_the_head)


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (free_one_at_a_time, "TOGETHER"),
        (_checks_the_queue_first, "its cost grows with the pool"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch06_free_blocks_catalogue(wrong, fragment):
    rejects(check_free_blocks, wrong, fragment)


def _reverses_the_table_in_place(pool, req_blocks):
    req_blocks.reverse()
    _free_blocks(pool, req_blocks)


def _frees_one_block_at_a_time(pool, req_blocks):
    for block in reversed(req_blocks):
        _free_blocks(pool, block)  # one block where an iterable of blocks is expected


def _frees_by_block_id(pool, req_blocks):
    """Found by a learner: physical order instead of the table's; it got an expected/got pair and no hint."""
    _free_blocks(pool, sorted(req_blocks, key=lambda b: b.block_id, reverse=True))


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (_reverses_the_table_in_place, "changed the block table"),
        (_frees_one_block_at_a_time, "you passed one block where a list"),
        (_frees_by_block_id, "whatever their block ids"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch06_free_request_blocks_catalogue(wrong, fragment):
    rejects(check_free_request_blocks, wrong, fragment)


def _get_new_blocks(pool, num_blocks, *, mistake=None):
    limit = pool.num_blocks if mistake == "all blocks" else pool.get_num_free_blocks()
    if num_blocks > limit or (mistake == ">= in the pre-check" and num_blocks >= limit):
        raise ValueError(f"cannot get {num_blocks} blocks")
    blocks = []
    for _ in range(num_blocks):
        block = pool.free_block_queue.popleft()
        if mistake == "counts every pop" and block.block_hash is None:
            pool.num_evictions += 1
        if mistake == "event when events are off" and block.block_hash is not None and not pool.enable_kv_cache_events:
            # queues the event whether or not the pool records events (the normal path below queues it when on)
            pool.kv_event_queue.append(BlockRemoved(block_hashes=(block.block_hash,), block_ids=(block.block_id,)))
        if block.block_hash is not None:
            if mistake == "scans the map":
                for block_hash, cached in list(pool.cached_block_hash_to_block.items()):
                    if cached is block:
                        pool.cached_block_hash_to_block.pop(block_hash, block.block_id)
            else:
                if mistake == "pop without the block id":
                    pool.cached_block_hash_to_block.pop(block.block_hash)
                pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
            if mistake != "uncounted":
                pool.num_evictions += 1
            if mistake == "event after clearing the hash":
                block.block_hash = None
            if mistake != "no event" and pool.enable_kv_cache_events:
                group = block.kv_cache_group_id
                pool.kv_event_queue.append(BlockRemoved((block.block_hash,), (block.block_id,), group_idx=group))
            block.block_hash, block.kv_cache_group_id = None, 0
        block.ref_cnt = 1
        blocks.append(block)
    if mistake == "one block alone" and len(blocks) == 1:
        return blocks[0]
    return blocks


@pytest.mark.parametrize(
    "mistake, fragment",
    [
        ("all blocks", "pool.get_num_free_blocks()"),
        # The learner's own raise, not the engine's: the message says to look at its condition.
        (">= in the pre-check", "your own code raised this ValueError: check the condition before that raise"),
        # A library method called with the wrong arguments, not the learner's signature.
        ("pop without the block id", "a call in your code passes other arguments than that function or method"),
        ("scans the map", "walked the hash map 1 time(s)"),
        ("one block alone", "you returned one block"),
        ("uncounted", "pool.num_evictions += 1"),
        ("no event", "record each eviction when the pool records events"),
        ("event after clearing the hash", "you queued them after clearing block.block_hash"),  # found by a learner
        ("counts every pop", "count only the popped blocks that still had a hash"),
        ("event when events are off", "only when pool.enable_kv_cache_events is on"),
    ],
)
def test_ch06_get_new_blocks_catalogue(mistake, fragment):
    rejects(check_get_new_blocks, lambda pool, n: _get_new_blocks(pool, n, mistake=mistake), fragment)


def test_ch06_eviction_accepts_other_styles(capsys):
    check_free_blocks(_free_blocks)
    check_free_request_blocks(lambda pool, req_blocks: _free_blocks(pool, req_blocks[::-1]))
    check_get_new_blocks(_get_new_blocks)
    out = capsys.readouterr().out
    assert "✓ free_blocks" in out and "✓ free_request_blocks" in out and "✓ get_new_blocks" in out


# -- chapter 07: kernels ---------------------------------------------------------------
def _paged_decode(query, k_cache, v_cache, block_table, seq_len, scale=None, *, mistake=None):
    """Gather then softmax (another style than the online softmax), with one optional mistake."""
    num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    num_blocks = math.ceil(seq_len / block_size)
    blocks = block_table[:num_blocks].long()
    if mistake == "zeroes the unused slots":
        k_cache[blocks[-1], seq_len - (num_blocks - 1) * block_size :] = 0.0
        v_cache[blocks[-1], seq_len - (num_blocks - 1) * block_size :] = 0.0
    dtype = query.dtype if mistake == "in the query's dtype" else torch.float32  # float32 is asked
    keys = k_cache[blocks].flatten(0, 1)[:seq_len].to(dtype)  # [seq_len, Hkv, D]
    values = v_cache[blocks].flatten(0, 1)[:seq_len].to(dtype)
    group = num_q_heads // num_kv_heads
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", query.to(dtype), keys) * scale
    if mistake == "exp without the max":
        weights = torch.exp(scores)
        weights = weights / weights.sum(dim=1, keepdim=True)
    else:
        weights = torch.softmax(scores, dim=1)
    out = torch.einsum("hn,nhd->hd", weights, values)
    return out if mistake == "float32 out" else out.to(query.dtype)


@pytest.mark.parametrize(
    "mistake, fragment",
    [
        ("float32 out", "it must have the query's dtype"),
        ("exp without the max", "subtracts the running max"),
        ("zeroes the unused slots", "changed its inputs"),
        ("in the query's dtype", "accumulate in float32"),
    ],
)
def test_ch07_paged_decode_catalogue(mistake, fragment):
    rejects(check_paged_decode, lambda *a, **k: _paged_decode(*a, mistake=mistake, **k), fragment)


def _online_softmax_without_the_rescale(query, k_cache, v_cache, block_table, seq_len, scale=None):
    """Block by block with a running max, but the old terms are never brought to the new max."""
    num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    group = num_q_heads // num_kv_heads
    running_max = torch.full((num_q_heads,), float("-inf"))
    total, acc = torch.zeros(num_q_heads), torch.zeros(num_q_heads, head_dim)
    for i in range(math.ceil(seq_len / block_size)):
        rows = slice(0, min(block_size, seq_len - i * block_size))
        k = k_cache[int(block_table[i]), rows].float().repeat_interleave(group, dim=1)
        v = v_cache[int(block_table[i]), rows].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query.float(), k) * scale
        running_max = torch.maximum(running_max, scores.max(dim=1).values)
        weights = torch.exp(scores - running_max[:, None])
        total, acc = total + weights.sum(dim=1), acc + torch.einsum("hn,nhd->hd", weights, v)
    return (acc / total[:, None]).to(query.dtype)


def test_ch07_paged_decode_catalogue_missing_rescale():
    rejects(check_paged_decode, _online_softmax_without_the_rescale, "the online-softmax rescale is missing")


def test_ch07_paged_decode_accepts_gather_then_softmax(capsys):
    check_paged_decode(_paged_decode)
    assert "✓ paged_decode" in capsys.readouterr().out


needs_triton = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason=kernels.UNAVAILABLE_MESSAGE)

if kernels.TRITON_AVAILABLE:
    import triton
    import triton.language as tl

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
        token = tl.program_id(0)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
        in_tile = (heads < num_kv_heads) & (dims < head_dim)
        if MISTAKE == 2:
            in_tile = in_tile.to(tl.int32)  # a mask made of integers
        store_mask = in_tile
        if MISTAKE == 4:
            store_mask = heads < num_kv_heads  # "the loads are masked, the store needs only the heads"
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
            row = row + heads * stride_cache_head + dims
            key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=in_tile)
            value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=in_tile)
            if MISTAKE == 1:  # "the model runs in float16 anyway"
                key = key.to(tl.float16)
                value = value.to(tl.float16)
            tl.store(k_cache_ptr + row, key, mask=store_mask)
            tl.store(v_cache_ptr + row, value, mask=store_mask)

    def _store_kv_with(mistake: int):
        def store_kv(key, value, k_cache, v_cache, slot_mapping):
            _, block_size, num_kv_heads, head_dim = k_cache.shape
            _store_kv_kernel[(key.shape[0],)](
                key,
                value,
                k_cache,
                v_cache,
                slot_mapping,
                key.stride(0),
                key.stride(1),
                (key if mistake == 3 else value).stride(0),  # 3: "value is laid out like key"
                (key if mistake == 3 else value).stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                num_kv_heads,
                head_dim,
                BLOCK_SIZE=block_size,
                HEADS_PAD=triton.next_power_of_2(num_kv_heads),
                HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
                MISTAKE=mistake,
            )

        return store_kv


@needs_triton
@pytest.mark.parametrize(
    "mistake, fragment",
    [
        (1, "went through torch.float16"),
        (2, "a Triton mask must be boolean"),
        (3, "load V with its own strides"),
        (4, "where the tile's padding lanes fall"),
    ],
)
def test_ch07_store_kv_catalogue(mistake, fragment):
    message = rejects(check_store_kv, _store_kv_with(mistake), fragment)
    assert "slots=[" in message  # the case is named


# -- chapter 08: admission -------------------------------------------------------------
def _schedule_waiting(scheduler, token_budget, output, *, take_from_the_back=False, seen=None):
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and token_budget > 0 and len(scheduler.running) < scheduler.max_num_seqs:
        request = scheduler.waiting[-1] if take_from_the_back else scheduler.waiting[0]
        computed_blocks, num_computed_tokens = manager.get_computed_blocks(request)
        num_new_tokens = min(request.num_tokens - num_computed_tokens, token_budget)
        if manager.allocate_slots(request, num_new_tokens, num_computed_tokens, computed_blocks) is None:
            break
        scheduler.waiting.remove(request)
        scheduler.running.append(request)
        request.status = RequestStatus.RUNNING
        if seen is not None:  # "first admission" remembered outside the scheduler
            if request.request_id not in seen:
                seen.add(request.request_id)
                request.num_cached_tokens = num_computed_tokens
        elif request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        scheduler.schedule_request(request, num_computed_tokens, num_new_tokens, output)
        token_budget -= num_new_tokens
    return token_budget


def _remembers_in_a_default(scheduler, token_budget, output, seen=set()):  # noqa: B006
    return _schedule_waiting(scheduler, token_budget, output, seen=seen)


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (lambda s, b, o: _schedule_waiting(s, b, o, take_from_the_back=True), "the right requests, in the wrong order"),
        (_remembers_in_a_default, "keeps state outside the scheduler"),
        (lambda s, b, o: s.waiting[0].prompt_token_ids[10_000], "raised IndexError"),
    ],
    ids=["takes from the back", "mutable default", "crashes"],
)
def test_ch08_schedule_waiting_catalogue(wrong, fragment):
    message = rejects(check_schedule_waiting, wrong, fragment)
    assert "scenario '" in message  # the scenario and step are named


def test_ch08_schedule_waiting_accepts_a_remove_based_loop(capsys):
    check_schedule_waiting(_schedule_waiting)
    check_schedule_waiting(Scheduler.schedule_waiting)
    assert capsys.readouterr().out.count("✓ schedule_waiting") == 2


# -- chapter 08b: the sliding-window lookup -------------------------------------------------
def _sliding_window_hit(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    """Correct, in another style: look every position up first, then find the run from the right."""
    cached = [block_pool.get_cached_block(block_hashes[i], kv_cache_group_id) for i in range(max_num_blocks)]
    end = max_num_blocks
    while end > 0:
        start = end
        while start > 0 and cached[start - 1] is not None and end - start < num_contiguous_blocks:
            start -= 1
        if end - start == num_contiguous_blocks or (start == 0 and end > start):
            return [block_pool.null_block] * start + cached[start:end]
        end = start - 1 if start == end else start
    return []


def _pops_the_hashes_from_the_right(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group):
    del block_hashes[max_num_blocks:]  # "only the first max_num_blocks count"
    run = []
    while block_hashes:
        block = block_pool.get_cached_block(block_hashes.pop(), group)
        run = [block] + run if block is not None else []
        if len(run) == num_contiguous_blocks:
            return [block_pool.null_block] * len(block_hashes) + run
    return run


def _remembers_hits_by_hashes(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group, seen={}):  # noqa: B006
    key = (tuple(block_hashes), max_num_blocks, num_contiguous_blocks, group)
    if key not in seen:  # "the same hashes give the same hit"
        seen[key] = find_sliding_window_cache_hit(
            block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group
        )
    return list(seen[key])


def _yields_the_hit(*args):
    yield from find_sliding_window_cache_hit(*args)


def _assumes_the_last_block_is_cached(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group):
    last = block_pool.get_cached_block(block_hashes[max_num_blocks - 1], group)
    if last.ref_cnt >= 0:  # the hit's last block, "always cached"
        return find_sliding_window_cache_hit(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group)


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (_pops_the_hashes_from_the_right, "changed the block_hashes list"),
        (_remembers_hits_by_hashes, "it keeps state between calls"),
        (_yields_the_hit, "returned a generator, not a list"),
        (_assumes_the_last_block_is_cached, "get_cached_block(...) for a hash that is not cached"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch08b_find_sliding_window_cache_hit_catalogue(wrong, fragment):
    rejects(check_find_sliding_window_cache_hit, wrong, fragment)


def test_ch08b_find_sliding_window_cache_hit_accepts_another_style(capsys):
    check_find_sliding_window_cache_hit(_sliding_window_hit)
    check_find_sliding_window_cache_hit(find_sliding_window_cache_hit)
    assert capsys.readouterr().out.count("✓ find_sliding_window_cache_hit") == 2


# -- chapter 09: the prompt fix -------------------------------------------------------------
def _sorts_the_tools_in_place(system_prompt, tools, user_request, now):
    tools.sort(key=lambda tool: tool["name"])
    return reference_build_messages(system_prompt, tools, user_request, now)


_STORY_ORDER = ["draw_picture", "find_rhyme", "play_sound", "save_story"]


def _hard_codes_the_story_tools(system_prompt, tools, user_request, now):
    ordered = [tool for name in _STORY_ORDER for tool in tools if tool["name"] == name]
    return reference_build_messages(system_prompt, ordered, user_request, now)


def _caches_the_system_turn(system_prompt, tools, user_request, now, cache={}):  # noqa: B006
    if system_prompt not in cache:
        cache[system_prompt] = reference_build_messages(system_prompt, tools, "", now)[0]
    return [cache[system_prompt], {"role": "user", "content": f"Current time: {now:%Y-%m-%d %H:%M:%S}\n{user_request}"}]


def _yields_the_messages(system_prompt, tools, user_request, now):
    yield from reference_build_messages(system_prompt, tools, user_request, now)


def _the_minute_at_the_top(system_prompt, tools, user_request, now):
    """The exact time moved to the user's turn, but "the minute" kept first: the request where it changes loses."""
    messages = reference_build_messages(system_prompt, tools, user_request, now)
    messages[0]["content"] = f"It is {now:%H:%M} now.\n" + messages[0]["content"]
    return messages


def _json_of_a_datetime(system_prompt, tools, user_request, now):
    return [{"role": "user", "content": json.dumps({"now": now, "request": user_request})}]


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (_sorts_the_tools_in_place, "changed the arguments it was given"),
        (_hard_codes_the_story_tools, "lost some of its definition"),
        (_caches_the_system_turn, "lost some of its definition"),
        (_yields_the_messages, "must return a list"),
        (_json_of_a_datetime, "raised TypeError"),
        (_the_minute_at_the_top, "a part of the current time (the date, the hour or the minute)"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch09_prompt_fix_catalogue(wrong, fragment):
    rejects(check_prompt_fix, wrong, fragment)


# -- every check: the learner's exception is explained, the check's frames are cut -------
def test_every_chapter_check_failure_renders_without_the_checkers_traceback():
    with pytest.raises(CheckFailure) as info:
        check_slot_mapping(_reads_one_block_too_far)
    rendered = "".join(info.value._render_traceback_())  # what Jupyter shows
    assert "compute_slot_mapping([7], 0, 10, 16)" in rendered
    assert "_harness.py" not in rendered and "slot_mapping_checks.py" not in rendered


def test_every_chapter_stub_still_surfaces_as_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError("your code here: see the instructions above")

    for check in (
        check_slot_mapping,
        check_find_longest_cache_hit,
        check_free_queue,
        check_schedule_waiting,
        check_find_sliding_window_cache_hit,
    ):
        with pytest.raises(NotImplementedError):
            check(stub)


@pytest.mark.parametrize("name", sorted(set(CHECKS) - {"check_decode_loop"}))
def test_every_check_on_the_untouched_stub_says_not_written_yet_in_one_line(name):
    """Issue 41: a check run on the stub printed a 40-line traceback through the harness. It is one line in Jupyter
    (what ``_render_traceback_`` gives IPython), naming the stub's function; the type stays NotImplementedError."""

    def stub(*args, **kwargs):
        raise NotImplementedError("your code here: see the instructions above")

    with pytest.raises(NotImplementedError) as info:
        CHECKS[name](stub)
    rendered = info.value._render_traceback_()
    assert len(rendered) == 1 and rendered[0].startswith("not written yet: "), rendered
    assert f"run {name} again" in rendered[0]
    assert "stub is still" in rendered[0] or name.removeprefix("check_") in rendered[0], rendered


def test_the_not_written_yet_line_names_the_method_of_a_stub_class():
    class FreeKVCacheBlockQueue:
        def __init__(self, blocks):
            raise NotImplementedError("your code here: see the instructions above")

    with pytest.raises(NotImplementedError) as info:
        check_free_queue(FreeKVCacheBlockQueue)
    assert info.value._render_traceback_() == [
        "not written yet: FreeKVCacheBlockQueue.__init__ is still the exercise's stub (it raises NotImplementedError). Write it, "
        "run its cell, then run check_free_queue again"
    ]


def test_a_stub_is_a_not_implemented_error_the_learner_raised_or_one_saying_your_code_here():
    from mini_vllm.course._harness import is_the_stub

    def learners(block_ids, start, end, block_size):
        raise NotImplementedError("later")  # the learner's own stub, in their words

    with pytest.raises(NotImplementedError) as info:
        check_slot_mapping(learners)
    assert info.value._render_traceback_()[0].startswith("not written yet: learners is still the exercise's stub")
    assert is_the_stub(NotImplementedError("your code here: the kernel body is still the exercise stub"))
    assert not is_the_stub(NotImplementedError("not supported on this backend"))  # raised elsewhere: left as it is


def test_ch06_get_new_blocks_unforeseen_result_becomes_a_message_not_a_crash():
    class Block:  # not a KVCacheBlock: the check's own bookkeeping trips over it
        block_id = 0

    def returns_strange_blocks(pool, num_blocks):
        return [Block()] * num_blocks

    with pytest.raises(CheckFailure, match="get_new_blocks"):
        check_get_new_blocks(returns_strange_blocks)


def test_ch02_free_queue_catalogue_entries_are_distinct_mistakes():
    """Guard against a catalogue that tests one mistake many times: the messages differ."""
    messages = {
        rejects(check_free_queue, SentinelsInTheClassBody, "interfere"),
        rejects(check_free_queue, RemoveWalksTheList, "O(1)"),
        rejects(check_free_queue, YieldsTheFreeBlocks, "generator"),
    }
    assert len(messages) == 3


def test_ch06_get_new_blocks_catalogue_pool_is_really_busy():
    """The busy pool of check_get_new_blocks: the mistake 'compare with num_blocks' only shows there."""
    pool = BlockPool(8)
    pool.touch(pool.blocks[:5])
    assert pool.get_num_free_blocks() == 3 < 4 <= pool.num_blocks


# -- chapter 01: the decode loop (needs the bundled model) ----------------------------------
def _decode_loop(**mistake):
    correct = make_decode()

    def greedy_decode(model, prompt_ids, max_new_tokens):
        if mistake.get("extends_the_prompt"):
            tokens = prompt_ids  # no copy: the new tokens land in the caller's list
            new = correct(model, list(tokens), max_new_tokens)
            tokens.extend(new)
            return new
        new = correct(model, prompt_ids, max_new_tokens)
        return (token for token in new) if mistake.get("generator") else new

    return greedy_decode


@pytest.mark.parametrize(
    "mistake, fragment",
    [({"extends_the_prompt": True}, "changed the prompt_ids list"), ({"generator": True}, "returned a generator")],
    ids=["extends the prompt", "generator"],
)
def test_ch01_decode_loop_catalogue(default_model, mistake, fragment):
    from mini_vllm.course import check_decode_loop

    with pytest.raises(CheckFailure) as info:
        check_decode_loop(_decode_loop(**mistake), default_model)
    assert fragment in str(info.value), str(info.value)


# -- no check crashes, whatever the learner's code does ------------------------------------
def _returns_none(*args, **kwargs):
    return None


def _returns_text(*args, **kwargs):
    return "a string"


def _raises_key_error(*args, **kwargs):
    return {}["missing"]


def _returns_strange_items(*args, **kwargs):
    return [object(), object()]


class _EmptyClass:
    def __init__(self, *args, **kwargs):
        pass


# Every registered check, a new one included: the decode loop needs the model and the queue is a class
# (both have their own test), store_kv needs Triton.
ALL_CHECKS = [
    check
    for name, check in CHECKS.items()
    if name not in ("check_decode_loop", "check_free_queue") and (name != "check_store_kv" or kernels.TRITON_AVAILABLE)
]


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "behaviour", [_returns_none, _returns_text, _raises_key_error, _returns_strange_items], ids=lambda f: f.__name__
)
def test_every_chapter_check_survives_strange_learner_code(check, behaviour):
    """Every check ends in a CheckFailure (an AssertionError with a message), never another exception."""
    with pytest.raises(CheckFailure) as info:
        check(behaviour)
    assert len(str(info.value).splitlines()[0]) > 20


@pytest.mark.parametrize(
    "queue_cls",
    [_EmptyClass, type("Raising", (Queue,), {"popleft": _raises_key_error})],
    ids=["no methods", "popleft raises"],
)
def test_ch02_free_queue_check_survives_strange_learner_code(queue_cls):
    with pytest.raises(CheckFailure):
        check_free_queue(queue_cls)


def _status_as_text(scheduler, token_budget, output):
    budget = _schedule_waiting(scheduler, token_budget, output)
    for request in scheduler.running:
        request.status = "RUNNING"  # a string, not RequestStatus.RUNNING
    return budget


def test_ch08_schedule_waiting_without_the_guard_a_strange_result_would_crash_the_check():
    """The proof that guarded_check matters: the bare check trips over a status that is a string."""
    with pytest.raises(AttributeError):
        check_schedule_waiting.__wrapped__(_status_as_text)
    with pytest.raises(CheckFailure, match="the check could not go on: AttributeError"):
        check_schedule_waiting(_status_as_text)
