"""JupyterHub for a workshop room: N learners on one machine, each with their own copy of the course.

    make hub HUB_PASSWORD=...            (or: .venv/bin/python -m jupyterhub -f workshop/jupyterhub_config.py)

What it sets up (workshop/README.md is the instructor's guide):

* log-in: jupyterhub's ``SharedPasswordAuthenticator`` (JupyterHub >= 5.3): every
  learner picks a user name and types the password on the whiteboard; no system
  accounts. ``MINI_VLLM_WORKSHOP_USERS=ada,bob`` restricts the names, otherwise
  anyone with the password gets in. Names are lower-case letters, digits, ``-`` and
  ``_`` (they become folder names).
* servers: jupyterhub's ``SimpleLocalProcessSpawner``, one JupyterLab per learner as
  a process of the hub's own user, in ``$MINI_VLLM_WORKSHOP_DIR/home/<name>/``. No
  isolation between learners (same Unix user) and no enforced memory or CPU limit:
  see the guide for systemdspawner / The Littlest JupyterHub, which enforce both.
* each learner's server is ``workshop/singleuser.py``, which first lays their home out
  as ``make lab``'s checkout is: ``notebooks/``, ``exercises/`` and ``solutions/`` are
  links to the shared course (read-only in JupyterLab: the course's contents manager),
  and ``my-course/`` is their own copy, made at every start by
  ``mini_vllm.course.lab.prepare_working_copy``, which never overwrites a file that is
  there. JupyterLab gets ``make lab``'s options: the contents manager, the pre-save
  hook, the lab settings, nothing from the network. (The hub itself never imports the
  course's package, which loads torch: that happens once per learner, in their server.)
* ``$MINI_VLLM_WORKSHOP_DIR/progress/<name>`` links to that learner's
  ``my-course/exercises``: ``make grade DIR=$MINI_VLLM_WORKSHOP_DIR/progress``.
* the real model (``models/``) and real vLLM (``.venv-vllm``) of this checkout are
  shared by path, read-only by convention; every learner's kept parts go to their
  own ``my-course/parts`` (``MINI_VLLM_PARTS``), one compute thread per kernel.

Settings, from the environment (``make hub`` passes its variables through):

    MINI_VLLM_WORKSHOP_PASSWORD        the learners' password, 8 characters or more (required)
    MINI_VLLM_WORKSHOP_DIR             the hub's folder: homes, progress links, its database (build/workshop)
    MINI_VLLM_WORKSHOP_URL             where the hub listens (http://:8080, every interface)
    MINI_VLLM_WORKSHOP_USERS           comma-separated allowed learner names (anyone, if unset)
    MINI_VLLM_WORKSHOP_ADMIN           the instructor's name, with MINI_VLLM_WORKSHOP_ADMIN_PASSWORD
                                       (32 characters or more): the admin page lists and stops servers
    MINI_VLLM_WORKSHOP_COURSE          the folder holding notebooks/, exercises/, solutions/ (this checkout);
                                       point it at a trimmed copy to hand out only some chapters
    MINI_VLLM_WORKSHOP_SOLUTIONS       "no" keeps solutions/ out of the learners' homes
    MINI_VLLM_WORKSHOP_MEM_LIMIT       reported to each server as MEM_LIMIT (2G); not enforced here
    MINI_VLLM_WORKSHOP_CPU_LIMIT       reported as CPU_LIMIT (1); not enforced here

Command-line options of ``jupyterhub`` win over this file (``HUB_ARGS`` in ``make hub``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the course's checkout: the package, models/, .venv-vllm/
WORKSHOP_DIR = Path(os.environ.get("MINI_VLLM_WORKSHOP_DIR") or ROOT / "build" / "workshop").resolve()
COURSE = Path(os.environ.get("MINI_VLLM_WORKSHOP_COURSE") or ROOT).resolve()
HOMES = WORKSHOP_DIR / "home"
PROGRESS = WORKSHOP_DIR / "progress"
# make lab's start page (mini_vllm.course.lab.START_NOTEBOOK; the hub does not import the course's
# package, which loads torch: tests/course/test_workshop.py keeps the two equal).
START_NOTEBOOK = "my-course/notebooks/00_welcome.ipynb"
USERNAME_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
# The configurable-http-proxy that `make hub` installs with npm (workshop/ensure_proxy.sh).
LOCAL_PROXY = ROOT / "build" / "node_modules" / ".bin" / "configurable-http-proxy"
REAL_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def learner_environment() -> dict[str, str]:
    """What every learner's server and kernels get (JupyterHub passes almost nothing of its own environment)."""
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "LANG": os.environ.get("LANG") or "C.UTF-8",
        "OMP_NUM_THREADS": "1",  # one compute thread per kernel: N learners on N cores, no oversubscription
        "PYTHONUNBUFFERED": "1",
        # workshop/singleuser.py lays each home out from these
        "MINI_VLLM_WORKSHOP_COURSE": str(COURSE),
        "MINI_VLLM_WORKSHOP_PROGRESS": str(PROGRESS),
        "MINI_VLLM_WORKSHOP_SOLUTIONS": os.environ.get("MINI_VLLM_WORKSHOP_SOLUTIONS", "yes"),
    }
    if (REAL_MODEL / "provenance.json").exists():  # make real-model: one read-only copy for the room
        env["MINI_VLLM_REAL_MODEL"] = str(REAL_MODEL)
    if (ROOT / ".venv-vllm" / ".installed").exists():  # make vllm: one virtualenv for the room
        env["MINI_VLLM_VLLM_PYTHON"] = str(VLLM_PYTHON)
    return env


c = get_config()  # noqa: F821  (JupyterHub's config loader provides it)

# -- the hub ---------------------------------------------------------------------------------
WORKSHOP_DIR.mkdir(parents=True, exist_ok=True)
c.JupyterHub.bind_url = os.environ.get("MINI_VLLM_WORKSHOP_URL") or "http://:8080"
c.JupyterHub.db_url = f"sqlite:///{WORKSHOP_DIR / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(WORKSHOP_DIR / "jupyterhub_cookie_secret")
c.JupyterHub.cleanup_servers = True  # stopping the hub stops every learner's server
c.ConfigurableHTTPProxy.pid_file = str(WORKSHOP_DIR / "jupyterhub-proxy.pid")
if LOCAL_PROXY.exists():
    c.ConfigurableHTTPProxy.command = [str(LOCAL_PROXY)]

# -- log-in: one shared password ---------------------------------------------------------------
c.JupyterHub.authenticator_class = "shared-password"
password = os.environ.get("MINI_VLLM_WORKSHOP_PASSWORD", "")
if len(password) < 8:
    raise SystemExit(
        "workshop/jupyterhub_config.py: set MINI_VLLM_WORKSHOP_PASSWORD (make hub HUB_PASSWORD=...) "
        "to the password you give the room, 8 characters or more"
    )
c.SharedPasswordAuthenticator.user_password = password
c.Authenticator.username_pattern = USERNAME_PATTERN
allowed = [name.strip().lower() for name in os.environ.get("MINI_VLLM_WORKSHOP_USERS", "").split(",") if name.strip()]
if allowed:
    c.Authenticator.allowed_users = set(allowed)
else:
    c.Authenticator.allow_all = True
admin = os.environ.get("MINI_VLLM_WORKSHOP_ADMIN", "")
if admin:
    c.Authenticator.admin_users = {admin}
    c.SharedPasswordAuthenticator.admin_password = os.environ.get("MINI_VLLM_WORKSHOP_ADMIN_PASSWORD", "")

# -- one JupyterLab per learner, no system users ------------------------------------------------
c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = str(HOMES / "{username}")
# make lab for one home, then jupyterhub-singleuser with make lab's JupyterLab options (workshop/singleuser.py)
c.Spawner.cmd = [sys.executable, str(ROOT / "workshop" / "singleuser.py")]
c.Spawner.args = ["--ServerApp.terminals_enabled=False"]  # no shell: the learners share one Unix user
c.Spawner.default_url = f"/lab/tree/{START_NOTEBOOK}"
c.Spawner.environment = learner_environment()
# A local process spawner only reports these (MEM_LIMIT, CPU_LIMIT in the server's environment, shown by
# jupyter-resource-usage when installed); systemdspawner and TLJH enforce them (workshop/README.md).
c.Spawner.mem_limit = os.environ.get("MINI_VLLM_WORKSHOP_MEM_LIMIT") or "2G"
c.Spawner.cpu_limit = float(os.environ.get("MINI_VLLM_WORKSHOP_CPU_LIMIT") or 1)
# A loaded machine with a room logging in at once: give servers time to start.
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 120
