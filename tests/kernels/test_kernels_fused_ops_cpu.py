"""The C element-wise kernels (``mini_vllm.kernels.fused_ops_cpu``) and the model running them.

Each kernel is held to the model's readable definition (``mini_vllm.model.rms_norm``,
``apply_rotary_pos_emb``, ``silu_and_mul``) on shapes the engine meets (the bundled
model's, SmolLM2's) and on odd ones; each comparison is shown to catch a known-wrong
variant. Compiled here with the machine's C compiler (CI has gcc): a missing compiler
fails these tests rather than skipping them.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm import cpu_fast_path as fast
from mini_vllm import model as M
from mini_vllm.attention import TorchAttentionBackend, get_attn_backend
from mini_vllm.kernels import fused_ops_cpu, paged_attention_cpu
from mini_vllm.model import apply_rotary_pos_emb, default_model_path, load_model, rms_norm, silu_and_mul

TOLERANCE = 1e-5  # float32, as for the attention kernels


def randn(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_the_kernels_build_here():
    assert fused_ops_cpu.available(), fused_ops_cpu.unavailable_reason()


# (rows, dim): a decode step, a prefill, SmolLM2's 576, a Qwen3 head (64), odd widths.
NORM_SHAPES = [(5, 576), (300, 576), (1, 64), (7, 100), (3, 4, 128), (2, 1)]


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_is_the_models(shape):
    x, weight = randn(*shape, seed=1, scale=3.0), randn(shape[-1], seed=2)
    assert_close(fused_ops_cpu.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))


def test_rms_norm_of_tiny_rows_pins_eps():
    """Rows so small that eps dominates their mean square: a kernel that drops eps (or adds it
    after the square root) is caught, as the wrong formula is by this comparison."""
    x, weight = randn(4, 64, seed=3, scale=1e-4), randn(64, seed=4)
    expected = rms_norm(x, weight, 1e-6)
    assert_close(fused_ops_cpu.rms_norm(x, weight, 1e-6), expected)
    assert not torch.allclose(rms_norm(x, weight, 0.0), expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_rms_norm_of_a_strided_view_reads_the_view():
    """Qwen3's q_norm gets the query heads of the qkv output: a view whose rows are not contiguous."""
    qk = randn(5, 12, 64, seed=5)
    view, weight = qk[:, :9], randn(64, seed=6)
    assert not view.is_contiguous()
    assert_close(fused_ops_cpu.rms_norm(view, weight, 1e-6), rms_norm(view, weight, 1e-6))


@pytest.mark.parametrize("shape", [(5, 2 * 1536), (300, 2 * 1536), (1, 2), (2, 3, 2 * 37)], ids=str)
def test_silu_and_mul_is_the_models(shape):
    gate_up = randn(*shape, seed=7, scale=4.0)
    extremes = torch.tensor([-100.0, 100.0, -1e30, 0.0])  # exp(-g) overflowing: silu is ~0 or g
    gate_up.view(-1)[: len(extremes)] = extremes[: gate_up.numel()]
    got = fused_ops_cpu.silu_and_mul(gate_up)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(got, silu_and_mul(gate_up))


def test_silu_and_mul_comparison_catches_halves_swapped():
    gate_up = randn(5, 64, seed=8)
    swapped = torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1)
    assert not torch.allclose(fused_ops_cpu.silu_and_mul(gate_up), silu_and_mul(swapped))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 2, 128), (2, 1, 6)])
def test_rotary_embedding_rotates_the_query_and_key_heads_where_they_lie(num_heads, num_kv_heads, head_dim):
    """As the model calls it: on the query and key heads inside the fused qkv projection's
    output, in place, leaving the value heads alone."""
    n = 5
    qkv = randn(n, (num_heads + 2 * num_kv_heads) * head_dim, seed=9)
    positions = torch.tensor([0, 1, 17, 300, 4095])
    cos, sin = M.RotaryEmbedding(head_dim, 10000.0)(positions, torch.float32)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(n, num_heads + num_kv_heads, head_dim)
    expected = apply_rotary_pos_emb(qk, cos, sin)
    values = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()

    got = fused_ops_cpu.rotary_embedding_(qk, cos, sin)

    assert got.data_ptr() == qk.data_ptr()
    assert_close(got, expected)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], values)


def test_rotary_comparison_catches_the_interleaved_layout():
    """GPT-J's layout pairs (2i, 2i + 1), not (i, i + D/2): the comparison tells them apart."""
    x = randn(3, 2, 8, seed=10)
    cos, sin = M.RotaryEmbedding(8, 10000.0)(torch.tensor([1, 5, 9]), torch.float32)
    pairs = x.view(3, 2, 4, 2)
    interleaved = torch.stack(
        (
            pairs[..., 0] * cos[..., :4] - pairs[..., 1] * sin[..., :4],
            pairs[..., 1] * cos[..., :4] + pairs[..., 0] * sin[..., :4],
        ),
        dim=-1,
    ).view(3, 2, 8)
    assert not torch.allclose(fused_ops_cpu.rotary_embedding_(x.clone(), cos, sin), interleaved)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: fused_ops_cpu.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-6),
            "x is torch.float64",
        ),
        (lambda: fused_ops_cpu.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6), r"weight has shape \(5,\)"),
        (lambda: fused_ops_cpu.rms_norm([1.0], torch.ones(1), 1e-6), "x must be a tensor"),
        (lambda: fused_ops_cpu.silu_and_mul(torch.ones(2, 5)), r"last dimension \(5\) must hold gate and up"),
        (lambda: fused_ops_cpu.rotary_embedding_(torch.ones(2, 8), torch.ones(2, 8), torch.ones(2, 8)), "x must be"),
        (
            lambda: fused_ops_cpu.rotary_embedding_(
                torch.ones(2, 8, 3).transpose(1, 2), torch.ones(2, 8), torch.ones(2, 8)
            ),
            "heads must be contiguous",
        ),
        (
            lambda: fused_ops_cpu.rotary_embedding_(torch.ones(2, 1, 8), torch.ones(3, 8), torch.ones(3, 8)),
            "cos and sin",
        ),
    ],
    ids=["dtype", "weight-shape", "not-a-tensor", "odd-width", "not-3d", "strided-heads", "angles"],
)
def test_bad_input_is_a_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def clear_build_caches():
    """Both C files build or load anew on their next use (under the environment then)."""
    fused_ops_cpu._load.cache_clear()
    paged_attention_cpu._load.cache_clear()


def test_silu_and_mul_of_gates_past_exps_range_is_zero_as_torchs():
    """exp(-g) overflows float32 below g = -88: PyTorch's formula gives 0 there; -ffast-math
    assumes no infinity, so the kernel must not compute it."""
    gate_up = torch.tensor([[-3e38, -1e30, -100.0, -89.0, 1.0, 1e10, 1e30, 2.0]])
    torch.testing.assert_close(fused_ops_cpu.silu_and_mul(gate_up), silu_and_mul(gate_up))


def test_what_the_c_code_cannot_read_is_refused():
    """Raw pointers need dense tensors with their data in memory, and no autograd."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # data_ptr() is 0: the C code would write through a null pointer
        fake = torch.randn(2, 4)
        with pytest.raises(ValueError, match="x must be a plain dense tensor"):
            fused_ops_cpu.rms_norm(fake, torch.ones(4), 1e-6)
        with pytest.raises(ValueError, match="paged_attention_cpu: query must be a plain dense tensor"):
            paged_attention_cpu.paged_attention_cpu(
                torch.randn(1, 2, 8),
                torch.randn(2, 4, 1, 8),
                torch.randn(2, 4, 1, 8),
                torch.zeros(1, 1, dtype=torch.int32),
                torch.ones(1, dtype=torch.int32),
            )
    with pytest.raises(ValueError, match="gate_up must be a plain dense tensor"):
        fused_ops_cpu.silu_and_mul(torch.ones(2, 4).to_sparse())
    weight = torch.ones(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="linear is for inference .* weight requires grad"):
        fused_ops_cpu.linear(torch.ones(1, 4), weight)
    with torch.no_grad():
        fused_ops_cpu.linear(torch.ones(1, 4), weight)


@pytest.mark.parametrize("eps", [None, "1e-6", float("nan"), float("inf"), -1.0, True])
def test_rms_norm_names_a_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        fused_ops_cpu.rms_norm(torch.ones(2, 4), torch.ones(4), eps)


def test_rotary_refuses_tokens_that_overlap_and_angles_of_the_wrong_shape():
    x = torch.randn(1, 2, 4).expand(3, 2, 4)  # three tokens on one row of memory
    cos, sin = torch.ones(3, 1, 4), torch.zeros(3, 1, 4)
    with pytest.raises(ValueError, match="tokens overlap in memory"):
        fused_ops_cpu.rotary_embedding_(x, cos, sin)
    with pytest.raises(ValueError, match=r"cos and sin must be \[3, 1, 4\] or \[3, 4\], got \(4, 3\)"):
        fused_ops_cpu.rotary_embedding_(torch.randn(3, 2, 4), cos.reshape(3, 4).t(), sin.reshape(3, 4).t())
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        fused_ops_cpu.rms_norm(torch.tensor(3.0), torch.ones(0), 1e-6)


def test_without_a_compiler_the_cpu_backend_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MINI_VLLM_CACHE_DIR", str(tmp_path))
    clear_build_caches()
    try:
        assert not fused_ops_cpu.available()
        assert "no-such-compiler" in fused_ops_cpu.unavailable_reason()
        with pytest.raises(ValueError, match="attention_backend='cpu' needs its C kernels.*no-such-compiler"):
            get_attn_backend("cpu")
        with pytest.raises(RuntimeError, match="the C element-wise kernels are unavailable"):
            fused_ops_cpu.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6)
        from mini_vllm.tools.bench import fastest_attention_backend

        assert fastest_attention_backend("cpu") == "auto"  # make bench asks the factory, which refuses
        model = load_model(default_model_path(), attn_backend=TorchAttentionBackend())
        assert fast.install_cpu_fast_path(model) is False  # nothing changes: the readable path runs
        assert not any(type(m) in fast.CPU_LAYERS.values() for m in model.modules())
    finally:
        monkeypatch.undo()
        clear_build_caches()
    assert fused_ops_cpu.available()


def test_the_bundled_model_with_fused_ops_gives_the_readable_paths_hidden_states():
    """The bundled model is a Qwen3 (q_norm and k_norm on strided views): one packed forward
    of two sequences, with and without the C kernels, on the same weights."""
    from test_model import PagedCache

    model = load_model(default_model_path(), attn_backend=TorchAttentionBackend())
    cache = PagedCache(model.config)
    input_ids, positions, metadata = cache.step([("a", list(range(5, 45))), ("b", list(range(100, 107)))])
    rows = torch.tensor([0, 39, 46])  # three rows: the logits take the C projection loop
    with torch.no_grad():
        expected = model(input_ids, positions, cache.kv_caches, metadata)
        expected_logits = model.compute_logits(expected[rows])
        assert fast.install_cpu_fast_path(model) is True
        got = model(input_ids, positions, cache.kv_caches, metadata)
        got_logits = model.compute_logits(got[rows])
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    # Every plain layer became its CPU version, keeping its weights (the output projection stays tied).
    layer_classes = {
        type(m) for m in model.modules() if isinstance(m, (M.RMSNorm, M.MLP, M.Attention, torch.nn.Linear))
    }
    assert layer_classes == set(fast.CPU_LAYERS.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.packed_weight is not None
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_fused_ops_are_for_float32_on_the_cpu():
    model = load_model(default_model_path(), dtype=torch.bfloat16, attn_backend=TorchAttentionBackend())
    assert fast.install_cpu_fast_path(model) is False
    assert not any(type(m) in fast.CPU_LAYERS.values() for m in model.modules())


@pytest.mark.parametrize("backend, fused", [("cpu", True), ("torch", False)])
def test_only_the_cpu_backend_turns_them_on(backend, fused):
    from mini_vllm import LLM

    llm = LLM(dtype="float32", num_blocks=16, attention_backend=backend)
    model = llm.llm_engine.model_runner.model
    assert isinstance(model.model.norm, fast.CpuRMSNorm) is fused
    assert isinstance(model.lm_head, fast.CpuLinear) is fused  # the torch backend: plain layers


@pytest.mark.parametrize("rows, in_features, out_features", [(1, 576, 960), (3, 1536, 576), (2, 7, 5), (9, 64, 33)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_is_torchs(rows, in_features, out_features, bias):
    x, weight = randn(rows, in_features, seed=11), randn(out_features, in_features, seed=12)
    b = randn(out_features, seed=13) if bias else None
    torch.testing.assert_close(
        fused_ops_cpu.linear(x, weight, b), torch.nn.functional.linear(x, weight, b), rtol=1e-4, atol=1e-4
    )


def test_linear_comparison_catches_a_transposed_weight():
    x, weight = randn(2, 16, seed=14), randn(16, 16, seed=15)
    assert not torch.allclose(fused_ops_cpu.linear(x, weight), torch.nn.functional.linear(x, weight.t()), atol=1e-3)


def test_linear_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x \(2, 5\) and weight \(3, 4\)"):
        fused_ops_cpu.linear(torch.ones(2, 5), torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"bias has shape \(4,\), expected \(3,\)"):
        fused_ops_cpu.linear(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4))


@pytest.mark.parametrize("rows", [1, 3, 4, 6])
def test_a_projection_takes_the_c_loop_below_packed_min_rows_only(rows, monkeypatch):
    """Below PACKED_MIN_ROWS rows the C loop; from there on the packed oneDNN copy (or the plain multiply)."""
    layer = fast.CpuLinear(16, 8, bias=True)
    layer.pack_for_cpu()
    calls, c_loop = [], fused_ops_cpu.linear
    monkeypatch.setattr(fused_ops_cpu, "linear", lambda *args: calls.append(args) or c_loop(*args))
    x = randn(rows, 16, seed=16)
    with torch.no_grad():  # the C loop is for inference
        got = layer(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
    assert len(calls) == (1 if rows < fast.PACKED_MIN_ROWS else 0)
