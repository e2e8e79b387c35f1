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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mini_vllm.attention import AttentionBackend, AttentionMetadata, get_attn_backend
from mini_vllm.registry import Registry


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


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


@dataclass
class ModelConfig:
    """The numbers the model needs, parsed from a Hugging Face ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    qkv_bias: bool  # biases on q_proj, k_proj, v_proj (Qwen2; Llama's attention_bias)
    qk_norm: bool  # per-head RMSNorm of queries and keys (Qwen3)
    torch_dtype: str  # the dtype the checkpoint was saved in, e.g. "bfloat16"
    o_bias: bool = False  # a bias on o_proj too (Llama/Qwen3 ``attention_bias``)
    mlp_bias: bool = False  # biases in the MLP (Llama ``mlp_bias``)
    rope_scaling: dict | None = None  # None: plain RoPE; else "linear" or "llama3" parameters
    # Hybrid models (chapter 08b): each layer's kind, "full_attention" or "sliding_attention"
    # (empty: all full), and the sliding layers' window in tokens (None: no sliding layer).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Per layer, its sliding window (None for a full-attention layer)."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return [self.sliding_window if kind == "sliding_attention" else None for kind in types]

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """Parse a ``config.json`` dict; ValueError for what this model does not implement."""
        family = model_family(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu' (SwiGLU)")
        layer_types, sliding_window = _parse_layer_types(cfg)
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(cfg)
        return cls(
            architecture=family.architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            # GQA: absent means one KV head per query head (plain multi-head attention)
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            layer_types=layer_types,
            sliding_window=sliding_window,
            **family.fields(cfg),  # what differs by family: qkv_bias, qk_norm, o_bias
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``path/config.json``.

        When ``generation_config.json`` names end-of-sequence tokens, those win:
        it is what ``transformers``' ``generate`` stops on (chat models often
        list their end-of-turn token there, e.g. ``<|im_end|>``).
        """
        path = Path(path)
        if not (path / "config.json").is_file():
            what = "has no config.json" if path.is_dir() else "does not exist"
            raise ValueError(f"model folder {str(path)!r} {what}: give a local Hugging Face model folder")
        config = cls.from_dict(json.loads((path / "config.json").read_text()))
        gen_file = path / "generation_config.json"
        if gen_file.exists():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            if gen_eos is not None:
                config.eos_token_id = gen_eos
        return config


# --------------------------------------------------------------------------- #
# Model families
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ModelFamily:
    """One architecture the engine runs: how to read its config, which module builds it."""

    architecture: str  # config.json's "architectures"[0], e.g. "Qwen3ForCausalLM"
    model_type: str  # config.json's "model_type", e.g. "qwen3" (names the family when "architectures" is absent)
    fields: Callable[[dict], dict]  # config.json -> the ModelConfig fields that differ by family
    model_class: type[nn.Module] | None = None  # what load_model builds; None: CausalLM


MODEL_FAMILIES: Registry[ModelFamily] = Registry("model family")
"""architecture -> its ``ModelFamily``; ``ModelConfig.from_dict`` and ``load_model`` read it."""


def register_model_family(architecture: str, *, model_type: str, model_class: type[nn.Module] | None = None):
    """Decorator: register a function ``fields(cfg) -> dict`` as the family ``architecture``.

    ``fields`` reads the Hugging Face ``config.json`` dict and returns the
    ``ModelConfig`` fields that differ by family (``qkv_bias``, ``qk_norm``,
    ``o_bias``); it refuses with a ValueError what is not implemented. A family
    whose layers differ gives its module as ``model_class`` (default :class:`CausalLM`).
    """

    def decorator(fields: Callable[[dict], dict]) -> Callable[[dict], dict]:
        MODEL_FAMILIES.add(architecture, ModelFamily(architecture, model_type, fields, model_class))
        return fields

    return decorator


def model_family(cfg: dict) -> ModelFamily:
    """The registered family of a ``config.json`` dict (ValueError, listing the supported ones, if none)."""
    architectures = cfg.get("architectures") or []
    # A config that was never saved with a model lacks "architectures";
    # its model_type still names the family.
    by_model_type = {MODEL_FAMILIES[name].model_type: name for name in MODEL_FAMILIES}
    arch = architectures[0] if architectures else by_model_type.get(cfg.get("model_type"))
    if arch not in MODEL_FAMILIES:
        raise ValueError(f"unsupported architecture {arch!r}; mini-vLLM supports " + ", ".join(MODEL_FAMILIES))
    return MODEL_FAMILIES[arch]


@register_model_family("LlamaForCausalLM", model_type="llama")
def llama_fields(cfg: dict) -> dict:
    # transformers writes attention_bias=True to mean q, k, v AND o.
    attention_bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": attention_bias, "qk_norm": False, "o_bias": attention_bias}


@register_model_family("Qwen2ForCausalLM", model_type="qwen2")
def qwen2_fields(cfg: dict) -> dict:
    # Qwen2 always has q/k/v biases and never an o_proj bias.
    return {"qkv_bias": True, "qk_norm": False, "o_bias": False}


@register_model_family("Qwen3ForCausalLM", model_type="qwen3")
def qwen3_fields(cfg: dict) -> dict:
    # Llama's layers plus an RMSNorm on each query and key head; attention_bias as Llama's.
    attention_bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": attention_bias, "qk_norm": True, "o_bias": attention_bias}


# The built-in families, derived from the registry (the code reads MODEL_FAMILIES, which also
# holds families registered later by other modules).
SUPPORTED_ARCHITECTURES = MODEL_FAMILIES.names()


_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


LAYER_TYPES = ("full_attention", "sliding_attention")


def _parse_layer_types(cfg: dict) -> tuple[tuple[str, ...], int | None]:
    """``(layer_types, sliding_window)`` as transformers reads them; ValueError for what is not implemented.

    A layer slides when its ``layer_types`` entry is "sliding_attention" and
    the config has a window. Qwen2/Qwen3 configs turn the window off with
    ``use_sliding_window: false`` (transformers then ignores
    ``sliding_window``) and, without ``layer_types``, make layers from
    ``max_window_layers`` on slide.
    """
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window", True):
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if window is None or "use_sliding_window" not in cfg:
            return (), None
        first_sliding = cfg.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; mini-vLLM implements {list(LAYER_TYPES)}")
    if window is None or "sliding_attention" not in layer_types:
        return (), None
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"sliding_window must be an integer >= 2, got {window!r}")
    return layer_types, window


def _parse_rope(cfg: dict) -> tuple[float, dict | None]:
    """The RoPE base and scaling, from ``rope_parameters`` (transformers >= 5) or legacy keys.

    Implemented: the plain RoPE, ``linear`` scaling and Llama 3.1's ``llama3``
    scaling (Llama 3.x checkpoints use it). Anything else (yarn, dynamic,
    longrope, ...) changes the frequencies in ways not implemented here, and
    silently ignoring it would give wrong logits, so it is rejected.
    """
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; implemented: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not implemented")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, params


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

    kernel = None  # None: rms_norm below; CausalLM.use_fused_cpu_ops sets the C version

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.kernel or rms_norm)(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s formula: ``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


# Below this many rows (a decode step of one to three sequences) the plain multiply, MKL's
# matrix-vector path over the checkpoint layout, streams the weight faster than oneDNN's
# packed copy; from four rows on, the packed copy wins (measured on the course's CPUs:
# benchmarks/README.md, "Where the decode step's time goes").
PACKED_MIN_ROWS = 4


class Linear(nn.Linear):
    """``nn.Linear``, plus an optional copy of its weight laid out for oneDNN (CPU, float32).

    On a CPU, PyTorch's default matrix multiply (MKL's ``sgemm``) re-reads the
    weight in its checkpoint layout at every call. oneDNN can first *reorder*
    the weight once into the blocked layout its kernels stream from, which on
    this course's CPUs makes multiplies of a few rows and more ~1.5-2.5x faster
    (vLLM's CPU backend does the same). :meth:`pack_for_cpu` makes that copy
    (the model runner calls it once, after loading); inputs of fewer than
    ``PACKED_MIN_ROWS`` rows keep the plain multiply, which is faster there (or, with
    the ``cpu`` backend, ``kernel``: a C loop of dot products, :func:`mini_vllm.kernels.fused_ops_cpu.linear`).
    The parameter stays the source of truth: when it is replaced or changed in
    place (its version counter moves), the packed copy is ignored and the plain
    multiply runs.
    """

    packed_weight = None  # the oneDNN copy, or None
    _packed_from = None  # (the weight tensor it was made from, its version then)
    kernel = None  # below PACKED_MIN_ROWS: None, the plain multiply; CausalLM.use_fused_cpu_ops sets the C loop

    def pack_for_cpu(self) -> bool:
        """Make the oneDNN copy of the weight; False (and nothing changes) where oneDNN cannot."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            probe = torch.randn(3, self.in_features)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
        except (RuntimeError, AttributeError):
            return False
        if not torch.allclose(got, nn.functional.linear(probe, weight, self.bias), rtol=1e-4, atol=1e-4):
            return False
        self.packed_weight = packed
        self._packed_from = (weight, weight._version)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] < PACKED_MIN_ROWS:
            return super().forward(x) if self.kernel is None else self.kernel(x, self.weight, self.bias)
        if self.packed_weight is None or x.dim() != 2:
            return super().forward(x)
        source, version = self._packed_from
        packed_is_current = source is self.weight and version == self.weight._version
        if not packed_is_current:
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


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

    rotary_kernel = None  # None: apply_rotary_pos_emb; CausalLM.use_fused_cpu_ops sets the C version (in place)

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
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=config.o_bias)
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
        q, k = (self.rotary_kernel or apply_rotary_pos_emb)(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        # The backend writes k and v into this step's cache slots, then each
        # sequence's queries attend over its whole context in the cache --
        # the cached prefix and the tokens just written.
        out = self.attn_backend.forward(q, k, v, k_cache, v_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    kernel = None  # None: silu_and_mul below; CausalLM.use_fused_cpu_ops sets the C version

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        # gate_proj and up_proj stacked (rows in that order): one multiply reads the input once.
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=config.mlp_bias)
        self.down_proj = Linear(inter, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj((self.kernel or silu_and_mul)(self.gate_up_proj(x)))


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
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
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

    def pack_linear_weights_for_cpu(self) -> int:
        """Give every projection its oneDNN weight copy (see :class:`Linear`); returns how many.

        Costs a second copy of the weights in memory; a no-op (0) off the CPU,
        for other dtypes, or where this PyTorch has no oneDNN.
        """
        return sum(module.pack_for_cpu() for module in self.modules() if isinstance(module, Linear))

    def use_fused_cpu_ops(self) -> bool:
        """Run RMSNorm, RoPE and SwiGLU's gate as fused C kernels (:mod:`mini_vllm.kernels.fused_ops_cpu`),
        and projections of fewer than ``PACKED_MIN_ROWS`` rows as its plain C loop.

        The same numbers up to float rounding, in one pass each instead of several
        PyTorch calls: what vLLM's CPU backend does, and what the ``cpu`` attention
        backend asks for. Returns False (and nothing changes) off the CPU, for other
        dtypes, or where the C file cannot be built.
        """
        weight = self.model.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return False
        from mini_vllm.kernels import fused_ops_cpu

        if not fused_ops_cpu.available():
            return False
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = fused_ops_cpu.rms_norm
            elif isinstance(module, MLP):
                module.kernel = fused_ops_cpu.silu_and_mul
            elif isinstance(module, Attention):
                module.rotary_kernel = fused_ops_cpu.rotary_embedding_
            elif isinstance(module, Linear):
                module.kernel = fused_ops_cpu.linear
        return True

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
    "Linear",
    "STACKED_PARAMS",
    "stack_checkpoint",
    "rope_inv_freq",
    "load_model",
    "default_model_path",
]
