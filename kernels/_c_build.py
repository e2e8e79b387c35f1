"""Compile a C file of this package with the machine's C compiler and load it (``ctypes``).

The CPU kernels (``paged_attention_cpu.c``, ``fused_ops_cpu.c``) are plain C with no
PyTorch headers: each is compiled once per machine with ``cc`` (or ``$CC``) into
``~/.cache/mini_vllm`` (or ``$MINI_VLLM_CACHE_DIR``; a private temporary folder when the
home cannot be written), in under a second, and loaded with :mod:`ctypes`.
:func:`load_library` says why not when that fails (no compiler, a compile error, a folder
that cannot be written), so that a caller can report it instead of raising.
:func:`check_c_tensors` is what every wrapper checks before it hands a tensor's raw
pointer to C.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

# -O3 with the CPU's own vector instructions; -ffast-math lets the compiler reorder float32
# sums into vector lanes and use its vector exp (the rounding of any blocked sum: the tests
# hold each kernel to its reference within 1e-5).
CFLAGS = ["-O3", "-march=native", "-ffast-math"]


def cache_dir() -> Path:
    """Where compiled libraries go, as an absolute path (``dlopen`` reads a bare name as a system library)."""
    return Path(os.environ.get("MINI_VLLM_CACHE_DIR") or Path.home() / ".cache" / "mini_vllm").absolute()


def compiler() -> list[str] | None:
    """The compiler command: ``$CC`` split as make splits it (``CC="ccache gcc"``), else cc, gcc or clang."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _cpu_flags() -> str:
    """What -march=native compiles for: the CPU's feature flags (a shared home may serve several CPUs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(command: list[str], source: Path, library: Path) -> None:
    """Compile ``source`` into ``library``; raises OSError or SubprocessError."""
    library.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: two processes compiling at once never load half a file.
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built, obj = Path(tmp) / library.name, Path(tmp) / "kernel.o"
        # Compiled with CFLAGS, linked without them: gcc links a shared library made with
        # -ffast-math against crtfastmath.o, which would switch the whole process (PyTorch
        # included) to flushing tiny floats to zero as soon as the library is loaded.
        for step in (
            [*command, *CFLAGS, "-fPIC", "-c", str(source), "-o", str(obj)],
            [*command, "-shared", str(obj), "-o", str(built), "-lm"],
        ):
            subprocess.run(step, check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, library)


def load_library(
    source: Path, signatures: Mapping[str, tuple[type | None, Sequence[type]]]
) -> tuple[ctypes.CDLL | None, str]:
    """Compile ``source`` (once per source, compiler and CPU) and load it: ``(library, "")`` or ``(None, why not)``.

    ``signatures``: each C function's name -> ``(restype, argtypes)``, set on the loaded library.
    """
    command = compiler()
    if not command:
        return None, "no C compiler found (install gcc, or set CC)"
    parts = [source.read_bytes(), " ".join(command).encode(), " ".join(CFLAGS).encode(), _cpu_flags().encode()]
    name = f"{source.stem}-{hashlib.sha256(b'-'.join(parts)).hexdigest()[:16]}.so"
    library = cache_dir() / name
    try:
        try:
            if not library.exists():
                _build(command, source, library)
        except OSError:
            if os.environ.get("MINI_VLLM_CACHE_DIR"):
                raise  # the folder the user chose: say so
            # The default folder cannot be written (a read-only home): a private folder of this process.
            library = Path(tempfile.mkdtemp(prefix="mini_vllm-")) / name
            _build(command, source, library)
        lib = ctypes.CDLL(str(library))
    except subprocess.SubprocessError as error:
        detail = getattr(error, "stderr", "") or str(error)
        return None, f"compiling {source.name} failed: {detail.strip()[:500]}"
    except OSError as error:  # no such compiler, a cache folder that cannot be written, a library that cannot load
        return None, f"building or loading {library} failed: {error}"
    for function_name, (restype, argtypes) in signatures.items():
        function = getattr(lib, function_name)
        function.restype, function.argtypes = restype, list(argtypes)
    return lib, ""


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the tensor types whose data_ptr() is their memory


def check_c_tensors(function: str, dtype: torch.dtype | None, **tensors: torch.Tensor) -> None:
    """ValueError naming the first tensor the C code cannot read through its raw pointer: not a
    plain dense CPU tensor (sparse, nested, fake, another device), not of ``dtype`` (None: any),
    or one autograd tracks while grad is on (the kernels are for inference)."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{function}: {name} must be a tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{function} runs on the CPU, but {name} is on {tensor.device}")
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(
                f"{function} takes {str(dtype).removeprefix('torch.')} tensors, but {name} is {tensor.dtype}"
            )
        if type(tensor) not in _PLAIN or tensor.layout != torch.strided or tensor.is_nested:
            raise ValueError(
                f"{function}: {name} must be a plain dense tensor (not sparse, nested, fake or a subclass)"
            )
        if tensor.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{function} is for inference (no autograd), but {name} requires grad: call it under torch.no_grad()"
            )
