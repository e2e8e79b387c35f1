"""Wait until a server started by a test answers HTTP 200 (or fail saying why): JupyterLab, the hub."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_for_http(url: str, process: subprocess.Popen, name: str, timeout: float, log: Path | None = None) -> None:
    """Poll ``url`` until it answers 200; raise if ``process`` exits first or ``timeout`` seconds pass."""
    tail = (lambda: ":\n" + log.read_text()[-4000:]) if log is not None else (lambda: "")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{name} exited with {process.returncode}{tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{name} did not answer {url} within {timeout:.0f} s{tail()}")
