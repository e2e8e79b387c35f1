"""What the KV cache must hold, per kind of layer: specs, groups and the cache config (chapter 08b).

A model whose layers all use full attention needs one block table per
request. A *hybrid* model (Gemma 3, gpt-oss, Llama 4, Mistral variants) mixes
full-attention layers with sliding-window layers, which attend only to the
last ``sliding_window`` tokens and so need only the blocks under that window.
vLLM splits the layers into *KV-cache groups* of one size, each of one kind
(Gemma 3, five sliding layers per full one: one full-attention group and five
sliding-window groups): the layers of a group share one block table per
request, every group takes its blocks from the one shared ``BlockPool``, and a
cache hit is the prefix that every group can serve.

vLLM equivalents: ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``,
``SlidingWindowSpec``, ``KVCacheGroupSpec``, ``KVCacheConfig``) and
``vllm/v1/core/kv_cache_planning.py`` (which groups a model's layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from .validation import check_block_size, check_positive_int


@dataclass(frozen=True)
class FullAttentionSpec:
    """Layers that attend to every earlier token: a request holds all its blocks until it finishes."""

    block_size: int


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Layers that attend to the last ``sliding_window`` tokens only (the token itself included).

    A request needs only the blocks that intersect the window of its next
    token; the ones before it are freed while the request runs and replaced
    in its table by the pool's null block.
    """

    block_size: int
    sliding_window: int


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table per request (vLLM: ``KVCacheGroupSpec``).

    ``layer_ids``: the model's layer indices in the group, in order. The
    ``i``-th layer of every group writes into the same KV tensor ``i``: a
    block belongs to one group at a time, so the groups share the memory. A
    group may hold fewer layers than the others (vLLM's padding): its last
    tensors are unused.
    """

    layer_ids: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache of one engine: ``num_blocks`` blocks of one shared pool, and the groups that use them.

    One full-attention group is the engine of every chapter before 08b.
    mini-vLLM puts the full-attention group first (group 0), so that group's
    prefix-cache keys are the bare block hashes, as in a single-group engine;
    vLLM numbers groups in layer order and sorts full attention first only
    for the lookup.
    """

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        check_positive_int("num_blocks", self.num_blocks)
        if not self.kv_cache_groups:
            raise ValueError("a KVCacheConfig needs at least one KV-cache group")
        sizes = {group.kv_cache_spec.block_size for group in self.kv_cache_groups}
        if len(sizes) != 1:
            raise ValueError(f"every KV-cache group must use the same block_size, got {sorted(sizes)}")

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def num_layers_per_block(self) -> int:
        """How many layers' K/V one block holds: the group size (a padded group leaves some of them unused)."""
        return max(len(group.layer_ids) for group in self.kv_cache_groups)


def max_blocks_per_request(kv_cache_config: KVCacheConfig, num_tokens: int, max_num_batched_tokens: int) -> int:
    """The most blocks of the pool one request of ``num_tokens`` tokens holds at once, over all groups.

    A full-attention group holds every block; a sliding-window group at most
    the window before a chunk plus the chunk: ``cdiv(sliding_window - 1 +
    max_num_batched_tokens, block_size) + 1`` (vLLM:
    ``SlidingWindowSpec.max_memory_usage_bytes``).
    """
    block_size = kv_cache_config.block_size
    num_blocks = -(-num_tokens // block_size)
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            total += min(num_blocks, -(-(spec.sliding_window - 1 + max_num_batched_tokens) // block_size) + 1)
        else:
            total += num_blocks
    return total


def group_layers(layer_specs: list[KVCacheSpec] | tuple[KVCacheSpec, ...]) -> tuple[KVCacheGroupSpec, ...]:
    """Split a model's layers into KV-cache groups of one size, as vLLM 0.33 does.

    ``layer_specs[i]``: layer ``i``'s spec. Layers with equal specs share a
    *bucket*. Every group holds the same number of layers, the group size:
    the smallest bucket's, or the largest bucket's when that is under 1.5x the
    smallest (12 sliding + 13 full become two groups of 13, not 25 layers in
    groups of 12). Each bucket is split into ``cdiv(len(bucket), group_size)``
    groups, the ``i``-th taking ``bucket[i::num_groups]``; the last group of a
    bucket may hold fewer layers (vLLM pads it: those tensor slots stay
    unused). Gemma 3's 5 sliding layers per full one give one full-attention
    group and five sliding-window groups; a model whose layers all slide has
    one sliding-window group.

    Groups are numbered bucket by bucket, the full-attention bucket first
    (mini-vLLM's convention, see ``KVCacheConfig``), then in layer order.
    vLLM: ``_get_kv_cache_groups_uniform_page_size`` in
    ``vllm/v1/core/kv_cache_planning.py``.
    """
    buckets: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(layer_specs):
        buckets.setdefault(spec, []).append(layer)
    ordered = sorted(buckets.items(), key=lambda item: not isinstance(item[0], FullAttentionSpec))
    sizes = [len(layers) for _, layers in ordered]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for spec, layers in ordered:
        num_groups = -(-len(layers) // group_size)
        groups += [KVCacheGroupSpec(tuple(layers[i::num_groups]), spec) for i in range(num_groups)]
    return tuple(groups)


def make_kv_cache_config(
    layer_windows: list[int | None] | tuple[int | None, ...],
    block_size: int,
    num_blocks: int,
    disable_hybrid_kv_cache_manager: bool = False,
) -> KVCacheConfig:
    """The KV cache of a model whose layer ``i`` has sliding window ``layer_windows[i]`` (None: full attention).

    The layers are grouped as vLLM 0.33 groups them (``group_layers``).
    ``disable_hybrid_kv_cache_manager``: a model that mixes full attention
    and sliding windows is cached as if every layer used full attention (one
    group; vLLM's ``unify_hybrid_kv_cache_specs``): no block leaves a table
    early and every full block is cached. A model whose layers all slide keeps
    its sliding-window group either way, as in vLLM.
    """
    check_block_size(block_size)
    for window in layer_windows:
        if window is not None:
            check_positive_int("sliding_window", window)
    specs: list[KVCacheSpec] = [
        FullAttentionSpec(block_size) if window is None else SlidingWindowSpec(block_size, window)
        for window in layer_windows
    ]
    if disable_hybrid_kv_cache_manager and None in layer_windows:
        windows = sorted({window for window in layer_windows if window is not None})
        if len(windows) > 1:  # vLLM: "All attention layers in the same KV cache group must have the same window size"
            raise ValueError(
                f"disable_hybrid_kv_cache_manager puts every layer in one group, but the sliding layers use "
                f"windows {windows}: every layer of a group must use the same window"
            )
        specs = [FullAttentionSpec(block_size)] * len(specs)
    return KVCacheConfig(num_blocks, group_layers(specs))
