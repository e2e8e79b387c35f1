"""What ``make test`` installs before the tests run, and what a test does when one is missing.

``make test`` installs Debian's Chromium (``scripts/ensure_chromium.sh``), real
vLLM (``make vllm``) and the converted real model (``make real-model``). Where
one cannot be installed (a laptop without apt or root, macOS, no network) the
tests that need it skip and say why, so the rest of the suite still runs. Under
CI (``CI=true``) the same skip is a failure: a CI run that silently skipped the
browser, the vLLM or the real-model tests would pass without testing them.

A test marks such a skip by calling ``missing(prerequisite, reason)`` or with
``skip_if_missing(condition, prerequisite, reason)``; both tag the skip
reason. ``pytest_runtest_makereport`` below (imported by ``tests/conftest.py``)
turns a tagged skip into a failure when ``CI`` is true. Other skips (no CUDA,
no Triton on macOS, …) stay skips everywhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

CHROMIUM = "/usr/bin/chromium"
# The prerequisites make test installs, with how to get each.
PREREQUISITES = {
    "chromium": f"{CHROMIUM}: scripts/ensure_chromium.sh (apt-get install chromium)",
    "playwright": "playwright for Python: pip install playwright (no `playwright install` needed)",
    "vllm": "real vLLM in .venv-vllm/: make vllm",
    "vllm-router": "vllm-router in .venv-router/: make router",
    "real-model": "SmolLM2-135M-Instruct in models/: make real-model",
    "npm": "npm and the npm registry, for make site's widget and MathJax scripts: apt-get install npm",
}
TAG = "missing prerequisite"


def under_ci() -> bool:
    """True when ``CI`` is set to a true value (GitHub Actions, GitLab and most CI services set CI=true)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def distribution_installed(name: str) -> bool:
    """True when the distribution ``name`` (pip's name, not an import name) is installed here."""
    import importlib.metadata

    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def reason_for(prerequisite: str, reason: str) -> str:
    """The tagged skip reason: ``[missing prerequisite: vllm] …``."""
    if prerequisite not in PREREQUISITES:
        raise ValueError(f"unknown prerequisite {prerequisite!r}; known: {sorted(PREREQUISITES)}")
    return f"[{TAG}: {prerequisite}] {reason}"


def missing(prerequisite: str, reason: str) -> NoReturn:
    """Skip this test because ``prerequisite`` is missing (a failure under CI, see the module docstring)."""
    pytest.skip(reason_for(prerequisite, reason))


# The prerequisites that are markers too: make test-fast leaves their tests out.
TIER_MARKERS = {"real-model": "real_model", "vllm": "vllm"}


def pytest_configure(config):
    """Register the prerequisites' markers (tests/conftest.py imports this hook)."""
    for prerequisite, marker in TIER_MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: needs {PREREQUISITES[prerequisite]} (not in make test-fast)")


def skip_if_missing(condition: bool, prerequisite: str, reason: str):
    """``pytest.mark.skipif`` with a tagged reason, and the prerequisite's marker (``real_model``, ``vllm``)."""
    skip = pytest.mark.skipif(condition, reason=reason_for(prerequisite, reason))
    if prerequisite not in TIER_MARKERS:
        return skip
    return lambda test: getattr(pytest.mark, TIER_MARKERS[prerequisite])(skip(test))


def require_chromium() -> None:
    """Skip (a failure under CI) unless Debian's Chromium and Playwright for Python are there."""
    if not Path(CHROMIUM).exists():
        missing("chromium", f"{CHROMIUM} is missing: run scripts/ensure_chromium.sh (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing("playwright", "playwright is not installed: pip install playwright (no `playwright install` needed)")


def _skip_message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI, a skip for a missing prerequisite fails the test instead."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not under_ci() or hasattr(report, "wasxfail"):
        return
    message = _skip_message(report)
    if f"[{TAG}: " not in message:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"CI=true: {message.removeprefix('Skipped: ')}\n"
        "Under CI a missing prerequisite fails the run instead of skipping the tests that need it "
        "(tests/prerequisites.py); install it, or run without CI=true to skip."
    )
