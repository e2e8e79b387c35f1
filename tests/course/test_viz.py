"""The widgets show what the engine really holds, render without a kernel, and only listen.

Scripted scenarios run on a bare ``KVCacheManager`` (no model needed); the
dashboard tests run a real engine on the default model (skipped until it exists).
"""

from __future__ import annotations

import dataclasses
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from mini_vllm.hashing import hash_request_tokens
from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request, RequestStatus
from mini_vllm.scheduler import schedule_whole_prompt
from mini_vllm.viz import BlockTableView, EngineDashboard, FreeQueueView, HashChainView, PoolView, StateSource

BLOCK_SIZE = 4
SHARED_PREFIX = list(range(100, 112))  # 12 tokens = 3 full blocks
A_TOKENS = SHARED_PREFIX + [200]  # 13 tokens: 3 full blocks + 1 partial
B_TOKENS = SHARED_PREFIX + [7, 8, 9]  # 15 tokens: shares A's 3 full blocks
C_TOKENS = list(range(500, 516))  # 16 tokens, nothing in common


class FakeTokenizer:
    """Token id -> "<id>" text: enough to check that tooltips carry the tokens' text."""

    def decode(self, token_ids):
        return "".join(f"<{t}>" for t in token_ids)

    def encode(self, text, add_special_tokens=False):
        return [int(part) for part in re.findall(r"<(\d+)>", text)]


def admit(manager: KVCacheManager, request: Request) -> None:
    """What the scheduler does for a waiting request whose whole prompt fits in one step."""
    num_hit_tokens = schedule_whole_prompt(manager, request)
    assert num_hit_tokens is not None
    request.num_cached_tokens = num_hit_tokens
    request.status = RequestStatus.RUNNING


def finish(manager: KVCacheManager, request: Request) -> None:
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)


@pytest.fixture
def shared():
    """A and B running, sharing blocks 0, 1, 2 (ref_cnt 2); B hit them in the cache."""
    manager = KVCacheManager(6, block_size=BLOCK_SIZE)
    a = Request("A", A_TOKENS, block_size=BLOCK_SIZE)
    b = Request("B", B_TOKENS, block_size=BLOCK_SIZE)
    admit(manager, a)
    admit(manager, b)
    return manager, {"A": a, "B": b}


@pytest.fixture
def evicted(shared):
    """A and B finished, then C took 4 blocks from the head: block 2 (A's third block) was evicted."""
    manager, requests = shared
    finish(manager, requests["A"])
    finish(manager, requests["B"])
    c = Request("C", C_TOKENS, block_size=BLOCK_SIZE)
    admit(manager, c)
    requests["C"] = c
    manager.check_invariants()
    return manager, requests


class _ByClass(HTMLParser):
    """Collects the text inside every element of a given class, keyed by an attribute."""

    def __init__(self, css_class: str, key: str) -> None:
        super().__init__()
        self.css_class, self.key = css_class, key
        self.found: dict[str, str] = {}
        self.titles: dict[str, str] = {}
        self._stack: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        key = attrs.get(self.key) if self.css_class in classes else None
        if key is not None:
            self.found[key] = ""
            self.titles[key] = attrs.get("title", "")
        if tag not in ("br", "img", "input", "meta", "hr"):
            self._stack.append((tag, key))

    def handle_endtag(self, tag):
        if self._stack:
            self._stack.pop()

    def handle_data(self, data):
        for _, key in self._stack:
            if key is not None:
                self.found[key] += " " + data


def texts_by(html: str, css_class: str, key: str = "data-block") -> tuple[dict[str, str], dict[str, str]]:
    parser = _ByClass(css_class, key)
    parser.feed(html)
    squeeze = lambda text: " ".join(text.split())  # noqa: E731
    return {k: squeeze(v) for k, v in parser.found.items()}, parser.titles


def short(token_ids, index):
    return hash_request_tokens(token_ids, BLOCK_SIZE)[index].hex()[:4]


# -- the pool -------------------------------------------------------------------------
def test_pool_view_shows_shared_blocks_ref_counts_owners_and_hashes(shared):
    manager, requests = shared
    view = PoolView(manager, requests=requests)
    text = view.to_text()
    for block_id in range(3):
        assert f"    {block_id}  UC       2  {short(A_TOKENS, block_id)}  A, B" in text
    assert "    3  U        1  -     A" in text  # A's partial tail: in use, no hash
    assert "    4  U        1  -     B" in text
    assert "    5  F        0  -     -             q1" in text
    assert "6 blocks × 4 tokens: 5 in use (3 shared), 0 cached and free, 1 free and empty" in text

    cells, titles = texts_by(view.to_html(), "mv-block")
    assert sorted(cells, key=int) == ["0", "1", "2", "3", "4", "5"]
    assert cells["0"] == f"0 UC ref 2 #{short(A_TOKENS, 0)} A, B"
    assert cells["3"] == "3 U ref 1 — A"
    assert cells["5"] == "5 F ref 0 — q1"
    assert "held by A, B" in titles["1"]


def test_pool_view_after_eviction_shows_free_queue_places_and_next_to_evict(evicted):
    manager, requests = evicted
    assert manager.block_pool.num_evictions == 1
    view = PoolView(manager, requests=requests)
    text = view.to_text()
    # Free queue after the frees was [4, 3, 5, 2, 1, 0]; C popped 4, 3, 5, 2 (evicting 2's hash).
    assert f"    1  C        0  {short(A_TOKENS, 1)}  -             q1 (evict next)" in text
    assert f"    0  C        0  {short(A_TOKENS, 0)}  -             q2" in text
    assert f"    2  UC       1  {short(C_TOKENS, 3)}  C" in text
    assert "next reused: block 1; next evicted: block 1" in text

    html = view.to_html()
    cells, _ = texts_by(html, "mv-block")
    assert cells["1"].endswith("q1 evict") and "evict" not in cells["0"]
    assert re.findall(r'data-block="(\d)"[^>]*style="[^"]*border:4px solid #D55E00', html) == ["1"]  # thick border


def test_pool_view_tooltip_shows_the_blocks_tokens_as_text(evicted):
    manager, requests = evicted
    # Block 0 is free now, but still cached: its text comes from the request that filled it.
    view = PoolView(manager, requests=requests, tokenizer=FakeTokenizer())
    _, titles = texts_by(view.to_html(), "mv-block")
    assert "'<100><101><102><103>'" in titles["0"]
    assert "token ids: 100 101 102 103" in titles["0"]
    assert "token ids: 512 513 514 515" in titles["2"]
    # Without a tokenizer the ids still show.
    _, titles = texts_by(PoolView(manager, requests=requests).to_html(), "mv-block")
    assert "token ids: 104 105 106 107" in titles["1"]


# -- block tables ---------------------------------------------------------------------
def test_block_table_view_points_b_at_as_blocks_with_hits_shared_and_partial_tail(shared):
    manager, requests = shared
    view = BlockTableView(manager, requests=requests)
    text = view.to_text()
    assert "A [running] 13 tokens, 13 computed, 0 hit blocks" in text
    assert "B [running] 15 tokens, 15 computed, 3 hit blocks" in text
    b_part = text[text.index("B [running]") :]
    assert "  logical     0   1   2   3" in b_part
    assert "  physical    0   1   2   4" in b_part
    assert "  ref_cnt     2   2   2   1" in b_part
    assert "  mark      HIT HIT HIT 3/4" in b_part
    a_part = text[text.index("A [running]") : text.index("B [running]")]
    assert "  physical    0   1   2   3" in a_part
    assert "  mark        -   -   - 1/4" in a_part

    html = view.to_html()
    rows = re.findall(r'class="mv-entry" data-request="(\w)" data-logical="(\d)" data-block="(\d)"', html)
    assert rows == [
        ("A", "0", "0"),
        ("A", "1", "1"),
        ("A", "2", "2"),
        ("A", "3", "3"),
        ("B", "0", "0"),
        ("B", "1", "1"),
        ("B", "2", "2"),
        ("B", "3", "4"),
    ]
    b_html = html[html.index('data-request="B" data-logical="0"') :]
    assert b_html.count('class="mv-hit"') == 3  # B's first three blocks came from the cache
    assert html[: html.index('data-request="B" data-logical="0"')].count('class="mv-hit"') == 0
    assert html.count('class="mv-shared"') == 6  # blocks 0-2, in both tables
    assert ">3/4<" in b_html and ">1/4<" in html


def test_block_table_hits_prefer_events_over_num_cached_tokens(shared):
    manager, requests = shared
    source = StateSource(manager, requests=requests)
    source.hit_blocks["B"] = 2  # what a ComputedBlocksFound event would say after a re-admission
    assert "B [running] 15 tokens, 15 computed, 2 hit blocks" in BlockTableView(source).to_text()


# -- free queue -----------------------------------------------------------------------
def test_free_queue_view_lists_head_to_tail_and_marks_next_to_evict(shared):
    manager, requests = shared
    finish(manager, requests["A"])
    finish(manager, requests["B"])
    view = FreeQueueView(manager, requests=requests)
    h = [short(A_TOKENS, i) for i in range(3)]
    # Freed in reverse table order: uncached tails to the head, cached blocks to the tail, last block first.
    assert f"head -> 4:F -> 3:F -> 5:F -> 2:C#{h[2]} -> 1:C#{h[1]} -> 0:C#{h[0]} -> tail" in view.to_text()
    assert "next reused: block 4; next evicted: block 2" in view.to_text()
    html = view.to_html()
    assert re.findall(r'class="mv-free" data-block="(\d)"', html) == ["4", "3", "5", "2", "1", "0"]
    cells, _ = texts_by(html, "mv-free")
    assert cells["4"] == "4 F empty next"
    assert cells["2"] == f"2 C #{h[2]} evict"


def test_free_queue_view_of_a_full_pool_says_it_is_empty():
    manager = KVCacheManager(2, block_size=BLOCK_SIZE)
    admit(manager, Request("X", list(range(8)), block_size=BLOCK_SIZE))
    text = FreeQueueView(manager).to_text()
    assert "(head -> tail, 0 blocks)" in text and "  empty" in text
    assert "next reused: none (no free block); next evicted: none (no cached free block)" in text


class Untouchable:
    """Stands in for the manager's pool and group managers: any read of it fails the test."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _fail(self, what: str):
        raise AssertionError(f"a widget read manager.{self.name}{what}: read KVCacheManager.snapshot() instead")

    def __getattr__(self, attr):
        self._fail(f".{attr}")

    def __getitem__(self, key):
        self._fail(f"[{key!r}]")

    def __iter__(self):
        self._fail(" (iterated)")

    def __len__(self):
        self._fail(" (len)")


def render_with_the_cache_hidden(manager, monkeypatch, views) -> list[str]:
    """Render ``views`` while the manager answers only ``snapshot()`` (taken now) about its cache."""
    taken = manager.snapshot()
    monkeypatch.setattr(manager, "snapshot", lambda: taken)
    for name in ("block_pool", "managers", "sliding_window_managers"):
        monkeypatch.setattr(manager, name, Untouchable(name))
    return [text for view in views for text in (view.to_html(), view.to_text())]


def test_every_view_reads_the_cache_only_through_its_snapshot(evicted, monkeypatch):
    manager, requests = evicted
    views = [
        PoolView(manager, requests=requests),
        BlockTableView(manager, requests=requests),
        FreeQueueView(manager, requests=requests),
        HashChainView(manager, A_TOKENS, requests=requests),
    ]
    expected = [text for view in views for text in (view.to_html(), view.to_text())]
    assert render_with_the_cache_hidden(manager, monkeypatch, views) == expected


def test_a_view_that_reaches_into_the_pool_is_caught(evicted, monkeypatch):
    class PeekingView(FreeQueueView):
        def render_text(self, snap):
            pool = self.source.manager.block_pool  # past the snapshot: what the test forbids
            return str([block.block_id for block in pool.free_block_queue.get_all_free_blocks()])

    manager, requests = evicted
    with pytest.raises(AssertionError, match="a widget read manager.block_pool.free_block_queue"):
        render_with_the_cache_hidden(manager, monkeypatch, [PeekingView(manager, requests=requests)])


# -- hash chain -----------------------------------------------------------------------
def test_hash_chain_view_shows_hits_and_where_the_chain_breaks(evicted):
    manager, requests = evicted
    view = HashChainView(manager, A_TOKENS, requests=requests)
    h = [short(A_TOKENS, i) for i in range(3)]
    lines = view.to_text().splitlines()
    assert lines[1:5] == [
        f"  block 0: NONE -> {h[0]}  HIT block 0",
        f"  block 1: {h[0]} -> {h[1]}  HIT block 1",
        f"  block 2: {h[1]} -> {h[2]}  MISS <- chain breaks",
        "  partial block: 1 tokens, not hashed",
    ]
    assert "2 of 3 full blocks hit in a row; the chain breaks at block 2" in view.to_text()
    html = view.to_html()
    assert re.findall(r'data-block-index="(\d)"', html) == ["0", "1", "2"]
    assert html.count('class="mv-hit"') == 2 and html.count('class="mv-miss"') == 1
    assert "chain breaks here" in html


def test_hash_chain_view_caps_the_usable_hit_at_the_last_prompt_token(evicted):
    manager, requests = evicted
    # C's 4 blocks are all cached, but a request for C must still compute its last token.
    text = HashChainView(manager, C_TOKENS).to_text()
    assert "4 of 4 full blocks hit in a row. A request with this prompt reuses 3 blocks (12 tokens)" in text
    assert "capped: the last prompt token is always computed" in text


def test_hash_chain_view_marks_cached_blocks_after_the_break_unreachable(shared):
    manager, requests = shared
    finish(manager, requests["A"])
    finish(manager, requests["B"])
    pool = manager.block_pool
    # Move block 1 to the head of the free queue and pop it: its hash (A's second block) is evicted,
    # while block 2, which chains on it, is still cached.
    pool.free_block_queue.remove(pool.blocks[1])
    pool.free_block_queue.appendleft(pool.blocks[1])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    view = HashChainView(manager, A_TOKENS)
    text = view.to_text()
    assert "HIT block 0" in text and "MISS <- chain breaks" in text
    assert "UNREACHABLE (cached in block 2)" in text
    assert "1 of 3 full blocks hit in a row; the chain breaks at block 1" in text
    assert view.to_html().count('class="mv-unreachable"') == 1


def test_hash_chain_view_reports_the_first_differing_token_against_a_reference(shared):
    manager, requests = shared
    view = HashChainView(manager, B_TOKENS, reference=A_TOKENS, tokenizer=FakeTokenizer())
    assert view.first_difference() == 12
    assert "first different token: position 12 (block 3): 7 '<7>' vs reference 200 '<200>'" in view.to_text()
    assert 'class="mv-first-diff"' in view.to_html()
    # A text prompt goes through the tokenizer; a prefix of the reference differs where it ends.
    prefix = HashChainView(manager, "<100><101>", reference=A_TOKENS, tokenizer=FakeTokenizer())
    assert prefix.token_ids == [100, 101] and prefix.first_difference() == 2


def test_hash_chain_view_uses_the_cache_salt(shared):
    manager, requests = shared
    text = HashChainView(manager, A_TOKENS, cache_salt="tenant-1").to_text()
    assert "0 of 3 full blocks hit in a row; the chain breaks at block 0" in text


# -- rendering rules ------------------------------------------------------------------
@pytest.mark.parametrize("view_class", [PoolView, BlockTableView, FreeQueueView])
def test_views_render_without_a_kernel_deterministically_and_address_free(evicted, view_class):
    manager, requests = evicted
    view = view_class(manager, requests=requests)
    bundle = view._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"] == repr(view) == view.to_text()
    assert "<script" not in bundle["text/html"] and "<style" not in bundle["text/html"]
    for text in bundle.values():
        assert not re.search(r"0x[0-9a-fA-F]{6,}| at 0x|object at", text)
    # The same state renders to the same bytes, from a new view too.
    again = view_class(manager, requests=dict(reversed(list(requests.items()))))
    assert view.to_html() == view.to_html()
    if view_class is not BlockTableView:  # a table lists requests in the order it was given them
        assert again.to_html() == view.to_html() and again.to_text() == view.to_text()


def test_every_state_has_a_letter_and_a_legend_for_grayscale_readers(evicted):
    manager, requests = evicted
    html = PoolView(manager, requests=requests).to_html()
    assert 'class="mv-legend"' in html
    for label in (
        "F = free, empty",
        "U = in use",
        "UC = in use and cached",
        "C = cached, free",
        "double border = shared",
        "thick border = evicted next",
    ):
        assert label in html
    cells, _ = texts_by(html, "mv-block")
    assert all(cell.split()[1] in {"F", "U", "C", "UC"} for cell in cells.values())
    assert "repeating-linear-gradient" in html  # cached blocks are hatched, not only coloured


def test_large_pools_show_used_and_cached_blocks_and_count_the_rest():
    manager = KVCacheManager(500, block_size=BLOCK_SIZE)
    admit(manager, Request("A", A_TOKENS, block_size=BLOCK_SIZE))
    view = PoolView(manager, max_cells=50)
    cells, _ = texts_by(view.to_html(), "mv-block")
    assert sorted(cells, key=int) == ["0", "1", "2", "3", "4"]  # A's four blocks and the queue's head
    assert "495 more free, empty blocks" in view.to_html()
    queue = FreeQueueView(manager, max_items=20)
    assert "...476 more..." in queue.to_text()


def test_static_snapshot_freezes_the_state(shared):
    manager, requests = shared
    view = PoolView(manager, requests=requests)
    frozen = view.static()
    finish(manager, requests["A"])
    assert frozen._repr_mimebundle_() == {"text/plain": frozen.to_text(), "text/html": frozen.to_html()}
    assert "A, B" in frozen.to_text() and "A, B" not in view.to_text()


def test_views_reject_what_they_cannot_read():
    with pytest.raises(TypeError, match="LLM, an LLMEngine or a KVCacheManager"):
        PoolView(object())
    with pytest.raises(ValueError, match="live=True needs an LLM"):
        PoolView(KVCacheManager(4, block_size=BLOCK_SIZE), live=True)


# -- with an engine -------------------------------------------------------------------
MODEL = os.environ.get("MINI_VLLM_TEST_MODEL")


def model_path() -> str:
    from mini_vllm import default_model_path

    path = MODEL or default_model_path()
    if not Path(path, "config.json").exists():
        pytest.skip(f"the default model is not built yet ({path})")
    return path


PROMPT_IDS = [list(range(10, 60)), list(range(10, 50)) + [3, 4, 5, 6, 7], list(range(10, 42)) + [9] * 30]


def make_llm(**kwargs):
    from mini_vllm import LLM

    kwargs.setdefault("num_blocks", 24)
    return LLM(model_path(), device="cpu", **kwargs)


def run_workload(llm):
    from mini_vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in PROMPT_IDS]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    sampled = llm.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=3))
    # Four 2-block prompts that all grow into a third block: more than 9 blocks hold.
    crowded = llm.generate(
        [{"prompt_token_ids": [k] * 30} for k in range(60, 64)],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    )
    outputs = [
        (o.request_id, o.num_cached_tokens, [c.token_ids for c in o.outputs]) for o in greedy + sampled + crowded
    ]
    return outputs, dataclasses.asdict(llm.llm_engine.get_stats())


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def test_engine_runs_the_same_with_and_without_a_dashboard():
    # A pool so small that requests are preempted and cached blocks evicted.
    plain = make_llm(num_blocks=9, max_num_batched_tokens=64)
    watched = make_llm(num_blocks=9, max_num_batched_tokens=64)
    dashboard = EngineDashboard(watched, min_interval=0.0)
    try:
        assert run_workload(watched) == run_workload(plain)
        stats = watched.llm_engine.get_stats()
        assert stats.num_evictions > 0 and stats.num_preemptions > 0  # the scenario exercised both
        assert dashboard._live.num_renders > 2 and dashboard._live.last_error is None
    finally:
        dashboard.close()


def test_dashboard_listens_and_close_detaches_without_leaking_across_reruns(llm):
    engine = llm.llm_engine
    before = list(engine.events.listeners)
    first = EngineDashboard(llm)
    assert len(engine.events.listeners) == len(before) + 1
    second = EngineDashboard(llm)  # re-running the cell: the old dashboard is closed
    assert not first.is_open and second.is_open
    assert len(engine.events.listeners) == len(before) + 1
    second.close()
    second.close()  # idempotent
    assert engine.events.listeners == before
    assert engine.kv_cache_manager.block_pool.enable_kv_cache_events == bool(before)


def test_step_button_advances_the_engine_and_changes_the_rendered_html(llm):
    from mini_vllm import SamplingParams

    engine = llm.llm_engine
    with EngineDashboard(llm) as dashboard:
        ids = dashboard.add_requests(
            [{"prompt_token_ids": PROMPT_IDS[0]}, {"prompt_token_ids": PROMPT_IDS[1]}],
            SamplingParams(temperature=0, max_tokens=3),
        )
        steps = engine.num_steps
        assert [engine.requests[i].status for i in ids] == [RequestStatus.WAITING] * 2  # queued, not run
        before = dashboard.html.value
        assert "Queued" in before and f"{ids[0]}" in before
        dashboard.step_button.click()
        assert engine.num_steps == steps + 1
        after = dashboard.html.value
        assert after != before and f"Step {steps + 1}: computed" in after
        cells, _ = texts_by(after, "mv-entry", "data-logical")
        assert cells  # the block tables are drawn
        dashboard.run_button.click()
        assert not engine.has_unfinished_requests()
        assert {o.request_id for o in dashboard.last_outputs} == set(ids)
        assert "Finished recently" in dashboard.html.value
        dashboard.step_button.click()  # idle: nothing happens to the engine
        assert "Idle" in dashboard.html.value
        dashboard.reset_button.click()
        assert "Prefix cache reset" in dashboard.html.value
        assert not engine.kv_cache_manager.block_pool.cached_block_hash_to_block._cache


def test_dashboard_follows_generate_live_with_throttled_renders_and_a_final_one(llm):
    from mini_vllm import SamplingParams

    engine = llm.llm_engine
    with EngineDashboard(llm, min_interval=3600.0) as dashboard:
        renders = dashboard._live.num_renders
        llm.generate([{"prompt_token_ids": ids} for ids in PROMPT_IDS], SamplingParams(temperature=0, max_tokens=10))
        # Ten-plus steps, but with a one-hour interval only the final (idle) render happened.
        assert dashboard._live.num_renders == renders + 1
        assert f"step</span> <b>{engine.num_steps}</b>" in dashboard.html.value
        assert len(dashboard.hit_rate_history) >= 10
        assert 'class="mv-sparkline"' in dashboard.html.value


def test_a_failing_view_never_breaks_the_engine(llm, monkeypatch):
    from mini_vllm import SamplingParams

    with EngineDashboard(llm, min_interval=0.0) as dashboard:
        monkeypatch.setattr(dashboard, "to_html", lambda: 1 / 0)
        dashboard._live.render = dashboard.to_html
        out = llm.generate([{"prompt_token_ids": PROMPT_IDS[0]}], SamplingParams(temperature=0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        assert "ZeroDivisionError" in dashboard._live.last_error


def test_dashboard_mimebundle_has_widget_static_html_and_stable_text(llm):
    from mini_vllm import SamplingParams

    with EngineDashboard(llm) as dashboard:
        llm.generate([{"prompt_token_ids": PROMPT_IDS[0]}], SamplingParams(temperature=0, max_tokens=2))
        bundle = dashboard._repr_mimebundle_()
        assert {"text/plain", "text/html", "application/vnd.jupyter.widget-view+json"} <= set(bundle)
        assert bundle["text/plain"] == dashboard.to_text() == repr(dashboard)
        assert "ms" not in bundle["text/plain"] and "‖K‖" not in bundle["text/plain"]
        assert not re.search(r"0x[0-9a-fA-F]{6,}", bundle["text/plain"])
        for css_class in ("mv-header", "mv-tables", "mv-pool", "mv-freequeue", "mv-hashchain"):
            assert f'class="{css_class}"' in bundle["text/html"]
    assert "application/vnd.jupyter.widget-view+json" not in dashboard._repr_mimebundle_()  # closed: static only
    assert set(dashboard.static()._repr_mimebundle_()) == {"text/plain", "text/html"}


def test_a_live_view_follows_the_engine_until_closed(llm):
    from mini_vllm import SamplingParams

    engine = llm.llm_engine
    before = list(engine.events.listeners)
    view = PoolView(llm, live=True, min_interval=0.0)
    assert "application/vnd.jupyter.widget-view+json" in view._repr_mimebundle_()
    engine.add_request("live-a", PROMPT_IDS[0], SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    assert "live-a" in view.widget.value  # updated by the listener, no refresh() called
    view.close()
    assert engine.events.listeners == before
    while engine.has_unfinished_requests():
        engine.step()
    assert "live-a" in view.widget.value  # closed: it no longer follows
    assert set(view._repr_mimebundle_()) == {"text/plain", "text/html"}


def test_shared_blocks_show_one_k_norm_read_from_the_cache_tensor(llm):
    from mini_vllm import SamplingParams

    engine = llm.llm_engine
    with EngineDashboard(llm) as dashboard:
        dashboard.add_requests(
            [{"prompt_token_ids": PROMPT_IDS[0]}, {"prompt_token_ids": PROMPT_IDS[0][:40] + [1, 2]}],
            SamplingParams(temperature=0, max_tokens=2),
            request_ids=["knorm-a", "knorm-b"],
        )
        dashboard.step()
        snap = dashboard.snapshot()
        norms = engine.model_runner.block_statistic(0).tolist()
        a, b = (r for r in snap.requests if r.request_id in ("knorm-a", "knorm-b"))
        shared = [x for x in a.block_ids[0] if x in b.block_ids[0]]
        assert len(shared) >= 2 and b.num_hit_blocks >= 2
        for block_id in shared:
            assert snap.blocks[block_id].ref_cnt == 2
            assert snap.blocks[block_id].k_norm == pytest.approx(norms[block_id]) and norms[block_id] > 0
        html = dashboard.table_view.render_html(snap)
        entry = re.compile(r'data-request="knorm-(a|b)" data-logical="0" data-block="(\d+)".*?‖K‖([\d.]+)', re.S)
        found = {m.group(1): (m.group(2), m.group(3)) for m in entry.finditer(html)}
        assert found["a"] == found["b"]  # B's table points at A's physical block: one tensor, one norm
        dashboard.run()


def test_cached_block_text_does_not_depend_on_when_the_widget_redrew(llm):
    """Token text of a cached, free block is recorded when the block is cached, not at
    render time, so the committed static HTML is the same however the throttle fell."""
    from mini_vllm import SamplingParams

    llm.llm_engine.reset_prefix_cache()
    prompt = list(range(200, 236))  # two full blocks + 4 tokens
    view = PoolView(llm, live=True, min_interval=3600.0)  # no render while the request is alive
    try:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2))
        _, titles = texts_by(view.to_html(), "mv-block")
    finally:
        view.close()
    texts = list(titles.values())
    assert any("token ids: " + " ".join(map(str, prompt[:16])) in t for t in texts)
    assert any("token ids: " + " ".join(map(str, prompt[16:32])) in t for t in texts)


def test_a_live_view_redraws_when_the_prefix_cache_is_reset(llm):
    """reset_prefix_cache() runs between steps; its AllBlocksCleared event reaches the live view."""
    from mini_vllm import SamplingParams

    llm.llm_engine.reset_prefix_cache()
    view = PoolView(llm, live=True, min_interval=3600.0)
    try:
        llm.generate([{"prompt_token_ids": list(range(300, 336))}], SamplingParams(temperature=0, max_tokens=2))
        before = view._live.widget.value
        renders = view._live.num_renders
        assert llm.llm_engine.reset_prefix_cache() is True
        assert view._live.num_renders == renders + 1
        assert view._live.widget.value != before  # the cached blocks are shown as empty now
    finally:
        view.close()


# -- the learner's path: buttons in any order, closing, TTFT, wording ----------------
def test_a_cell_after_a_run_click_still_finds_its_output(llm):
    """Chapter 00: the learner presses Run, then runs the cell that reads the result (once an IndexError)."""
    from mini_vllm import SamplingParams

    with EngineDashboard(llm) as dashboard:
        [request_id] = dashboard.add_requests(
            {"prompt_token_ids": PROMPT_IDS[0]}, SamplingParams(temperature=0, max_tokens=3)
        )
        dashboard.step()
        dashboard.run_button.click()  # the learner
        assert dashboard.run() == []  # the next cell: nothing left to run ...
        assert "Idle" in dashboard.message
        output = dashboard.outputs[request_id]  # ... and the output is still there
        assert output.request_id == request_id and len(output.outputs[0].token_ids) == 3


def test_every_button_works_on_an_idle_engine_in_any_order(llm):
    with EngineDashboard(llm) as dashboard:
        for button, expected in [
            (dashboard.run_button, "Idle"),
            (dashboard.step_button, "Idle"),
            (dashboard.reset_button, "Prefix cache reset"),
            (dashboard.run_button, "Idle"),
        ]:
            button.click()
            assert expected in dashboard.message
            assert not any(b.disabled for b in (dashboard.step_button, dashboard.run_button, dashboard.reset_button))


def test_close_freezes_the_widget_instead_of_blanking_it(llm):
    from mini_vllm import SamplingParams

    engine = llm.llm_engine
    before = list(engine.events.listeners)
    dashboard = EngineDashboard(llm)
    dashboard.close()
    assert engine.events.listeners == before  # detached
    assert dashboard.html.comm is not None and dashboard.box.comm is not None  # the widgets stay: the output keeps them
    assert "Closed" in dashboard.html.value and dashboard.buttons.layout.display == "none"
    frozen = dashboard.html.value
    llm.generate([{"prompt_token_ids": PROMPT_IDS[0]}], SamplingParams(temperature=0, max_tokens=2))
    assert dashboard.html.value == frozen  # it no longer follows


def test_ttft_counts_engine_time_not_the_time_before_the_click(llm, monkeypatch):
    """A fake clock: 100 s pass between queueing and pressing Step; the step itself takes 0.5 s."""
    import mini_vllm.viz.dashboard as dashboard_module
    from mini_vllm import SamplingParams

    clock = {"now": 1000.0}
    monkeypatch.setattr(dashboard_module.time, "monotonic", lambda: clock["now"])
    engine = llm.llm_engine
    with EngineDashboard(llm) as dashboard:
        dashboard.add_requests({"prompt_token_ids": PROMPT_IDS[1]}, SamplingParams(temperature=0, max_tokens=2))
        queued_at = clock["now"]
        clock["now"] += 100.0  # the learner reads the text, then presses Step

        real_step = engine.step

        def slow_step():
            clock["now"] += 0.5  # the engine's work
            return real_step()

        monkeypatch.setattr(engine, "step", slow_step)
        dashboard.step_button.click()
        assert dashboard.last_ttft_steps == 1
        assert dashboard.last_ttft == pytest.approx(0.5)
        assert clock["now"] - queued_at > 100  # what a TTFT from the arrival time would have shown
        assert "1 step, 500.0 ms" in dashboard.html.value
        dashboard.run()


def test_one_token_is_one_token():
    from mini_vllm import SamplingParams

    llm = make_llm()
    with EngineDashboard(llm) as dashboard:
        dashboard.add_requests({"prompt_token_ids": PROMPT_IDS[0]}, SamplingParams(temperature=0, max_tokens=3))
        dashboard.step()  # the prefill
        dashboard.step()  # one decode step: one token
        assert dashboard.message.startswith(f"Step {llm.llm_engine.num_steps}: computed 1 token (")
        dashboard.run()
        assert "1 request finished" in dashboard.message


def test_k_norm_is_explained_and_not_drawn_on_free_empty_blocks():
    from mini_vllm import SamplingParams

    llm = make_llm()
    llm.generate([{"prompt_token_ids": PROMPT_IDS[0][:40]}], SamplingParams(temperature=0, max_tokens=2))
    llm.llm_engine.reset_prefix_cache()  # every block free and empty again, its old K still in the tensor
    view = PoolView(llm, k_norm=True)
    snap = view.snapshot()
    assert any(b.k_norm for b in snap.blocks if b.state == "F")  # stale K in the tensor ...
    html = view.render_html(snap)
    cells = re.findall(r'<div class="mv-block".*?</div></div>', html, re.S)
    assert cells and not any("mv-knorm" in c for c in cells)  # ... but no ‖K‖ on a free, empty block
    assert "‖K‖: L2 norm of the block" in html and "keys in layer 0" in html  # the legend says what the figure is
    assert "‖K‖" not in PoolView(llm).to_html()  # no figure, no explanation


def test_a_request_without_blocks_says_so_on_its_own_row(llm):
    from mini_vllm import SamplingParams

    engine = llm.llm_engine
    engine.add_request("waits", PROMPT_IDS[0], SamplingParams(temperature=0, max_tokens=2))
    try:
        html = BlockTableView(llm).to_html()
        row = re.search(r'data-request="waits".*?no blocks yet \(waiting\)</span>', html, re.S)
        assert row, html[:2000]
        assert "line-height:1.35" in row.group(0).rsplit("<span", 1)[1]  # not squeezed by the cells' line-height 0
    finally:
        engine.abort_request("waits")


def test_the_live_widget_scrolls_its_views_under_a_fixed_header(llm):
    with EngineDashboard(llm, max_height=300) as dashboard:
        value = dashboard.html.value
        header, _, rest = value.partition('class="mv-scroll"')
        assert "mv-header" in header and "mv-header" not in rest  # the header stays above the scroll box
        assert "max-height:300px" in rest[:80] and "mv-tables" in rest
        assert 'class="mv-scroll"' not in dashboard.to_html()  # the static snapshot shows everything


def test_the_snapshot_counts_a_readmission_after_preemption_apart():
    """The dashboard's counters are vLLM 0.33's: a preempted request's re-admission is not a new lookup."""
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = Request("A", list(range(3 * BLOCK_SIZE + 1)), block_size=BLOCK_SIZE)
    for preempted in (False, True):
        assert schedule_whole_prompt(manager, request) is not None
        if not preempted:
            manager.free(request)  # what Scheduler.preempt does
            request.num_computed_tokens = 0
            request.num_preemptions += 1
    snap = PoolView(manager, requests=[request]).snapshot()
    stats = snap.prefix_cache_stats
    assert (stats.queries, stats.hits) == (request.num_tokens, 0)
    assert (stats.preempted_queries, stats.preempted_hits) == (request.num_tokens, 3 * BLOCK_SIZE)
    assert snap.hit_rate == 0.0
    manager.prefix_cache_stats.hits += 1  # the snapshot holds a copy: later counting does not change it
    assert stats.hits == 0
