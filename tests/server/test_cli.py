"""The command line: python -m mini_vllm generate | chat | demo | bench."""

from __future__ import annotations

import pytest

from mini_vllm.entrypoints.cli import main


def test_generate_prints_a_story_that_follows_the_request(capsys):
    main(["generate", "Tell me a story about a brave dog named Leo.", "--max-tokens", "40", "--device", "cpu"])
    story = capsys.readouterr().out
    assert "Leo" in story and "dog" in story


def test_chat_reports_cached_tokens_for_the_second_turn(monkeypatch, capsys):
    lines = iter(["Tell me a story about a kind cat named Mia.", "Another one about a dog named Leo.", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    main(["chat", "--max-tokens", "30", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("bot>") == 2
    cached = [
        int(line.split("[")[1].split("/")[0])
        for line in out.splitlines()
        if "prompt tokens from the prefix cache" in line
    ]
    assert cached[0] == 0 and cached[1] > 0  # the second turn re-sends the first: it hits


def test_demo_shows_hits_with_caching_on_and_none_with_it_off(capsys):
    results = main(["demo", "--num-requests", "3", "--max-tokens", "4", "--device", "cpu"])
    assert results == 0
    out = capsys.readouterr().out
    assert "prefix caching on" in out and "prefix caching off" in out
    assert "hit rate 0.0%" in out


def test_bench_takes_its_own_options():
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0


@pytest.mark.parametrize("port", ["99999", "-5", "http"])
def test_serve_refuses_a_port_outside_0_to_65535_before_loading_the_model(port, monkeypatch, capsys):
    """An argparse error naming the range (exit 2), not three tracebacks and an OverflowError after the model loaded."""
    monkeypatch.setattr("mini_vllm.entrypoints.openai.api_server.LLM", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", f"--port={port}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--port: must be an integer from 0 to 65535" in error and "Traceback" not in error, error
