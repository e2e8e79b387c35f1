"""The model runner: from a scheduled batch to logits (chapters 03, 07, 08).

It owns the model's weights and the physical KV cache: per layer a K and a V
tensor of shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` (in a
hybrid model the KV-cache groups share them: see ``ModelRunner``). Each
step it turns the scheduler's decisions into tensors — the flat token ids and
positions, each token's cache slot (``slot_mapping``), each sequence's block
table and length — runs the model once over the whole batch, and returns the
logits of every sequence whose last token was computed.

It knows nothing of hashes or ref counts: block ids are just addresses here.

vLLM equivalent: ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner``,
``_prepare_inputs``) and ``vllm/v1/worker/block_table.py`` (slot mapping).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .attention import AttentionBackend, AttentionMetadata
from .config import DEFAULT_BLOCK_SIZE
from .kv_cache_interface import KVCacheConfig, SlidingWindowSpec, make_kv_cache_config
from .model import CausalLM
from .model_config import ModelConfig
from .scheduler import SchedulerOutput

if TYPE_CHECKING:
    from .kv_offload.connector import OffloadingConnector

logger = logging.getLogger("mini_vllm")


def kv_cache_layers_per_block(config: ModelConfig, disable_hybrid_kv_cache_manager: bool = False) -> int:
    """How many layers' K/V one block holds: every layer, or in a hybrid model one KV-cache group's layers.

    A block belongs to one group at a time, so a hybrid model's groups share
    the KV tensors: 2 full-attention + 2 sliding-window layers need blocks of
    2 layers, half of what 4 full-attention layers need; Gemma 3's 5:1 layout
    a sixth (chapter 08b). The groups are vLLM 0.33's (``group_layers``); with
    ``disable_hybrid_kv_cache_manager`` a hybrid model is one group of every layer.
    """
    windows = config.layer_sliding_windows
    return make_kv_cache_config(windows, DEFAULT_BLOCK_SIZE, 1, disable_hybrid_kv_cache_manager).num_layers_per_block


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, disable_hybrid_kv_cache_manager: bool = False
) -> int:
    """K and V of the layers one block holds: ``2 * layers * block_size * kv_heads * head_dim * bytes``."""
    element_size = torch.empty((), dtype=dtype).element_size()
    layers = kv_cache_layers_per_block(config, disable_hybrid_kv_cache_manager)
    return 2 * layers * block_size * config.num_kv_heads * config.head_dim * element_size


def compute_slot_mapping(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of token positions ``start..end-1`` of one sequence.

    Position ``p`` lives in logical block ``p // block_size``, which the block
    table maps to physical block ``block_ids[p // block_size]``; inside it, at
    offset ``p % block_size``. The slot is the row of that token once the
    cache's first two dimensions are flattened.
    """
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


class ModelRunner:
    """Owns the model and the KV cache tensors; runs one batch per call.

    ``slot_mapping`` is the slot-mapping extension point
    (``mini_vllm/engine_parts.py``): a function with this module's
    ``compute_slot_mapping``'s signature, kept as ``self.compute_slot_mapping``,
    which ``prepare_inputs`` calls once per scheduled sequence (default: this
    module's ``compute_slot_mapping``, looked up when the runner is built).

    ``kv_cache_config`` (default: one full-attention group of every layer):
    with several KV-cache groups (a hybrid model, chapter 08b) the ``j``-th
    layer of every group uses KV tensor ``j`` (a block belongs to one group
    at a time, so they never collide), and each step builds one
    ``AttentionMetadata`` per group: its block tables, its slot mapping and,
    for a sliding-window group, its window.
    """

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        slot_mapping: Callable[[list[int], int, int, int], list[int]] | None = None,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        self.model = model
        self.compute_slot_mapping = compute_slot_mapping if slot_mapping is None else slot_mapping
        if self.attn_backend.cpu_fast_path:  # the ``cpu`` backend: the model's layers in C and oneDNN too
            from .cpu_fast_path import install_cpu_fast_path  # (imports the C kernels: only when asked)

            install_cpu_fast_path(model)
        self.config = model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        if kv_cache_config is None:
            kv_cache_config = make_kv_cache_config([None] * self.config.num_layers, block_size, num_blocks)
        self.kv_cache_config = kv_cache_config
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        # Zeros, not empty: unused slots are masked anyway, but zeros keep any
        # accidental read finite and make the widgets' K statistics meaningful.
        tensors = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(kv_cache_config.num_layers_per_block)
        ]
        # Layer l of a group's layers uses tensor index_in_group(l); layer_group[l]: its group.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [tensors[0]] * self.config.num_layers
        self.layer_group = [0] * self.config.num_layers
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            for index, layer in enumerate(group.layer_ids or range(self.config.num_layers)):
                self.kv_caches[layer] = tensors[index]
                self.layer_group[layer] = group_id
        # Each layer attends over its own window, whatever its group caches: with the hybrid
        # manager off, a sliding-window layer sits in the full-attention group (vLLM: "the
        # compute of layers like sliding window is still saved").
        self.layer_attention = list(zip(self.layer_group, self.config.layer_sliding_windows))
        group_windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in kv_cache_config.kv_cache_groups]
        self.one_metadata = len(group_windows) == 1 and all(
            window == group_windows[0] for _, window in self.layer_attention
        )
        # A KV-cache offloading tier (``mini_vllm/kv_offload/connector.py``) that loads into these tensors
        # before a forward pass and stores from them after it; set by the engine, None without a tier.
        self.kv_connector: OffloadingConnector | None = None

    @property
    def attn_backend(self) -> AttentionBackend:
        return self.model.model.layers[0].self_attn.attn_backend

    def prepare_inputs(self, scheduler_output: SchedulerOutput):
        """Flatten the batch: token ids, positions, attention metadata and logits rows.

        The metadata is one ``AttentionMetadata``, or in a hybrid model a list
        with each layer's group's (``CausalLM.forward`` takes either).
        """
        groups = self.kv_cache_config.kv_cache_groups
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[list[int]] = [[] for _ in groups]  # per group
        block_tables: list[list[list[int]]] = [[] for _ in groups]  # per group, per sequence
        seq_lens: list[int] = []
        cu_seqlens_q: list[int] = [0]
        for scheduled in scheduler_output.scheduled:
            start = scheduled.num_computed_tokens
            end = start + scheduled.num_new_tokens
            input_ids.extend(scheduled.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            for group_id, block_ids in enumerate(scheduled.block_ids):
                slot_mapping[group_id].extend(self.compute_slot_mapping(block_ids, start, end, self.block_size))
                block_tables[group_id].append(block_ids)
            seq_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + scheduled.num_new_tokens)

        def as_tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        def padded(tables: list[list[int]], has_nulls: bool) -> list[list[int]]:
            # Past a table's end, and where a sliding-window table holds the null block (-1),
            # the placeholder 0: never read (masked by seq_lens and by the window).
            if has_nulls:
                tables = [[max(block_id, 0) for block_id in table] for table in tables]
            max_blocks = max(len(table) for table in tables)
            return [table + [0] * (max_blocks - len(table)) for table in tables]

        shared = dict(
            seq_lens=as_tensor(seq_lens, torch.int32),
            cu_seqlens_q=as_tensor(cu_seqlens_q, torch.int32),
            max_query_len=max(s.num_new_tokens for s in scheduler_output.scheduled),
            max_seq_len=max(seq_lens),
        )
        by_group = []
        for group_id, group in enumerate(groups):
            window = group.kv_cache_spec.sliding_window if isinstance(group.kv_cache_spec, SlidingWindowSpec) else None
            by_group.append(
                AttentionMetadata(
                    slot_mapping=as_tensor(slot_mapping[group_id], torch.int64),
                    block_tables=as_tensor(padded(block_tables[group_id], window is not None), torch.int32),
                    sliding_window=window,
                    **shared,
                )
            )
        metadata = by_group[0] if self.one_metadata else self.metadata_per_layer(by_group)
        # The logits we need: the last new token of each sequence.
        logits_indices = as_tensor([end - 1 for end in cu_seqlens_q[1:]], torch.int64)
        return as_tensor(input_ids, torch.int64), as_tensor(positions, torch.int64), metadata, logits_indices

    def metadata_per_layer(self, by_group: list[AttentionMetadata]) -> list[AttentionMetadata]:
        """Each layer's metadata: its group's tables, with the layer's own sliding window."""
        variants: dict[tuple[int, int | None], AttentionMetadata] = {}
        for group_id, window in self.layer_attention:
            if (group_id, window) not in variants:
                metadata = by_group[group_id]
                if metadata.sliding_window != window:
                    metadata = dataclasses.replace(metadata, sliding_window=window)
                variants[group_id, window] = metadata
        return [variants[key] for key in self.layer_attention]

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """Run one step; returns float32 logits ``[num_scheduled_requests, vocab]`` on the CPU."""
        if scheduler_output.is_empty:
            return None
        if self.kv_connector is not None:  # the offloading tier's hits, into their pool blocks
            self.kv_connector.load_kv(scheduler_output)
        input_ids, positions, metadata, logits_indices = self.prepare_inputs(scheduler_output)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        if self.kv_connector is not None:  # the prompt blocks just computed, into the tier
            self.kv_connector.save_kv(scheduler_output)
        return self.model.compute_logits(hidden[logits_indices]).cpu()

    def block_statistic(self, layer: int = 0) -> torch.Tensor:
        """Per physical block, the norm of its K tensor in one layer (for the widgets)."""
        k_cache = self.kv_caches[layer][0]
        return k_cache.float().flatten(1).norm(dim=1).cpu()
