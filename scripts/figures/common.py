"""Shared bits for the hand-written SVG figures (palette of mini_vllm/viz/html.py)."""

import base64, html

BLUE = "#0072B2"
ORANGE = "#E69F00"
GREEN = "#009E73"
VERMILLION = "#D55E00"
GRAY = "#8a8a8a"
INK = "#1b1b1b"
MUTED = "#5c5c5c"
LIGHT_BLUE = "#d4e8f7"
LIGHT_ORANGE = "#fff5e1"
LIGHT_GREEN = "#dcf1e9"
LIGHT_VERM = "#fbe4d5"
LIGHT_GRAY = "#f3f3f3"
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', Arial, sans-serif"
MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"

MIN_SIZE = 10.5


def esc(s):
    return html.escape(str(s), quote=True)


def t(x, y, s, size=12, anchor="start", fill=INK, weight=None, mono=False, italic=False, extra=""):
    size = max(size, MIN_SIZE)
    a = f'x="{x}" y="{y}" font-size="{size}"'
    if anchor != "start":
        a += f' text-anchor="{anchor}"'
    if fill != INK:
        a += f' fill="{fill}"'
    if weight:
        a += f' font-weight="{weight}"'
    if mono:
        a += f' font-family="{MONO}"'
    if italic:
        a += ' font-style="italic"'
    if extra:
        a += " " + extra
    return f"<text {a}>{html.escape(str(s), quote=False)}</text>"


def rect(x, y, w, h, fill="#ffffff", stroke=GRAY, rx=4, sw=1, extra=""):
    return f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}" fill="{fill}" stroke="{stroke}" stroke-width="{sw}"{(" " + extra) if extra else ""}/>'


def line(x1, y1, x2, y2, stroke=MUTED, sw=1.4, arrow=True, marker="a", extra=""):
    m = f' marker-end="url(#{marker})"' if arrow else ""
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{stroke}" stroke-width="{sw}"{m}{(" " + extra) if extra else ""}/>'


def path(d, stroke=MUTED, sw=1.4, arrow=True, marker="a", fill="none", extra=""):
    m = f' marker-end="url(#{marker})"' if arrow else ""
    return f'<path d="{d}" fill="{fill}" stroke="{stroke}" stroke-width="{sw}"{m}{(" " + extra) if extra else ""}/>'


def markers(**colours):
    """One arrow-head marker per name=colour."""
    out = []
    for name, c in colours.items():
        out.append(
            f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>'
        )
    return "<defs>" + "".join(out) + "</defs>"


def svg(width, height, title, body, desc=None):
    d = f"<desc>{esc(desc)}</desc>" if desc else ""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="{FONT}" font-size="12" fill="{INK}" role="img">'
        f'<title>{esc(title)}</title>{d}<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>'
        + "".join(body)
        + "</svg>"
    )


def img_tag(svg_text, alt, width):
    b64 = base64.b64encode(svg_text.encode("utf-8")).decode("ascii")
    return (
        f'<img src="data:image/svg+xml;base64,{b64}" alt="{esc(alt)}" width="{width}" '
        f'style="max-width:100%;height:auto">'
    )
