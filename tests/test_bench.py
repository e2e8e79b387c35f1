"""The benchmark runs end to end and writes the JSON whose keys are fixed (issue 7).

Timings are never asserted (they belong to the benchmark, not the tests); the
deterministic parts are: token counts, hit rates, output equality, the keys.
"""

from __future__ import annotations

import json

from mini_vllm import bench

FIXED_KEYS = {
    "shared_prefix": {"ttft_speedup", "ideal_speedup", "hit_rate", "prefill_tokens_on", "prefill_tokens_off"},
    "no_sharing": {"throughput_ratio_on_off"},
    "multi_turn": {"hit_rate_stable", "hit_rate_timestamped"},
    "vs_transformers": {"throughput_ratio", "outputs_equal"},
    "block_manager": {"admit_free_us", "decode_step_us"},
}


def test_bench_writes_the_fixed_json_keys_and_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.BenchSettings, "quick", classmethod(lambda cls, device="auto": cls.tiny(device)))
    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(path), "--device", "cpu"]) == 0
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
    assert "shared prefix: TTFT speedup" in capsys.readouterr().out
