"""The engine stands alone: its modules never import the course, the widgets, the servers, the
benchmarks or the comparisons with vLLM, not even inside a function. Those are built on the
engine (they listen to its events, drive its classes), never the other way round.

And the widgets read the KV cache only through its snapshot (``KVCacheManager.snapshot``):
no module of ``mini_vllm/viz`` names the pool's or the group managers' live internals.

Read from the source with ``ast`` (``tests/import_graph.py``), so an import hidden in a rarely
called function is caught as well as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import ENGINE, LAYERS, PACKAGE_DATA, ROOT, engine_files, imports_of, module_name

# What is built on the engine: no engine module may import any of these (or what is inside them).
NOT_FOR_THE_ENGINE = tuple(layer.rstrip("/").replace("/", ".") for layer in LAYERS)


def forbidden_imports(files: list[Path], root: Path = ROOT) -> list[str]:
    """``"mini_vllm/x.py:12 imports mini_vllm.viz.state"`` for every import of a forbidden module."""
    found = []
    for path in files:
        for imp in imports_of(path, root):
            if any(imp.module == name or imp.module.startswith(name + ".") for name in NOT_FOR_THE_ENGINE):
                found.append(f"{path.relative_to(root)}:{imp.line} imports {imp.module}")
    return found


def test_the_engine_modules_import_nothing_built_on_them():
    files = engine_files()
    assert {module_name(path) for path in files} >= {
        "mini_vllm.scheduler",
        "mini_vllm.llm_engine",
        "mini_vllm.attention",
        "mini_vllm.attention.torch_backend",
    }
    assert forbidden_imports(files) == []


def package_entries_outside_the_layout(root: Path = ROOT) -> list[str]:
    """Modules and folders directly in ``mini_vllm/`` that are neither engine, a layer, nor data."""
    known = set(ENGINE) | set(LAYERS) | set(PACKAGE_DATA) | {"mini_vllm/__main__.py"}
    found = []
    for path in sorted((root / "mini_vllm").iterdir()):
        if path.name.startswith((".", "__pycache__")) or path.suffix not in ("", ".py"):
            continue
        entry = str(path.relative_to(root)) + ("/" if path.is_dir() else "")
        if entry not in known:
            found.append(entry)
    return found


def test_the_package_holds_the_engine_and_each_layer_in_its_own_package():
    # Engine modules in one place and nothing else beside them: a new module at the top of
    # mini_vllm/ is either engine code (listed in tests/import_graph.py's ENGINE, so the
    # contracts cover it) or belongs in one of the layers' packages.
    assert package_entries_outside_the_layout() == []


def test_the_layout_check_flags_a_tool_beside_the_engine(tmp_path):
    package = tmp_path / "mini_vllm"
    package.mkdir()
    (package / "scheduler.py").write_text("")
    (package / "bench.py").write_text("")
    (package / "tools").mkdir()
    assert package_entries_outside_the_layout(tmp_path) == ["mini_vllm/bench.py"]


def test_every_forbidden_name_is_a_module_that_exists():
    # A name that no longer matches a module would silently stop protecting anything.
    for name in NOT_FOR_THE_ENGINE:
        path = ROOT.joinpath(*name.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), name


def test_the_checker_flags_an_engine_module_that_imports_one(tmp_path):
    package = tmp_path / "mini_vllm"
    (package / "viz").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "viz" / "__init__.py").write_text("")
    (package / "viz" / "state.py").write_text("")
    (package / "router.py").write_text("")
    (package / "course").mkdir()
    (package / "course" / "__init__.py").write_text("")
    (package / "hashing.py").write_text("import hashlib\n")
    (package / "scheduler.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from .hashing import sha256\n"
        "import mini_vllm.companions.router\n"  # line 4
        "if TYPE_CHECKING:\n"
        "    from .course import fixtures\n"  # line 6: never runs, still a dependency
        "def snapshot():\n"
        "    from .viz.state import StateSource\n"  # line 8: inside a function
        "    return StateSource\n"
        "class Scheduler:\n"
        "    def show(self):\n"
        "        from . import viz\n"  # line 12: `from package import module`
        "        import importlib\n"
        "        return importlib.import_module('mini_vllm.entrypoints.cli')\n"  # line 14
    )
    clean = forbidden_imports([package / "hashing.py"], tmp_path)
    flagged = forbidden_imports([package / "scheduler.py"], tmp_path)
    assert clean == []
    assert flagged == [
        "mini_vllm/scheduler.py:4 imports mini_vllm.companions.router",
        "mini_vllm/scheduler.py:6 imports mini_vllm.course",
        "mini_vllm/scheduler.py:8 imports mini_vllm.viz.state",
        "mini_vllm/scheduler.py:12 imports mini_vllm.viz",
        "mini_vllm/scheduler.py:14 imports mini_vllm.entrypoints.cli",
    ]


# What only the live cache has, not its snapshot: the group managers' tables, the free queue's
# links and walk, the hash map's own lookup. A widget that names one reaches past the snapshot.
CACHE_INTERNALS = (
    "req_to_blocks",
    "managers",
    "sliding_window_managers",
    "get_all_free_blocks",
    "fake_head",
    "fake_tail",
    "prev_free_block",
    "next_free_block",
    "get_one_block",
    "get_cached_block",
)


def cache_internals_read(files: list[Path], root: Path = ROOT) -> list[str]:
    """``"mini_vllm/viz/x.py:12 reads .req_to_blocks"`` for every attribute in ``CACHE_INTERNALS`` read."""
    found = []
    for path in files:
        reads = sorted(
            (node.lineno, node.col_offset, node.attr)
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.Attribute) and node.attr in CACHE_INTERNALS
        )
        found += [f"{path.relative_to(root)}:{line} reads .{attr}" for line, _, attr in reads]
    return found


def test_the_widgets_read_the_cache_only_through_its_snapshot():
    files = sorted((ROOT / "mini_vllm" / "viz").glob("*.py"))
    assert {path.name for path in files} >= {"state.py", "views.py", "dashboard.py", "hash_chain.py"}
    assert cache_internals_read(files) == []


def test_the_checker_flags_a_widget_that_reaches_into_the_pool(tmp_path):
    (tmp_path / "mini_vllm" / "viz").mkdir(parents=True)
    clean = tmp_path / "mini_vllm" / "viz" / "clean.py"
    clean.write_text(
        "def render(manager):\n"
        "    cache = manager.snapshot()\n"
        "    return cache.block_pool.free_block_queue, cache.get_block_ids('A')\n"
    )
    widget = tmp_path / "mini_vllm" / "viz" / "widget.py"
    widget.write_text(
        "def render(manager):\n"
        "    pool = manager.block_pool\n"
        "    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]\n"  # line 3
        "    tables = manager.managers[0].req_to_blocks\n"  # line 4: two of them
        "    return queue, tables, pool.get_cached_block(b'h')\n"  # line 5
    )
    assert cache_internals_read([clean], tmp_path) == []
    assert cache_internals_read([widget], tmp_path) == [
        "mini_vllm/viz/widget.py:3 reads .get_all_free_blocks",
        "mini_vllm/viz/widget.py:4 reads .managers",
        "mini_vllm/viz/widget.py:4 reads .req_to_blocks",
        "mini_vllm/viz/widget.py:5 reads .get_cached_block",
    ]
