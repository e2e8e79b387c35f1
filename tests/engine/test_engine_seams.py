"""The engine's seams: who talks to whom, one owner per piece of state, one configuration object.

* ``LLMEngine`` talks only to the ``Scheduler``, the scheduler only to the ``KVCacheManager``,
  the manager to the ``BlockPool``;
* everything the engine keeps per request is on the ``Request`` in ``LLMEngine.requests``,
  and nothing of a finished or aborted request is left anywhere;
* ``EngineConfig`` is the one source of the settings' names, defaults and checks.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap

import pytest

from engine_invariants import assert_nothing_leaked

from mini_vllm import LLM, SamplingParams
from mini_vllm import llm_engine, scheduler
from mini_vllm.companions import profiler
from mini_vllm.entrypoints import cli
from mini_vllm.config import DEFAULT_BLOCK_SIZE, EngineConfig
from mini_vllm.events import AllBlocksCleared
from mini_vllm.hashing import hash_request_tokens
from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request
from mini_vllm.companions.router import CacheReplica

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPT = {"prompt_token_ids": list(range(10, 10 + 40))}  # two full 16-token blocks and a tail


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=32, device="cpu")


# -- who talks to whom -------------------------------------------------------------------------


def reaches_through(source: str, names: set[str]) -> list[str]:
    """The expressions in ``source`` that use something *through* one of ``names`` (``x.kv_cache_manager.free``)."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr in names:
            found.append(ast.unparse(node))
    return found


def test_reaches_through_finds_a_reach_past_the_scheduler():
    wrong = "def f(self):\n    self.kv_cache_manager.block_pool.enable_kv_cache_events = True\n"
    assert reaches_through(wrong, {"kv_cache_manager"}) == ["self.kv_cache_manager.block_pool"]
    assert reaches_through("def f(self):\n    return self.scheduler.kv_cache_manager\n", {"kv_cache_manager"}) == []


def test_the_engine_uses_nothing_through_the_kv_cache_manager_or_the_pool():
    source = inspect.getsource(llm_engine)
    assert reaches_through(source, {"kv_cache_manager", "block_pool"}) == []


def test_the_scheduler_uses_nothing_through_the_block_pool():
    assert reaches_through(inspect.getsource(scheduler), {"block_pool"}) == []


def test_stats_reset_and_events_go_through_the_scheduler(llm):
    engine = llm.llm_engine
    seen = []
    engine.add_listener(seen.append)
    try:
        assert engine.kv_cache_manager.block_pool.enable_kv_cache_events  # the scheduler turned recording on
        llm.generate([PROMPT, PROMPT], GREEDY)
        stats, scheduler_stats = engine.get_stats(), engine.scheduler.make_stats()
        assert stats.num_blocks == scheduler_stats.num_blocks == 32
        assert stats.num_blocks_in_use == 32 - scheduler_stats.num_free_blocks == 0
        assert stats.prefix_cache_hits == scheduler_stats.prefix_cache_stats.hits > 0
        assert stats.num_evictions == scheduler_stats.num_evictions == engine.kv_cache_manager.block_pool.num_evictions
        # make_stats hands out a copy: counting goes on without changing what was handed out.
        llm.generate([PROMPT], GREEDY)
        assert engine.scheduler.make_stats().prefix_cache_stats.hits > scheduler_stats.prefix_cache_stats.hits
        assert llm.reset_prefix_cache()
        assert isinstance(seen[-1], AllBlocksCleared)
    finally:
        engine.remove_listener(seen.append)
    assert not engine.kv_cache_manager.block_pool.enable_kv_cache_events


def test_a_schedule_that_raises_leaves_no_uncomputed_block_in_the_cache(llm, monkeypatch):
    engine = llm.llm_engine
    assert llm.reset_prefix_cache()
    real_schedule = scheduler.Scheduler.schedule_request

    def schedule_then_fail(self, request, *args, **kwargs):
        real_schedule(self, request, *args, **kwargs)
        raise RuntimeError("a bug in the scheduler")

    monkeypatch.setattr(scheduler.Scheduler, "schedule_request", schedule_then_fail)
    engine.add_request("bug", list(PROMPT["prompt_token_ids"]), GREEDY)
    with pytest.raises(RuntimeError, match="a bug in the scheduler"):
        engine.step()
    pool = engine.kv_cache_manager.block_pool
    assert len(pool.cached_block_hash_to_block) == 0  # the two blocks cached at schedule time were uncached
    monkeypatch.undo()
    engine.abort_request("bug")
    assert_nothing_leaked(engine)

    # Without the scheduler's clean-up the blocks would stay cached, K/V never written.
    monkeypatch.setattr(KVCacheManager, "uncache_blocks", lambda self, blocks: None)
    monkeypatch.setattr(scheduler.Scheduler, "schedule_request", schedule_then_fail)
    engine.add_request("bug", list(PROMPT["prompt_token_ids"]), GREEDY)
    with pytest.raises(RuntimeError):
        engine.step()
    assert len(pool.cached_block_hash_to_block) == 2
    monkeypatch.undo()
    engine.abort_request("bug")
    assert llm.reset_prefix_cache()


# -- one owner per piece of state ----------------------------------------------------------------


def test_a_request_carries_the_engine_s_bookkeeping_and_leaves_in_one_place(llm):
    engine = llm.llm_engine
    engine.add_requests([PROMPT, PROMPT], GREEDY, request_ids=["kept", "dropped"])
    request = engine.requests["kept"]
    assert request.metrics.arrival_time == request.arrival_time and request.generator is not None
    engine.abort_request("dropped")
    assert set(engine.requests) == {"kept"}
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_leaked(engine)


def test_nothing_leaked_finds_a_container_nobody_listed(llm):
    engine = llm.llm_engine
    assert_nothing_leaked(engine)
    engine.scheduler.finished_req_ids = {"a"}  # a per-request container added later, by someone else
    try:
        with pytest.raises(AssertionError, match="Scheduler.finished_req_ids"):
            assert_nothing_leaked(engine)
    finally:
        del engine.scheduler.finished_req_ids


def test_the_request_path_has_no_lora_name():
    assert "lora_name" not in inspect.signature(Request).parameters
    assert not hasattr(Request("r", [1, 2, 3]), "lora_name")


# -- one configuration object --------------------------------------------------------------------


def test_llm_repeats_no_setting_of_its_own():
    parameters = inspect.signature(LLM.__init__, follow_wrapped=False).parameters
    code = LLM.__init__.__code__  # what the function itself declares, whatever signature it shows
    # (parts is not a setting: the engine's extension points, mini_vllm/engine_parts.py)
    assert code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] == ("self", "model", "config", "parts")
    assert code.co_flags & inspect.CO_VARKEYWORDS  # the settings come in as **settings
    assert "settings" not in parameters  # and are shown one by one (next test)


def shown_settings(signature: inspect.Signature) -> dict:
    return {
        name: p.default for name, p in signature.parameters.items() if name not in ("self", "model", "config", "parts")
    }


def test_the_signature_shows_every_setting_with_engine_config_s_default():
    """help(LLM) / Shift-Tab list the settings, read from EngineConfig, not written twice."""
    expected = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert shown_settings(inspect.signature(LLM)) == expected
    unspelled = inspect.signature(lambda self, model=None, *, config=None, **settings: None)
    assert shown_settings(unspelled) != expected  # a bare **settings signature is caught


def settings_not_named(doc: str) -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig) if f"``{f.name}``" not in doc]


def test_help_llm_names_every_setting():
    assert settings_not_named(LLM.__init__.__doc__) == []
    assert settings_not_named("``device``, ``dtype``") != []  # a docstring that forgot some is caught
    assert all(f"{f.name}:" in EngineConfig.__doc__ for f in dataclasses.fields(EngineConfig))


def test_an_unknown_setting_is_a_type_error_naming_it_and_the_valid_ones(monkeypatch):
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_block'.*num_blocks, kv_cache_memory_gb"):
        LLM(device="cpu", num_block=8)
    with pytest.raises(TypeError, match="not both"):
        LLM(config=EngineConfig(device="cpu"), num_blocks=8)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got dict"):
        LLM(config={"device": "cpu"})


def test_llm_keywords_and_config_give_the_same_engine_config():
    by_keywords = LLM(device="cpu", num_blocks=16, max_num_seqs=4)
    config = EngineConfig(device="cpu", num_blocks=16, max_num_seqs=4)
    assert by_keywords.llm_engine.config == config  # every other field took EngineConfig's default
    assert LLM(config=config).llm_engine.config is config


def test_the_command_line_takes_its_defaults_from_engine_config():
    parser = argparse.ArgumentParser()
    cli._engine_args(parser)
    args = parser.parse_args([])
    defaults = EngineConfig()
    assert cli.ENGINE_OPTIONS and all(getattr(args, name) == getattr(defaults, name) for name in cli.ENGINE_OPTIONS)
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--block-size", "0"])  # EngineConfig's check, as a usage error


@pytest.mark.parametrize(
    "make",
    [
        lambda size: EngineConfig(block_size=size),
        lambda size: Request("r", [1, 2, 3], block_size=size),
        lambda size: KVCacheManager(4, block_size=size),
        lambda size: hash_request_tokens([1, 2, 3], size),
        lambda size: profiler.explain_miss([1, 2], [1, 3], block_size=size),
    ],
    ids=["EngineConfig", "Request", "KVCacheManager", "hash_request_tokens", "explain_miss"],
)
def test_every_block_size_is_checked_by_one_function(make):
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        make(0)
    with pytest.raises(TypeError, match="block_size must be a positive integer, got bool True"):
        make(True)


def test_one_default_block_size():
    for function in (Request, KVCacheManager, CacheReplica, profiler.explain_miss):
        assert inspect.signature(function).parameters["block_size"].default == DEFAULT_BLOCK_SIZE
    assert EngineConfig().block_size == DEFAULT_BLOCK_SIZE
