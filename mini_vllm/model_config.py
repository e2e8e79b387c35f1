"""The model's configuration and the families the engine runs (chapters 01, 08b).

``ModelConfig`` holds the numbers the model needs, parsed from a Hugging Face
``config.json`` (``ModelConfig.from_pretrained``); what a config asks for and
this engine does not implement (another activation, a RoPE scaling other than
``linear`` and ``llama3``, partial rotary embeddings, unknown layer types) is a
ValueError here, before any weight is read. ``MODEL_FAMILIES`` is the registry
of architectures (Llama, Qwen2, Qwen3): a family is one decorated function that
reads the config fields that differ by family (``register_model_family``).

vLLM equivalent: ``vllm/config/model.py`` (``ModelConfig``) and
``vllm/model_executor/models/registry.py`` (``ModelRegistry``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mini_vllm.registry import Registry

if TYPE_CHECKING:
    from torch import nn


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
