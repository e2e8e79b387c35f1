"""Code that runs inside real vLLM's own virtualenv (``.venv-vllm/``, made by ``make vllm``).

Nothing here imports mini-vLLM: each file is started as a script by
``.venv-vllm/bin/python`` and may use only vLLM and the standard library.

* ``run_vllm.py``: whole workloads through vLLM's ``LLM``;
  ``mini_vllm/tools/compare_vllm/`` starts it and compares its answers with mini-vLLM's.
* ``kv_cache_manager_driver.py``: vLLM's ``KVCacheManager`` driven call by call;
  ``tests/vs_vllm/test_vs_vllm_kv_cache_manager.py`` compares it with mini-vLLM's after every call,
  ``tests/vs_vllm/test_vs_vllm_hybrid_kv_cache_manager.py`` the same for a hybrid model (a
  full-attention and a sliding-window KV-cache group).
"""
