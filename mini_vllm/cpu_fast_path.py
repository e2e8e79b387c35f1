"""The CPU's fast path, in one place: what the ``cpu`` attention backend installs on a loaded model (chapter 07).

The model's layers (``model.py``) are plain PyTorch: the readable path that
every chapter shows and that the ``torch`` and ``triton`` backends run.
:func:`install_cpu_fast_path` turns each of them into its CPU version, a
subclass with the same weights and the same numbers (up to float rounding)
in fewer, faster calls:

==============  ==============  ==================================================
layer           becomes         its forward
==============  ==============  ==================================================
``nn.Linear``   ``CpuLinear``   below ``PACKED_MIN_ROWS`` rows, a C loop of dot
                                products (:func:`mini_vllm.kernels.fused_ops_cpu.linear`);
                                from there on, a copy of the weight packed for
                                oneDNN (~1.5-2.5x faster multiplies)
``RMSNorm``     ``CpuRMSNorm``  one fused C kernel
``MLP``         ``CpuMLP``      SwiGLU's gate as one fused C kernel
``Attention``   ``CpuAttention``  RoPE as one fused C kernel, in place
==============  ==============  ==================================================

The ``cpu`` backend asks for it (``AttentionBackend.cpu_fast_path``), and the
model runner installs it once, on the loaded model; on another device or
dtype, or without the C kernels, it changes nothing and returns False.

vLLM equivalent: its CPU backend's C++ ops (``csrc/cpu/``: ``rms_norm``,
``silu_and_mul``, ``rotary_embedding``) and the oneDNN weight packing of
``vllm/model_executor/layers/utils.py`` (``dispatch_cpu_unquantized_gemm``),
done in ``process_weights_after_loading``.
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels import fused_ops_cpu
from .model import MLP, Attention, RMSNorm

# Below this many rows (a decode step of one to three sequences) the C loop, which streams the
# weight in its checkpoint layout, beats oneDNN's packed copy; from four rows on, the packed copy
# wins (measured on the course's CPUs: benchmarks/README.md, "Where the decode step's time goes").
PACKED_MIN_ROWS = 4


class CpuLinear(nn.Linear):
    """``nn.Linear`` with a C loop for a few rows and a oneDNN-packed weight copy for more.

    PyTorch's default multiply (MKL's ``sgemm``) re-reads the weight in its
    checkpoint layout at every call; oneDNN can first *reorder* it once into
    the blocked layout its kernels stream from (vLLM's CPU backend does the
    same). :meth:`pack_for_cpu` makes that copy. The parameter stays the
    source of truth: when it is replaced or changed in place (its version
    counter moves), the packed copy is ignored and the plain multiply runs.
    """

    packed_weight = None  # the oneDNN copy, or None
    _packed_from = None  # (the weight tensor it was made from, its version then)

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
            return fused_ops_cpu.linear(x, self.weight, self.bias)
        if self.packed_weight is None or x.dim() != 2:
            return super().forward(x)
        source, version = self._packed_from
        if source is not self.weight or version != self.weight._version:  # the packed copy is stale
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class CpuRMSNorm(RMSNorm):
    """:class:`~mini_vllm.model.RMSNorm` as one C kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops_cpu.rms_norm(x, self.weight, self.eps)


class CpuMLP(MLP):
    """:class:`~mini_vllm.model.MLP` with SwiGLU's gate as one C kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops_cpu.silu_and_mul(self.gate_up_proj(x)))


class CpuAttention(Attention):
    """:class:`~mini_vllm.model.Attention` with RoPE as one C kernel (in place)."""

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return fused_ops_cpu.rotary_embedding_(qk, cos, sin)


# Each plain layer, and the CPU version it becomes.
CPU_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: CpuLinear,
    RMSNorm: CpuRMSNorm,
    MLP: CpuMLP,
    Attention: CpuAttention,
}


def install_cpu_fast_path(model: nn.Module) -> bool:
    """Turn every layer of ``model`` into its CPU version (``CPU_LAYERS``) and pack the projections' weights.

    Each layer keeps its parameters (a tied output projection stays tied):
    only its class changes, to the subclass whose forward calls the C
    kernels. Returns False, and changes nothing, off the CPU, for a dtype
    other than float32, or where the C file cannot be built.
    """
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not fused_ops_cpu.available():
        return False
    for module in model.modules():
        module.__class__ = CPU_LAYERS.get(type(module), type(module))
        if isinstance(module, CpuLinear):
            module.pack_for_cpu()
    return True
