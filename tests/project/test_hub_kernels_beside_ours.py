"""Hugging Face's ``kernels`` package installed beside the course: neither shadows the other.

``kernels`` is the import name of Hugging Face's kernel hub package, which
transformers 5.25 and newer depend on and import (``from kernels import ...``).
The course's kernels are ``mini_vllm.kernels`` (the top-level ``kernels/``
folder, which has no ``__init__.py``), so both import, whatever comes first on
``sys.path``. Each case runs in a fresh interpreter, as a learner would:

- from the repository root with the root first on the path (``PYTHONPATH=.``,
  and ``python -c`` there puts the working folder first too): where a
  top-level ``kernels/`` package would shadow theirs;
- from ``notebooks/``, where ``make lab``'s chapters run.

What each run does: the Triton, C (``cpu``) and torch attention backends
generate the same tokens; the chapter 07 kernel checks pass on the engine's
kernels; transformers loads the bundled model (and, marked ``real_model``, the
real one). ``make test`` installs the hub package (pyproject's test extra);
``make test-latest`` runs this file against the newest transformers too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prerequisites import distribution_installed, under_ci

ROOT = Path(__file__).resolve().parents[2]
REAL_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"

# (working folder, PYTHONPATH): the two places a learner's code runs from.
PLACES = {
    "root on the path": (ROOT, str(ROOT)),
    "notebooks/": (ROOT / "notebooks", None),
}

HUB_IS_THEIRS = """
import importlib.metadata, sys
import kernels as hub
assert hasattr(hub, "get_kernel"), f"import kernels found {hub.__file__}, not Hugging Face's kernel hub package"
assert "site-packages" in hub.__file__, hub.__file__
import inspect
from packaging.version import parse
from transformers.utils.import_utils import is_kernels_available
window = {k: v.default for k, v in inspect.signature(is_kernels_available).parameters.items()}
admitted = parse(window["MIN_VERSION"]) <= parse(importlib.metadata.version("kernels")) < parse(window["MAX_VERSION"])
assert is_kernels_available() == admitted, "transformers takes something else for Hugging Face's kernels"
from mini_vllm import kernels as ours
assert ours is not hub and ours.__name__ == "mini_vllm.kernels"
assert ours.KERNELS_DIR == ROOT / "kernels", ours.KERNELS_DIR
print("hub:", importlib.metadata.version("kernels"), "| transformers:", importlib.metadata.version("transformers"))
"""

BACKENDS_GENERATE = """
from mini_vllm import LLM, SamplingParams
prompts = ["The paged KV cache", "Prefix caching reuses"]
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
tokens = {}
for backend in ("torch", "cpu", "triton"):
    llm = LLM(device="cpu", attention_backend=backend)
    tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 4 for t in tokens[backend]), (backend, tokens[backend])
assert tokens["cpu"] == tokens["torch"] == tokens["triton"], tokens
print("backends: the same tokens on torch, cpu and triton")
"""

KERNEL_CHECKS = """
import torch
from mini_vllm import kernels
from mini_vllm.course.kernel_checks import check_paged_decode, check_store_kv

def paged_decode(query, k_cache, v_cache, block_table, seq_len, scale=None):
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    return kernels.reference.paged_attention(query[None], k_cache, v_cache, block_table[None], seq_lens, scale)[0]

check_store_kv(kernels.store_kv)
check_paged_decode(paged_decode)
"""

TRANSFORMERS_LOADS = """
import transformers
model = transformers.AutoModelForCausalLM.from_pretrained(MODEL)
print("transformers loaded", type(model).__name__)
"""


def run_in(place: str, *snippets: str, model: Path | None = None, script_dir: Path) -> subprocess.CompletedProcess:
    """Run the snippets as ``python -c`` in ``place`` (the working folder first on sys.path), from a
    file so that the kernel checks can read the source of the functions they are given."""
    cwd, pythonpath = PLACES[place]
    header = f"from pathlib import Path\nROOT = Path({str(ROOT)!r})\n"
    if model is not None:
        header += f"MODEL = {str(model)!r}\n"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    script = script_dir / "snippets.py"
    script.write_text(header + "\n".join(textwrap.dedent(s) for s in snippets))
    run = f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))"
    return subprocess.run([sys.executable, "-c", run], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def hub_installed() -> bool:
    return distribution_installed("kernels")


# The test extra installs it (make test, make test-fast); without it these tests prove nothing.
pytestmark = pytest.mark.skipif(
    not hub_installed() and not under_ci(),
    reason="Hugging Face's kernels is not installed: pip install -e '.[test]' (make test-fast does)",
)


def test_the_hub_package_is_installed_here():
    """Under CI the skip above never applies: a test environment without the hub package fails here."""
    assert hub_installed(), "pyproject's test extra installs Hugging Face's kernels; this environment lacks it"


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
@pytest.mark.parametrize("place", sorted(PLACES))
def test_every_backend_generates_and_the_kernel_checks_pass(place, tmp_path):
    result = run_in(place, HUB_IS_THEIRS, BACKENDS_GENERATE, KERNEL_CHECKS, script_dir=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "the same tokens on torch, cpu and triton" in result.stdout
    assert "✓ store_kv:" in result.stdout and "✓ paged_decode:" in result.stdout, result.stdout


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
@pytest.mark.parametrize("place", sorted(PLACES))
def test_transformers_loads_the_bundled_model(place, tmp_path):
    from mini_vllm.model import default_model_path

    result = run_in(place, HUB_IS_THEIRS, TRANSFORMERS_LOADS, model=default_model_path(), script_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "transformers loaded" in result.stdout


@pytest.mark.real_model
@pytest.mark.parametrize("place", sorted(PLACES))
def test_transformers_loads_the_real_model(place, tmp_path):
    if not (REAL_MODEL / "config.json").is_file():
        from prerequisites import missing

        missing("real-model", "SmolLM2-135M-Instruct is not converted: run `make real-model`")
    result = run_in(place, HUB_IS_THEIRS, TRANSFORMERS_LOADS, model=REAL_MODEL, script_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "transformers loaded" in result.stdout


def test_a_top_level_kernels_package_in_the_checkout_would_be_caught(tmp_path):
    """The check above can fail: a checkout whose kernels/ has an __init__.py (the old layout)
    shadows the hub package from the root, and HUB_IS_THEIRS says so."""
    fake_root = tmp_path / "checkout"
    (fake_root / "kernels").mkdir(parents=True)
    (fake_root / "kernels" / "__init__.py").write_text("TRITON_AVAILABLE = True\n")
    env = {**os.environ, "PYTHONPATH": str(fake_root)}
    code = f"from pathlib import Path\nROOT = Path({str(ROOT)!r})\n" + textwrap.dedent(HUB_IS_THEIRS)
    result = subprocess.run([sys.executable, "-c", code], cwd=fake_root, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "not Hugging Face's kernel hub package" in result.stderr
