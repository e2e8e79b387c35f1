"""KV events on the wire (``mini_vllm/distributed/kv_events.py``): vLLM's format, over ZMQ.

An engine publishes; a subscriber on the other end of a real socket reads the batches back.
That they decode with vLLM's own classes and equal vLLM's stream is
``tests/vs_vllm/test_vs_vllm_kv_events.py``; here: the format, the sequence numbers, the
topic, the replay socket, the configuration's checks.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from mini_vllm import LLM, SamplingParams
from mini_vllm.distributed.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    KVEventSubscriber,
    NullEventPublisher,
    external_block_hash,
    make_publisher,
    publish_kv_events,
)
from mini_vllm.hashing import hash_request_tokens
from mini_vllm.tools.compare_kv_events import first_difference, free_port


def test_the_configuration_takes_vllms_fields_and_defaults():
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.topic, config.buffer_steps, config.hwm) == (
        "zmq",
        "tcp://*:5557",
        "",
        10_000,
        100_000,
    )
    assert config.replay_endpoint is None and config.publishes
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().publishes
    assert isinstance(make_publisher(KVEventsConfig()), NullEventPublisher)
    assert isinstance(make_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null")), NullEventPublisher)


@pytest.mark.parametrize(
    "text, named",
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "endpont"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"hwm": "many"}', "hwm"),
        ('{"endpoint": "http://x:1"}', "endpoint"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ("[1]", "JSON object"),
        ('{"enable_kv_cache_events": tru', "not valid JSON"),
    ],
)
def test_a_bad_configuration_is_a_value_error_naming_what_is_wrong(text, named):
    with pytest.raises(ValueError, match=named):
        KVEventsConfig.from_json(text)


def test_block_hashes_go_out_as_vllm_sends_them(monkeypatch):
    block_hash = bytes(range(32))
    assert external_block_hash(block_hash) == int.from_bytes(bytes(range(24, 32)), "big")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert external_block_hash(block_hash) == block_hash


def test_a_batch_is_an_array_and_each_event_a_map_tagged_with_its_type():
    from mini_vllm.distributed.kv_events import KVEventBatch

    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[7], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0,
            ),
            BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch)) == [
        1.5,
        [
            {
                "type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2],
                "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None],
                "group_idx": 0,
            },
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]  # fmt: skip


def _receive_all(subscriber: KVEventSubscriber, quiet_s: float = 0.5) -> list:
    received = []
    while (message := subscriber.receive(quiet_s)) is not None:
        received.append(message)
    return received


@pytest.fixture(scope="module")
def engine_and_subscriber():
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        buffer_steps=3,
        topic="replica-a",
    )
    llm = LLM(device="cpu", block_size=16, num_blocks=8, max_model_len=128)
    publication = publish_kv_events(llm.llm_engine, config)
    subscriber = KVEventSubscriber(
        f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="replica-a"
    )
    time.sleep(0.5)  # a SUB socket misses what is published before it has joined
    yield llm, subscriber
    subscriber.close()
    publication.close()


def test_an_engine_publishes_each_steps_events_numbered_in_order(engine_and_subscriber):
    llm, subscriber = engine_and_subscriber
    prompt = list(range(100, 140))  # 2 full blocks of 16, 8 tokens more
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0))
    received = _receive_all(subscriber)
    assert [seq for seq, _ in received] == list(range(len(received))) and received
    events = [event for _, batch in received for event in batch.events]
    assert all(batch.data_parallel_rank == 0 for _, batch in received)
    stored = events[0]
    hashes = hash_request_tokens(prompt, 16)
    assert isinstance(stored, BlockStored) and len(events) == 1  # 2 blocks, one event; the tail never fills
    assert stored.block_hashes == [external_block_hash(h) for h in hashes]
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size) == (None, prompt[:32], 16)
    assert (stored.group_idx, stored.medium, stored.kv_cache_spec_kind, stored.extra_keys) == (
        0,
        "GPU",
        "full_attention",
        [None, None],
    )

    # A reset is sent at once (no step needs to follow it), numbered after the step before.
    llm.reset_prefix_cache()
    cleared = _receive_all(subscriber)
    assert [type(e) for _, b in cleared for e in b.events] == [AllBlocksCleared]  # at once, no step needed
    assert cleared[0][0] == received[-1][0] + 1


def test_an_eviction_is_a_block_removed_event_and_a_salt_an_extra_key(engine_and_subscriber):
    llm, subscriber = engine_and_subscriber
    params = SamplingParams(max_tokens=1, temperature=0)
    for start in (0, 200, 400):  # 3 prompts of 3 blocks in a pool of 8: the third evicts
        llm.generate([{"prompt_token_ids": list(range(start, start + 48)), "cache_salt": "t"}], params)
    events = [event for _, batch in _receive_all(subscriber) for event in batch.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [len(e.block_hashes) for e in stored] == [3, 3, 3]
    assert stored[0].extra_keys == [("t",), None, None]  # the salt enters block 0 only (untagged, as vLLM sends it)
    assert len(removed) == 1 and len(removed[0].block_hashes) == 1  # 2 free blocks, then the oldest cached one
    assert {h for e in removed for h in e.block_hashes} <= {h for e in stored[:2] for h in e.block_hashes}


def test_the_replay_socket_sends_the_kept_batches_from_a_sequence_number_on(engine_and_subscriber):
    llm, subscriber = engine_and_subscriber
    llm.reset_prefix_cache()
    for start in (600, 700, 800, 900):
        llm.generate([{"prompt_token_ids": list(range(start, start + 17))}], SamplingParams(max_tokens=1))
    live = _receive_all(subscriber)
    last = live[-1][0]
    replayed = subscriber.replay(last - 1)
    assert [seq for seq, _ in replayed] == [last - 1, last]
    assert [b.events for _, b in replayed] == [b.events for _, b in live[-2:]]
    kept = subscriber.replay(0)  # buffer_steps=3: only the last 3 are kept
    assert [seq for seq, _ in kept] == [last - 2, last - 1, last]


def test_a_replay_request_gets_vllms_frames(engine_and_subscriber):
    # What a router's replay client sees: [b"", topic, seq, payload] per batch, then the end marker.
    _, subscriber = engine_and_subscriber
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(subscriber.replay_endpoint)
    socket.send_multipart((b"", (10**6).to_bytes(8, "big")))  # past the end: only the end marker
    assert socket.poll(5000)
    assert socket.recv_multipart() == [b"", b"", END_SEQ, b""]
    socket.close(linger=0)


def test_a_subscriber_of_another_topic_gets_nothing(engine_and_subscriber):
    llm, subscriber = engine_and_subscriber
    endpoint = subscriber._sub.getsockopt_string(zmq.LAST_ENDPOINT)
    other = KVEventSubscriber(endpoint, topic="replica-b")
    time.sleep(0.3)
    llm.reset_prefix_cache()
    assert other.receive(0.5) is None
    assert subscriber.receive(2.0) is not None
    other.close()


def test_an_endpoint_in_use_is_a_clear_error():
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    first = make_publisher(config)
    try:
        with pytest.raises(OSError, match=f"tcp://\\*:{port}"):
            make_publisher(config)
    finally:
        first.shutdown()


def test_the_comparison_with_vllms_stream_flags_a_difference():
    event = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}
    assert first_difference([event], [event]) is None
    assert "event 0" in first_difference([event], [{**event, "block_hashes": [2]}])
    assert "1 events, vLLM 2" in first_difference([event], [event, event])


@pytest.mark.parametrize("module, package", [("msgspec", "msgspec"), ("zmq", "pyzmq")])
def test_without_its_dependencies_the_error_names_the_package_to_install(module, package):
    import subprocess
    import sys

    code = f"import sys; sys.modules[{module!r}] = None; import mini_vllm.distributed.kv_events"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert f"ImportError: KV events on the wire need the {package!r} package" in completed.stderr


def test_a_tier_event_goes_on_the_wire_with_its_medium():
    # The offloading tier's events (mini_vllm/kv_offload) carry medium "CPU", as vLLM's OffloadingConnector sends them.
    from mini_vllm import events as engine_events
    from mini_vllm.distributed.kv_events import to_wire

    stored = engine_events.BlockStored(
        block_hashes=(b"\x01" * 32,),
        parent_block_hash=None,
        token_ids=(),
        block_size=0,
        medium=engine_events.MEDIUM_CPU,
    )
    removed = engine_events.BlockRemoved(block_hashes=(b"\x01" * 32,), medium=engine_events.MEDIUM_CPU)
    assert to_wire(stored).medium == "CPU"
    assert to_wire(removed).medium == "CPU"
    pool = engine_events.BlockStored(block_hashes=(b"\x02" * 32,), parent_block_hash=None, token_ids=(1,), block_size=1)
    assert to_wire(pool).medium == "GPU"


def test_a_late_subscriber_takes_what_it_missed_from_the_replay_socket(engine_and_subscriber):
    # A router that connects after the replica started: the PUB socket kept nothing for it, so
    # take_events fills the gap from the replay socket and hands over the engine's event classes.
    from mini_vllm import events as engine_events

    llm, subscriber = engine_and_subscriber
    llm.reset_prefix_cache()
    prompt = list(range(1000, 1033))  # 2 full blocks of 16
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1))
    _receive_all(subscriber)
    late = KVEventSubscriber(
        subscriber._sub.getsockopt_string(zmq.LAST_ENDPOINT), subscriber.replay_endpoint, "replica-a"
    )
    time.sleep(0.5)
    try:
        llm.generate([{"prompt_token_ids": list(range(1100, 1117))}], SamplingParams(max_tokens=1))
        events = late.take_events()
    finally:
        late.close()
    stored = [e for e in events if isinstance(e, engine_events.BlockStored)]
    assert isinstance(events[0], engine_events.AllBlocksCleared), events  # the reset, replayed
    assert stored[0].block_hashes == tuple(external_block_hash(h) for h in hash_request_tokens(prompt, 16))
    assert len(stored) == 2 and stored[1].token_ids == tuple(range(1100, 1116))  # then the live batch


def _publisher_on(config: KVEventsConfig, timeout_s: float = 5.0):
    """A new publisher on ``config``'s ports, once the closed one's sockets have let them go."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return make_publisher(config)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_restarted_replicas_new_stream_clears_the_mirror_and_is_read(monkeypatch):
    # A replica restarts: a new publisher on the same endpoint numbers its batches from 0 again. The
    # subscriber takes a number below the expected one as a new stream: an AllBlocksCleared first (the old
    # cache is gone), then the new batches, the one it missed while reconnecting filled from the replay socket.
    from mini_vllm import events as engine_events
    from mini_vllm.companions.router import CacheAwareRouter
    from mini_vllm.distributed.kv_events import KVEventBatch

    def stored(block_hash: int) -> KVEventBatch:
        event = BlockStored(
            block_hashes=[block_hash], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
            medium="CPU", lora_name=None,
        )  # fmt: skip
        return KVEventBatch(ts=time.time(), events=[event])

    port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}"
    )
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    router = CacheAwareRouter(1)
    publisher = make_publisher(config)
    try:
        time.sleep(0.5)  # the subscriber joins
        for block_hash in (1, 2, 3):
            publisher.publish(stored(block_hash))
        before = subscriber.take_events(settle_s=0.5)
        router.observe(0, before)
        assert [e.block_hashes for e in before] == [(1,), (2,), (3,)]
        publisher.shutdown()
        publisher = _publisher_on(config)  # the replica restarted
        after, published = [], []
        for block_hash in range(4, 100):  # a batch sent before the subscriber has reconnected reaches only the replay
            publisher.publish(stored(block_hash))
            published.append(block_hash)
            if after := subscriber.take_events(settle_s=0.3):
                break
        router.observe(0, after)
    finally:
        subscriber.close()
        publisher.shutdown()
    assert isinstance(after[0], engine_events.AllBlocksCleared), after
    assert [e.block_hashes for e in after[1:]] == [(h,) for h in published]  # seq 0, 1, ...: none lost
    assert set(router.cached[0]) == set(published)  # the mirror forgot the blocks of the replica's first life
