"""The engine's extension points (``mini_vllm/engine_parts.py``): the only way the learner's code gets in.

* The course layer (``mini_vllm/course/*.py``) assigns no behaviour or
  component onto an engine object and swaps nothing module-level: an ast
  check, and unit tests proving the check flags what it must.
* Every ``EngineParts`` field, given a wrapping implementation that records
  its calls, is called by a running engine (a part the engine does not use
  cannot be called a part of the engine), and the engine's tokens stay the
  reference's.
* Two ``LLM`` s in one process with different parts do not affect each other.
* The exercises build their engines with the learner's part through
  ``learner_engine(mine=...)``, never by assigning it onto an engine object;
  the chapters patch only to watch the engine, at the places listed here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import types
from pathlib import Path

import pytest
import torch

import mini_vllm
from mini_vllm import LLM, SamplingParams
from mini_vllm.attention.torch_backend import TorchAttentionBackend, decode_attention
from mini_vllm.block_pool import FreeKVCacheBlockQueue
from mini_vllm.engine_parts import ENGINE_PART_NAMES, EngineParts
from mini_vllm.hashing import hash_block_tokens, hash_request_tokens

COURSE = Path(mini_vllm.__file__).parent / "course"
ROOT = COURSE.parents[1]
ENGINE_MODULES = [
    "mini_vllm.block_pool",
    "mini_vllm.kv_cache_manager",
    "mini_vllm.scheduler",
    "mini_vllm.request",
    "mini_vllm.hashing",
    "mini_vllm.model_runner",
    "mini_vllm.model",
    "mini_vllm.llm_engine",
    "mini_vllm.llm",
    "mini_vllm.engine_parts",
    "mini_vllm.attention.base",
    "mini_vllm.attention.torch_backend",
]
PROMPTS = [
    "You are a storyteller for children. Tell short, kind stories with animals. " * 2 + f"Animal {i}." for i in range(4)
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
OTHER_PROMPTS = [f"A list of {i} unrelated words about the weather, the sea and the mountains, " * 2 for i in range(3)]


def _run(llm):
    """PROMPTS (shared prefix: hits), then unrelated prompts that need the pool's cached blocks (evictions)."""
    return llm.generate(PROMPTS, GREEDY) + llm.generate(OTHER_PROMPTS, GREEDY)


def _engine_args():
    # Few blocks: the later prompts evict the earlier ones' cached blocks.
    return dict(device="cpu", num_blocks=12, max_num_batched_tokens=64, block_size=16)


# -- the checker ------------------------------------------------------------------------
def _is_engine_object(value) -> bool:
    module = getattr(value, "__module__", None) or ""
    return module in ENGINE_MODULES or module.startswith("mini_vllm.attention")


def engine_names() -> set[str]:
    """Attribute names that are engine behaviour or components: assigning one from outside is patching.

    The engine modules' functions and classes, every method and property of
    their classes, and every attribute of a built engine's objects that holds
    an engine object or a callable (``free_block_queue``, ``block_pool``,
    ``attn_backend``, ...). Plain data (a block's ``block_hash``, a request's
    ``num_computed_tokens``) is not among them: the checks build scenarios
    with it, as the scheduler would.
    """
    names: set[str] = set()
    for module_name in ENGINE_MODULES:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if inspect.isfunction(value) or inspect.isclass(value):
                if value.__module__ == module_name:
                    names.add(name)
                    if inspect.isclass(value):
                        for member, attr in inspect.getmembers(value):
                            if callable(attr) or isinstance(attr, property):
                                names.add(member)
    llm = LLM(**_engine_args())
    engine = llm.llm_engine
    seen: set[int] = set()
    stack = [llm, engine.model_runner.model.model.layers[0].self_attn]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for name, value in getattr(obj, "__dict__", {}).items():
            if callable(value) or _is_engine_object(value) or isinstance(value, torch.nn.Module):
                names.add(name)
                if _is_engine_object(value) and not isinstance(value, type):
                    stack.append(value)
    names -= {name for name in names if name.startswith("__") and name.endswith("__")}
    return names


def _imported_objects(tree: ast.Module, package: str) -> dict[str, object]:
    """Every name the source imports, resolved to its object (a module, a class, a function)."""
    objects: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                objects[alias.asname or alias.name.split(".")[0]] = importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.import_module("." * node.level + (node.module or ""), package) if node.level else None
            if base is None:
                base = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(base, alias.name, None)
                if value is None:
                    try:
                        value = importlib.import_module(f"{base.__name__}.{alias.name}")
                    except ImportError:
                        continue
                objects[alias.asname or alias.name] = value
    return objects


def engine_patches(source: str, names: set[str], package: str = "mini_vllm.course") -> list[str]:
    """Each place ``source`` patches the engine: ``line: what``.

    Flags ``setattr``/``delattr`` calls; an assignment (or ``del``) of an
    engine name (``engine_names``) on anything but ``self``/``cls``; and any
    assignment onto an imported module or an imported engine class or
    function (a module-level swap).
    """
    tree = ast.parse(source)
    imported = _imported_objects(tree, package)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for sub in ast.walk(target):
                if not isinstance(sub, ast.Attribute) or isinstance(sub.ctx, ast.Load):
                    continue
                owner = sub.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Name) and owner.id in imported:
                    value = imported[owner.id]
                    if isinstance(value, types.ModuleType) or _is_engine_object(value):
                        found.append(f"{node.lineno}: {ast.unparse(sub)} (module-level swap)")
                        continue
                if sub.attr in names:
                    found.append(f"{node.lineno}: {ast.unparse(sub)}")
    return found


@pytest.fixture(scope="module")
def names() -> set[str]:
    return engine_names()


def test_the_course_layer_never_patches_the_engine(names):
    found = {
        path.name: patches
        for path in sorted(COURSE.glob("*.py"))
        if (patches := engine_patches(path.read_text(), names))
    }
    assert not found, f"the course layer patches the engine (use EngineParts instead): {found}"


@pytest.mark.parametrize(
    "patch",
    [
        "pool.free_block_queue = FreeKVCacheBlockQueue(blocks)",
        "manager.find_longest_cache_hit = lambda block_hashes, max_num_blocks: []",
        "llm.llm_engine.scheduler.schedule_waiting = my_schedule_waiting",
        "layer.self_attn.attn_backend = backend",
        "setattr(pool, 'get_new_blocks', mine)",
        "from mini_vllm import model_runner\nmodel_runner.compute_slot_mapping = mine",
        "import mini_vllm.request as request\nrequest.hash_new_full_blocks = mine",
        "from mini_vllm.block_pool import BlockPool\nBlockPool.free_blocks = mine",
        "del manager.free",
    ],
)
def test_the_checker_flags_a_patch(names, patch):
    assert engine_patches(patch, names), f"not flagged: {patch}"


@pytest.mark.parametrize(
    "fine",
    [
        "self.free_block_queue = queue",  # an object's own attribute, in its own class
        "block.block_hash = block_hash",  # scenario data, as cache_full_blocks sets it
        "request.num_computed_tokens = 16",
        "from mini_vllm.course.fixtures import CountingBlock\nCountingBlock.reads = 0",  # the course's own class
        "llm = LLM(parts=EngineParts(free_blocks=mine))",
    ],
)
def test_the_checker_passes_what_is_not_a_patch(names, fine):
    assert not engine_patches(fine, names)


def test_the_engine_names_include_its_components_and_parts(names):
    assert {"free_block_queue", "block_pool", "attn_backend", "compute_slot_mapping"} <= names
    assert {"get_new_blocks", "free_blocks", "find_longest_cache_hit", "free", "schedule_waiting"} <= names
    assert "block_hash" not in names and "num_computed_tokens" not in names


# -- every part is called by a running engine ------------------------------------------------
class RecordingQueue(FreeKVCacheBlockQueue):
    """The reference queue, recording which of its operations the pool used."""

    calls: list[str] = []

    def __init__(self, blocks):
        RecordingQueue.calls.append("__init__")
        super().__init__(blocks)

    def popleft_n(self, n):
        RecordingQueue.calls.append("popleft_n")
        return super().popleft_n(n)

    def remove(self, block):
        RecordingQueue.calls.append("remove")
        super().remove(block)


class SingleOperationsQueue:
    """A queue with only the single operations (as a learner may write it): the pool adds the batch ones."""

    def __init__(self, blocks):
        self._queue = FreeKVCacheBlockQueue(blocks)

    @property
    def num_free_blocks(self):
        return self._queue.num_free_blocks

    def popleft(self):
        return self._queue.popleft()

    def remove(self, block):
        self._queue.remove(block)

    def append(self, block):
        self._queue.append(block)

    def appendleft(self, block):
        self._queue.appendleft(block)

    def get_all_free_blocks(self):
        return self._queue.get_all_free_blocks()


def _recording(calls: dict[str, int], name: str, fn):
    def recorded(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    return recorded


def _reference_paged_decode(query, k_cache, v_cache, block_table, seq_len, scale):
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    return decode_attention(query[None], k_cache, v_cache, block_table[None], seq_lens, seq_len, scale)[0]


def _recording_parts(calls: dict[str, int], *, hash_with_request_tokens: bool) -> EngineParts:
    reference = EngineParts()
    wrapped = {
        name: _recording(calls, name, getattr(reference, name))
        for name in ("slot_mapping", "find_longest_cache_hit", "free_blocks", "free_request_blocks")
    }
    wrapped["get_new_blocks"] = _recording(calls, "get_new_blocks", reference.get_new_blocks)
    wrapped["schedule_waiting"] = _recording(calls, "schedule_waiting", reference.schedule_waiting)
    wrapped["store_kv"] = _recording(calls, "store_kv", TorchAttentionBackend().store_kv)
    wrapped["paged_decode"] = _recording(calls, "paged_decode", _reference_paged_decode)
    if hash_with_request_tokens:
        wrapped["hash_request_tokens"] = _recording(calls, "hash_request_tokens", hash_request_tokens)
    else:
        wrapped["hash_block_tokens"] = _recording(calls, "hash_block_tokens", hash_block_tokens)
    return EngineParts(free_queue=RecordingQueue, **wrapped)


@pytest.fixture(scope="module")
def reference_outputs():
    llm = LLM(**_engine_args())
    outputs = _run(llm)
    return outputs, llm.llm_engine.get_stats()


@pytest.mark.parametrize("hash_with_request_tokens", [False, True])
def test_every_part_is_called_by_a_running_engine(reference_outputs, hash_with_request_tokens):
    calls: dict[str, int] = {}
    RecordingQueue.calls = []
    parts = _recording_parts(calls, hash_with_request_tokens=hash_with_request_tokens)
    llm = LLM(**_engine_args(), parts=parts)
    assert llm.llm_engine.parts is parts
    outputs = _run(llm)
    calls["free_queue"] = len(RecordingQueue.calls)
    hashing = "hash_request_tokens" if hash_with_request_tokens else "hash_block_tokens"
    # The default model has no sliding-window layer: that part is a hybrid model's (test below);
    # lru_evict is the CPU tier's, which only an engine with kv_offloading_size has (tests/course).
    not_here = {"hash_block_tokens", "hash_request_tokens", "find_sliding_window_cache_hit", "lru_evict"}
    expected = set(ENGINE_PART_NAMES) - not_here | {hashing}
    assert set(parts.replaced()) == expected
    never_called = sorted(name for name in expected if not calls.get(name))
    assert not never_called, f"parts the running engine never called: {never_called} (calls: {calls})"
    assert {"__init__", "popleft_n", "remove"} <= set(RecordingQueue.calls)
    expected_outputs, expected_stats = reference_outputs
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected_outputs]
    assert [o.num_cached_tokens for o in outputs] == [o.num_cached_tokens for o in expected_outputs]
    stats = llm.llm_engine.get_stats()
    assert (stats.num_evictions, stats.prefix_cache_hits) == (
        expected_stats.num_evictions,
        expected_stats.prefix_cache_hits,
    )
    assert stats.num_evictions > 0 and stats.prefix_cache_hits > 0  # the workload exercised eviction and hits
    llm.llm_engine.kv_cache_manager.check_invariants()


def test_a_queue_without_batch_operations_is_the_pools_queue(reference_outputs):
    llm = LLM(**_engine_args(), parts=EngineParts(free_queue=SingleOperationsQueue))
    queue = llm.llm_engine.kv_cache_manager.block_pool.free_block_queue
    assert isinstance(queue, SingleOperationsQueue) and hasattr(queue, "popleft_n")
    outputs = _run(llm)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference_outputs[0]]
    llm.llm_engine.kv_cache_manager.check_invariants()


def test_the_reference_engine_runs_its_own_parts():
    engine = LLM(**_engine_args()).llm_engine
    assert engine.parts == EngineParts() and engine.parts.replaced() == []
    pool = engine.kv_cache_manager.block_pool
    # The reference methods stay the classes' own: nothing is bound on the instances.
    assert "get_new_blocks" not in vars(pool) and "free_blocks" not in vars(pool)
    assert "schedule_waiting" not in vars(engine.scheduler)
    assert type(pool.free_block_queue) is FreeKVCacheBlockQueue
    assert engine.model_runner.attn_backend.name in ("torch", "triton")


def test_parts_are_plain_frozen_data():
    parts = EngineParts()
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.free_blocks = None
    with pytest.raises(TypeError, match="EngineParts"):
        LLM(**_engine_args(), parts={"free_blocks": None})
    with pytest.raises(ValueError, match="sha256"):
        LLM(**_engine_args(), hash_algo="xxhash", parts=EngineParts(hash_block_tokens=lambda *a: b""))


# -- engines do not affect each other -----------------------------------------------------
def test_two_engines_with_different_parts_do_not_affect_each_other(reference_outputs):
    calls: dict[str, int] = {}
    never_hits = EngineParts(
        find_longest_cache_hit=_recording(calls, "lookup", lambda block_pool, block_hashes, max_num_blocks: []),
        slot_mapping=_recording(calls, "slot_mapping", EngineParts().slot_mapping),
    )
    mine = LLM(**_engine_args(), parts=never_hits)
    reference = LLM(**_engine_args())
    reference_run = _run(reference)
    assert not calls, "an engine ran another engine's parts"
    assert [o.num_cached_tokens for o in reference_run] == [o.num_cached_tokens for o in reference_outputs[0]]
    mine_run = _run(mine)
    assert calls["lookup"] and calls["slot_mapping"]
    assert sum(o.num_cached_tokens for o in mine_run) == 0  # its lookup never hits
    assert [o.outputs[0].token_ids for o in mine_run] == [o.outputs[0].token_ids for o in reference_run]
    before = dict(calls)
    again = reference.generate(PROMPTS, GREEDY)
    assert calls == before
    assert sum(o.num_cached_tokens for o in again) > 0


def test_a_hybrid_engine_calls_the_sliding_window_part_and_the_lookup_parts_of_both_groups():
    """The sliding-window lookup is a hybrid model's part (chapter 08b): its engine calls it, beside full
    attention's ``find_longest_cache_hit``, and gives the hits the reference gives."""
    from mini_vllm.model import hybrid_model_path

    calls: dict[str, int] = {}
    reference = EngineParts()
    parts = EngineParts(
        find_sliding_window_cache_hit=_recording(
            calls, "find_sliding_window_cache_hit", reference.find_sliding_window_cache_hit
        ),
        find_longest_cache_hit=_recording(calls, "find_longest_cache_hit", reference.find_longest_cache_hit),
    )
    args = dict(device="cpu", num_blocks=64, block_size=16)
    long_prompts = [" ".join(PROMPTS) * 3, " ".join(PROMPTS) * 3 + " Once more."]
    theirs = LLM(hybrid_model_path(), **args)
    ours = LLM(hybrid_model_path(), **args, parts=parts)
    expected = [theirs.generate([p], GREEDY)[0] for p in long_prompts]
    got = [ours.generate([p], GREEDY)[0] for p in long_prompts]
    assert calls.get("find_sliding_window_cache_hit", 0) >= 2 and calls.get("find_longest_cache_hit", 0) >= 2
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in expected]
    assert got[1].num_cached_tokens > 0  # the second prompt extends the first: a hit in both groups
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    ours.llm_engine.kv_cache_manager.check_invariants()


# -- the notebooks: every exercise plugs its part in through EngineParts ------------------------------------
NOTEBOOK_DIR = ROOT / "notebooks"
EXERCISE_NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9]*.ipynb")) + sorted(
    (ROOT / "exercises").glob("[0-9]*.ipynb")
)
# What chapters still patch to *watch* the engine (never to replace a part); nothing may be added here.
CHAPTER_INSTRUMENTATION = {
    "03_block_tables.ipynb": {"runner.prepare_inputs"},  # records the model runner's inputs for a table
    "08_engine.ipynb": {"runner.prepare_inputs"},
    "06b_radix_tree_vs_hash_map.ipynb": {"pool.get_cached_block"},  # counts dictionary probes
}


def notebook_patches(path: Path, names: set[str]) -> set[str]:
    """What ``path``'s code cells patch, outside the cells that define the exercise's own parts.

    A part's own body may change the state it is given (``pool.num_evictions += 1`` is
    ``get_new_blocks``' contract); the cells between it and the engine may not.
    """
    notebook = json.loads(path.read_text())
    cells = [
        "".join(cell["source"])
        for cell in notebook["cells"]
        if cell["cell_type"] == "code"
        and "### BEGIN SOLUTION" not in "".join(cell["source"])
        and "your code here" not in "".join(cell["source"])
    ]
    code = "\n".join(line for line in "\n".join(cells).split("\n") if not line.lstrip().startswith(("%", "!")))
    return {patch.split(": ", 1)[1].split(" ")[0] for patch in engine_patches(code, names)}


@pytest.mark.parametrize("path", EXERCISE_NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_exercise_plugs_its_part_in_through_engine_parts(path, names):
    assert notebook_patches(path, names) == set(), "build the engine with learner_engine(mine={...}) instead"


def test_chapters_patch_the_engine_only_to_watch_it(names):
    found = {
        path.name: patches
        for path in sorted(NOTEBOOK_DIR.glob("*.ipynb"))
        if (patches := notebook_patches(path, names))
    }
    assert found == CHAPTER_INSTRUMENTATION


def test_the_notebook_checker_flags_a_part_plugged_in_by_hand(names, tmp_path):
    notebook = {
        "cells": [
            {
                "cell_type": "code",
                "source": ["def f(pool):\n", "    ### BEGIN SOLUTION\n", "    pool.num_evictions += 1\n"],
            },
            {
                "cell_type": "code",
                "source": ["%time x = 1\n", "pool.free_block_queue = FreeKVCacheBlockQueue(blocks)\n"],
            },
        ]
    }
    path = tmp_path / "02_x.ipynb"
    path.write_text(json.dumps(notebook))
    assert notebook_patches(path, names) == {"pool.free_block_queue"}
