"""The learner's own engine: passing parts are kept, later engines use them, a reset goes back.

A learner's notebook is played by a script run as ``__main__`` (what a
notebook's cells are), so the checks keep its code exactly as they keep a
notebook's.
"""

from __future__ import annotations

import re
import runpy
import textwrap
import json
import traceback
from pathlib import Path

import pytest

import mini_vllm.model_runner as model_runner
import mini_vllm.hashing as hashing
from mini_vllm import LLM, SamplingParams
from mini_vllm.course import (
    check_find_longest_cache_hit,
    check_slot_mapping,
    compare_with_reference,
    kept_parts,
    learner_engine,
    parts_dir,
    parts_line,
    reset_parts,
    show_parts,
)
from mini_vllm.course import parts as parts_module
from mini_vllm.course.lookup_checks import reference_find_longest_cache_hit

LEARNER_NOTEBOOK = """
import math
from mini_vllm.block_pool import KVCacheBlock
from mini_vllm.course import check_find_longest_cache_hit, check_free_queue, check_slot_mapping

NO_BLOCK = None


def physical_block(block_ids, position, block_size):
    return block_ids[math.floor(position / block_size)]


def compute_slot_mapping(block_ids, start, end, block_size):
    return [physical_block(block_ids, p, block_size) * block_size + p % block_size for p in range(start, end)]


def find_longest_cache_hit(block_pool, block_hashes, max_num_blocks):
    hits = []
    for block_hash in block_hashes[:max_num_blocks]:
        block = block_pool.get_cached_block(block_hash)
        if block is NO_BLOCK:
            break
        hits.append(block)
    return hits


class FreeKVCacheBlockQueue:
    def __init__(self, blocks):
        self.fake_head, self.fake_tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.fake_head.next_free_block, self.fake_tail.prev_free_block = self.fake_tail, self.fake_head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self):
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        block = self.fake_head.next_free_block
        self.remove(block)
        return block

    def remove(self, block):
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def _insert_after(self, before, block):
        after = before.next_free_block
        before.next_free_block, block.prev_free_block = block, before
        block.next_free_block, after.prev_free_block = after, block
        self.num_free_blocks += 1

    def append(self, block):
        self._insert_after(self.fake_tail.prev_free_block, block)

    def appendleft(self, block):
        self._insert_after(self.fake_head, block)

    def get_all_free_blocks(self):
        blocks, block = [], self.fake_head.next_free_block
        while block is not self.fake_tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


check_slot_mapping(compute_slot_mapping)
check_find_longest_cache_hit(find_longest_cache_hit)
check_free_queue(FreeKVCacheBlockQueue)
"""


@pytest.fixture
def parts_folder(tmp_path, monkeypatch):
    folder = tmp_path / "parts"
    monkeypatch.setenv(parts_module.PARTS_ENV, str(folder))
    return folder


def _play_notebook(tmp_path, source: str = LEARNER_NOTEBOOK) -> dict:
    script = tmp_path / "learner_notebook.py"
    script.write_text(textwrap.dedent(source))
    return runpy.run_path(str(script), run_name="__main__")


def _engine_args():
    return dict(device="cpu", num_blocks=24, max_num_batched_tokens=64)


PROMPTS = [
    "You are a storyteller for children. Tell short, kind stories with animals. " * 2 + f"Animal {i}." for i in range(4)
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_the_parts_folder_is_the_env_var_when_set(parts_folder):
    assert parts_dir() == parts_folder


def test_a_check_on_code_outside_a_notebook_keeps_nothing(parts_folder, capsys):
    check_find_longest_cache_hit(reference_find_longest_cache_hit)
    assert kept_parts() == [] and not parts_folder.exists()
    assert "kept as your part" not in capsys.readouterr().out


def test_passing_notebook_code_is_kept_with_what_it_uses(parts_folder, tmp_path, capsys):
    _play_notebook(tmp_path)
    assert "kept as your part 'slot_mapping'" in capsys.readouterr().out
    assert kept_parts() == ["free_queue", "slot_mapping", "find_longest_cache_hit"]
    source = (parts_folder / "slot_mapping.py").read_text()
    assert "import math" in source and "def physical_block" in source  # its helper and its import came along
    lookup_source = (parts_folder / "find_longest_cache_hit.py").read_text()
    assert "NO_BLOCK = None" in lookup_source  # a constant of the notebook
    slot_mapping = parts_module.load_part("slot_mapping")
    assert slot_mapping([7, 2], 14, 18, 16) == model_runner.compute_slot_mapping([7, 2], 14, 18, 16)
    # The kept class passes its check again, loaded from its file.
    check_slot_mapping(slot_mapping)


def test_a_failing_check_keeps_nothing(parts_folder, tmp_path):
    with pytest.raises(AssertionError):
        _play_notebook(tmp_path, LEARNER_NOTEBOOK.replace("p % block_size for p", "p for p"))
    assert "slot_mapping" not in kept_parts()


def test_the_learners_engine_runs_their_parts_and_matches_the_reference(parts_folder, tmp_path, capsys):
    _play_notebook(tmp_path)
    mine = learner_engine(**_engine_args())
    assert mine.course_parts["free_queue"] == "yours" and mine.course_parts["schedule_waiting"] == "reference"
    queue = mine.llm_engine.kv_cache_manager.block_pool.free_block_queue
    # The learner's class itself, with the batch operations it lacks added by the pool (it has no popleft_n).
    assert type(queue).__mro__[1].__module__.startswith("mini_vllm_course_parts")
    table = show_parts(mine)
    assert "3 of 13 parts are yours" in repr(table) and "<table>" in table._repr_html_()
    result = compare_with_reference(mine, LLM(**_engine_args()), PROMPTS, GREEDY)
    assert result["all equal"] and sum(result["cached tokens (yours)"]) > 0
    # Nothing module-level is swapped: the parts are the learner's engine's own.
    assert model_runner.compute_slot_mapping.__module__ == "mini_vllm.model_runner"
    assert hashing.hash_new_full_blocks.__module__ == "mini_vllm.hashing"


def test_a_wrong_part_shows_up_against_the_reference(parts_folder, capsys):
    never_hits = {"find_longest_cache_hit": lambda block_pool, block_hashes, max_num_blocks: []}
    mine = learner_engine(parts=never_hits, **_engine_args())
    result = compare_with_reference(mine, LLM(**_engine_args()), PROMPTS, GREEDY)
    assert not result["all equal"] and sum(result["cached tokens (yours)"]) == 0


def test_parts_are_used_by_the_learners_engine_only(parts_folder):
    calls = []

    def recording_slot_mapping(block_ids, start, end, block_size):
        calls.append((start, end))
        return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]

    mine = learner_engine(parts={"slot_mapping": recording_slot_mapping}, **_engine_args())
    mine.generate(PROMPTS[:1], GREEDY)
    assert calls, "the learner's compute_slot_mapping was not called"
    before = len(calls)
    LLM(**_engine_args()).generate(PROMPTS[:1], GREEDY)  # a reference engine in the same process
    assert len(calls) == before


def test_reset_goes_back_to_the_reference(parts_folder, tmp_path):
    _play_notebook(tmp_path)
    assert reset_parts("slot_mapping") == ["slot_mapping"]
    assert "slot_mapping" not in kept_parts()
    assert reset_parts() == ["free_queue", "find_longest_cache_hit"]
    assert set(learner_engine(**_engine_args()).course_parts.values()) == {"reference"}
    with pytest.raises(ValueError, match="unknown part"):
        reset_parts("find_longest_cache_hits")


def test_a_part_that_no_longer_loads_falls_back_to_the_reference(parts_folder, capsys):
    parts_folder.mkdir(parents=True)
    (parts_folder / "slot_mapping.py").write_text("def compute_slot_mapping(:\n")
    mine = learner_engine(**_engine_args())
    assert mine.course_parts["slot_mapping"] == "reference"
    assert "using the reference for 'slot_mapping'" in capsys.readouterr().out


def test_unknown_parts_are_refused(parts_folder):
    with pytest.raises(ValueError, match="unknown part"):
        learner_engine(parts={"free_queues": object}, **_engine_args())


def test_make_serve_serves_the_learners_engine(parts_folder, tmp_path):
    """``serve --learner-engine``: any OpenAI client talks to the engine the learner built, with its parts."""
    from openai import OpenAI

    from mini_vllm.tools.compare_servers import SERVED_MODEL_NAME, ServerSpec, start_mini_server
    from mini_vllm.model import default_model_path

    _play_notebook(tmp_path)
    spec = ServerSpec(str(default_model_path()), block_size=16, num_blocks=24, max_model_len=512)
    with start_mini_server(spec, tmp_path / "mine", extra_args=["--learner-engine"]) as server:
        server.wait_ready(timeout=120)
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        replies = [
            client.completions.create(
                model=SERVED_MODEL_NAME, prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            for p in PROMPTS[:2]
        ]
        log = server.log_tail(lines=200)
    assert "3 of 13 parts are yours" in log, log
    expected = LLM(**_engine_args()).generate(PROMPTS[:2], GREEDY)
    assert [r.choices[0].text for r in replies] == [o.outputs[0].text for o in expected]
    assert replies[1].usage.prompt_tokens_details.cached_tokens > 0  # the learner's lookup found the shared prefix


def _get_new_blocks_without_the_counter(pool, num_blocks):
    """A learner's lazy eviction that forgets the counter and the BlockRemoved event: tokens and hits stay right."""
    blocks = pool.free_block_queue.popleft_n(num_blocks)
    for block in blocks:
        if block.block_hash is not None:
            pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
            block.block_hash = None
        block.ref_cnt = 1
    return blocks


def test_the_comparison_with_the_reference_checks_evictions_events_and_the_free_queue(parts_folder, capsys):
    from mini_vllm.course import run_against_reference

    same = run_against_reference({}, workloads=["eviction_and_preemption"])
    assert same["observables"]["equal"] and same["observables"]["num_events"] > 0
    assert "the same as the reference's" in capsys.readouterr().out
    wrong = run_against_reference(
        {"get_new_blocks": _get_new_blocks_without_the_counter}, workloads=["eviction_and_preemption"]
    )
    assert all(w["tokens_equal"] and w["cached_equal"] for w in wrong["reference"])  # what was compared before
    assert not wrong["observables"]["equal"]
    first = wrong["observables"]["differences"][0]
    assert "evictions, the reference" in first and first.startswith("eviction_and_preemption: 0 evictions")
    assert any("KV-cache events, step" in d for d in wrong["observables"]["differences"])
    assert "DIFFERENT from the reference" in capsys.readouterr().out


def test_mine_goes_in_on_top_of_the_kept_parts(parts_folder, tmp_path):
    """An exercise runs the part it just wrote (``mine``) with every part kept before it."""
    _play_notebook(tmp_path)
    calls = []

    def recording_slot_mapping(block_ids, start, end, block_size):
        calls.append((start, end))
        return model_runner.compute_slot_mapping(block_ids, start, end, block_size)

    mine = learner_engine(mine={"slot_mapping": recording_slot_mapping}, **_engine_args())
    assert mine.course_parts["free_queue"] == "yours"  # kept by the notebook
    mine.generate(PROMPTS[:1], GREEDY)
    assert calls, "the part given as mine was not used"
    assert learner_engine(parts={}, mine={}, **_engine_args()).course_parts["free_queue"] == "reference"


def test_a_part_that_raises_in_the_forward_pass_is_raised_as_itself(parts_folder):
    """The engine ends the step's requests with an error and goes on; the learner's engine raises the part's error."""

    def broken_slot_mapping(block_ids, start, end, block_size):
        raise IndexError("my off-by-one")

    mine = learner_engine(parts={"slot_mapping": broken_slot_mapping}, **_engine_args())
    with pytest.raises(IndexError, match="my off-by-one") as caught:
        mine.generate(PROMPTS[:2], GREEDY)
    assert any("your part 'slot_mapping'" in note for note in caught.value.__notes__)
    # The traceback goes from the call to the learner's function: none of the engine's frames in between.
    names = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert names[-2:] == ["generate", "broken_slot_mapping"], names
    assert mine.llm_engine.kv_cache_manager.block_pool.get_num_free_blocks() == _engine_args()["num_blocks"]
    assert not mine.llm_engine.has_unfinished_requests()
    # A reference engine built the same way raises nothing: the part, not the workload, was wrong.
    assert len(learner_engine(parts={}, **_engine_args()).generate(PROMPTS[:2], GREEDY)) == 2


def test_a_part_error_deep_in_a_library_keeps_one_library_frame(parts_folder):
    """Found by a learner pass (07): a Triton kernel's error in the engine printed 17 frames of the interpreter."""

    def slot_mapping_calling_a_library(block_ids, start, end, block_size):
        return json.loads("[1, 2")  # raises three frames down in the json package

    mine = learner_engine(parts={"slot_mapping": slot_mapping_calling_a_library}, **_engine_args())
    with pytest.raises(json.JSONDecodeError) as caught:
        mine.generate(PROMPTS[:1], GREEDY)
    names = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert names[-3:] == ["generate", "slot_mapping_calling_a_library", "loads"], names


def test_the_dashboard_marks_the_learners_parts(parts_folder, tmp_path):
    from mini_vllm.viz import EngineDashboard

    _play_notebook(tmp_path)
    mine = EngineDashboard(learner_engine(**_engine_args()))
    line = "your parts (3 of 13): free_queue, slot_mapping, find_longest_cache_hit; the other 10 are the reference's"
    assert line in mine.to_text() and "mv-parts" in mine.to_html()
    reference = EngineDashboard(LLM(**_engine_args()))
    assert "your parts" not in reference.to_text() and "mv-parts" not in reference.to_html()


def test_side_by_side_shows_the_engines_code_only_after_the_check_passed(parts_folder, tmp_path):
    import inspect

    from mini_vllm.course import side_by_side
    from mini_vllm.course.parts import reference_objects

    reference_line = "return [block_ids[p // block_size] * block_size + p % block_size"  # the engine's answer
    assert any(reference_line in inspect.getsource(obj) for obj in reference_objects("slot_mapping"))
    before = side_by_side("slot_mapping")
    assert "Not yet" in repr(before) and reference_line not in repr(before)
    _play_notebook(tmp_path)  # the learner's checks pass: their parts are kept
    after = side_by_side("slot_mapping", "find_longest_cache_hit")
    text = repr(after)
    assert "def physical_block" in text  # the learner's kept code, helper included
    assert reference_line in text  # and the engine's, next to it
    assert "mv-side-by-side" in after._repr_html_()
    with pytest.raises(ValueError, match="unknown"):
        side_by_side("slot_mappings")


def test_a_part_checked_under_another_name_is_kept_under_the_parts_name(parts_folder, tmp_path):
    """``check_find_longest_cache_hit(my_lookup)``: the file defines my_lookup and the part's own name."""
    _play_notebook(
        tmp_path,
        LEARNER_NOTEBOOK.replace("def find_longest_cache_hit(", "def my_lookup(").replace(
            "check_find_longest_cache_hit(find_longest_cache_hit)", "check_find_longest_cache_hit(my_lookup)"
        ),
    )
    source = (parts_folder / "find_longest_cache_hit.py").read_text()
    assert "def my_lookup(" in source and "find_longest_cache_hit = my_lookup" in source
    mine = learner_engine(**_engine_args())
    assert mine.course_parts["find_longest_cache_hit"] == "yours"


def test_a_helper_bound_to_a_second_name_is_kept_under_that_name_too(parts_folder, tmp_path):
    """``store_kv_kernel = my_kernel`` and a launcher that calls store_kv_kernel: the file defines both names."""
    _play_notebook(
        tmp_path,
        LEARNER_NOTEBOOK.replace("def physical_block(", "def my_physical_block(").replace(
            "\ndef compute_slot_mapping(", "\nphysical_block = my_physical_block\n\n\ndef compute_slot_mapping("
        ),
    )
    source = (parts_folder / "slot_mapping.py").read_text()
    assert "def my_physical_block(" in source and "physical_block = my_physical_block" in source
    slot_mapping = parts_module.load_part("slot_mapping")  # a NameError here before the alias was written
    assert slot_mapping([7, 2], 14, 18, 16) == model_runner.compute_slot_mapping([7, 2], 14, 18, 16)


def test_an_engine_constant_is_kept_as_its_import_not_as_this_processes_value(parts_folder, tmp_path):
    """NONE_HASH follows PYTHONHASHSEED: a kept hash function must import it, or it stops matching the engine."""
    notebook = """
import hashlib
import pickle

from mini_vllm.block_pool import BlockRemoved  # re-exported there: its own module is mini_vllm.events
from mini_vllm.hashing import NONE_HASH
from mini_vllm.course import check_hash_block_tokens


def hash_block_tokens(parent_block_hash, token_ids, extra_keys=None):
    assert BlockRemoved is not None
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)).digest()


check_hash_block_tokens(hash_block_tokens)
"""
    _play_notebook(tmp_path, notebook)
    source = (parts_folder / "hash_block_tokens.py").read_text()
    assert "from mini_vllm.hashing import NONE_HASH" in source and "NONE_HASH = b" not in source
    assert "from mini_vllm.events import BlockRemoved" in source  # a class: from its own module


def test_a_kept_file_without_the_parts_name_falls_back_to_the_reference(parts_folder, capsys):
    parts_folder.mkdir(parents=True)
    (parts_folder / "find_longest_cache_hit.py").write_text(
        "def my_lookup(block_pool, block_hashes, n):\n    return []\n"
    )
    mine = learner_engine(**_engine_args())  # does not raise: the part is skipped, with a line
    assert mine.course_parts["find_longest_cache_hit"] == "reference"
    assert "defines no 'find_longest_cache_hit'" in capsys.readouterr().out


def test_a_part_given_as_mine_before_its_check_passed_is_named_as_unchecked(parts_folder, capsys):
    namespace = {"__name__": "__main__"}  # the learner's notebook
    exec("def compute_slot_mapping(block_ids, start, end, block_size):\n    return []\n", namespace)
    learner_engine(mine={"slot_mapping": namespace["compute_slot_mapping"]}, **_engine_args())
    assert "your compute_slot_mapping runs in this engine, but its check has not passed yet" in capsys.readouterr().out
    # The engine's own function given as mine (exercise 04 hashes with the engine's): no note.
    learner_engine(mine={"slot_mapping": model_runner.compute_slot_mapping}, **_engine_args())
    assert "note" not in capsys.readouterr().out


def test_kept_kernels_stay_out_of_the_chapters_engines_where_triton_is_interpreted(parts_folder, capsys, monkeypatch):
    import importlib

    from mini_vllm.course import learner_engine as build

    module = importlib.import_module("mini_vllm.course.learner_engine")  # the module (the package exports the function)

    def store_kv(key, value, k_cache, v_cache, slot_mapping):  # a kept kernel part (the reference's arithmetic)
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value

    monkeypatch.setattr(module, "learner_parts", lambda: {"store_kv": store_kv})
    monkeypatch.setattr(module, "_triton_interpreted", lambda: True)
    assert build(**_engine_args()).course_parts["store_kv"] == "reference"
    assert "your store_kv stay out of this engine" in capsys.readouterr().out
    assert build(kernels=True, **_engine_args()).course_parts["store_kv"] == "yours"
    assert build(mine={"store_kv": store_kv}, **_engine_args()).course_parts["store_kv"] == "yours"
    assert "stay out" not in capsys.readouterr().out  # given as mine: it runs, and nothing says otherwise
    monkeypatch.setattr(module, "_triton_interpreted", lambda: False)  # a GPU: the kernels run
    assert build(**_engine_args()).course_parts["store_kv"] == "yours"


def test_every_function_a_kept_message_names_is_exported_from_the_course():
    # keep() tells the learner "load it with mini_vllm.course.load_part(...)", "mini_vllm.course.reset_parts()".
    import mini_vllm.course as course

    source = Path(parts_module.__file__).read_text()
    named = set(re.findall(r"mini_vllm\.course\.(\w+)\(", source))
    assert named >= {"load_part", "reset_parts"}
    assert [name for name in sorted(named) if not hasattr(course, name)] == []


def test_a_lookup_that_returns_none_in_its_list_is_named_with_the_entry(parts_folder):
    """Found by a learner pass (08b): a None in the hit's list ended steps later in 'NoneType' has no 'ref_cnt'."""
    from mini_vllm.course.learner_errors import NotAListOfBlocks
    from mini_vllm.kv_cache_manager import find_longest_cache_hit

    def hit_with_a_hole(block_pool, block_hashes, max_num_blocks):
        hit = find_longest_cache_hit(block_pool, block_hashes, max_num_blocks)
        return hit + [None] if hit else hit

    mine = learner_engine(parts={"find_longest_cache_hit": hit_with_a_hole}, **_engine_args())
    mine.generate(PROMPTS[:1], GREEDY)  # caches the shared start: the next prompt hits it
    with pytest.raises(
        TypeError, match=r"your find_longest_cache_hit returned a list whose entry \d+ is None"
    ) as caught:
        mine.generate(PROMPTS[1:2], GREEDY)
    assert isinstance(caught.value, NotAListOfBlocks)
    assert any("your part 'find_longest_cache_hit'" in note for note in caught.value.__notes__)
    assert "ref_cnt" not in str(caught.value)
    assert mine.llm_engine.kv_cache_manager.block_pool.get_num_free_blocks() == _engine_args()["num_blocks"]
    assert not mine.llm_engine.has_unfinished_requests()


def test_parts_that_return_their_blocks_as_a_tuple_run_as_the_checks_take_them(parts_folder):
    """Found by a learner pass (05, 06, 08b): a tuple passed the check and was kept, then every engine raised
    NotAListOfBlocks; the checks take a tuple as a list, and so does the learner's engine."""
    from mini_vllm.block_pool import BlockPool
    from mini_vllm.kv_cache_manager import find_longest_cache_hit

    def lookup(block_pool, block_hashes, max_num_blocks):
        return tuple(find_longest_cache_hit(block_pool, block_hashes, max_num_blocks))

    def get_new_blocks(block_pool, num_blocks):
        return tuple(BlockPool.get_new_blocks(block_pool, num_blocks))

    parts = {"find_longest_cache_hit": lookup, "get_new_blocks": get_new_blocks}
    mine = learner_engine(parts=parts, **_engine_args())
    reference = learner_engine(parts={}, **_engine_args())
    for llm in (mine, reference):
        llm.generate(PROMPTS[:1], GREEDY)
    got, want = mine.generate(PROMPTS[1:2], GREEDY)[0], reference.generate(PROMPTS[1:2], GREEDY)[0]
    assert got.num_cached_tokens == want.num_cached_tokens > 0
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_an_engine_error_after_a_learners_part_names_the_parts_and_shows_where_it_fired(parts_folder):
    """Found by a learner pass (05): a lookup that takes its hit off the free queue itself made the engine's
    touch raise 'remove() called on block 0' under ~12 frames of the scheduler, with no word about the part."""
    from mini_vllm.kv_cache_manager import find_longest_cache_hit

    def lookup_that_takes_its_hit_off_the_queue(block_pool, block_hashes, max_num_blocks):
        hit = find_longest_cache_hit(block_pool, block_hashes, max_num_blocks)
        for block in hit:
            if block.ref_cnt == 0:
                block_pool.free_block_queue.remove(block)  # touch's job: the engine does it next
        return hit

    mine = learner_engine(parts={"find_longest_cache_hit": lookup_that_takes_its_hit_off_the_queue}, **_engine_args())
    mine.generate(PROMPTS[:1], GREEDY)
    with pytest.raises(ValueError, match="not in the free queue") as caught:
        mine.generate(PROMPTS[1:2], GREEDY)
    note = "\n".join(caught.value.__notes__)
    assert "the engine's own code raised this" in note and "check_find_longest_cache_hit" in note, note
    names = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert names[1:] == ["generate", "touch", "remove"], names  # the call, then where it fired
    # A bad prompt is the caller's mistake, before any step: no note about parts.
    with pytest.raises(ValueError) as bad_prompt:
        mine.generate([{"prompt_token_ids": []}], GREEDY)
    assert not getattr(bad_prompt.value, "__notes__", None)


def test_an_error_in_a_learners_free_queue_is_said_to_be_theirs(parts_folder):
    """A learner pass (02): the note said "the engine's own code raised this" above the learner's own remove."""
    from mini_vllm.block_pool import FreeKVCacheBlockQueue

    class QueueWhoseRemoveFails(FreeKVCacheBlockQueue):
        def remove(self, block):
            raise ValueError(f"my remove of block {block.block_id}")

    mine = learner_engine(parts={"free_queue": QueueWhoseRemoveFails}, **_engine_args())
    with pytest.raises(ValueError, match="my remove") as caught:
        mine.generate(PROMPTS[:2], GREEDY)
    note = "\n".join(caught.value.__notes__)
    assert note.startswith("your own code raised this") and "check_free_queue" in note, note
    names = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert names[1:] == ["generate", "remove"], names


def test_an_admission_past_the_token_budget_is_named_in_the_learners_engine(parts_folder):
    """A learner pass (08): a schedule_waiting without the budget cap scheduled ~290 tokens against 64, and
    the engine cell printed "same tokens, same hits" (or a shape error in the rotary embedding)."""
    from mini_vllm.scheduler import Scheduler

    def no_budget_cap(scheduler, token_budget, output):
        return Scheduler.schedule_waiting(scheduler, 10**6, output) and token_budget

    mine = learner_engine(parts={"schedule_waiting": no_budget_cap}, **dict(_engine_args(), max_num_batched_tokens=16))
    with pytest.raises(AssertionError, match=r"schedule_waiting scheduled \d+ new tokens with a token budget of 16"):
        mine.generate(PROMPTS[:2], GREEDY)
    assert not mine.llm_engine.has_unfinished_requests()


def test_a_free_blocks_that_loses_blocks_stalls_with_a_note_naming_the_learners_parts(parts_folder):
    """Found by a learner pass (06): the stall's message under the engine's traceback did not point at the check."""
    from mini_vllm.block_pool import BlockPool
    from mini_vllm.scheduler import EngineStalled

    def free_blocks_keeping_one(block_pool, ordered_blocks):
        BlockPool.free_blocks(block_pool, list(ordered_blocks)[1:])  # the request's last block never comes back

    mine = learner_engine(parts={"free_blocks": free_blocks_keeping_one}, **dict(_engine_args(), num_blocks=8))
    with pytest.raises(EngineStalled, match="cannot make progress") as caught:
        for prompt in PROMPTS * 4:  # a block lost per request: the pool of 8 runs dry within a few
            mine.generate(prompt, GREEDY)
    note = "\n".join(caught.value.__notes__)
    assert "your free_blocks" in note and "check_free_blocks" in note, note
    names = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert names[1:] == ["generate"], names  # this test's call, then generate: none of the scheduler's frames
    # The reference engine serves the same prompts: the part, not the workload, stalled it.
    assert len(learner_engine(parts={}, **dict(_engine_args(), num_blocks=8)).generate(PROMPTS, GREEDY)) == 4


def test_a_part_kept_when_the_kernels_were_imported_as_kernels_still_loads_and_says_what_changed(
    tmp_path, monkeypatch, capsys
):
    """Parts kept before the rename say `import kernels` (now Hugging Face's package): loading one
    rewrites those imports to mini_vllm.kernels, says so in one line, and the part works."""
    from mini_vllm.course import parts as parts_module

    monkeypatch.setenv("MINI_VLLM_PARTS", str(tmp_path))
    old = (
        '"""Your part: paged_decode, kept when its check passed."""\n\n'
        "import kernels  # noqa: F401  (first: sets TRITON_INTERPRET=1 on a machine without a GPU)\n"
        "import kernels.reference as reference\n"
        "from kernels.reference import paged_attention\n\n"
        "def paged_decode(query, k_cache, v_cache, block_table, seq_len, scale=None):\n"
        "    assert reference.paged_attention is paged_attention\n"
        "    return kernels.__name__\n"
    )
    (tmp_path / "paged_decode.py").write_text(old)
    paged_decode = parts_module.load_part("paged_decode")
    assert paged_decode(None, None, None, None, 0) == "mini_vllm.kernels"
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "imported as mini_vllm.kernels now" in out, out
    updated = (tmp_path / "paged_decode.py").read_text()
    assert "import kernels" not in updated.replace("mini_vllm import kernels", "")
    parts_module.load_part("paged_decode")  # the second time there is nothing left to say
    assert capsys.readouterr().out == ""


def test_every_engine_says_in_one_line_which_parts_are_yours_and_which_the_reference(parts_folder, tmp_path, capsys):
    assert parts_line() == (
        "your parts: none yet · reference: FreeKVCacheBlockQueue (02), compute_slot_mapping (03), hash_block_tokens, "
        "hash_request_tokens (04), find_longest_cache_hit (05), free_blocks, free_request_blocks, get_new_blocks (06), "
        "lru_evict (06c), store_kv, paged_decode (07), schedule_waiting (08), find_sliding_window_cache_hit (08b)"
    )
    _play_notebook(tmp_path)
    capsys.readouterr()
    mine = learner_engine(**_engine_args())
    printed = capsys.readouterr().out.splitlines()
    line = (
        "your parts: FreeKVCacheBlockQueue (02), compute_slot_mapping (03), find_longest_cache_hit (05) · "
        "reference: hash_block_tokens, hash_request_tokens (04), free_blocks, free_request_blocks, get_new_blocks (06), "
        "lru_evict (06c), store_kv, paged_decode (07), schedule_waiting (08), find_sliding_window_cache_hit (08b)"
    )
    assert printed == [line]  # the builder says it, in one line
    assert parts_line(mine) == line == parts_line()  # the same for the LLM, its engine and the kept parts
    assert parts_line(mine.llm_engine) == line and repr(parts_line(mine)) == line  # a notebook shows it unquoted
    # A reference engine beside the learner's: their kept parts are named, as not run by it.
    reference = learner_engine(parts={}, quiet=True, **_engine_args())
    assert capsys.readouterr().out == ""
    assert parts_line(reference).endswith(
        "· kept, not run by this engine: FreeKVCacheBlockQueue (02), compute_slot_mapping (03), find_longest_cache_hit (05)"
    )
    assert parts_line(LLM(**_engine_args())).startswith("your parts: none yet · reference: FreeKVCacheBlockQueue (02)")
    with pytest.raises(TypeError, match="holds no engine"):
        parts_line(object())


def test_a_server_over_the_learners_engine_names_its_parts(parts_folder):
    from mini_vllm.entrypoints.async_llm import AsyncLLM

    def compute_slot_mapping(block_ids, start, end, block_size):
        return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]

    mine = learner_engine(parts={"slot_mapping": compute_slot_mapping}, quiet=True, **_engine_args())
    served = AsyncLLM(mine)
    try:
        assert parts_line(served).startswith("your parts: compute_slot_mapping (03) · reference:")
    finally:
        served.shutdown()


def test_a_kept_part_imports_the_kernels_first_only_when_it_uses_triton(parts_folder, tmp_path):
    """Issue 41: every kept file started with `from mini_vllm import kernels` (which sets TRITON_INTERPRET),
    even a pure-Python part; only a part that imports Triton needs it, before Triton loads."""
    _play_notebook(tmp_path)
    for key in ("free_queue", "slot_mapping", "find_longest_cache_hit"):
        assert "kernels" not in (parts_folder / f"{key}.py").read_text(), key
    pytest.importorskip("triton.language")
    script = tmp_path / "kernel_notebook.py"
    script.write_text(
        "import triton.language as tl\n\n\n"
        "def paged_decode(query, k_cache, v_cache, block_table, seq_len, scale):\n    return tl.cdiv(seq_len, 16)\n"
    )
    namespace = runpy.run_path(str(script), run_name="__main__")
    lines = parts_module.freeze(namespace["paged_decode"], "paged_decode").splitlines()
    imports = [line for line in lines if line.startswith(("import ", "from "))]
    assert imports == [parts_module.KERNELS_FIRST, "import triton.language as tl"], imports


HANDED_TO_THE_ENGINE = """
from mini_vllm import kv_cache_manager
from mini_vllm.block_pool import BlockPool
from mini_vllm.course import (
    check_find_longest_cache_hit, check_free_blocks, check_get_new_blocks, check_hash_block_tokens,
    check_schedule_waiting,
)
from mini_vllm.hashing import hash_block_tokens as engines_hash
from mini_vllm.scheduler import Scheduler


def hash_block_tokens(parent_block_hash, token_ids, extra_keys=None):
    return engines_hash(parent_block_hash, token_ids, extra_keys)


def lookup(block_pool, block_hashes):
    return kv_cache_manager.longest_cache_hit(block_hashes, block_pool.get_cached_block)


def find_longest_cache_hit(block_pool, block_hashes, max_num_blocks):
    return lookup(block_pool, block_hashes[:max_num_blocks])  # through a helper of the notebook's


def get_new_blocks(pool, num_blocks):
    return pool.get_new_blocks(num_blocks)


def schedule_waiting(scheduler, token_budget, output):
    return Scheduler.schedule_waiting(scheduler, token_budget, output)


check_hash_block_tokens(hash_block_tokens)
check_find_longest_cache_hit(find_longest_cache_hit)
check_free_blocks(BlockPool.free_blocks)
check_get_new_blocks(get_new_blocks)
check_schedule_waiting(schedule_waiting)
"""


def test_an_answer_that_is_or_only_calls_the_engines_own_is_said_to_be_and_not_kept(parts_folder, tmp_path, capsys):
    """Issue 41: exercise 05's answer that just called the engine's longest_cache_hit passed and was kept as the
    learner's part. The checks still run (the code is right), but say whose code it is, and keep nothing."""
    _play_notebook(tmp_path, HANDED_TO_THE_ENGINE)
    out = capsys.readouterr().out
    assert kept_parts() == [], out
    for line in (
        "✗ not kept: your hash_block_tokens calls the engine's own hash_block_tokens (mini_vllm.hashing)",
        "✗ not kept: your find_longest_cache_hit calls the engine's own longest_cache_hit",
        "✗ not kept: your free_blocks is the engine's own BlockPool.free_blocks (mini_vllm.block_pool)",
        "✗ not kept: your get_new_blocks calls the engine's own BlockPool.get_new_blocks (mini_vllm.block_pool), "
        "as .get_new_blocks(...)",
        "✗ not kept: your schedule_waiting calls the engine's own Scheduler.schedule_waiting (mini_vllm.scheduler)",
    ):
        assert line in out, out
    assert "kept as your part" not in out


def test_a_helper_named_as_the_engines_function_is_the_learners_own_and_kept(parts_folder, tmp_path, capsys):
    source = LEARNER_NOTEBOOK.replace("def find_longest_cache_hit(", "def longest_cache_hit(").replace(
        "check_find_longest_cache_hit(find_longest_cache_hit)",
        "def find_longest_cache_hit(block_pool, block_hashes, max_num_blocks):\n"
        "    return longest_cache_hit(block_pool, block_hashes, max_num_blocks)\n\n\n"
        "check_find_longest_cache_hit(find_longest_cache_hit)",
    )
    _play_notebook(tmp_path, source)
    assert "find_longest_cache_hit" in kept_parts() and "✗ not kept" not in capsys.readouterr().out


OFFLOAD_NOTEBOOK = """
from mini_vllm.course import check_lru_evict


def lru_evict(policy, n, protected):
    candidates = sorted((policy.ranks[key], key) for key in policy.evictable if key not in protected)
    if len(candidates) < n:
        return None
    evicted = [(key, policy.chunks[key]) for _, key in candidates[:n]]
    for key, _ in evicted:
        policy.remove(key)
    return evicted


check_lru_evict(lru_evict)
"""


def _offload_rounds(llm) -> list[int]:
    """Six 64-token prefixes, one at a time, twice, through a tier of 10 chunks: the cached tokens of each."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(69)] for _ in range(6)]
    greedy = SamplingParams(max_tokens=2, temperature=0)
    return [llm.generate([{"prompt_token_ids": p}], greedy)[0].num_cached_tokens for p in prompts + prompts[::-1]]


def test_a_kept_lru_evict_is_what_the_learners_tier_runs(parts_folder, tmp_path, capsys):
    _play_notebook(tmp_path, OFFLOAD_NOTEBOOK)
    assert "kept as your part 'lru_evict'" in capsys.readouterr().out
    assert kept_parts() == ["lru_evict"]
    args = dict(device="cpu", num_blocks=12, block_size=16, max_num_seqs=1, kv_offloading_size=0.01)
    chunks_per_centigib = LLM(**args).llm_engine.scheduler.connector.manager.num_chunks
    args["kv_offloading_size"] = 0.01 * 10.5 / chunks_per_centigib  # a tier of 10 chunks: it must evict
    llm = learner_engine(**args, quiet=True)
    assert llm.course_parts["lru_evict"] == "yours"
    manager = llm.llm_engine.scheduler.connector.manager
    assert manager.num_chunks == 10
    assert manager.policy.evict_choice.__wrapped__.__module__ == "mini_vllm_course_parts.lru_evict"
    mine = _offload_rounds(llm)
    reference = _offload_rounds(learner_engine(**args, parts={}, quiet=True))
    assert mine == reference and sum(reference) > 0  # the reversed second round hits the newest prefixes
    # The comparison can fail: a tier that evicts the newest chunks instead keeps other prefixes.
    newest_first = OFFLOAD_NOTEBOOK.replace("candidates[:n]", "candidates[::-1][:n]")
    newest_first = newest_first.replace("check_lru_evict(lru_evict)", "")
    wrong = _play_notebook(tmp_path, newest_first)["lru_evict"]
    assert _offload_rounds(learner_engine(**args, parts={"lru_evict": wrong}, quiet=True)) != reference


def test_kept_parts_an_offloading_tier_cannot_run_stay_out_of_its_engine_with_a_note(parts_folder, capsys, monkeypatch):
    import importlib

    from mini_vllm.course import learner_engine as build
    from mini_vllm.kv_offload.lru import lru_evict as reference_lru_evict
    from mini_vllm.scheduler import Scheduler

    module = importlib.import_module("mini_vllm.course.learner_engine")

    def schedule_waiting(self, token_budget, output):  # a kept exercise-08 part (the engine's own arithmetic)
        return Scheduler.schedule_waiting(self, token_budget, output)

    def lru_evict(policy, n, protected):  # a kept exercise-06c part
        return reference_lru_evict(policy, n, protected)

    monkeypatch.setattr(module, "learner_parts", lambda: {"schedule_waiting": schedule_waiting, "lru_evict": lru_evict})
    tier = dict(device="cpu", num_blocks=24, kv_offloading_size=0.01)
    arc = {"kv_connector_extra_config": {"eviction_policy": "arc"}}
    assert build(**_engine_args()).course_parts["schedule_waiting"] == "yours"  # no tier: it runs
    assert "stays out" not in capsys.readouterr().out
    parts = build(**tier).course_parts  # LLMEngine refuses a replaced schedule_waiting beside a tier
    assert (parts["schedule_waiting"], parts["lru_evict"]) == ("reference", "yours")
    assert "your schedule_waiting stays out of this engine with an offloading tier" in capsys.readouterr().out
    parts = build(**tier, kv_transfer_config=arc).course_parts  # and an ARC tier a replaced lru_evict
    assert (parts["schedule_waiting"], parts["lru_evict"]) == ("reference", "reference")
    assert "your lru_evict stays out of this engine with an offloading tier: the 'arc' policy never" in (
        capsys.readouterr().out
    )
    with pytest.raises(ValueError, match="schedule_waiting"):  # given as mine, it goes in: the engine says why not
        build(mine={"schedule_waiting": schedule_waiting}, **tier)
