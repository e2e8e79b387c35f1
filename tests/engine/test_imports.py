"""Imports are light and change nothing: the engine's bookkeeping modules load without torch or
transformers, importing anything in ``mini_vllm`` sets no environment variable, and the engine
modules import each other without a cycle.

Each import runs in a fresh interpreter (what this test process already imported says nothing),
with ``TRITON_INTERPRET`` removed from its environment: ``tests/conftest.py`` sets it for the
kernel tests, and an import that sets it must be caught here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from import_graph import ROOT, engine_files, find_cycles, import_graph

# Bookkeeping modules: chapters 04-06 and the scheduler's tests use them without a model.
LIGHT_MODULES = [
    "mini_vllm",
    "mini_vllm.hashing",
    "mini_vllm.block_pool",
    "mini_vllm.kv_cache_manager",
    "mini_vllm.config",
    "mini_vllm.sampling_params",
    "mini_vllm.request",
    "mini_vllm.scheduler",
    "mini_vllm.events",
    "mini_vllm.outputs",
    "mini_vllm.parallel_sampling",
    "mini_vllm.registry",
    "mini_vllm.attention",
]


def import_in_fresh_process(statement: str) -> dict:
    """Run ``statement`` in a new interpreter; report the heavy modules it loaded and the variables it changed."""
    script = textwrap.dedent(
        f"""
        import json, os, sys
        before = dict(os.environ)
        {statement}
        after = dict(os.environ)
        print(json.dumps({{
            "loaded": sorted(m for m in ("torch", "transformers", "triton", "mini_vllm.kernels") if m in sys.modules),
            "changed": sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)),
        }}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_bookkeeping_modules_load_without_torch_and_change_no_environment_variable(module):
    report = import_in_fresh_process(f"import {module}")
    assert report == {"loaded": [], "changed": []}, f"import {module}: {report}"


def test_importing_the_offline_api_changes_no_environment_variable():
    # LLM needs torch and transformers, but not the Triton kernels: `mini_vllm.kernels` decides on
    # TRITON_INTERPRET when it is imported, so it is imported only once a backend needs it.
    report = import_in_fresh_process("from mini_vllm import LLM, SamplingParams, default_model_path")
    assert "torch" in report["loaded"]
    assert "mini_vllm.kernels" not in report["loaded"] and "triton" not in report["loaded"], report
    assert report["changed"] == [], report


def test_package_names_are_imported_on_first_use():
    import mini_vllm

    from mini_vllm import LLM, SamplingParams, default_model_path  # the notebooks' import
    from mini_vllm.llm import LLM as llm_LLM
    from mini_vllm.model import default_model_path as model_default_model_path
    from mini_vllm.sampling_params import SamplingParams as sp_SamplingParams

    assert (LLM, SamplingParams, default_model_path) == (llm_LLM, sp_SamplingParams, model_default_model_path)
    for name in mini_vllm.__all__:
        assert getattr(mini_vllm, name) is not None
    assert set(mini_vllm.__all__) <= set(dir(mini_vllm))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        mini_vllm.not_a_name  # noqa: B018
    from mini_vllm import hashing  # a submodule, as before

    assert hashing.__name__ == "mini_vllm.hashing"


def test_the_engine_modules_import_each_other_without_a_cycle():
    files = engine_files()
    assert len(files) >= 20 and all(path.is_file() for path in files)
    assert find_cycles(import_graph(files)) == []  # as the interpreter runs them, on import
    # Counting imports inside functions too: a function-level import only hides a cycle.
    assert find_cycles(import_graph(files, module_level_only=False)) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    package = tmp_path / "mini_vllm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("from .hashing import HASH_FUNCTIONS\n")
    (package / "hashing.py").write_text("HASH_FUNCTIONS = {}\ndef f():\n    from .config import x\n")
    (package / "leaf.py").write_text("from . import hashing\n")
    files = sorted(package.glob("*.py"))
    assert find_cycles(import_graph(files, tmp_path)) == []
    assert find_cycles(import_graph(files, tmp_path, module_level_only=False)) == [
        ["mini_vllm.config", "mini_vllm.hashing"]
    ]
    assert import_graph(files, tmp_path)["mini_vllm.leaf"] == {"mini_vllm", "mini_vllm.hashing"}
