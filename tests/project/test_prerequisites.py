"""A skip for a missing prerequisite is a skip on a laptop and a failure under CI (tests/prerequisites.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prerequisites import PREREQUISITES, reason_for

TESTS = Path(__file__).resolve().parents[1]  # tests/, where prerequisites.py is

SAMPLE = """
import pytest
from prerequisites import missing, skip_if_missing

def test_needs_vllm():
    missing("vllm", "vLLM cannot be installed here: no wheel")

@skip_if_missing(True, "real-model", "run make real-model")
def test_needs_the_real_model():
    pass

def test_needs_cuda():
    pytest.skip("no CUDA here")

def test_runs():
    pass
"""


def run_sample(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "prerequisites",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "test_sample.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_missing_prerequisite_skips_without_ci(tmp_path):
    done = run_sample(tmp_path, ci=None)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 3 skipped" in done.stdout
    assert "[missing prerequisite: vllm] vLLM cannot be installed here: no wheel" in done.stdout


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_missing_prerequisite_fails_under_ci_and_other_skips_stay_skips(tmp_path, ci):
    done = run_sample(tmp_path, ci=ci)
    assert done.returncode == 1, done.stdout
    assert "FAILED test_sample.py::test_needs_vllm" in done.stdout
    assert "ERROR test_sample.py::test_needs_the_real_model" in done.stdout  # a skipif fails in its setup
    assert "SKIPPED" in done.stdout and "no CUDA here" in done.stdout
    assert "1 failed, 1 passed, 1 skipped, 1 error" in done.stdout
    assert "CI=true: [missing prerequisite: vllm]" in done.stdout


def test_ci_false_is_not_ci(tmp_path):
    assert run_sample(tmp_path, ci="false").returncode == 0


def test_only_known_prerequisites_are_tagged():
    assert set(PREREQUISITES) == {"chromium", "playwright", "vllm", "vllm-router", "real-model", "npm"}
    with pytest.raises(ValueError, match="unknown prerequisite"):
        reason_for("cuda", "no GPU")
