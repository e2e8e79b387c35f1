"""A learner's first hour, in a real browser: ``make lab``'s server, chapter 00, the buttons, an exercise.

Headless Chromium drives JupyterLab exactly as ``make lab`` starts it
(``mini_vllm.course.lab.server_command``: the same options, on a free
localhost port, without a token), on a temporary copy of the course:

1. the root address opens chapter 00 of the learner's working copy, and the
   file browser shows every folder; chapter 00 is opened from the file browser;
2. Run All: no traceback, no error output, no "Error displaying widget", and
   the live dashboard is still there at the end;
3. Step, Run and Reset on the idle dashboard, then the following cells again
   with a Step and a Run pressed in between (once an IndexError);
4. save and reload: the widget comes back (live or static), never an error;
   with the kernel shut down, the saved notebook shows the static snapshot;
5. an exercise opened from the file browser runs to its first check, which
   fails with the stub's NotImplementedError and nothing else;
6. the learner pastes their answers into exercises 02 and 03 (the solutions'
   code, typed into the stubs' cells) and runs them: both checks pass, each
   part is kept (the exercise says how many parts are theirs and shows the
   engine's code next to theirs); then chapter 08's dashboard, in a new
   kernel, names the two parts as theirs.

The committed notebooks are never touched (checked). Screenshots:
``build/screenshots/learner_*.png``. Needs Debian's Chromium at
/usr/bin/chromium (``scripts/ensure_chromium.sh``) and Playwright for Python
(never its own browser download); skipped with the reason otherwise, and failed
under CI (``CI=true``, tests/prerequisites.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mini_vllm.course import lab
from http_wait import wait_for_http
from jupyterlab_page import accept_kernel_dialog, lab_test_server, wait_kernel_idle
from prerequisites import CHROMIUM, require_chromium

ROOT = Path(__file__).resolve().parents[2]
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
# What must never show on the page (the exercise's own NotImplementedError is checked apart).
BAD_OUTPUT = ("Loading widget", "Error displaying widget", "model not found", "Traceback", "Error:")
EXERCISE = "02_paged_pool.ipynb"
VISIBLE = ".jp-NotebookPanel:not(.lm-mod-hidden)"
WIDGET_HTML = ".mv-dashboard-widget .widget-html-content"

pytestmark = pytest.mark.slow


def _requirements() -> None:
    require_chromium()  # a skip, or a failure under CI (tests/prerequisites.py)
    from mini_vllm import default_model_path

    if not Path(default_model_path(), "config.json").exists():
        pytest.skip("the default model is not there")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fingerprint(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in lab.COPIED_FOLDERS
        for p in sorted((root / folder).glob("*.ipynb"))
    }


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _redirect_target(url: str) -> str:
    try:
        urllib.request.build_opener(_NoRedirect).open(url, timeout=10)
    except urllib.error.HTTPError as err:
        return err.headers.get("Location", "")
    return ""


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


# -- page helpers -----------------------------------------------------------------
def _check_page(page, when: str) -> None:
    text = page.inner_text(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
    for bad in BAD_OUTPUT:
        assert bad not in text, f"{bad!r} on the page {when}:\n{text[:4000]}"
    errors = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) [data-mime-type='application/vnd.jupyter.stderr']")
    assert errors.count() == 0, f"error output {when}: {errors.first.inner_text()[:2000]}"


def _wait_all_run(page, timeout: float = 240_000) -> None:
    """Every code cell has a number in its prompt, none is queued or running."""
    page.wait_for_function(
        "() => { const p = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')];"
        " return p.length > 0 && p.every(e => /\\[\\d+\\]/.test(e.textContent)); }",
        timeout=timeout,
    )


def _menu(page, menu: str, item: str) -> None:
    page.click(f".lm-MenuBar-item:has-text('{menu}')")
    page.click(f".lm-Menu-itemLabel:text-is('{item}')")


def _clear_outputs(page) -> None:
    """Edit > Clear Outputs of All Cells: no prompt has a number (a shipped chapter's have)."""
    accept_kernel_dialog(page)
    page.click(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
    page.click(".lm-MenuBar-item:has-text('Edit')")
    page.click(".lm-Menu-itemLabel:text-matches('^Clear (Outputs of All Cells|All Outputs)$')")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]"
        ".every(e => !/\\d/.test(e.textContent))",
        timeout=10_000,
    )


def _run_all(page, attempts: int = 4) -> None:
    """Edit > Clear Outputs of All Cells, then Run > Run All Cells, until the first cell really runs.

    Clearing first makes "the first cell ran" visible (the shipped notebook's
    prompts already have numbers). A status bar can say "Idle" a moment before
    the kernel is attached; Run All issued then runs nothing. So: click, check, retry.
    """
    started = (
        "() => { const p = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt');"
        " return !!p && /\\[(\\*|\\d+)\\]/.test(p.textContent); }"
    )
    for _ in range(attempts):
        _clear_outputs(page)
        _menu(page, "Run", "Run All Cells")
        try:
            page.wait_for_function(started, timeout=15_000)
            return
        except Exception:  # playwright's TimeoutError: not started yet, try again
            continue
    raise AssertionError(f"Run All Cells did not start the first cell in {attempts} tries")


def _run_cell(page, index: int, timeout: float = 120_000) -> None:
    """Select code cell ``index`` (0-based), Shift+Enter, wait until it has run."""
    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").nth(index)
    before = cell.locator(".jp-InputPrompt").inner_text()
    cell.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        "([i, before]) => { const c = document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')[i];"
        " const t = c.querySelector('.jp-InputPrompt').textContent; return /\\[\\d+\\]/.test(t) && t !== before; }",
        arg=[index, before],
        timeout=timeout,
    )


def _press(page, button: str, expect: str, timeout: float = 60_000) -> None:
    """Click a dashboard button once the last click is done, and wait for the message it produces.

    ``expect`` must be a message the previous press could not have left (so the wait is
    for this click): a click that lands while the kernel still handles the last one can
    hit a button the kernel has just disabled, and the browser drops it.
    """
    buttons = ".mv-dashboard-widget button"
    page.wait_for_function(
        "(sel) => { const b = [...document.querySelectorAll(sel)]; return b.length > 0 && b.every(x => !x.disabled); }",
        arg=buttons,
        timeout=timeout,
    )
    wait_kernel_idle(page, timeout=timeout / 1000)
    page.click(f"{buttons}:has-text('{button}')")
    page.wait_for_function(
        "([sel, text]) => { const w = document.querySelector(sel); return !!w &&"
        " w.querySelector('.mv-message').textContent.includes(text); }",
        arg=[WIDGET_HTML, expect],
        timeout=timeout,
    )


def _listing_item(page, name: str):
    """The file browser's row for ``name`` (exactly that name) in the folder it shows."""
    return page.locator(".jp-DirListing-item").filter(has=page.get_by_text(name, exact=True)).first


def _open_from_file_browser(page, *names: str) -> None:
    """Double-click through the file browser from its root: folder, folder, ..., file."""
    for _ in range(4):  # a click while the listing refreshes can be lost: click again
        page.click(".jp-BreadCrumbs-home")
        try:
            _listing_item(page, "my-course").wait_for(timeout=8_000)  # at the root
            break
        except Exception:  # playwright's TimeoutError
            continue
    else:
        raise AssertionError("the file browser did not go back to the course's root")
    for name, following in zip(names, names[1:] + (None,)):
        _listing_item(page, name).wait_for(timeout=30_000)
        _listing_item(page, name).dblclick()
        if following is None:
            break
        # The listing is re-drawn for the new folder: wait for it (the folder's own row gone,
        # the next one there), or the next double-click hits a stale row.
        page.wait_for_function(
            "([gone, there]) => { const names = [...document.querySelectorAll('.jp-DirListing-itemText')]"
            ".map(e => e.textContent.trim()); return !names.includes(gone) && names.includes(there); }",
            arg=[name, following],
            timeout=30_000,
        )
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell", timeout=60_000)


def _shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"learner_{name}.png"), full_page=True)


def _learner_path(page, base: str, root: Path) -> None:
    # 1. The root address lands in chapter 00 of the working copy; the file browser shows every folder.
    page.goto(f"{base}/lab", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-DirListing-content", timeout=60_000)
    page.click(".jp-BreadCrumbs-home")
    for folder in ("exercises", "my-course", "notebooks", "solutions"):
        _listing_item(page, folder).wait_for(timeout=30_000)
    _open_from_file_browser(page, "my-course", "notebooks", "00_welcome.ipynb")
    wait_kernel_idle(page, timeout=90.0, path="my-course/notebooks/00_welcome.ipynb")

    # 2. Run All: every cell runs, nothing fails, the live dashboard is there at the end.
    _run_all(page)
    _wait_all_run(page)
    page.wait_for_selector(f"{WIDGET_HTML} .mv-dashboard", timeout=60_000)
    _check_page(page, "after Run All")
    _shot(page, "00_after_run_all")

    # 3. Every button on the idle engine, in any order; then the following cells again.
    _press(page, "Step", "no request to step")
    _press(page, "Run", "nothing to run")
    _press(page, "Reset cache", "Prefix cache reset")
    _run_cell(page, 4)  # queue the fifth request and step once
    assert "Step" in page.inner_text(f"{WIDGET_HTML} .mv-message")
    _press(page, "Step", "computed")  # a decode step, pressed by the learner
    _press(page, "Run", "finished")
    assert "Finished recently" in page.inner_text(WIDGET_HTML)
    _run_cell(page, 5)  # reads the finished request (was: IndexError after a Run click)
    _run_cell(page, 6)
    _check_page(page, "after the buttons and the cells run again")
    page.locator(".mv-dashboard-widget").screenshot(path=str(SCREENSHOTS / "learner_00_dashboard.png"))

    # The dashboard on a 1280x800 laptop screen: buttons and header in view with the views below.
    page.set_viewport_size({"width": 1280, "height": 800})
    page.locator(".mv-dashboard-widget").scroll_into_view_if_needed()
    height = page.locator(".mv-dashboard-widget").bounding_box()["height"]
    assert height < 720, f"the dashboard is {height:.0f} px tall: its buttons scroll away on a 1280x800 screen"
    page.screenshot(path=str(SCREENSHOTS / "learner_00_dashboard_1280x800.png"))
    page.set_viewport_size({"width": 1400, "height": 4000})

    # 4. Save, reload: the widget is restored (live or as its saved state), never an error.
    saved_file = root / lab.START_NOTEBOOK
    before_save = saved_file.stat().st_mtime_ns
    page.click(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
    page.click(".lm-MenuBar-item:has-text('File')")
    page.click(".lm-Menu-itemLabel:text-matches('^Save( Notebook)?$')")
    deadline = time.monotonic() + 30
    while saved_file.stat().st_mtime_ns == before_save:
        assert time.monotonic() < deadline, "File > Save did not write the notebook"
        time.sleep(0.2)
    time.sleep(1)  # the rest of the write
    saved = json.loads(saved_file.read_text())
    assert saved["cells"][4]["outputs"], "the saved dashboard cell is empty"
    page.reload(wait_until="domcontentloaded")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell", timeout=60_000)
    wait_kernel_idle(page, timeout=90.0)
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .mv-dashboard", timeout=60_000)
    page.wait_for_timeout(3000)  # a widget that cannot be restored says so within ~2 s
    _check_page(page, "after save and reload")
    _shot(page, "00_after_reload")

    # 5. An exercise from the file browser, run to its first check.
    _open_from_file_browser(page, "my-course", "exercises", EXERCISE)
    wait_kernel_idle(page, timeout=90.0)
    _run_all(page)
    page.wait_for_selector(
        ".jp-NotebookPanel:not(.lm-mod-hidden) [data-mime-type='application/vnd.jupyter.stderr']", timeout=120_000
    )
    page.wait_for_timeout(1000)
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")
    errors = [
        i
        for i in range(cells.count())
        if cells.nth(i).locator("[data-mime-type='application/vnd.jupyter.stderr']").count()
    ]
    assert len(errors) == 1, f"error outputs in code cells {errors}"
    failed = cells.nth(errors[0])
    assert failed.locator(".jp-InputArea-editor").inner_text().strip().startswith("check_")  # the first check cell
    message = failed.locator("[data-mime-type='application/vnd.jupyter.stderr']").inner_text()
    # The untouched stub is one line that says so (not a traceback through the check's harness).
    assert message.startswith("not written yet:") and "NotImplementedError" in message, message[:2000]
    assert "Traceback" not in message and len(message.strip().splitlines()) <= 2, message[:2000]
    for i in range(errors[0]):
        assert re.search(r"\[\d+\]", cells.nth(i).locator(".jp-InputPrompt").inner_text()), f"cell {i} did not run"
    assert "Error displaying widget" not in page.inner_text(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
    _shot(page, "exercise_first_check")

    # 6. The learner passes exercises 02 and 03; a later chapter's engine runs their parts and says so.
    _pass_exercise(page, EXERCISE, "class FreeKVCacheBlockQueue", parts_yours=1)
    _pass_exercise(page, "03_block_tables.ipynb", "def compute_slot_mapping", parts_yours=2)
    _open_from_file_browser(page, "my-course", "notebooks", "08_engine.ipynb")
    wait_kernel_idle(page, timeout=90.0, path="my-course/notebooks/08_engine.ipynb")
    chapter = json.loads((root / "my-course" / "notebooks" / "08_engine.ipynb").read_text())
    sources = ["".join(c["source"]) for c in chapter["cells"] if c["cell_type"] == "code"]
    dashboard_cell = next(i for i, source in enumerate(sources) if "EngineDashboard(dash_llm" in source)
    _clear_outputs(page)  # the shipped chapter's prompts have numbers: a new one shows the cell ran
    _run_cell(page, 0)  # the chapter's set-up
    page.locator(f"{VISIBLE} .jp-CodeCell").nth(dashboard_cell).scroll_into_view_if_needed()
    _run_cell(page, dashboard_cell)
    parts_line = f"{VISIBLE} {WIDGET_HTML} .mv-parts"
    page.wait_for_selector(parts_line, timeout=60_000)
    assert page.inner_text(parts_line).startswith("your parts (2 of 13): free_queue, slot_mapping"), page.inner_text(
        parts_line
    )
    _check_page(page, "in chapter 08 with the learner's parts")
    page.locator(f"{VISIBLE} .mv-dashboard-widget").screenshot(path=str(SCREENSHOTS / "learner_08_your_parts.png"))


def _solution_code(name: str) -> str:
    """What a learner who got exercise ``name`` right writes: the solution's cell that the exercise stubs."""
    notebook = json.loads((ROOT / "solutions" / name).read_text())
    [source] = ["".join(c["source"]) for c in notebook["cells"] if "### BEGIN SOLUTION" in "".join(c["source"])]
    return source


def _paste_into_cell(page, marker: str, text: str) -> None:
    """Replace the text of the code cell whose source contains ``marker`` with ``text`` (select all, paste)."""
    page.wait_for_function(  # a notebook just opened draws its editors a moment after its cells
        "([sel, marker]) => [...document.querySelectorAll(sel)].some(e => e.textContent.includes(marker))",
        arg=[f"{VISIBLE} .jp-CodeCell .cm-content", marker],
        timeout=30_000,
    )
    cells = page.locator(f"{VISIBLE} .jp-CodeCell")
    for index in range(cells.count()):
        editor = cells.nth(index).locator(".cm-content")
        if marker in editor.inner_text():
            editor.click()
            page.keyboard.press("Control+a")
            page.keyboard.insert_text(text)
            typed = cells.nth(index).locator(".cm-content").inner_text()
            assert "### END SOLUTION" in typed and "NotImplementedError" not in typed, typed[:2000]
            return
    raise AssertionError(f"no code cell with {marker!r} in the exercise")


def _pass_exercise(page, name: str, marker: str, parts_yours: int) -> None:
    """Open exercise ``name``, paste the right answer over its stub, Run All: its check passes, the part is kept."""
    _open_from_file_browser(page, "my-course", "exercises", name)
    wait_kernel_idle(page, timeout=90.0, path=f"my-course/exercises/{name}")
    _paste_into_cell(page, marker, _solution_code(name))
    _run_all(page)
    _wait_all_run(page)
    _check_page(page, f"after passing {name}")
    text = page.inner_text(f"{VISIBLE} .jp-Notebook")  # the end of the notebook (cells far above are not drawn)
    assert f"{parts_yours} of 13 parts are yours" in text, text[-4000:]
    # The engine's own code shows next to the learner's only once the part is kept (the check passed).
    assert page.locator(f"{VISIBLE} .mv-side-by-side").count() == 1, text[-4000:]
    _shot(page, f"exercise_{name.split('_')[0]}_passed")


def _static_after_the_kernel_is_gone(page, base: str) -> None:
    """Shut every kernel down, reopen chapter 00: the saved dashboard shows as its static snapshot."""
    stopped = page.evaluate(
        """async () => {
            const xsrf = decodeURIComponent((document.cookie.match(/_xsrf=([^;]+)/) || [])[1] || "");
            const kernels = await (await fetch("/api/kernels")).json();
            for (const k of kernels) {
                await fetch("/api/kernels/" + k.id, {method: "DELETE", headers: {"X-XSRFToken": xsrf}});
            }
            return (await (await fetch("/api/kernels")).json()).length === 0 ? kernels.length : -1;
        }"""
    )
    assert stopped >= 1, f"could not shut the kernels down ({stopped})"
    page.goto(f"{base}/lab/tree/{lab.START_NOTEBOOK}", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .mv-dashboard", timeout=60_000)
    page.wait_for_timeout(4000)
    _check_page(page, "after reopening with a new kernel")
    _shot(page, "00_reopened_new_kernel")


def test_a_learner_goes_through_chapter_00_and_an_exercise():
    _requirements()
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    committed = _fingerprint(ROOT)
    workdir = Path(tempfile.mkdtemp(prefix="mv-learner-"))
    root = workdir / "course"
    for folder in lab.COPIED_FOLDERS:  # a checkout of the course's notebooks
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    created = lab.prepare_working_copy(root)  # what `make lab` does first
    assert root / lab.START_NOTEBOOK in created
    port = _free_port()
    command, env = lab_test_server(root, workdir, port)
    env["MINI_VLLM_PARTS"] = str(workdir / "parts")  # the parts this learner keeps, and only theirs
    server_log = open(workdir / "server.log", "w")
    server = subprocess.Popen(command, cwd=root, env=env, stdout=server_log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_http(f"{base}/api/status", server, "jupyter lab", timeout=90.0)
        assert (
            _redirect_target(f"{base}/").rstrip("?").endswith(f"/lab/tree/{lab.START_NOTEBOOK}")
        )  # the printed address
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
                    _learner_path(page, base, root)
                    _static_after_the_kernel_is_gone(page, base)
                except Exception as err:
                    page.screenshot(path=str(SCREENSHOTS / "learner_failure.png"), full_page=True)
                    shown = page.inner_text("body")[:4000]
                    raise AssertionError(
                        f"{err}\n--- the page showed (build/screenshots/learner_failure.png):\n{shown}"
                    ) from err
            finally:
                context.close()
    finally:
        _stop(server)
        server_log.close()
        shutil.copy(workdir / "server.log", SCREENSHOTS / "learner_jupyter_server.log")  # for a failed run
        shutil.rmtree(workdir, ignore_errors=True)
    assert _fingerprint(ROOT) == committed, "the committed notebooks changed"
