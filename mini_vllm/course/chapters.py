"""The chapter list, in one place: the three chapter tables are written from it.

README.md ("What the course covers"), notebooks/README.md and chapter 00's
course map each hold the same table, between the markers ``TABLE_BEGIN`` and
``TABLE_END``. Adding or splitting a chapter means adding its ``Chapter`` here
and running ``python -m mini_vllm.course.build chapter-tables`` (``make
exercises`` runs it too); ``tests/course/test_chapter_index.py`` fails while a table
differs from this list or a notebook in ``notebooks/`` is missing from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nbformat

from ..tools.paths import REPO_ROOT

ROOT = REPO_ROOT
TABLE_BEGIN = "<!-- chapter table: written by `python -m mini_vllm.course.build chapter-tables` from mini_vllm/course/chapters.py -->"
TABLE_END = "<!-- end of chapter table -->"
WELCOME = "notebooks/00_welcome.ipynb"
TABLE_FILES = ("README.md", "notebooks/README.md", WELCOME)


@dataclass(frozen=True)
class Chapter:
    """One chapter: ``number`` as in its file name, what it teaches, what its exercise asks (None: no exercise)."""

    number: str
    notebook: str  # the file in notebooks/
    summary: str
    exercise: str | None = None


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00", "00_welcome.ipynb", "welcome: what we build, one live `generate` with the dashboard"),
    Chapter(
        "01",
        "01_kv_cache.ipynb",
        "the KV cache, prefill vs decode, why equal prefixes give equal K/V (shown numerically)",
        "a decode loop with a contiguous cache",
    ),
    Chapter(
        "02",
        "02_paged_pool.ipynb",
        "the paged pool: fragmentation, 16-token blocks, `KVCacheBlock`, `FreeKVCacheBlockQueue`",
        "`FreeKVCacheBlockQueue`",
    ),
    Chapter(
        "03", "03_block_tables.ipynb", "block tables, token → block math, `slot_mapping`", "`compute_slot_mapping`"
    ),
    Chapter(
        "04",
        "04_hash_chain.ipynb",
        "the hash chain: position, SHA-256 vs `hash()` vs xxhash, `NONE_HASH`, extra keys, token ids vs text",
        "`hash_block_tokens`, `hash_request_tokens`",
    ),
    Chapter(
        "05",
        "05_prefix_hits.ipynb",
        "prefix hits: the hash map, `find_longest_cache_hit`, the last-block rule, same-step hits, "
        "speculative decoding's lookahead, n>1 sharing, counting hits",
        "`find_longest_cache_hit`",
    ),
    Chapter(
        "06",
        "06_eviction.ipynb",
        "ref counts and LRU eviction: free order, lazy eviction, hit rate vs memory pressure",
        "`free_blocks`, `get_new_blocks` with eviction",
    ),
    Chapter(
        "06b",
        "06b_radix_tree_vs_hash_map.ipynb",
        "radix tree or hash map: SGLang's `RadixCache` against vLLM's chained block hashes on the same workload — "
        "matching granularity, eviction, cost",
    ),
    Chapter(
        "06c",
        "06c_offloading.ipynb",
        "a second tier: KV-cache offloading as vLLM 0.33 does it — what is stored when, the lookup going on into "
        "the tier, loads before the forward pass, LRU and ARC, a failed load, events with their medium, "
        "`--cpu-offload-gb` is not it, a load against a miss measured",
        "the tier's LRU eviction `lru_evict`",
    ),
    Chapter(
        "07",
        "07_triton_kernels.ipynb",
        "Triton: `store_kv`, paged decode, prefill over a cached prefix",
        "a `store_kv` kernel and a paged decode loop",
    ),
    Chapter(
        "08",
        "08_engine.ipynb",
        "the engine: scheduler, continuous batching, chunked prefill, preemption",
        "admission with prefix lookup",
    ),
    Chapter(
        "08b",
        "08b_hybrid_models.ipynb",
        "hybrid models: sliding-window layers, KV-cache groups side by side, the null block, per-group lookups and "
        "the hit every group can serve, which sliding-window blocks vLLM caches (boundaries only), the memory saved",
        "the sliding-window lookup `find_sliding_window_cache_hit`",
    ),
    Chapter(
        "09",
        "09_prompt_caching_in_practice.ipynb",
        'prompt caching in practice, writing prompts that hit: the tips measured, a "why did it miss" profiler, '
        "a timestamp in the chat template, every tip on a real model",
        "a prompt fix that raises the hit rate",
    ),
    Chapter(
        "09b",
        "09b_sharing_a_cache_safely.ipynb",
        "sharing a cache safely: the timing side channel and `cache_salt` (on the bundled and a real model), "
        "role markers in user content, prefix-aware routing across replicas",
    ),
    Chapter("10", "10_benchmarks.ipynb", "benchmarks on your machine"),
    Chapter(
        "A",
        "A_from_mini_vllm_to_vllm.ipynb",
        "from mini-vLLM to vLLM: every concept ↔ vLLM's names, flags and metrics; what the course leaves out; "
        "real vLLM side by side (`make vllm`)",
    ),
)


def chapter_table() -> str:
    """The chapter table as markdown, with its markers."""
    rows = ["| # | chapter (`notebooks/`) | exercise: you implement |", "|---|---|---|"]
    rows += [f"| {c.number} | {c.summary} | {c.exercise or '—'} |" for c in CHAPTERS]
    return "\n".join([TABLE_BEGIN, "", *rows, "", TABLE_END])


def _replace_table(text: str, where: str) -> str:
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise ValueError(f"{where} has no chapter-table markers ({TABLE_BEGIN!r} ... {TABLE_END!r})")
    start = text.index(TABLE_BEGIN)
    end = text.index(TABLE_END) + len(TABLE_END)
    return text[:start] + chapter_table() + text[end:]


def tables_out_of_date(root: Path = ROOT) -> list[str]:
    """The files whose chapter table differs from ``chapter_table()``."""
    return [name for name in TABLE_FILES if _read(root / name) != _replace_table(_read(root / name), name)]


def write_chapter_tables(root: Path = ROOT) -> list[str]:
    """Rewrite the table in every file that holds one; returns the files changed."""
    changed = []
    for name in TABLE_FILES:
        path = root / name
        if name.endswith(".ipynb"):
            nb = nbformat.read(path, as_version=4)
            for cell in nb.cells:
                if cell.cell_type == "markdown" and TABLE_BEGIN in cell.source:
                    new = _replace_table(cell.source, name)
                    if new != cell.source:
                        cell.source = new
                        nbformat.write(nb, path)
                        changed.append(name)
                    break
            else:
                raise ValueError(f"{name} has no markdown cell with the chapter-table markers")
        else:
            text = path.read_text()
            new = _replace_table(text, name)
            if new != text:
                path.write_text(new)
                changed.append(name)
    return changed


def _read(path: Path) -> str:
    """A file's text, or a notebook's markdown cell that holds the table."""
    if path.suffix != ".ipynb":
        return path.read_text()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and TABLE_BEGIN in cell.source:
            return cell.source
    raise ValueError(f"{path.name} has no markdown cell with the chapter-table markers")
