"""One "nothing leaked" check for every test that drives a whole engine.

After an engine has served (or refused, or lost to a fault) every request given
to it, nothing of those requests may remain: every block back in the free
queue, no block table, no per-request state in the engine or the scheduler,
and the KV-cache manager's own invariants intact.
"""

from __future__ import annotations


def assert_nothing_leaked(engine) -> None:
    """``engine``: an ``LLMEngine`` or an ``LLM`` (its ``llm_engine`` is checked)."""
    engine = getattr(engine, "llm_engine", engine)
    manager = engine.kv_cache_manager
    manager.check_invariants()
    assert manager.get_num_free_blocks() == manager.num_blocks, (
        f"{manager.num_blocks - manager.get_num_free_blocks()} blocks still in use"
    )
    assert not manager.req_to_blocks and not manager.num_cached_block, f"block tables left: {list(manager.req_to_blocks)}"
    assert not engine.requests and not engine.generators and not engine.metrics, f"requests left: {list(engine.requests)}"
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert not engine.has_unfinished_requests()
