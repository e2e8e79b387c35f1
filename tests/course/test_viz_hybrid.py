"""The widgets on a hybrid model (one table per KV-cache group), and a single-group engine drawn exactly as before.

A hybrid engine (chapter 08b) keeps, per request, a full-attention table and
a sliding-window table over one pool; the sliding-window table holds the null
block (id -1) where blocks left the window. The views draw every group's
table, count owners over all of them and never draw the null block as a block.

A single-group engine must render byte for byte as it did before the views
knew about groups: the committed notebooks' outputs depend on it. The golden
files under ``tests/course/viz_golden/`` were written by the views before that
change; ``MINI_VLLM_UPDATE_VIZ_GOLDEN=1`` rewrites them (only when a rendering
change is meant).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request, RequestStatus
from mini_vllm.scheduler import schedule_whole_prompt
from mini_vllm.viz import BlockTableView, EngineDashboard, FreeQueueView, HashChainView, PoolView, StateSource

GOLDEN = Path(__file__).parent / "viz_golden"
UPDATE = os.environ.get("MINI_VLLM_UPDATE_VIZ_GOLDEN") == "1"

BLOCK_SIZE = 4
SHARED_PREFIX = list(range(100, 112))
A_TOKENS = SHARED_PREFIX + [200]
B_TOKENS = SHARED_PREFIX + [7, 8, 9]
C_TOKENS = list(range(500, 516))


class FakeTokenizer:
    def decode(self, token_ids):
        return "".join(f"<{t}>" for t in token_ids)

    def encode(self, text, add_special_tokens=False):
        return [int(part) for part in re.findall(r"<(\d+)>", text)]


def admit(manager: KVCacheManager, request: Request) -> None:
    num_hit_tokens = schedule_whole_prompt(manager, request)
    assert num_hit_tokens is not None
    request.num_cached_tokens = num_hit_tokens
    request.status = RequestStatus.RUNNING


def finish(manager: KVCacheManager, request: Request) -> None:
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)


# -- the single-group golden ------------------------------------------------------------
def _views(manager, requests, prompt, reference) -> dict:
    tokenizer = FakeTokenizer()
    return {
        "pool": PoolView(manager, requests=requests, tokenizer=tokenizer),
        "tables": BlockTableView(manager, requests=requests, tokenizer=tokenizer),
        "queue": FreeQueueView(manager, requests=requests, tokenizer=tokenizer),
        "chain": HashChainView(manager, prompt, reference=reference, requests=requests, tokenizer=tokenizer),
    }


def single_group_renderings() -> dict[str, str]:
    """Every view of a few bare-manager scenarios, as text and HTML (no model, so no numerics)."""
    out: dict[str, str] = {}

    def render(scenario: str, views: dict) -> None:
        for name, view in views.items():
            out[f"{scenario}.{name}.txt"] = view.to_text()
            out[f"{scenario}.{name}.html"] = view.to_html()

    manager = KVCacheManager(6, block_size=BLOCK_SIZE)
    requests = {"A": Request("A", A_TOKENS, block_size=BLOCK_SIZE), "B": Request("B", B_TOKENS, block_size=BLOCK_SIZE)}
    admit(manager, requests["A"])
    admit(manager, requests["B"])
    render("shared", _views(manager, requests, B_TOKENS, A_TOKENS))

    finish(manager, requests["A"])
    finish(manager, requests["B"])
    requests["C"] = Request("C", C_TOKENS, block_size=BLOCK_SIZE)
    admit(manager, requests["C"])
    requests["W"] = Request("W", list(range(300, 309)), block_size=BLOCK_SIZE)  # waiting: no blocks yet
    render("evicted", _views(manager, requests, A_TOKENS, None))

    large = KVCacheManager(60, block_size=BLOCK_SIZE)
    admit(large, Request("L", list(range(40)), block_size=BLOCK_SIZE))
    out["large.pool.txt"] = PoolView(large, max_cells=20).to_text()
    out["large.pool.html"] = PoolView(large, max_cells=20, show_legend=False).to_html()
    out["large.queue.txt"] = FreeQueueView(large, max_items=12).to_text()
    out["large.queue.html"] = FreeQueueView(large, max_items=12).to_html()

    uncached = KVCacheManager(4, block_size=BLOCK_SIZE, enable_caching=False)
    solo = {"U": Request("U", list(range(10)), block_size=BLOCK_SIZE)}
    admit(uncached, solo["U"])
    render("uncached", _views(uncached, solo, list(range(10)), None))
    return out


def model_path() -> str:
    from mini_vllm import default_model_path

    path = default_model_path()
    if not Path(path, "config.json").exists():
        pytest.skip(f"the default model is not built yet ({path})")
    return path


def dashboard_renderings() -> dict[str, str]:
    """A dashboard on the default model: queued (text and HTML), then one step (text: no timings, no numerics)."""
    from mini_vllm import LLM, SamplingParams

    llm = LLM(model_path(), device="cpu", num_blocks=24)
    out: dict[str, str] = {}
    with EngineDashboard(llm, k_norm=False, min_interval=0.0) as dashboard:
        dashboard.add_requests(
            [{"prompt_token_ids": list(range(10, 58))}, {"prompt_token_ids": list(range(10, 42)) + [9] * 20}],
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        )
        out["dashboard.queued.txt"] = dashboard.to_text()
        out["dashboard.queued.html"] = dashboard.to_html()
        dashboard.step()
        out["dashboard.stepped.txt"] = dashboard.to_text()
    return out


def _check_golden(renderings: dict[str, str]) -> None:
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        for name, text in renderings.items():
            (GOLDEN / name).write_text(text, encoding="utf-8")
    for name, text in renderings.items():
        assert text == (GOLDEN / name).read_text(encoding="utf-8"), f"{name} renders differently than before"


def test_single_group_views_render_exactly_as_before():
    _check_golden(single_group_renderings())


def test_single_group_dashboard_renders_exactly_as_before():
    _check_golden(dashboard_renderings())


def test_the_golden_files_hold_real_renderings():
    # An empty or truncated golden would make the comparison above vacuous.
    tables = (GOLDEN / "shared.tables.txt").read_text(encoding="utf-8")
    assert "B [running] 15 tokens, 15 computed, 3 hit blocks" in tables and "  mark      HIT HIT HIT 3/4" in tables
    assert 'class="mv-entry" data-request="B" data-logical="0" data-block="0" title=' in (
        GOLDEN / "shared.tables.html"
    ).read_text(encoding="utf-8")
    assert "EngineDashboard: step 1, 2 running" in (GOLDEN / "dashboard.stepped.txt").read_text(encoding="utf-8")
    assert "block  state  ref  hash  owners        free queue" in (GOLDEN / "evicted.pool.txt").read_text()


def test_a_single_group_snapshot_has_one_full_attention_group():
    manager = KVCacheManager(6, block_size=BLOCK_SIZE)
    a = Request("A", A_TOKENS, block_size=BLOCK_SIZE)
    admit(manager, a)
    snap = StateSource(manager, requests=[a]).snapshot()
    assert snap.groups == ("full attention",) and snap.num_groups == 1
    assert snap.labelled_groups == () and snap.group_tag(0) == ""  # one group: nothing to tell apart
    (info,) = snap.requests
    assert info.block_ids == ((0, 1, 2, 3),)  # one table per group
    assert [b.group for b in snap.blocks] == [0, 0, 0, 0, None, None]  # held by group 0; free and empty: none
    assert snap.cached_by_group == (snap.cached,)


# -- a hybrid engine ------------------------------------------------------------------------
WINDOW = 64
HYBRID_BLOCK_SIZE = 16
P1 = list(range(10, 305))  # 295 tokens
P2 = P1[:250] + list(range(700, 740))  # shares P1's first 250 tokens
P3 = P2[:260] + [5] * 20  # 280 tokens: hits what P1 and P2 left


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory) -> str:
    """The bundled hybrid model, or the default model with its layout (layers 0, 2 sliding) in a temp folder."""
    from mini_vllm.model import hybrid_model_path

    if Path(hybrid_model_path(), "config.json").exists():
        return hybrid_model_path()
    folder = tmp_path_factory.mktemp("hybrid") / "model"
    shutil.copytree(model_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        use_sliding_window=True,
    )
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def hybrid(hybrid_path):
    """P1 and P2 ran to the end; then c (P3) was admitted with a hit, decoded a step, and d (P3 again) hit c's blocks.

    Returns (llm, dashboard, snapshot of that moment). c's window moved past its
    first blocks: its sliding-window table starts with null blocks.
    """
    from mini_vllm import LLM, SamplingParams

    llm = LLM(hybrid_path, block_size=HYBRID_BLOCK_SIZE, num_blocks=48, attention_backend="torch", device="cpu")
    manager = llm.llm_engine.kv_cache_manager
    assert len(manager.managers) == 2
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    dashboard = EngineDashboard(llm, k_norm=False, min_interval=0.0)
    llm.generate([{"prompt_token_ids": P1}], params)
    llm.generate([{"prompt_token_ids": P2}], params)
    dashboard.add_requests([{"prompt_token_ids": P3}], params, request_ids=["c"])
    dashboard.step()
    dashboard.add_requests([{"prompt_token_ids": P3}], params, request_ids=["d"])
    dashboard.step()
    manager.check_invariants()
    yield llm, dashboard, dashboard.snapshot()
    dashboard.close()


def _request(snap, request_id):
    return next(r for r in snap.requests if r.request_id == request_id)


def test_the_snapshot_describes_both_groups_and_every_table(hybrid):
    llm, _, snap = hybrid
    manager = llm.llm_engine.kv_cache_manager
    assert snap.labelled_groups == snap.kv_cache_groups and snap.num_groups == 2
    assert snap.groups == ("full attention", f"sliding window {WINDOW} tokens")
    assert [(g.group_id, g.sliding_window, g.layer_ids) for g in snap.kv_cache_groups] == [
        (0, None, (1, 3)),
        (1, WINDOW, (0, 2)),
    ]
    for request_id in ("c", "d"):
        info = _request(snap, request_id)
        assert info.block_ids == tuple(map(tuple, manager.get_block_ids_by_group(request_id)))
    assert [b.block_id for b in snap.blocks] == list(range(48))  # the null block is not a block of the pool


def test_a_request_whose_window_moved_shows_nulls_in_its_sliding_window_row(hybrid):
    llm, _, snap = hybrid
    c = _request(snap, "c")
    full, sliding = c.block_ids
    # c computed 281 tokens: its next token's window starts at token 281 - 63 = 218, in block 13.
    assert c.num_computed_tokens == 281
    assert sliding[:13] == (-1,) * 13 and -1 not in sliding[13:] and len(sliding) == 18
    assert -1 not in full and len(full) == 18

    text = BlockTableView(llm).render_text(snap)
    c_part = text[text.index("c [running]") : text.index("d [running]")]
    rows = {line.split()[0] if not line.startswith("       ") else None: line for line in c_part.splitlines()}
    assert "∅" not in rows["full"] and rows["full"].split()[2:] == [str(b) for b in full]
    assert rows["SW64"].split()[2:] == ["∅"] * 13 + [str(b) for b in sliding[13:]]

    html = BlockTableView(llm).render_html(snap)
    entries = re.findall(
        r'class="mv-entry( mv-null)?" data-request="c" data-logical="(\d+)" data-block="(-?\d+)" '
        r'data-group="(\d)" title="([^"]*)"',
        html,
    )
    by_group = {g: [(int(i), int(b), bool(null), title) for null, i, b, gg, title in entries if gg == g] for g in "01"}
    assert [b for _, b, _, _ in by_group["0"]] == list(full)
    assert [b for _, b, _, _ in by_group["1"]] == list(sliding)
    nulls = [(i, title) for i, b, null, title in by_group["1"] if null]
    assert [i for i, _ in nulls] == list(range(13))
    assert all("null block: left the sliding window, freed" in title for _, title in nulls)
    assert not any(null for _, _, null, _ in by_group["0"])
    # One labelled row per group under c.
    assert re.findall(r'class="mv-group-row" data-request="c" data-group="(\d)"', html) == ["0", "1"]


def test_hits_are_marked_per_group(hybrid):
    llm, dashboard, snap = hybrid
    c, d = _request(snap, "c"), _request(snap, "d")
    # The dashboard counts hit positions from ComputedBlocksFound (whose block ids list both groups' blocks).
    assert dashboard.source.hit_blocks == {"c": 16, "d": 17}
    assert (c.num_hit_blocks, d.num_hit_blocks) == (16, 17)
    # Full attention: every hit position. Sliding window: only the hit blocks still in the table.
    assert [c.is_hit(i, 0) for i in range(18)] == [True] * 16 + [False] * 2
    assert [c.is_hit(i, 1) for i in range(18)] == [False] * 13 + [True] * 3 + [False] * 2
    assert [d.is_hit(i, 1) for i in range(18)] == [False] * 13 + [True] * 4 + [False]

    text = BlockTableView(llm).render_text(snap)
    d_part = text[text.index("d [running]") :]
    marks = [line.split()[1:] for line in d_part.splitlines() if line.strip().startswith("mark")]
    assert marks[0] == ["HIT"] * 17 + ["9/16"]
    assert marks[1] == ["-"] * 13 + ["HIT"] * 4 + ["9/16"]

    html = BlockTableView(llm).render_html(snap)
    cells = re.findall(
        r'<div class="mv-entry[^"]*" data-request="d" data-logical="\d+" data-block="-?\d+" '
        r'data-group="(\d)".*?</div></div>',
        html,
        re.S,
    )
    assert len(cells) == 36
    hits = re.findall(
        r'<div class="mv-entry[^"]*" data-request="d"[^>]*data-group="(\d)"(?:(?!mv-entry).)*?mv-hit', html, re.S
    )
    assert hits.count("0") == 17 and hits.count("1") == 4


def test_owners_and_groups_cover_the_blocks_of_both_groups(hybrid):
    llm, _, snap = hybrid
    manager = llm.llm_engine.kv_cache_manager
    expected_owners: dict[int, set[str]] = {}
    expected_group: dict[int, int] = {}
    for group_id, group_manager in enumerate(manager.managers):
        for request_id, table in group_manager.req_to_blocks.items():
            for block in table:
                if block.block_id >= 0:
                    expected_owners.setdefault(block.block_id, set()).add(request_id)
                    expected_group[block.block_id] = group_id
    sliding_held = {b for b, g in expected_group.items() if g == 1}
    assert sliding_held and set(expected_group.values()) == {0, 1}
    for block in snap.blocks:
        assert set(block.owners) == expected_owners.get(block.block_id, set()), block
        assert len(block.owners) == block.ref_cnt  # every holder is named, in whichever group
        if block.block_id in expected_group:
            assert block.group == expected_group[block.block_id]
        elif block.block_hash is not None:  # free but cached: the group it is cached for
            assert block.group == manager.block_pool.blocks[block.block_id].kv_cache_group_id
        else:
            assert block.group is None
    # c and d share their hit blocks in both groups.
    c, d = _request(snap, "c"), _request(snap, "d")
    assert snap.blocks[c.block_ids[0][0]].owners == ("c", "d")
    shared_sliding = snap.blocks[d.block_ids[1][13]]
    assert shared_sliding.owners == ("c", "d") and shared_sliding.group == 1
    assert any(b.group == 1 and b.ref_cnt == 0 and b.block_hash for b in snap.blocks)  # a cached, free SW block

    text = PoolView(llm).render_text(snap)
    assert "block  state  ref  hash  group  owners        free queue" in text
    line = next(row for row in text.splitlines() if row.startswith(f"{shared_sliding.block_id:>5}  "))
    assert line.split()[4:6] == ["SW64", "c,"] and line.split()[6] == "d"
    counts = f"by group: full {sum(b.group == 0 for b in snap.blocks)}, SW64 {sum(b.group == 1 for b in snap.blocks)}"
    assert counts in text
    html = PoolView(llm).render_html(snap)
    cells = dict(re.findall(r'class="mv-block" data-block="(\d+)"(?: data-group="(\d)")?', html))
    assert {int(b): (int(g) if g else None) for b, g in cells.items()} == {b.block_id: b.group for b in snap.blocks}
    assert 'class="mv-group-key"' in html and "group 1: sliding window 64 tokens (layers 0, 2)" in html


def test_the_free_queue_names_the_group_a_cached_block_is_cached_for(hybrid):
    llm, _, snap = hybrid
    text = FreeQueueView(llm).render_text(snap)
    for block_id in snap.free_queue:
        block = snap.blocks[block_id]
        tag = {0: "/full", 1: "/SW64"}.get(block.group, "")
        assert (
            f" {block_id}:{block.state}" + (f"#{block.block_hash.hex()[:4]}" if block.block_hash else "") + tag in text
        )
    assert "/SW64" in text and "/full" in text


def test_the_dashboard_says_how_many_groups_and_the_window(hybrid):
    _, dashboard, _ = hybrid
    text = dashboard.to_text()
    assert text.splitlines()[1] == (
        "KV-cache groups (2, one pool): group 0 full attention (layers 1, 3); "
        "group 1 sliding window 64 tokens (layers 0, 2)"
    )
    html = dashboard.to_html()
    assert "48 blocks × 16 tokens shared by 2 KV-cache groups: group 0 full attention (layers 1, 3); " in html
    assert "∅ = null block: left the sliding window, freed" in html


def test_the_hash_chain_hit_is_what_every_group_serves(hybrid, hybrid_path):
    llm, _, snap = hybrid
    manager = llm.llm_engine.kv_cache_manager
    cut = P1[:200] + [1] * 40  # P1's first 12 blocks, then something else
    for prompt in (P1, P2, P3, cut):
        view = HashChainView(llm, prompt)
        request = Request("probe", prompt, block_size=HYBRID_BLOCK_SIZE)
        _, num_tokens = manager.get_computed_blocks(request)  # takes no reference
        manager.shared_prefix_boundary.pop("probe", None)
        assert view.summary(snap)["usable"] * HYBRID_BLOCK_SIZE == num_tokens
    # cut's full-attention prefix is cached, but the sliding-window group has no window's worth there.
    view = HashChainView(llm, cut)
    summary = view.summary(snap)
    assert summary["full_usable"] == 12 and summary["usable"] == 0
    text = view.render_text(snap)
    assert "12 of 15 full blocks hit in a row; the chain breaks at block 12" in text
    assert "reuses 0 blocks (0 tokens) — not 12: every KV-cache group must serve the hit" in text
    assert "; SW64: block " in text and "; SW64: -" in text
    assert "cached for SW64 (group 1)" in view.render_html(snap)


# -- Gemma 3's layout: six groups on one screen -----------------------------------------------
def test_six_groups_render_each_with_its_own_tag_and_colour():
    """A 5:1 layout (one full-attention group, five sliding-window groups of one spec): every view
    names each group apart (``SW8.1`` .. ``SW8.5``), and the six groups get six colours."""
    from mini_vllm.kv_cache_interface import make_kv_cache_config
    from mini_vllm.viz.html import group_color

    config = make_kv_cache_config([8] * 5 + [None], BLOCK_SIZE, 60)
    manager = KVCacheManager(60, block_size=BLOCK_SIZE, kv_cache_config=config)
    requests = {"A": Request("A", list(range(40)), block_size=BLOCK_SIZE)}
    admit(manager, requests["A"])
    finish(manager, requests["A"])
    requests["B"] = Request("B", list(range(40)) + [7] * 5, block_size=BLOCK_SIZE)
    admit(manager, requests["B"])
    snap = StateSource(manager, requests=list(requests.values())).snapshot()
    tags = [group.tag for group in snap.kv_cache_groups]
    assert tags == ["full", "SW8.1", "SW8.2", "SW8.3", "SW8.4", "SW8.5"]
    assert snap.kv_cache_groups[3].description == "sliding window 8 tokens (3 of 5)"
    assert len({group_color(group.group_id) for group in snap.kv_cache_groups}) == 6
    (b,) = [r for r in snap.requests if r.request_id == "B"]
    assert len(b.block_ids) == 6
    for name, view in _views(manager, requests, requests["B"].all_token_ids, None).items():
        text = view.to_text()
        view.to_html()
        if name == "tables":
            assert all(tag in text for tag in tags), text
