"""The block tables' view: per request, logical block -> physical block, hits, shared blocks, the tail.

Like every view (``views.py`` says how they render), it reads a ``CacheSnapshot``
(``state.py``); with several KV-cache groups (a hybrid model) each request gets one
labelled row per group, with one group its table alone.

    >>> BlockTableView(manager, requests={"A": a, "B": b})
"""

from __future__ import annotations

from typing import Any

from .html import (
    BLUE,
    GREEN,
    INK,
    MONO,
    MUTED,
    NULL_SYMBOL,
    NULL_TOOLTIP,
    badge,
    cell_style,
    container,
    esc,
    group_strip,
    heading,
    legend,
    null_cell_style,
    style,
    tooltip_tokens,
)
from .state import NULL_BLOCK_ID, CacheSnapshot, RequestInfo
from .views import View, group_badge


def shared_with(request: RequestInfo, snap: CacheSnapshot) -> list[tuple[str, list[int]]]:
    """The other requests whose tables (of any group) hold some of ``request``'s blocks, with those blocks."""
    shares: dict[str, list[int]] = {}
    for table in request.block_ids:
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

    With several KV-cache groups (a hybrid model), one row per group for each
    request, labelled with the group (``CacheSnapshot.labelled_groups``); a
    sliding-window row shows the null block (∅) where its blocks left the
    window, and marks the hits that group took.
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
        block_id = request.block_ids[group][index]
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
        tagged = bool(snap.group_tag(group))  # several groups: say which one
        where = f"{request.request_id}, " + (f"{snap.kv_cache_groups[group].description} group, " if tagged else "")
        label = f"{where}logical block {index} → physical block {block.block_id} (ref_cnt {block.ref_cnt})"
        text = self.source.decode(tokens) if tokens else None
        title = esc(tooltip_tokens(label, tokens, text))
        box = cell_style(block.state, shared=block.is_shared, width="78px") + (group_strip(group) if tagged else "")
        group_attribute = f' data-group="{group}"' if tagged else ""
        return (
            f'<div class="mv-entry" data-request="{esc(request.request_id)}" data-logical="{index}" '
            f'data-block="{block.block_id}"{group_attribute} title="{title}" style="{box}">'
            f'<div style="{style(color=MUTED, font_size="10px")}">L{index} →</div>'
            f'<div style="{style(font_weight="700", font_size="14px")}">{block.block_id} '
            f'<span style="{style(font_family=MONO, font_size="10px", font_weight="700")}">{block.state}</span></div>'
            f'<div style="{style(white_space="nowrap")}">{" ".join(marks) or "&nbsp;"}</div>{bar}{knorm}</div>'
        )

    def _tables_html(self, request: RequestInfo, snap: CacheSnapshot) -> str:
        """The request's tables: one labelled row per group, or the one group's entries alone."""
        rows = []
        for group, table in zip(snap.kv_cache_groups, request.block_ids):
            cells = "".join(self.render_entry(request, i, snap, group.group_id) for i in range(len(table)))
            if not snap.group_tag(group.group_id):  # nothing to tell apart
                rows.append(cells)
                continue
            num_nulls = sum(1 for block_id in table if block_id == NULL_BLOCK_ID)
            note = f"{num_nulls} × {NULL_SYMBOL}: before the window" if group.is_sliding_window else group.layers_text
            label = (
                f'<div class="mv-group-label" style="{style(display="inline-block", vertical_align="top", width="86px", line_height="1.35", padding_top="6px")}">'
                f"{group_badge(snap, group.group_id)}"
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
            entries = self._tables_html(request, snap) if any(request.block_ids) else ""
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
        if snap.labelled_groups:
            note += f" and KV-cache group ({snap.num_groups} groups: {', '.join(snap.groups)})"
        body = heading("Block tables", note)
        if self.show_legend:
            body += legend(
                include_tables=True,
                block_size=snap.block_size,
                k_norm_layer=self.layer if self.k_norm else None,
                groups=snap.labelled_groups,
            )
        body += "".join(rows) if rows else f'<div style="{style(color=MUTED)}">no requests</div>'
        return container(body, self.css_class)

    def _text_rows(self, request: RequestInfo, snap: CacheSnapshot, group: int) -> dict[str, list[str]]:
        """One group's table as text rows: physical, ref_cnt, mark (the null block: ∅, -, -)."""
        rows: dict[str, list[str]] = {"physical": [], "ref_cnt": [], "mark": []}
        for i, block_id in enumerate(request.block_ids[group]):
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
        per_group = ", one row per KV-cache group" if snap.labelled_groups else ""
        lines = [f"Block tables (logical -> physical{per_group}):"]
        lines += [f"  {group.tag}: group {group.group_id}, {group.description}" for group in snap.labelled_groups]
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
            if not any(request.block_ids):
                lines.append("  (no blocks)")
                continue
            # The logical row, then physical / ref_cnt / mark per group, the first labelled with the group's tag
            # where groups are told apart.
            length = max(len(table) for table in request.block_ids)
            labelled: list[tuple[str, list[str]]] = [("logical", [str(i) for i in range(length)])]
            tag_width = max((len(group.tag) for group in snap.labelled_groups), default=0)
            for group in snap.kv_cache_groups:
                tag = snap.group_tag(group.group_id)
                for k, (name, row) in enumerate(self._text_rows(request, snap, group.group_id).items()):
                    labelled.append((f"{tag if k == 0 else '':<{tag_width}} {name}" if tag_width else name, row))
            width = max(len(cell) for _, row in labelled for cell in row) + 1
            label_width = max(len(label) for label, _ in labelled)
            for label, row in labelled:
                lines.append(f"  {label:<{label_width}} " + "".join(cell.rjust(width) for cell in row))
        return "\n".join(lines)
