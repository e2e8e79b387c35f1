"""The benchmark runs end to end and writes the JSON whose keys are fixed.

Timings are never asserted (they belong to the benchmark, not the tests); the
deterministic parts are: token counts, hit rates, output equality, the keys.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics

import pytest

from mini_vllm import LLM
from mini_vllm.model import hybrid_model_path
from mini_vllm.tools import bench, paths
from mini_vllm.tools.compare_vllm import run_mini

FIXED_KEYS = {
    "shared_prefix": {
        "ttft_speedup",
        "ttft_speedup_range",
        "ideal_speedup",
        "attainable_speedup",
        "hit_rate",
        "prefill_tokens_on",
        "prefill_tokens_off",
        "ttft_fresh_same_uncached_ms",
        "cache_overhead_ratio",
        "cache_overhead_ratio_range",
        "cache_overhead_flops_ratio",
    },
    "no_sharing": {"throughput_ratio_on_off", "throughput_ratio_on_off_range"},
    "multi_turn": {"hit_rate_stable", "hit_rate_timestamped"},
    "vs_transformers": {"throughput_ratio", "throughput_ratio_range", "outputs_equal"},
    "block_manager": {"admit_free_us", "decode_step_us", "free_us", "vllm", "ratio_vs_vllm"},
}
# Per model, keyed by the model's folder name.
ROOFLINE_KEYS = {
    "decode_step_ms": float,
    "weights_read_floor_ms": float,
    "decode_vs_floor": float,
    "decode_vs_floor_range": list,
    "weight_bytes": int,
}
VS_VLLM_KEYS = {
    "vllm_version": str,
    "threads": int,
    "throughput_ratio": float,
    "ttft_cold_ratio": float,
    "ttft_warm_ratio": float,
    "throughput_ratio_range": list,
    "ttft_cold_ratio_range": list,
    "ttft_warm_ratio_range": list,
    "cached_tokens_equal": bool,
    "outputs_equal": bool,
    "mini_cache_overhead_ratio": float,
    "vllm_cache_overhead_ratio": float,
    "fresh_matches_warm": bool,
}


def check_types(section: dict, keys: dict, where: str) -> None:
    for key, kind in keys.items():
        assert isinstance(section.get(key), kind), f"{where}[{key!r}] = {section.get(key)!r} is not {kind.__name__}"


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
def test_bench_writes_the_fixed_json_keys_and_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.BenchSettings, "quick", classmethod(lambda cls, device="auto": cls.tiny(device)))
    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(path), "--device", "cpu", "--no-vllm"]) == 0
    results = json.loads(path.read_text())
    assert {"device", "versions"} <= set(results)
    for section, keys in FIXED_KEYS.items():
        assert keys <= set(results[section]), f"{section} lacks {keys - set(results[section])}"
        assert not any(key.startswith("_") for key in results[section])  # raw data stays out of the file
    shared = results["shared_prefix"]
    assert shared["prefill_tokens_on"] < shared["prefill_tokens_off"]
    assert shared["ideal_speedup"] == shared["prefill_tokens_off"] / shared["prefill_tokens_on"]
    assert shared["hit_rate"] > 0.5 and shared["outputs_equal_on_off"]
    assert results["multi_turn"]["hit_rate_stable"] > results["multi_turn"]["hit_rate_timestamped"]
    assert results["vs_transformers"]["outputs_equal"] is True
    for plot in results["plots"]:
        assert (tmp_path / plot.split("/")[-1]).exists()
    assert shared["hit_rate"] == 1 - shared["prefill_tokens_on"] / shared["prefill_tokens_off"]  # same requests
    assert all(low <= high for low, high in (shared["ttft_speedup_range"], shared["cache_overhead_ratio_range"]))
    check_types(results["roofline"]["default_model"], ROOFLINE_KEYS, "roofline['default_model']")
    assert (
        results["roofline"]["default_model"]["weight_bytes"] == 14_160_896
    )  # 3.5 M float32 weights, tied counted once
    assert results["vs_vllm"] == {}  # --quick and --no-vllm leave real vLLM out
    assert results["attention_backend"] == "cpu"  # on a CPU: the C decode kernel, which CI's compiler builds
    assert "shared prefix: TTFT cold / warm" in capsys.readouterr().out


def test_public_drops_raw_keys_at_every_depth():
    raw = {"a": {"_raw": [1], "x": 1, "models": {"m": {"_ttfts": [2], "y": 2}}}, "_top": 3}
    assert bench.public(raw) == {"a": {"x": 1, "models": {"m": {"y": 2}}}}


def test_vs_vllm_figures_checks_types_of_a_complete_section():
    """The contract's checker rejects a section with a wrong type (it can fail)."""
    good = {
        "vllm_version": "0.32.0",
        "threads": 1,
        "throughput_ratio": 0.5,
        "ttft_cold_ratio": 1.0,
        "ttft_warm_ratio": 1.1,
        "throughput_ratio_range": [0.4, 0.6],
        "ttft_cold_ratio_range": [0.9, 1.1],
        "ttft_warm_ratio_range": [1.0, 1.2],
        "cached_tokens_equal": True,
        "outputs_equal": True,
        "mini_cache_overhead_ratio": 1.1,
        "vllm_cache_overhead_ratio": 1.1,
        "fresh_matches_warm": True,
    }
    check_types(good, VS_VLLM_KEYS, "vs_vllm")
    with pytest.raises(AssertionError, match="threads"):
        check_types(dict(good, threads="1"), VS_VLLM_KEYS, "vs_vllm")


def test_prefill_flops_counts_every_projection_weight_and_every_key_each_query_sees():
    """Checked against the model's own parameter count and a brute-force count of the causal keys."""
    llm = LLM(num_blocks=8)
    config = llm.llm_engine.model_config
    model = llm.llm_engine.model_runner.model
    layer_weights = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2)
    output_projection = model.lm_head.weight.numel()
    per_key = 2 * 2 * config.num_heads * config.head_dim * config.num_layers  # scores + weighted values
    for num_new, num_cached in ((1, 0), (5, 0), (7, 64), (31, 288)):
        keys_seen = sum(num_cached + i + 1 for i in range(num_new))  # query i sees itself and all before it
        expected = 2 * num_new * layer_weights + 2 * output_projection + per_key * keys_seen
        assert bench.prefill_flops(config, num_new, num_cached) == expected


def test_vs_vllm_fresh_prompts_compute_exactly_what_the_warm_ones_do():
    """Each fresh prompt of the ttft workload is as long as what the warm request before it computes,
    on a real mini-vLLM engine with vLLM's block size; a prompt one token off is caught."""
    llm = LLM(num_blocks=8)
    workloads = bench._vs_vllm_workloads(llm, rounds=1, max_tokens=2)
    assert [w["name"] for w in workloads] == ["ttft_0", "throughput_0"]
    assert len(workloads[0]["calls"]) == len(bench.TTFT_CALLS)
    spec = {"block_size": bench.VS_VLLM_BLOCK_SIZE, "num_blocks": bench.VS_VLLM_NUM_BLOCKS, "workloads": workloads}
    results = run_mini(None, [spec])[0]["workloads"]
    result = results[0]
    warm = [r for r in result["requests"] if bench.TTFT_CALLS[r["call"]] == "warm"]
    assert all(r["num_cached_tokens"] > 0 for r in warm)  # the warm ones really hit the system prompt
    assert bench._fresh_matches_warm(result["requests"])

    off_by_one = [dict(r) for r in result["requests"]]
    fresh = next(r for r in off_by_one if bench.TTFT_CALLS[r["call"]] == "fresh")
    fresh["num_prompt_tokens"] += 1
    assert not bench._fresh_matches_warm(off_by_one)
    fresh["num_prompt_tokens"] -= 1
    fresh["num_cached_tokens"] = bench.VS_VLLM_BLOCK_SIZE  # a fresh prompt that hit the cache
    assert not bench._fresh_matches_warm(off_by_one)

    figures = bench.vs_vllm_figures(results)
    by_kind = {
        kind: [r["ttft_s"] for r in result["requests"] if bench.TTFT_CALLS[r["call"]] == kind]
        for kind in ("warm", "fresh")
    }
    assert figures["ttft_warm_ms"] == pytest.approx(1000 * statistics.median(by_kind["warm"]))
    assert figures["ttft_fresh_ms"] == pytest.approx(1000 * statistics.median(by_kind["fresh"]))
    assert figures["cache_overhead_ratio"] == pytest.approx(figures["ttft_warm_ms"] / figures["ttft_fresh_ms"])


def test_format_table_reads_a_file_written_before_the_cost_of_caching_was_measured():
    """A learner's older ``benchmarks/results/bench.json`` lacks the newer keys; chapter 10 still prints it."""
    results = json.loads((paths.REFERENCE_RESULTS_DIR / "bench-cpu.json").read_text())
    assert "cost of caching" in bench.format_table(results)
    for section in [results["shared_prefix"], *(m["shared_prefix"] for m in results.get("models", {}).values())]:
        section.pop("cache_overhead_flops_ratio", None)
    for section in results.get("vs_vllm", {}).values():
        for key in ("mini_cache_overhead_ratio", "vllm_cache_overhead_ratio", "fresh_matches_warm"):
            section.pop(key, None)
    text = bench.format_table(results)
    assert "cache overhead warm / fresh" in text and "in FLOPs" not in text and "cost of caching" not in text


def test_serving_over_http_measures_the_mini_server_and_formats_both_tables(tmp_path):
    """``bench_serving`` against the real server (one short round, no vLLM), then both tables with and without vLLM."""
    import sys

    from mini_vllm.tools.compare_servers import ServerSpec, bench_serving
    from mini_vllm.model import default_model_path

    sys.path.insert(0, str(paths.BENCHMARKS_DIR))
    import readme_table

    spec = ServerSpec(str(default_model_path()), block_size=32, num_blocks=64, max_model_len=512)
    r = bench_serving(spec, tmp_path, rounds=1, num_requests=6, concurrency=2, max_tokens=4, with_vllm=False)
    assert r["mini_throughput_tok_s"] > 0 and r["mini_ttft_p50_ms"] > 0
    assert r["mini_cached_tokens"] > 0  # chats 0 and 5 share a system prompt: the cache works over HTTP too
    assert "throughput_ratio" not in r
    rows = bench.serving_rows("default_model", r)
    assert [row[0] for row in rows] == ["default_model: over HTTP, throughput", "default_model: over HTTP, TTFT p50"]
    assert all("vLLM not installed" in row[2] for row in rows)
    both = dict(
        r,
        vllm_throughput_tok_s=2 * r["mini_throughput_tok_s"],
        vllm_throughput_tok_s_range=[1.0, 3.0],
        vllm_ttft_p50_ms=r["mini_ttft_p50_ms"] / 2,
        vllm_ttft_p50_ms_range=[1.0, 2.0],
        throughput_ratio=0.5,
        ttft_ratio=2.0,
    )
    assert bench.serving_rows("m", both)[0][1] == "0.50x vLLM" and bench.serving_rows("m", both)[1][1] == "2.00x vLLM"
    results = json.loads((paths.REFERENCE_RESULTS_DIR / "bench-cpu.json").read_text())
    results["serving"] = {"default_model": both}
    assert "over HTTP, throughput" in bench.format_table(results)
    assert "**0.50×**" in readme_table.table(results)
    results["serving"] = {"default_model": r}
    assert "no vLLM measured" in readme_table.table(results)


def test_both_tables_show_vllm_in_its_default_configuration_and_the_goals_of_the_issue():
    """A vs-vLLM section with the ``vllm_default`` column: both tables name each vLLM configuration,
    and the README marks each goal met or missed from the numbers (never by hand)."""
    import sys

    sys.path.insert(0, str(paths.BENCHMARKS_DIR))
    import readme_table

    results = json.loads((paths.REFERENCE_RESULTS_DIR / "bench-cpu.json").read_text())
    section = results["vs_vllm"]["SmolLM2-135M-Instruct"]
    section["vllm_default"] = {
        "vllm_configuration": bench.VLLM_DEFAULT,
        "throughput_ratio": 0.75,
        "throughput_ratio_range": [0.7, 0.8],
        "ttft_cold_ratio": 1.3,
        "ttft_cold_ratio_range": [1.2, 1.4],
        "ttft_warm_ratio": 1.2,
        "ttft_warm_ratio_range": [1.1, 1.3],
        "mini_cache_overhead_ratio": 1.1,
        "vllm_cache_overhead_ratio": 1.05,
        "vllm": {"throughput_tok_s": 120.0, "ttft_cold_ms": 330.0},
        "outputs_equal": True,
    }
    text = bench.format_table(results)
    assert "vs vLLM by default" in text and "0.75x, 1.30x / 1.20x" in text and "compiled" in text
    assert "0.11" not in text  # no figure measured once, elsewhere, stands in for a measurement
    markdown = readme_table.table(results)
    default_row = next(
        line for line in markdown.splitlines() if "SmolLM2-135M-Instruct: vs vLLM 0.32.0 as it runs by default" in line
    )
    assert "**0.75×**" in default_row and "asynchronous scheduling" in default_row
    comparable_row = next(line for line in markdown.splitlines() if "SmolLM2-135M-Instruct: vs vLLM" in line)
    assert "eager, synchronous scheduling" in comparable_row
    assert "mini-vLLM's attention backend `cpu`" in comparable_row  # the committed run measured the C decode kernel
    section["throughput_ratio"], section["ttft_cold_ratio"] = 0.88, 1.05
    goals = readme_table.table(results).split("SmolLM2-135M-Instruct: vs vLLM", 1)[1].splitlines()[0]
    assert "throughput ≥ 1.0× **missed**" in goals and "TTFT cold ≤ 1.1× ✓" in goals
    section["throughput_ratio"] = 1.02
    assert "throughput ≥ 1.0× ✓" in readme_table.table(results)


def test_the_cpu_is_described_by_its_model_cores_and_avx512(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert bench.cpu_description(cpuinfo).startswith("AMD EPYC, ") and bench.cpu_description(cpuinfo).endswith(
        "with AVX-512"
    )
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2\n")
    assert bench.cpu_description(cpuinfo).endswith("without AVX-512")


# -- the engine each benchmark runs (chapter 10 runs the learner's beside the reference) ------------
def _small(settings: bench.BenchSettings, num_requests: int = 2) -> bench.BenchSettings:
    return dataclasses.replace(
        settings,
        num_requests=num_requests,
        max_tokens=2,
        num_turns=2,
        hf_batch_size=2,
        shared_prefix_rounds=1,
        roofline_rounds=1,
        bandwidth_bytes=8 * 2**20,
    )


class CountingLLM(LLM):
    """An ``LLM`` that counts its ``generate`` calls (``chat`` goes through it too)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_generate_calls = 0

    def generate(self, *args, **kwargs):
        self.num_generate_calls += 1
        return super().generate(*args, **kwargs)


@pytest.mark.parametrize("name", sorted(bench.RUNNERS))
def test_every_live_benchmark_runs_the_engines_of_the_factory_it_is_given(name):
    built = []

    def engine(model, **kwargs):
        built.append((model, kwargs, CountingLLM(model, **kwargs)))
        return built[-1][2]

    settings = _small(bench.BenchSettings.tiny(device="cpu"))
    results = bench.run_benchmarks(settings, [name], engine=engine)
    assert set(results) == {name}
    assert built, f"{name} built its engines without the factory it was given"
    assert all(llm.num_generate_calls > 0 for *_, llm in built), f"{name} built an engine it did not measure"
    assert all(kwargs["device"] == "cpu" and kwargs["num_blocks"] == 256 for _, kwargs, _ in built)
    expected_model = hybrid_model_path() if name == "hybrid" else None
    assert [model for model, *_ in built] == [expected_model] * len(built)
    if name in ("shared_prefix", "hybrid"):  # caching on and off: two engines of the factory
        assert sorted(kwargs["enable_prefix_caching"] for _, kwargs, _ in built) == [False, True]


def test_the_hybrid_benchmark_runs_the_learners_sliding_window_part():
    """Exercise 08b's part runs in the hybrid workload of the learner's engine, and caching keeps the outputs."""
    from mini_vllm.course import learner_engine
    from mini_vllm.single_type_kv_cache_manager import find_sliding_window_cache_hit

    calls = []

    def sliding_window_hit(*args, **kwargs):  # the reference's, counted: the learner's part as it would run
        calls.append(args)
        return find_sliding_window_cache_hit(*args, **kwargs)

    engine = functools.partial(learner_engine, parts={"find_sliding_window_cache_hit": sliding_window_hit})
    result = bench.run_benchmarks(_small(bench.BenchSettings.tiny(device="cpu"), 3), ["hybrid"], engine=engine)
    hybrid = result["hybrid"]
    assert calls, "the learner's find_sliding_window_cache_hit never ran in the hybrid benchmark"
    assert hybrid["outputs_equal_on_off"]
    assert 0 < hybrid["prefill_tokens_on"] < hybrid["prefill_tokens_off"]  # the third request hits


def test_prefill_flops_counts_at_most_the_window_of_keys_in_a_sliding_window_layer():
    """The hybrid model: layers 0 and 2 see at most 64 keys per query, layers 1 and 3 every earlier key."""
    config = LLM(hybrid_model_path(), num_blocks=8).llm_engine.model_config
    full = dataclasses.replace(config, layer_types=(), sliding_window=None)
    window = config.sliding_window
    per_layer_key = 2 * 2 * config.num_heads * config.head_dim
    for num_new, num_cached in ((1, 0), (5, 0), (7, 64), (31, 288)):
        positions = range(num_cached, num_cached + num_new)
        all_keys = sum(p + 1 for p in positions)
        windowed = sum(min(window, p + 1) for p in positions)
        saved = 2 * per_layer_key * (all_keys - windowed)  # two sliding layers
        assert (
            bench.prefill_flops(full, num_new, num_cached) - bench.prefill_flops(config, num_new, num_cached) == saved
        )
    assert bench.prefill_flops(config, 5, 0) == bench.prefill_flops(full, 5, 0)  # all within the window
