"""Chapter companions: small programs built on the engine that a chapter studies beside it.

* ``profiler`` — why a prompt missed the cache: the first differing token and
  the block it falls in (chapters 04, 09);
* ``router`` — a cache-aware router over several engines that mirrors their
  KV-cache events (chapter 09b);
* ``radix_cache`` — SGLang's radix tree, on the same workloads as the hash
  map (chapter 06b).

They import the engine; the engine never imports them (``tests/engine/test_import_contracts.py``).
"""
