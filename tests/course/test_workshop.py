"""The workshop kit (workshop/): a JupyterHub for a room, each learner's home laid out as make lab's checkout.

The fast tests read ``workshop/jupyterhub_config.py`` into a traitlets ``Config``
and lay out a learner's home with ``workshop/singleuser.py`` on temporary folders.

The slow one is a small workshop: the hub started as ``make hub`` starts it (the
same config file, on free localhost ports, every folder temporary, a trimmed
course of chapter 00 and exercise 03), three learners who log in with the shared
password in headless Chromium, each landing in their own chapter 00 (its first
cells run: the engine and its live dashboard), then exercise 03, where ada pastes
the solution, bob a typical mistake (an inclusive ``end``) and cy runs the stub;
each runs the check cell, sees its message, and saves. The instructor then grades
the room with ``python -m mini_vllm grade`` on the hub's ``progress/`` folder: one
row per learner, pass / FAIL / not done. Every process the hub started (proxy,
servers, kernels) is found by the test's temporary folder in its environment and
ended by id, whatever happened.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from traitlets.config import Config

from mini_vllm.course import lab
from http_wait import wait_for_http
from jupyterlab_page import VISIBLE, session_kernel, wait_kernel_idle
from prerequisites import CHROMIUM, missing, require_chromium

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "workshop" / "jupyterhub_config.py"
SINGLEUSER = ROOT / "workshop" / "singleuser.py"
PROXY = ROOT / "build" / "node_modules" / ".bin" / "configurable-http-proxy"
SCREENSHOTS = ROOT / "build" / "screenshots"
PASSWORD = "workshop-test-password"
EXERCISE = "03_block_tables.ipynb"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]

# What each learner writes into the exercise's code cell, and what the check then says.
SOLUTION = """def compute_slot_mapping(block_ids, start, end, block_size):
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
"""
INCLUSIVE_END = SOLUTION.replace("range(start, end)", "range(start, end + 1)")
LEARNERS = {
    "ada": (SOLUTION, "agree with the reference", "pass"),
    "bob": (INCLUSIVE_END, "`end` is exclusive", "FAIL"),
    "cy": (None, "NotImplementedError", "not done"),
}


def _load_config(tmp_path: Path, **env: str) -> tuple[Config, dict]:
    values = {"MINI_VLLM_WORKSHOP_DIR": str(tmp_path / "ws"), "MINI_VLLM_WORKSHOP_PASSWORD": PASSWORD, **env}
    config = Config()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in values.items():
            patch.setenv(key, value)
        namespace = runpy.run_path(str(CONFIG), init_globals={"get_config": lambda: config})
    return config, namespace


def _singleuser():
    return runpy.run_path(str(SINGLEUSER))  # its main() runs only as __main__


def _trimmed_course(folder: Path) -> Path:
    """A course of chapter 00 and exercise 03 (and its solution): what an instructor hands out for a short slot."""
    for sub, name in (("notebooks", "00_welcome.ipynb"), ("exercises", EXERCISE), ("solutions", EXERCISE)):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / sub / name, folder / sub / name)
    return folder


# -- the config file and the learner's home ------------------------------------------------------
def test_config_sets_up_the_room(tmp_path):
    config, namespace = _load_config(tmp_path, MINI_VLLM_WORKSHOP_USERS="Ada, bob")
    assert config.JupyterHub.authenticator_class == "shared-password"
    assert config.SharedPasswordAuthenticator.user_password == PASSWORD
    assert config.Authenticator.allowed_users == {"ada", "bob"}
    assert config.JupyterHub.spawner_class == "jupyterhub.spawner.SimpleLocalProcessSpawner"
    assert config.SimpleLocalProcessSpawner.home_dir_template == str(tmp_path / "ws" / "home" / "{username}")
    assert config.Spawner.cmd == [sys.executable, str(SINGLEUSER)]
    assert config.Spawner.default_url == f"/lab/tree/{lab.START_NOTEBOOK}"
    assert namespace["START_NOTEBOOK"] == lab.START_NOTEBOOK
    env = config.Spawner.environment
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["MINI_VLLM_WORKSHOP_PROGRESS"] == str(tmp_path / "ws" / "progress")
    assert str(Path(sys.executable).parent) in env["PATH"].split(os.pathsep)
    assert config.Spawner.mem_limit == "2G" and config.Spawner.cpu_limit == 1


def test_config_refuses_to_start_without_a_password(tmp_path):
    with pytest.raises(SystemExit, match="MINI_VLLM_WORKSHOP_PASSWORD"):
        _load_config(tmp_path, MINI_VLLM_WORKSHOP_PASSWORD="")


def test_a_learner_home_is_make_labs_checkout_and_keeps_their_work(tmp_path):
    prepare = _singleuser()["prepare_learner"]
    course = _trimmed_course(tmp_path / "course")
    home, progress = tmp_path / "home" / "ada", tmp_path / "progress"
    created = prepare(home, "ada", course, progress)
    assert {p.relative_to(home).as_posix() for p in created} == {
        "my-course/notebooks/00_welcome.ipynb",
        f"my-course/exercises/{EXERCISE}",
        f"my-course/solutions/{EXERCISE}",
    }
    for folder in lab.COPIED_FOLDERS:  # the shared course, read-only through the contents manager
        assert (home / folder).is_symlink() and (home / folder).resolve() == course / folder
    assert (home / "my-course" / "parts").is_dir()
    assert (progress / "ada").resolve() == home / "my-course" / "exercises"
    mine = home / "my-course" / "exercises" / EXERCISE
    mine.write_text("my own work")
    assert prepare(home, "ada", course, progress) == []  # the next start copies nothing over it
    assert mine.read_text() == "my own work"


def test_solutions_can_stay_out_of_the_room(tmp_path):
    prepare = _singleuser()["prepare_learner"]
    home = tmp_path / "bob"
    prepare(home, "bob", _trimmed_course(tmp_path / "course"), None, solutions=False)
    assert not (home / "solutions").exists() and not (home / "my-course" / "solutions").exists()


def test_learners_get_make_labs_jupyterlab_options(tmp_path):
    home = tmp_path / "home" / "ada"
    options = _singleuser()["server_options"](home)
    expected = lab.server_command(home)[3:]
    assert [o for o in expected if not o.startswith(("--ServerApp.root_dir=", "--LabApp.default_url="))] == options
    assert any("CourseContentsManager" in o for o in options)
    assert any(o.startswith("--ContentsManager.pre_save_hook=") for o in options)
    assert any(o.startswith("--LabApp.app_settings_dir=") for o in options)


# -- a small workshop in a real browser -----------------------------------------------------------
def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _ensure_proxy() -> None:
    if PROXY.exists():
        return
    if shutil.which("npm") is None:
        missing("npm", "npm is missing: workshop/ensure_proxy.sh installs configurable-http-proxy with it")
    result = subprocess.run(["bash", str(ROOT / "workshop" / "ensure_proxy.sh")], capture_output=True, text=True)
    if result.returncode != 0 or not PROXY.exists():
        missing("npm", f"workshop/ensure_proxy.sh could not install configurable-http-proxy: {result.stderr[-500:]}")


def _processes_of(marker: str) -> list[int]:
    """Every process whose environment names ``marker`` (the test's own temporary folder), but this one."""
    needle = marker.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _memory_report(pids: list[int]) -> list[dict]:
    """What each of the workshop's processes is and its peak resident memory (VmHWM), for the guide's sizing."""
    rows = []
    for pid in pids:
        try:
            command = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")).decode(errors="replace")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        peak = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
        kind = next(
            (
                k
                for k, m in (
                    ("kernel", "ipykernel"),
                    ("server", "singleuser.py"),
                    ("proxy", "configurable-http-proxy"),
                    ("hub", "jupyterhub_config"),
                )
                if m in command
            ),
            "other",
        )
        rows.append({"pid": pid, "kind": kind, "peak_rss_mb": round(peak / 1024), "command": command[:160]})
    return rows


def _end_processes(pids: list[int], timeout: float = 20.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.3)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_cell_until(page, index: int, expected: str, attempts: int = 3) -> None:
    """Run code cell ``index`` until its output shows ``expected``: on a loaded machine a kernel that
    has just started can drop the first request, and the next cell must not run without this one."""
    cell = page.locator(f"{VISIBLE} .jp-CodeCell").nth(index)
    for _ in range(attempts):
        _run_cell(page, index)
        if expected in cell.locator(".jp-OutputArea").inner_text():
            return
        wait_kernel_idle(page, timeout=240.0)
    raise AssertionError(f"cell {index} never printed {expected!r}: {cell.inner_text()[-2000:]}")


def _run_cell(page, index: int, timeout: float = 240_000, attempts: int = 3) -> None:
    """Select code cell ``index``, Shift+Enter, wait until its prompt shows a new number (retried once
    if the keypress ran nothing: a kernel can report idle a moment before it takes requests)."""
    cell = page.locator(f"{VISIBLE} .jp-CodeCell").nth(index)
    before = cell.locator(".jp-InputPrompt").inner_text()
    for attempt in range(attempts):
        cell.locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(
                f"([i, before]) => {{ const c = document.querySelectorAll('{VISIBLE} .jp-CodeCell')[i];"
                " const t = c.querySelector('.jp-InputPrompt').textContent; return /\\[(\\*|\\d+)\\]/.test(t) && t !== before; }",
                arg=[index, before],
                timeout=20_000,
            )
            break
        except Exception:  # playwright's TimeoutError: the cell did not start
            if attempt == attempts - 1:
                raise
    page.wait_for_function(
        f"(i) => /\\[\\d+\\]/.test(document.querySelectorAll('{VISIBLE} .jp-CodeCell')[i]"
        ".querySelector('.jp-InputPrompt').textContent)",
        arg=index,
        timeout=timeout,
    )


def _type_into_cell(page, index: int, source: str) -> None:
    """Replace code cell ``index``'s text, as a paste does (no auto-indent, no closing brackets added)."""
    editor = page.locator(f"{VISIBLE} .jp-CodeCell").nth(index).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(source)
    assert editor.inner_text().strip() == source.strip(), editor.inner_text()


def _save(page, path: Path) -> None:
    before = path.stat().st_mtime_ns
    page.click(f"{VISIBLE} .jp-Notebook")
    page.click(".lm-MenuBar-item:has-text('File')")
    page.click(".lm-Menu-itemLabel:text-matches('^Save( Notebook)?$')")
    deadline = time.monotonic() + 60
    while path.stat().st_mtime_ns == before:
        assert time.monotonic() < deadline, f"File > Save did not write {path}"
        time.sleep(0.3)
    time.sleep(1)


def _put_status(page, name: str, path: str) -> tuple[int, str]:
    """PUT a notebook through the learner's contents API, as an autosave does: (status, message)."""
    return tuple(
        page.evaluate(
            """async ([name, path]) => {
                const xsrf = decodeURIComponent((document.cookie.match(/_xsrf=([^;]+)/) || [])[1] || "");
                const r = await fetch(`/user/${name}/api/contents/${path}`, {method: "PUT",
                    headers: {"X-XSRFToken": xsrf, "Content-Type": "application/json"},
                    body: JSON.stringify({type: "file", format: "text", content: "overwritten"})});
                return [r.status, await r.text()];
            }""",
            [name, path],
        )
    )


def _dialogs(page) -> list[str]:
    """The text of every JupyterLab dialog on the page (a "file changed on disk" one eats keystrokes)."""
    return [text[:300] for text in page.locator(".jp-Dialog").all_inner_texts()]


def _kernel_history(log_path: Path, name: str) -> str:
    """The hub log's lines on kernels and ``name``'s sessions: what replaced a kernel, if one was replaced."""
    marks = ("Kernel started", "Kernel shutdown", "Kernel restarted", "restarting kernel", "died", "Starting buffering")
    lines = [
        line[:220]
        for line in log_path.read_text(errors="replace").splitlines()
        if any(m in line for m in marks) or (f"/user/{name}/api/sessions" in line and " GET " not in line)
    ]
    return "\n".join(lines[-20:])


def _learner(page, base: str, name: str, home: Path, log_path: Path) -> None:
    source, says, _ = LEARNERS[name]
    # Logged in: the hub started their server, which opened their own chapter 00.
    page.wait_for_url(f"**/user/{name}/lab/**", timeout=300_000)
    page.wait_for_selector(f"{VISIBLE} .jp-Notebook .jp-Cell", timeout=180_000)
    assert page.url.split("?")[0].endswith(f"/user/{name}/lab/tree/{lab.START_NOTEBOOK}")
    kernel = wait_kernel_idle(page, timeout=240.0, path=lab.START_NOTEBOOK)
    for attempt in range(2):
        _run_cell_until(page, 0, "system prompt 0")  # an engine on the bundled model
        _run_cell(page, 1)  # its live dashboard
        dashboard_output = page.locator(f"{VISIBLE} .jp-CodeCell").nth(1).locator(".jp-OutputArea").inner_text()
        if "NameError" not in dashboard_output or attempt:
            break
        # The dashboard ran in a kernel without the engine: JupyterLab replaced the notebook's kernel
        # between the two cells (seen once under CI's load, at a kernel's start). A learner runs the
        # first cell again; so does the test, once, and says so with what the server logged.
        warnings.warn(
            f"{name}: chapter 00's kernel changed between its first two cells (started as {kernel}, now "
            f"{session_kernel(page, lab.START_NOTEBOOK)}); ran them again. The hub log:\n"
            f"{_kernel_history(log_path, name)}",
            stacklevel=1,
        )
        kernel = wait_kernel_idle(page, timeout=240.0, path=lab.START_NOTEBOOK)
    page.wait_for_selector(f"{VISIBLE} .mv-dashboard", timeout=120_000)
    assert "Traceback" not in page.inner_text(f"{VISIBLE} .jp-Notebook")
    page.screenshot(path=str(SCREENSHOTS / f"workshop_{name}_00.png"))

    # The shared course is read-only (make lab's contents manager); their copy is not.
    status, message = _put_status(page, name, "notebooks/scratch.txt")
    assert status == 403 and "my-course/notebooks/scratch.txt" in message, (status, message[:500])
    status, _ = _put_status(page, name, "my-course/scratch.txt")
    assert status in (200, 201), status
    assert (home / "my-course" / "scratch.txt").read_text() == "overwritten"

    # Exercise 03: write an answer (or not), run the check, read its message, save.
    page.goto(f"{base}/user/{name}/lab/tree/my-course/exercises/{EXERCISE}", wait_until="domcontentloaded")
    page.wait_for_selector(f"{VISIBLE} .jp-Notebook .jp-Cell", timeout=180_000)
    page.wait_for_function(
        f"() => document.querySelector('{VISIBLE} .jp-Notebook').textContent.includes('slot_mapping')", timeout=60_000
    )
    wait_kernel_idle(page, timeout=240.0, path=f"my-course/exercises/{EXERCISE}")
    if source is not None:
        _type_into_cell(page, 1, source)
    for index in range(3):  # the imports, the function, the check cell
        _run_cell(page, index)
    check = page.locator(f"{VISIBLE} .jp-CodeCell").nth(2)
    assert check.locator(".jp-InputArea-editor").inner_text().strip().startswith("check_slot_mapping")
    page.wait_for_function(
        f"(text) => document.querySelectorAll('{VISIBLE} .jp-CodeCell')[2].textContent.includes(text)",
        arg=says,
        timeout=60_000,
    )
    page.screenshot(path=str(SCREENSHOTS / f"workshop_{name}_exercise.png"))
    _save(page, home / "my-course" / "exercises" / EXERCISE)


@pytest.mark.slow
def test_three_learners_on_the_hub_and_the_instructor_grades_them():
    require_chromium()
    pytest.importorskip("jupyterhub", reason="pip install -e '.[workshop]' (make hub installs it)")
    _ensure_proxy()
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="mv-workshop-"))
    try:
        _workshop_then_grade(workdir, sync_playwright)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _workshop_then_grade(workdir: Path, sync_playwright) -> None:
    course = _trimmed_course(workdir / "course")
    ws = workdir / "ws"
    public, hub_api, proxy_api = _free_ports(3)
    base = f"http://127.0.0.1:{public}"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MINI_VLLM_WORKSHOP_DIR=str(ws),
        MINI_VLLM_WORKSHOP_COURSE=str(course),
        MINI_VLLM_WORKSHOP_PASSWORD=PASSWORD,
        MINI_VLLM_WORKSHOP_URL=base,
        MINI_VLLM_WORKSHOP_SOLUTIONS="no",
    )
    command = [
        sys.executable,
        "-m",
        "jupyterhub",
        "-f",
        str(CONFIG),
        f"--JupyterHub.hub_port={hub_api}",
        f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{proxy_api}",
    ]
    log_path = workdir / "hub.log"
    log = open(log_path, "w")
    hub = subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_http(f"{base}/hub/api", hub, "the hub", timeout=180.0, log=log_path)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                pages = {}
                for name in LEARNERS:  # the room logs in at once: three servers start side by side
                    page = browser.new_context(viewport={"width": 1400, "height": 1800}).new_page()
                    page.set_default_timeout(60_000)
                    page.on("dialog", lambda dialog: dialog.accept())  # "leave the page?" when a notebook is unsaved
                    page.goto(f"{base}/hub/login", wait_until="domcontentloaded")
                    page.fill("#username_input", name)
                    page.fill("#password_input", PASSWORD)
                    page.click("#login_submit")
                    pages[name] = page
                for name, page in pages.items():
                    try:
                        _learner(page, base, name, ws / "home" / name, log_path)
                    except Exception as err:
                        page.screenshot(path=str(SCREENSHOTS / "workshop_failure.png"), full_page=True)
                        raise AssertionError(
                            f"{name}: {err}\n--- JupyterLab dialogs open: {_dialogs(page)!r}"
                            f"\n--- the page showed:\n{page.inner_text('body')[:3000]}"
                            f"\n--- the hub log on kernels and {name}'s sessions:\n{_kernel_history(log_path, name)}"
                        ) from err
            finally:
                browser.close()
        homes = ws / "home"
        assert sorted(p.name for p in homes.iterdir()) == sorted(LEARNERS)
        assert not (homes / "ada" / "solutions").exists()  # MINI_VLLM_WORKSHOP_SOLUTIONS=no
        assert list((homes / "ada" / "my-course" / "parts").glob("*slot_mapping*")), "ada's part was not kept"
        assert not list((homes / "bob" / "my-course" / "parts").glob("*slot_mapping*"))
        saved = json.loads((homes / "ada" / "my-course" / "exercises" / EXERCISE).read_text())
        assert "range(start, end)" in "".join(saved["cells"][3]["source"])
        # Every process of the room and its peak memory, for workshop/README.md's sizing (not asserted).
        report = _memory_report(_processes_of(str(workdir)))
        (SCREENSHOTS / "workshop_processes.json").write_text(json.dumps(report, indent=1) + "\n")
    finally:
        if hub.poll() is None:
            hub.send_signal(signal.SIGTERM)  # the hub stops every learner's server and the proxy
            try:
                hub.wait(timeout=60)
            except subprocess.TimeoutExpired:
                hub.kill()
                hub.wait(timeout=10)
        _end_processes(_processes_of(str(workdir)))  # whatever is left: servers, kernels, the proxy
        log.close()
        shutil.copy(log_path, SCREENSHOTS / "workshop_hub.log")

    assert not _processes_of(str(workdir)), "processes of the workshop are still running"
    # The instructor: make grade DIR=<workshop>/progress
    grade = subprocess.run(
        [sys.executable, "-m", "mini_vllm", "grade", str(ws / "progress"), "--timeout", "300"],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    table = grade.stdout
    assert grade.returncode == 0, grade.stderr[-3000:]
    for name, (_, _, status) in LEARNERS.items():
        lines = table.split(f"{name}: ", 1)[1].splitlines()
        passed = 1 if status == "pass" else 0
        assert lines[0] == f"{passed} of 1 checks pass", table
        assert EXERCISE in lines[1] and "check_slot_mapping" in lines[1] and f" {status} " in lines[1] + " ", table
    assert "compute_slot_mapping: a prefill" in table.split("bob: ", 1)[1].splitlines()[1], table  # the first line
