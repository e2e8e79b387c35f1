"""A learner's server on the workshop hub: ``make lab`` for one home folder, then JupyterHub's single-user server.

The hub (``workshop/jupyterhub_config.py``) starts this as each learner's server,
in their home folder. Before JupyterLab starts, it lays the home out as ``make
lab``'s checkout is:

* ``notebooks/``, ``exercises/``, ``solutions/``: links to the shared course
  (``$MINI_VLLM_WORKSHOP_COURSE``), read-only in JupyterLab through the course's
  contents manager;
* ``my-course/``: the learner's own copy, made by
  ``mini_vllm.course.lab.prepare_working_copy``, which never overwrites a file
  that is there (so this runs on every start, and a chapter added to the course
  later reaches the learner at their next start);
* ``my-course/parts/``: the parts of their own engine (``MINI_VLLM_PARTS``), so one
  learner's kept parts never reach another's engine;
* ``$MINI_VLLM_WORKSHOP_PROGRESS/<name>`` links to their ``my-course/exercises``,
  the layout ``python -m mini_vllm grade`` expects (one folder per learner).

Then it runs ``jupyterhub.singleuser`` in this same process with ``make lab``'s
JupyterLab options (``lab.server_command``): the contents manager, the pre-save
hook, the lab settings, nothing fetched from the network. Run in one process, torch
(which the contents manager's package imports) is loaded once per learner.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS_OFF = ("no", "0", "false")


def prepare_learner(home: Path, name: str, course: Path, progress: Path | None, solutions: bool = True) -> list[Path]:
    """Lay out ``home`` as make lab's checkout (see the module docstring); returns the notebooks copied in.

    Idempotent: nothing that is there is replaced, links included.
    """
    from mini_vllm.course import lab

    home.mkdir(parents=True, exist_ok=True)
    for folder in lab.COPIED_FOLDERS:
        link = home / folder
        if folder == "solutions" and not solutions:
            continue
        if not link.exists() and not link.is_symlink() and (course / folder).is_dir():
            link.symlink_to(course / folder, target_is_directory=True)
    created = lab.prepare_working_copy(home)
    (home / lab.WORKING_COPY / "parts").mkdir(parents=True, exist_ok=True)
    if progress is not None:
        progress.mkdir(parents=True, exist_ok=True)
        link = progress / name
        if not link.is_symlink() and not link.exists():
            link.symlink_to(home / lab.WORKING_COPY / "exercises", target_is_directory=True)
    return created


def server_options(home: Path) -> list[str]:
    """make lab's JupyterLab options, less the two the hub sets per learner (root folder, start page)."""
    from mini_vllm.course import lab

    return [
        option
        for option in lab.server_command(home)[3:]
        if not option.startswith(("--ServerApp.root_dir=", "--LabApp.default_url="))
    ]


def main() -> None:
    from mini_vllm.course import lab

    home = Path(os.environ.get("HOME") or Path.cwd())
    name = os.environ.get("JUPYTERHUB_USER") or home.name
    course = Path(os.environ.get("MINI_VLLM_WORKSHOP_COURSE") or ROOT)
    progress = os.environ.get("MINI_VLLM_WORKSHOP_PROGRESS")
    solutions = os.environ.get("MINI_VLLM_WORKSHOP_SOLUTIONS", "").lower() not in SOLUTIONS_OFF
    created = prepare_learner(home, name, course, Path(progress) if progress else None, solutions)
    print(f"mini-vLLM: {name}'s working copy is {home / lab.WORKING_COPY} ({len(created)} notebooks copied in)")
    os.environ["MINI_VLLM_PARTS"] = str(home / lab.WORKING_COPY / "parts")  # the kernels inherit it
    os.chdir(home)

    from jupyterhub.singleuser import main as singleuser_main

    singleuser_main(argv=server_options(home) + sys.argv[1:])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the course's package, wherever the hub started us from
    main()
