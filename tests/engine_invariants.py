"""One "nothing leaked" check for every test that drives a whole engine.

After an engine has served (or refused, or lost to a fault) every request given
to it, nothing of those requests may remain: every block back in the free
queue, no block table, no per-request state in the engine or the scheduler,
and the KV-cache manager's own invariants intact.
"""

from __future__ import annotations

from collections import deque
from typing import Any


# Containers on these objects that are not per request (anything else must be empty when idle).
NOT_PER_REQUEST = {"eos_token_ids"}


def per_request_containers(engine) -> dict[str, Any]:
    """Every dict, list, set or deque held by the engine, its scheduler, its KV-cache manager or a group's, by name.

    Found by looking, not listed by hand: a container added later is checked too.
    """
    containers = {}
    manager = engine.scheduler.kv_cache_manager
    for owner in (engine, engine.scheduler, manager, *manager.managers):  # and each KV-cache group's manager
        for name, value in vars(owner).items():
            if isinstance(value, (dict, list, set, deque)) and name not in NOT_PER_REQUEST:
                containers[f"{type(owner).__name__}.{name}"] = value
    return containers


def assert_nothing_leaked(engine) -> None:
    """``engine``: an ``LLMEngine`` or an ``LLM`` (its ``llm_engine`` is checked)."""
    engine = getattr(engine, "llm_engine", engine)
    manager = engine.kv_cache_manager
    manager.check_invariants()
    assert manager.get_num_free_blocks() == manager.num_blocks, (
        f"{manager.num_blocks - manager.get_num_free_blocks()} blocks still in use"
    )
    left = {name: value for name, value in per_request_containers(engine).items() if value}
    assert not left, f"per-request state left: {left}"
    assert not engine.has_unfinished_requests()
