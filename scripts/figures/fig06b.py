from common import *

W, H = 720, 332
b = [markers(a=MUTED)]
# headers
b.append(t(10, 18, "SGLang · radix tree: one path per prefix", 12.5, weight="700"))
b.append(t(10, 33, "each edge carries a run of tokens", 10.5, fill=MUTED))
b.append(t(372, 18, "vLLM · block hashes: one chain per prompt", 12.5, weight="700"))
b.append(t(372, 33, "each hash covers its block and everything before it", 10.5, fill=MUTED))
b.append(line(356, 8, 356, 250, stroke="#dddddd", sw=1, arrow=False))

yA, yB, yC = 96, 156, 230
yN2 = (yA + yB) / 2
yN1 = 178


# tree edges (elbows)
def edge(x1, y1, x2, y2, label, desc=None, colour=INK):
    d = f"M{x1},{y1} L{x1},{y2} L{x2},{y2}"
    out = path(d, stroke=colour, sw=1.6, arrow=False)
    lx = x1 + 8
    out += t(lx, y2 - 6, label, 11, weight="700")
    if desc:
        out += t(lx, y2 + 14, desc, 10, fill=MUTED)
    return out


def node(x, y, r=4.5, fill="#ffffff", stroke=INK):
    return f'<circle cx="{x}" cy="{y}" r="{r}" fill="{fill}" stroke="{stroke}" stroke-width="1.6"/>'


b.append(path(f"M14,{yN1} L84,{yN1}", stroke=INK, sw=1.6, arrow=False))
b.append(t(20, yN1 - 6, "5 tokens", 11, weight="700"))
b.append(t(20, yN1 + 14, "“…system", 10, fill=MUTED) + t(20, yN1 + 26, "⏎You are”", 10, fill=MUTED))
b.append(edge(84, yN1, 204, yN2, "281 tokens", "rest of system 0 …"))
b.append(t(92, yN2 + 27, "…<|im_start|>user⏎", 9.5, fill=MUTED, mono=True))
b.append(edge(204, yN2, 344, yA, "15 tokens", "user 0’s request"))
b.append(edge(204, yN2, 344, yB, "23 tokens", "user 1’s request"))
b.append(edge(84, yN1, 344, yC, "305 tokens", "rest of system 1 + user 2’s request"))
b.append(node(14, yN1, 5, fill=INK))
b.append(t(10, yN1 - 22, "root", 10, fill=MUTED))
for x, y in [(344, yA), (344, yB), (344, yC)]:
    b.append(node(x, y, 4, fill=LIGHT_GRAY))
b.append(node(84, yN1, 6, fill=LIGHT_VERM, stroke=VERMILLION))
b.append(node(204, yN2, 6, fill=LIGHT_VERM, stroke=VERMILLION))
b.append(t(212, yN2 + 4, "split at token 286", 10, fill=VERMILLION, weight="600", extra='dy="0"'))
b.append(t(92, yN1 + 4, "split at token 5", 10, fill=VERMILLION, weight="600"))

# chains
X0, BWD, G = 372, 38, 3


def chain(y, cells, tail, label):
    out = [t(X0, y - 15, label, 11, weight="600")]
    x = X0
    for c in cells:
        if c == "⋯":
            out.append(t(x + BWD / 2, y + 5, "⋯", 13, anchor="middle", fill=MUTED))
        else:
            shared = c.startswith("h")
            fill, stroke = (LIGHT_BLUE, BLUE) if shared else ("#ffffff", MUTED)
            if c in ("a17", "b17", "c0"):
                stroke = VERMILLION
            out.append(
                rect(x, y - 10, BWD, 20, fill=fill, stroke=stroke, rx=3, sw=1.5 if stroke == VERMILLION else 1.2)
            )
            out.append(t(x + BWD / 2, y + 4, c, 11, anchor="middle", mono=True, weight="600"))
        x += BWD + G
    out.append(rect(x, y - 10, 84, 20, fill="#ffffff", stroke=GRAY, rx=3, extra='stroke-dasharray="3,2"'))
    out.append(t(x + 42, y + 4, f"+{tail}: no hash", 10.5, anchor="middle", fill=MUTED))
    return "".join(out)


b.append(t(X0 - 2, 56, "block", 9.5, anchor="end", fill=MUTED))
for k, lab in enumerate(["0", "1", "", "16", "17", "18"]):
    b.append(t(X0 + k * (BWD + G) + BWD / 2, 56, lab, 9.5, anchor="middle", fill=MUTED))
b.append(chain(yA, ["h0", "h1", "⋯", "h16", "a17"], 13, "system 0 + user 0 · 301 tokens"))
b.append(chain(yB, ["h0", "h1", "⋯", "h16", "b17", "b18"], 5, "system 0 + user 1 · 309 tokens"))
b.append(chain(yC, ["c0", "c1", "⋯", "c16", "c17", "c18"], 6, "system 1 + user 2 · 310 tokens"))
for y in (yA, yB, yC):
    b.append(line(350, y, X0 - 4, y, stroke=GRAY, sw=1, arrow=False, extra='stroke-dasharray="2,3"'))
# legend / notes
y = 266
b.append(rect(10, y - 10, 14, 12, fill=LIGHT_VERM, stroke=VERMILLION, rx=6, sw=1.4))
b.append(t(30, y, "where prompts part, the tree branches (the edge is split there, mid-edge if need be)", 10.5))
b.append(rect(10, y + 8, 14, 12, fill=LIGHT_BLUE, stroke=BLUE, rx=2, sw=1.2))
b.append(
    t(
        30,
        y + 18,
        "the same hashes in two chains: one shared prefix, stored once in the map (39 keys for the three prompts)",
        10.5,
    )
)
b.append(rect(10, y + 26, 14, 12, fill="#ffffff", stroke=VERMILLION, rx=2, sw=1.5))
b.append(
    t(30, y + 36, "where prompts part, a different hash, and so for every later block: block 17 (tokens 272–287)", 10.5)
)
b.append(
    t(
        30,
        y + 50,
        "holds 14 shared tokens and 2 of user 0’s or user 1’s; system 1’s prompt parts at token 5, in block 0",
        10.5,
    )
)

SVG = svg(
    W,
    H,
    "The same three prompts as SGLang's radix tree and as vLLM's chains of block hashes: a shared prefix is one path in the tree and the same hashes in the map; where prompts part, the tree branches and the chains get different hashes from that block on",
    b,
)
ALT = (
    "Left: a radix tree of three prompts. From the root, an edge of 5 tokens shared by all; it splits into an edge "
    "of 305 tokens (system prompt 1 and user 2) and an edge of 281 tokens (the rest of system prompt 0), which splits "
    "into user 0's 15 tokens and user 1's 23 tokens. Right: each prompt's chain of 16-token block hashes. The two "
    "prompts of system prompt 0 share hashes h0 to h16; block 17 differs (a17 and b17). The prompt of system prompt 1 "
    "differs from block 0 on (c0 to c18). Partial last blocks have no hash."
)
if __name__ == "__main__":
    open(__import__("pathlib").Path(__file__).with_suffix(".svg"), "w").write(SVG)
