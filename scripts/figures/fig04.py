from common import *

W, H = 720, 300
X0, DX, BW = 132, 142, 124  # block columns


def bx(i):
    return X0 + i * DX


def strip(x, y, changed=None, stroke=GRAY):
    cells = []
    for k in range(16):
        fill = VERMILLION if k == changed else "#e9e9e9"
        cells.append(f'<rect x="{x + 7 + k * 7}" y="{y + 3}" width="6" height="12" fill="{fill}"/>')
    return rect(x, y, BW, 18, fill="#ffffff", stroke=stroke, rx=3, sw=1.2 if stroke != GRAY else 1) + "".join(cells)


def hnode(x, y, label, fill, stroke, note=None, note_fill=MUTED):
    out = rect(x, y, BW, 26, fill=fill, stroke=stroke, rx=13, sw=1.4)
    if note:
        out += t(x + 12, y + 17.5, label, 13, weight="700", mono=True)
        out += t(x + BW - 10, y + 17, note, 11, anchor="end", fill=note_fill, weight="600")
    else:
        out += t(x + BW / 2, y + 17.5, label, 13, anchor="middle", weight="700", mono=True)
    return out


b = [markers(a=MUTED, v=VERMILLION, g=GREEN)]
b.append(t(10, 20, "hash(block i) = H(hash(block i − 1), tokens[16i : 16i + 16], extra_keys_i)", 12.5, weight="600"))

# row 1: the prompt
y = 44
b.append(t(10, y, "the prompt", 12, weight="600", fill=BLUE))
ys, yh = y + 24, y + 52
for i in range(4):
    x = bx(i)
    b.append(
        t(x, ys - 6, f"block {i}", 11, weight="700")
        + t(x + BW, ys - 6, f"tokens {16 * i}–{16 * i + 15}", 10, anchor="end", fill=MUTED)
    )
    b.append(strip(x, ys))
    b.append(line(x + BW / 2, ys + 18, x + BW / 2, yh - 1))
    b.append(hnode(x, yh, f"h{i}", LIGHT_BLUE, BLUE))
    b.append(line(x + BW / 2, yh + 44, x + BW / 2, yh + 27, stroke=GRAY, sw=1.1))
    b.append(t(x + BW / 2, yh + 56, f"extra_keys_{i}", 10, anchor="middle", fill=MUTED, mono=True))
    px = 110 if i == 0 else bx(i - 1) + BW
    b.append(line(px, yh + 13, x - 1, yh + 13))
b.append(rect(10, yh, 100, 26, fill=LIGHT_GRAY, stroke=MUTED, rx=13, sw=1.2))
b.append(t(60, yh + 17, "NONE_HASH", 11.5, anchor="middle", weight="700", mono=True))
b.append(
    t(60, yh + 42, "the root of", 10, anchor="middle", fill=MUTED)
    + t(60, yh + 54, "every chain", 10, anchor="middle", fill=MUTED)
)
b.append(line(bx(3) + BW, yh + 13, 712, yh + 13) + t(700, yh - 4, "…", 14, anchor="middle", fill=MUTED))

# row 2: token 20 changed
y = 176
b.append(
    t(
        10,
        y,
        "the same prompt with token 25 changed (it lies in block 1); same extra keys",
        12,
        weight="600",
        fill=VERMILLION,
    )
)
ys, yh = y + 24, y + 52
for i in range(4):
    x = bx(i)
    b.append(t(x, ys - 6, f"block {i}", 11, weight="700"))
    b.append(strip(x, ys, changed=9 if i == 1 else None, stroke=VERMILLION if i == 1 else GRAY))
    b.append(line(x + BW / 2, ys + 18, x + BW / 2, yh - 1))
    if i == 0:
        b.append(hnode(x, yh, "h0", LIGHT_GREEN, GREEN, "= same", GREEN))
    else:
        b.append(hnode(x, yh, f"h{i}′", LIGHT_VERM, VERMILLION, "≠ changed", VERMILLION))
    px = 110 if i == 0 else bx(i - 1) + BW
    b.append(line(px, yh + 13, x - 1, yh + 13, stroke=MUTED if i <= 1 else VERMILLION, marker="a" if i <= 1 else "v"))
cx = bx(1) + 7 + 9 * 7 + 3
b.append(f'<path d="M{cx - 4},{ys - 9} L{cx + 4},{ys - 9} L{cx},{ys - 2} z" fill="{VERMILLION}"/>')
b.append(t(cx + 7, ys - 4, "token 25", 10, fill=VERMILLION, weight="700"))
b.append(rect(10, yh, 100, 26, fill=LIGHT_GRAY, stroke=MUTED, rx=13, sw=1.2))
b.append(t(60, yh + 17, "NONE_HASH", 11.5, anchor="middle", weight="700", mono=True))
b.append(
    line(bx(3) + BW, yh + 13, 712, yh + 13, stroke=VERMILLION, marker="v")
    + t(700, yh - 4, "…", 14, anchor="middle", fill=MUTED)
)
b.append(
    t(bx(0) + BW / 2, yh + 44, "h0 covers tokens 0–15:", 10.5, anchor="middle", fill=MUTED)
    + t(bx(0) + BW / 2, yh + 57, "token 25 is no input", 10.5, anchor="middle", fill=MUTED)
)
b.append(
    t(bx(1), yh + 44, "h1′: token 25 is one of its inputs.   h2′, h3′, …: the same tokens as before,", 10.5, fill=MUTED)
)
b.append(
    t(bx(1), yh + 57, "but each takes its parent’s hash as input, so the change runs down the chain.", 10.5, fill=MUTED)
)

SVG = svg(
    W,
    H,
    "The hash chain: each block's hash is computed from its parent's hash, its tokens and its extra keys; changing token 25 in block 1 changes the hashes of blocks 1, 2, 3 and on, not block 0's",
    b,
)
ALT = (
    "Hash chain of four 16-token blocks. Top: NONE_HASH feeds h0, h0 feeds h1, and so on; each hash also takes its "
    "block's tokens and extra keys. Bottom: the same prompt with token 25, in block 1, changed: h0 stays the same, "
    "h1, h2, h3 and every later hash change."
)
if __name__ == "__main__":
    open(__import__("pathlib").Path(__file__).with_suffix(".svg"), "w").write(SVG)
