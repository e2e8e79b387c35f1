"""The learner's parts: every exercise implementation that passed its check, kept on disk.

When a check passes on code written in a notebook (or a script), the check
calls :func:`keep`: the code's source, with what it needs from the notebook
(imports, constants, the learner's own helper functions), is written to
``<parts folder>/<part>.py``. Later chapters build the learner's engine from
these files (:func:`mini_vllm.course.learner_engine`); the reference fills in
every part that is not there.

The parts folder is ``$MINI_VLLM_PARTS`` when that is set, else
``my-course/parts/`` in the course's checkout (git-ignored), else
``~/.cache/mini-vllm/parts``. :func:`reset_parts` deletes kept parts: the
engine goes back to the reference for them. The files are plain Python: a
learner may read them, and an instructor may collect them.

Only code defined in ``__main__`` (a notebook's cells, a script) is kept: a
check run on the reference itself, or from the test suite, writes nothing.
"""

from __future__ import annotations

import ast
import dis
import importlib.util
import inspect
import linecache
import os
import re
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tools import paths

PARTS_ENV = "MINI_VLLM_PARTS"


@dataclass(frozen=True)
class Part:
    """One piece of the engine a learner writes: where, under which name, and what it does."""

    key: str
    chapter: str
    name: str  # the function's or class's name in the exercise
    role: str  # what it does in the engine
    # The engine's implementation, as "module:qualified.name": first the one with the exercise's signature,
    # then what it delegates to or is called from; shown next to the learner's once their check passed
    # (side_by_side), and looked for in the chapters before it (tests/course/test_no_answer_before_exercise.py).
    reference: tuple[str, ...] = ()
    in_engine: bool = True  # False: the learner's code, but not engine code (the engine of their parts never runs it)


PARTS: list[Part] = [
    Part(
        "free_queue",
        "02",
        "FreeKVCacheBlockQueue",
        "the free-block queue (LRU order, O(1) remove)",
        ("mini_vllm.block_pool:FreeKVCacheBlockQueue",),
    ),
    Part(
        "slot_mapping",
        "03",
        "compute_slot_mapping",
        "token positions -> cache slots",
        ("mini_vllm.model_runner:compute_slot_mapping",),
    ),
    Part("hash_block_tokens", "04", "hash_block_tokens", "one block's hash", ("mini_vllm.hashing:hash_block_tokens",)),
    Part(
        "hash_request_tokens",
        "04",
        "hash_request_tokens",
        "a request's chain of block hashes",
        ("mini_vllm.hashing:hash_request_tokens", "mini_vllm.hashing:hash_new_full_blocks"),
    ),
    Part(
        "find_longest_cache_hit",
        "05",
        "find_longest_cache_hit",
        "the prefix lookup",
        (
            "mini_vllm.kv_cache_manager:find_longest_cache_hit",
            "mini_vllm.kv_cache_manager:longest_cache_hit",
            "mini_vllm.kv_cache_manager:KVCacheManager.find_longest_cache_hit",
        ),
    ),
    Part(
        "free_blocks",
        "06",
        "free_blocks",
        "freeing blocks (tail or head of the queue)",
        ("mini_vllm.block_pool:BlockPool.free_blocks",),
    ),
    Part(
        "free_request_blocks",
        "06",
        "free_request_blocks",
        "freeing a request's table, last block first",
        (
            "mini_vllm.kv_cache_manager:free_request_blocks",
            "mini_vllm.single_type_kv_cache_manager:SingleTypeKVCacheManager.free",
        ),
    ),
    Part(
        "get_new_blocks",
        "06",
        "get_new_blocks",
        "popping blocks, with lazy eviction",
        ("mini_vllm.block_pool:BlockPool.get_new_blocks", "mini_vllm.block_pool:BlockPool._maybe_evict_cached_block"),
    ),
    Part(
        "lru_evict",
        "06c",
        "lru_evict",
        "the CPU tier's LRU eviction (offloading)",
        ("mini_vllm.kv_offload.lru:lru_evict", "mini_vllm.kv_offload.lru:LRUCachePolicy.evict"),
    ),
    Part(
        "store_kv",
        "07",
        "store_kv",
        "the Triton kernel that writes K/V into the cache",
        ("mini_vllm.kernels.store_kv:_store_kv_kernel",),
    ),
    Part(
        "paged_decode",
        "07",
        "paged_decode",
        "decode attention over the paged cache",
        ("mini_vllm.kernels.reference:paged_attention", "mini_vllm.kernels.reference:unified_attention"),
    ),
    Part(
        "schedule_waiting",
        "08",
        "schedule_waiting",
        "admission of waiting requests with prefix lookup",
        ("mini_vllm.scheduler:Scheduler.schedule_waiting",),
    ),
    Part(
        "find_sliding_window_cache_hit",
        "08b",
        "find_sliding_window_cache_hit",
        "a sliding-window group's lookup (hybrid models)",
        ("mini_vllm.single_type_kv_cache_manager:find_sliding_window_cache_hit",),
    ),
    Part(
        "build_messages",
        "09",
        "build_messages",
        "the cache-friendly prompt of the story app",
        ("mini_vllm.course.prompt_checks:reference_build_messages",),
        in_engine=False,
    ),
]


def reference_objects(key: str) -> list[Any]:
    """The engine's implementation of part ``key``: the objects ``Part.reference`` names, imported."""
    objects = []
    for dotted in PARTS_BY_KEY[key].reference:
        module_name, _, qualified = dotted.partition(":")
        obj: Any = importlib.import_module(module_name)
        for attribute in qualified.split("."):
            obj = getattr(obj, attribute)
        objects.append(getattr(obj, "fn", obj))  # a @triton.jit kernel wraps its function
    return objects


PARTS_BY_KEY = {part.key: part for part in PARTS}


def parts_dir() -> Path:
    """Where parts are kept: ``$MINI_VLLM_PARTS``, the checkout's ``my-course/parts``, or ``~/.cache``."""
    configured = os.environ.get(PARTS_ENV)
    if configured:
        return Path(configured).expanduser()
    if paths.is_checkout():
        return paths.REPO_ROOT / "my-course" / "parts"
    return Path.home() / ".cache" / "mini-vllm" / "parts"


# -- keeping a part ------------------------------------------------------------------
def keep(key: str, obj: Any) -> Path | None:
    """Write ``obj`` (the learner's passing implementation of part ``key``) to the parts folder.

    Returns the file, or None when nothing was kept (``obj`` is not the
    learner's code, or it uses something from the notebook that cannot be
    written as source; then a line says so).
    """
    part = PARTS_BY_KEY[key]
    handed_over = engines_own(key, obj)
    if handed_over is not None:
        print(
            f"  ✗ not kept: {handed_over}. The exercise is to write it: the engine of your parts keeps running "
            "the reference's until your own passes"
        )
        return None
    if not _is_learners(obj):
        return None
    try:
        source = freeze(obj, part.name)
    except _CannotFreeze as reason:
        print(f"  (not kept as your part '{key}': {reason})")
        return None
    folder = parts_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.py"
    path.write_text(source)
    if part.in_engine:
        print(
            f"  kept as your part '{key}': from now on, the engine of your parts uses it "
            "(mini_vllm.course.reset_parts() goes back to the reference)"
        )
    else:  # e.g. build_messages: it shapes the prompts a client sends, no engine runs it
        print(f"  kept as your part '{key}' (load it with mini_vllm.course.load_part({key!r}); it is not engine code)")
    return path


# -- the engine's own implementation, handed in as the learner's ----------------------------
def engines_own(key: str, obj: Any) -> str | None:
    """How ``obj``, given as the learner's part ``key``, hands the exercise to the engine; None when it does not.

    ``obj`` *is* one of the objects ``Part.reference`` names (imported, as a bound method, a
    ``functools.partial``, a subclass of the reference's class), or its code (with the notebook's
    own helpers it uses) *calls* one: by a global, a module's attribute or an object's method of
    that name (``block_pool.get_new_blocks(...)`` in ``get_new_blocks``), or an import in the
    function. A check that passes on it proves nothing the learner wrote.
    """
    part = PARTS_BY_KEY[key]
    references = reference_objects(key)
    given = _unwrapped(obj)
    for reference in references:
        if given is reference or (
            inspect.isclass(given) and inspect.isclass(reference) and issubclass(given, reference)
        ):
            how = "is a subclass of" if given is not reference else "is"
            return f"your {part.name} {how} the engine's own {_described(reference)}"
    names = {getattr(reference, "__name__", None): reference for reference in references}
    for code, fn_globals in _learners_code(given):
        for instruction in dis.get_instructions(code):
            name = instruction.argval
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and name in fn_globals:
                value = _unwrapped(fn_globals[name])
                if any(value is reference for reference in references):
                    return f"your {part.name} calls the engine's own {_described(value)}"
            elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM") and name in names:
                return f"your {part.name} calls the engine's own {_described(names[name])}, as .{name}(...)"
    return None


def _unwrapped(obj: Any) -> Any:
    """The function or class behind a Triton kernel, a bound method, a ``functools.partial`` or a decorator."""
    for _ in range(5):
        if inspect.isclass(obj):
            return obj
        inner = getattr(obj, "fn", None) or getattr(obj, "__func__", None) or getattr(obj, "func", None)
        inner = inner or getattr(obj, "__wrapped__", None)
        if inner is None or inner is obj:
            return obj
        obj = inner
    return obj


def _described(reference: Any) -> str:
    return f"{getattr(reference, '__qualname__', reference)} ({getattr(reference, '__module__', '?')})"


def _learners_code(obj: Any) -> list[tuple[types.CodeType, dict]]:
    """(code object, its globals) of ``obj`` (a function, or a class's methods), of the functions nested in it,
    and of the notebook's own functions and classes it uses, each once."""
    found: list[tuple[types.CodeType, dict]] = []
    seen: set[int] = set()
    pending = [obj]
    while pending:
        item = _unwrapped(pending.pop())
        if id(item) in seen:
            continue
        seen.add(id(item))
        if inspect.isfunction(item):
            functions = [item]
        elif inspect.isclass(item):
            functions = [_unwrapped(v) for v in vars(item).values() if inspect.isfunction(_unwrapped(v))]
            functions += [v.fget for v in vars(item).values() if isinstance(v, property) and v.fget]
        else:
            continue
        for function in functions:
            codes = [function.__code__]
            while codes:
                code = codes.pop()
                found.append((code, function.__globals__))
                codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            for name in _global_names([function.__code__]):
                value = function.__globals__.get(name)
                if getattr(_unwrapped(value), "__module__", None) == "__main__":
                    pending.append(value)  # the notebook's own helper: what it calls counts too
    return found


def _is_learners(obj: Any) -> bool:
    fn = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps the function
    return getattr(fn, "__module__", None) == "__main__"


class _CannotFreeze(Exception):
    pass


def freeze(obj: Any, name: str) -> str:
    """Python source that defines ``name`` as ``obj`` does, with what it uses from its notebook.

    Imports are written for modules and for functions from packages;
    constants (numbers, strings, bytes, tuples of them) as assignments; the
    notebook's own functions and classes as their source, before their users.
    """
    header = [f'"""Your part: {name}, kept when its check passed. Edit it here, or re-run the exercise."""', ""]
    imports: list[str] = []
    definitions: list[str] = []
    defined = _defined_name(obj, name)
    if not defined.isidentifier():
        raise _CannotFreeze(f"a {defined} cannot be kept as a file: write it with def {name}(...)")
    # Checked under another name (check_find_longest_cache_hit(my_lookup)): the part's name too.
    _freeze_into(obj, name, imports, definitions, seen=set())
    if any(re.match(r"(from|import) triton\b", line) for line in imports):  # a kernel: Triton must not load first
        header.append(KERNELS_FIRST)
    lines = header + sorted(set(imports)) + [""] + definitions
    return "\n".join(lines).rstrip() + "\n"


KERNELS_FIRST = (
    "from mini_vllm import kernels  # noqa: F401  (first: sets TRITON_INTERPRET=1 on a machine without a GPU)"
)
"""The first import of a kept part that imports Triton: on a machine without a GPU, Triton must start interpreted."""


def _defined_name(obj: Any, fallback: str) -> str:
    """The name ``obj``'s own ``def`` or ``class`` gives it (a Triton kernel's: its function's)."""
    return getattr(getattr(obj, "fn", obj), "__name__", fallback)


def _freeze_into(obj: Any, name: str, imports: list[str], definitions: list[str], seen: set) -> None:
    """Append ``obj``'s source (after what it uses), and ``name = <its def's name>`` where they differ.

    The alias matters wherever the notebook bound the code to a second name: the part
    checked as ``my_lookup``, or a launcher that calls ``store_kv_kernel`` after
    ``store_kv_kernel = my_kernel``.
    """
    if id(obj) not in seen:
        seen.add(id(obj))
        source, fn_globals, code_objects = _source_of(obj, name)
        for global_name in sorted(_global_names(code_objects)):
            if global_name not in fn_globals or global_name == name:
                continue
            _freeze_global(global_name, fn_globals[global_name], imports, definitions, seen)
        definitions.append(source.rstrip() + "\n\n")
    defined = _defined_name(obj, name)
    alias = f"{name} = {defined}\n"
    if defined != name and alias not in definitions:
        definitions.append(alias)


def _source_of(obj: Any, name: str) -> tuple[str, dict, list[types.CodeType]]:
    """(source, globals, code objects) of a function, a Triton kernel or a class."""
    if inspect.isfunction(getattr(obj, "fn", None)):  # a @triton.jit kernel (compiled or interpreted)
        fn = obj.fn
        return _function_source(fn), fn.__globals__, [fn.__code__]
    if inspect.isfunction(obj):
        return _function_source(obj), obj.__globals__, [obj.__code__]
    if inspect.isclass(obj):
        functions = [v for v in vars(obj).values() if inspect.isfunction(v)]
        functions += [v.fget for v in vars(obj).values() if isinstance(v, property) and v.fget]
        if not functions:
            raise _CannotFreeze(f"class {name} has no methods to find its source by")
        return _class_source(obj, functions[0]), functions[0].__globals__, [f.__code__ for f in functions]
    raise _CannotFreeze(f"{name} is a {type(obj).__name__}, not a function or a class")


def _function_source(fn: types.FunctionType) -> str:
    """A function's source, from its cell or file; a function made by ``exec`` (or typed at a prompt) has none."""
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except OSError:  # inspect finds no file or cell holding its code
        raise _CannotFreeze(
            f"{fn.__name__} has no source to keep (it was made by exec(...) or typed at a prompt, so no cell or file "
            f"holds its code): define it with def {fn.__name__}(...) in a cell and run the check again"
        ) from None


def _class_source(cls: type, method: types.FunctionType) -> str:
    """A notebook class's source, found through one of its methods' cell (inspect cannot in Jupyter)."""
    filename = method.__code__.co_filename
    text = "".join(linecache.getlines(filename))
    if not text:
        raise _CannotFreeze(f"the source of class {cls.__name__} is not available")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = text.splitlines()[start - 1 : node.end_lineno]
            return textwrap.dedent("\n".join(lines))
    raise _CannotFreeze(f"class {cls.__name__} not found in its cell")


def _global_names(code_objects: list[types.CodeType]) -> set[str]:
    """The global names the code reads (not attribute names), nested functions and comprehensions included."""
    names: set[str] = set()
    stack = list(code_objects)
    while stack:
        code = stack.pop()
        for instruction in dis.get_instructions(code):
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                names.add(instruction.argval)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


_CONSTANT_TYPES = (int, float, str, bytes, bool, type(None))


def _freeze_global(name: str, value: Any, imports: list[str], definitions: list[str], seen: set) -> None:
    if isinstance(value, types.ModuleType):
        module = value.__name__
        imports.append(f"import {module}" if module == name else f"import {module} as {name}")
        return
    if _is_constant(value):
        origin = _engine_module_defining(name, value)
        if origin is not None:  # NONE_HASH: the engine's own value in every process, not this one's copy
            imports.append(f"from {origin} import {name}")
        else:
            definitions.append(f"{name} = {value!r}\n")
        return
    module = getattr(getattr(value, "fn", value), "__module__", None)
    if module == "__main__":
        _freeze_into(value, name, imports, definitions, seen)
        return
    if module and (inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value)):
        original = getattr(value, "__name__", name)
        imports.append(f"from {module} import {original}" + ("" if original == name else f" as {name}"))
        return
    raise _CannotFreeze(f"it uses {name}, a {type(value).__name__} from the notebook that cannot be written as source")


def _engine_module_defining(name: str, value: Any) -> str | None:
    """The engine or kernels module whose ``name`` is this very constant, if one is loaded.

    A constant the notebook imported from the engine is kept as that import: a
    value that depends on the process (``NONE_HASH`` follows ``PYTHONHASHSEED``)
    would be wrong frozen into the file. (Functions and classes are imported
    from their own ``__module__``.)
    """
    for module_name, module in sorted(sys.modules.items()):
        if module_name.split(".")[0] == "mini_vllm" and not module_name.startswith("mini_vllm.course"):
            if getattr(module, name, _MISSING) is value:
                return module_name
    return None


_MISSING = object()


def _is_constant(value: Any) -> bool:
    if isinstance(value, _CONSTANT_TYPES):
        return True
    return isinstance(value, (tuple, frozenset)) and all(_is_constant(v) for v in value)


# -- loading and resetting -----------------------------------------------------------
def kept_parts() -> list[str]:
    """Keys of the parts kept in the parts folder, in course order."""
    folder = parts_dir()
    return [part.key for part in PARTS if (folder / f"{part.key}.py").exists()]


def load_part(key: str) -> Any:
    """The learner's kept implementation of ``key`` (ImportError if it is not kept or does not load)."""
    part = PARTS_BY_KEY[key]
    path = parts_dir() / f"{key}.py"
    if not path.exists():
        raise ImportError(f"part '{key}' is not kept ({path.name} is not in the parts folder)")
    _update_kernels_imports(path)
    module_name = f"mini_vllm_course_parts.{key}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - a broken part falls back to the reference
        raise ImportError(f"part '{key}' does not load: {type(error).__name__}: {error}") from error
    if not hasattr(module, part.name):  # an edited file that no longer defines the part
        raise ImportError(f"part '{key}' does not load: {path} defines no {part.name!r}")
    return getattr(module, part.name)


# A part kept before the course's kernels were renamed says `import kernels` (now Hugging Face's package).
_OLD_KERNELS_IMPORT = re.compile(
    r"^(\s*)(?:import kernels(?!\w)(\.[\w.]+)?( as \w+)?|from kernels(?=[. ]))", re.MULTILINE
)


def _new_kernels_import(match: re.Match) -> str:
    indent, submodule, alias = match.group(1), match.group(2), match.group(3)
    if match.group(0).lstrip().startswith("from"):
        return f"{indent}from mini_vllm.kernels"
    if submodule or alias:  # import kernels.reference as reference
        return f"{indent}import mini_vllm.kernels{submodule or ''}{alias or ' as kernels'}"
    return f"{indent}from mini_vllm import kernels"


def _update_kernels_imports(path: Path) -> None:
    """Rewrite a kept part's imports of ``kernels`` to ``mini_vllm.kernels``, with a line saying so.

    The course's kernels were importable as ``kernels`` until that name turned out
    to be Hugging Face's kernel hub package (which transformers installs); a part
    kept before then would import theirs, or fail.
    """
    source = path.read_text()
    updated = _OLD_KERNELS_IMPORT.sub(_new_kernels_import, source)
    if updated != source:
        path.write_text(updated)
        print(f"  updated {path.name}: the course's kernels are imported as mini_vllm.kernels now (it said `kernels`)")


def learner_parts(keys: list[str] | None = None) -> dict[str, Any]:
    """Every kept part that loads (or those of ``keys``); a part that fails to load is skipped, with a line."""
    parts = {}
    for key in keys if keys is not None else kept_parts():
        try:
            parts[key] = load_part(key)
        except ImportError as error:
            print(f"  using the reference for '{key}': {error}")
    return parts


def reset_parts(*keys: str) -> list[str]:
    """Forget kept parts (all of them when no key is given): the reference takes their place. Returns the keys."""
    unknown = [key for key in keys if key not in PARTS_BY_KEY]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; the parts are {[p.key for p in PARTS]}")
    removed = []
    for key in keys or [part.key for part in PARTS]:
        path = parts_dir() / f"{key}.py"
        if path.exists():
            path.unlink()
            removed.append(key)
    return removed
