"""Ways in from outside the process: the OpenAI-compatible HTTP server and the command line.

``async_llm.AsyncLLM`` runs one engine loop for many concurrent callers;
``openai.api_server`` puts FastAPI in front of it. vLLM's layout:
``vllm/v1/engine/async_llm.py`` and ``vllm/entrypoints/openai/``. ``cli`` is
``python -m mini_vllm`` (``serve``, ``bench``, ``compare-vllm``, ``grade``, ...;
vLLM's: ``vllm/entrypoints/cli/``).
"""
