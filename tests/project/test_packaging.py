"""The project's set-up files agree with each other (pyproject, environment.yml, Makefile, CI)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


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


def test_packages_import():
    import mini_vllm  # noqa: F401
    from mini_vllm import kernels

    assert kernels.__name__ == "mini_vllm.kernels"


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


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> Path:
    """mini-vLLM built as a wheel (no build isolation: setuptools is in the venv) and unpacked."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"  # a copy: setuptools builds in the source folder, and the checkout stays as it is
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so")
    for name in ("pyproject.toml", "setup.py", "README.md", "mini_vllm", "kernels"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": ignore} if copy is shutil.copytree else {}))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        cwd=out,
    )
    (wheel,) = out.glob("mini_vllm_course-*.whl")
    unpacked = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    return unpacked


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
def test_the_wheel_claims_no_import_name_but_mini_vllm(built_wheel):
    """`kernels` is Hugging Face's kernel hub package (transformers imports it): a wheel of
    ours installs mini_vllm only, with the kernels/ folder inside it as mini_vllm/kernels/."""
    top_level = sorted(p.name for p in built_wheel.iterdir() if not p.name.endswith(".dist-info"))
    assert top_level == ["mini_vllm"], top_level
    shipped = {p.name for p in (built_wheel / "mini_vllm" / "kernels").iterdir()}
    wanted = {p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".py", ".c")}
    assert wanted <= shipped, f"not in the wheel: {sorted(wanted - shipped)}"


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
def test_an_installed_wheel_finds_its_kernels_and_their_c_sources(built_wheel, tmp_path):
    """Imported from the unpacked wheel (not the checkout), mini_vllm.kernels reads its own folder,
    and the cpu backend's C sources lie beside their Python modules."""
    script = textwrap.dedent(
        """
        import mini_vllm, mini_vllm.kernels as kernels
        from mini_vllm.kernels import fused_ops_cpu, paged_attention_cpu, reference
        print(mini_vllm.__file__)
        print(kernels.KERNELS_DIR)
        print(paged_attention_cpu.SOURCE.is_file(), fused_ops_cpu.SOURCE.is_file())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(built_wheel)}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    package_file, kernels_dir, sources = result.stdout.splitlines()
    assert Path(package_file).is_relative_to(built_wheel), package_file
    assert Path(kernels_dir) == built_wheel / "mini_vllm" / "kernels"
    assert sources == "True True"
