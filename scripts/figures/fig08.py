from common import *

W, H = 720, 344
b = [markers(a=MUTED, v=VERMILLION, bl=BLUE)]
b.append(
    t(
        10,
        18,
        "At position i, an EAGLE-style drafter reads the target’s hidden state at i and the token at i + 1",
        12.5,
        weight="700",
    )
)

cols = [13, 14, 15, 16, 17, 18]
X = {p: 214 + k * 76 for k, p in enumerate(cols)}
BOUND = (X[15] + X[16]) / 2
yT, yH, yD, yK = 56, 110, 168, 226
# row labels
for y, l1, l2 in [
    (yT, "tokens", "the target’s input"),
    (yH, "hidden states", "from the target model"),
    (yD, "drafter input", "at position i"),
    (yK, "drafter K/V", "its own KV cache"),
]:
    b.append(t(10, y + 9, l1, 11.5, weight="700") + t(10, y + 23, l2, 10, fill=MUTED))
# block boundary
b.append(line(BOUND, 34, BOUND, yK + 30, stroke=INK, sw=1.2, arrow=False, extra='stroke-dasharray="5,3"'))
b.append(t(BOUND - 8, 42, "block 0 (positions 0–15)", 10.5, anchor="end", weight="600"))
b.append(t(BOUND + 8, 42, "block 1 (positions 16–31)", 10.5, weight="600"))
for p in cols:
    x = X[p]
    hot_t = p == 16
    hot_d = p == 15
    # token
    b.append(
        rect(
            x - 20,
            yT,
            40,
            24,
            fill=LIGHT_VERM if hot_t else "#ffffff",
            stroke=VERMILLION if hot_t else MUTED,
            rx=3,
            sw=1.5 if hot_t else 1,
        )
    )
    b.append(t(x, yT + 16.5, f"t{p}", 11.5, anchor="middle", mono=True, weight="600"))
    # target: token -> hidden state
    b.append(line(x - 8, yT + 24, x - 8, yH - 1, stroke=BLUE, sw=1.2, marker="bl"))
    b.append(rect(x - 18, yH, 36, 22, fill=LIGHT_BLUE, stroke=BLUE, rx=3, sw=1.2))
    b.append(t(x, yH + 15.5, f"h{p}", 11.5, anchor="middle", mono=True, weight="600"))
    # drafter input at position p: (h_p, t_p+1)
    b.append(line(x - 8, yH + 22, x - 8, yD - 1, stroke=MUTED, sw=1.2))
    nxt = f"t{p + 1}"
    b.append(
        rect(
            x - 30,
            yD,
            60,
            24,
            fill=LIGHT_VERM if hot_d else LIGHT_GRAY,
            stroke=VERMILLION if hot_d else MUTED,
            rx=3,
            sw=1.6 if hot_d else 1,
        )
    )
    b.append(t(x, yD + 16.5, f"h{p}, {nxt}", 10.5, anchor="middle", mono=True, weight="600"))
    # the next token's arrow (diagonal from column p+1)
    x2 = x + 76
    col = VERMILLION if hot_d else MUTED
    if p + 1 in X:
        b.append(
            line(x2 + 8, yT + 24, x + 14, yD - 1, stroke=col, sw=1.5 if hot_d else 1.1, marker="v" if hot_d else "a")
        )
    else:
        b.append(line(x + 44, yT + 24, x + 14, yD - 1, stroke=col, sw=1.1, marker="a"))
    # drafter K/V
    b.append(line(x, yD + 24, x, yK - 1, stroke=col, sw=1.2, marker="v" if hot_d else "a"))
    b.append(
        rect(x - 24, yK, 48, 22, fill="#ffffff", stroke=VERMILLION if hot_d else GRAY, rx=3, sw=1.6 if hot_d else 1)
    )
    b.append(t(x, yK + 15, f"K/V {p}", 10.5, anchor="middle", weight="600"))
for x in (X[13] - 44, X[18] + 44):
    b.append(t(x, yT + 16, "…", 13, anchor="middle", fill=MUTED) + t(x, yD + 16, "…", 13, anchor="middle", fill=MUTED))

y = 276
b.append(
    t(
        10,
        y,
        "K/V 15, the drafter’s entry at block 0’s last position, depends on t16, a token of block 1:",
        11,
        fill=VERMILLION,
        weight="600",
    )
)
b.append(
    t(
        10,
        y + 15,
        "a hit on block 0 cached when another token followed it would give the drafter wrong state there.",
        11,
    )
)
b.append(
    t(
        10,
        y + 30,
        "Older releases (and vLLM 0.33 with a KV connector) drop the last matched block of every hit and recompute it;",
        11,
    )
)
b.append(
    t(
        10,
        y + 45,
        "otherwise vLLM 0.33 hashes the next token too: block 0’s extra keys become (keys, next_token), here t16.",
        11,
    )
)

SVG = svg(
    W,
    H,
    "An EAGLE drafter at position i reads the target's hidden state h_i and the token t_i+1, so its K/V at block 0's last position (15) depend on token 16, the first token of block 1",
    b,
)
ALT = (
    "Token positions 13 to 18 around the boundary between block 0 (positions 0 to 15) and block 1. The target model "
    "turns each token t_i into a hidden state h_i. The EAGLE drafter at position i takes h_i and the next token "
    "t_i+1 and writes its own K/V at position i. At position 15, the last of block 0, that next token is t16, "
    "which lies in block 1: so older vLLM releases drop the last matched block of a hit, and vLLM 0.33 makes "
    "block 0's hash also cover t16."
)
if __name__ == "__main__":
    open(__import__("pathlib").Path(__file__).with_suffix(".svg"), "w").write(SVG)
