"""``make lab``: the learner's own copy of the course, opened in JupyterLab.

The committed notebooks (``notebooks/``, ``exercises/``, ``solutions/``) are
the course as shipped, and ``make test`` checks their outputs with strict
nbval. A learner's run, saved by JupyterLab's autosave, must never land in
them. So ``python -m mini_vllm.course.lab`` (what ``make lab`` runs):

1. copies every chapter, exercise and solution into ``my-course/`` (ignored
   by git) with the same folder names, so links between them and relative
   paths work the same. A file that is already there is never overwritten:
   your work is kept from one session to the next, and a chapter added to the
   course later is copied in the next time. Delete a file from ``my-course/``
   to get the shipped version back;
2. starts JupyterLab on the repository root, so every folder is in the file
   browser, and opens ``my-course/notebooks/00_welcome.ipynb`` (the address it
   prints opens it too);
3. saves notebooks through ``pre_save_hook``: a live widget whose state is not
   saved with the notebook is saved as the static HTML snapshot every widget
   of ``mini_vllm.viz`` carries, so a reopened notebook shows that snapshot
   instead of "Error displaying widget". The settings in ``lab_settings/``
   have JupyterLab save the widgets' state (``saveState``), so a widget whose
   kernel is still running comes back live after a reload;
4. keeps the committed folders read-only (``CourseContentsManager`` in
   ``lab_contents.py``): a notebook opened from ``notebooks/``, ``exercises/``
   or ``solutions/`` shows JupyterLab's read-only badge and is never autosaved
   (its cells still run), and a save, rename or delete there is refused with a
   message that points to the same file in ``my-course/``. So a session can
   never leave a committed notebook changed, and ``make test`` still passes.

``server_command()`` is the whole command line; the browser test starts its
server with it too.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from .build import ROOT, WIDGET_VIEW

WORKING_COPY = "my-course"
COPIED_FOLDERS = ("notebooks", "exercises", "solutions")
START_NOTEBOOK = f"{WORKING_COPY}/notebooks/00_welcome.ipynb"
LAB_SETTINGS = Path(__file__).with_name("lab_settings")
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def prepare_working_copy(root: Path = ROOT) -> list[Path]:
    """Copy the course's notebooks into ``root/my-course/`` where they are missing; returns the new files."""
    created = []
    for folder in COPIED_FOLDERS:
        for source in sorted((root / folder).glob("*.ipynb")):
            target = root / WORKING_COPY / folder / source.name
            if target.exists():
                continue  # the learner's version wins
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            created.append(target)
    return created


def server_command(root: Path = ROOT, extra_args: Sequence[str] = ()) -> list[str]:
    """The ``jupyter lab`` command line ``make lab`` runs (``extra_args`` go last and win)."""
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.default_url=/lab/tree/{START_NOTEBOOK}",
        "--ServerApp.contents_manager_class=mini_vllm.course.lab_contents.CourseContentsManager",
        "--ContentsManager.pre_save_hook=mini_vllm.course.lab.pre_save_hook",
        f"--LabApp.app_settings_dir={LAB_SETTINGS}",
        # Nothing from the network: no news, no update check, no extension catalogue.
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # Jupyter refuses root otherwise (containers)
    return command + list(extra_args)


def is_committed_path(path: str) -> bool:
    """Whether an API path (relative to the served root) lies in a committed folder: ``notebooks/...`` etc."""
    parts = [part for part in path.replace("\\", "/").split("/") if part not in ("", ".")]
    return bool(parts) and parts[0] in COPIED_FOLDERS


def refuse_committed_path(path: str, action: str = "save") -> None:
    """HTTP 403, which JupyterLab shows the learner, for a change to a committed notebook; nothing otherwise."""
    if not is_committed_path(path):
        return
    from tornado.web import HTTPError  # Jupyter's own error type: only imported inside a Jupyter server

    path = "/".join(part for part in path.replace("\\", "/").split("/") if part not in ("", "."))
    raise HTTPError(
        403,
        f"cannot {action} {path}: {path.split('/')[0]}/ holds the course as shipped, which is read-only here "
        f"(make test checks it). Work in your own copy, {WORKING_COPY}/{path} ('Save as...' there to keep these edits).",
    )


def saved_widget_ids(notebook: dict) -> set[str]:
    """The ids of the widget models whose state is saved in the notebook's metadata."""
    state = (notebook.get("metadata") or {}).get("widgets", {}).get(WIDGET_STATE, {})
    return set((state.get("state") or {}).keys())


def keep_restorable_widgets(notebook: dict) -> int:
    """Replace every widget view that cannot be restored by its static rendering; returns how many.

    A view can be restored when its model's state is saved in the notebook.
    Otherwise (no saved state, a closed widget, a kernel that is gone) the
    output keeps its other renderings (our widgets carry ``text/html`` and
    ``text/plain``), and an output that had nothing else is dropped.
    """
    saved = saved_widget_ids(notebook)
    replaced = 0
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            data = output.get("data") or {}
            view = data.get(WIDGET_VIEW)
            if view is not None and view.get("model_id") not in saved:
                replaced += 1
                del data[WIDGET_VIEW]
                if not data:
                    continue
            kept.append(output)
        cell["outputs"] = kept
    return replaced


def pre_save_hook(model: dict, path: str = "", contents_manager: Any = None, **kwargs: Any) -> None:
    """Jupyter's pre-save hook: nothing is saved into the committed folders (an HTTP 403 that names
    ``my-course/``), and notebooks are saved with only restorable widget views."""
    refuse_committed_path(path)
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        keep_restorable_widgets(model["content"])


def main(argv: Sequence[str] | None = None) -> int:
    """Make the working copy, then replace this process by JupyterLab (extra arguments go to it)."""
    created = prepare_working_copy()
    where = ROOT / WORKING_COPY
    if created:
        print(f"mini-vLLM: copied {len(created)} notebooks into {where} (your working copy; git ignores it)")
    else:
        print(f"mini-vLLM: your working copy is {where} (your files there are kept; delete one to get it fresh)")
    command = server_command(extra_args=list(sys.argv[1:] if argv is None else argv))
    os.execv(command[0], command)
    return 0  # not reached: execv does not return


if __name__ == "__main__":
    sys.exit(main())
