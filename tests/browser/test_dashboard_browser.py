"""The dashboard in a real browser: JupyterLab + headless Chromium, run all cells, click Step.

Proves what unit tests cannot: the widget really renders in JupyterLab (no
"Loading widget...", no "Error displaying widget"), the static views render as
HTML, and a click on Step reaches the kernel, steps the engine and updates the
dashboard on screen. Screenshots land in ``build/screenshots/``.

Needs Debian's Chromium at /usr/bin/chromium (``scripts/ensure_chromium.sh``
installs it) and Playwright for Python (``pip install playwright``; its own
browser download is never used). Skipped with the reason when either is missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = Path(__file__).with_name("dashboard_test.ipynb")
SCREENSHOTS = ROOT / "build" / "screenshots"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# What must never show in an output area.
BAD_OUTPUT = ("Loading widget", "Error displaying widget", "Traceback", "Error:", "model not found")

pytestmark = pytest.mark.slow


def _requirements() -> str:
    """The model path, or skip with the reason."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: run scripts/ensure_chromium.sh (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed: pip install playwright (no `playwright install` needed)")
    from mini_vllm import default_model_path

    model = os.environ.get("MINI_VLLM_TEST_MODEL") or default_model_path()
    if not Path(model, "config.json").exists():
        pytest.skip(f"the default model is not built yet ({model})")
    return model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_server(url: str, process: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jupyter lab exited early with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


FIRST_CELL_STARTED = (
    "() => { const p = document.querySelector('.jp-CodeCell .jp-InputPrompt');"
    " return !!p && /\\[(\\*|\\d+)\\]/.test(p.textContent); }"
)


def _run_all_cells(page, attempts: int = 4) -> None:
    """Run > Run All Cells through the menu, as a learner would, until the first cell really starts.

    A status bar can say "Idle" a moment before the notebook's kernel is attached;
    Run All issued then clears the prompts and runs nothing. So: click, check, retry.
    """
    for _ in range(attempts):
        page.click(".jp-Notebook")
        page.click(".lm-MenuBar-item:has-text('Run')")
        page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
        try:
            page.wait_for_function(FIRST_CELL_STARTED, timeout=10_000)
            return
        except Exception:  # playwright's TimeoutError: not started, try again
            continue
    raise AssertionError(f"Run All Cells did not start the first cell in {attempts} tries")


def _drive(page, base: str, token: str) -> None:
    """Open the notebook, run all cells, check the dashboard, click Step and Run (screenshots on the way)."""
    page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    # Wait until the kernel is up, then Run > Run All Cells through the menu, as a learner would.
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-Toolbar-kernelStatus, .jp-Notebook-ExecutionIndicator')]"
        ".some(e => /idle/i.test(e.getAttribute('data-status') || e.title || e.textContent || ''))",
        timeout=60_000,
    )
    _run_all_cells(page)

    html_widget = ".mv-dashboard-widget .widget-html-content"
    page.wait_for_selector(f"{html_widget} .mv-dashboard", timeout=60_000)
    # Every code cell done: a number in its prompt, none still "[*]".
    page.wait_for_function(
        "() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];"
        " return p.length >= 4 && p.every(e => /\\[\\d+\\]/.test(e.textContent)); }",
        timeout=60_000,
    )
    page.wait_for_function(
        f"() => (document.querySelector('{html_widget}') || {{}}).textContent.includes('Queued')",
        timeout=20_000,
    )
    page.screenshot(path=str(SCREENSHOTS / "dashboard_before_step.png"), full_page=True)

    outputs = page.inner_text(".jp-Notebook")
    for bad in BAD_OUTPUT:
        assert bad not in outputs, f"{bad!r} in the notebook's outputs:\n{outputs[:3000]}"
    for css_class in ("mv-tables", "mv-pool", "mv-freequeue", "mv-hashchain"):
        assert page.locator(f"{html_widget} .{css_class}").count() == 1, css_class
    # The static view (cell 4) renders as plain HTML: a pool of 24 cells.
    static_cells = page.locator(".jp-OutputArea-output .mv-pool").last.locator(".mv-block")
    assert static_cells.count() == 24

    before = page.inner_html(html_widget)
    assert "step</span> <b>0</b>" in before
    page.click(".mv-dashboard-widget button:has-text('Step')")
    page.wait_for_function(
        f"() => document.querySelector('{html_widget}').innerHTML.includes('Step 1: computed')",
        timeout=30_000,
    )
    after = page.inner_html(html_widget)
    assert after != before
    assert "step</span> <b>1</b>" in after
    assert page.locator(f"{html_widget} .mv-hit").count() >= 1  # the second request hit the first's blocks
    page.screenshot(path=str(SCREENSHOTS / "dashboard_after_step.png"), full_page=True)
    dashboard = page.locator(".mv-dashboard-widget")
    dashboard.screenshot(path=str(SCREENSHOTS / "dashboard_widget.png"))

    # Run finishes both requests: they show up as finished, their blocks stay cached.
    page.click(".mv-dashboard-widget button:has-text('Run')")
    page.wait_for_function(
        f"() => document.querySelector('{html_widget}').innerHTML.includes('Finished recently')",
        timeout=30_000,
    )
    assert "running</span> <b>0</b>" in page.inner_html(html_widget)
    page.screenshot(path=str(SCREENSHOTS / "dashboard_after_run.png"), full_page=True)

    outputs = page.inner_text(".jp-Notebook")
    for bad in BAD_OUTPUT:
        assert bad not in outputs, f"{bad!r} in the notebook's outputs after the clicks:\n{outputs[:3000]}"


def test_dashboard_renders_in_jupyterlab_and_step_updates_it():
    model = _requirements()
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="mv-browser-"))
    root_dir = workdir / "root"
    root_dir.mkdir()
    shutil.copy(NOTEBOOK, root_dir / NOTEBOOK.name)
    port, token = _free_port(), secrets.token_hex(16)
    # A private settings folder: no "get notified about Jupyter news?" prompt over the page.
    settings_dir = workdir / "settings"
    notification = settings_dir / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True)
    notification.write_text('{"fetchNews": "false"}')
    env = dict(os.environ)
    env.update(
        MINI_VLLM_TEST_MODEL=model,
        JUPYTER_CONFIG_DIR=str(workdir / "config"),  # no user settings, a fresh workspace
        JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(settings_dir),
        JUPYTERLAB_WORKSPACES_DIR=str(workdir / "workspaces"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    jupyter = Path(sys.executable).with_name("jupyter")
    server_log = open(workdir / "server.log", "w")
    server = subprocess.Popen(
        [
            str(jupyter), "lab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
            # Nothing from the network: no news, no update check, no extension catalogue.
            "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False",
        ] + (["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
        cwd=root_dir, env=env, stdout=server_log, stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_server(f"{base}/api/status?token={token}", server)
        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                str(workdir / "chromium-profile"),
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 4000},
            )
            try:
                page = context.pages[0] if context.pages else context.new_page()
                try:
                    _drive(page, base, token)
                except Exception as err:
                    page.screenshot(path=str(SCREENSHOTS / "dashboard_failure.png"), full_page=True)
                    shown = page.inner_text("body")[:4000]
                    raise AssertionError(f"{err}\n--- the page showed (build/screenshots/dashboard_failure.png):\n{shown}") from err
            finally:
                context.close()
    finally:
        _stop(server)
        server_log.close()
        shutil.copy(workdir / "server.log", SCREENSHOTS / "jupyter_server.log")  # for a failed run
        shutil.rmtree(workdir, ignore_errors=True)
