"""Why did this prompt miss the prefix cache? A token-level profiler (chapter 09).

The prefix cache compares *token ids*, one full block at a time, along a hash
chain. So the question "why did request B not reuse request A's prefix?" has
an exact answer: the first token where the two id lists differ. Everything
before the block that holds that token is reused; that block and every block
after it miss, because each block's hash covers every token before it.

    >>> from mini_vllm.companions.profiler import explain_miss
    >>> report = explain_miss(tokens_a, tokens_b, block_size=16, tokenizer=tok)
    >>> report.first_diff_token, report.first_broken_block, report.num_reusable_tokens
    >>> report            # a readable summary (HTML in a notebook)

``simulate_prefix_cache`` replays a list of prompts against an unbounded
prefix cache (no model, no eviction) and reports each prompt's hit, which is
what the engine would report as ``num_cached_tokens`` when nothing is evicted.

Both compute block hashes with ``mini_vllm.hashing.hash_request_tokens``, the
engine's own function, so a cache salt (or any other extra key) is taken into
account exactly as the engine does.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import DEFAULT_BLOCK_SIZE, check_block_size
from ..hashing import BlockHash, hash_request_tokens
from ..kv_cache_manager import longest_cache_hit, max_cache_hit_blocks

PromptLike = str | Sequence[int] | Sequence[dict]


# -- one pair of prompts ------------------------------------------------------------
@dataclass(repr=False)
class MissReport:
    """How much of ``new`` can reuse the cached blocks of ``cached``, and why not more.

    All counts are in tokens or blocks of ``block_size`` tokens. ``cached`` is
    the prompt assumed to be in the prefix cache; ``new`` the prompt that arrives.

    Attributes:
        num_common_tokens: length of the longest common token prefix.
        first_diff_token: index of the first token where the prompts differ;
            None when one prompt is a prefix of the other (or they are equal).
        first_broken_block: the first full block of ``new`` whose hash has no
            twin in ``cached`` (None when every full block of ``new`` matches).
            When ``new`` merely extends ``cached`` this is its first new block.
        num_matching_blocks: leading full blocks with equal hashes.
        num_reusable_blocks: what the engine would hit: the matching blocks,
            capped at ``(len(new) - 1) // block_size`` (``max_cache_hit_blocks``) because
            the last token of a prompt is always computed (its logits give the first output token).
        num_lost_tokens: equal tokens that are recomputed anyway: the start of
            the broken block (or the capped last block, or a partial tail).
        salts_differ: the two prompts carry different cache salts.
        context_cached / context_new: decoded text around the divergence
            (None without a tokenizer).
    """

    block_size: int
    num_tokens_cached: int
    num_tokens_new: int
    num_common_tokens: int
    first_diff_token: int | None
    first_broken_block: int | None
    num_matching_blocks: int
    num_reusable_blocks: int
    salts_differ: bool = False
    context_before: str | None = None
    context_cached: str | None = None
    context_new: str | None = None
    cached_token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)

    # -- derived numbers ----------------------------------------------------------
    @property
    def num_reusable_tokens(self) -> int:
        return self.num_reusable_blocks * self.block_size

    @property
    def num_tokens_to_compute(self) -> int:
        """Prefill tokens ``new`` still computes."""
        return self.num_tokens_new - self.num_reusable_tokens

    @property
    def num_lost_tokens(self) -> int:
        """Tokens equal in both prompts that are recomputed anyway."""
        if self.salts_differ:
            return 0
        return self.num_common_tokens - self.num_reusable_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of ``new``'s tokens served from the cache."""
        return self.num_reusable_tokens / self.num_tokens_new if self.num_tokens_new else 0.0

    @property
    def num_full_blocks_new(self) -> int:
        return self.num_tokens_new // self.block_size

    def block_states(self) -> list[str]:
        """One state per block of ``new``: "hit", "broken", "miss", "last" (capped) or "partial"."""
        states = []
        num_blocks = -(-self.num_tokens_new // self.block_size)
        for index in range(num_blocks):
            if index >= self.num_full_blocks_new:
                states.append("partial")
            elif index < self.num_reusable_blocks:
                states.append("hit")
            elif index < self.num_matching_blocks:
                states.append("last")  # matches, but the last-token rule recomputes it
            elif index == self.first_broken_block and self.first_diff_token is not None:
                states.append("broken")
            else:
                states.append("miss")
        return states

    # -- the explanation ------------------------------------------------------------
    @property
    def reason(self) -> str:
        """One or two sentences: why ``new`` reuses what it reuses."""
        bs = self.block_size
        if self.salts_differ:
            return (
                "The cache salts differ: the salt enters block 0's hash and every later hash chains "
                "over it, so no block can be shared, whatever the tokens."
            )
        if self.first_diff_token is None:
            if self.num_tokens_new == self.num_tokens_cached:
                tail = self.num_tokens_new % bs
                if tail:
                    return (
                        f"The prompts are identical. All {self.num_reusable_blocks} full blocks are reused; "
                        f"the last {tail} tokens fill only part of a block, which is never cached: they are computed."
                    )
                return (
                    f"The prompts are identical and end exactly on a block boundary. The last block is "
                    f"recomputed anyway: the last token's logits are needed, so the lookup stops at "
                    f"(num_tokens - 1) // block_size = {self.num_reusable_blocks} blocks."
                )
            if self.num_tokens_new > self.num_tokens_cached:
                tail = self.num_tokens_cached % bs
                extra = (
                    f" Its last {tail} tokens filled only part of a block, which was never hashed: they are recomputed."
                    if tail
                    else ""
                )
                return (
                    f"The new prompt extends the cached one (append-only): the cached prompt's "
                    f"{self.num_tokens_cached // bs} full blocks are all reused.{extra}"
                )
            return (
                "The new prompt is a prefix of the cached one: its full blocks are reused, "
                "except that its last token is always computed."
            )
        block, offset = divmod(self.first_diff_token, bs)
        if self.first_diff_token == 0:
            return "The prompts differ from the very first token: nothing can be reused."
        lost = (
            f" Its first {offset} tokens are equal in both prompts but are recomputed: a block "
            f"is reused whole or not at all."
            if offset
            else ""
        )
        return (
            f"The prompts first differ at token {self.first_diff_token}, in block {block} "
            f"(offset {offset}). Blocks 0..{block - 1} are reused; block {block} and every block "
            f"after it miss, because each block's hash chains over all the tokens before it.{lost}"
            if block > 0
            else f"The prompts first differ at token {self.first_diff_token}, inside block 0: "
            f"nothing can be reused.{lost}"
        )

    def _strip(self) -> str:
        symbols = {"hit": "✓", "last": "↻", "broken": "✗", "miss": "·", "partial": "_"}
        return "".join(symbols[s] for s in self.block_states())

    def to_text(self) -> str:
        bs = self.block_size
        lines = [f"MissReport (block_size={bs})"]
        for label, n in (("cached", self.num_tokens_cached), ("new", self.num_tokens_new)):
            lines.append(f"  {label + ' prompt:':<15}{n:>5} tokens = {n // bs} full blocks + {n % bs}")
        lines.append(f"  common prefix: {self.num_common_tokens:>5} tokens")
        if self.salts_differ:
            lines.append("  cache salts:   differ")
        if self.first_diff_token is not None:
            block, offset = divmod(self.first_diff_token, bs)
            lines.append(f"  first difference: token {self.first_diff_token} (block {block}, offset {offset})")
        lines.append(
            f"  reusable: {self.num_reusable_blocks} blocks = {self.num_reusable_tokens} tokens "
            f"({self.hit_rate:.0%} of the new prompt); {self.num_tokens_to_compute} tokens to compute"
        )
        lines.append(f"  blocks of the new prompt: {self._strip()}")
        lines.append("    (✓ reused  ↻ equal but recomputed (last block)  ✗ first broken block  · miss  _ partial)")
        if self.context_new is not None and self.first_diff_token is not None:
            lines.append(f"  around token {self.first_diff_token}:")
            lines.append(f"    cached: …{self.context_before!r} ⟦{self.context_cached!r}⟧")
            lines.append(f"    new:    …{self.context_before!r} ⟦{self.context_new!r}⟧")
        lines.append(f"  why: {self.reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        colors = {"hit": "#009E73", "last": "#56B4E9", "broken": "#D55E00", "miss": "#F0C9B5", "partial": "#DDDDDD"}
        titles = {
            "hit": "reused from the cache",
            "last": "equal, but recomputed: the last token must be computed",
            "broken": "first block whose hash differs",
            "miss": "misses: its hash chains over the broken block",
            "partial": "partial block: never hashed",
        }
        symbols = {"hit": "✓", "last": "↻", "broken": "✗", "miss": "·", "partial": "_"}

        def square(state: str, title: str) -> str:  # one coloured block with its text-report symbol
            return (
                f'<span title="{title}" style="display:inline-block;width:15px;height:15px;margin:1px;'
                f"border-radius:2px;background:{colors[state]};font:bold 11px/15px monospace;"
                f'text-align:center;color:#222">{symbols[state]}</span>'
            )

        states = self.block_states()
        cells = "".join(square(s, f"block {i}: {titles[s]}") for i, s in enumerate(states))
        legend = " ".join(
            f'<span style="white-space:nowrap">{square(s, titles[s])} {label}</span>'
            for s, label in (
                ("hit", "reused"),
                ("last", "equal but recomputed (last block)"),
                ("broken", "first broken block"),
                ("miss", "misses after it"),
                ("partial", "partial (never hashed)"),
            )
            if s in states
        )
        rows = [
            ("cached prompt", f"{self.num_tokens_cached} tokens"),
            ("new prompt", f"{self.num_tokens_new} tokens"),
            ("common prefix", f"{self.num_common_tokens} tokens"),
        ]
        if self.first_diff_token is not None:
            block, offset = divmod(self.first_diff_token, self.block_size)
            rows.append(("first difference", f"token {self.first_diff_token} (block {block}, offset {offset})"))
        rows.append(
            (
                "reusable",
                f"<b>{self.num_reusable_blocks} blocks = {self.num_reusable_tokens} tokens</b> ({self.hit_rate:.0%})",
            )
        )
        table = "".join(f'<tr><td style="padding:1px 8px 1px 0;color:#555">{k}</td><td>{v}</td></tr>' for k, v in rows)
        context = ""
        if self.context_new is not None and self.first_diff_token is not None:

            def shown(text: str) -> str:  # newlines as \n, HTML escaped
                return html.escape(repr(text)[1:-1])

            mark = '<mark style="background:#F0C9B5">'
            before = shown(self.context_before)
            context = (
                '<div style="font-family:monospace;font-size:12px;margin-top:4px">'
                f"cached: …{before}{mark}{shown(self.context_cached)}</mark><br>"
                f"new:&nbsp;&nbsp;&nbsp; …{before}{mark}{shown(self.context_new)}</mark>"
                "</div>"
            )
        return (
            '<div style="font-family:sans-serif;font-size:13px;border:1px solid #ccc;padding:6px;max-width:760px">'
            f"<b>Why the miss?</b> (block_size={self.block_size})<table>{table}</table>"
            f'<div style="margin-top:4px">blocks of the new prompt: {cells}</div>'
            f'<div style="margin-top:2px;font-size:12px;color:#555">{legend}</div>{context}'
            f'<div style="margin-top:4px">{html.escape(self.reason)}</div></div>'
        )


def _to_token_ids(prompt: PromptLike, tokenizer: Any) -> list[int]:
    """Token ids of a prompt: ids as they are, a string encoded, a conversation rendered."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass tokenizer=llm.get_tokenizer()")
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        if tokenizer is None:
            raise ValueError("a conversation needs a tokenizer (its chat template renders it)")
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return [int(t) for t in prompt]


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items ``a`` and ``b`` share: the index of the first difference,
    or the shorter length when one is a prefix of the other. On token ids it is where
    two prompts diverge; on block-hash lists, how many blocks they share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def explain_miss(
    cached: PromptLike,
    new: PromptLike,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tokenizer: Any = None,
    cached_salt: str | None = None,
    new_salt: str | None = None,
    window: int = 8,
) -> MissReport:
    """Explain how much of ``new`` reuses the blocks of ``cached`` (assumed to be in the cache).

    Args:
        cached, new: token ids, strings (encoded with ``tokenizer``) or chat
            conversations (rendered with ``tokenizer``'s chat template).
        block_size: the KV cache's block size.
        tokenizer: decodes the text around the divergence (and encodes text prompts).
        cached_salt, new_salt: the prompts' cache salts, as the engine hashes them.
        window: tokens of context shown on each side of the divergence.
    """
    check_block_size(block_size)
    a = _to_token_ids(cached, tokenizer)
    b = _to_token_ids(new, tokenizer)
    if not b:
        raise ValueError("the new prompt is empty")
    common = common_prefix_length(a, b)
    first_diff = common if common < min(len(a), len(b)) else None

    hashes_a = hash_request_tokens(a, block_size, cache_salt=cached_salt)
    hashes_b = hash_request_tokens(b, block_size, cache_salt=new_salt)
    matching = common_prefix_length(hashes_a, hashes_b)  # the chain: equal up to the first broken block
    first_broken = matching if matching < len(hashes_b) else None
    reusable = min(matching, max_cache_hit_blocks(len(b), block_size))

    before = cached_ctx = new_ctx = None
    if tokenizer is not None and first_diff is not None:
        start = max(0, first_diff - window)
        before = tokenizer.decode(b[start:first_diff])
        cached_ctx = tokenizer.decode(a[first_diff : first_diff + window])
        new_ctx = tokenizer.decode(b[first_diff : first_diff + window])
    return MissReport(
        block_size=block_size,
        num_tokens_cached=len(a),
        num_tokens_new=len(b),
        num_common_tokens=common,
        first_diff_token=first_diff,
        first_broken_block=first_broken,
        num_matching_blocks=matching,
        num_reusable_blocks=reusable,
        salts_differ=cached_salt != new_salt,
        context_before=before,
        context_cached=cached_ctx,
        context_new=new_ctx,
        cached_token_ids=a,
        new_token_ids=b,
    )


# -- a stream of prompts -------------------------------------------------------------
@dataclass(repr=False)
class PrefixCacheSimulation:
    """Prompts replayed in order against an unbounded prefix cache.

    ``num_hit_tokens[i]`` is what the engine reports as ``num_cached_tokens``
    for prompt ``i`` when nothing is evicted and each prompt runs after the
    previous one finished. ``best_match[i]`` is the earlier prompt that shares
    the most blocks with prompt ``i`` (None for a cold miss). Counters follow
    the engine's: ``queries`` = prompt tokens looked up, ``hits`` = tokens found.

    The simulation caches prompt blocks only; the real engine also caches the
    blocks its outputs fill, so it can hit a little more.
    """

    block_size: int
    token_ids: list[list[int]]
    cache_salts: list[str | None]
    num_hit_tokens: list[int]
    best_match: list[int | None]

    @property
    def queries(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def hits(self) -> int:
        return sum(self.num_hit_tokens)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def explain(self, index: int, tokenizer: Any = None) -> MissReport:
        """Why prompt ``index`` hit what it hit, against its best earlier match."""
        match = self.best_match[index]
        if match is None:
            match = index - 1 if index > 0 else index
        return explain_miss(
            self.token_ids[match],
            self.token_ids[index],
            block_size=self.block_size,
            tokenizer=tokenizer,
            cached_salt=self.cache_salts[match],
            new_salt=self.cache_salts[index],
        )

    def to_text(self) -> str:
        lines = [f"{'prompt':>6} {'tokens':>7} {'hit':>6} {'rate':>6}  best earlier match"]
        for i, (tokens, hit, match) in enumerate(zip(self.token_ids, self.num_hit_tokens, self.best_match)):
            rate = hit / len(tokens) if tokens else 0.0
            lines.append(f"{i:>6} {len(tokens):>7} {hit:>6} {rate:>6.0%}  {'-' if match is None else match}")
        lines.append(f"hit rate {self.hit_rate:.1%} ({self.hits} of {self.queries} prompt tokens)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.to_text()


def simulate_prefix_cache(
    prompts: Sequence[PromptLike],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tokenizer: Any = None,
    cache_salts: Sequence[str | None] | None = None,
) -> PrefixCacheSimulation:
    """Replay ``prompts`` in order against an unbounded prefix cache; see ``PrefixCacheSimulation``."""
    token_lists = [_to_token_ids(p, tokenizer) for p in prompts]
    salts = list(cache_salts) if cache_salts is not None else [None] * len(token_lists)
    if len(salts) != len(token_lists):
        raise ValueError(f"got {len(salts)} cache salts for {len(token_lists)} prompts")
    owner: dict[BlockHash, int] = {}  # block hash -> the first prompt that cached it
    hits: list[int] = []
    best: list[int | None] = []
    for index, (tokens, salt) in enumerate(zip(token_lists, salts)):
        if not tokens:
            raise ValueError(f"prompt {index} is empty")
        hashes = hash_request_tokens(tokens, block_size, cache_salt=salt)
        owners = longest_cache_hit(hashes, owner.get)  # the prompts that cached each hit block
        hits.append(min(len(owners), max_cache_hit_blocks(len(tokens), block_size)) * block_size)
        best.append(owners[-1] if owners else None)
        for block_hash in hashes:
            owner.setdefault(block_hash, index)
    return PrefixCacheSimulation(block_size, token_lists, salts, hits, best)


__all__ = ["MissReport", "explain_miss", "PrefixCacheSimulation", "simulate_prefix_cache"]
