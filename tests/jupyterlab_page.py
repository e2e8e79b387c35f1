"""Driving JupyterLab in a test: its server command line, and the page states the browser tests wait on."""

from __future__ import annotations

import os
import time
from pathlib import Path

from mini_vllm.course import lab

VISIBLE = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in front


def lab_test_server(root: Path, workdir: Path, port: int, token: str = "") -> tuple[list[str], dict[str, str]]:
    """``make lab``'s command line on 127.0.0.1:``port`` and private Jupyter folders under ``workdir``
    (no user settings, a fresh workspace); ``token`` empty: no log-in."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        JUPYTER_CONFIG_DIR=str(workdir / "config"),
        JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(workdir / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(workdir / "workspaces"),
    )
    command = lab.server_command(
        root,
        [
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            "--ServerApp.password=",
            "--ServerApp.terminals_enabled=False",
        ],
    )
    return command, env


def accept_kernel_dialog(page) -> None:
    """A "Select Kernel" dialog can come up while a notebook opens: choose the default, as a learner would."""
    dialog = page.locator(".jp-Dialog:has-text('Select Kernel') .jp-Dialog-button.jp-mod-accept")
    if dialog.count():
        dialog.first.click()


def session_kernel(page, path: str) -> dict | None:
    """The server's own record of notebook ``path``'s kernel, ``{"id", "state"}``; None while it has no session."""
    return page.evaluate(
        """async (path) => {
            const config = JSON.parse(document.getElementById('jupyter-config-data').textContent);
            const xsrf = decodeURIComponent((document.cookie.match(/_xsrf=([^;]+)/) || [])[1] || "");
            const r = await fetch(`${config.baseUrl}api/sessions`, {headers: {"X-XSRFToken": xsrf}});
            if (!r.ok) return null;
            const s = (await r.json()).find(s => s.path === path);
            return s && s.kernel ? {id: s.kernel.id, state: s.kernel.execution_state} : null;
        }""",
        path,
    )


def wait_kernel_idle(page, timeout: float, path: str | None = None) -> str | None:
    """Until the notebook in front says its kernel is idle (choosing the default kernel if asked), and
    with ``path`` (the notebook's, from the server's root) until the server says so too: its kernel's id.

    The page's indicator can say "idle" before the server has the notebook's session (seen in a hub
    log); a cell run then makes JupyterLab start a second kernel, which replaces the first after the
    cell ran there, and the next cell finds nothing the first one defined.
    """
    idle = (
        f"() => [...document.querySelectorAll('{VISIBLE} .jp-Notebook-ExecutionIndicator,"
        f" {VISIBLE} .jp-Toolbar-kernelStatus')]"
        ".some(e => /idle/i.test(e.getAttribute('data-status') || e.title || e.textContent || ''))"
    )
    deadline = time.monotonic() + timeout
    while True:
        kernel = session_kernel(page, path) if path is not None else None
        if page.evaluate(idle) and (path is None or (kernel and kernel["state"] == "idle")):
            return kernel["id"] if kernel else None
        assert time.monotonic() < deadline, f"the kernel was not idle within {timeout:.0f} s (the server's: {kernel})"
        accept_kernel_dialog(page)
        page.wait_for_timeout(300)
