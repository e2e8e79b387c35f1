"""The model runner: from a scheduled batch to logits (chapters 03, 07, 08).

It owns the model's weights and the physical KV cache: per layer a K and a V
tensor of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``. Each
step it turns the scheduler's decisions into tensors — the flat token ids and
positions, each token's cache slot (``slot_mapping``), each sequence's block
table and length — runs the model once over the whole batch, and returns the
logits of every sequence whose last token was computed.

It knows nothing of hashes or ref counts: block ids are just addresses here.

vLLM equivalent: ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner``,
``_prepare_inputs``) and ``vllm/v1/worker/block_table.py`` (slot mapping).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .attention import AttentionBackend, AttentionMetadata
from .model import CausalLM, ModelConfig
from .scheduler import SchedulerOutput

logger = logging.getLogger("mini_vllm")


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer: ``2 * layers * block_size * kv_heads * head_dim * bytes``."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


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
    ) -> None:
        self.model = model
        self.compute_slot_mapping = compute_slot_mapping if slot_mapping is None else slot_mapping
        # On a CPU in float32: the projections run from oneDNN-packed weight copies
        # (model.Linear; ~1.5-2.5x faster matrix multiplies, a second copy of the weights).
        if device.type == "cpu" and dtype == torch.float32:
            model.pack_linear_weights_for_cpu()
        self.config = model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        # Zeros, not empty: unused slots are masked anyway, but zeros keep any
        # accidental read finite and make the widgets' K statistics meaningful.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.config.num_layers)
        ]

    @property
    def attn_backend(self) -> AttentionBackend:
        return self.model.model.layers[0].self_attn.attn_backend

    def set_attn_backend(self, backend: AttentionBackend) -> AttentionBackend:
        """Make every attention layer use ``backend`` (they share one); returns the backend it replaces.

        For a backend built after the engine (chapter 07 plugs one into a
        running ``LLM``); ``EngineParts.store_kv`` / ``paged_decode`` choose
        the backend when the engine is built.
        """
        previous = self.attn_backend
        for layer in self.model.model.layers:
            layer.self_attn.attn_backend = backend
        return previous

    def prepare_inputs(self, scheduler_output: SchedulerOutput):
        """Flatten the batch: token ids, positions, attention metadata and logits rows."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        cu_seqlens_q: list[int] = [0]
        block_tables: list[list[int]] = []
        for scheduled in scheduler_output.scheduled:
            start = scheduled.num_computed_tokens
            end = start + scheduled.num_new_tokens
            input_ids.extend(scheduled.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self.compute_slot_mapping(scheduled.block_ids, start, end, self.block_size))
            seq_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + scheduled.num_new_tokens)
            block_tables.append(scheduled.block_ids)
        max_blocks = max(len(table) for table in block_tables)
        padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]

        def as_tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        metadata = AttentionMetadata(
            slot_mapping=as_tensor(slot_mapping, torch.int64),
            block_tables=as_tensor(padded, torch.int32),
            seq_lens=as_tensor(seq_lens, torch.int32),
            cu_seqlens_q=as_tensor(cu_seqlens_q, torch.int32),
            max_query_len=max(s.num_new_tokens for s in scheduler_output.scheduled),
            max_seq_len=max(seq_lens),
        )
        # The logits we need: the last new token of each sequence.
        logits_indices = as_tensor([end - 1 for end in cu_seqlens_q[1:]], torch.int64)
        return as_tensor(input_ids, torch.int64), as_tensor(positions, torch.int64), metadata, logits_indices

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """Run one step; returns float32 logits ``[num_scheduled_requests, vocab]`` on the CPU."""
        if scheduler_output.is_empty:
            return None
        input_ids, positions, metadata, logits_indices = self.prepare_inputs(scheduler_output)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden[logits_indices]).cpu()

    def block_statistic(self, layer: int = 0) -> torch.Tensor:
        """Per physical block, the norm of its K tensor in one layer (for the widgets)."""
        k_cache = self.kv_caches[layer][0]
        return k_cache.float().flatten(1).norm(dim=1).cpu()
