"""The project's set-up files agree with each other (pyproject, environment.yml, Makefile, CI)."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_parses_and_names_the_same_packages_as_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra, requirements in project["optional-dependencies"].items():
        wanted |= {_name(r) for r in requirements if not r.startswith("mini-vllm-course")}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {_name(r) for r in pip_section if not r.startswith("-e")}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    assert "-e ." in pip_section, "environment.yml must install the project itself (editable)"
    assert any(str(d).startswith("python") for d in env["dependencies"])


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme


def test_packages_import_and_transformers_ignores_our_kernels_package():
    import kernels  # noqa: F401
    import mini_vllm  # noqa: F401
    from transformers.utils import import_utils

    # transformers has an optional integration with a PyPI package that is also
    # called "kernels"; our package of that name must not switch it on.
    assert not import_utils.is_kernels_available()


def test_every_bundled_model_folder_ships_in_the_package():
    """A model folder under mini_vllm/ (one with a config.json) is package data: an installed
    (non-editable) mini-vLLM must find default_model_path() and hybrid_model_path() there."""
    from mini_vllm.model import default_model_path, hybrid_model_path

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["mini_vllm"]
    folders = {p.parent.name for p in (ROOT / "mini_vllm").glob("*/config.json")}
    assert {Path(default_model_path()).name, Path(hybrid_model_path()).name} <= folders
    for folder in folders:
        assert f"{folder}/*" in patterns, f"mini_vllm/{folder}/ is not in pyproject's package-data"


@pytest.mark.parametrize("module", ["paged_attention_cpu", "fused_ops_cpu"])
def test_the_c_kernel_sources_ship_in_the_package(module):
    """The cpu attention backend compiles kernels/paged_attention_cpu.c and kernels/fused_ops_cpu.c
    on first use: an installed (non-editable) mini-vLLM needs the files beside their Python modules."""
    source = importlib.import_module(f"kernels.{module}").SOURCE

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert source.suffix == ".c" and source.parent.name == "kernels" and source.is_file()
    assert any(Path(source.name).match(pattern) for pattern in package_data["kernels"])
