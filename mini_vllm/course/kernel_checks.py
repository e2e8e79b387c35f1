"""Checks for chapter 07: a Triton ``store_kv`` kernel and a paged decode loop.

* :func:`check_store_kv` runs your ``store_kv(key, value, k_cache, v_cache,
  slot_mapping)`` (the launcher of your Triton kernel) on small caches and
  compares every element of both caches with :func:`mini_vllm.kernels.reference.store_kv`.
  It also stores one token whose cache offset is past ``2**31`` elements, in a
  cache that only *reserves* 8 GiB of address space (only the pages written
  are ever backed by memory), to catch offsets computed in 32 bits, and
  float16 rows, values of magnitude 1e30 (a float16 detour turns them into
  inf) and block sizes that are not powers of two. A store outside the
  tokens' rows that falls exactly on the padding lanes of the
  ``[HEADS_PAD, HEAD_DIM_PAD]`` tile is named as a missing mask; ``slot_mapping``
  is followed in memory by a slot no token has, so a program that runs past
  ``num_tokens`` writes there (and is named) instead of at a garbage address.
  Two caches that are views with other strides (K and V side by side in one
  tensor; each head's slots together) catch strides worked out from the shape.
  In Triton's interpreter every ``tl.load``'s addresses are recorded, so loads
  without the mask (behind masked stores, which keep the caches right) are
  named: compiled, they read past the end of ``key`` and ``value``.
* :func:`check_paged_decode` compares your PyTorch
  ``paged_decode(query, k_cache, v_cache, block_table, seq_len, scale=None)``
  with :func:`mini_vllm.kernels.reference.paged_attention` for one sequence, float16
  and bfloat16 included (the output keeps the query's dtype, within 1 ulp of
  the float32 result: arithmetic in float16/bfloat16 is several ulps off),
  with scores all far below 0, and checks that the inputs (the query, the shared
  caches) are unchanged. An output that an online softmax without the rescale by
  ``exp(old_max - new_max)`` gives, or one that is right only when the
  running max never changes (the same keys reordered), is named as such.

Both functions are extension points of the engine (``EngineParts.store_kv``,
``EngineParts.paged_decode``): ``learner_engine(mine={"store_kv": ...,
"paged_decode": ...})`` serves a real ``generate`` with them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import mmap
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ._harness import Checker, Mistake, first_mistake, guarded_check, learner_error

GUARD_ROWS = 2
"""Rows of sentinel values before and after each cache in the store_kv check."""
SENTINEL = -7.0
"""What every slot nobody writes holds: a store that lands anywhere else shows up."""
PAST_THE_END = 8
"""Entries after slot_mapping (the bait slot) and rows after key and value (zeros) in the store_kv check."""


# -- shared helpers ----------------------------------------------------------------
def _device() -> torch.device:
    """Where the kernels run: CPU tensors in Triton's interpreter, GPU tensors when compiled."""
    from mini_vllm import kernels

    if kernels.TRITON_INTERPRETED or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def _is_stub(error: BaseException) -> bool:
    """True when ``error`` comes from an exercise stub (``raise NotImplementedError``).

    Triton's interpreter wraps an exception raised inside a kernel in its own
    ``InterpreterError`` (the original is its ``__cause__``); a compiled kernel
    fails to compile, with the stub's source line in the message.
    """
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, NotImplementedError) or "NotImplementedError" in str(error):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


@dataclass
class _KernelError:
    """An exception raised while Triton traced or ran the learner's kernel, as Triton words it."""

    error: BaseException

    @functools.cached_property
    def store_shapes(self) -> tuple[list[int], list[int]] | None:
        """(the value's shape, the address tile's shape) when a tl.store's addresses do not cover its value."""
        match = re.search(r"Expected pointer argument to have shape (.+?) but got (.+)", str(self.error))
        if match is None:
            return None
        value, address = ([int(n) for n in re.findall(r"\d+", shape)] for shape in match.groups())
        return value, address


# The kernel errors whose hint is known, as a table of mistakes (first_mistake picks the hint;
# the others get the general guess from the exception).
KERNEL_ERRORS = (
    Mistake(
        lambda seen: (
            seen.store_shapes is not None
            and len(seen.store_shapes[1]) == 2
            and seen.store_shapes[1][0] == 1
            and seen.store_shapes[0][0] > 1
        ),
        hint=lambda seen: (
            f"the address tile is [1, HEAD_DIM_PAD] = {seen.store_shapes[1]} but the value is [HEADS_PAD, "
            f"HEAD_DIM_PAD] = {seen.store_shapes[0]}: the address lacks heads * stride_cache_head. A token's row "
            "in the cache is block * stride_cache_block + offset * stride_cache_offset + heads * stride_cache_head "
            "+ dims, one address per lane of the tile"
        ),
    ),
)


def _kernel_error_hint(error: BaseException) -> str:
    seen = _KernelError(error)
    mistake = first_mistake(KERNEL_ERRORS, seen)
    return mistake.hint_for(seen) if mistake else ""


def _call_kernel_launcher(fn: Callable, *args, what: str = "store_kv(...)") -> None:
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 - the stub passes, the rest is explained
        if _is_stub(error):
            raise NotImplementedError("your code here: the kernel body is still the exercise stub") from None
        raise learner_error(
            "store_kv",
            what,
            error,
            expected="each token's K/V row stored in its slot, nothing else changed",
            hint=_kernel_error_hint,
        ) from None


# -- store_kv -------------------------------------------------------------------
class _GuardedCache:
    """A cache tensor with rows of sentinel values before and after it.

    The cache is a view into the middle of a bigger buffer, so a store at slot
    -1 (one row before the cache) or past the last slot lands in a guard row
    instead of someone else's memory, and the check can say so.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device) -> None:
        self.row = num_kv_heads * head_dim  # elements per slot
        self.shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_slots = num_blocks * block_size
        # Rows after the cache: enough that even a slot multiplied by the block stride
        # (a typical mistake) lands inside the buffer instead of corrupting memory.
        self.rows_after = self.num_slots * block_size + GUARD_ROWS
        total_rows = GUARD_ROWS + self.num_slots + self.rows_after
        self.buffer = torch.full((total_rows * self.row,), SENTINEL, dtype=dtype, device=device)
        start = GUARD_ROWS * self.row
        self.cache = self.buffer[start : start + self.num_slots * self.row].view(self.shape)

    def guards_untouched(self) -> bool:
        before = self.buffer[: GUARD_ROWS * self.row]
        after = self.buffer[(GUARD_ROWS + self.num_slots) * self.row :]
        return bool((before == SENTINEL).all() and (after == SENTINEL).all())

    def stray_rows(self, valid_slots: set[int]) -> list[int]:
        """Slots outside ``valid_slots`` whose row no longer holds the sentinel."""
        rows = self.cache.reshape(self.num_slots, self.row)
        changed = (rows != SENTINEL).any(dim=1).nonzero().flatten().tolist()
        return [slot for slot in changed if slot not in valid_slots]

    def changed_offsets(self) -> set[int]:
        """Element offsets (relative to the cache's start; guard rows included) that no longer hold the sentinel."""
        changed = (self.buffer != SENTINEL).nonzero().flatten() - GUARD_ROWS * self.row
        return set(changed.tolist())

    def find_row(self, row: torch.Tensor) -> int | None:
        """Element offset (relative to the cache's start) where ``row`` was written, if anywhere."""
        flat = self.buffer
        wanted = row.reshape(-1).to(flat.dtype)
        n = wanted.numel()
        for start in range(0, flat.numel() - n + 1):
            if torch.equal(flat[start : start + n], wanted):
                return start - GUARD_ROWS * self.row
        return None


# What a wrong store shows, as tables of mistakes: for a token whose row is not in its slot
# (TOKEN_MISTAKES, the first row that shows names the mistake), then for stores outside the tokens'
# rows (STRAY_MISTAKES). Each table reads one observation, _WrongToken or _Strays.
@dataclass
class _Tile:
    """The launcher's ``[HEADS_PAD, HEAD_DIM_PAD]`` tile over a token's ``[num_kv_heads, head_dim]`` row."""

    num_kv_heads: int
    head_dim: int
    slots: list[int]

    @property
    def heads_pad(self) -> int:
        return _next_power_of_2(self.num_kv_heads)

    @property
    def dims_pad(self) -> int:
        return _next_power_of_2(self.head_dim)

    @functools.cached_property
    def padding_lanes(self) -> set[int]:
        """The tile's lanes that are not part of a row, as element offsets: with the mask missing from the
        store, each token writes them past its heads' last elements."""
        row, lanes = self.num_kv_heads * self.head_dim, set()
        for slot in self.slots:
            if slot >= 0:
                lanes.update(
                    slot * row + head * self.head_dim + dim
                    for head in range(self.heads_pad)
                    for dim in range(self.dims_pad)
                    if head >= self.num_kv_heads or dim >= self.head_dim
                )
        return lanes

    @property
    def mask_hint(self) -> str:
        heads_pad, dims_pad, num_kv_heads, head_dim = self.heads_pad, self.dims_pad, self.num_kv_heads, self.head_dim
        extra = []
        if dims_pad > head_dim:
            extra.append(f"dims {head_dim}..{dims_pad - 1} of every head: head_dim {head_dim} is padded to {dims_pad}")
        if heads_pad > num_kv_heads:
            extra.append(
                f"head{'s' if heads_pad - num_kv_heads > 1 else ''} "
                f"{', '.join(map(str, range(num_kv_heads, heads_pad)))}: {num_kv_heads} KV heads are padded to "
                f"{heads_pad}"
            )
        return (
            f"the tile has HEADS_PAD x HEAD_DIM_PAD = {heads_pad} x {dims_pad} lanes, but a token's row is only "
            f"num_kv_heads x head_dim = {num_kv_heads} x {head_dim} elements. The extra lanes ({'; '.join(extra)}) "
            "must be masked off, or they are stored too: past the end of each head's row, into the next slot's "
            "row (or past the cache). Pass mask=in_tile, which bounds both (heads < num_kv_heads) & (dims < "
            "head_dim), to both tl.store calls, and to the tl.loads (those lanes read past the token's row of key "
            "and value)"
        )


@dataclass
class _WrongToken:
    """A token whose K or V row is not (exactly) in its slot, and what the caches hold instead."""

    token: int
    slot: int
    block_size: int
    tile: _Tile
    k: _GuardedCache
    v: _GuardedCache
    want_k: torch.Tensor
    want_v: torch.Tensor
    cache_dtype: torch.dtype
    magnitude: float
    fused_qkv: bool
    value_from_wider: bool

    @property
    def got_k(self) -> torch.Tensor:
        return self.k.cache[divmod(self.slot, self.block_size)]

    @property
    def got_v(self) -> torch.Tensor:
        return self.v.cache[divmod(self.slot, self.block_size)]

    @property
    def row(self) -> int:
        return self.k.row

    @property
    def where(self) -> str:
        block, offset = divmod(self.slot, self.block_size)
        return f"token {self.token} (slot {self.slot} = block {block}, offset {offset})"

    @property
    def wrong_elements(self) -> set[int]:
        return {
            self.slot * self.row + j
            for got, want in ((self.got_k, self.want_k), (self.got_v, self.want_v))
            for j in (got.reshape(-1) != want.reshape(-1)).nonzero().flatten().tolist()
        }

    @property
    def narrowed(self) -> list[torch.dtype]:
        """The narrower dtypes a round trip through which gives the key stored."""
        return [
            narrow
            for narrow in (torch.float16, torch.bfloat16)
            if narrow != self.cache_dtype and torch.equal(self.got_k, self.want_k.to(narrow).to(self.cache_dtype))
        ]

    @property
    def which(self) -> str:
        """The wrong one of the two rows: the key's, unless only the value is wrong."""
        return "key" if not torch.equal(self.got_k, self.want_k) else "value"

    @property
    def untouched(self) -> bool:
        """True when nothing was stored in the token's slot (both rows still hold the sentinel)."""
        return bool((self.got_k == SENTINEL).all() and (self.got_v == SENTINEL).all())

    @functools.cached_property
    def found(self) -> int | None:
        """Where the wrong row's head 0 was written (an element offset from the cache's start), if anywhere."""
        cache, want = (self.k, self.want_k) if self.which == "key" else (self.v, self.want_v)
        return cache.find_row(want[0])


def _nowhere_hint(seen: _WrongToken) -> str:
    which = seen.which
    hint = f"token {seen.token}'s {which} is nowhere in {which[0]}_cache"
    if seen.fused_qkv:
        source = f"{which} is a view into a fused qkv tensor here"
        hint += f": {source}, so token t starts at t * stride_{which}_token, not t * num_kv_heads * head_dim"
    elif which == "value":
        hint += (
            " (its key is right): load V from value_ptr with value's own strides (stride_value_token, "
            "stride_value_head) and store it at the same cache offset as K, into v_cache_ptr"
        )
    return hint


def _landed_elsewhere_hint(seen: _WrongToken) -> str:
    block, offset = divmod(seen.slot, seen.block_size)
    return (
        f"token {seen.token}'s {seen.which} landed at element {seen.found} instead of {seen.slot * seen.row} "
        f"(block {block} * {seen.block_size * seen.row} + offset {offset} * {seen.row})"
    )


def _not_in_slot(seen: _WrongToken) -> str:
    return f"{seen.where} is not in its slot"


TOKEN_MISTAKES = (
    Mistake(
        lambda seen: bool(seen.tile.padding_lanes) and seen.wrong_elements <= seen.tile.padding_lanes,
        lambda seen: (
            f"token {seen.token} (slot {seen.slot}) is not in its slot: elements of its row were "
            "overwritten by another token's padding lanes"
        ),
        lambda seen: seen.tile.mask_hint,
    ),
    Mistake(
        lambda seen: (
            bool(seen.narrowed)
            or (seen.magnitude > 1e4 and torch.isinf(seen.got_k).any() and not torch.isinf(seen.want_k).any())
        ),
        _not_in_slot,
        lambda seen: (
            f"the row went through {seen.narrowed[0] if seen.narrowed else 'a narrower dtype'} on its "
            "way: its values were rounded (and large ones become inf: float16 holds at most 65504). Store in the "
            "caches' own dtype; do not cast through float16"
        ),
    ),
    Mistake(
        lambda seen: torch.equal(seen.got_k, seen.want_v) or torch.equal(seen.got_v, seen.want_k),
        _not_in_slot,
        "K goes into k_cache and V into v_cache: one of them got the other's row",
    ),
    Mistake(
        lambda seen: seen.value_from_wider and torch.equal(seen.got_k, seen.want_k),
        _not_in_slot,
        "the key is right but the value is not, and here value's strides differ from key's: load V "
        "with its own strides (stride_value_token, stride_value_head), not the key's",
    ),
    Mistake(
        lambda seen: torch.equal(seen.got_k[0], seen.want_k[0]) and not torch.equal(seen.got_k, seen.want_k),
        _not_in_slot,
        "head 0 is right but another head is not: offset each head by stride_key_head "
        "(stride_value_head) in key/value and by the cache's head stride",
    ),
    # Then: where did the wrong row go?
    Mistake(
        lambda seen: seen.slot == 0 and seen.untouched,
        _not_in_slot,
        "slot 0 is a real slot; only negative slots are skipped: slot -1 marks a padding token, so skip "
        "the token when slot < 0 (not slot <= 0, which drops the first slot of block 0)",
    ),
    Mistake(lambda seen: seen.found is None, _not_in_slot, _nowhere_hint),
    Mistake(
        lambda seen: seen.found == seen.slot * seen.row and seen.which == "value",
        _not_in_slot,
        lambda seen: (
            f"token {seen.token}'s key is right and head 0 of its value is in place, but not the rest of "
            "the value: load and store V with the same [heads, dims] tile and mask as K, with value's own "
            "strides (stride_value_token, stride_value_head)"
        ),
    ),
    Mistake(
        lambda seen: seen.found in (seen.slot * seen.tile.head_dim, seen.slot),
        _not_in_slot,
        lambda seen: (
            f"token {seen.token}'s {seen.which} landed at element {seen.found}, i.e. you used the slot as "
            f"an element offset; a slot is a whole row of num_kv_heads * head_dim = {seen.row} elements: "
            "split it into (block, offset) and multiply each by its stride"
        ),
    ),
    Mistake(
        lambda seen: seen.found == seen.slot * seen.block_size * seen.row,
        _not_in_slot,
        lambda seen: (
            f"token {seen.token}'s {seen.which} landed at block {seen.slot}, i.e. you multiplied the slot "
            "by the block stride: block = slot // BLOCK_SIZE, offset = slot % BLOCK_SIZE"
        ),
    ),
    Mistake(
        lambda seen: seen.found == seen.token * seen.row,
        _not_in_slot,
        lambda seen: (
            f"token {seen.token}'s {seen.which} landed where slot {seen.token} goes: address by "
            f"slot_mapping[token] (here slot {seen.slot}), not the program id: slot = tl.load(slot_mapping_ptr "
            "+ token)"
        ),
    ),
    Mistake(lambda seen: True, _not_in_slot, _landed_elsewhere_hint),
)


@dataclass
class _Strays:
    """What changed outside the tokens' rows after a store."""

    k: _GuardedCache
    v: _GuardedCache
    tile: _Tile
    slots: list[int]
    bait: int  # the slot that follows slot_mapping in memory (-1: none)

    @functools.cached_property
    def valid(self) -> set[int]:
        return {slot for slot in self.slots if slot >= 0}

    @functools.cached_property
    def stray(self) -> list[int]:
        """Slots no token has whose row changed, K's then V's."""
        return self.k.stray_rows(self.valid) + self.v.stray_rows(self.valid)

    @functools.cached_property
    def in_bounds(self) -> bool:
        return self.k.guards_untouched() and self.v.guards_untouched()

    @property
    def clean(self) -> bool:
        return self.in_bounds and not self.stray

    @functools.cached_property
    def outside(self) -> set[int]:
        """Changed element offsets outside the tokens' rows."""
        row = self.k.row
        rows = {slot * row + j for slot in self.valid for j in range(row)}
        return (self.k.changed_offsets() | self.v.changed_offsets()) - rows


STRAY_MISTAKES = (
    Mistake(
        lambda seen: not seen.clean and seen.bait >= 0 and seen.bait in seen.stray and seen.bait not in seen.valid,
        lambda seen: (
            f"slot {seen.bait} changed, but no token has it: it is the slot that follows slot_mapping's "
            f"{len(seen.slots)} entries in memory, so your kernel stored a token past num_tokens"
        ),
        "launch one program per token (grid = (num_tokens,)) and let program i store token i only; a "
        "program that handles several tokens must mask its loads and stores with tokens < num_tokens",
    ),
    Mistake(
        lambda seen: (
            not seen.clean
            and bool(seen.tile.padding_lanes)
            and bool(seen.outside)
            and seen.outside <= seen.tile.padding_lanes
        ),
        lambda seen: (
            f"your kernel wrote {len(seen.outside)} element(s) outside the tokens' rows, all of them right "
            "after a head's row, where the tile's padding lanes fall: your store's mask lets them through (or "
            "there is none)"
        ),
        lambda seen: seen.tile.mask_hint,
    ),
    Mistake(
        lambda seen: -1 in seen.slots and not seen.clean,
        "a token with slot -1 was written somewhere",
        "slot -1 means 'no slot' (a padding token): that program must store nothing "
        "(return early when slot < 0, or make the store's mask false everywhere)",
    ),
    Mistake(
        lambda seen: not seen.in_bounds,
        "your kernel wrote outside the cache",
        "a slot is block_id * block_size + offset: write k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE]",
    ),
    Mistake(
        lambda seen: bool(seen.stray),
        lambda seen: f"slots {sorted(set(seen.stray))} changed, but no token has them",
        "only the slots in slot_mapping may change",
    ),
)


@dataclass
class _Reads:
    """What the learner's kernel read (as byte addresses, with the load's mask true) outside what it needs."""

    read: np.ndarray  # every address loaded
    allowed: np.ndarray  # the elements of the tokens' rows of key and value, and slot_mapping's entries
    ends: dict[str, int]  # the address of the last element of key and of value

    @functools.cached_property
    def outside(self) -> np.ndarray:
        return np.setdiff1d(self.read, self.allowed)

    @property
    def past_the_end(self) -> str | None:
        """key or value, when a read went past the address of its last element."""
        return next((name for name, end in self.ends.items() if (self.outside > end).any()), None)


READ_MISTAKES = (
    Mistake(
        lambda seen: seen.outside.size > 0,
        lambda seen: (
            "your tl.load has no mask: lanes outside in_tile read past the token's row"
            + (
                f" (past the end of {seen.past_the_end} for the last token: an illegal address on a GPU)"
                if seen.past_the_end
                else ""
            )
        ),
        "the stores are masked, but the loads must be too: pass mask=in_tile to both tl.load calls (a lane "
        "masked off reads nothing). Compiled for a GPU, an unmasked load of the last token's padding lanes "
        "reads past the end of key and value, an illegal memory access",
    ),
)


@contextlib.contextmanager
def _loads_recorded() -> Iterator[list[np.ndarray]]:
    """The byte addresses every tl.load reads (its mask true) while the block runs, one array per load.

    Triton's interpreter loads through ``interpreter_builder.create_masked_load`` (``tl.load``
    without a mask too); it is wrapped for the block's duration. A kernel compiled for a GPU reads
    where no check can see: the list stays empty.
    """
    loads: list[np.ndarray] = []
    from mini_vllm import kernels

    if not kernels.TRITON_INTERPRETED:
        yield loads
        return
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    load = builder.create_masked_load

    def recorded(ptrs, mask, *args, **kwargs):
        addresses = np.asarray(ptrs.data, dtype=np.uint64)
        loads.append(addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)])
        return load(ptrs, mask, *args, **kwargs)

    builder.create_masked_load = recorded
    try:
        yield loads
    finally:
        del builder.create_masked_load  # the class's method again


def _element_addresses(tensor: torch.Tensor) -> np.ndarray:
    """The byte address of every element of ``tensor`` (a view: its strides, not its shape, place them)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = offsets[..., None] + torch.arange(size) * stride
    return (tensor.data_ptr() + offsets.reshape(-1).numpy() * tensor.element_size()).astype(np.uint64)


def _store_case(
    store_kv: Callable,
    check: Checker,
    case: str,
    *,
    slots: list[int],
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype=torch.float32,
    key_dtype=torch.float32,
    slot_dtype=torch.int64,
    fused_qkv: bool = False,
    value_from_wider: bool = False,
    magnitude: float = 1.0,
    seed: int = 0,
    random_case: bool = False,
) -> None:
    """Store one batch with the learner's ``store_kv``: every token's row in its slot, nothing else changed.

    A wrong store is named by the first row of TOKEN_MISTAKES (a token not in its slot) or
    STRAY_MISTAKES (a store elsewhere) that shows; the case counts once, by its final comparison.
    """
    from mini_vllm.kernels import reference

    device = _device()
    generator = torch.Generator().manual_seed(seed)
    num_tokens = len(slots)
    shape = (num_tokens, num_kv_heads, head_dim)
    if fused_qkv:
        # The model computes q, k and v in one matmul: key and value are views with a longer token stride.
        qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(key_dtype).to(device)
        key = qkv[:, num_kv_heads : 2 * num_kv_heads]
        value = qkv[:, 2 * num_kv_heads :]
    else:
        key = (torch.randn(shape, generator=generator) * magnitude).to(key_dtype).to(device)
        value = (torch.randn(shape, generator=generator) * magnitude).to(key_dtype).to(device)
    if value_from_wider:
        # key contiguous, value a view into a wider tensor: their token (and head) strides differ.
        wider = torch.randn(num_tokens, num_kv_heads + 1, 2 * head_dim, generator=generator).to(key_dtype).to(device)
        value = wider[:, 1:, head_dim:]
    k = _GuardedCache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    v = _GuardedCache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    # slot_mapping (and key, value when they are plain tensors) are views of longer buffers: what follows
    # their last token is a slot no token has (the bait) and rows of zeros, so a program that runs past
    # num_tokens stores into the bait slot, where the check sees it, instead of wherever garbage points.
    unused = sorted(set(range(num_blocks * block_size)) - set(slots))
    bait = unused[-1] if unused else -1
    backing = torch.full((num_tokens + PAST_THE_END,), bait, dtype=slot_dtype, device=device)
    backing[:num_tokens] = torch.tensor(slots, dtype=slot_dtype)
    slot_mapping = backing[:num_tokens]
    if not fused_qkv:
        key = _followed_by_zeros(key)
    if not (fused_qkv or value_from_wider):
        value = _followed_by_zeros(value)

    with _loads_recorded() as loads:
        _call_kernel_launcher(
            store_kv,
            key,
            value,
            k.cache,
            v.cache,
            slot_mapping,
            what=f"{case}: store_kv(key {key_dtype}, cache {cache_dtype}, slots={slots}, block_size={block_size}, "
            f"num_kv_heads={num_kv_heads}, head_dim={head_dim})",
        )

    expected_k = torch.full(k.shape, SENTINEL, dtype=cache_dtype, device=device)
    expected_v = torch.full(v.shape, SENTINEL, dtype=cache_dtype, device=device)
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
    where = f"{case} (block_size={block_size}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, slots={slots})"
    tile = _Tile(num_kv_heads, head_dim, slots)

    # Properties first: each names one mistake. Where did each token's row go?
    for token, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        want_k, want_v = key[token].to(cache_dtype), value[token].to(cache_dtype)
        if torch.equal(k.cache[block, offset], want_k) and torch.equal(v.cache[block, offset], want_v):
            continue
        wrong = _WrongToken(
            token, slot, block_size, tile, k, v, want_k, want_v, cache_dtype, magnitude, fused_qkv, value_from_wider
        )
        check.expect_no_mistakes(TOKEN_MISTAKES, wrong, f"{where}: ", random_case, counted=False)
    check.expect_no_mistakes(STRAY_MISTAKES, _Strays(k, v, tile, slots, bait), f"{where}: ", random_case, counted=False)
    needed = [_element_addresses(tensor) for tensor in (key, value, slot_mapping)]
    reads = _Reads(
        np.concatenate(loads) if loads else np.zeros(0, dtype=np.uint64),
        np.concatenate(needed),
        {"key": int(needed[0].max()), "value": int(needed[1].max())},
    )
    check.expect_no_mistakes(READ_MISTAKES, reads, f"{where}: ", random_case, counted=False)
    # Then the whole caches, element by element.
    check.expect(
        torch.equal(k.cache, expected_k) and torch.equal(v.cache, expected_v),
        f"{where}: the caches differ from mini_vllm.kernels.reference.store_kv",
        "only the slots in slot_mapping may change, each to its token's K (V) row",
        random_case=random_case,
    )


def _store_into_strided_caches(store_kv: Callable, check: Checker, layout: str) -> None:
    """K and V caches that are views with other strides than a contiguous ``[num_blocks, block_size, heads, dim]``.

    ``layout``:

    - ``"interleaved"``: views into one ``[num_blocks, 2, block_size, heads, head_dim]`` tensor (a
      block's K and V side by side, FlashInfer's layout), so the block stride is twice ``block_size *
      stride_cache_offset``: a kernel that ignores ``stride_cache_block`` (``slot * stride_cache_offset``,
      or strides computed from the shape) is right on every contiguous cache and wrong here;
    - ``"heads first"``: views of ``[num_blocks, heads, block_size, head_dim]`` tensors, so a token's
      heads are ``block_size * head_dim`` apart and its slots ``head_dim`` apart: a kernel that takes
      ``stride_cache_block`` but works out the offset and head strides from the shape is wrong here.

    The expected caches are written in plain PyTorch (``mini_vllm.kernels.reference.store_kv`` takes contiguous
    caches only). The cases are not counted: a passing check prints the same counts as before them.
    """
    num_blocks, block_size, num_kv_heads, head_dim = 4, 4, 2, 8
    slots = [5, 0, 13, 10]
    device = _device()
    generator = torch.Generator().manual_seed(7)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(device)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(device)
    if layout == "interleaved":
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)

        def caches(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return kv[:, 0], kv[:, 1]

        described = (
            "views into one [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor (a block's K and V side by side)"
        )
    else:
        shape = (2, num_blocks, num_kv_heads, block_size, head_dim)

        def caches(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return kv[0].transpose(1, 2), kv[1].transpose(1, 2)

        described = "views of [num_blocks, num_kv_heads, block_size, head_dim] tensors (each head's slots together)"
    # Room after the tensor: a store addressed as if the blocks were packed tighter or looser stays in it.
    buffer = torch.full((2 * math.prod(shape),), SENTINEL, device=device)
    k_cache, v_cache = caches(buffer[: math.prod(shape)].view(shape))
    expected = buffer.clone()
    expected_k, expected_v = caches(expected[: math.prod(shape)].view(shape))
    for token, slot in enumerate(slots):
        expected_k[slot // block_size, slot % block_size] = key[token]
        expected_v[slot // block_size, slot % block_size] = value[token]
    where = (
        f"K and V caches that are {described}, block_size={block_size}, num_kv_heads={num_kv_heads}, "
        f"head_dim={head_dim}, slots={slots}"
    )
    _call_kernel_launcher(store_kv, key, value, k_cache, v_cache, torch.tensor(slots, device=device), what=where)
    if torch.equal(buffer, expected):
        return
    row = num_kv_heads * head_dim
    block_stride, offset_stride, head_stride = k_cache.stride()[:3]
    packed = block_size * offset_stride
    k_start = k_cache.storage_offset()
    for token, slot in enumerate(slots):
        block, offset = divmod(slot, block_size)
        if torch.equal(k_cache[block, offset], key[token]):
            continue
        at = block * block_stride + offset * offset_stride
        if layout == "interleaved" and torch.equal(buffer[k_start + slot * row :][:row], key[token].reshape(-1)):
            check.fail(
                f"{where}: token {token}'s key (slot {slot} = block {block}, offset {offset}) landed at element "
                f"{slot * row} of k_cache instead of {at} "
                f"(block {block} * stride_cache_block {block_stride} + offset {offset} * {offset_stride})",
                f"you ignored stride_cache_block: here the blocks are {block_stride} elements apart, not "
                f"block_size * stride_cache_offset = {packed}. Address the cache with block * stride_cache_block "
                "+ offset * stride_cache_offset + heads * stride_cache_head + dims (block = slot // BLOCK_SIZE, "
                "offset = slot % BLOCK_SIZE); slot * stride_cache_offset, or strides worked out from the shape, "
                "are right only when the blocks are packed one after the other",
            )
        contiguous_row = k_start + block * block_stride + offset * row
        if layout == "heads first" and torch.equal(buffer[contiguous_row:][:row], key[token].reshape(-1)):
            check.fail(
                f"{where}: token {token}'s key (slot {slot} = block {block}, offset {offset}) was written as one "
                f"run of {row} elements at element {contiguous_row - k_start} of k_cache; here its heads are "
                f"{head_stride} elements apart (stride_cache_head) and its slots {offset_stride} "
                "(stride_cache_offset)",
                "you used stride_cache_block but worked out the offset and head strides from the shape "
                "(offset * num_kv_heads * head_dim, heads * head_dim): use the strides the launcher passes, "
                "block * stride_cache_block + offset * stride_cache_offset + heads * stride_cache_head + dims",
            )
        break
    check.fail(
        f"{where}: the caches differ from what storing each token's K (V) row in its slot gives",
        "use the strides the launcher passes (stride_cache_block, stride_cache_offset, stride_cache_head): "
        "a cache's blocks need not be packed one after the other, nor a token's heads",
    )


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2``: the launcher's HEADS_PAD and HEAD_DIM_PAD."""
    return 1 << max(0, n - 1).bit_length()


def _followed_by_zeros(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, tokens first) as a view of a buffer with PAST_THE_END rows of zeros after it."""
    buffer = torch.zeros((tensor.shape[0] + PAST_THE_END, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    buffer[: tensor.shape[0]] = tensor
    return buffer[: tensor.shape[0]]


def _reserve(num_elements: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A 1-D tensor of ``num_elements`` that costs memory only where it is written (None if impossible).

    On the CPU: an anonymous ``MAP_NORESERVE`` mapping (Linux), wrapped by
    ``torch.frombuffer`` without a copy. On a GPU: a plain allocation, if the
    GPU has room for it.
    """
    num_bytes = num_elements * torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if free < num_bytes + 2**30:
            return None
        return torch.empty(num_elements, dtype=dtype, device=device)
    if not sys.platform.startswith("linux"):
        return None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    try:
        region = mmap.mmap(-1, num_bytes, flags=flags)
    except (OSError, ValueError):
        return None
    return torch.frombuffer(region, dtype=dtype)


def _store_past_two_to_the_31(store_kv: Callable, check: Checker) -> bool:
    """Store one token at an element offset past 2**31 with an int32 slot_mapping.

    Returns False (and checks nothing) when the memory for it cannot be reserved.
    """
    block_size, num_kv_heads, head_dim = 16, 1, 8
    row = num_kv_heads * head_dim
    far_block = 2**31 // (block_size * row) + 1  # its first element is past 2**31
    cache_elements = (far_block + 1) * block_size * row
    # A 32-bit offset wraps around by 2**32 elements, to about 2**31 before the
    # cache: reserve that much in front of it, so a wrapped store lands in
    # memory we own, where we can see it, instead of crashing the process.
    before = 2**31 + 2**20
    device = _device()
    whole = _reserve(before + cache_elements, torch.float16, device)
    if whole is None:
        print("  (skipped the 2**31 case: cannot reserve 8 GiB of address space here)")
        return False
    cache = whole[before : before + cache_elements].view(far_block + 1, block_size, num_kv_heads, head_dim)
    offset_in_block = 3
    slot = far_block * block_size + offset_in_block
    element = slot * row
    assert element > 2**31
    rows = (torch.arange(row, dtype=torch.float16) + 1).view(1, num_kv_heads, head_dim).to(device)
    cache[far_block, offset_in_block].zero_()
    wrapped = before + element - 2**32
    whole[wrapped : wrapped + row].zero_()
    # K and V share the cache here (8 GiB, not 16): the same row is stored twice.
    _call_kernel_launcher(store_kv, rows, rows, cache, cache, torch.tensor([slot], dtype=torch.int32, device=device))
    landed = torch.equal(cache[far_block, offset_in_block].reshape(-1), rows.reshape(-1))
    if not landed and torch.equal(whole[wrapped : wrapped + row], rows.reshape(-1)):
        hint = (
            "the row landed 2**32 elements before its slot: the offset was computed in int32 and "
            "wrapped around. Convert the slot to int64 right after loading it "
            "(tl.load(...).to(tl.int64)), before multiplying by any stride"
        )
    else:
        hint = "convert the slot to tl.int64 before computing block * stride"
    del cache, whole
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the 8 GiB back to the GPU, not to PyTorch's cache
    check.expect(
        landed,
        f"slot {slot} (element offset {element:,} > 2**31 = {2**31:,}, slot_mapping int32): the row is not in its slot",
        hint,
    )
    return True


@guarded_check(part="store_kv")
def check_store_kv(store_kv: Callable) -> None:
    """Your ``store_kv(key, value, k_cache, v_cache, slot_mapping)`` (it launches your Triton kernel)."""
    check = Checker("store_kv")
    base = dict(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    cases = [  # (what the case is, _store_case's arguments besides base's); the first also finds a stub
        ("one token", dict(slots=[6])),
        ("five tokens in scattered slots", dict(slots=[5, 0, 13, 10, 7])),
        ("slot -1 (a padding token)", dict(slots=[2, -1, 9])),
        ("slots -1 only", dict(slots=[-1, -1])),
        ("the last slot of the last block", dict(slots=[15, 0])),
        (
            "one KV head, head_dim 12 (not a power of two)",
            dict(slots=[1, 11, 4], num_blocks=3, num_kv_heads=1, head_dim=12),
        ),
        ("three KV heads", dict(slots=[3, 8], num_blocks=3, num_kv_heads=3, head_dim=4)),
        ("key and value are views into a fused qkv tensor", dict(slots=[7, 1, 12], fused_qkv=True)),
        ("value is a view with other strides than key", dict(slots=[9, 2, 14], value_from_wider=True)),
        ("float32 key into a float16 cache", dict(slots=[4, 9], cache_dtype=torch.float16)),
        ("an int32 slot_mapping", dict(slots=[14, 3], slot_dtype=torch.int32)),
        (
            "float16 key and value into a float16 cache",
            dict(slots=[2, 12], key_dtype=torch.float16, cache_dtype=torch.float16),
        ),
        ("values of magnitude 1e30 (float32 holds them, float16 does not)", dict(slots=[0, 5], magnitude=1e30)),
        ("block_size 3 (not a power of two)", dict(slots=[4, 0, 8], num_blocks=3, block_size=3)),
    ]
    for label, arguments in cases:
        _store_case(store_kv, check, label, **(base | arguments))
    _store_into_strided_caches(store_kv, check, "interleaved")
    _store_into_strided_caches(store_kv, check, "heads first")
    _store_past_two_to_the_31(store_kv, check)
    rng = check.rng
    for index in range(25):
        num_blocks = rng.randint(1, 5)
        block_size = rng.choice([1, 2, 3, 4, 16])
        num_slots = num_blocks * block_size
        num_tokens = rng.randint(1, min(num_slots, 9))
        slots = rng.sample(range(num_slots), num_tokens)
        for position in range(num_tokens):
            if rng.random() < 0.15:
                slots[position] = -1
        _store_case(
            store_kv,
            check,
            f"random case {index}",
            slots=slots,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=rng.choice([1, 2, 3, 4]),
            head_dim=rng.choice([4, 6, 8, 16]),
            cache_dtype=rng.choice([torch.float32, torch.float16]),
            slot_dtype=rng.choice([torch.int64, torch.int32]),
            fused_qkv=rng.random() < 0.3,
            seed=index + 1,
            random_case=True,
        )
    check.passed()


# -- paged decode -----------------------------------------------------------------
def _dense_decode(query, keys, values, scale, kv_head_of) -> torch.Tensor:
    """Decode attention over dense ``keys``/``values`` ([n, Hkv, D]); query head h reads KV head kv_head_of(h)."""
    num_q_heads = query.shape[0]
    index = torch.tensor([kv_head_of(h) for h in range(num_q_heads)])
    k = keys.float()[:, index]  # [n, Hq, D]
    v = values.float()[:, index]
    scores = torch.einsum("hd,nhd->hn", query.float(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)


class _DecodeCase:
    """One sequence's decode step over a paged cache whose unused slots hold ``fill`` (by default 2 query heads
    and 2 KV heads of 8 dimensions, blocks of 4 tokens: the fixed cases name only what they change)."""

    def __init__(
        self,
        *,
        seq_len,
        table,
        num_blocks,
        block_size=4,
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=8,
        fill=float("nan"),
        pad_table=0,
        seed=0,
        dtype=torch.float32,
        very_negative=False,
    ):
        generator = torch.Generator().manual_seed(seed)
        self.seq_len, self.block_size = seq_len, block_size
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, fill)
        self.v_cache = torch.full(shape, fill)
        self.keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        self.values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        self.query = torch.randn(num_q_heads, head_dim, generator=generator)
        self.very_negative = very_negative
        if very_negative:
            # Every score q . k is far below 0 (about -1000): exp(score) underflows to 0 without the max.
            self.query = self.query.abs() + 1.0
            self.keys = -(self.keys.abs() + 1.0) * (1000.0 / head_dim)
        self.dtype = dtype
        for position in range(seq_len):
            block = table[position // block_size]
            self.k_cache[block, position % block_size] = self.keys[position]
            self.v_cache[block, position % block_size] = self.values[position]
        # Padding after the sequence's blocks, as in the engine's block tables (block 0).
        self.block_table = torch.tensor(list(table) + [0] * pad_table, dtype=torch.int32)
        if dtype != torch.float32:  # the case is defined by what the half-precision tensors hold
            self.query, self.k_cache, self.v_cache = (t.to(dtype) for t in (self.query, self.k_cache, self.v_cache))
            self.keys, self.values = self.keys.to(dtype).float(), self.values.to(dtype).float()

    def with_positions(self, order: list[int]) -> _DecodeCase:
        """The same keys and values in another order along the sequence (the same blocks, the same garbage)."""
        other = copy.copy(self)
        other.keys, other.values = self.keys[order], self.values[order]
        other.k_cache, other.v_cache = self.k_cache.clone(), self.v_cache.clone()
        table = self.block_table.tolist()
        for position in range(self.seq_len):
            block, offset = table[position // self.block_size], position % self.block_size
            other.k_cache[block, offset] = other.keys[position].to(self.k_cache.dtype)
            other.v_cache[block, offset] = other.values[position].to(self.v_cache.dtype)
        return other

    def scores(self, scale) -> torch.Tensor:
        """[num_q_heads, seq_len] float32 scores q . k * scale (query head h reads KV head h // group)."""
        group = self.num_q_heads // self.num_kv_heads
        keys = self.keys.float().repeat_interleave(group, dim=1)
        return torch.einsum("hd,nhd->hn", self.query.float(), keys) * scale

    def describe(self) -> str:
        return (
            f"seq_len={self.seq_len}, block_size={self.block_size}, block_table={self.block_table.tolist()}, "
            f"num_q_heads={self.num_q_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            + ("" if self.dtype == torch.float32 else f", dtype={self.dtype}")
        )

    def expected(self, scale=None) -> torch.Tensor:
        from mini_vllm.kernels import reference

        out = reference.paged_attention(
            self.query[None],
            self.k_cache,
            self.v_cache,
            self.block_table[None],
            torch.tensor([self.seq_len], dtype=torch.int32),
            scale,
        )
        return out[0]

    def dense(self, scale, kv_head_of=None, keys=None, values=None) -> torch.Tensor:
        group = self.num_q_heads // self.num_kv_heads
        kv_head_of = kv_head_of or (lambda h: h // group)
        keys = self.keys if keys is None else keys
        values = self.values if values is None else values
        return _dense_decode(self.query, keys, values, scale, kv_head_of)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element, NaN equal to NaN (the caches' unused slots hold NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape:
        return False
    tolerance = (1e-4, 1e-5) if want.dtype == torch.float32 else (2e-2, 2e-2)
    return bool(torch.allclose(got.float(), want.float(), rtol=tolerance[0], atol=tolerance[1]))


@dataclass
class _DecodeError:
    """An exception the learner's paged_decode raised on a case."""

    case: _DecodeCase
    error: BaseException

    @property
    def grouped(self) -> bool:
        return self.case.num_q_heads != self.case.num_kv_heads

    @functools.cached_property
    def k_heads(self) -> int | None:
        """The heads of the learner's K when an einsum with the query failed on them (as torch words it)."""
        match = re.search(
            r"has size (\d+) for operand 1 which does not broadcast with previously seen size (\d+)", str(self.error)
        )
        if match is None or int(match.group(2)) != self.case.num_q_heads:
            return None
        return int(match.group(1))


def _group_hint(seen: _DecodeError) -> str:
    case = seen.case
    told = (
        f"your K has {seen.k_heads} heads where the query has {case.num_q_heads}"
        if seen.k_heads is not None
        else f"here {case.num_q_heads} query heads share {case.num_kv_heads} KV heads"
    )
    return (
        f"{told}: group = num_q_heads // num_kv_heads = {case.num_q_heads // case.num_kv_heads} (num_kv_heads // "
        f"num_q_heads is {case.num_kv_heads // case.num_q_heads}); query head h reads KV head h // group, so "
        "repeat each KV head group times (k.repeat_interleave(group, dim=1)) to give K the query's heads"
    )


# The crashes whose hint is known, as a table of mistakes (first_mistake picks the hint; the others get
# the general guess from the exception).
DECODE_ERRORS = (
    Mistake(
        lambda seen: isinstance(seen.error, IndexError),
        hint=lambda seen: (
            "an index past the end of the block table or of a block: the sequence has "
            f"ceil(seq_len / block_size) = {math.ceil(seen.case.seq_len / seen.case.block_size)} blocks here, and "
            "the block table may hold no entry after them; walk exactly that many, and take block_size from the "
            "cache (k_cache.shape[1])"
        ),
    ),
    Mistake(
        lambda seen: seen.grouped and (seen.k_heads is not None or "ZeroDivisionError" in repr(seen.error)),
        hint=_group_hint,
    ),
)


def _decode_error_hint(seen: _DecodeError) -> str:
    mistake = first_mistake(DECODE_ERRORS, seen)
    return mistake.hint_for(seen) if mistake else ""


@dataclass
class _ChangedInputs:
    """Which of paged_decode's inputs it changed."""

    query: bool
    k_cache: bool
    v_cache: bool


CHANGED_INPUTS = (
    Mistake(
        lambda seen: seen.query and not (seen.k_cache or seen.v_cache),
        "your paged_decode changed the query it was given",
        "the query is the caller's tensor (the model reads it again): scale a copy, q = query.float() * scale, "
        "not query.mul_(scale) or query *= scale, which write into it",
    ),
)


def _decode_case(
    paged_decode: Callable, check: Checker, case: _DecodeCase, name: str, scale=None, random_case: bool = False
) -> None:
    kwargs = {} if scale is None else {"scale": scale}
    where = f"{name} ({case.describe()}{'' if scale is None else f', scale={scale}'})"
    check.case = where
    given = (case.query.clone(), case.k_cache.clone(), case.v_cache.clone(), case.block_table.clone())
    got = check.call(
        paged_decode,
        *given,
        case.seq_len,
        **kwargs,
        what=f"{where}: paged_decode(...)",
        expected=f"a tensor [num_q_heads, head_dim] = [{case.num_q_heads}, {case.head_dim}]",
        hint=lambda error: _decode_error_hint(_DecodeError(case, error)),
    )
    want = case.expected(scale)
    changed = _ChangedInputs(*(not _same(a, b) for a, b in zip(given, (case.query, case.k_cache, case.v_cache))))
    check.expect_no_mistakes(CHANGED_INPUTS, changed, f"{where}: ", random_case, counted=False)
    check.expect(
        all(_same(a, b) for a, b in zip(given, (case.query, case.k_cache, case.v_cache, case.block_table))),
        f"{where}: your paged_decode changed its inputs (the query, the caches or the block table)",
        "the caches are shared by every sequence and every step: read them, never write them "
        "(no in-place ops like k.mul_(scale), k_cache[...] = ..., or masked_fill_ on a view of the cache)",
        random_case=random_case,
    )
    if not (isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape)):
        check.expect(
            False,
            f"{where}: the output should be a tensor of shape {tuple(want.shape)} "
            f"(num_q_heads, head_dim); got {getattr(got, 'shape', type(got).__name__)}",
            random_case=random_case,
        )
    check.expect(
        got.dtype == want.dtype,
        f"{where}: the output has dtype {got.dtype}; it must have the query's dtype, {want.dtype}",
        "compute in float32, then return (acc / running_sum[:, None]).to(query.dtype): the next layer "
        "expects the model's dtype",
        random_case=random_case,
    )
    used_scale = case.head_dim**-0.5 if scale is None else scale
    if _close(got, want):
        if case.dtype != torch.float32:
            exact = case.dense(used_scale)  # float32, from the same half-precision inputs
            ulps = _ulps(got, exact, case.values, case.dtype)
            dtype = str(case.dtype).removeprefix("torch.")
            check.expect(
                ulps <= 1.0,
                f"{where}: your output is {ulps:.1f} ulps of {dtype} away from the float32 result (a float32 "
                f"computation rounded once to {dtype} is within 1 ulp)",
                f"accumulate in float32: convert the query and each block's K and V with .float() before the dot "
                f"products, keep running_max, running_sum and acc in float32, and round once, at the end: "
                f"return (acc / running_sum[:, None]).to(query.dtype). Arithmetic in {dtype} rounds every "
                f"product, exp and sum to {_MANTISSA_BITS[case.dtype] + 1} significant bits",
                random_case=random_case,
            )
        check.expect(True, where, random_case=random_case)
        return
    seen = _WrongOutput(paged_decode, case, got, scale, kwargs)
    mistake = first_mistake(OUTPUT_MISTAKES, seen)
    check.expect(
        False,
        f"{where}: your output differs from the reference by up to "
        f"{(got.float() - want.float()).abs().max().item():.3g}",
        mistake.hint_for(seen) if mistake else OUTPUT_HINT,
        random_case=random_case,
    )


_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def _ulps(got: torch.Tensor, exact: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest error of ``got`` against the float32 ``exact``, in ulps of ``dtype`` at each element.

    An element near 0 (the weighted values cancel) is measured with the ulp at 1/64 of the largest
    |V|: float32's own rounding there is far below it, and a ulp at 1e-6 would be meaningless.
    """
    floor = max(values.abs().max().item() / 64, torch.finfo(dtype).tiny)
    magnitude = exact.abs().clamp_min(floor)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - _MANTISSA_BITS[dtype])
    return ((got.float() - exact).abs() / ulp).max().item()


def _online_softmax(case: _DecodeCase, scale, *, rescale_acc: bool, rescale_sum: bool) -> torch.Tensor:
    """The online softmax over the case's blocks in float32, with the rescale of acc and/or the sum left out."""
    scores, values = case.scores(scale), case.values.float()
    group = case.num_q_heads // case.num_kv_heads
    values = values.repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_dim]
    running_max = torch.full((case.num_q_heads,), float("-inf"))
    running_sum = torch.zeros(case.num_q_heads)
    acc = torch.zeros(case.num_q_heads, case.head_dim)
    for start in range(0, case.seq_len, case.block_size):
        block_scores = scores[:, start : start + case.block_size]
        new_max = torch.maximum(running_max, block_scores.max(dim=1).values)
        rescale = torch.exp(running_max - new_max)
        weights = torch.exp(block_scores - new_max[:, None])
        running_sum = (running_sum * rescale if rescale_sum else running_sum) + weights.sum(dim=1)
        block_values = values[start : start + case.block_size]
        acc = (acc * rescale[:, None] if rescale_acc else acc) + torch.einsum("hn,nhd->hd", weights, block_values)
        running_max = new_max
    return acc / running_sum[:, None]


def _missing_rescale(paged_decode: Callable, case: _DecodeCase, scale, kwargs: dict, got: torch.Tensor) -> str | None:
    """A hint when ``got`` is what an online softmax without the rescale by exp(old_max - new_max) gives.

    Two signs, either is enough: ``got`` equals the online softmax with the rescale of the accumulator
    and/or the running sum left out; or the learner's function is right on the same keys and values
    reordered so that every head's largest score sits in the first block (the running max then never
    changes, so a missing rescale costs nothing) while it is wrong here, where the max grows.
    """
    if case.seq_len <= case.block_size:
        return None
    scores = case.scores(scale)
    grows = None  # (query head, block of the sequence) where a running max first grows after block 0
    for start in range(case.block_size, case.seq_len, case.block_size):
        before = scores[:, :start].max(dim=1).values
        block_max = scores[:, start : start + case.block_size].max(dim=1).values
        heads = (block_max > before).nonzero().flatten().tolist()
        if heads:
            grows = (heads[0], start // case.block_size)
            break
    if grows is None:
        return None
    left_out = None
    for rescale_acc, rescale_sum, what in (
        (False, True, "the accumulator acc"),
        (True, False, "the running sum"),
        (False, False, "the accumulator and the running sum"),
    ):
        if _close(got, _online_softmax(case, scale, rescale_acc=rescale_acc, rescale_sum=rescale_sum)):
            left_out = what
            break
    right_when_the_max_stays = False
    first = list(dict.fromkeys(scores.argmax(dim=1).tolist()))  # every head's best position, once each
    if len(first) <= case.block_size:
        order = first + [p for p in range(case.seq_len) if p not in first]
        steady = case.with_positions(order)
        try:
            again = paged_decode(
                steady.query.clone(),
                steady.k_cache.clone(),
                steady.v_cache.clone(),
                steady.block_table.clone(),
                steady.seq_len,
                **kwargs,
            )
            right_when_the_max_stays = isinstance(again, torch.Tensor) and _close(
                again, steady.expected(kwargs.get("scale"))
            )
        except Exception:  # noqa: BLE001 - no second sign, the first may still tell
            pass
    if left_out is None and not right_when_the_max_stays:
        return None
    head, block = grows
    return (
        "the online-softmax rescale is missing"
        + (f": your output is what the loop gives when it never rescales {left_out}" if left_out else "")
        + ". "
        + (
            "On the same keys and values reordered so that every head's largest score is in the first block "
            "(the running max never changes) your output is right; "
            if right_when_the_max_stays
            else ""
        )
        + f"here query head {head}'s max grows in the sequence's block {block} (of "
        f"{math.ceil(case.seq_len / case.block_size)}). The terms summed before were weighted by "
        "exp(score - old_max): when a block raises the max, multiply acc AND running_sum by "
        "exp(old_max - new_max) before adding the block's terms (rescale = torch.exp(running_max - new_max); "
        "acc = acc * rescale[:, None] + ...; running_sum = running_sum * rescale + ...)"
    )


def _first_tokens_only(got: torch.Tensor, case: _DecodeCase, scale, num_tokens: int) -> bool:
    """True when ``got`` is what attending to the sequence's first ``num_tokens`` tokens only gives.

    With no tokens at all a loop divides 0 by 0: every element NaN.
    """
    if num_tokens <= 0:
        return bool(torch.isnan(got.float()).all())
    if num_tokens >= case.seq_len:
        return False
    return _close(got, case.dense(scale, keys=case.keys[:num_tokens], values=case.values[:num_tokens]))


def _leading_blocks_read(got: torch.Tensor, case: _DecodeCase, scale) -> int | None:
    """k when ``got`` is what reading only the sequence's first k whole blocks gives (0 < k < all)."""
    num_blocks = math.ceil(case.seq_len / case.block_size)
    return next(
        (k for k in range(1, num_blocks) if _first_tokens_only(got, case, scale, k * case.block_size)),
        None,
    )


def _every_block_partial(case: _DecodeCase, scale) -> torch.Tensor:
    """What a loop that slices every block to seq_len % block_size tokens (as if each were the last) gives."""
    valid = case.seq_len % case.block_size
    num_blocks = math.ceil(case.seq_len / case.block_size)
    positions = [i * case.block_size + j for i in range(num_blocks) for j in range(valid)]
    return case.dense(scale, keys=case.keys[positions], values=case.values[positions])


def _unmasked_output(case: _DecodeCase, scale) -> torch.Tensor:
    """What a loop that reads every slot of the last block (past seq_len) computes."""
    num_blocks_used = math.ceil(case.seq_len / case.block_size)
    blocks = case.block_table[:num_blocks_used].long()
    keys = case.k_cache[blocks].flatten(0, 1)
    values = case.v_cache[blocks].flatten(0, 1)
    return case.dense(scale, keys=keys, values=values)


def _logical_block_output(case: _DecodeCase, scale) -> torch.Tensor | None:
    """What a loop reading k_cache[i] instead of k_cache[block_table[i]] computes (None if it would fail)."""
    num_blocks_used = math.ceil(case.seq_len / case.block_size)
    if num_blocks_used > case.k_cache.shape[0]:
        return None
    keys = case.k_cache[:num_blocks_used].flatten(0, 1)[: case.seq_len]
    values = case.v_cache[:num_blocks_used].flatten(0, 1)[: case.seq_len]
    if torch.isnan(keys).any() or torch.isnan(values).any():
        return torch.full((case.num_q_heads, case.head_dim), float("nan"))
    return case.dense(scale, keys=keys, values=values)


@dataclass
class _WrongOutput:
    """A paged_decode output that is not the reference's, and the case it was computed on."""

    paged_decode: Callable
    case: _DecodeCase
    got: torch.Tensor
    scale: float | None  # the scale passed (None: the default)
    kwargs: dict

    @property
    def used_scale(self) -> float:
        return self.case.head_dim**-0.5 if self.scale is None else self.scale

    @property
    def extreme(self) -> bool:
        return self.case.very_negative or (self.scale is not None and self.scale >= 10)

    @property
    def full_blocks(self) -> int:
        """The sequence's tokens in full blocks."""
        return self.case.seq_len // self.case.block_size * self.case.block_size

    @property
    def partial(self) -> int:
        """The tokens in the partial last block (0: the last block is full)."""
        return self.case.seq_len % self.case.block_size

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.case.seq_len / self.case.block_size)

    def attends_to(self, output: torch.Tensor | None) -> bool:
        return output is not None and _close(self.got, output)

    def first_tokens_only(self, num_tokens: int) -> bool:
        return _first_tokens_only(self.got, self.case, self.used_scale, num_tokens)

    @functools.cached_property
    def leading_blocks_read(self) -> int | None:
        return _leading_blocks_read(self.got, self.case, self.used_scale)

    @functools.cached_property
    def unmasked(self) -> torch.Tensor:
        return _unmasked_output(self.case, self.used_scale)

    @functools.cached_property
    def missing_rescale(self) -> str | None:
        return _missing_rescale(self.paged_decode, self.case, self.used_scale, self.kwargs, self.got)


def _last_full_block_hint(seen: _WrongOutput) -> str:
    case = seen.case
    return (
        f"the sequence's last block is full here (seq_len {case.seq_len} is a multiple of block_size "
        f"{case.block_size}), and your loop took none of its tokens"
        + (" (with no tokens at all, the softmax is 0 / 0 = NaN)" if case.seq_len == case.block_size else "")
        + ": the last block holds seq_len - i * block_size tokens, up to block_size: "
        "min(block_size, seq_len - i * block_size). seq_len % block_size is 0 when the block is full"
    )


def _leading_blocks_hint(seen: _WrongOutput) -> str:
    case, num_read = seen.case, seen.leading_blocks_read
    hint = (
        f"your loop read only the sequence's first {num_read} block(s) ({num_read * case.block_size} tokens) "
        f"of its {seen.num_blocks}: walk ceil(seq_len / block_size) blocks"
    )
    if case.block_size != 16 and num_read == math.ceil(case.seq_len / 16):
        hint += (
            f", with this cache's block_size ({case.block_size}, k_cache.shape[1]): {num_read} is the number "
            "of blocks a block_size of 16 gives. The engine's caches have other block sizes; never write 16"
        )
    return hint


OUTPUT_HINT = "compare your loop with mini_vllm.kernels.reference.paged_attention on this case"
"""The hint for a wrong output that no row of OUTPUT_MISTAKES explains."""

# What a wrong output is, as a table of mistakes: the first row that shows gives the hint (each row
# compares the output with what one mistake computes on the case).
OUTPUT_MISTAKES = (
    Mistake(
        lambda seen: seen.partial == 0 and seen.first_tokens_only(seen.full_blocks - seen.case.block_size),
        hint=_last_full_block_hint,
    ),
    Mistake(
        lambda seen: seen.partial > 0 and seen.first_tokens_only(seen.full_blocks),
        hint=lambda seen: (
            f"you left out the partial last block: its {seen.partial} token(s) (positions "
            f"{seen.full_blocks}..{seen.case.seq_len - 1}) count too. Walk ceil(seq_len / block_size) = "
            f"{seen.num_blocks} blocks (math.ceil, or (seq_len + block_size - 1) // "
            f"block_size), not seq_len // block_size = {seen.case.seq_len // seen.case.block_size}"
        ),
    ),
    Mistake(lambda seen: seen.leading_blocks_read is not None, hint=_leading_blocks_hint),
    Mistake(
        lambda seen: seen.partial > 0 and seen.attends_to(_every_block_partial(seen.case, seen.used_scale)),
        hint=lambda seen: (
            f"you took {seen.partial} token(s) (seq_len % block_size) from EVERY block; only the last block is "
            f"partial: block i holds min(block_size, seq_len - i * block_size) of the sequence's tokens, "
            "so every block before the last is full"
        ),
    ),
    Mistake(
        lambda seen: seen.scale is None and seen.attends_to(seen.case.dense(1.0 / seen.case.head_dim)),
        hint=lambda seen: (
            f"your default scale is 1/head_dim (1/{seen.case.head_dim}); with scale=None the scores are multiplied "
            f"by 1/sqrt(head_dim) = {seen.case.head_dim**-0.5:.4g} (math.sqrt, or head_dim ** -0.5)"
        ),
    ),
    Mistake(
        lambda seen: seen.extreme and not torch.isfinite(seen.got.float()).all() and not seen.attends_to(seen.unmasked),
        hint="the scores here are extreme (about -1000, or large with scale 40): exp(score) underflows to 0 "
        "(0 / 0 = NaN) or overflows to inf (inf / inf = NaN). The online softmax subtracts the running "
        "max before exp (exp(score - max) is 1 for the largest score), which keeps every term finite "
        "and the sum positive whatever the scores",
    ),
    Mistake(
        lambda seen: bool(torch.isnan(seen.got).any()),
        hint="NaN in your output: the slots past seq_len in the last block hold NaN here (unused memory "
        "can hold anything). Masking their scores to -inf is not enough if you then multiply their "
        "V by a weight of 0, because 0 * NaN = NaN: drop those rows (slice to the valid length) "
        "or select with torch.where",
    ),
    Mistake(
        lambda seen: seen.attends_to(seen.case.dense(1.0)),
        hint="your scores are not scaled: multiply q @ k by 1/sqrt(head_dim) (or by `scale` when it is given)",
    ),
    Mistake(
        lambda seen: seen.scale is not None and seen.attends_to(seen.case.dense(seen.case.head_dim**-0.5)),
        hint="you ignored the `scale` argument: use it when it is given, 1/sqrt(head_dim) only when it is None",
    ),
    Mistake(
        lambda seen: (
            seen.case.num_q_heads != seen.case.num_kv_heads
            and seen.attends_to(seen.case.dense(seen.used_scale, lambda h: h % seen.case.num_kv_heads))
        ),
        hint=lambda seen: (
            f"grouped-query attention: query head h reads KV head h // "
            f"{seen.case.num_q_heads // seen.case.num_kv_heads} (num_q_heads // num_kv_heads), "
            "consecutive query heads share a KV head; you used h % num_kv_heads"
        ),
    ),
    Mistake(
        lambda seen: seen.partial > 0 and seen.attends_to(seen.unmasked),
        hint=lambda seen: (
            f"the last block holds only {seen.partial} of the sequence's tokens (seq_len % block_size); you also "
            f"attended to its {seen.case.block_size - seen.partial} unused slots: mask them (or slice them off)"
        ),
    ),
    Mistake(lambda seen: seen.missing_rescale is not None, hint=lambda seen: seen.missing_rescale),
    Mistake(
        lambda seen: seen.attends_to(_logical_block_output(seen.case, seen.used_scale)),
        hint="you read the blocks in logical order (block i of the sequence = k_cache[i]); "
        "the sequence's i-th block lives in physical block block_table[i]",
    ),
)


@guarded_check(part="paged_decode")
def check_paged_decode(paged_decode: Callable) -> None:
    """Your ``paged_decode(query, k_cache, v_cache, block_table, seq_len, scale=None)``, one sequence."""
    check = Checker("paged_decode")
    long = dict(seq_len=64, block_size=16, num_q_heads=4, head_dim=32, table=[3, 0, 2, 1], num_blocks=4)
    fixed = [  # (what the case is, _DecodeCase's arguments besides its defaults, scale)
        ("one full block, block_table [0]", dict(seq_len=4, table=[0], num_blocks=1), None),
        ("an explicit scale", dict(seq_len=4, table=[0], num_blocks=1), 0.3),
        (
            "three full blocks in shuffled physical blocks",
            dict(seq_len=12, table=[3, 0, 5], num_blocks=6, fill=0.0),
            None,
        ),
        (
            "a partial last block (unused slots hold 100.0)",
            dict(seq_len=10, table=[1, 2, 0], num_blocks=3, fill=100.0),
            None,
        ),
        ("a partial last block (unused slots hold NaN)", dict(seq_len=10, table=[1, 2, 0], num_blocks=3), None),
        (
            "grouped-query attention: 4 query heads share 2 KV heads",
            dict(seq_len=8, num_q_heads=4, table=[2, 1], num_blocks=4, fill=0.0),
            None,
        ),
        (
            "grouped-query attention: 6 query heads share 2 KV heads, partial block",
            dict(seq_len=7, num_q_heads=6, head_dim=4, table=[1, 3], num_blocks=4),
            None,
        ),
        (
            "a block table padded past the sequence's blocks (block 0 holds NaN)",
            dict(seq_len=5, num_kv_heads=1, table=[2, 1], num_blocks=3, pad_table=2),
            None,
        ),
        ("seq_len 1 (the first decode step of a 1-token prompt)", dict(seq_len=1, table=[2], num_blocks=3), None),
        (
            "block_size 1",
            dict(seq_len=5, block_size=1, num_kv_heads=1, head_dim=4, table=[4, 0, 3, 1, 2], num_blocks=6),
            None,
        ),
        ("large scores (softmax must subtract the running max)", dict(seq_len=9, table=[0, 2, 1], num_blocks=3), 40.0),
        (
            "every score about -1000 (softmax must subtract the running max)",
            dict(seq_len=9, table=[0, 2, 1], num_blocks=3, very_negative=True),
            None,
        ),
        (
            "float16 query and caches (the output keeps the query's dtype)",
            dict(seq_len=10, num_kv_heads=1, table=[2, 0, 1], num_blocks=3, dtype=torch.float16),
            None,
        ),
        (
            "bfloat16 query and caches",
            dict(seq_len=6, num_q_heads=4, table=[1, 0], num_blocks=3, dtype=torch.bfloat16),
            None,
        ),
        (
            "block_size 3 (not a power of two)",
            dict(seq_len=8, block_size=3, head_dim=4, table=[2, 0, 3], num_blocks=4),
            None,
        ),
        # Long enough that arithmetic in float16/bfloat16 (not float32) is several ulps off, whatever the step.
        ("float16, 64 tokens in 4 blocks of 16 (accumulate in float32)", dict(long, dtype=torch.float16), None),
        ("bfloat16, 64 tokens in 4 blocks of 16 (accumulate in float32)", dict(long, dtype=torch.bfloat16), None),
    ]
    for seed, (name, kwargs, scale) in enumerate(fixed):
        _decode_case(paged_decode, check, _DecodeCase(seed=seed, **kwargs), name, scale)
    rng = check.rng
    for index in range(40):
        block_size = rng.choice([1, 2, 3, 4, 8, 16])
        seq_len = rng.randint(1, 40)
        num_used = math.ceil(seq_len / block_size)
        num_blocks = num_used + rng.randint(0, 3)
        num_kv_heads = rng.choice([1, 2, 3])
        group = rng.choice([1, 2, 4])
        table = rng.sample(range(num_blocks), num_used)
        case = _DecodeCase(
            seq_len=seq_len,
            block_size=block_size,
            num_q_heads=num_kv_heads * group,
            num_kv_heads=num_kv_heads,
            head_dim=rng.choice([4, 8, 16]),
            table=table,
            num_blocks=num_blocks,
            pad_table=rng.randint(0, 2),
            seed=100 + index,
        )
        _decode_case(
            paged_decode, check, case, f"random case {index}", rng.choice([None, None, 0.25]), random_case=True
        )
    check.passed()
