"""HTML building blocks shared by the views: styles, cells, the legend, a sparkline.

Every style is inline (``style="..."``): the snapshot must look right where no
stylesheet or JavaScript runs (a notebook viewer, GitHub, an ``ipywidgets.HTML``).
Colour never carries meaning alone: each state also has a letter (F/U/C/UC),
cached blocks are hatched, shared blocks have a double border and the next
block to be evicted a thick border, so the views read in grayscale and for
colour-blind readers. The colours are from the Okabe-Ito palette.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from ..config import DEFAULT_BLOCK_SIZE
from .state import CACHED, FREE, USED, USED_CACHED, KVCacheGroupInfo

BLUE = "#0072B2"
ORANGE = "#E69F00"
GREEN = "#009E73"
VERMILLION = "#D55E00"
GRAY = "#8a8a8a"
INK = "#1b1b1b"
MUTED = "#5c5c5c"

# Single quotes only: these go inside style="..." attributes.
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', Arial, sans-serif"
MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"


def hatch(dark: str, light: str) -> str:
    """A diagonal-stripe background: the pattern that marks a cached block."""
    return f"repeating-linear-gradient(135deg, {dark} 0px, {dark} 3px, {light} 3px, {light} 7px)"


# Per block state: (background, border colour, border style, name in the legend).
STATE_STYLE: dict[str, tuple[str, str, str, str]] = {
    FREE: ("#ffffff", GRAY, "dashed", "free, empty"),
    USED: ("#d4e8f7", BLUE, "solid", "in use (ref_cnt ≥ 1)"),
    CACHED: (hatch("#f8dba3", "#fff5e1"), ORANGE, "solid", "cached, free: can still be hit, evictable"),
    USED_CACHED: (hatch("#b9d8f1", "#e6f2fb"), BLUE, "solid", "in use and cached (has a hash)"),
}


# KV-cache groups (hybrid models only): a colour strip at the top of a block and a tag
# ("full", "SW64") say which group a block belongs to; the null block is a hatched grey ∅.
GROUP_COLORS = ("#CC79A7", "#56B4E9", "#F0E442", "#000000", "#009E73", "#D55E00", "#0072B2", "#E69F00")
NULL_SYMBOL = "∅"
NULL_TOOLTIP = "null block: left the sliding window, freed"


def group_color(group: int) -> str:
    return GROUP_COLORS[group % len(GROUP_COLORS)]


def group_strip(group: int | None) -> str:
    """Extra style for a block of ``group``: a strip of the group's colour along its top edge ("" for None)."""
    return "" if group is None else f";box-shadow:inset 0 4px 0 {group_color(group)}"


def null_cell_style(width: str = "78px") -> str:
    """The box of a null-block entry: hatched light grey, dotted border (no block state: it is not a block)."""
    return style(
        display="inline-block",
        vertical_align="top",
        box_sizing="border-box",
        width=width,
        min_height="62px",
        margin="2px",
        padding="3px 5px",
        border=f"1px dotted {GRAY}",
        border_radius="4px",
        background=hatch("#e4e4e4", "#f7f7f7"),
        color=MUTED,
        font_size="11px",
        line_height="14px",
        overflow="hidden",
    )


def esc(value: object) -> str:
    """HTML-escape text (quotes too: it also goes into attributes)."""
    return html.escape(str(value), quote=True)


def style(**properties: object) -> str:
    """``style(font_size="12px")`` -> ``font-size:12px`` (underscores become dashes)."""
    return ";".join(f"{name.replace('_', '-')}:{value}" for name, value in properties.items())


def container(body: str, css_class: str, title: str | None = None) -> str:
    """The outer box of a view: white background (readable in dark themes too), one font."""
    head = (
        f'<div style="{style(font_weight="600", font_size="13px", margin="0 0 6px 0")}">{esc(title)}</div>'
        if title
        else ""
    )
    box = style(
        font_family=FONT,
        font_size="12px",
        line_height="1.35",
        color=INK,
        background="#ffffff",
        padding="8px 10px",
        border="1px solid #d0d0d0",
        border_radius="6px",
        margin="4px 0",
        max_width="100%",
        overflow_x="auto",
    )
    return f'<div class="{css_class}" style="{box}">{head}{body}</div>'


def heading(text: str, note: str = "") -> str:
    note_html = f' <span style="{style(font_weight="400", color=MUTED)}">{esc(note)}</span>' if note else ""
    return (
        f'<div style="{style(font_weight="600", font_size="13px", margin="8px 0 4px 0")}">{esc(text)}{note_html}</div>'
    )


def badge(text: str, color: str, css_class: str = "", solid: bool = True) -> str:
    """A small rounded label (white text on ``color``, or ``color`` text on white)."""
    colors = style(background=color, color="#ffffff") if solid else style(background="#ffffff", color=color)
    css = style(
        display="inline-block",
        padding="0 4px",
        border_radius="3px",
        border=f"1px solid {color}",
        font_size="10px",
        font_weight="700",
        line_height="14px",
        white_space="nowrap",
    )
    cls = f' class="{css_class}"' if css_class else ""
    return f'<span{cls} style="{css};{colors}">{esc(text)}</span>'


def cell_style(state: str, shared: bool = False, next_evict: bool = False, width: str = "86px") -> str:
    """The box of one block: fill and border by state; double border if shared; thick if next to evict."""
    background, border_color, border_style, _ = STATE_STYLE[state]
    border = f"1px {border_style} {border_color}"
    padding = "3px 5px"
    if shared:
        border = f"4px double {BLUE}"
        padding = "0px 2px"
    if next_evict:
        border = f"4px solid {VERMILLION}"
        padding = "0px 2px"
    return style(
        display="inline-block",
        vertical_align="top",
        box_sizing="border-box",
        width=width,
        min_height="62px",
        margin="2px",
        padding=padding,
        border=border,
        border_radius="4px",
        background=background,
        font_size="11px",
        line_height="14px",
        overflow="hidden",
    )


def mono(text: str, color: str = INK, weight: str = "400") -> str:
    return f'<span style="{style(font_family=MONO, color=color, font_weight=weight)}">{esc(text)}</span>'


def swatch(state: str, label: str, shared: bool = False, next_evict: bool = False) -> str:
    box = cell_style(state, shared=shared, next_evict=next_evict, width="26px")
    box += ";min-height:18px;height:18px;text-align:center;font-weight:700;margin:0 4px 0 0;vertical-align:middle"
    letter = state if not (shared or next_evict) else ("U" if shared else "C")
    item = style(display="inline-block", margin="0 12px 2px 0", white_space="nowrap")
    return f'<span style="{item}"><span style="{box}">{esc(letter)}</span>{esc(label)}</span>'


def group_swatch(group: KVCacheGroupInfo) -> str:
    """A legend item for one KV-cache group: its colour strip and tag, then what it is."""
    box = cell_style(USED, width="40px") + group_strip(group.group_id)
    box += ";min-height:18px;height:18px;text-align:center;font-weight:700;margin:0 4px 0 0;vertical-align:middle"
    box += ";padding:3px 2px 0 2px;font-size:10px"
    item = style(display="inline-block", margin="0 12px 2px 0", white_space="nowrap")
    layers = f" ({group.layers_text})" if group.layers_text else ""
    label = f"group {group.group_id}: {group.description}{layers}"
    return f'<span class="mv-group-key" style="{item}"><span style="{box}">{esc(group.tag)}</span>{esc(label)}</span>'


def null_swatch() -> str:
    box = null_cell_style(width="26px")
    box += ";min-height:18px;height:18px;text-align:center;font-weight:700;margin:0 4px 0 0;vertical-align:middle"
    box += ";padding:1px 2px"
    item = style(display="inline-block", margin="0 12px 2px 0", white_space="nowrap")
    return (
        f'<span style="{item}"><span style="{box}">{NULL_SYMBOL}</span>{esc(f"{NULL_SYMBOL} = {NULL_TOOLTIP}")}</span>'
    )


def legend(
    include_tables: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    k_norm_layer: int | None = None,
    groups: Sequence[KVCacheGroupInfo] = (),
) -> str:
    """What the letters, patterns and borders mean (and the ‖K‖ figure, when the view shows it).

    ``groups``: the KV-cache groups the view tells apart
    (``CacheSnapshot.labelled_groups``: none for a single group); the legend
    shows each one's colour and tag and, where they are, the null block.
    """
    items = [swatch(state, f"{state} = {STATE_STYLE[state][3]}") for state in (FREE, USED, USED_CACHED, CACHED)]
    items.append(swatch(USED, "double border = shared (ref_cnt ≥ 2)", shared=True))
    items.append(swatch(CACHED, "thick border = evicted next", next_evict=True))
    extra = "qN: N-th in the free queue (q1 is reused first) · hash: first 4 hex digits"
    if include_tables:
        items.append(
            f'<span style="{style(display="inline-block", margin="0 12px 2px 0")}">'
            f"{badge('HIT', GREEN)} prefix-cache hit</span>"
        )
        extra += f" · n/{block_size}: filled slots of a partial block"
    items += [group_swatch(group) for group in groups]
    if groups and include_tables:
        items.append(null_swatch())
    # In a hybrid model the groups share the KV tensors: layer l uses the tensor of its index in its group.
    tensor = next((g.layer_ids.index(k_norm_layer) for g in groups if k_norm_layer in g.layer_ids), None)
    if k_norm_layer is not None and tensor is not None:
        shared_by = " and ".join(
            f"layer {group.layer_ids[tensor]} ({group.kind})" for group in groups if len(group.layer_ids) > tensor
        )
        extra += (
            f" · ‖K‖: L2 norm of the block's keys in layer {k_norm_layer}'s KV tensor, which {shared_by} share "
            "(a block holds one group's layers), read from the cache: same number, same K/V"
        )
    elif k_norm_layer is not None:
        extra += (
            f" · ‖K‖: L2 norm of the block's keys in layer {k_norm_layer}, read from the cache: same number, same K/V"
        )
    note = f'<div style="{style(color=MUTED, font_size="11px", margin_top="2px")}">{esc(extra)}</div>'
    return (
        f'<div class="mv-legend" style="{style(font_size="11px", margin="2px 0 6px 0")}">{"".join(items)}{note}</div>'
    )


def tooltip_tokens(block_label: str, token_ids: Sequence[int] | None, text: str | None) -> str:
    """The hover text of a block: its tokens as text (and ids)."""
    if token_ids is None:
        return block_label
    ids = " ".join(str(t) for t in token_ids)
    if text is None:
        return f"{block_label}\ntoken ids: {ids}"
    return f"{block_label}\n{text!r}\ntoken ids: {ids}"


def sparkline(
    series: Sequence[tuple[Sequence[float], str]],
    width: int = 200,
    height: int = 36,
    max_value: float = 1.0,
    label: str = "",
) -> str:
    """A tiny inline SVG plot of one or more lines ``(values, colour)``, values in [0, max_value].

    Coordinates are rounded to 0.1 px, so the same values give the same SVG text.
    """
    pad = 3
    inner_w, inner_h = width - 2 * pad, height - 2 * pad
    parts = [
        f'<rect x="0.5" y="0.5" width="{width - 1}" height="{height - 1}" fill="#ffffff" stroke="#cfcfcf" />',
        f'<line x1="{pad}" y1="{pad + inner_h / 2:.1f}" x2="{width - pad}" y2="{pad + inner_h / 2:.1f}" '
        f'stroke="#e6e6e6" stroke-dasharray="2,2" />',
    ]
    for values, color in series:
        if not values:
            continue
        n = len(values)
        points = []
        for index, value in enumerate(values):
            x = pad + (inner_w * index / (n - 1) if n > 1 else inner_w)
            y = pad + inner_h * (1 - max(0.0, min(max_value, value)) / max_value)
            points.append((x, y))
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        last_x, last_y = points[-1]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{path}" />')
        parts.append(f'<circle cx="{last_x:.1f}" cy="{last_y:.1f}" r="2.4" fill="{color}" />')
    title = f"<title>{esc(label)}</title>" if label else ""
    return (
        f'<svg class="mv-sparkline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'xmlns="http://www.w3.org/2000/svg" style="vertical-align:middle">{title}{"".join(parts)}</svg>'
    )
