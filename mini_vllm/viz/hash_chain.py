"""``HashChainView``: a prompt cut into blocks, each block's chained hash, hit or miss now (chapters 04, 05, 09).

Block ``i``'s hash covers every token up to the end of block ``i``, so the
first block that misses breaks the chain: later blocks cannot be hit even if
their hash happens to be cached ("unreachable"). With a ``reference`` prompt
the view also shows the first token where the two differ — the usual answer
to "why did my prompt miss the cache?".

    >>> HashChainView(llm, "Once upon a time", reference="Once upon a tree")

The chain's HIT/MISS is group 0's (the full-attention group, in a hybrid
model); each other group (chapter 08b: there are none in a single-group
model) gets a column saying where it has the block cached, and the reusable
hit is the prefix every group can serve (a sliding-window group needs only the
blocks under the window before the hit's end), as
``KVCacheManager.get_computed_blocks`` finds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..hashing import hash_request_tokens
from ..kv_cache_manager import find_sliding_window_cache_hit, longest_cache_hit, max_cache_hit_blocks
from ..single_type_kv_cache_manager import sliding_window_contiguous_blocks
from ..companions.profiler import common_prefix_length
from .html import GREEN, MONO, MUTED, VERMILLION, badge, container, esc, heading, style, tooltip_tokens
from .state import CacheSnapshot, KVCacheGroupInfo, short_hash
from .views import View

PromptLike = str | Sequence[int] | Any


class _SnapshotLookup:
    """What ``find_sliding_window_cache_hit`` reads of a pool, answered from a snapshot (block ids, no blocks)."""

    null_block = None

    def __init__(self, snap: CacheSnapshot) -> None:
        self.snap = snap

    def get_cached_block(self, block_hash: bytes, kv_cache_group_id: int = 0) -> int | None:
        return self.snap.cached_by_group[kv_cache_group_id].get(block_hash)


def hybrid_hit_blocks(snap: CacheSnapshot, block_hashes: Sequence[bytes], max_num_blocks: int) -> int:
    """How many blocks every KV-cache group can serve for ``block_hashes`` (the engine's hybrid lookup).

    Group 0 (full attention) bounds the hit; each later group cuts it to what
    it serves: a sliding-window group needs the ``cdiv(window - 1,
    block_size)`` blocks before the hit's end cached for it (or a run from
    block 0). A single-group snapshot: the longest cached prefix.
    """
    num_blocks = len(longest_cache_hit(block_hashes[:max_num_blocks], snap.cached.get))
    for group in snap.kv_cache_groups[1:]:
        if group.sliding_window is not None:
            contiguous = sliding_window_contiguous_blocks(group.sliding_window, snap.block_size)
            found = find_sliding_window_cache_hit(
                _SnapshotLookup(snap), block_hashes, num_blocks, contiguous, group.group_id
            )
        else:
            found = longest_cache_hit(block_hashes[:num_blocks], snap.cached_by_group[group.group_id].get)
        num_blocks = len(found)
    return num_blocks


class HashChainView(View):
    """One prompt cut into blocks with their chained hashes, each a hit or a miss in the cache now.

    Args:
        prompt: token ids, a ``Request``, a string (encoded with the tokenizer)
            or a prompt dict as ``LLM.generate`` takes.
        reference: an optional second prompt; the view shows the first token
            where the two differ — the block where their chains part.
        cache_salt: the extra key, as the engine would hash it; lora_name: the LoRA key vLLM would add
            (mini-vLLM serves no adapters; chapter 04 shows how the key separates them).
    """

    css_class = "mv-hashchain"

    def __init__(
        self,
        source: Any,
        prompt: PromptLike,
        *,
        reference: PromptLike | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        title: str = "Hash chain",
        **kwargs: Any,
    ) -> None:
        super().__init__(source, **kwargs)
        if cache_salt is None:  # a Request or a prompt dict carries its own salt
            cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else getattr(prompt, "cache_salt", None)
        self.token_ids = self._to_token_ids(prompt)
        self.reference_ids = self._to_token_ids(reference) if reference is not None else None
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.title = title

    def _to_token_ids(self, prompt: PromptLike) -> list[int]:
        if hasattr(prompt, "prompt_token_ids"):  # a Request
            return list(prompt.prompt_token_ids)
        if isinstance(prompt, dict):  # as for LLM.generate: {"prompt_token_ids": [...]} or {"prompt": "..."}
            return self._to_token_ids(prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"])
        if isinstance(prompt, str):
            if self.source.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (pass tokenizer=... or token ids)")
            return list(self.source.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def chain(self, snap: CacheSnapshot) -> list[dict]:
        """One row per full block: index, tokens, hash, parent, the cached block (or None)."""
        size = snap.block_size
        hashes = hash_request_tokens(self.token_ids, size, self.cache_salt, self.lora_name, snap.hash_algo)
        rows = []
        parent = None
        for index, block_hash in enumerate(hashes):
            rows.append(
                {
                    "index": index,
                    "tokens": self.token_ids[index * size : (index + 1) * size],
                    "hash": block_hash,
                    "parent": parent,
                    "cached_block": snap.cached.get(block_hash),
                    # per later group (none with one group), the block cached for it (None: not cached for it)
                    "cached_by_group": tuple(cached.get(block_hash) for cached in snap.cached_by_group[1:]),
                }
            )
            parent = block_hash
        return rows

    def first_difference(self) -> int | None:
        """The first token index where prompt and reference differ (None: identical or no reference)."""
        if self.reference_ids is None:
            return None
        common = common_prefix_length(self.token_ids, self.reference_ids)
        identical = common == len(self.token_ids) == len(self.reference_ids)
        return None if identical else common

    def summary(self, snap: CacheSnapshot) -> dict:
        rows = self.chain(snap)
        num_hits = len(longest_cache_hit([row["hash"] for row in rows], snap.cached.get))
        usable = min(num_hits, max_cache_hit_blocks(len(self.token_ids), snap.block_size))
        summary = {
            "rows": rows,
            "num_hits": num_hits,
            "first_miss": num_hits if num_hits < len(rows) else None,
            "usable": usable,
            "tail": len(self.token_ids) - len(rows) * snap.block_size,
            "diff": self.first_difference(),
        }
        # Every group must serve the hit: group 0's usable prefix, cut by the others (none with one group).
        summary["full_usable"] = usable
        summary["usable"] = hybrid_hit_blocks(snap, [row["hash"] for row in rows], usable)
        summary["groups"] = snap.kv_cache_groups[1:]
        return summary

    def _diff_text(self, position: int) -> str:
        def token_at(ids: Sequence[int]) -> str:
            if position >= len(ids):
                return "(end)"
            text = self.source.decode([ids[position]])
            return f"{ids[position]} {text!r}" if text is not None else str(ids[position])

        assert self.reference_ids is not None
        return (
            f"first different token: position {position} (block {position // self._block_size}): "
            f"{token_at(self.token_ids)} vs reference {token_at(self.reference_ids)}"
        )

    @property
    def _block_size(self) -> int:
        return self.source.block_size

    def _verdict(self, summary: dict) -> str:
        rows = summary["rows"]
        text = f"{summary['num_hits']} of {len(rows)} full blocks hit in a row"
        if summary["first_miss"] is not None:
            text += f"; the chain breaks at block {summary['first_miss']}"
        text += (
            f". A request with this prompt reuses {summary['usable']} block"
            f"{'s' if summary['usable'] != 1 else ''} ({summary['usable'] * self._block_size} tokens)"
        )
        full_usable = summary["full_usable"]
        if full_usable < summary["num_hits"]:
            text += " — capped: the last prompt token is always computed"
        if summary["usable"] < full_usable:
            groups: Sequence[KVCacheGroupInfo] = summary["groups"]
            windows = ", ".join(group.description for group in groups if group.is_sliding_window)
            text += (
                f" — not {full_usable}: every KV-cache group must serve the hit, and the {windows} group"
                " needs the blocks under the window before the hit's end cached for it"
            )
        return text + "."

    def _row_html(self, row: dict, size: int, cell: str, marker: str, status: str, extra: str = "") -> str:
        """One table row: block index, token range, its text (tokens on hover), parent → hash, status."""
        index = row["index"]
        text = self.source.decode(row["tokens"])
        shown = repr(text) if text is not None else " ".join(map(str, row["tokens"]))
        tooltip = esc(tooltip_tokens(f"block {index}", row["tokens"], text))
        parent = short_hash(row["parent"]) if row["parent"] is not None else "NONE_HASH"
        mono_cell = f"{cell};font-family:{MONO};white-space:nowrap"
        text_cell = f"{mono_cell};max-width:320px;overflow:hidden;text-overflow:ellipsis"
        return (
            f'<tr class="mv-chain-row" data-block-index="{index}">'
            f'<td style="{cell};font-weight:700">{index}</td>'
            f'<td style="{mono_cell}">{index * size}–{index * size + size - 1}{marker}</td>'
            f'<td style="{text_cell}" title="{tooltip}">{esc(shown)}</td>'
            f'<td style="{mono_cell}">{parent} → <b>{short_hash(row["hash"])}</b></td>'
            f'<td style="{cell}">{status}</td>{extra}</tr>'
        )

    def render_html(self, snap: CacheSnapshot) -> str:
        summary = self.summary(snap)
        diff = summary["diff"]
        size = snap.block_size
        cell = style(padding="3px 6px", border_bottom="1px solid #eeeeee", vertical_align="top", text_align="left")
        # The HIT/MISS column is group 0's; one column per other group, where groups are told apart.
        groups = snap.labelled_groups
        names = ["block", "tokens", "text", "parent → hash", "in the cache now"]
        names[-1] += "".join(f" ({group.description})" for group in groups[:1])
        names += [f"cached for {group.tag} (group {group.group_id})" for group in groups[1:]]
        header = "".join(f'<th style="{cell};font-weight:600;color:{MUTED}">{esc(name)}</th>' for name in names)
        body_rows = []
        for row in summary["rows"]:
            index = row["index"]
            if row["cached_block"] is not None and index < summary["num_hits"]:
                status = badge("HIT", GREEN, "mv-hit") + f" block {row['cached_block']}"
            elif row["cached_block"] is not None:
                status = badge("UNREACHABLE", MUTED, "mv-unreachable") + (
                    f" cached in block {row['cached_block']}, but an earlier block missed"
                )
            elif index == summary["first_miss"]:
                status = badge("MISS", VERMILLION, "mv-miss") + " chain breaks here"
            else:
                status = badge("MISS", VERMILLION, "mv-miss", solid=False)
            marker = ""
            if diff is not None and index == diff // size:
                marker = " " + badge(f"differs at token {diff}", VERMILLION, "mv-diff", solid=False)
            extra = "".join(
                f'<td class="mv-group-cached" style="{cell}">'
                + (f"block {block_id}" if block_id is not None else f'<span style="color:{MUTED}">—</span>')
                + "</td>"
                for block_id in row["cached_by_group"]
            )
            body_rows.append(self._row_html(row, size, cell, marker, status, extra))
        if summary["tail"]:
            start = len(summary["rows"]) * size
            body_rows.append(
                f'<tr class="mv-chain-tail"><td style="{cell};color:{MUTED}">{len(summary["rows"])}</td>'
                f'<td style="{cell};font-family:{MONO};color:{MUTED}">{start}–{start + summary["tail"] - 1}</td>'
                f'<td style="{cell};color:{MUTED}" colspan="{3 + snap.num_groups - 1}">partial block ({summary["tail"]}/{size} tokens): '
                "no hash yet, never cached</td></tr>"
            )
        table_style = style(border_collapse="collapse", font_size="12px")
        table = f'<table style="{table_style}"><tr>{header}</tr>{"".join(body_rows)}</table>'
        verdict = f'<div class="mv-verdict" style="{style(margin_top="6px")}">{esc(self._verdict(summary))}</div>'
        diff_html = ""
        if diff is not None:
            diff_style = style(margin_top="2px", color=VERMILLION)
            diff_html = f'<div class="mv-first-diff" style="{diff_style}">{esc(self._diff_text(diff))}</div>'
        note = f"{len(self.token_ids)} tokens, blocks of {size}"
        if self.cache_salt:
            note += f", cache_salt={self.cache_salt!r}"
        return container(heading(self.title, note) + table + verdict + diff_html, self.css_class)

    def render_text(self, snap: CacheSnapshot) -> str:
        summary = self.summary(snap)
        lines = [f"{self.title}: {len(self.token_ids)} tokens, blocks of {snap.block_size}"]
        for row in summary["rows"]:
            parent = short_hash(row["parent"]) if row["parent"] is not None else "NONE"
            if row["cached_block"] is not None and row["index"] < summary["num_hits"]:
                status = f"HIT block {row['cached_block']}"
            elif row["cached_block"] is not None:
                status = f"UNREACHABLE (cached in block {row['cached_block']})"
            else:
                status = "MISS" + (" <- chain breaks" if row["index"] == summary["first_miss"] else "")
            for group, block_id in zip(snap.kv_cache_groups[1:], row["cached_by_group"]):
                status += f"; {group.tag}: " + (f"block {block_id}" if block_id is not None else "-")
            lines.append(f"  block {row['index']}: {parent} -> {short_hash(row['hash'])}  {status}")
        if summary["tail"]:
            lines.append(f"  partial block: {summary['tail']} tokens, not hashed")
        lines.append(self._verdict(summary))
        if summary["diff"] is not None:
            lines.append(self._diff_text(summary["diff"]))
        return "\n".join(lines)
