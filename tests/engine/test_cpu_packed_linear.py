"""CpuLinear's oneDNN-packed weight copy (the CPU fast path, mini_vllm/cpu_fast_path.py) computes
what nn.Linear does, and is never used once the weight it was made from has changed."""

from __future__ import annotations

import pytest
import torch

from mini_vllm.cpu_fast_path import PACKED_MIN_ROWS, CpuLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")


def make_linear(bias: bool = True) -> CpuLinear:
    torch.manual_seed(0)
    layer = CpuLinear(48, 24, bias=bias)
    layer.requires_grad_(False)
    return layer


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_packed_equals_plain(bias, rows):
    layer = make_linear(bias)
    x = torch.randn(rows, 48)
    plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert layer.pack_for_cpu()
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)


def test_a_changed_weight_is_not_served_from_a_stale_packed_copy():
    layer = make_linear()
    x = torch.randn(4, 48)
    assert layer.pack_for_cpu()
    stale = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")
    layer.weight.mul_(2)  # in place: the version counter moves
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    # The known-wrong variant: the stale copy really differs, so the check above can fail.
    assert not torch.allclose(stale, layer(x))
    layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight), requires_grad=False)  # replaced
    torch.testing.assert_close(layer(x), layer.bias.expand(4, 24))


def test_not_packed_off_float32():
    layer = make_linear().to(torch.bfloat16)
    assert not layer.pack_for_cpu() and layer.packed_weight is None


def test_few_rows_take_the_c_loop_and_more_the_packed_copy():
    """Below ``PACKED_MIN_ROWS`` rows (a decode step of a few sequences) the C loop runs on the weight;
    from there on the packed copy. Proved by packing a zero weight: only the packed path gives zeros."""
    layer = make_linear(bias=False)
    assert layer.pack_for_cpu()
    layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(layer.weight), None)
    for rows in (1, PACKED_MIN_ROWS - 1):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert layer(torch.randn(PACKED_MIN_ROWS, 48)).abs().max() == 0
