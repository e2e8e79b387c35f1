"""``make lab``: the learner's working copy and the JupyterLab it starts (the browser test drives it for real)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mini_vllm.course import lab
from mini_vllm.course.build import ROOT, WIDGET_VIEW
from jupyterlab_page import lab_test_server

VIEW = {"model_id": "abc", "version_major": 2, "version_minor": 0}


def _course(tmp_path: Path) -> Path:
    for folder in lab.COPIED_FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "01_x.ipynb").write_text(f'{{"from": "{folder}"}}')
    (tmp_path / "notebooks" / "00_welcome.ipynb").write_text('{"shipped": true}')
    return tmp_path


def test_the_working_copy_mirrors_the_folders_and_keeps_the_learners_files(tmp_path):
    root = _course(tmp_path)
    created = lab.prepare_working_copy(root)
    assert sorted(p.relative_to(root).as_posix() for p in created) == [
        "my-course/exercises/01_x.ipynb",
        "my-course/notebooks/00_welcome.ipynb",
        "my-course/notebooks/01_x.ipynb",
        "my-course/solutions/01_x.ipynb",
    ]
    mine = root / lab.START_NOTEBOOK
    mine.write_text('{"my": "work"}')  # the learner's autosave
    (root / "my-course" / "exercises" / "01_x.ipynb").unlink()  # "give me the shipped one back"
    (root / "notebooks" / "02_new.ipynb").write_text("{}")  # a chapter added to the course later
    again = lab.prepare_working_copy(root)
    assert sorted(p.relative_to(root).as_posix() for p in again) == [
        "my-course/exercises/01_x.ipynb",
        "my-course/notebooks/02_new.ipynb",
    ]
    assert mine.read_text() == '{"my": "work"}'  # kept
    assert (root / "notebooks" / "00_welcome.ipynb").read_text() == '{"shipped": true}'  # the shipped one untouched


def test_git_ignores_the_working_copy():
    if not (ROOT / ".git").exists():
        return  # an exported tree: nothing to ask git
    result = subprocess.run(["git", "check-ignore", "-q", f"{lab.WORKING_COPY}/notebooks/00_welcome.ipynb"], cwd=ROOT)
    assert result.returncode == 0, "my-course/ must be in .gitignore"


def test_the_server_serves_the_root_opens_chapter_00_and_saves_through_the_hook(tmp_path):
    command = lab.server_command(tmp_path, ["--port=1234"])
    assert command[1:3] == ["-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={tmp_path}" in command
    assert "--LabApp.default_url=/lab/tree/my-course/notebooks/00_welcome.ipynb" in command
    assert "--ContentsManager.pre_save_hook=mini_vllm.course.lab.pre_save_hook" in command
    assert "--ServerApp.contents_manager_class=mini_vllm.course.lab_contents.CourseContentsManager" in command
    assert command[-1] == "--port=1234"  # the caller's options last: they win
    settings = json.loads((lab.LAB_SETTINGS / "overrides.json").read_text())
    assert settings["@jupyter-widgets/jupyterlab-manager:plugin"]["saveState"] is True


def _notebook(outputs, saved_ids=()):
    metadata = {}
    if saved_ids:
        metadata["widgets"] = {lab.WIDGET_STATE: {"state": {i: {} for i in saved_ids}}}
    return {"metadata": metadata, "cells": [{"cell_type": "code", "outputs": outputs}, {"cell_type": "markdown"}]}


def test_a_saved_notebook_keeps_only_widget_views_it_can_restore():
    live = {
        "output_type": "display_data",
        "data": {WIDGET_VIEW: dict(VIEW), "text/html": "<b>snapshot</b>", "text/plain": "t"},
    }
    bare = {"output_type": "display_data", "data": {WIDGET_VIEW: dict(VIEW, model_id="gone")}}
    text = {"output_type": "stream", "name": "stdout", "text": "hello"}

    restorable = _notebook([json.loads(json.dumps(live)), text], saved_ids=["abc"])
    model = {"type": "notebook", "content": restorable}
    lab.pre_save_hook(model=model, path="x.ipynb", contents_manager=None)
    assert WIDGET_VIEW in restorable["cells"][0]["outputs"][0]["data"]  # its state is saved: it comes back live

    lost = _notebook([json.loads(json.dumps(live)), bare, text])  # no saved state (or a closed widget)
    lab.pre_save_hook(model={"type": "notebook", "content": lost}, path="x.ipynb", contents_manager=None)
    outputs = lost["cells"][0]["outputs"]
    assert [set(o.get("data", {})) for o in outputs] == [{"text/html", "text/plain"}, set()]  # the snapshot stays
    assert outputs[1] == text  # an output that was only a widget view is gone, the rest untouched

    other = {"type": "file", "content": "x"}
    lab.pre_save_hook(model=other, path="x.txt", contents_manager=None)  # not a notebook: untouched
    assert other == {"type": "file", "content": "x"}


# -- the committed notebooks are read-only in make lab's JupyterLab ------------------------------


def _course_with_notebooks(tmp_path: Path) -> Path:
    import nbformat

    root = _course(tmp_path)
    for folder in lab.COPIED_FOLDERS:
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('shipped')")])
        nbformat.write(notebook, root / folder / "01_x.ipynb")
    lab.prepare_working_copy(root)
    return root


def _edited(root: Path, path: str) -> dict:
    """The notebook at ``path`` with a learner's output added: what JupyterLab's autosave sends."""
    notebook = json.loads((root / path).read_text())
    notebook["cells"][0]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "my run\n"}]
    return {"type": "notebook", "format": "json", "content": notebook}


def test_committed_paths_are_the_shipped_folders_only():
    for path in ("notebooks", "notebooks/01_x.ipynb", "/exercises/01_x.ipynb", "solutions/sub/x.py", "./notebooks/x"):
        assert lab.is_committed_path(path), path
    for path in ("", "/", "my-course/notebooks/01_x.ipynb", "notebooks-Copy1/x.ipynb", "README.md", "mini_vllm/x.py"):
        assert not lab.is_committed_path(path), path


def test_the_contents_manager_refuses_saves_to_committed_notebooks_and_keeps_my_course_writable(tmp_path):
    """The real save path of make lab's server (its contents manager and pre-save hook), in process."""
    import asyncio

    from tornado.web import HTTPError

    from mini_vllm.course.lab_contents import CourseContentsManager

    root = _course_with_notebooks(tmp_path)
    manager = CourseContentsManager(root_dir=str(root), pre_save_hook="mini_vllm.course.lab.pre_save_hook")
    shipped = {f: (root / f / "01_x.ipynb").read_bytes() for f in lab.COPIED_FOLDERS}

    async def scenario():
        for folder in lab.COPIED_FOLDERS:
            path = f"{folder}/01_x.ipynb"
            assert (await manager.get(path, content=False))["writable"] is False  # JupyterLab: read-only, no autosave
            try:
                await manager.save(_edited(root, path), path)
            except HTTPError as error:
                assert error.status_code == 403
                assert f"cannot save {path}" in error.log_message and f"my-course/{path}" in error.log_message
            else:
                raise AssertionError(f"saving {path} was not refused")
        # Every other way of writing there is refused too; nothing is created, moved or deleted.
        attempts = [
            manager.new_untitled("notebooks", type="notebook"),
            manager.delete("notebooks/01_x.ipynb"),
            manager.rename("notebooks/01_x.ipynb", "my-course/stolen.ipynb"),
            manager.rename("my-course/notebooks/01_x.ipynb", "notebooks/01_x.ipynb"),
            manager.copy("my-course/notebooks/01_x.ipynb", "notebooks"),
            manager.copy("my-course/notebooks", "solutions"),
        ]
        for attempt in attempts:
            try:
                await attempt
            except HTTPError as error:
                assert error.status_code == 403, error
            else:
                raise AssertionError("a write into a committed folder was not refused")
        # The working copy saves as before (through the same hook).
        mine = "my-course/notebooks/01_x.ipynb"
        assert (await manager.get(mine, content=False))["writable"] is True
        await manager.save(_edited(root, mine), mine)
        assert (await manager.get("my-course", content=False))["writable"] is True

    asyncio.run(scenario())
    assert {f: (root / f / "01_x.ipynb").read_bytes() for f in lab.COPIED_FOLDERS} == shipped
    assert sorted(p.name for p in (root / "notebooks").iterdir()) == ["00_welcome.ipynb", "01_x.ipynb"]
    assert "my run" in (root / "my-course" / "notebooks" / "01_x.ipynb").read_text()


def test_the_pre_save_hook_alone_refuses_committed_paths():
    """Even with Jupyter's stock contents manager, the hook make lab configures rejects the save (a 403)."""
    from tornado.web import HTTPError

    model = {"type": "notebook", "content": {"cells": [], "metadata": {}}}
    try:
        lab.pre_save_hook(model=model, path="solutions/03_x.ipynb", contents_manager=None)
    except HTTPError as error:
        assert error.status_code == 403 and "my-course/solutions/03_x.ipynb" in error.log_message
    else:
        raise AssertionError("the hook let a committed notebook be saved")
    lab.pre_save_hook(model=model, path="my-course/solutions/03_x.ipynb", contents_manager=None)  # fine


def test_make_labs_server_refuses_a_save_to_a_committed_notebook_over_http(tmp_path):
    """The command ``make lab`` runs, over Jupyter's REST API (what JupyterLab's save calls)."""
    import socket
    import time
    import urllib.error
    import urllib.request

    (tmp_path / "course").mkdir()
    root = _course_with_notebooks(tmp_path / "course")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = "course-test"
    command, env = lab_test_server(root, tmp_path / "jupyter", port, token)
    base = f"http://127.0.0.1:{port}/api/contents"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)

    def call(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"{base}/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                call("GET", "")
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.5)
        shipped = (root / "notebooks" / "01_x.ipynb").read_bytes()
        status, listing = call("GET", "notebooks/01_x.ipynb?content=0")
        assert status == 200 and listing["writable"] is False
        status, reply = call("PUT", "notebooks/01_x.ipynb", _edited(root, "notebooks/01_x.ipynb"))
        assert status == 403, reply
        assert "my-course/notebooks/01_x.ipynb" in reply["message"]
        assert (root / "notebooks" / "01_x.ipynb").read_bytes() == shipped
        mine = "my-course/notebooks/01_x.ipynb"
        status, reply = call("PUT", mine, _edited(root, mine))
        assert status == 200, reply
        assert "my run" in (root / mine).read_text()
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
