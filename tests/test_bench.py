"""The benchmark runs end to end and writes the JSON whose keys are fixed.

Timings are never asserted (they belong to the benchmark, not the tests); the
deterministic parts are: token counts, hit rates, output equality, the keys.
"""

from __future__ import annotations

import json

import pytest

from mini_vllm import bench

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
    },
    "no_sharing": {"throughput_ratio_on_off", "throughput_ratio_on_off_range"},
    "multi_turn": {"hit_rate_stable", "hit_rate_timestamped"},
    "vs_transformers": {"throughput_ratio", "throughput_ratio_range", "outputs_equal"},
    "block_manager": {"admit_free_us", "decode_step_us", "free_us", "vllm", "ratio_vs_vllm"},
}
# Per model, keyed by the model's folder name.
ROOFLINE_KEYS = {"decode_step_ms": float, "weights_read_floor_ms": float, "decode_vs_floor": float, "weight_bytes": int}
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
}


def check_types(section: dict, keys: dict, where: str) -> None:
    for key, kind in keys.items():
        assert isinstance(section.get(key), kind), f"{where}[{key!r}] = {section.get(key)!r} is not {kind.__name__}"


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
    }
    check_types(good, VS_VLLM_KEYS, "vs_vllm")
    with pytest.raises(AssertionError, match="threads"):
        check_types(dict(good, threads="1"), VS_VLLM_KEYS, "vs_vllm")
