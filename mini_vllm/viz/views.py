"""The views of the KV cache: the pool, the block tables, the free queue (hash chain: ``hash_chain.py``).

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
    GREEN,
    INK,
    MONO,
    MUTED,
    NULL_SYMBOL,
    NULL_TOOLTIP,
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
    null_cell_style,
    style,
    tooltip_tokens,
)
from .state import (
    CACHED,
    FREE,
    NULL_BLOCK_ID,
    USED,
    USED_CACHED,
    BlockInfo,
    CacheSnapshot,
    RequestInfo,
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
    """The block's group tag (``full``, ``SW64``) in a hybrid snapshot; "" otherwise or for a free, empty block."""
    if not snap.is_hybrid or block.group is None:
        return ""
    return snap.kv_cache_groups[block.group].tag


def _group_badge(snap: CacheSnapshot, group: int) -> str:
    return badge(snap.kv_cache_groups[group].tag, group_color(group), "mv-group", solid=False)


def _block_tooltip(source: StateSource, block: BlockInfo, snap: CacheSnapshot) -> str:
    lines = [f"block {block.block_id}: ref_cnt {block.ref_cnt}"]
    if snap.is_hybrid and block.group is not None:
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
        if snap.is_hybrid:
            counts += "; by group: " + ", ".join(
                f"{group.tag} {snap.blocks_in_group(group.group_id)}" for group in snap.kv_cache_groups
            )
        return counts

    def render_cell(self, block: BlockInfo, snap: CacheSnapshot) -> str:
        next_evict = block.block_id == snap.next_to_evict
        ref_color = BLUE if block.ref_cnt > 1 else (INK if block.ref_cnt else MUTED)
        ref = f'<span style="{style(color=ref_color, font_weight="700" if block.ref_cnt > 1 else "400")}">ref {block.ref_cnt}</span>'
        if block.k_norm and block.state != FREE:  # a free, empty block's slots hold nothing anyone reads
            ref += f'<span class="mv-knorm" style="{style(color=MUTED, font_size="10px")}">‖K‖{block.k_norm:.4g}</span>'
        ref_line = (
            f'<div style="{style(display="flex", justify_content="space-between", white_space="nowrap")}">{ref}</div>'
        )
        tag = _group_badge(snap, block.group) if group_tag(snap, block) else ""
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
        group = ""
        if snap.is_hybrid:
            box += group_strip(block.group)
            group = f' data-group="{block.group}"' if block.group is not None else ""
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
                    groups=snap.kv_cache_groups,
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
        if snap.is_hybrid:  # a group column, between the hash and the owners
            lines[1] = f"block  state  ref  hash  {'group':<{width}}  owners        free queue"
        for block in shown:
            place = "-"
            if block.free_position is not None:
                place = f"q{block.free_position + 1}"
                if block.block_id == snap.next_to_evict:
                    place += " (evict next)"
            group = f"{group_tag(snap, block) or '-':<{width}}  " if snap.is_hybrid else ""
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


def shared_with(request: RequestInfo, snap: CacheSnapshot) -> list[tuple[str, list[int]]]:
    """The other requests whose tables (of any group) hold some of ``request``'s blocks, with those blocks."""
    shares: dict[str, list[int]] = {}
    for table in request.tables():
        for block_id in table:
            if block_id == NULL_BLOCK_ID:
                continue
            for owner in snap.blocks[block_id].owners:
                if owner != request.request_id:
                    shares.setdefault(owner, []).append(block_id)
    return list(shares.items())  # owners are sorted per block, blocks in table order (group by group)


def _shares_text(request: RequestInfo, snap: CacheSnapshot, limit: int = 2) -> str:
    shares = shared_with(request, snap)
    if not shares:
        return ""
    parts = [f"blocks {', '.join(map(str, blocks))} with {owner}" for owner, blocks in shares[:limit]]
    more = f" (+{len(shares) - limit} more)" if len(shares) > limit else ""
    return "shares " + "; ".join(parts) + more


class BlockTableView(View):
    """Per request: logical block → physical block, hits, shared blocks, the partial tail.

    In a hybrid model, one row per KV-cache group for each request, labelled
    with the group; a sliding-window row shows the null block (∅) where its
    blocks left the window, and marks the hits that group took.
    """

    css_class = "mv-tables"

    def __init__(self, source: Any, *, show_legend: bool = True, **kwargs: Any) -> None:
        super().__init__(source, **kwargs)
        self.show_legend = show_legend

    def render_null_entry(self, request: RequestInfo, index: int, snap: CacheSnapshot, group: int) -> str:
        """A null entry of ``group``'s table: the block at ``index`` left the sliding window (or was never taken)."""
        description = snap.kv_cache_groups[group].description
        title = esc(
            f"{request.request_id}, {description} group, logical block {index} → the null block\n"
            f"{NULL_TOOLTIP}: the window of the next token starts after it, so this group's layers never "
            "read it again; the block went back to the pool and stays cached for others until evicted"
        )
        return (
            f'<div class="mv-entry mv-null" data-request="{esc(request.request_id)}" data-logical="{index}" '
            f'data-block="{NULL_BLOCK_ID}" data-group="{group}" title="{title}" style="{null_cell_style()}">'
            f'<div style="{style(font_size="10px")}">L{index} →</div>'
            f'<div style="{style(font_weight="700", font_size="14px")}">{NULL_SYMBOL}</div>'
            f'<div style="{style(font_size="10px")}">null</div></div>'
        )

    def render_entry(self, request: RequestInfo, index: int, snap: CacheSnapshot, group: int = 0) -> str:
        block_id = request.tables()[group][index]
        if block_id == NULL_BLOCK_ID:
            return self.render_null_entry(request, index, snap, group)
        block = snap.blocks[block_id]
        filled = request.tokens_in_block(index, snap.block_size)
        hit = request.is_hit(index, group)
        marks = []
        if hit:
            marks.append(badge("HIT", GREEN, "mv-hit"))
        if block.is_shared:
            marks.append(badge(f"×{block.ref_cnt}", BLUE, "mv-shared", solid=False))
        if filled < snap.block_size:
            marks.append(f'<span class="mv-partial">{filled}/{snap.block_size}</span>')
        bar = ""
        if filled < snap.block_size:
            width = round(100 * filled / snap.block_size)
            bar = (
                f'<div style="{style(height="4px", background="#ffffff", border=f"1px solid {MUTED}", margin_top="2px")}">'
                f'<div style="{style(height="4px", width=f"{width}%", background=INK)}"></div></div>'
            )
        knorm = (
            f'<div class="mv-knorm" style="{style(color=MUTED)}">‖K‖{block.k_norm:.4g}</div>'
            if block.k_norm is not None
            else ""
        )
        start = index * snap.block_size
        tokens = request.token_ids[start : start + filled] if request.token_ids else None
        where = f"{request.request_id}, "
        if snap.is_hybrid:
            where += f"{snap.kv_cache_groups[group].description} group, "
        label = f"{where}logical block {index} → physical block {block.block_id} (ref_cnt {block.ref_cnt})"
        text = self.source.decode(tokens) if tokens else None
        title = esc(tooltip_tokens(label, tokens, text))
        box = cell_style(block.state, shared=block.is_shared, width="78px")
        group_attribute = ""
        if snap.is_hybrid:
            box += group_strip(group)
            group_attribute = f' data-group="{group}"'
        return (
            f'<div class="mv-entry" data-request="{esc(request.request_id)}" data-logical="{index}" '
            f'data-block="{block.block_id}"{group_attribute} title="{title}" style="{box}">'
            f'<div style="{style(color=MUTED, font_size="10px")}">L{index} →</div>'
            f'<div style="{style(font_weight="700", font_size="14px")}">{block.block_id} '
            f'<span style="{style(font_family=MONO, font_size="10px", font_weight="700")}">{block.state}</span></div>'
            f'<div style="{style(white_space="nowrap")}">{" ".join(marks) or "&nbsp;"}</div>{bar}{knorm}</div>'
        )

    def _group_rows_html(self, request: RequestInfo, snap: CacheSnapshot) -> str:
        """A hybrid request's tables: one labelled row per group."""
        rows = []
        for group, table in zip(snap.kv_cache_groups, request.tables()):
            cells = "".join(self.render_entry(request, i, snap, group.group_id) for i in range(len(table)))
            num_nulls = sum(1 for block_id in table if block_id == NULL_BLOCK_ID)
            note = f"{num_nulls} × {NULL_SYMBOL}: before the window" if group.is_sliding_window else group.layers_text
            label = (
                f'<div class="mv-group-label" style="{style(display="inline-block", vertical_align="top", width="86px", line_height="1.35", padding_top="6px")}">'
                f"{_group_badge(snap, group.group_id)}"
                f'<div style="{style(color=MUTED, font_size="10px")}">{esc(group.kind)}</div>'
                f'<div style="{style(color=MUTED, font_size="10px")}">{esc(note)}</div></div>'
            )
            rows.append(
                f'<div class="mv-group-row" data-request="{esc(request.request_id)}" data-group="{group.group_id}">'
                f"{label}"
                f'<div style="{style(display="inline-block", vertical_align="top", max_width="calc(100% - 90px)")}">'
                f"{cells}</div></div>"
            )
        return "".join(rows)

    def render_html(self, snap: CacheSnapshot) -> str:
        rows = []
        for request in snap.requests:
            if not any(request.tables()):
                entries = ""
            elif snap.is_hybrid:
                entries = self._group_rows_html(request, snap)
            else:
                entries = "".join(self.render_entry(request, i, snap) for i in range(len(request.block_ids)))
            if not entries:  # in the row's own line (the cells' box has line-height 0)
                entries = (
                    f'<span style="{style(color=MUTED, display="inline-block", line_height="1.35", padding_top="4px")}">'
                    f"no blocks yet ({esc(request.status)})</span>"
                )
            shares = _shares_text(request, snap)
            shares_html = f'<div class="mv-shares" style="{style(color=BLUE, font_weight="600")}">{esc(shares)}</div>'
            info = (
                f'<div style="{style(width="150px", display="inline-block", vertical_align="top", padding_top="4px")}">'
                f'<div style="{style(font_weight="700", font_family=MONO, font_size="13px")}">{esc(request.request_id)}</div>'
                f'<div style="{style(color=MUTED)}">{esc(request.status)}</div>'
                f'<div style="{style(color=MUTED)}">{request.num_tokens} tokens, {request.num_computed_tokens} computed</div>'
                f'<div style="{style(color=GREEN if request.num_hit_blocks else MUTED)}">'
                f"{request.num_hit_blocks} block{'s' if request.num_hit_blocks != 1 else ''} from the cache</div>"
                f"{shares_html if shares else ''}</div>"
            )
            rows.append(
                f'<div class="mv-table-row" data-request="{esc(request.request_id)}" '
                f'style="{style(padding="4px 0", border_top="1px solid #eeeeee")}">{info}'
                f'<div style="{style(display="inline-block", vertical_align="top", max_width="calc(100% - 160px)", line_height="0")}">'
                f"{entries}</div></div>"
            )
        note = "logical block → physical block, per request"
        if snap.is_hybrid:
            note += f" and KV-cache group ({snap.num_groups} groups: {', '.join(snap.groups)})"
        body = heading("Block tables", note)
        if self.show_legend:
            body += legend(
                include_tables=True,
                block_size=snap.block_size,
                k_norm_layer=self.layer if self.k_norm else None,
                groups=snap.kv_cache_groups,
            )
        body += "".join(rows) if rows else f'<div style="{style(color=MUTED)}">no requests</div>'
        return container(body, self.css_class)

    def _text_rows(self, request: RequestInfo, snap: CacheSnapshot, group: int) -> dict[str, list[str]]:
        """One group's table as text rows: physical, ref_cnt, mark (the null block: ∅, -, -)."""
        rows: dict[str, list[str]] = {"physical": [], "ref_cnt": [], "mark": []}
        for i, block_id in enumerate(request.tables()[group]):
            if block_id == NULL_BLOCK_ID:
                rows["physical"].append(NULL_SYMBOL)
                rows["ref_cnt"].append("-")
                rows["mark"].append("-")
                continue
            block = snap.blocks[block_id]
            filled = request.tokens_in_block(i, snap.block_size)
            marks = []
            if request.is_hit(i, group):
                marks.append("HIT")
            if filled < snap.block_size:
                marks.append(f"{filled}/{snap.block_size}")
            rows["physical"].append(str(block.block_id))
            rows["ref_cnt"].append(str(block.ref_cnt))
            rows["mark"].append(",".join(marks) or "-")
        return rows

    def render_text(self, snap: CacheSnapshot) -> str:
        lines = ["Block tables (logical -> physical):"]
        if snap.is_hybrid:
            lines[0] = "Block tables (logical -> physical, one row per KV-cache group):"
            lines += [f"  {group.tag}: group {group.group_id}, {group.description}" for group in snap.kv_cache_groups]
        if not snap.requests:
            lines.append("  no requests")
        for request in snap.requests:
            lines.append(
                f"{request.request_id} [{request.status}] {request.num_tokens} tokens, "
                f"{request.num_computed_tokens} computed, {request.num_hit_blocks} hit blocks"
            )
            shares = _shares_text(request, snap)
            if shares:
                lines.append(f"  {shares}")
            if not any(request.tables()):
                lines.append("  (no blocks)")
                continue
            if not snap.is_hybrid:
                rows = {"logical": [str(i) for i in range(len(request.block_ids))]}
                rows.update(self._text_rows(request, snap, 0))
                width = max(len(cell) for row in rows.values() for cell in row) + 1
                for name, row in rows.items():
                    lines.append(f"  {name:<8} " + "".join(cell.rjust(width) for cell in row))
                continue
            # Hybrid: the logical row, then physical / ref_cnt / mark per group, labelled with the group's tag.
            length = max(len(table) for table in request.tables())
            labelled: list[tuple[str, list[str]]] = [("logical", [str(i) for i in range(length)])]
            tag_width = max(len(group.tag) for group in snap.kv_cache_groups)
            for group in snap.kv_cache_groups:
                for k, (name, row) in enumerate(self._text_rows(request, snap, group.group_id).items()):
                    labelled.append((f"{group.tag if k == 0 else '':<{tag_width}} {name}", row))
            width = max(len(cell) for _, row in labelled for cell in row) + 1
            label_width = max(len(label) for label, _ in labelled)
            for label, row in labelled:
                lines.append(f"  {label:<{label_width}} " + "".join(cell.rjust(width) for cell in row))
        return "\n".join(lines)


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
        width = "70px" if snap.is_hybrid else "58px"  # room for the group's tag
        box = cell_style(block.state, next_evict=next_evict, width=width) + ";min-height:44px;text-align:center"
        if snap.is_hybrid:
            box += group_strip(block.group)
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
        if snap.is_hybrid:
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
