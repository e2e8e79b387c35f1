"""Print how vLLM groups a model's layers into KV-cache groups (the grouping's differential test).

Run with the Python of a virtualenv that has vLLM (``.venv-vllm``), optionally
with ``PYTHONPATH`` at a release's files: it imports only vLLM and the standard
library. ``tests/vs_vllm/test_vs_vllm_hybrid_kv_cache_manager.py`` sends it, on
stdin, ``{"workloads": [{"windows": [None | W, ...], "block_size": B,
"disable_hybrid_kv_cache_manager": bool}, ...]}`` (layer ``i``'s sliding
window, None for full attention) and reads one list of groups per layout,
``[{"window": None | W, "layers": [i, ...]}, ...]`` in vLLM's group order, or
``{"error": message}`` for a layout vLLM refuses with a ValueError.

It runs ``get_kv_cache_groups``' path for attention layers of one page size
(``vllm/v1/core/kv_cache_planning.py``): ``unify_hybrid_kv_cache_specs`` when
the hybrid manager is off, then one group when every spec is the same or of
one uniform type, else ``_get_kv_cache_groups_uniform_page_size``.
"""

from __future__ import annotations

import json
import sys


def groups_of(windows: list, block_size: int, disable_hybrid: bool) -> list[dict]:
    import torch
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

    def spec(window):
        if window is None:
            return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
        return SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=window
        )

    specs = {f"model.layers.{i}.self_attn.attn": spec(window) for i, window in enumerate(windows)}
    if disable_hybrid:
        planning.unify_hybrid_kv_cache_specs(specs)
    if planning.is_kv_cache_spec_uniform(specs):
        groups = planning._get_kv_cache_groups_uniform_spec(specs)
    elif uniform := UniformTypeKVCacheSpecs.from_specs(specs):
        groups = planning._get_kv_cache_groups_uniform_type(uniform)
    else:
        groups = planning._get_kv_cache_groups_uniform_page_size(specs)
    result = []
    for group in groups:
        first = group.kv_cache_spec
        if isinstance(first, UniformTypeKVCacheSpecs):
            first = next(iter(first.kv_cache_specs.values()))
        result.append(
            {
                "window": first.sliding_window if isinstance(first, SlidingWindowSpec) else None,
                "layers": [int(name.split(".")[2]) for name in group.layer_names],
            }
        )
    return result


def main() -> None:
    import logging

    logging.disable(logging.WARNING)
    import vllm

    payload = json.load(sys.stdin)
    results = []
    for w in payload["workloads"]:
        try:
            results.append(groups_of(w["windows"], w["block_size"], w["disable_hybrid_kv_cache_manager"]))
        except ValueError as error:  # a layout vLLM refuses
            results.append({"error": str(error)})
    json.dump({"vllm_version": vllm.__version__, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
