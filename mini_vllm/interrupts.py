"""Ctrl-C at a safe moment: keep the engine's bookkeeping whole (chapter 08).

Pressing Ctrl-C (or "interrupt kernel" in Jupyter) raises ``KeyboardInterrupt``
between any two Python bytecodes. Inside the scheduler's bookkeeping that
could leave a request half-admitted: popped from the waiting queue but not yet
running, or holding blocks nobody knows about. The engine therefore runs its
bookkeeping inside ``keyboard_interrupts_deferred()``: a Ctrl-C that arrives
there is remembered and raised when the block ends, at a point where the
state is consistent. The forward pass itself is *not* deferred (that is where
the time goes, and where a Ctrl-C should land); the engine undoes a step
interrupted there (``LLMEngine.step``).

It only acts where Python's default SIGINT handler is installed and in the
main thread (the only one that receives signals); anywhere else it does
nothing, so a custom handler of yours is never replaced.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def keyboard_interrupts_deferred() -> Iterator[None]:
    """Hold back a Ctrl-C during the block; raise ``KeyboardInterrupt`` when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # someone else handles SIGINT (or an outer block already defers it)
        return
    received = []

    def remember(signum, frame):
        received.append(signum)

    signal.signal(signal.SIGINT, remember)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise KeyboardInterrupt
