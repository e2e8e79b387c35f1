"""The repository's tools, built on the engine and never imported by it.

* ``bench`` — ``make bench``: every benchmark, side by side with real vLLM;
* ``compare_vllm`` — the same workloads through mini-vLLM and real vLLM
  (which runs in its own virtualenv, driven by the scripts in ``vllm_side/``,
  which import only vLLM);
* ``compare_servers`` — mini-vLLM's OpenAI server against vLLM's, over HTTP;
* ``real_model`` — ``make real-model``: SmolLM2-135M-Instruct from a PyPI wheel;
* ``paths`` — where everything lives in a checkout.
"""
