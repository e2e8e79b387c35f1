"""Where real vLLM is, and running it: a job for ``vllm_side/run_vllm.py`` in vLLM's own virtualenv.

``make vllm`` installs vLLM into ``.venv-vllm/``; ``run_vllm`` sends engine specs
(``block_size``, ``num_blocks``, ``workloads``) to one subprocess of its Python
and reads back what vLLM did. vLLM's own side is ``vllm.LLM``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from .. import paths
from .workloads import CACHE_SETTINGS, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, engine_max_model_len

VLLM_VENV = paths.VLLM_VENV
# Written by ``make vllm`` when it could install vLLM / when it could not (with the reason).
VLLM_READY_MARKER = VLLM_VENV / ".installed"
VLLM_UNAVAILABLE_MARKER = VLLM_VENV / ".unavailable"
DRIVER = paths.VLLM_SIDE_DIR / "run_vllm.py"


def vllm_python() -> str | None:
    """The Python of vLLM's virtualenv, or None when ``make vllm`` has not installed it.

    ``MINI_VLLM_VLLM_PYTHON`` overrides the location (a vLLM you installed elsewhere).
    """
    override = os.environ.get("MINI_VLLM_VLLM_PYTHON")
    if override:
        return override if Path(override).exists() else None
    python = VLLM_VENV / "bin" / "python"
    if VLLM_READY_MARKER.exists() and python.exists():
        return str(python)
    return None


def vllm_missing_reason() -> str:
    """Why ``vllm_python()`` is None, in one line (for skip messages and notebooks)."""
    if VLLM_UNAVAILABLE_MARKER.exists():
        return "vLLM cannot be installed here: " + VLLM_UNAVAILABLE_MARKER.read_text().strip()
    return "real vLLM is not installed: run `make vllm` (it installs vLLM into .venv-vllm/)"


def run_vllm(
    model_path: str,
    engines: list[dict],
    dtype: str = "float32",
    threads: int = 1,
    probes: bool = False,
    timeout_s: int = 900,
    configuration: str = "comparable",
) -> dict:
    """vLLM's side: one subprocess of ``.venv-vllm/bin/python`` runs every engine spec, one after
    another (and, with ``probes``, drives vLLM's cache classes directly: ``run_vllm.run_probes``).

    ``configuration``: ``"comparable"`` (eager, synchronous scheduling, the engine core in
    the same process: the settings ``run_vllm.py``'s docstring explains) or ``"default"``
    (vLLM's own defaults on a CPU: compiled, asynchronous scheduling, a separate engine core).
    """
    job = {
        "threads": threads,
        "probes": probes,
        "configuration": configuration,
        "engines": [
            {
                "model": spec.get("model", model_path),
                "dtype": dtype,
                "block_size": spec["block_size"],
                "num_blocks": spec["num_blocks"],
                "max_model_len": spec.get("max_model_len")
                or engine_max_model_len(spec["block_size"], spec["num_blocks"]),
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "workloads": spec["workloads"],
                **({"model_impl": spec["model_impl"]} if spec.get("model_impl") else {}),
                **{name: spec[name] for name in CACHE_SETTINGS if name in spec},
            }
            for spec in engines
        ],
    }
    return run_vllm_job(job, timeout_s)


def run_vllm_job(job: dict, timeout_s: int = 900, pythonpath: str | None = None) -> dict:
    """One job for ``mini_vllm/tools/vllm_side/run_vllm.py`` (its docstring says the format), run in vLLM's virtualenv.

    ``pythonpath``: a release's Python files to import vLLM from instead of the installed one's
    (``.vllm-<version>/src``, from ``benchmarks/get_vllm_source.sh``; for what needs no compiled kernel).
    """
    python = vllm_python()
    if python is None:
        raise RuntimeError(vllm_missing_reason())
    with tempfile.TemporaryDirectory(prefix="compare-vllm-") as folder:
        job_path, result_path = Path(folder) / "job.json", Path(folder) / "result.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # vLLM's virtualenv must not see this one's packages
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        completed = subprocess.run(
            [python, str(DRIVER), str(job_path), str(result_path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=folder,
        )
        if completed.returncode != 0 or not result_path.exists():
            tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"vLLM exited with status {completed.returncode}:\n{tail}")
        return json.loads(result_path.read_text())
