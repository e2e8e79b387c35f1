"""``serve --kv-offloading-size``: the tier's hits as a client and a scraper see them, through the ``openai`` client.

Six 64-token prefixes, each with 5 tokens of its own, are sent twice, one at
a time, to a server whose pool (12 blocks of 16 tokens) holds about one
prompt. By the second round the pool has evicted every prefix. With the
tier, each second-round reply reports its 64 prefix tokens in
``usage.prompt_tokens_details.cached_tokens`` (vLLM's server reports
``num_cached_tokens``, the pool's hit plus the connector's), and ``/metrics``
counts them as ``vllm:external_prefix_cache_hits``, not as the pool's
``vllm:prefix_cache_hits``. Without the tier the same requests report none.
"""

from __future__ import annotations

import argparse
import random

import httpx
import pytest
from openai import OpenAI

from mini_vllm import LLM
from mini_vllm.entrypoints.cli import main
from mini_vllm.entrypoints.openai.api_server import BackgroundServer
from mini_vllm.entrypoints.openai.cli_args import engine_settings, make_arg_parser

MODEL = "mini-vllm"
PREFIX, SUFFIX, NUM_PREFIXES, BLOCK_SIZE = 64, 5, 6, 16
rng = random.Random(0)
PROMPTS = [[rng.randrange(100, 1000) for _ in range(PREFIX + SUFFIX)] for _ in range(NUM_PREFIXES)]


def metric_values(url: str) -> dict[str, float]:
    """``/metrics`` as {"vllm:external_prefix_cache_hits_total": ..., ...} (one model, so no labels kept)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:")}


def two_rounds(kv_offloading_size: float | None) -> tuple[list[int], dict[str, float]]:
    """Every prompt twice, one at a time: each reply's cached tokens, and /metrics after."""
    llm = LLM(num_blocks=12, block_size=BLOCK_SIZE, max_num_seqs=1, device="cpu", kv_offloading_size=kv_offloading_size)
    with BackgroundServer(llm, served_model_name=MODEL) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        cached = []
        for prompt in PROMPTS + PROMPTS:
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
            assert reply.usage.prompt_tokens == PREFIX + SUFFIX
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        return cached, metric_values(server.url)


@pytest.fixture(scope="module")
def with_tier():
    return two_rounds(0.01)


def test_tier_hits_are_cached_tokens_in_usage(with_tier):
    cached, _ = with_tier
    assert cached == [0] * NUM_PREFIXES + [PREFIX] * NUM_PREFIXES


def test_tier_hits_are_external_in_metrics_and_not_the_pools(with_tier):
    _, metrics = with_tier
    assert metrics["vllm:external_prefix_cache_queries_total"] == 2 * NUM_PREFIXES * (PREFIX + SUFFIX)
    assert metrics["vllm:external_prefix_cache_hits_total"] == NUM_PREFIXES * PREFIX
    assert metrics["vllm:prefix_cache_hits_total"] == 0  # the pool had evicted every prefix


def test_without_a_tier_nothing_comes_back_and_the_external_counters_stay_0():
    cached, metrics = two_rounds(None)
    assert cached == [0] * 2 * NUM_PREFIXES
    # vLLM exports the external counters with or without a connector.
    assert metrics["vllm:external_prefix_cache_queries_total"] == 0
    assert metrics["vllm:external_prefix_cache_hits_total"] == 0


def test_serve_flags_set_the_tier_with_vllms_names():
    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-offloading-size", "0.5", "--kv-offloading-backend", "native"])
    settings = engine_settings(args)
    assert settings["kv_offloading_size"] == 0.5 and settings["kv_offloading_backend"] == "native"
    assert "kv_offloading_size" not in engine_settings(parser.parse_args([]))  # no flag: no tier


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-offloading-size=0.01", "--kv-offloading-backend=lmcache"], "kv_offloading_backend must be 'native'"),
        (["--kv-offloading-size=-1"], "kv_offloading_size must be positive"),
        (["--kv-offloading-size=lots"], "--kv-offloading-size: invalid float value"),
    ],
)
def test_serve_refuses_bad_offloading_flags_by_name(flags, message, monkeypatch, capsys):
    monkeypatch.setattr("mini_vllm.entrypoints.openai.api_server.uvicorn.run", lambda *a, **k: pytest.fail("served"))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error, error


def test_serve_takes_the_eviction_policy_as_vllm_does():
    # vllm serve --kv-offloading-size N --kv-transfer-config '{"kv_connector_extra_config": {"eviction_policy": "arc"}}'
    parser = make_arg_parser(argparse.ArgumentParser())
    arc = '{"kv_connector_extra_config": {"eviction_policy": "arc"}}'
    settings = engine_settings(parser.parse_args(["--kv-offloading-size", "0.01", "--kv-transfer-config", arc]))
    assert settings["kv_transfer_config"] == {"kv_connector_extra_config": {"eviction_policy": "arc"}}
    assert type(
        LLM(device="cpu", num_blocks=12, **settings).llm_engine.scheduler.connector.manager.policy
    ).__name__ == ("ARCCachePolicy")
    assert "kv_transfer_config" not in engine_settings(parser.parse_args([]))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-offloading-size=0.01", '--kv-transfer-config={"eviction_policy": "arc"}'], "not built here"),
        (["--kv-offloading-size=0.01", "--kv-transfer-config=arc"], "--kv-transfer-config: not valid JSON"),
        (["--kv-offloading-size=0.01", "--kv-transfer-config=[1]"], "expected a JSON object"),
        (['--kv-transfer-config={"kv_connector_extra_config": {}}'], "give kv_offloading_size too"),
    ],
)
def test_serve_refuses_a_kv_transfer_config_it_cannot_follow(flags, message, monkeypatch, capsys):
    test_serve_refuses_bad_offloading_flags_by_name(flags, message, monkeypatch, capsys)
