"""Engine events: what the widgets (and tests) can listen to (chapters 00, 05, 06, 08).

The engine emits one typed event for each change to the KV cache and the
queues. Listeners are plain callables; with none attached, nothing is built,
so the events cost nothing. Widgets only listen: they never change the engine.

Changes to the prefix cache are vLLM's KV events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, as in ``vllm/distributed/kv_events.py``):
the block pool records them and the engine passes the same objects on, so a
widget, a test and a router in front of several engines all read one family.
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
    """Prefix-cache lookup for an admitted request: the blocks it hit.

    Built by the scheduler's admission (chapter 08's exercise may build it too), so it checks its
    fields: a ``Request`` for its id, or the blocks for their ids, is a ``TypeError`` naming the field.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str):
            raise TypeError(
                f"ComputedBlocksFound: request_id must be the request's id (a str), got "
                f"{type(self.request_id).__name__}: pass request.request_id"
            )
        if not isinstance(self.block_ids, (tuple, list)):
            wrong = type(self.block_ids).__name__
        else:  # the type of the first item that is no id, if any
            ids = self.block_ids
            wrong = next((type(b).__name__ for b in ids if isinstance(b, bool) or not isinstance(b, int)), None)
        if wrong is not None:
            raise TypeError(
                f"ComputedBlocksFound: block_ids must be a tuple of the hit blocks' ids (ints), got {wrong}: "
                "pass manager.block_ids_of(new_computed_blocks)"
            )
        if isinstance(self.num_computed_tokens, bool) or not isinstance(self.num_computed_tokens, int):
            raise TypeError(
                f"ComputedBlocksFound: num_computed_tokens must be an int (the hit's tokens), got "
                f"{type(self.num_computed_tokens).__name__}"
            )
        object.__setattr__(self, "block_ids", tuple(self.block_ids))


@dataclass(frozen=True)
class BlocksAllocated:
    """New blocks popped from the free queue for a request."""

    request_id: str
    block_ids: tuple[int, ...]


# -- KV-cache events: vLLM's family (``vllm/distributed/kv_events.py``) ----------------
# The block pool records them (``BlockPool.take_events``); the scheduler and the
# engine pass them on to listeners unchanged, so the widgets, the router and
# the tests all see one family under vLLM's names. Fields follow vLLM 0.33's
# where they make sense here; ``block_ids`` is mini-vLLM's addition (vLLM's
# events are for routers in other processes, which cannot use block ids; the
# widgets here draw blocks by id).
#
# ``medium`` says where the blocks are, as vLLM's: "GPU" for the pool (vLLM's
# ``MEDIUM_GPU``, whatever the device), "CPU" for a KV-cache offloading tier
# in host memory (``mini_vllm/kv_offload/``), published by its connector.

MEDIUM_GPU = "GPU"  # the pool
MEDIUM_CPU = "CPU"  # the offloading tier, in host memory


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache: one event per ``cache_full_blocks`` call.

    ``block_hashes[i]`` names ``block_ids[i]``; the blocks are consecutive
    blocks of one request, holding ``token_ids`` (``block_size`` tokens each).
    ``parent_block_hash`` is the hash of the block before the first one (None
    for a request's first block). ``group_idx``: the KV-cache group whose
    blocks these are (always 0 but in a hybrid model, chapter 08b). A
    sliding-window group caches only some blocks of a request: it sends one
    event per run of consecutive blocks (vLLM sends one per call, its hashes
    skipping the blocks it left out). ``extra_keys[i]``: what besides the
    tokens entered ``block_hashes[i]``, as vLLM publishes it (the keys of
    ``hashing.block_extra_keys`` without their tags: a salted request's first
    block has ``(salt,)``, other blocks None), so that a router can hash a
    salted prompt as the replica did. ``medium``: "GPU" from the pool, "CPU"
    from the offloading tier, whose events are vLLM's default payload, one
    hash per event with no tokens (``token_ids=()``, ``block_size=0``, no
    parent, no ``block_ids``). vLLM 0.33 also sends ``lora_id``,
    ``lora_name`` and a few more; they have no use here (mini-vLLM serves no
    LoRA adapters; ``mini_vllm/distributed/kv_events.py`` fills them in as
    vLLM does when it puts these events on the wire).
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    block_ids: tuple[int, ...] = ()
    group_idx: int = 0
    extra_keys: tuple[tuple | None, ...] = ()
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks left the prefix cache (evicted on reuse, or uncached after a failed step).

    vLLM 0.33's pool sends one event per removed hash; so does mini-vLLM
    (``block_hashes`` has one entry, ``block_ids`` the matching block;
    ``group_idx`` the KV-cache group it was cached for). From the offloading
    tier (``medium="CPU"``): one event per eviction, with every hash it evicted.
    """

    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...] = ()
    group_idx: int = 0
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """``reset_prefix_cache`` emptied the prefix cache: every hash is gone."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


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
    | BlockStored
    | BlockRemoved
    | AllBlocksCleared
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
