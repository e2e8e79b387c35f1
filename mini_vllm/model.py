"""A Llama / Qwen2 / Qwen3 decoder that runs over the paged KV cache (chapters 01, 07, 08).

This is the whole model, in plain PyTorch. It reads the same ``config.json``
and ``*.safetensors`` files as Hugging Face ``transformers`` and computes the
same numbers -- the tests compare the logits -- but its forward pass is shaped
like vLLM's, not like ``transformers``':

* **No batch dimension.** The tokens of all sequences in a step are packed into
  one flat ``[num_tokens]`` tensor; ``positions`` says where each token sits in
  its own sequence, and the :class:`~mini_vllm.attention.AttentionMetadata`
  says which rows belong to which sequence. A prefill of 500 tokens and a
  decode of 1 token ride in the same forward, with no padding.
* **No KV cache inside the model.** Each layer receives its slice of the paged
  cache pool (``k_cache``, ``v_cache``: ``[num_blocks, block_size,
  num_kv_heads, head_dim]``) owned by the model runner. The attention backend
  writes this step's keys and values into their slots, then attends over each
  sequence's blocks through its block table.

Everything else is the standard recipe shared by the three families:

=================  =========================================================
piece              what it is
=================  =========================================================
RMSNorm            scale by ``1 / rms(x)``, then a learned weight (no mean,
                   no bias)
RoPE               rotate each query/key by an angle proportional to its
                   position, so ``q . k`` depends on the *distance* only
GQA                fewer key/value heads than query heads: each KV head
                   serves a group of query heads (a smaller cache)
SwiGLU MLP         ``down(silu(gate(x)) * up(x))``
Qwen2              adds biases to the q/k/v projections
Qwen3              adds an RMSNorm on each query and key head (``q_norm``,
                   ``k_norm``) before RoPE
tied embeddings    the output projection reuses the input embedding matrix
=================  =========================================================

Module names mirror the checkpoint keys (``model.layers.3.self_attn.o_proj``),
except where vLLM fuses projections that read the same input: ``qkv_proj``
holds ``q_proj``, ``k_proj`` and ``v_proj`` stacked, ``gate_up_proj`` holds
``gate_proj`` and ``up_proj`` (one matrix multiply instead of three or two).
:func:`load_model` stacks the checkpoint's tensors in that order
(:data:`STACKED_PARAMS`, vLLM's ``stacked_params_mapping``), then loading is a
plain ``load_state_dict``.

The file reads top down: the bundled models' paths, the layers, the model,
then loading. The configuration the model is built from, and the families it
knows, are ``model_config.py`` (``ModelConfig``, ``MODEL_FAMILIES``). The
layers stay plain PyTorch on every backend; the CPU's fast path (fused C
kernels, oneDNN-packed projections), which the ``cpu`` backend asks for, is
``cpu_fast_path.py``, in one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from mini_vllm.attention import AttentionBackend, AttentionMetadata, get_attn_backend
from mini_vllm.model_config import (
    MODEL_FAMILIES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelFamily,
    register_model_family,
)


def default_model_path() -> str:
    """Absolute path of the bundled default model (a tiny Qwen3 trained on stories).

    ``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load it too;
    ``training/`` holds the script that made it.
    """
    return str(Path(__file__).resolve().parent / "default_model")


def hybrid_model_path() -> str:
    """Absolute path of the bundled hybrid model: the default model's architecture with
    layers 0 and 2 sliding-window attention (64 tokens) and layers 1 and 3 full attention.

    Its ``config.json`` says so with ``layer_types`` and ``sliding_window``;
    ``transformers`` honours them, and so does vLLM's Transformers backend
    (``model_impl="transformers"``; vLLM's native Qwen3 refuses the config).
    ``training/README.md`` says how it was fine-tuned from the default model.
    """
    return str(Path(__file__).resolve().parent / "hybrid_model")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE's ``head_dim / 2`` angular frequencies ``theta ** (-2i / head_dim)``, maybe rescaled.

    ``linear`` divides every frequency by ``factor`` (positions look ``factor``
    times closer). ``llama3`` divides only the slow frequencies -- wavelengths
    longer than the original context -- keeps the fast ones, and blends in
    between (the formula of ``transformers``' ``_compute_llama3_parameters``).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, blended, scaled)


# --------------------------------------------------------------------------- #
# Building blocks
# --------------------------------------------------------------------------- #


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension.

    Computed in float32 and cast back before the weight multiplies -- the same
    order as ``transformers``, so bfloat16 runs round the same way.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s formula: ``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]``: pairs dimension ``i`` with ``i + head_dim/2``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), the "half-split" layout of Llama and Qwen.

    Dimension pair ``(i, i + d/2)`` of a query or key at position ``p`` is
    rotated by the angle ``p * theta ** (-2i / d)``. After rotating both, the dot
    product ``q . k`` depends only on the distance between their positions --
    which is why a block of K/V computed for one request can be reused by
    another: same tokens at the same positions give the same rotated keys.

    One instance serves every layer (``model.rotary_emb``, as in
    ``transformers``): the angles depend only on the positions, so
    :class:`CausalLM` computes ``cos`` and ``sin`` once per step and every
    layer applies them with :func:`apply_rotary_pos_emb`.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        # A buffer (moves with .to(device)) but not part of the checkpoint.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[n, 1, D]`` of the tokens' positions ``[n]``, in ``dtype``."""
        # The angles are computed in float32 (bfloat16 positions would be too
        # coarse past 256), then cast to the activations' dtype.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [n, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]: same angle for i and i + D/2
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]  # broadcast over heads


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of ``x`` ``[n, heads, D]`` by the angles of :class:`RotaryEmbedding`.

    :class:`Attention` passes its query and key heads together (``[n, Hq + Hkv, D]``):
    both turn by the same angles, so one pass of these few operations rotates both.
    """
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q_proj, k_proj and v_proj stacked (rows in that order): one multiply reads the input once.
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=config.o_bias)
        if config.qk_norm:
            # Qwen3: normalise each head's query and key before RoPE (keeps
            # attention logits in range without a bias).
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.attn_backend = attn_backend

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``rope``: this step's ``(cos, sin)`` from :class:`RotaryEmbedding`."""
        n = hidden.shape[0]
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)  # the query heads, then the key heads
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        q, k = self.rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        # The backend writes k and v into this step's cache slots, then each
        # sequence's queries attend over its whole context in the cache --
        # the cached prefix and the tokens just written.
        out = self.attn_backend.forward(q, k, v, k_cache, v_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the query and key heads together: :func:`apply_rotary_pos_emb`."""
        return apply_rotary_pos_emb(qk, cos, sin)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        # gate_proj and up_proj stacked (rows in that order): one multiply reads the input once.
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate, ``silu(gate) * up``, from ``gate_up_proj``'s output ``[..., gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, rope, k_cache, v_cache, attn_metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, k_cache, v_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    """Embedding, the layers, the final norm (checkpoint prefix ``model.``) and the RoPE angles."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, attn_backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


class CausalLM(nn.Module):
    """The language model: token ids in, final hidden states out; logits on request.

    Owns only weights. The KV cache belongs to the model runner (passed in
    per call, one ``(k_cache, v_cache)`` pair per layer), the batch layout to
    the step's :class:`AttentionMetadata`.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, attn_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings, the output projection *is* the embedding matrix."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Run the new tokens of a packed batch; returns final-normed hidden states.

        input_ids, positions: ``[num_tokens]`` int64 (several sequences back to
        back). kv_caches: per layer ``(k_cache, v_cache)``, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]``; this call writes
        the new tokens' K/V into them. ``attn_metadata``: one for every layer,
        or (a hybrid model, chapter 08b) one per layer: each KV-cache group has
        its own block tables, slot mapping and sliding window. Returns
        ``[num_tokens, hidden_size]``.
        """
        layers = self.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV caches, got {len(kv_caches)}")
        if isinstance(attn_metadata, AttentionMetadata):
            attn_metadata = [attn_metadata] * len(layers)
        elif len(attn_metadata) != len(layers):
            raise ValueError(f"expected one AttentionMetadata or {len(layers)}, got {len(attn_metadata)}")
        hidden = self.model.embed_tokens(input_ids)
        # The RoPE angles depend only on the positions: computed once per step, not once per layer.
        rope = self.model.rotary_emb(positions, hidden.dtype)
        for layer, (k_cache, v_cache), metadata in zip(layers, kv_caches, attn_metadata):
            hidden = layer(hidden, rope, k_cache, v_cache, metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) for the rows of ``hidden`` you need.

        Kept apart from :meth:`forward` because the engine only needs the last
        token of each sequence: projecting 500 prefill rows onto the
        vocabulary just to keep one would waste most of the work.
        """
        return self.lm_head(hidden).float()


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #

# (fused module, the checkpoint's modules stacked into it, in row order): vLLM's stacked_params_mapping.
STACKED_PARAMS = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
)


def stack_checkpoint(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with each layer's q/k/v and gate/up tensors stacked into the fused modules' names.

    ``model.layers.0.self_attn.{q,k,v}_proj.weight`` become the rows of
    ``model.layers.0.self_attn.qkv_proj.weight`` (biases likewise). A group
    with a member missing is left as it is, so the name check reports it.
    """
    stacked = dict(checkpoint)
    for name in checkpoint:
        for fused, parts in STACKED_PARAMS:
            module, found, param = name.rpartition(f".{parts[0]}.")  # "model.layers.0.self_attn", "weight"
            names = [f"{module}.{part}.{param}" for part in parts]
            if found and all(n in checkpoint for n in names):
                stacked[f"{module}.{fused}.{param}"] = torch.cat([stacked.pop(n) for n in names])
    return stacked


def load_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_backend: AttentionBackend | None = None,
) -> CausalLM:
    """Load a Hugging Face folder (``config.json`` + ``*.safetensors``) into a :class:`CausalLM`.

    Every ``*.safetensors`` file in the folder is read, so sharded checkpoints
    (``model-00001-of-00004.safetensors`` ...) work. A tied checkpoint stores
    the embedding once; the output projection then shares it. The model comes
    back in eval mode with gradients off.
    """
    from safetensors.torch import load_file

    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    if attn_backend is None:
        attn_backend = get_attn_backend("auto", str(device))

    # Build on the "meta" device: shapes only, no memory, no random init --
    # the checkpoint overwrites every weight anyway.
    model_class = MODEL_FAMILIES[config.architecture].model_class or CausalLM
    with torch.device("meta"):
        model = model_class(config, attn_backend)

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    checkpoint: dict[str, torch.Tensor] = {}
    for file in files:
        checkpoint.update(load_file(str(file), device="cpu"))
    # Old Llama checkpoints carry RoPE's inv_freq; we compute it ourselves.
    checkpoint = {k: v for k, v in checkpoint.items() if not k.endswith("rotary_emb.inv_freq")}
    checkpoint = stack_checkpoint(checkpoint)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        # Tied: transformers stores the matrix once, as the embedding; a copy
        # under lm_head.weight, if a file has one, is ignored.
        checkpoint.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(checkpoint))
    unexpected = sorted(set(checkpoint) - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {path} does not match {config.architecture}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    state = {k: v.to(device=device, dtype=dtype) for k, v in checkpoint.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    # assign=True adopts the tensors instead of copying into meta storage.
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign replaced the Parameter objects: tie them again
    # Non-checkpoint buffers (RoPE's inv_freq) are still on "meta": rebuild them.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    model.eval()
    model.requires_grad_(False)
    return model


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "MODEL_FAMILIES",
    "ModelFamily",
    "register_model_family",
    "ModelConfig",
    "CausalLM",
    "RMSNorm",
    "rms_norm",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "silu_and_mul",
    "STACKED_PARAMS",
    "stack_checkpoint",
    "rope_inv_freq",
    "load_model",
    "default_model_path",
]
