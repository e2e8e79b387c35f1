"""``make lab``: the learner's working copy and the JupyterLab it starts (the browser test drives it for real)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mini_vllm.course import lab
from mini_vllm.course.build import ROOT, WIDGET_VIEW

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
