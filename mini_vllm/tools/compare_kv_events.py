"""mini-vLLM's KV-event stream against vLLM's, both decoded by vLLM's own classes.

The same workloads (``compare_vllm.build_workloads``) run through mini-vLLM, publishing
its KV events over ZMQ (``mini_vllm/distributed/kv_events.py``), and through real vLLM
started with the same ``--kv-events-config``. A subscriber records every message of each
stream; both streams are then decoded in vLLM's virtualenv by vLLM's ``KVEventBatch``
(``tools/vllm_side/run_vllm.py``). Equal streams mean a router reading vLLM's events reads
mini-vLLM's the same way: the same hashes (with the same ``PYTHONHASHSEED``), parents,
token ids, block sizes, groups and media, in the same order.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from .compare_vllm import (
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    engine_max_model_len,
    run_mini_workloads,
    run_vllm_job,
)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def local_endpoint(endpoint: str) -> str:
    """Where a subscriber on this machine connects to a publisher bound at ``endpoint``."""
    return endpoint.replace("*", "127.0.0.1")


def record_mini_stream(
    model_path: str | None, block_size: int, num_blocks: int, workloads: list[dict], kv_events_config: dict
) -> list[tuple[str, int, bytes]]:
    """Run ``workloads`` on a mini-vLLM ``LLM`` that publishes its KV events; every message, as sent."""
    import zmq

    from ..distributed.kv_events import KVEventsConfig, publish_kv_events
    from ..llm import LLM

    config = KVEventsConfig(**kv_events_config)
    llm = LLM(
        model_path,
        device="cpu",
        dtype="float32",
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=engine_max_model_len(block_size, num_blocks),
    )
    publication = publish_kv_events(llm.llm_engine, config)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(local_endpoint(config.endpoint))
    subscriber.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
    time.sleep(0.5)  # a SUB socket misses what is published before it has joined
    try:
        run_mini_workloads(llm, workloads)
    finally:
        publication.close()  # sends what is queued
    messages = []
    while subscriber.poll(1000):
        topic, seq, payload = subscriber.recv_multipart()
        messages.append((topic.decode(), int.from_bytes(seq, "big"), payload))
    subscriber.close(linger=0)
    return messages


def compare_streams(
    model_path: str,
    block_size: int,
    num_blocks: int,
    workloads: list[dict],
    kv_events_config: dict | None = None,
    timeout_s: int = 900,
    release_source: str | None = None,
) -> dict:
    """Both streams, decoded by vLLM: ``{"mini": [batch, ...], "vllm": [batch, ...], "vllm_version"}``.

    A batch is ``{"topic", "seq", "data_parallel_rank", "events": [{"type", ...fields}]}``.
    With ``release_source`` (a release's Python files, ``.vllm-<version>/src``) both streams are
    decoded again by that release's classes: ``"release": {"version", "mini", "vllm"}``.
    ``kv_events_config`` defaults to vLLM's defaults on a free port; both engines get the
    same one but for the port. Both must run with the same ``PYTHONHASHSEED`` (set it in
    this process's environment: vLLM's subprocess inherits it).
    """
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "", **(kv_events_config or {})}
    mini_config = {**config, "endpoint": f"tcp://*:{free_port()}"}
    vllm_config = {**config, "endpoint": f"tcp://*:{free_port()}"}
    messages = record_mini_stream(model_path, block_size, num_blocks, workloads, mini_config)
    job = {
        "threads": 1,
        "decode_kv_events": [payload.hex() for _, _, payload in messages],
        "engines": [
            {
                "model": model_path,
                "dtype": "float32",
                "block_size": block_size,
                "num_blocks": num_blocks,
                "max_model_len": engine_max_model_len(block_size, num_blocks),
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "workloads": workloads,
                "kv_events_config": vllm_config,
            }
        ],
    }
    result = run_vllm_job(job, timeout_s)
    mini = [
        {"topic": topic, "seq": seq, **batch} for (topic, seq, _), batch in zip(messages, result["decoded_kv_events"])
    ]
    theirs = result["engines"][0]["kv_events"]
    streams = {"mini": mini, "vllm": theirs, "vllm_version": result["vllm_version"]}
    if release_source is not None:
        payloads = [payload.hex() for _, _, payload in messages] + [batch["payload"] for batch in theirs]
        decoded = run_vllm_job({"decode_kv_events": payloads}, timeout_s, pythonpath=release_source)
        batches = decoded["decoded_kv_events"]
        streams["release"] = {
            "version": decoded["vllm_version"],
            "mini": batches[: len(messages)],
            "vllm": batches[len(messages) :],
        }
    return streams


def flat_events(batches: Sequence[dict]) -> list[dict]:
    """Every event of every batch, in order (vLLM sends a reset's ``AllBlocksCleared`` with its next
    step's events, mini-vLLM at once: the batches may be cut differently, the sequence may not)."""
    return [event for batch in batches for event in batch["events"]]


def first_difference(mini: Sequence[dict], vllm: Sequence[dict]) -> str | None:
    """None when the two event sequences are equal, else where and how they first differ."""
    for index, (ours, theirs) in enumerate(zip(mini, vllm)):
        if ours != theirs:
            return f"event {index}: mini-vLLM sent {ours}, vLLM sent {theirs}"
    if len(mini) != len(vllm):
        return f"mini-vLLM sent {len(mini)} events, vLLM {len(vllm)}"
    return None
