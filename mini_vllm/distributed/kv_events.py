"""KV-cache events on the wire, as vLLM publishes them (``vllm/distributed/kv_events.py``).

A router in front of several replicas (``vllm-router``'s ``kv_aware`` policy,
llm-d's KV-cache indexer, Dynamo's KV router) learns what each replica has
cached from that replica's KV events, read from a ZMQ socket. This module puts
the engine's own KV events (``mini_vllm.events``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, recorded by the block pool) on that
socket in vLLM's format, so the same routers read a mini-vLLM replica as they
read a vLLM one:

* **What is sent**: one ``KVEventBatch`` per engine step (the events of that
  step, in the order they happened), encoded as msgpack by ``msgspec``. The
  batch is an array ``[ts, events, data_parallel_rank]``; each event is a map
  tagged with its class name (``{"type": "BlockStored", ...}``), its fields in
  vLLM's order, those still at their default left out. Block hashes are sent
  as vLLM sends them by default: the last 8 bytes of the hash as an unsigned
  int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: the hash's bytes).
* **How**: a ZMQ PUB socket sends each batch as three frames, ``[topic,
  sequence number (8 bytes, big-endian), payload]``; a subscriber that missed
  some asks the replay socket (ROUTER) for every batch from a sequence number
  on, out of the last ``buffer_steps`` batches, and gets them followed by an
  end marker (sequence number -1). A thread owns both sockets; the engine only
  puts batches on a queue.
* **Configured** with vLLM's ``KVEventsConfig`` fields (``serve
  --kv-events-config '{...}'``).

The engine never imports this module: ``publish_kv_events`` attaches it to an
engine as a listener, like a widget. Its hashes are the engine's own, equal to
vLLM's when both run with the same ``PYTHONHASHSEED`` (``mini_vllm/hashing.py``).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any

from .. import events as engine_events
from ..hashing import BlockHash
from ..kv_cache_interface import KVCacheConfig, SlidingWindowSpec

try:
    import msgspec
except ImportError as err:  # a dependency of the server's extra (pyproject.toml: course)
    raise ImportError(
        "KV events on the wire need the 'msgspec' package (it encodes them as vLLM does): pip install msgspec"
    ) from err
try:
    import zmq
except ImportError as err:
    raise ImportError("KV events on the wire need the 'pyzmq' package (their ZMQ sockets): pip install pyzmq") from err


# -- the configuration: vLLM's KVEventsConfig -----------------------------------------
@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``), field for field.

    ``publisher`` left out is ``"zmq"`` when events are enabled, else ``"null"``.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"  # PUB socket: bound if it has a wildcard (or is ipc://), else connected
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests (always bound)
    buffer_steps: int = 10_000  # how many past batches the replay socket can send again
    hwm: int = 100_000  # the PUB socket's high-water mark: batches queued for a slow subscriber
    max_queue_size: int = 100_000  # batches the engine may queue for the publisher thread
    topic: str = ""  # the first frame of every message (vLLM's default: empty)

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events-config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"kv-events-config: enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv-events-config: {name} must be a positive integer, got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv-events-config: {name} must be a string, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(f"kv-events-config: replay_endpoint must be a string, got {self.replay_endpoint!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv-events-config: endpoint must be tcp://, ipc:// or inproc://, got {self.endpoint!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config``'s JSON (vLLM's flag); unknown fields are a ValueError naming them."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"kv-events-config: not valid JSON ({err}): {text!r}") from None
        if not isinstance(values, dict):
            raise ValueError(f"kv-events-config: expected a JSON object, got {text!r}")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict) -> KVEventsConfig:
        """The fields by name; unknown ones are a ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"kv-events-config: unknown field(s) {unknown}; expected some of {sorted(known)}")
        return cls(**values)


# -- the wire format: vLLM's msgspec structs ----------------------------------------
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the step's events were collected
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event travels as a map with its class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block, untagged (a salt as itself)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None  # what the group's layers are: "full_attention", "sliding_window"
    kv_cache_spec_sliding_window: int | None = None
    # vLLM also has locality, ownership and session_id; it leaves them None for the engine's
    # own blocks, so they are never sent.


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(block_hash: BlockHash) -> ExternalBlockHash:
    """A block hash as vLLM puts it in an event (``maybe_convert_block_hash``).

    By default the low 64 bits of the hash (its last 8 bytes, big-endian) as an
    int: what routers index. ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` sends the
    whole hash's bytes instead.
    """
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "0":
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


GroupKind = tuple[str, int | None]  # (kv_cache_spec_kind, kv_cache_spec_sliding_window)
FULL_ATTENTION: GroupKind = ("full_attention", None)


def group_kinds(kv_cache_config: KVCacheConfig) -> tuple[GroupKind, ...]:
    """What each KV-cache group is, as a ``BlockStored`` names it (vLLM: ``get_kv_cache_spec_kind``)."""
    kinds = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            kinds.append(("sliding_window", spec.sliding_window))
        else:
            kinds.append(FULL_ATTENTION)
    return tuple(kinds)


def to_wire(event: engine_events.KVCacheEvent, kinds: tuple[GroupKind, ...] = (FULL_ATTENTION,)) -> KVCacheEvent:
    """The engine's KV event as vLLM sends it (block ids stay behind: they mean nothing to a router).

    ``kinds``: each KV-cache group's kind (``group_kinds``), which vLLM adds to every ``BlockStored``.
    """
    if isinstance(event, engine_events.BlockStored):
        parent = event.parent_block_hash
        kind, window = kinds[event.group_idx]
        return BlockStored(
            block_hashes=[external_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else external_block_hash(parent),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,  # mini-vLLM serves no LoRA adapters
            medium=event.medium,  # "GPU": the pool; "CPU": the offloading tier
            lora_name=None,
            extra_keys=list(event.extra_keys) if event.extra_keys else None,
            group_idx=event.group_idx,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )
    if isinstance(event, engine_events.BlockRemoved):
        return BlockRemoved(
            block_hashes=[external_block_hash(h) for h in event.block_hashes],
            medium=event.medium,
            group_idx=event.group_idx,
        )
    if isinstance(event, engine_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV-cache event: {type(event).__name__}")


def from_wire(event: BlockStored | BlockRemoved | AllBlocksCleared) -> engine_events.KVCacheEvent:
    """An event off the wire as the engine's event class (what the course's router observes).

    The block hashes stay as the wire carries them (``external_block_hash``): a router that
    reads them compares its own prompt hashes in that form (``CacheAwareRouter(block_key=...)``).
    """
    if isinstance(event, BlockStored):
        return engine_events.BlockStored(
            block_hashes=tuple(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            group_idx=event.group_idx or 0,
            medium=event.medium or engine_events.MEDIUM_GPU,
        )
    if isinstance(event, BlockRemoved):
        return engine_events.BlockRemoved(
            block_hashes=tuple(event.block_hashes),
            group_idx=event.group_idx or 0,
            medium=event.medium or engine_events.MEDIUM_GPU,
        )
    return engine_events.AllBlocksCleared()


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """One message's payload back into a ``KVEventBatch`` (a subscriber's side)."""
    return _decoder.decode(payload)


# -- publishers --------------------------------------------------------------------------
class NullEventPublisher:
    """``publisher: "null"``: events go nowhere."""

    def publish(self, batch: KVEventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address (or a local ipc/inproc one) is bound; any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket for the batches, ROUTER socket for replays, one thread owning both (vLLM's ZmqEventPublisher).

    ``publish`` only queues the batch; the thread numbers it (0, 1, 2, ...),
    encodes it, sends ``[topic, seq, payload]`` and keeps ``(seq, payload)``
    for replays. Between batches it answers replay requests: a request is
    ``[client id, b"", start seq]`` and gets every kept batch from ``start
    seq`` on as ``[client id, b"", topic, seq, payload]``, then ``[client id,
    b"", b"", END_SEQ, b""]``.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = context.socket(zmq.ROUTER) if config.replay_endpoint else None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if self._replay is not None:
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise OSError(f"kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: {err}") from err
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if not self._running:
            raise RuntimeError("the KV-events publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        self._queue.put(batch)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._kept.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request: [client id, b"", start seq]
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config`` asks for (vLLM's ``EventPublisherFactory.create``)."""
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(config)


# -- from the engine's events to batches -------------------------------------------------
class StepBatcher:
    """An engine listener: the KV events of each engine step, published as one batch when the step ends.

    As vLLM's scheduler publishes them (``Scheduler.update_from_output``: one
    ``KVEventBatch`` of what the block pool recorded during the step). An
    ``AllBlocksCleared`` from a reset between steps is sent at once: no step
    may follow it for a while, and a router must not keep routing to a cache
    that is gone.
    """

    def __init__(
        self, publisher: ZmqEventPublisher | NullEventPublisher, kinds: tuple[GroupKind, ...] = (FULL_ATTENTION,)
    ) -> None:
        self.publisher = publisher
        self.kinds = kinds
        self._pending: list[KVCacheEvent] = []

    def __call__(self, event: engine_events.EngineEvent) -> None:
        if isinstance(event, (engine_events.BlockStored, engine_events.BlockRemoved)):
            self._pending.append(to_wire(event, self.kinds))
        elif isinstance(event, engine_events.AllBlocksCleared):
            self._pending.append(to_wire(event, self.kinds))
            self.flush()
        elif isinstance(event, engine_events.StepFinished):
            self.flush()

    def flush(self) -> None:
        if self._pending:
            events, self._pending = self._pending, []
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))


class KVEventsPublication:
    """A publisher attached to an engine; ``close()`` detaches it and closes its sockets."""

    def __init__(self, engine: Any, config: KVEventsConfig) -> None:
        self.engine = engine
        self.config = config
        self.publisher = make_publisher(config)
        self.batcher = StepBatcher(self.publisher, group_kinds(engine.kv_cache_config))
        engine.add_listener(self.batcher)

    def close(self) -> None:
        self.engine.remove_listener(self.batcher)
        self.batcher.flush()
        self.publisher.shutdown()


def publish_kv_events(engine: Any, config: KVEventsConfig) -> KVEventsPublication:
    """Publish ``engine``'s KV events as ``config`` says (an ``LLMEngine``; ``LLM.llm_engine``)."""
    return KVEventsPublication(engine, config)


# -- a subscriber (tests, the course's router) ---------------------------------------------
class KVEventSubscriber:
    """Reads a replica's batches: ``receive()`` from its PUB socket, ``replay(seq)`` from its ROUTER socket."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        context = zmq.Context.instance()
        self._sub = context.socket(zmq.SUB)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._next_seq = 0  # the batch take_events expects next: a larger one means batches were missed

    def receive(self, timeout_s: float = 1.0) -> tuple[int, KVEventBatch] | None:
        """The next ``(seq, batch)``, or None if none came within ``timeout_s``."""
        if not self._sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self._sub.recv_multipart()
        return int.from_bytes(seq, "big"), decode_batch(payload)

    def replay(self, start_seq: int, timeout_s: float = 5.0) -> list[tuple[int, KVEventBatch]]:
        """Every batch the replica still keeps from ``start_seq`` on."""
        if self.replay_endpoint is None:
            raise ValueError("this subscriber has no replay_endpoint")
        # A DEALER, not a REQ: one request gets many replies. ROUTER sees [our id, b"", start seq].
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.connect(self.replay_endpoint)
        try:
            socket.send_multipart((b"", start_seq.to_bytes(8, "big")))
            batches = []
            while True:
                if not socket.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"no replay from {self.replay_endpoint} within {timeout_s} s")
                _, topic, seq, payload = socket.recv_multipart()
                if seq == END_SEQ:
                    return batches
                batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        finally:
            socket.close(linger=0)

    def take_events(self, settle_s: float = 0.2) -> list[engine_events.KVCacheEvent]:
        """Every event published since the last call, oldest first, as the engine's classes (``from_wire``).

        Reads batches until none comes for ``settle_s``. A gap in the sequence numbers (batches sent
        before this subscriber connected: a PUB socket keeps nothing for a late subscriber) is filled
        from the replay socket first, as vLLM's subscribers do; without one, the gap stays a gap.

        A sequence number below the expected one is a new stream: the replica restarted, its
        publisher numbers from 0 again, and the cache it had is gone. Its events come after an
        ``AllBlocksCleared``, so that a router's mirror of that replica forgets the old cache too,
        and the count starts over (a restart is seen only if the new stream has not yet sent as
        many batches as the old one had when this subscriber last read it).
        """
        batches: list[KVEventBatch] = []
        while (received := self.receive(settle_s)) is not None:
            seq, batch = received
            if seq < self._next_seq:  # a restarted replica's new stream
                batches.append(KVEventBatch(ts=batch.ts, events=[AllBlocksCleared()]))
                self._next_seq = 0
            if seq > self._next_seq and self.replay_endpoint is not None:
                batches += [b for s, b in self.replay(self._next_seq) if self._next_seq <= s < seq]
            batches.append(batch)
            self._next_seq = seq + 1
        return [from_wire(event) for batch in batches for event in batch.events]

    def close(self) -> None:
        self._sub.close(linger=0)


def config_dict(config: KVEventsConfig) -> dict:
    """``config`` as the JSON object ``--kv-events-config`` takes (for starting vLLM with the same one)."""
    return asdict(config)
