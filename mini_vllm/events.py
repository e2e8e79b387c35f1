"""Engine events: what the widgets (and tests) can listen to (chapters 00, 05, 06, 08).

The engine emits one typed event for each change to the KV cache and the
queues. Listeners are plain callables; with none attached, nothing is built,
so the events cost nothing. Widgets only listen: they never change the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestAdded:
    request_id: str
    num_prompt_tokens: int


@dataclass(frozen=True)
class ComputedBlocksFound:
    """Prefix-cache lookup for an admitted request: the blocks it hit."""

    request_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclass(frozen=True)
class BlocksAllocated:
    """New blocks popped from the free queue for a request."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockCached:
    """A full block entered the prefix cache under ``block_hash``."""

    block_id: int
    block_hash: bytes


@dataclass(frozen=True)
class BlockEvicted:
    """A cached block was reused for something else; its hash is gone."""

    block_id: int
    block_hash: bytes


@dataclass(frozen=True)
class BlocksFreed:
    """A request finished or was preempted; its blocks lost one reference each."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class RequestPreempted:
    request_id: str


@dataclass(frozen=True)
class RequestFinished:
    request_id: str
    finish_reason: str


@dataclass(frozen=True)
class StepFinished:
    """One engine step is done: which requests ran and how many tokens each computed."""

    step: int
    num_scheduled_tokens: tuple[tuple[str, int], ...]
    num_running: int
    num_waiting: int


EngineEvent = (
    RequestAdded
    | ComputedBlocksFound
    | BlocksAllocated
    | BlockCached
    | BlockEvicted
    | BlocksFreed
    | RequestPreempted
    | RequestFinished
    | StepFinished
)
Listener = Callable[[EngineEvent], None]


class EventBus:
    """Delivers events to listeners in the order they were added."""

    def __init__(self) -> None:
        self.listeners: list[Listener] = []

    @property
    def active(self) -> bool:
        return bool(self.listeners)

    def add(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def remove(self, listener: Listener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def emit(self, event: EngineEvent) -> None:
        for listener in list(self.listeners):
            listener(event)
