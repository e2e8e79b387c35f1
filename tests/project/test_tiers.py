"""The tiers do their job: ``make test-fast`` catches a planted bug in the engine, a check or the server.

Each case copies the checkout, plants one bug, and runs the fast tier's selection
(the Makefile's own FAST_MARKERS) over the layer the bug is in, stopping at the
first failure. The copy comes first on ``sys.path``, so its ``mini_vllm`` is the
one imported. Without the bug the same selection passes (``make test-fast``,
and ``make test`` around this file).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()


def make_variable(name: str) -> str:
    match = re.search(rf"^{name}\s*:=\s*(.+)$", MAKEFILE, flags=re.MULTILINE)
    assert match, f"the Makefile defines no {name}"
    return match.group(1).strip()


FAST_FOLDERS = make_variable("FAST_FOLDERS").split()
FAST_MARKERS = make_variable("FAST_MARKERS")

# (layer, file, the line as it is, the line with the bug): one bug a layer.
BUGS = {
    "engine: a cache hit takes no reference on its block": (
        "tests/engine",
        "mini_vllm/block_pool.py",
        "            block.ref_cnt += 1\n",
        "            pass\n",
    ),
    "check: a check accepts a wrong answer": (
        "tests/course",
        "mini_vllm/course/_harness.py",
        "        if got != expected:\n",
        "        if False:\n",
    ),
    "server: cached_tokens is always 0": (
        "tests/server",
        "mini_vllm/entrypoints/openai/protocol.py",
        '"prompt_tokens_details": {"cached_tokens": cached_tokens} if with_details else None,',
        '"prompt_tokens_details": {"cached_tokens": 0} if with_details else None,',
    ),
}


def test_the_tiers_in_the_makefile_are_the_layers():
    assert FAST_FOLDERS == ["tests/engine", "tests/kernels", "tests/course", "tests/server", "tests/project"]
    for folder in FAST_FOLDERS:
        assert (ROOT / folder).is_dir(), folder
    assert "not slow" in FAST_MARKERS and "not real_model" in FAST_MARKERS and "not vllm" in FAST_MARKERS


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_the_fast_tier_fails_on_a_planted_bug(bug, tmp_path):
    folder, path, line, planted = BUGS[bug]
    assert folder in FAST_FOLDERS
    copy = tmp_path / "checkout"
    ignore = shutil.ignore_patterns(".venv*", ".git", "models", "build", "my-course", "__pycache__", "*.egg-info")
    shutil.copytree(ROOT, copy, ignore=ignore)
    source = (copy / path).read_text()
    assert source.count(line) == 1, f"{path} no longer has the line this test changes: {line!r}"
    (copy / path).write_text(source.replace(line, planted))

    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    which = [sys.executable, "-c", "import mini_vllm; print(mini_vllm.__file__)"]
    imported = subprocess.run(which, cwd=copy, env=env, capture_output=True, text=True, timeout=120).stdout
    assert Path(imported.strip()).is_relative_to(copy), f"the copy's mini_vllm is not the one imported: {imported}"
    command = [sys.executable, "-m", "pytest", folder, "-m", FAST_MARKERS, "-x", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 1, f"{bug}: the fast tier did not fail\n{result.stdout[-3000:]}{result.stderr[-2000:]}"
    assert re.search(r"\b1 failed\b", result.stdout), result.stdout[-3000:]
