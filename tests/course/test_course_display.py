"""``show_source``: the real code, cut where the chapter says, in a fixed-width font everywhere."""

from __future__ import annotations

import inspect
import re
import textwrap

import pytest

from mini_vllm.block_pool import BlockPool
from mini_vllm.course import show_source


def _code(listing) -> str:
    return listing.text.split("```python\n", 1)[1].rsplit("\n```", 1)[0]


def test_end_alone_cuts_from_the_first_line():
    full = textwrap.dedent(inspect.getsource(BlockPool.get_new_blocks)).rstrip().splitlines()
    marker = next(line.strip() for line in full[2:] if line.strip())  # some line after the signature
    cut = _code(show_source(BlockPool.get_new_blocks, end=marker)).splitlines()
    assert cut[0] == full[0]  # starts at the top
    assert marker in cut[-1] and len(cut) < len(full)  # and stops at `end`, not at the end of the function


def test_start_and_end_select_an_inclusive_range():
    cut = _code(show_source(BlockPool.get_new_blocks, start="def get_new_blocks", end="def get_new_blocks"))
    assert cut.splitlines() == [cut.splitlines()[0]] and cut.startswith("def get_new_blocks")


def test_a_marker_that_is_not_there_names_itself():
    with pytest.raises(ValueError, match="no-such-line"):
        show_source(BlockPool.get_new_blocks, end="no-such-line")
    with pytest.raises(ValueError, match="no-such-line"):
        show_source(BlockPool.get_new_blocks, start="no-such-line")


def test_html_rendering_is_monospace_and_carries_the_same_code():
    listing = show_source(BlockPool.get_new_blocks)
    bundle = listing._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/markdown", "text/html"}
    html = bundle["text/html"]
    assert re.search(r"<pre style=\"font-family:[^\"]*monospace", html)  # not the page's proportional font
    text = re.sub(r"<[^>]+>", "", html)
    import html as html_lib

    assert _code(listing) in html_lib.unescape(text)
    assert bundle["text/markdown"] == bundle["text/plain"] == listing.text


def test_show_interface_keeps_signatures_and_docstrings_and_drops_bodies():
    from mini_vllm.block_pool import FreeKVCacheBlockQueue
    from mini_vllm.course import show_interface

    function = _code(show_interface(BlockPool.get_new_blocks))
    assert function.startswith("def get_new_blocks(self, num_blocks: int)")
    assert inspect.getdoc(BlockPool.get_new_blocks).splitlines()[0] in function
    assert function.splitlines()[-1].strip() == "..." and "popleft_n" not in function

    cls = _code(show_interface(FreeKVCacheBlockQueue))
    assert cls.startswith("class FreeKVCacheBlockQueue:") and "Invariants" in cls
    for method in ("__init__", "popleft", "remove", "append", "appendleft", "get_all_free_blocks", "__len__"):
        assert f"def {method}(" in cls
    assert "_insert_run_after" not in cls and "fake_head.next_free_block" not in cls  # no private helper, no body
    compile(cls, "<interface>", "exec")  # still valid Python
    assert "interface only" in show_interface(FreeKVCacheBlockQueue)._repr_html_()
