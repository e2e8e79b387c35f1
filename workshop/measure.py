"""Measure what each chapter and exercise costs one learner: wall time and peak memory of a headless run.

    .venv/bin/python workshop/measure.py [--out workshop/measured.json] [NOTEBOOK ...]

Each notebook (default: every chapter in ``notebooks/`` and every exercise's
filled-in twin in ``solutions/``, i.e. the exercise as a learner who solved it
runs it) is copied into a temporary folder outside the repository and executed
there, top to bottom, by

    /usr/bin/time -f '%e %M' jupyter nbconvert --to notebook --execute COPY --output-dir TMP

with ``OMP_NUM_THREADS=1`` (what the hub gives every learner) and a private,
empty parts folder (``MINI_VLLM_PARTS``). ``%M`` is the largest resident set of
the process tree that ``time`` waited for: in practice the kernel (torch, the
model, the widgets), as in README's "Memory" paragraph. The wall time includes
nbconvert's start and the kernel's start (about 3-5 s). The committed
notebooks are never touched. The machine's load average before and after each
run is recorded too: on a shared machine the times are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def default_notebooks() -> list[Path]:
    chapters = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb"))
    solutions = sorted((ROOT / "solutions").glob("[0-9][0-9]*_*.ipynb"))
    return chapters + solutions


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(("MEASURED ", "Command exited"))]
    return lines[-1][:300] if lines else "failed"


def measure(notebook: Path, timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="mv-measure-") as tmp:
        tmp = Path(tmp)
        copy = tmp / notebook.parent.name / notebook.name  # notebooks/, solutions/: relative links still resolve
        copy.parent.mkdir()
        shutil.copyfile(notebook, copy)
        parts = tmp / "parts"
        env = dict(os.environ, OMP_NUM_THREADS="1", MINI_VLLM_PARTS=str(parts))
        command = [
            "/usr/bin/time",
            "-f",
            "MEASURED %e %M",
            sys.executable,
            "-m",
            "jupyter",
            "nbconvert",
            "--to",
            "notebook",
            "--execute",
            f"--ExecutePreprocessor.timeout={timeout}",
            str(copy),
            "--output-dir",
            str(tmp / "out"),
        ]
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        result = subprocess.run(command, cwd=copy.parent, env=env, capture_output=True, text=True)
        elapsed = time.monotonic() - started
        load_after = os.getloadavg()[0]
    line = next((ln for ln in result.stderr.splitlines() if ln.startswith("MEASURED ")), "")
    _, seconds, max_kb = line.split() if line else ("", str(elapsed), "0")
    return {
        "notebook": f"{notebook.parent.name}/{notebook.name}",
        "ok": result.returncode == 0,
        "wall_s": round(float(seconds), 1),
        "peak_rss_gb": round(int(max_kb) / 1024 / 1024, 2),
        "load_before": round(load_before, 2),
        "load_after": round(load_after, 2),
        "error": "" if result.returncode == 0 else _last_error(result.stderr),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "workshop" / "measured.json")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    args = parser.parse_args(argv)
    notebooks = [p.resolve() for p in args.notebooks] or default_notebooks()
    rows = []
    for notebook in notebooks:
        row = measure(notebook, args.timeout)
        rows.append(row)
        print(
            f"{row['notebook']:<48} {'ok ' if row['ok'] else 'ERR'} {row['wall_s']:7.1f} s  "
            f"{row['peak_rss_gb']:.2f} GB  load {row['load_before']:.1f}->{row['load_after']:.1f}  {row['error']}",
            flush=True,
        )
        # Written after every notebook: a long run that is stopped keeps what it measured.
        args.out.write_text(
            json.dumps(
                {
                    "how": "workshop/measure.py: /usr/bin/time around jupyter nbconvert --execute on a copy, "
                    "OMP_NUM_THREADS=1, one notebook at a time",
                    "when": time.strftime("%Y-%m-%d"),
                    "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.system()}",
                    "real_model": (ROOT / "models" / "SmolLM2-135M-Instruct" / "provenance.json").exists(),
                    "real_vllm": (ROOT / ".venv-vllm" / ".installed").exists(),
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
