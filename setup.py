"""Packaging beyond pyproject.toml: one step, putting kernels/ into a wheel as mini_vllm/kernels/.

In a checkout (and an editable install: make lab, environment.yml) the package
mini_vllm.kernels reads its modules from the top-level kernels/ folder
(mini_vllm/kernels/__init__.py). A wheel has no such folder beside mini_vllm/,
so building one copies the folder's files into the package itself. Nothing is
ever installed under the top-level name `kernels`, which is Hugging Face's.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class build_py_with_kernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads kernels/ where it is
        target = Path(self.build_lib) / "mini_vllm" / "kernels"
        for source in sorted(Path("kernels").glob("*")):
            if source.suffix in (".py", ".c"):
                self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": build_py_with_kernels})
