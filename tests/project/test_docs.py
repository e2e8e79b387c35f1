"""ARCHITECTURE.md points only at what exists: every `path/like/this.py` it names is in the
repository, and every `make target` it names is a target of the Makefile. README links to it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "ARCHITECTURE.md"
# Folders that a make target creates and git ignores: named in the guide, absent from a clean clone.
MADE_BY_MAKE = ("models/", ".venv-vllm/", ".venv-latest/", ".venv-router/", "my-course/")


def named_paths(markdown: str) -> list[str]:
    """Code spans that look like a repository path: ``a/b.py``, ``dir/``, ``README.md``.

    A span with ``<...>`` or ``NN`` in it is a pattern (``mini_vllm/course/<topic>_checks.py``), not a path.
    """
    paths = []
    for span in re.findall(r"`([^`\s]+)`", markdown):
        if "<" in span or "NN" in span or "(" in span:
            continue
        if "/" in span or re.fullmatch(r"[\w.-]+\.(py|md|ipynb|sh|toml|cfg|json)", span):
            paths.append(span)
    return paths


def missing_paths(markdown: str, root: Path) -> list[str]:
    return [p for p in named_paths(markdown) if not p.startswith(MADE_BY_MAKE) and not (root / p).exists()]


def named_make_targets(markdown: str) -> set[str]:
    return set(re.findall(r"`make ([\w-]+)", markdown))


def makefile_targets(makefile: str) -> set[str]:
    return set(re.findall(r"^([\w-]+):", makefile, flags=re.MULTILINE))


def test_every_path_in_the_guide_exists():
    markdown = GUIDE.read_text()
    assert len(named_paths(markdown)) > 40  # the guide names the files; the regex finds them
    assert not missing_paths(markdown, ROOT), (
        f"ARCHITECTURE.md names paths that do not exist: {missing_paths(markdown, ROOT)}"
    )


def test_every_make_target_in_the_guide_exists():
    named = named_make_targets(GUIDE.read_text())
    assert {"real-model", "vllm", "exercises"} <= named
    missing = named - makefile_targets((ROOT / "Makefile").read_text())
    assert not missing, f"ARCHITECTURE.md names make targets the Makefile lacks: {sorted(missing)}"


def test_readme_links_the_guide():
    assert "(ARCHITECTURE.md)" in (ROOT / "README.md").read_text()


def test_a_moved_file_or_a_removed_target_is_caught(tmp_path):
    (tmp_path / "mini_vllm").mkdir()
    (tmp_path / "mini_vllm" / "llm.py").write_text("")
    guide = "`mini_vllm/llm.py` calls `mini_vllm/engine.py`; `<topic>_checks.py` is a pattern; `models/` is made."
    assert named_paths(guide) == ["mini_vllm/llm.py", "mini_vllm/engine.py", "models/"]
    assert missing_paths(guide, tmp_path) == ["mini_vllm/engine.py"]  # so the test above would fail
    assert named_make_targets("run `make vllm`, then `make bench`") - makefile_targets("vllm:\n\tx\n") == {"bench"}
