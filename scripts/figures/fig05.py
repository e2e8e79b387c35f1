from common import *

PURPLE = "#CC79A7"
LIGHT_PURPLE = "#f6e4ee"
W, H = 720, 426
b = [markers(a=MUTED, bl=BLUE, p=PURPLE, g=GREEN)]

# 1. schedule time
b.append(
    t(
        10,
        18,
        "1 · schedule (allocate_slots): blocks chosen, full blocks cached — no K/V computed yet",
        12.5,
        weight="600",
    )
)


def mini(x, y, ids, colours, notes=None):
    out = []
    for k, (i, c) in enumerate(zip(ids, colours)):
        fill = LIGHT_BLUE if c == BLUE else (LIGHT_PURPLE if c == PURPLE else LIGHT_GREEN)
        out.append(rect(x + k * 26, y, 22, 20, fill=fill, stroke=c, rx=3, sw=1.3))
        out.append(t(x + k * 26 + 11, y + 14.5, str(i), 11.5, anchor="middle", weight="700"))
    return "".join(out)


y = 32
b.append(t(10, y + 14.5, "A (55 tokens)", 12, weight="700", fill=BLUE))
b.append(mini(110, y, [0, 1, 2, 3], [BLUE] * 4))
b.append(t(222, y + 14.5, "new blocks 0–3; blocks 0–2 are full: cached at once (hash → block)", 11, fill=MUTED))
y = 58
b.append(t(10, y + 14.5, "B (53 tokens)", 12, weight="700", fill=PURPLE))
b.append(mini(110, y, [0, 1, 2, 4], [GREEN, GREEN, GREEN, PURPLE]))
b.append(t(222, y + 14.5, "same first 48 tokens: hits blocks 0–2 (HIT, still empty); new block 4", 11, fill=MUTED))

# 2. the forward pass, layer by layer
y = 104
b.append(
    t(
        10,
        y,
        "2 · the forward pass: in every layer, ① store_kv for the whole batch, then ② attention",
        12.5,
        weight="600",
    )
)
y = 114
xs = [10, 184, 358]
for k, name in enumerate(["layer 0", "layer 1", "layer 2"]):
    x = xs[k]
    b.append(
        rect(
            x,
            y,
            158,
            34,
            fill="#ffffff" if k != 1 else LIGHT_GRAY,
            stroke=MUTED if k != 1 else INK,
            rx=4,
            sw=1 if k != 1 else 1.6,
        )
    )
    b.append(t(x + 8, y + 14, name, 11, weight="700"))
    b.append(t(x + 8, y + 28, "① store_kv → ② attention", 10.5, fill=MUTED))
    b.append(line(x + 158, y + 17, x + 174, y + 17))
b.append(t(533, y + 21, "…", 14, fill=MUTED))
b.append(rect(548, y, 90, 34, fill="#ffffff", stroke=MUTED, rx=4))
b.append(t(556, y + 14, "last layer", 11, weight="700") + t(556, y + 28, "① → ②", 10.5, fill=MUTED))
b.append(line(638, y + 17, 654, y + 17))
b.append(t(658, y + 14, "logits,", 10.5, fill=MUTED) + t(658, y + 28, "sample", 10.5, fill=MUTED))
# zoom lines from layer 1
b.append(path(f"M{184},{y + 34} L10,176", stroke=GRAY, sw=1, arrow=False, extra='stroke-dasharray="3,3"'))
b.append(path(f"M{342},{y + 34} L710,176", stroke=GRAY, sw=1, arrow=False, extra='stroke-dasharray="3,3"'))

# 3. one layer in detail
y0 = 176
b.append(rect(10, y0, 700, 242, fill="#fbfbfb", stroke=GRAY, rx=6))
b.append(t(20, y0 + 18, "inside layer 1 (every layer alike)", 11.5, weight="700"))
b.append(
    line(250, y0 + 14, 470, y0 + 14, stroke=GRAY, sw=1.1)
    + t(360, y0 + 10, "time within the layer", 10, anchor="middle", fill=MUTED)
)
# headers
b.append(t(24, y0 + 42, "① store_kv: write every request’s", 11, weight="700"))
b.append(t(24, y0 + 56, "new K/V into its slots", 11, weight="700"))
b.append(t(360, y0 + 42, "this layer’s cache blocks", 11, anchor="middle", weight="700"))
b.append(t(360, y0 + 56, "(k_cache, v_cache)", 10.5, anchor="middle", fill=MUTED, mono=True))
b.append(t(548, y0 + 42, "② attention: queries read", 11, weight="700"))
b.append(t(548, y0 + 56, "the cache (block tables)", 11, weight="700"))
# blocks
BX, BWD, BH = 282, 156, 22
rows = [
    (0, "A’s tokens 0–15", BLUE),
    (1, "A’s tokens 16–31", BLUE),
    (2, "A’s tokens 32–47", BLUE),
    (3, "A’s 48–54 (7 of 16)", BLUE),
    (4, "B’s 48–52 (5 of 16)", PURPLE),
]
by = {}
for k, (i, label, c) in enumerate(rows):
    yy = y0 + 68 + k * 27 + (10 if i == 4 else 0)
    by[i] = yy
    fill = LIGHT_BLUE if c == BLUE else LIGHT_PURPLE
    b.append(rect(BX, yy, BWD, BH, fill=fill, stroke=c, rx=3, sw=1.3))
    b.append(
        t(BX + 8, yy + 15, f"block {i}", 11, weight="700")
        + t(BX + BWD - 6, yy + 15, label.replace("A’s ", "").replace("B’s ", ""), 10, anchor="end", fill=MUTED)
    )
# left boxes
b.append(rect(24, by[0] + 4, 200, 4 * 27 - 13, fill="#ffffff", stroke=BLUE, rx=4, sw=1.4))
b.append(t(34, by[0] + 26, "A: K/V of its 55 new tokens", 11, weight="700", fill=BLUE))
b.append(t(34, by[0] + 42, "(positions 0–54)", 10.5, fill=MUTED))
b.append(t(34, by[0] + 62, "written into blocks 0–3", 10.5, fill=MUTED))
for i in range(4):
    b.append(line(224, by[0] + 4 + (4 * 27 - 13) / 2, BX - 2, by[i] + BH / 2, stroke=BLUE, sw=1.2, marker="bl"))
b.append(rect(24, by[4], 200, BH, fill="#ffffff", stroke=PURPLE, rx=4, sw=1.4))
b.append(t(34, by[4] + 15, "B: K/V of its 5 new tokens", 10.5, weight="700", fill=PURPLE))
b.append(line(224, by[4] + BH / 2, BX - 2, by[4] + BH / 2, stroke=PURPLE, sw=1.2, marker="p"))
# right boxes
RX = 548
b.append(rect(RX, by[0] + 4, 150, 2 * 27 - 4, fill="#ffffff", stroke=BLUE, rx=4, sw=1.4))
b.append(t(RX + 10, by[0] + 22, "A’s 55 queries read", 11, weight="700", fill=BLUE))
b.append(t(RX + 10, by[0] + 38, "blocks 0 1 2 3", 10.5, fill=MUTED))
for i in range(4):
    b.append(line(BX + BWD + 2, by[i] + BH / 2 - 4, RX - 2, by[0] + 4 + 25, stroke=BLUE, sw=1.1, marker="bl"))
b.append(rect(RX, by[3] + 2, 150, by[4] + BH - by[3] - 2, fill="#ffffff", stroke=PURPLE, rx=4, sw=1.4))
b.append(t(RX + 10, by[3] + 20, "B’s 5 queries read", 11, weight="700", fill=PURPLE))
b.append(t(RX + 10, by[3] + 36, "blocks 0 1 2 (HIT) and 4", 10.5, fill=MUTED))
for i in range(3):
    b.append(line(BX + BWD + 2, by[i] + BH / 2 + 4, RX - 2, by[3] + 24, stroke=GREEN, sw=1.5, marker="g"))
b.append(line(BX + BWD + 2, by[4] + BH / 2, RX - 2, by[4] + BH / 2 - 2, stroke=PURPLE, sw=1.2, marker="p"))
# the point
b.append(
    t(
        24,
        y0 + 232,
        "B’s hit is safe: A wrote blocks 0–2 of this layer in ① before any attention of this layer reads them in ②.",
        11,
        fill=GREEN,
        weight="600",
    )
)

SVG = svg(
    W,
    H,
    "A same-step prefix hit: in every layer every request's new K/V are written (store_kv) before any attention of that layer reads the cache, so request B can hit blocks that request A computes in the same step",
    b,
)
ALT = (
    "Requests A and B in one engine step. At schedule time A gets blocks 0 to 3, and blocks 0 to 2 enter the cache; "
    "B hits blocks 0 to 2 and gets block 4. In the forward pass, each layer first runs store_kv for both requests "
    "(A writes blocks 0 to 3, B writes block 4), then attention: A reads blocks 0 to 3, B reads blocks 0 to 2 and 4. "
    "So B's hit reads K/V that A wrote earlier in the same layer."
)
if __name__ == "__main__":
    open(__import__("pathlib").Path(__file__).with_suffix(".svg"), "w").write(SVG)
