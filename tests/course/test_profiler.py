"""The miss profiler tells the truth: its numbers are the engine's (oracle: a real KVCacheManager).
(mini_vllm/companions/profiler.py, chapter 09.)"""

from __future__ import annotations

import random

import pytest

from mini_vllm.companions.profiler import explain_miss, simulate_prefix_cache
from mini_vllm.companions.router import CacheReplica


class CharTokenizer:
    """One token per character: enough to test the decoded context."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def engine_hit(cached, new, block_size=16, cached_salt=None, new_salt=None):
    """What the engine's KV-cache manager really reuses for ``new`` after serving ``cached``."""
    replica = CacheReplica(num_blocks=64, block_size=block_size)
    replica.serve(cached, cached_salt)
    return replica.serve(new, new_salt)


def test_a_divergence_in_the_middle_breaks_its_block_and_every_later_one():
    cached = list(range(100))
    new = list(range(37)) + [999] + list(range(38, 100))
    report = explain_miss(cached, new, block_size=16)
    assert report.num_common_tokens == 37
    assert report.first_diff_token == 37
    assert report.first_broken_block == 2
    assert report.num_matching_blocks == 2
    assert report.num_reusable_blocks == 2
    assert report.num_reusable_tokens == 32
    assert report.num_lost_tokens == 5  # tokens 32..36 are equal but live in the broken block
    assert report.block_states() == ["hit", "hit", "broken", "miss", "miss", "miss", "partial"]
    assert "token 37" in report.reason and "block 2" in report.reason


def test_identical_prompts_on_a_block_boundary_recompute_their_last_block():
    tokens = list(range(48))
    report = explain_miss(tokens, tokens, block_size=16)
    assert report.first_diff_token is None
    assert report.num_matching_blocks == 3
    assert report.num_reusable_blocks == 2  # (48 - 1) // 16
    assert report.block_states() == ["hit", "hit", "last"]
    assert "logits" in report.reason


def test_identical_prompts_with_a_partial_tail_reuse_every_full_block():
    tokens = list(range(50))
    report = explain_miss(tokens, tokens, block_size=16)
    assert report.num_reusable_tokens == 48
    assert report.block_states() == ["hit", "hit", "hit", "partial"]


def test_an_appended_prompt_reuses_every_full_block_of_the_cached_one():
    report = explain_miss(list(range(40)), list(range(100)), block_size=16)
    assert report.first_diff_token is None
    assert report.num_reusable_tokens == 32
    assert report.first_broken_block == 2
    assert "append" in report.reason


def test_different_salts_share_nothing():
    tokens = list(range(64))
    report = explain_miss(tokens, tokens, cached_salt="tenant-a", new_salt="tenant-b")
    assert report.salts_differ
    assert report.num_reusable_tokens == 0
    assert "salt" in report.reason


def test_a_difference_at_token_zero_reuses_nothing():
    report = explain_miss([1] * 40, [2] + [1] * 39)
    assert report.first_diff_token == 0
    assert report.num_reusable_tokens == 0
    assert "first token" in report.reason


@pytest.mark.parametrize("seed", range(40))
def test_the_report_matches_what_the_engine_reuses(seed):
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    cached = [rng.randrange(5) for _ in range(rng.randint(1, 120))]
    cut = rng.randint(0, len(cached))
    new = cached[:cut] + [rng.randrange(5) for _ in range(rng.randint(1 if cut == 0 else 0, 60))]
    salts = rng.choice([(None, None), ("a", "a"), ("a", "b")])
    report = explain_miss(cached, new, block_size=block_size, cached_salt=salts[0], new_salt=salts[1])
    assert report.num_reusable_tokens == engine_hit(cached, new, block_size, *salts)
    assert report.num_reusable_tokens + report.num_tokens_to_compute == len(new)


def test_text_prompts_need_a_tokenizer_and_show_the_text_around_the_divergence():
    with pytest.raises(ValueError, match="tokenizer"):
        explain_miss("a cat", "a dog")
    tokenizer = CharTokenizer()
    cached = "Current time: 09:14:07. You are a storyteller who loves cats."
    new = "Current time: 09:14:52. You are a storyteller who loves cats."
    report = explain_miss(cached, new, block_size=4, tokenizer=tokenizer, window=6)
    assert report.first_diff_token == cached.index("07")
    assert report.context_before == "09:14:"
    assert report.context_cached.startswith("07")
    assert report.context_new.startswith("52")
    text = report.to_text()
    assert "first difference: token 20 (block 5, offset 0)" in text
    assert "'09:14:'" in text
    html = report._repr_html_()
    assert "<mark" in html and "block 5" in html


def test_html_strip_shows_the_text_symbols_and_a_legend():
    """The HTML squares carry the same ✓/✗/·/_ symbols as the text report, explained in a legend."""
    tokenizer = CharTokenizer()
    cached = "aaaabbbbccccdddd"
    new = "aaaabbbbXcccdddde"  # blocks: ✓ ✓ ✗ · _
    report = explain_miss(cached, new, block_size=4, tokenizer=tokenizer)
    assert report._strip() == "✓✓✗·_"
    html = report._repr_html_()
    import re

    squares = re.findall(r'title="block \d+: [^"]*"[^>]*>([^<]*)</span>', html)
    assert "".join(squares) == report._strip()
    for label in ("reused", "first broken block", "misses after it", "partial (never hashed)"):
        assert label in html
    assert "equal but recomputed" not in html  # the legend lists only the states shown


def test_html_escapes_the_prompt_text():
    tokenizer = CharTokenizer()
    report = explain_miss("<b>x</b> one", "<b>x</b> two", block_size=4, tokenizer=tokenizer)
    assert "<b>x</b>" not in report._repr_html_()


def test_the_simulation_matches_an_engine_that_never_evicts():
    rng = random.Random(0)
    systems = [[rng.randrange(50) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randint(1, 20))] for _ in range(30)]
    sim = simulate_prefix_cache(prompts, block_size=8)
    replica = CacheReplica(num_blocks=1000, block_size=8)
    assert sim.num_hit_tokens == [replica.serve(p) for p in prompts]
    assert sim.hit_rate == pytest.approx(replica.hit_rate)


def test_the_simulation_names_the_best_earlier_match_and_explains_it():
    a = list(range(64))
    b = list(range(100, 164))
    c = list(range(40)) + [7] * 24
    sim = simulate_prefix_cache([a, b, c], block_size=16)
    assert sim.num_hit_tokens == [0, 0, 32]
    assert sim.best_match == [None, None, 0]
    assert sim.explain(2).first_diff_token == 40
    assert "hit rate" in sim.to_text()


def test_salted_prompts_only_hit_their_own_tenant():
    tokens = list(range(64))
    sim = simulate_prefix_cache([tokens, tokens, tokens], block_size=16, cache_salts=["a", "b", "a"])
    assert sim.num_hit_tokens == [0, 0, 48]
