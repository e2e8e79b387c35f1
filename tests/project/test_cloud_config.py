"""The cloud and container set-ups are well formed: binder/ (repo2docker, mybinder.org) and .devcontainer/.

Neither can be built here (no Docker, no network to Binder), so these tests check
what repo2docker and the dev-container tools read: the files parse, Binder's
environment is built before the repository is copied in (so it must not refer to
the repository's files), pins Python and the CPU build of torch and names the same
packages as pyproject.toml; postBuild and start are executable shell scripts,
postBuild installs the package and prepares what ``make lab`` prepares (run here
on a copy of the course); the dev container's post-create command runs a make
target that exists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import yaml
from traitlets.config import Config

from mini_vllm.course import lab

ROOT = Path(__file__).resolve().parents[2]
BINDER = ROOT / "binder"
DEVCONTAINER = ROOT / ".devcontainer" / "devcontainer.json"


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower()


def binder_pip() -> list[str]:
    env = yaml.safe_load((BINDER / "environment.yml").read_text())
    return next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)


def repository_references(pip: list[str]) -> list[str]:
    """The pip lines that need the repository's files (an editable install, a requirements or constraints file, a path)."""
    return [r for r in pip if r.startswith(("-e", "-r", "-c", ".", "/")) or "file:" in r]


def makefile_targets(makefile: str | None = None) -> set[str]:
    text = (ROOT / "Makefile").read_text() if makefile is None else makefile
    return set(re.findall(r"^([\w-]+):", text, flags=re.MULTILINE))


def test_binder_environment_pins_python_and_cpu_torch_and_never_names_the_repository():
    env = yaml.safe_load((BINDER / "environment.yml").read_text())
    pythons = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    assert pythons == ["python=3.11"], "a pinned Python (the one the course is tested with)"
    pip = binder_pip()
    assert "torch==2.13.0+cpu" in pip and "--extra-index-url https://download.pytorch.org/whl/cpu" in pip
    # repo2docker builds this before it copies the repository: `-e .`, `-r`/`-c` files and paths would fail.
    assert not repository_references(pip), f"binder/environment.yml refers to the repository: {pip}"


def test_binder_environment_names_the_course_packages_at_the_tested_versions():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["course"]}
    listed = {_name(r) for r in binder_pip() if not r.startswith("-")}
    assert listed == wanted, f"only in binder/environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    for requirement in binder_pip():
        name = _name(requirement)
        if name in pins:
            assert requirement == f"{name}=={pins[name]}", f"{requirement}: constraints.txt pins {pins[name]}"


def _is_executable_script(path: Path) -> None:
    assert path.stat().st_mode & stat.S_IXUSR, f"{path.name} must be executable (repo2docker runs it)"
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_postbuild_is_executable_and_installs_the_package():
    postbuild = BINDER / "postBuild"
    _is_executable_script(postbuild)
    text = postbuild.read_text()
    assert "set -euo pipefail" in text
    assert re.search(r'^python -m pip install .*-c constraints\.txt -e "\.\[course\]"$', text, flags=re.MULTILINE)


def test_start_is_executable_and_runs_the_command_it_is_given():
    start = BINDER / "start"
    _is_executable_script(start)
    assert start.read_text().rstrip().endswith('exec "$@"')
    done = subprocess.run([str(start), "bash", "-c", "echo $OMP_NUM_THREADS"], capture_output=True, text=True)
    assert done.stdout.strip() == "1"


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
def test_postbuild_prepares_the_working_copy_and_jupyter_as_make_lab_does(tmp_path):
    """postBuild's Python step, run on a copy of the course with its own HOME (the checkout is not touched)."""
    step = re.search(r"^python - <<'PY'\n(.*?)^PY$", (BINDER / "postBuild").read_text(), flags=re.S | re.M).group(1)
    copy = tmp_path / "repo"
    for folder in ("mini_vllm", "kernels", *lab.COPIED_FOLDERS):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": str(copy)}
    done = subprocess.run([sys.executable, "-c", step], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (copy / lab.START_NOTEBOOK).is_file(), "the Binder link opens the working copy's chapter 00"
    config = Config()  # what Jupyter loads from ~/.jupyter/jupyter_server_config.py
    exec((tmp_path / "home" / ".jupyter" / "jupyter_server_config.py").read_text(), {"c": config})
    assert config.ContentsManager.pre_save_hook == "mini_vllm.course.lab.pre_save_hook"
    assert Path(config.LabApp.app_settings_dir) == copy / "mini_vllm" / "course" / "lab_settings"
    assert (Path(config.LabApp.app_settings_dir) / "overrides.json").is_file()
    # the same settings make lab passes on its command line
    command = " ".join(lab.server_command(copy))
    assert "--ContentsManager.pre_save_hook=mini_vllm.course.lab.pre_save_hook" in command
    assert "--LabApp.app_settings_dir=" in command


def test_devcontainer_parses_and_runs_an_existing_make_target_after_creation():
    config = json.loads(DEVCONTAINER.read_text())
    assert config["image"].startswith("mcr.microsoft.com/devcontainers/python:")
    assert "3.11" in config["image"], "the same Python as Binder's"
    targets = re.findall(r"\bmake ([\w-]+)", config["postCreateCommand"])
    assert targets and set(targets) <= makefile_targets(), (targets, "must be targets of the Makefile")
    assert 8888 in config["forwardPorts"]


def test_a_repository_path_in_binder_or_a_missing_make_target_would_be_caught():
    assert repository_references(["-e .", "-c constraints.txt", "torch==2.13.0+cpu", "./wheels/x.whl"]) == [
        "-e .",
        "-c constraints.txt",
        "./wheels/x.whl",
    ]
    assert makefile_targets("lab: x\n\tpython -m lab\ninstall-test: y\n") == {"lab", "install-test"}
