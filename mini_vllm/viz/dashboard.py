"""``EngineDashboard``: the live view of a running engine, with Step / Run / Reset (chapters 00, 05, 06, 08).

    >>> dash = EngineDashboard(llm)
    >>> dash                                   # shows it (the last line of a cell)
    >>> dash.add_requests(["Once upon a time", "Once upon a time there"])
    >>> # click Step to watch one engine step at a time, or just:
    >>> llm.generate([...])                    # the dashboard follows along, live
    >>> dash.outputs["r0"]                     # the RequestOutput of a request it stepped to the end
    >>> dash.close()                           # detach (a new dashboard on the same engine does it too)

It shows the pool, the block tables, the free queue and the hash chain of the
last prompt added, all read from the engine, plus a metrics line and a small
hit-rate plot. It only *listens* (``engine.add_listener``): the engine does
exactly the same with or without it. Re-rendering is throttled (at most every
``min_interval`` seconds, always when the engine goes idle).

Every button works at any time and in any order (Step or Run on an idle
engine, Reset while requests run: each says what it did or why not), and
what a later cell reads does not depend on which buttons were pressed:
``outputs`` keeps every request the dashboard stepped to the end, whoever
pressed. The widget's HTML scrolls inside a box of ``max_height`` pixels
under the buttons, so they stay in view on a laptop screen. ``close()``
freezes the widget on its last state (it stays on the page and in the saved
notebook), and a saved notebook keeps the static HTML where the live widget
cannot be restored.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any, Sequence

from ..engine_parts import ENGINE_PART_NAMES
from ..events import ComputedBlocksFound, RequestAdded, RequestFinished, StepFinished
from .html import BLUE, GREEN, MUTED, container, esc, legend, sparkline, style
from .live import LiveBinding
from .state import CacheSnapshot, StateSource
from .hash_chain import HashChainView
from .block_table_view import BlockTableView
from .views import FreeQueueView, PoolView, StaticSnapshot, mimebundle

# id(engine) -> its open dashboard: a new dashboard on the same engine closes the old one,
# so re-running a notebook cell never leaves a stale listener behind.
_OPEN_DASHBOARDS: "weakref.WeakValueDictionary[int, EngineDashboard]" = weakref.WeakValueDictionary()


def _groups_text(snap: CacheSnapshot) -> str:
    """``group 0 full attention (layers 1, 3); group 1 sliding window 64 tokens (layers 0, 2)`` ("" for one group)."""
    return "; ".join(
        f"group {group.group_id} {group.description}" + (f" ({group.layers_text})" if group.layers_text else "")
        for group in snap.labelled_groups
    )


def parts_text(engine: Any) -> str | None:
    """``your parts (2 of 12): free_queue, slot_mapping; the other 10 are the reference's``, or None.

    Read from the engine's ``EngineParts`` (``mini_vllm/engine_parts.py``): a part is
    "yours" when the engine was built with a replacement for it (the course's
    ``learner_engine``). None for an engine with every part its own.
    """
    parts = getattr(engine, "parts", None)
    replaced = parts.replaced() if parts is not None else []
    if not replaced:
        return None
    others = len(ENGINE_PART_NAMES) - len(replaced)
    return (
        f"your parts ({len(replaced)} of {len(ENGINE_PART_NAMES)}): {', '.join(replaced)}; "
        f"the other {others} {'is' if others == 1 else 'are'} the reference's"
    )


def _count(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


class EngineDashboard:
    """Owns one engine listener, the buttons and the HTML widget; the views read the engine.

    Invariants: while open, exactly one listener of this dashboard is on the
    engine; after ``close()`` none is. Nothing here changes the engine except
    the buttons (``step``, ``run``, ``reset``) and ``add_requests``.
    """

    def __init__(
        self,
        llm: Any,
        *,
        tokenizer: Any = None,
        k_norm: bool = True,
        layer: int = 0,
        min_interval: float = 0.2,
        history: int = 240,
        max_cells: int = 160,
        max_finished: int = 6,
        replace_previous: bool = True,
        max_height: int | None = 380,
    ) -> None:
        self.source = StateSource(llm, tokenizer=tokenizer)
        if self.source.engine is None:
            raise TypeError("EngineDashboard needs an LLM or an LLMEngine; for a bare KVCacheManager use the views")
        self.engine = self.source.engine
        self.parts_text = parts_text(self.engine)  # the engine's parts are fixed when it is built
        # One legend for the whole dashboard, at the top.
        self.pool_view = PoolView(self.source, k_norm=k_norm, layer=layer, max_cells=max_cells, show_legend=False)
        self.table_view = BlockTableView(self.source, k_norm=k_norm, layer=layer, show_legend=False)
        self.queue_view = FreeQueueView(self.source)
        self.k_norm = k_norm
        self.layer = layer

        self.hit_rate_history: deque[float] = deque(maxlen=history)
        self.usage_history: deque[float] = deque(maxlen=history)
        self.finished: deque[dict] = deque(maxlen=max_finished)
        self.last_outputs: list = []  # the RequestOutputs the last step()/run() returned
        self.outputs: dict[str, Any] = {}  # request id -> RequestOutput, for every request step()/run() finished
        self.max_height = max_height
        # TTFT counts engine time only: the steps from the request's arrival to its first
        # token, each timed from its start (not the time a learner took to press Step).
        self.last_ttft: float | None = None
        self.last_ttft_steps: int | None = None
        self._step_seconds: dict[int, float] = {}  # engine step -> its duration, for the last `history` steps
        self._pending_ttft: tuple[int, int] | None = None  # (arrival step, first-token step)
        self._driven_step_start: float | None = None  # set while step()/run() is inside engine.step()
        self._idle_since = time.monotonic()  # the end of the last step, or the last request added
        self.last_step: StepFinished | None = None
        self.message = "Add requests with dashboard.add_requests([...]) and press Step, or call llm.generate(...)."
        self._chain_prompt: list[int] | None = None
        self._chain_salt: str | None = None
        self._request_counter = 0

        previous = _OPEN_DASHBOARDS.get(id(self.engine))
        if replace_previous and previous is not None and previous.engine is self.engine:
            previous.close()

        import ipywidgets as widgets

        self.step_button = widgets.Button(description="Step", tooltip="engine.step() once", icon="step-forward")
        self.run_button = widgets.Button(description="Run", tooltip="step until every request finished", icon="play")
        self.reset_button = widgets.Button(
            description="Reset cache", tooltip="reset_prefix_cache() (only when idle)", icon="trash"
        )
        for button in (self.step_button, self.run_button, self.reset_button):
            button.layout.width = "auto"
            button.layout.margin = "0 6px 0 0"
        self.step_button.on_click(lambda _button: self._guarded(self.step))
        self.run_button.on_click(lambda _button: self._guarded(self.run))
        self.reset_button.on_click(lambda _button: self._guarded(self.reset))
        self._live = LiveBinding(self.engine, self._widget_html, min_interval, on_event=self._on_event)
        self.html = self._live.widget
        self.buttons = widgets.HBox([self.step_button, self.run_button, self.reset_button])
        self.box = widgets.VBox([self.buttons, self.html])
        self.box.add_class("mv-dashboard-widget")
        _OPEN_DASHBOARDS[id(self.engine)] = self

    # -- events -------------------------------------------------------------------
    def _on_event(self, event: Any) -> None:
        engine = self.engine
        self.source.observe(event)
        if isinstance(event, RequestAdded):
            if self._driven_step_start is None:
                self._idle_since = time.monotonic()  # an external step starts no earlier than this
            request = engine.requests.get(event.request_id)
            if request is not None:
                self._chain_prompt = list(request.prompt_token_ids)
                self._chain_salt = request.cache_salt
        elif isinstance(event, ComputedBlocksFound):
            # Positions in the table (a hybrid model's event lists every group's blocks).
            self.source.hit_blocks[event.request_id] = event.num_computed_tokens // self.source.block_size
        elif isinstance(event, RequestFinished):
            self._record_finished(event)
        elif isinstance(event, StepFinished):
            now = time.monotonic()
            # A step the dashboard drove is timed from its start; one driven elsewhere
            # (llm.generate) from the end of the previous step or the last request added.
            started = self._driven_step_start if self._driven_step_start is not None else self._idle_since
            self._step_seconds[event.step] = now - started
            self._step_seconds.pop(event.step - self.hit_rate_history.maxlen, None)
            self._idle_since = now
            self.last_step = event
            self.message = self._step_message()  # also when llm.generate(...) drives the engine
            stats = engine.kv_cache_manager.prefix_cache_stats
            self.hit_rate_history.append(stats.hit_rate)
            self.usage_history.append(engine.kv_cache_manager.usage)
            for request_id, _ in event.num_scheduled_tokens:
                self._record_ttft(engine.requests.get(request_id), event.step)
            if self._pending_ttft is not None:
                arrival_step, first_token_step = self._pending_ttft
                self._pending_ttft = None
                self.last_ttft_steps = first_token_step - arrival_step
                steps = range(arrival_step + 1, first_token_step + 1)
                known = [self._step_seconds[s] for s in steps if s in self._step_seconds]
                self.last_ttft = sum(known) if len(known) == len(steps) else None

    def _record_ttft(self, request: Any, step: int) -> None:
        # The step's duration is known only at its StepFinished: the TTFT is computed there.
        metrics = request.metrics if request is not None else None
        if metrics is not None and metrics.first_token_step == step:
            self._pending_ttft = (metrics.arrival_step, step)

    def _record_finished(self, event: RequestFinished) -> None:
        engine = self.engine
        request = engine.requests.get(event.request_id)
        self._record_ttft(request, engine.num_steps)
        self.source.hit_blocks.pop(event.request_id, None)
        if request is None:
            return
        text = self.source.decode(request.output_token_ids) if request.output_token_ids else ""
        self.finished.append(
            {
                "request_id": event.request_id,
                "finish_reason": event.finish_reason,
                "num_prompt_tokens": request.num_prompt_tokens,
                "num_cached_tokens": max(request.num_cached_tokens, 0),
                "num_output_tokens": request.num_output_tokens,
                "text": text,
            }
        )

    # -- actions (the buttons) -----------------------------------------------------
    def _guarded(self, action) -> None:
        # A click must never leave the buttons disabled or raise into the widget machinery.
        buttons = (self.step_button, self.run_button, self.reset_button)
        for button in buttons:
            button.disabled = True
        try:
            action()
        except Exception as err:  # shown in the dashboard instead of a lost traceback
            self.message = f"error: {type(err).__name__}: {err}"
            self.refresh()
        finally:
            for button in buttons:
                button.disabled = False

    def step(self) -> list:
        """``engine.step()`` once (nothing when no request is waiting or running)."""
        if not self.engine.has_unfinished_requests():
            self.message = "Idle: no request to step. Add some with dashboard.add_requests([...])."
            self.refresh()
            return []
        outputs = self._engine_step()
        self.last_outputs = outputs
        self.message = self._step_message()
        self.refresh()
        return outputs

    def _engine_step(self) -> list:
        """One ``engine.step()``, timed from its start; keeps the outputs of what finished."""
        self._driven_step_start = time.monotonic()
        try:
            outputs = self.engine.step()
        finally:
            self._driven_step_start = None
        for output in outputs:
            self.outputs[output.request_id] = output
        return outputs

    def run(self, max_steps: int = 100_000) -> list:
        """Step until no request is waiting or running; returns the finished outputs."""
        finished = []
        steps = 0
        while self.engine.has_unfinished_requests() and steps < max_steps:
            finished += self._engine_step()
            steps += 1
        self.last_outputs = finished
        if steps == 0:
            self.message = "Idle: nothing to run. Add requests with dashboard.add_requests([...])."
        else:
            self.message = (
                f"Ran {_count(steps, 'step')}; {_count(len(finished), 'request')} finished "
                f"({', '.join(o.request_id for o in finished) or 'none'})."
            )
        self.refresh()
        return finished

    def reset(self) -> bool:
        """``reset_prefix_cache()``, refused while a request holds blocks."""
        if self.engine.has_unfinished_requests():
            self.message = "Reset refused: requests are still waiting or running (run them first)."
            ok = False
        else:
            ok = self.engine.reset_prefix_cache()
            self.message = "Prefix cache reset: every hash forgotten." if ok else "Reset refused: blocks are in use."
        self.refresh()
        return ok

    def _step_message(self) -> str:
        event = self.last_step
        if event is None:
            return "Stepped."
        parts = ", ".join(f"{rid} +{n}" for rid, n in event.num_scheduled_tokens)
        total = sum(n for _, n in event.num_scheduled_tokens)
        return f"Step {event.step}: computed {_count(total, 'token')} ({parts or 'nothing scheduled'})."

    def add_requests(
        self, prompts: Any, sampling_params: Any = None, request_ids: Sequence[str] | None = None
    ) -> list[str]:
        """Queue requests without running them (press Step to watch them); returns their ids.

        ``prompts``: a string, a ``{"prompt_token_ids": [...], "cache_salt": ...}`` dict or a list
        of them, as for ``LLM.generate``. With ``n > 1`` each completion is its own request.
        """
        # Validation and queueing are the engine's (one path for every entry point):
        # a bad prompt raises before anything is queued.
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        counter_before = self._request_counter
        if request_ids is None:
            request_ids = [self._next_request_id() for _ in prompts]
        try:
            child_ids = self.engine.add_requests(prompts, sampling_params, request_ids)
        except BaseException:
            self._request_counter = counter_before  # nothing was queued: the ids are free again
            raise
        added = [request_id for ids in child_ids.values() for request_id in ids]
        self.message = f"Queued {', '.join(added)}: press Step (one engine step) or Run."
        self.refresh()
        return added

    def _next_request_id(self) -> str:
        while True:
            request_id = f"r{self._request_counter}"
            self._request_counter += 1
            if request_id not in self.engine.requests:
                return request_id

    # -- rendering ---------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-render the widget now."""
        self._live.refresh()

    def snapshot(self) -> CacheSnapshot:
        return self.source.snapshot(k_norm=self.k_norm, layer=self.layer)

    def _metrics(self, snap: CacheSnapshot) -> dict:
        stats = snap.prefix_cache_stats
        return {
            "step": snap.num_steps,
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "hit_rate": f"{100 * stats.hit_rate:.1f}%",
            "hits": f"{stats.hits}/{stats.queries} tokens"
            + (f" (+{stats.preempted_hits}/{stats.preempted_queries} re-admitted)" if stats.preempted_queries else ""),
            "blocks": f"{snap.num_blocks_in_use}/{snap.num_blocks}",
            "evictions": snap.num_evictions,
            "preemptions": snap.num_preemptions,
        }

    def _hash_chain(self) -> HashChainView | None:
        if self._chain_prompt is None:
            return None
        return HashChainView(
            self.source, self._chain_prompt, cache_salt=self._chain_salt, title="Hash chain of the last prompt added"
        )

    @staticmethod
    def _pool_description(snap: CacheSnapshot) -> str:
        """``64 blocks × 16 tokens`` and, where there are several, the KV-cache groups that share them."""
        text = f"{snap.num_blocks} blocks × {snap.block_size} tokens"
        groups = _groups_text(snap)
        return text + (f" shared by {snap.num_groups} KV-cache groups: {groups}" if groups else "")

    def _header_html(self, snap: CacheSnapshot) -> str:
        m = self._metrics(snap)
        item = style(display="inline-block", margin="0 14px 2px 0", white_space="nowrap")
        ttft = "–"
        if self.last_ttft_steps is not None:
            ttft = _count(self.last_ttft_steps, "step")
            if self.last_ttft is not None:
                ttft += f", {1000 * self.last_ttft:.1f} ms"
        metrics = [
            ("step", m["step"]),
            ("running", m["running"]),
            ("waiting", m["waiting"]),
            ("hit rate", f"{m['hit_rate']} ({m['hits']})"),
            ("blocks in use", m["blocks"]),
            ("evictions", m["evictions"]),
            ("preemptions", m["preemptions"]),
            ("last TTFT (engine time)", ttft),
        ]
        line = "".join(
            f'<span class="mv-metric" style="{item}"><span style="{style(color=MUTED)}">{esc(name)}</span> '
            f"<b>{esc(value)}</b></span>"
            for name, value in metrics
        )
        plot = sparkline(
            [(list(self.usage_history), BLUE), (list(self.hit_rate_history), GREEN)],
            label="hit rate (green) and pool usage (blue), per step",
        )
        key = (
            f'<span style="{style(font_size="11px", color=MUTED, margin_left="8px")}">'
            f'<span style="color:{GREEN};font-weight:700">━━</span> hit rate {m["hit_rate"]} &nbsp; '
            f'<span style="color:{BLUE};font-weight:700">━━</span> pool in use '
            f"{100 * snap.num_blocks_in_use / snap.num_blocks:.0f}% &nbsp; "
            f"(per step, last {self.hit_rate_history.maxlen})</span>"
        )
        # Title on the left, the hit-rate plot on the right: one row, so the dashboard stays short.
        title = (
            f'<div style="{style(display="flex", flex_wrap="wrap", justify_content="space-between", align_items="center")}">'
            f'<div style="{style(font_size="15px", font_weight="700")}">mini-vLLM engine '
            f'<span style="{style(font_weight="400", font_size="12px", color=MUTED)}">'
            f"{esc(self._pool_description(snap))}, read live from the engine</span></div>"
            f"<div>{plot}{key}</div></div>"
        )
        message_style = style(
            margin_top="4px",
            padding="3px 8px",
            background="#f3f6f9",
            border_left=f"3px solid {BLUE}",
            font_weight="600",
        )
        message = f'<div class="mv-message" style="{message_style}">{esc(self.message)}</div>'
        metrics_html = f'<div class="mv-metrics">{line}</div>'
        yours = self.parts_text
        if yours is not None:  # the learner's engine: which parts run their code
            yours_style = style(margin_top="2px", font_size="12px", color=GREEN, font_weight="600")
            metrics_html += f'<div class="mv-parts" style="{yours_style}">{esc(yours)}</div>'
        k_norm_layer = self.layer if self.k_norm else None
        return (
            title
            + metrics_html
            + message
            + legend(
                include_tables=True, block_size=snap.block_size, k_norm_layer=k_norm_layer, groups=snap.labelled_groups
            )
        )

    def _finished_html(self) -> str:
        if not self.finished:
            return ""
        cell = style(padding="2px 8px 2px 0", vertical_align="top", text_align="left")
        rows = "".join(
            f'<tr><td style="{cell};font-family:monospace;font-weight:700">{esc(f["request_id"])}</td>'
            f'<td style="{cell}">{esc(f["finish_reason"])}</td>'
            f'<td style="{cell}">{f["num_cached_tokens"]}/{f["num_prompt_tokens"]} prompt tokens cached</td>'
            f'<td style="{cell};max-width:480px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap" '
            f'title="{esc(f["text"])}">{esc(repr(f["text"]))}</td></tr>'
            for f in self.finished
        )
        return container(
            f'<div style="{style(font_weight="600", margin_bottom="4px")}">Finished recently</div>'
            f'<table style="{style(border_collapse="collapse", font_size="12px")}">{rows}</table>',
            "mv-finished",
        )

    def to_html(self, max_height: int | None = None) -> str:
        """The whole dashboard as one self-contained HTML snapshot (the widget shows the same).

        ``max_height``: the views under the header scroll inside a box that high (the
        live widget uses it, so the header and the buttons above stay in view).
        """
        snap = self.snapshot()
        chain = self._hash_chain()
        parts = [
            self.table_view.render_html(snap),
            self.pool_view.render_html(snap),
            self.queue_view.render_html(snap),
        ]
        if chain is not None:
            parts.append(chain.render_html(snap))
        parts.append(self._finished_html())
        body = "".join(parts)
        if max_height is not None:
            body = (
                f'<div class="mv-scroll" style="{style(max_height=f"{max_height}px", overflow_y="auto")}">{body}</div>'
            )
        header = container(self._header_html(snap), "mv-header")
        return f'<div class="mv-dashboard" style="{style(max_width="1200px")}">{header}{body}</div>'

    def _widget_html(self) -> str:
        return self.to_html(self.max_height)

    def to_text(self) -> str:
        """Deterministic plain text (no timings, no K norms): what strict nbval compares."""
        snap = self.snapshot()
        m = self._metrics(snap)
        lines = [
            f"EngineDashboard: step {m['step']}, {m['running']} running, {m['waiting']} waiting, "
            f"hit rate {m['hit_rate']} ({m['hits']}), blocks in use {m['blocks']}, "
            f"evictions {m['evictions']}, preemptions {m['preemptions']}",
        ]
        groups = _groups_text(snap)
        if groups:
            lines.append(f"KV-cache groups ({snap.num_groups}, one pool): {groups}")
        yours = self.parts_text
        if yours is not None:
            lines.append(yours)
        lines += [
            self.table_view.render_text(snap),
            self.pool_view.render_text(snap),
            self.queue_view.render_text(snap),
        ]
        chain = self._hash_chain()
        if chain is not None:
            lines.append(chain.render_text(snap))
        for f in self.finished:
            lines.append(
                f"finished {f['request_id']} ({f['finish_reason']}): {f['num_cached_tokens']}/"
                f"{f['num_prompt_tokens']} prompt tokens cached, {f['num_output_tokens']} output tokens"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.to_text()

    def static(self) -> StaticSnapshot:
        """The dashboard's current state as plain HTML + text, with no widget.

        The live widget's saved output keeps the state from when it was first
        displayed; end a notebook cell with ``dashboard.static()`` to keep the
        state after a run for readers without a kernel.
        """
        return StaticSnapshot(self.to_html(), self.to_text())

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        self.refresh()
        return mimebundle(self.to_text(), self.to_html(), self.box if self.is_open else None)

    # -- lifetime -------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._live.attached

    def close(self) -> None:
        """Stop following the engine (safe to call twice): the widget stays, frozen on its last state.

        The buttons disappear and the message says the dashboard is closed; the
        output that shows it keeps that final picture (a closed widget would
        leave an empty cell behind). A new ``EngineDashboard`` on the same
        engine closes the previous one this way.
        """
        if self.is_open:
            self.message = "Closed: this dashboard no longer follows the engine (create a new one to watch it)."
            self._live.refresh()
            self._live.detach()
            self.buttons.layout.display = "none"
        if _OPEN_DASHBOARDS.get(id(self.engine)) is self:
            del _OPEN_DASHBOARDS[id(self.engine)]

    def __enter__(self) -> "EngineDashboard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
