"""The views of the KV cache: the pool and the free queue (block tables: ``block_table_view.py``; hash chain: ``hash_chain.py``).

Each view reads a ``CacheSnapshot`` (see ``state.py``) and renders it twice:
as self-contained HTML (inline styles, no JavaScript) and as plain text that
is deterministic and free of addresses and timings (strict nbval compares it).
In a notebook a view displays its current state; ``live=True`` (with an
engine) turns it into an ``ipywidgets.HTML`` that follows the engine, and
``close()`` detaches it.

A hybrid model's engine (several KV-cache groups, chapter 08b) adds to each
view what the groups change: every request's table in each group, one row per
group, with the null block drawn as ∅; each block's group (a colour strip and
a tag such as ``full`` or ``SW64``). A single-group engine renders exactly as
without groups.

    >>> PoolView(llm)                       # the pool right now
    >>> BlockTableView(manager, requests={"A": a, "B": b})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .html import (
    BLUE,
    INK,
    MONO,
    MUTED,
    VERMILLION,
    badge,
    cell_style,
    container,
    esc,
    group_color,
    group_strip,
    heading,
    legend,
    mono,
    style,
    tooltip_tokens,
)
from .state import (
    CACHED,
    FREE,
    USED,
    USED_CACHED,
    BlockInfo,
    CacheSnapshot,
    StateSource,
    short_hash,
)

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def mimebundle(text: str, html: str, widget: Any = None) -> dict:
    """What a notebook displays: text, HTML and, for a live ``widget``, its view (Jupyter shows the richest)."""
    bundle = {"text/plain": text, "text/html": html}
    if widget is not None:
        bundle[WIDGET_VIEW] = widget._repr_mimebundle_()[WIDGET_VIEW]
    return bundle


class StaticSnapshot:
    """A frozen rendering (HTML and text) of a view or a dashboard: what a notebook keeps without a kernel.

    ``EngineDashboard.static()`` returns one: put it at the end of a cell to
    commit the dashboard's final state as plain HTML (no widget state needed).
    """

    def __init__(self, html: str, text: str) -> None:
        self.html = html
        self.text = text

    def to_html(self) -> str:
        return self.html

    def to_text(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        return mimebundle(self.text, self.html)


class View:
    """Base class: a state source, HTML and text renderings, an optional live widget.

    Subclasses implement ``render_html(snapshot)`` and ``render_text(snapshot)``.
    """

    css_class = "mv-view"

    def __init__(
        self,
        source: Any,
        *,
        requests: Any = None,
        tokenizer: Any = None,
        k_norm: bool = False,
        layer: int = 0,
        live: bool = False,
        min_interval: float = 0.2,
    ) -> None:
        if isinstance(source, StateSource):
            self.source = source
            self.source.add_requests(requests)
        else:
            self.source = StateSource(source, requests=requests, tokenizer=tokenizer)
        self.k_norm = k_norm
        self.layer = layer
        self._live = None
        if live:
            if self.source.engine is None:
                raise ValueError("live=True needs an LLM or LLMEngine (a bare KVCacheManager sends no events)")
            from .live import LiveBinding

            self._live = LiveBinding(self.source.engine, self.to_html, min_interval, on_event=self.source.observe)

    # -- renderings -------------------------------------------------------------
    def snapshot(self) -> CacheSnapshot:
        return self.source.snapshot(k_norm=self.k_norm, layer=self.layer)

    def render_html(self, snap: CacheSnapshot) -> str:
        raise NotImplementedError

    def render_text(self, snap: CacheSnapshot) -> str:
        raise NotImplementedError

    def to_html(self) -> str:
        """A static, self-contained HTML snapshot of the current state."""
        return self.render_html(self.snapshot())

    def to_text(self) -> str:
        """The current state as deterministic plain text."""
        return self.render_text(self.snapshot())

    def __repr__(self) -> str:
        return self.to_text()

    def static(self) -> StaticSnapshot:
        """The current state, frozen (no live widget)."""
        snap = self.snapshot()
        return StaticSnapshot(self.render_html(snap), self.render_text(snap))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        snap = self.snapshot()
        live = self._live is not None and self._live.attached
        if live:
            self._live.refresh()
        return mimebundle(self.render_text(snap), self.render_html(snap), self._live.widget if live else None)

    # -- live -------------------------------------------------------------------
    @property
    def widget(self):
        """The live ``ipywidgets.HTML`` (only with ``live=True``)."""
        return self._live.widget if self._live is not None else None

    def refresh(self) -> None:
        if self._live is not None:
            self._live.refresh()

    def close(self) -> None:
        """Stop following the engine; the widget stays on the page with its last state (a no-op for a static view)."""
        if self._live is not None:
            self._live.detach()


def _owners_label(owners: Sequence[str], limit: int = 2) -> str:
    if not owners:
        return ""
    shown = ", ".join(owners[:limit])
    return shown + (f" +{len(owners) - limit}" if len(owners) > limit else "")


def group_tag(snap: CacheSnapshot, block: BlockInfo) -> str:
    """The block's group tag (``full``, ``SW64``) where groups are told apart; "" for one group or a free, empty block."""
    return snap.group_tag(block.group)


def group_strip_of(snap: CacheSnapshot, block: BlockInfo) -> str:
    """The colour strip of the block's group where groups are told apart ("" where ``group_tag`` is "")."""
    return group_strip(block.group) if group_tag(snap, block) else ""


def group_badge(snap: CacheSnapshot, group: int) -> str:
    return badge(snap.kv_cache_groups[group].tag, group_color(group), "mv-group", solid=False)


def _block_tooltip(source: StateSource, block: BlockInfo, snap: CacheSnapshot) -> str:
    lines = [f"block {block.block_id}: ref_cnt {block.ref_cnt}"]
    if group_tag(snap, block):
        group = snap.kv_cache_groups[block.group]
        lines.append(f"KV-cache group {block.group}: {group.description}")
    if block.block_hash is not None:
        lines.append(f"hash {block.block_hash.hex()[:16]}…")
    if block.owners:
        lines.append("held by " + ", ".join(block.owners))
    if block.free_position is not None:
        lines.append(f"free queue position {block.free_position + 1} of {len(snap.free_queue)}")
    label = "\n".join(lines)
    text = source.decode(block.token_ids) if block.token_ids is not None else None
    return tooltip_tokens(label, block.token_ids, text)


class PoolView(View):
    """Every physical block: state letter, ref_cnt, short hash, owners, free-queue place.

    Pools larger than ``max_cells`` show their in-use and cached blocks and
    count the empty free ones.
    """

    css_class = "mv-pool"

    def __init__(self, source: Any, *, max_cells: int = 160, show_legend: bool = True, **kwargs: Any) -> None:
        super().__init__(source, **kwargs)
        self.max_cells = max_cells
        self.show_legend = show_legend

    def _shown_blocks(self, snap: CacheSnapshot) -> tuple[list[BlockInfo], int]:
        blocks = list(snap.blocks)
        if len(blocks) <= self.max_cells:
            return blocks, 0
        keep = [b for b in blocks if b.state != FREE or b.block_id == snap.next_to_reuse]
        return keep[: self.max_cells], len(blocks) - len(keep[: self.max_cells])

    @staticmethod
    def _counts(snap: CacheSnapshot) -> str:
        states = [b.state for b in snap.blocks]
        used = states.count(USED) + states.count(USED_CACHED)
        counts = (
            f"{snap.num_blocks} blocks × {snap.block_size} tokens: {used} in use "
            f"({sum(1 for b in snap.blocks if b.is_shared)} shared), "
            f"{states.count(CACHED)} cached and free, {states.count(FREE)} free and empty"
        )
        by_group = ", ".join(f"{group.tag} {snap.blocks_in_group(group.group_id)}" for group in snap.labelled_groups)
        return counts + (f"; by group: {by_group}" if by_group else "")

    def render_cell(self, block: BlockInfo, snap: CacheSnapshot) -> str:
        next_evict = block.block_id == snap.next_to_evict
        ref_color = BLUE if block.ref_cnt > 1 else (INK if block.ref_cnt else MUTED)
        ref = f'<span style="{style(color=ref_color, font_weight="700" if block.ref_cnt > 1 else "400")}">ref {block.ref_cnt}</span>'
        if block.k_norm and block.state != FREE:  # a free, empty block's slots hold nothing anyone reads
            ref += f'<span class="mv-knorm" style="{style(color=MUTED, font_size="10px")}">‖K‖{block.k_norm:.4g}</span>'
        ref_line = (
            f'<div style="{style(display="flex", justify_content="space-between", white_space="nowrap")}">{ref}</div>'
        )
        tag = group_badge(snap, block.group) if group_tag(snap, block) else ""
        head = (
            f'<div style="{style(display="flex", justify_content="space-between")}">'
            f'<span style="{style(font_weight="700", font_size="13px")}">{block.block_id}</span>{tag}'
            f'<span class="mv-state" style="{style(font_weight="700", font_family=MONO)}">{block.state}</span></div>'
        )
        hash_line = mono("#" + short_hash(block.block_hash)) if block.block_hash is not None else mono("—", MUTED)
        owners = _owners_label(block.owners)
        owner_line = (
            f'<div style="{style(white_space="nowrap", overflow="hidden", text_overflow="ellipsis")}">{esc(owners)}</div>'
            if owners
            else f'<div style="{style(color=MUTED)}">&nbsp;</div>'
        )
        foot = []
        if block.free_position is not None:
            foot.append(f"q{block.free_position + 1}")
        if next_evict:
            foot.append(badge("evict", VERMILLION, "mv-evict-next"))
        foot_line = f'<div style="{style(white_space="nowrap")}">{" ".join(foot) or "&nbsp;"}</div>'
        title = esc(_block_tooltip(self.source, block, snap))
        box = cell_style(block.state, shared=block.is_shared, next_evict=next_evict, width="100px")
        box += group_strip_of(snap, block)
        group = f' data-group="{block.group}"' if group_tag(snap, block) else ""
        return (
            f'<div class="mv-block" data-block="{block.block_id}"{group} title="{title}" style="{box}">'
            f"{head}{ref_line}<div>{hash_line}</div>{owner_line}{foot_line}</div>"
        )

    def render_html(self, snap: CacheSnapshot) -> str:
        shown, hidden = self._shown_blocks(snap)
        cells = "".join(self.render_cell(block, snap) for block in shown)
        hidden_note = (
            f'<div style="{style(color=MUTED, margin_top="4px")}">… and {hidden} more free, empty blocks (not shown)</div>'
            if hidden
            else ""
        )
        body = (
            heading("Block pool", self._counts(snap))
            + (
                legend(
                    block_size=snap.block_size,
                    k_norm_layer=self.layer if self.k_norm else None,
                    groups=snap.labelled_groups,
                )
                if self.show_legend
                else ""
            )
            + f'<div style="{style(line_height="0")}">{cells}</div>'
            + hidden_note
            + _next_line_html(snap)
        )
        return container(body, self.css_class)

    def render_text(self, snap: CacheSnapshot) -> str:
        shown, hidden = self._shown_blocks(snap)
        lines = [f"Block pool: {self._counts(snap)}", "block  state  ref  hash  owners        free queue"]
        width = max([len("group")] + [len(group.tag) for group in snap.kv_cache_groups])
        if snap.labelled_groups:  # a group column, between the hash and the owners
            lines[1] = f"block  state  ref  hash  {'group':<{width}}  owners        free queue"
        for block in shown:
            place = "-"
            if block.free_position is not None:
                place = f"q{block.free_position + 1}"
                if block.block_id == snap.next_to_evict:
                    place += " (evict next)"
            group = f"{group_tag(snap, block) or '-':<{width}}  " if snap.labelled_groups else ""
            lines.append(
                f"{block.block_id:>5}  {block.state:<5}  {block.ref_cnt:>3}  "
                f"{short_hash(block.block_hash) or '-':<4}  {group}{(', '.join(block.owners) or '-'):<12}  {place}"
            )
        if hidden:
            lines.append(f"... and {hidden} more free, empty blocks")
        lines.append(_next_line_text(snap))
        return "\n".join(lines)


def _next_line_text(snap: CacheSnapshot) -> str:
    reuse = snap.next_to_reuse
    evict = snap.next_to_evict
    reuse_text = f"block {reuse}" if reuse is not None else "none (no free block)"
    evict_text = f"block {evict}" if evict is not None else "none (no cached free block)"
    return f"next reused: {reuse_text}; next evicted: {evict_text}"


def _next_line_html(snap: CacheSnapshot) -> str:
    evict = snap.next_to_evict
    evict_html = (
        f"{badge('evict next', VERMILLION)} block <b>{evict}</b> (the first cached block from the head)"
        if evict is not None
        else "no cached block is free: nothing to evict"
    )
    reuse = snap.next_to_reuse
    reuse_html = f"block <b>{reuse}</b>" if reuse is not None else "none (the pool is full)"
    return f'<div class="mv-next" style="{style(margin_top="6px")}">next reused: {reuse_html} · {evict_html}</div>'


class FreeQueueView(View):
    """The free queue, head (reused first) to tail: empty and cached blocks, the next eviction."""

    css_class = "mv-freequeue"

    def __init__(self, source: Any, *, max_items: int = 48, **kwargs: Any) -> None:
        super().__init__(source, **kwargs)
        self.max_items = max_items

    def _shown(self, snap: CacheSnapshot) -> tuple[list[int], int, list[int]]:
        queue = list(snap.free_queue)
        if len(queue) <= self.max_items:
            return queue, 0, []
        tail_count = min(8, self.max_items // 4)
        head = queue[: self.max_items - tail_count]
        tail = queue[-tail_count:]
        return head, len(queue) - len(head) - len(tail), tail

    def render_item(self, block_id: int, snap: CacheSnapshot) -> str:
        block = snap.blocks[block_id]
        next_evict = block_id == snap.next_to_evict
        tag = group_tag(snap, block)
        width = "70px" if snap.labelled_groups else "58px"  # room for the group's tag
        box = cell_style(block.state, next_evict=next_evict, width=width) + ";min-height:44px;text-align:center"
        box += group_strip_of(snap, block)
        marks = ""
        if block_id == snap.next_to_reuse:
            marks = badge("next", INK, "mv-next-reuse")
        if next_evict:
            marks = (marks + " " if marks else "") + badge("evict", VERMILLION, "mv-evict-next")
        hash_text = "#" + short_hash(block.block_hash) if block.block_hash is not None else "empty"
        if tag:
            hash_text += f" {tag}"
        title = esc(_block_tooltip(self.source, block, snap))
        group = f' data-group="{block.group}"' if tag else ""
        return (
            f'<div class="mv-free" data-block="{block_id}"{group} title="{title}" style="{box}">'
            f'<div style="{style(font_weight="700", font_size="13px")}">{block_id} '
            f'<span style="{style(font_family=MONO, font_size="10px")}">{block.state}</span></div>'
            f'<div style="{style(font_family=MONO, font_size="10px", color=INK if block.block_hash else MUTED)}">'
            f"{hash_text}</div>"
            f'<div style="{style(white_space="nowrap")}">{marks or "&nbsp;"}</div></div>'
        )

    def render_html(self, snap: CacheSnapshot) -> str:
        head, skipped, tail = self._shown(snap)

        def label(text: str, **extra: str) -> str:  # a word between the cells, level with their middle
            return f'<span style="{style(display="inline-block", margin="16px 4px 0", vertical_align="top", **extra)}">{text}</span>'

        items = [self.render_item(block_id, snap) for block_id in head]
        if skipped:
            items.append(label(f"… {skipped} more …", color=MUTED))
        items += [self.render_item(block_id, snap) for block_id in tail]
        if items:
            chain = (
                label("head", font_weight="700")
                + label("→", color=MUTED).join(items)
                + label("tail", font_weight="700")
            )
        else:
            chain = f'<span style="{style(color=MUTED)}">empty: every block is in use</span>'
        note = (
            f"{len(snap.free_queue)} free blocks. get_new_blocks pops from the head; a freed cached block "
            "joins the tail, an empty one the head."
        )
        body = heading("Free block queue", "head → tail (LRU order)")
        if snap.labelled_groups:
            body += (
                f'<div style="{style(color=MUTED, margin_bottom="4px")}">One queue for every KV-cache group: '
                "a cached block is cached for one group (its tag); a block popped for reuse may go to any.</div>"
            )
        body += f'<div style="{style(line_height="0")}">{chain}</div>'
        body += f'<div style="{style(color=MUTED, margin_top="4px")}">{esc(note)}</div>' + _next_line_html(snap)
        return container(body, self.css_class)

    def render_text(self, snap: CacheSnapshot) -> str:
        head, skipped, tail = self._shown(snap)

        def item(block_id: int) -> str:
            block = snap.blocks[block_id]
            tag = group_tag(snap, block)  # a hybrid model's cached block: the group it is cached for
            return (
                f"{block_id}:{block.state}"
                + (f"#{short_hash(block.block_hash)}" if block.block_hash else "")
                + (f"/{tag}" if tag else "")
            )

        parts = [item(b) for b in head] + ([f"...{skipped} more..."] if skipped else []) + [item(b) for b in tail]
        lines = [
            f"Free block queue (head -> tail, {len(snap.free_queue)} blocks):",
            "  head -> " + " -> ".join(parts) + " -> tail" if parts else "  empty",
            _next_line_text(snap),
        ]
        return "\n".join(lines)
