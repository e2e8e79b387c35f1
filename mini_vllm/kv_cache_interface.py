"""What the KV cache must hold, per kind of layer: specs, groups and the cache config (chapter 08b).

A model whose layers all use full attention needs one block table per
request. A *hybrid* model (Gemma 3, gpt-oss, Llama 4, Mistral variants) mixes
full-attention layers with sliding-window layers, which attend only to the
last ``sliding_window`` tokens and so need only the blocks under that window.
vLLM gives each kind of layer its own *KV-cache group*: the layers of a group
share one block table per request, every group takes its blocks from the one
shared ``BlockPool``, and a cache hit is the prefix that every group can serve.

vLLM equivalents: ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``,
``SlidingWindowSpec``, ``KVCacheGroupSpec``, ``KVCacheConfig``) and
``vllm/v1/core/kv_cache_utils.py`` (which groups a model's layers).
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
    block belongs to one group at a time, so the groups share the memory.
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
        counts = {len(group.layer_ids) for group in self.kv_cache_groups}
        if len(counts) != 1:
            raise ValueError(
                "every KV-cache group must hold as many layers (they share the KV tensors), got "
                + ", ".join(f"{len(g.layer_ids)} {type(g.kv_cache_spec).__name__}" for g in self.kv_cache_groups)
            )

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def is_hybrid(self) -> bool:
        return len(self.kv_cache_groups) > 1

    @property
    def num_layers_per_block(self) -> int:
        """How many layers' K/V one block holds: the layers of one group."""
        return len(self.kv_cache_groups[0].layer_ids)


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


def make_kv_cache_config(
    layer_windows: list[int | None] | tuple[int | None, ...], block_size: int, num_blocks: int
) -> KVCacheConfig:
    """Group a model's layers by kind: one group of full-attention layers (first), one of sliding-window layers.

    ``layer_windows[i]``: layer ``i``'s sliding window, None for full
    attention. Every sliding layer must use the same window, and a hybrid
    model must have as many layers of each kind (each block holds one group's
    layers). vLLM splits unequal kinds into several groups of the same size
    (Gemma 3's five sliding layers per full one become six groups); mini-vLLM
    refuses them with a ValueError that says so.
    """
    check_block_size(block_size)
    full = tuple(i for i, window in enumerate(layer_windows) if window is None)
    sliding = tuple(i for i, window in enumerate(layer_windows) if window is not None)
    windows = {layer_windows[i] for i in sliding}
    if len(windows) > 1:
        raise ValueError(f"every sliding-window layer must use the same window, got {sorted(windows)}")
    groups = []
    if full:
        groups.append(KVCacheGroupSpec(full, FullAttentionSpec(block_size)))
    if sliding:
        (window,) = windows
        check_positive_int("sliding_window", window)
        groups.append(KVCacheGroupSpec(sliding, SlidingWindowSpec(block_size, window)))
    if full and sliding and len(full) != len(sliding):
        raise ValueError(
            f"this model has {len(full)} full-attention and {len(sliding)} sliding-window layers; "
            "mini-vLLM needs as many of each (one block holds one group's layers). vLLM splits them "
            "into groups of equal size instead."
        )
    return KVCacheConfig(num_blocks, tuple(groups))
