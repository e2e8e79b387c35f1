"""The C decode-attention kernel (``mini_vllm.kernels.paged_attention_cpu``) and the ``cpu`` backend.

The kernel is held to :func:`mini_vllm.kernels.reference.paged_attention` as the Triton kernel
is (tests/kernels/test_kernels_attention.py): random paged batches with shuffled blocks and
NaN in every slot no sequence owns, so reading one position too many turns the
output into NaN. Its sliding-window cases are in tests/kernels/test_sliding_window_attention.py
beside every other implementation. The kernel is compiled here with the machine's C
compiler (CI has gcc): a missing compiler fails these tests rather than skipping them.
"""

from __future__ import annotations

import shutil
import tempfile
import threading

import pytest
import torch

from engine_invariants import assert_nothing_leaked
from mini_vllm.kernels import fused_ops_cpu
from mini_vllm.kernels import paged_attention_cpu as cpu_kernel
from mini_vllm.kernels import reference
from mini_vllm.kernels.paged_attention_cpu import paged_attention_cpu
from mini_vllm.kernels.testing import make_paged_batch
from mini_vllm import LLM, SamplingParams
from mini_vllm.attention import cpu_backend, get_attn_backend
from mini_vllm.model import hybrid_model_path

TOLERANCE = 1e-5  # float32, as for the Triton kernels

# (num_q_heads, num_kv_heads, head_dim, block_size): GQA groups 1-4; head_dim 64 and 128
# take the kernel's unrolled paths, 80 and 48 its general one.
CASES = [(4, 4, 64, 16), (4, 2, 80, 8), (6, 2, 128, 16), (8, 2, 64, 8), (9, 3, 64, 32), (3, 1, 48, 16)]
SEQ_LENS = [1, 16, 37, 70, 9]  # one token, one full block, partial last blocks, several blocks


def decode_batch(num_q_heads, num_kv_heads, head_dim, block_size, seq_lens=SEQ_LENS, seed=0):
    batch = make_paged_batch(
        seq_lens,
        [1] * len(seq_lens),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        generator=torch.Generator().manual_seed(seed),
    )
    batch.store_new_kv()
    return batch


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not torch.isnan(actual).any(), "the kernel produced NaN: it read a slot it should not read"
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_the_kernel_builds_here():
    assert cpu_kernel.available(), cpu_kernel.unavailable_reason()


@pytest.mark.parametrize("heads_q, heads_kv, head_dim, block_size", CASES)
def test_matches_the_reference(heads_q, heads_kv, head_dim, block_size):
    batch = decode_batch(heads_q, heads_kv, head_dim, block_size, seed=head_dim + heads_q)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)

    assert_close(paged_attention_cpu(*args, 0.3), reference.paged_attention(*args, 0.3))
    # scale left out: head_dim ** -0.5, as the reference
    assert_close(paged_attention_cpu(*args), reference.paged_attention(*args))


def test_a_position_too_many_is_caught_by_the_nan_slots():
    """The comparison above can fail: one position past a sequence's end is a NaN slot."""
    batch = decode_batch(4, 2, 64, 16)
    one_too_many = batch.seq_lens.clone()
    one_too_many[2] += 1  # 37 -> 38: still inside its last block, whose tail is NaN
    out = paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, one_too_many)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3, 4]]).any()


def test_long_contexts_and_large_scores():
    """Softmax subtracts each row's maximum: scores of several hundred do not overflow exp."""
    batch = decode_batch(9, 3, 64, 32, seq_lens=[310, 1000, 64])
    args = (batch.query * 30, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    assert_close(paged_attention_cpu(*args), reference.paged_attention(*args))


def test_an_empty_batch_and_a_window_longer_than_every_sequence():
    batch = decode_batch(4, 2, 64, 16)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    assert_close(paged_attention_cpu(*args, sliding_window=10**30), reference.paged_attention(*args))
    empty = paged_attention_cpu(
        batch.query[:0], batch.k_cache, batch.v_cache, batch.block_tables[:0], batch.seq_lens[:0]
    )
    assert empty.shape == (0, 4, 64)


def test_bad_values_are_value_errors_that_name_them():
    batch = decode_batch(4, 2, 64, 16)
    args = [batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens]
    too_long = batch.seq_lens.clone()
    too_long[1] = batch.block_tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match=r"seq_lens\[1\] is 97: it must be at least 1 and fit in its block_tables"):
        paged_attention_cpu(*args[:4], too_long)
    empty = batch.seq_lens.clone()
    empty[0] = 0
    with pytest.raises(ValueError, match=r"seq_lens\[0\] is 0"):
        paged_attention_cpu(*args[:4], empty)
    outside = batch.block_tables.clone()
    outside[3, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="block_tables row 3 names a block outside the cache's"):
        paged_attention_cpu(*args[:3], outside, batch.seq_lens)
    with pytest.raises(ValueError, match="takes float32 tensors, but query is torch.float16"):
        paged_attention_cpu(batch.query.half(), *args[1:])
    with pytest.raises(ValueError, match="all tensors must be on one device: query is on meta"):
        paged_attention_cpu(batch.query.to("meta"), *args[1:])
    with pytest.raises(ValueError, match="runs on the CPU, but query is on meta"):
        paged_attention_cpu(*[tensor.to("meta") for tensor in args])
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention_cpu(*args[:3], batch.block_tables.long(), batch.seq_lens)
    with pytest.raises(ValueError, match="sliding_window must be None"):
        paged_attention_cpu(*args, sliding_window=0)


def test_many_query_heads_in_a_thread_with_a_small_stack():
    """The kernel's working memory is on the heap: 100 000 query heads in a thread with a 256 KiB
    stack (a per-head array on the stack overflowed it: a segmentation fault)."""
    query = torch.ones(1, 100_000, 1)
    value = torch.full((1, 1, 1, 1), 2.0)
    table, lengths = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    results = []
    previous = threading.stack_size(256 * 1024)
    try:
        thread = threading.Thread(
            target=lambda: results.append(paged_attention_cpu(query, value, value, table, lengths))
        )
        thread.start()
        thread.join()
    finally:
        threading.stack_size(previous)
    assert results and torch.equal(results[0], torch.full((1, 100_000, 1), 2.0))


def test_a_scale_that_is_not_a_number_is_refused():
    batch = decode_batch(4, 2, 64, 16)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    with pytest.raises(ValueError, match="scale must be a number or None, got '0.1'"):
        paged_attention_cpu(*args, "0.1")


def test_loading_the_kernel_leaves_the_float_environment_alone():
    """gcc links -ffast-math shared libraries with crtfastmath.o, which turns on flush-to-zero for
    the whole process when loaded; the build links without it, so tiny floats stay tiny."""
    assert cpu_kernel.available()
    assert (torch.tensor([1e-40]) * 1).item() != 0.0


def test_without_a_compiler_the_backend_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MINI_VLLM_CACHE_DIR", str(tmp_path))
    cpu_kernel._load.cache_clear()
    try:
        assert not cpu_kernel.available()
        assert "no-such-compiler" in cpu_kernel.unavailable_reason()
        with pytest.raises(
            ValueError, match="attention_backend='cpu' needs its C kernel.*use attention_backend='torch'"
        ):
            get_attn_backend("cpu")
        with pytest.raises(RuntimeError, match="the C decode-attention kernel is unavailable"):
            batch = decode_batch(4, 2, 64, 16)
            paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    finally:
        monkeypatch.undo()
        cpu_kernel._load.cache_clear()
        fused_ops_cpu._load.cache_clear()  # get_attn_backend("cpu") may have tried it too
    assert cpu_kernel.available()


@pytest.fixture
def fresh_build(monkeypatch):
    """Each call of ``_load`` builds or loads anew (under the test's environment), then the cache is reset."""
    cpu_kernel._load.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_kernel._load.cache_clear()
    fused_ops_cpu._load.cache_clear()


def test_a_cache_folder_that_cannot_be_written_is_a_reason_not_a_traceback(fresh_build, tmp_path):
    (tmp_path / "a-file").write_text("")
    fresh_build.setenv("MINI_VLLM_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    assert not cpu_kernel.available()
    assert "a-file" in cpu_kernel.unavailable_reason()
    with pytest.raises(ValueError, match="attention_backend='cpu' needs its C kernel"):
        get_attn_backend("cpu")
    assert get_attn_backend("torch").name == "torch"


def test_a_home_that_cannot_be_written_builds_in_a_private_temporary_folder(fresh_build, tmp_path):
    (tmp_path / "home").write_text("")  # a file: nothing can be created under it
    fresh_build.delenv("MINI_VLLM_CACHE_DIR", raising=False)
    fresh_build.setenv("HOME", str(tmp_path / "home"))
    fresh_build.setenv("TMPDIR", str(tmp_path))
    tempfile_dir = tempfile.tempdir
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        assert cpu_kernel.available(), cpu_kernel.unavailable_reason()
        assert len(list(tmp_path.glob("mini_vllm-*/paged_attention_cpu-*.so"))) == 1
    finally:
        tempfile.tempdir = tempfile_dir


def test_a_relative_cache_folder_and_a_cc_with_arguments(fresh_build, tmp_path):
    """``MINI_VLLM_CACHE_DIR=.`` loads from the current folder (not the system's library path), and
    ``CC`` is split as make splits it."""
    fresh_build.chdir(tmp_path)
    fresh_build.setenv("MINI_VLLM_CACHE_DIR", ".")
    fresh_build.setenv("CC", f"{shutil.which('cc') or shutil.which('gcc')} -pipe")
    assert cpu_kernel.available(), cpu_kernel.unavailable_reason()
    assert list(tmp_path.glob("paged_attention_cpu-*.so"))


def test_the_cpu_backend_is_for_the_cpu():
    assert get_attn_backend("cpu", "cpu").name == "cpu"
    assert get_attn_backend("cpu", "cpu:0").name == "cpu"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU, but the engine's device is 'cuda'"):
        get_attn_backend("cpu", "cuda")


def test_every_backend_factory_is_given_the_device(monkeypatch):
    """The registry's factories decide for themselves where they run: the device reaches them."""
    from mini_vllm import attention

    seen = []
    monkeypatch.setitem(attention.ATTENTION_BACKENDS._entries, "probe", lambda device: seen.append(device) or "made")
    assert get_attn_backend("probe", "cuda:1") == "made"
    assert seen == ["cuda:1"]


@pytest.fixture
def c_calls(monkeypatch):
    """Counts the cpu backend's calls into the C kernel."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return paged_attention_cpu(*args, **kwargs)

    monkeypatch.setattr(cpu_backend, "paged_attention_cpu", counted)
    return calls


@pytest.mark.parametrize("model", ["bundled", "hybrid (sliding-window layers)"])
def test_the_engine_on_the_cpu_backend_gives_the_torch_backends_tokens(model, c_calls):
    path = hybrid_model_path() if model.startswith("hybrid") else None
    torch_llm = LLM(path, dtype="float32", num_blocks=64, block_size=16, attention_backend="torch")
    cpu_llm = LLM(path, dtype="float32", num_blocks=64, block_size=16, attention_backend="cpu")
    assert cpu_llm.llm_engine.model_runner.attn_backend.name == "cpu"
    tokenizer = torch_llm.get_tokenizer()
    shared = tokenizer.encode(
        "Once upon a time there was a little fox who lived near the river. Every morning the fox "
        "ran along the water, said hello to the ducks and looked for shiny stones in the sand."
    )
    prompts = [
        {"prompt_token_ids": shared + tokenizer.encode(" One day the fox")},
        {"prompt_token_ids": shared + tokenizer.encode(" The fox had a friend")},
        {"prompt_token_ids": tokenizer.encode("Tell me a story about a cat.")},
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params)]
    got = cpu_llm.generate(prompts, params)

    assert [o.outputs[0].token_ids for o in got] == expected
    assert sum(o.num_cached_tokens for o in got) > 0
    assert 3 in c_calls, "no decode step of all three sequences went to the C kernel"
    assert_nothing_leaked(cpu_llm)
