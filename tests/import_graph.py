"""Who imports whom in ``mini_vllm``, read from the source with ``ast`` (nothing is imported).

Shared by ``tests/engine/test_imports.py`` (no import cycle among the engine modules) and
``tests/engine/test_import_contracts.py`` (the engine never imports the course, the widgets,
the servers, ...).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The engine: what ``LLM.generate`` runs, and the modules it stands on. Paths relative to the
# repository root; a folder means every module in it.
ENGINE = (
    "mini_vllm/__init__.py",
    "mini_vllm/hashing.py",
    "mini_vllm/block_pool.py",
    "mini_vllm/block_pool_snapshot.py",
    "mini_vllm/kv_cache_manager.py",
    "mini_vllm/request.py",
    "mini_vllm/scheduler.py",
    "mini_vllm/model_runner.py",
    "mini_vllm/model_config.py",
    "mini_vllm/model.py",
    "mini_vllm/cpu_fast_path.py",
    "mini_vllm/attention/",
    "mini_vllm/kernels/",  # the package of the top-level kernels/ folder (its __init__ points there)
    "mini_vllm/llm_engine.py",
    "mini_vllm/output_processor.py",
    "mini_vllm/detokenizer.py",
    "mini_vllm/engine_stats.py",
    "mini_vllm/llm.py",
    "mini_vllm/input_processor.py",
    "mini_vllm/sampling_params.py",
    "mini_vllm/config.py",
    "mini_vllm/outputs.py",
    "mini_vllm/events.py",
    "mini_vllm/sampler.py",
    "mini_vllm/interrupts.py",
    "mini_vllm/registry.py",
    "mini_vllm/validation.py",
    "mini_vllm/engine_parts.py",
    "mini_vllm/kv_cache_interface.py",
    "mini_vllm/single_type_kv_cache_manager.py",
    "mini_vllm/parallel_sampling.py",
    "mini_vllm/kv_offload/",  # the second tier below the pool (KV-cache offloading)
)

# What is built on the engine, each in its own package beside it (ARCHITECTURE.md, "Layout").
LAYERS = (
    "mini_vllm/course/",  # the course: checks, the learner's parts, authoring tools
    "mini_vllm/viz/",  # the widgets
    "mini_vllm/companions/",  # chapter companions: profiler, router, radix cache
    "mini_vllm/entrypoints/",  # the OpenAI server, its async engine, the command line
    "mini_vllm/tools/",  # benchmarks, the vLLM comparisons, the real-model converter, paths
    "mini_vllm/distributed/",  # what a replica tells the processes around it: its KV events on ZMQ
)
# Data folders inside the package (the bundled models).
PACKAGE_DATA = ("mini_vllm/default_model/", "mini_vllm/hybrid_model/")


def engine_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for entry in ENGINE:
        path = root / entry
        files.extend(sorted(path.glob("*.py")) if entry.endswith("/") else [path])
    return files


def module_name(path: Path, root: Path = ROOT) -> str:
    """``mini_vllm/attention/base.py`` -> ``mini_vllm.attention.base``; a package's ``__init__.py`` -> its name."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@dataclass(frozen=True)
class Import:
    module: str  # absolute name of the imported module
    line: int
    in_function: bool  # inside a function body: runs when called, not at import
    type_checking: bool  # under ``if TYPE_CHECKING:``: never runs


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool, type_checking: bool) -> Iterator[tuple[ast.AST, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        yield child, in_function, type_checking
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, True, type_checking)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, in_function, True
                yield from _walk(stmt, in_function, True)
            for stmt in child.orelse:
                yield stmt, in_function, type_checking
                yield from _walk(stmt, in_function, type_checking)
        else:
            yield from _walk(child, in_function, type_checking)


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    """Every module ``path`` imports, anywhere in it, with relative names made absolute.

    ``from pkg import name`` counts as importing ``pkg`` and, when ``pkg.name`` is a
    module under ``root``, ``pkg.name`` too. ``importlib.import_module("...")`` with a
    constant absolute name counts as an import.
    """
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def add(module: str, node: ast.AST, in_function: bool, type_checking: bool) -> None:
        found.append(Import(module, node.lineno, in_function, type_checking))

    tree = ast.parse(path.read_text(), filename=str(path))
    for node, in_function, type_checking in _walk(tree, False, False):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, in_function, type_checking)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            add(source, node, in_function, type_checking)
            for alias in node.names:
                if _is_module(f"{source}.{alias.name}", root):
                    add(f"{source}.{alias.name}", node, in_function, type_checking)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            target = node.args[0].value
            if called in ("import_module", "__import__") and isinstance(target, str) and not target.startswith("."):
                add(target, node, in_function, type_checking)
    return found


def import_graph(files: Iterable[Path], root: Path = ROOT, *, module_level_only: bool = True) -> dict[str, set[str]]:
    """module -> the modules among ``files`` it imports (at import time only, by default).

    Imports under ``if TYPE_CHECKING:`` never run and are left out; so are imports
    inside functions unless ``module_level_only`` is False.
    """
    files = list(files)
    names = {module_name(path, root) for path in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        edges = graph.setdefault(module_name(path, root), set())
        for imp in imports_of(path, root):
            if imp.type_checking or (module_level_only and imp.in_function):
                continue
            if imp.module in names and imp.module != module_name(path, root):
                edges.add(imp.module)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles
