"""Keeping an ``ipywidgets.HTML`` in sync with a running engine (throttled).

A ``LiveBinding`` registers one listener on the engine. The listener never
changes the engine and never raises into it (an error is shown in the widget
instead). It re-renders at most every ``min_interval`` seconds, always when
the engine becomes idle, and when asked (``refresh()``), so a long
``llm.generate(...)`` stays fast while the widget still moves.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..events import AllBlocksCleared, RequestFinished, StepFinished

logger = logging.getLogger("mini_vllm.viz")


class LiveBinding:
    """Owns one engine listener and the ``ipywidgets.HTML`` it updates.

    Invariant: while ``attached`` the listener is registered on ``engine``;
    ``detach()`` removes it (idempotent) and leaves the widget as it is,
    ``close()`` also closes the widget.
    """

    def __init__(
        self,
        engine: Any,
        render: Callable[[], str],
        min_interval: float = 0.2,
        on_event: Callable[[Any], None] | None = None,
        after_render: Callable[[], None] | None = None,
    ) -> None:
        import ipywidgets  # only the live part needs it; static views work without

        self.engine = engine
        self.render = render
        self.min_interval = min_interval
        self.on_event = on_event
        self.after_render = after_render
        self.widget = ipywidgets.HTML(value="")
        self.num_renders = 0
        self.last_error: str | None = None
        self._last_render = 0.0
        self._dirty = False
        self._last_step = engine.num_steps  # the last step whose StepFinished we saw
        self._listener = self._handle_event  # one bound method, so remove_listener finds it
        self.refresh()
        engine.add_listener(self._listener)
        self.attached = True

    # -- the listener -----------------------------------------------------------
    def _handle_event(self, event: Any) -> None:
        try:
            if self.on_event is not None:
                self.on_event(event)
            self._dirty = True
            if isinstance(event, StepFinished):
                self._last_step = event.step
                idle = event.num_running == 0 and event.num_waiting == 0
                if idle or time.monotonic() - self._last_render >= self.min_interval:
                    self.refresh()
            elif (
                isinstance(event, RequestFinished)
                and self._outside_a_step()
                and not self.engine.has_unfinished_requests()
            ):
                self.refresh()  # the last request was aborted between steps: no StepFinished follows
            elif isinstance(event, AllBlocksCleared):
                self.refresh()  # reset_prefix_cache() runs between steps: show the emptied cache now
        except Exception:  # a widget must never break the engine it watches
            self.last_error = traceback.format_exc()
            logger.exception("mini_vllm.viz: a live view failed to update")

    def _outside_a_step(self) -> bool:
        # step() counts itself first and reports StepFinished last: in between, a step is running.
        return self.engine.num_steps == self._last_step

    # -- rendering --------------------------------------------------------------
    def refresh(self) -> None:
        """Render now (and clear the pending-update flag)."""
        try:
            value = self.render()
        except Exception:
            self.last_error = traceback.format_exc()
            logger.exception("mini_vllm.viz: rendering failed")
            value = f"<pre>view failed to render:\n{self.last_error}</pre>"
        if value != self.widget.value:
            self.widget.value = value
        self.num_renders += 1
        self._last_render = time.monotonic()
        self._dirty = False
        if self.after_render is not None:
            self.after_render()

    def flush(self) -> None:
        """Render if anything changed since the last render."""
        if self._dirty:
            self.refresh()

    def detach(self) -> None:
        """Stop following the engine; the widget keeps its last rendering (safe to call twice).

        The widget stays open on purpose: an output that shows it keeps showing
        that last state (and a saved notebook can restore it), where a closed
        widget would vanish from the page.
        """
        if self.attached:
            self.engine.remove_listener(self._listener)
            self.attached = False

    def close(self) -> None:
        """Detach from the engine and close the widget: outputs showing it go blank (safe to call twice)."""
        self.detach()
        self.widget.close()
