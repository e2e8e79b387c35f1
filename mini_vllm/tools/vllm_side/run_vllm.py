"""Run workloads through real vLLM and print what it did, as JSON.

Started by ``mini_vllm.tools.compare_vllm`` (and ``training/check_hybrid_model.py``) as
``.venv-vllm/bin/python run_vllm.py IN.json OUT.json`` (``-`` for stdin / stdout).
It imports only vLLM and the standard library: it runs in vLLM's own
virtualenv, not in mini-vLLM's.

The input is ``{"threads": 1, "probes": false, "configuration": "comparable",
"engines": [spec, ...]}`` (``probes``: also drive vLLM's cache classes directly,
see ``run_probes``; ``configuration``: ``"comparable"``, the default, runs vLLM
with the settings listed below, ``"default"`` with vLLM's own defaults on a CPU:
graph compilation, asynchronous scheduling, the engine core in its own process);
each spec names one engine's settings and its workloads::

    {"model": "...", "block_size": 32, "dtype": "float32", "num_blocks": 64,
     "max_model_len": 1024, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
     "workloads": [{"name": "...", "calls": [
         {"prompts": [{"prompt_token_ids": [...], "cache_salt": "a"}],
          "sampling": {"temperature": 0, "max_tokens": 8, "n": 1}},
         {"prompts": [{"continue_chat": [...]}], "sampling": {...}}]}]}

Optional keys of a spec: ``"model_impl"`` (``vllm.LLM(model_impl=...)``, e.g.
``"transformers"``: vLLM's Transformers backend, which honours a config's
``layer_types`` -- vLLM's native Qwen3 has no per-layer windows: it refuses a
config that mixes layer types unless ``max_window_layers == num_hidden_layers``,
and then runs every layer with full attention; default: vLLM's own choice,
``"auto"``) and ``"async_scheduling"`` (default false), ``"prefix_cache_retention_interval"`` and
``"disable_hybrid_kv_cache_manager"`` (vLLM's settings; default: vLLM's), and ``"kv_events_config"`` (vLLM's
``--kv-events-config`` as a dict: the engine publishes its KV events, this
process subscribes to them before the workloads run, and the engine's result
has ``"kv_events"``: every batch received, decoded with vLLM's own
``KVEventBatch``, as plain lists and dicts, ``ts`` left out, with its
``"payload"`` as sent, in hex).
The job's optional ``"decode_kv_events"`` (payloads as hex, e.g. mini-vLLM's)
comes back decoded the same way, as ``"decoded_kv_events"``.
A call's ``"sampling"`` goes to ``SamplingParams`` as it is; with ``"logprobs"`` /
``"prompt_logprobs"`` in it (0 is enough), each request's result also has
``"logprobs"`` (per sample, each generated token's log-probability) /
``"prompt_logprobs"`` (each prompt token's, None for the first).
Each engine's result has ``"kv_cache"``: the KV-cache groups vLLM built (each
group's layers and spec: ``FullAttentionSpec``, ``SlidingWindowSpec`` with its
window) and the coordinator class serving them.

One ``vllm.LLM`` per spec serves all its workloads (starting one costs tens of
seconds), and the specs run one after another, never two engines at once:
before each workload the prefix cache is reset, and the counters are read
before and after, so each workload starts cold and reports its own counts.
Each call is one ``llm.generate`` with all its prompts, as mini-vLLM gets it.

Settings that make vLLM comparable with mini-vLLM (why each is needed):
* ``num_gpu_blocks_override = num_blocks + 1``: vLLM keeps block 0 as its null
  block, so a pool of N + 1 blocks serves N, as many as mini-vLLM's.
* ``enforce_eager=True``: no graph compilation (start-up ~1 s instead of minutes).
* ``async_scheduling=False`` and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the
  engine core in this process): by default vLLM schedules step N+1 while step N
  computes, so a request that finished in step N frees its blocks one step
  later; under memory pressure that preempts a request that mini-vLLM (which
  schedules after each step) does not. With both set, step-by-step traces of
  the two schedulers match (vLLM's block ids are one higher: its null block);
  with the engine core in its own process, vLLM 0.32 still preempted once more.
* ``disable_log_stats=False``: ``llm.get_metrics()`` then reports
  ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``.
* ``gpu_memory_utilization=0.5`` and ``VLLM_CPU_KVCACHE_SPACE`` (GiB) small: the
  defaults ask for more memory than a laptop has.
* ``VLLM_CPU_OMP_THREADS_BIND``: the CPU cores vLLM's worker computes on
  (``threads`` in the input: 1 -> core "0", 2 -> "0-1").
"""

from __future__ import annotations

import json
import os
import sys
import time


CONFIGURATIONS = ("comparable", "default")


def _set_environment(threads: int, configuration: str = "comparable") -> None:
    """vLLM reads these when it starts; they must be set before ``import vllm``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the pool is fixed below anyway
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if configuration == "comparable":
        # The engine core in this process (no separate engine process): steps run one after
        # another, as mini-vLLM's (see the module docstring), and one process fewer starts.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _counters(llm) -> dict:
    """The engine's cumulative counters, by their Prometheus names."""
    wanted = {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:generation_tokens"}
    values = {name: 0 for name in wanted}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            values[metric.name] += int(metric.value)
    return values


def _kv_cache_groups(llm) -> dict | None:
    """The KV-cache groups vLLM built (a hybrid model has one per attention kind) and the
    coordinator class that serves them; None where this vLLM keeps them out of reach."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # the in-process engine core
        groups = scheduler.kv_cache_config.kv_cache_groups
        coordinator = type(scheduler.kv_cache_manager.coordinator).__name__
    except AttributeError:
        return None
    return {
        "coordinator": coordinator,
        "groups": [
            {
                "layers": list(group.layer_names),
                "spec": type(group.kv_cache_spec).__name__,
                "block_size": group.kv_cache_spec.block_size,
                "sliding_window": getattr(group.kv_cache_spec, "sliding_window", None),
            }
            for group in groups
        ],
    }


def _chosen_logprobs(token_ids, logprobs) -> list[float]:
    """The log-probability of each token in ``token_ids`` (vLLM gives a {token: Logprob} per position)."""
    return [float(position[token].logprob) for token, position in zip(token_ids, logprobs)]


def resolve_prompt(prompt: dict, previous) -> list[int]:
    """A prompt's token ids. ``{"continue_chat": [...]}`` means: the previous call's
    last prompt + the tokens the engine generated for it + these new tokens (the
    next turn of a chat, built from this engine's own reply)."""
    if "continue_chat" in prompt:
        if previous is None:
            raise ValueError("continue_chat needs a previous call in the workload")
        previous_prompt, previous_reply = previous
        return previous_prompt + previous_reply + list(prompt["continue_chat"])
    return list(prompt["prompt_token_ids"])


def call_prompts(call: dict, previous) -> list[dict]:
    """One call's prompts as an engine's ``generate`` takes them: token ids (``resolve_prompt``),
    and the cache salt where the prompt has one. mini-vLLM's runner imports this too."""
    prompts = []
    for prompt in call["prompts"]:
        entry = {"prompt_token_ids": resolve_prompt(prompt, previous)}
        if prompt.get("cache_salt") is not None:
            entry["cache_salt"] = prompt["cache_salt"]
        prompts.append(entry)
    return prompts


def run_workload(llm, workload: dict) -> dict:
    """Send every call of one workload through ``llm``; return per-request results and counters."""
    from vllm import SamplingParams

    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
    before = _counters(llm)
    requests = []
    elapsed = 0.0
    previous = None
    for call_index, call in enumerate(workload["calls"]):
        sampling = dict(call.get("sampling", {}))
        sampling.setdefault("temperature", 0.0)
        params = SamplingParams(**sampling)
        prompts = call_prompts(call, previous)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed += time.perf_counter() - start
        previous = (list(outputs[-1].prompt_token_ids), list(outputs[-1].outputs[0].token_ids))
        for prompt_index, output in enumerate(outputs):
            metrics = output.metrics
            ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
            request = {
                "call": call_index,
                "index": prompt_index,
                "num_prompt_tokens": len(output.prompt_token_ids),
                "num_cached_tokens": int(output.num_cached_tokens or 0),
                "token_ids": [list(c.token_ids) for c in output.outputs],
                "ttft_s": ttft,
            }
            if params.logprobs is not None:  # each generated token's log-probability
                request["logprobs"] = [_chosen_logprobs(c.token_ids, c.logprobs) for c in output.outputs]
            if params.prompt_logprobs is not None:  # each prompt token's (None for the first)
                prompt_ids = output.prompt_token_ids
                request["prompt_logprobs"] = [None] + _chosen_logprobs(prompt_ids[1:], output.prompt_logprobs[1:])
            requests.append(request)
    after = _counters(llm)
    delta = {name: after[name] - before[name] for name in after}
    return {
        "name": workload["name"],
        "requests": requests,
        "prefix_cache_queries": delta["vllm:prefix_cache_queries"],
        "prefix_cache_hits": delta["vllm:prefix_cache_hits"],
        "num_preemptions": delta["vllm:num_preemptions"],
        "num_generated_tokens": delta["vllm:generation_tokens"],
        "elapsed_s": elapsed,
    }


# -- probes: vLLM's own cache classes, driven directly (Appendix A) ---------------------
def probe_block_hashes() -> list[str]:
    """vLLM's chained SHA-256 block hashes of tokens 100..147, block size 16 (hex)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)  # what the engine does at start-up
    tokens = list(range(100, 148))
    hashes, parent = [], None
    for start in range(0, len(tokens), 16):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start : start + 16], None)
        hashes.append(bytes(parent).hex())
    return hashes


def probe_free_queue() -> list[int]:
    """Appendix A's free-queue steps on vLLM's ``FreeKVCacheBlockQueue``: pop three from the
    head, take block 5 out of the middle (a cache hit), give the three back in reverse
    (a request freed), put block 5 at the head (a block without a hash)."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    blocks = [KVCacheBlock(i) for i in range(8)]
    queue = FreeKVCacheBlockQueue(blocks)
    popped = [queue.popleft() for _ in range(3)]
    queue.remove(blocks[5])
    for block in reversed(popped):
        queue.append(block)
    queue.prepend_n([blocks[5]])
    return [block.block_id for block in queue.get_all_free_blocks()]


def probe_block_pool() -> dict:
    """A vLLM ``BlockPool`` of 8 blocks: allocate 3, free them in reverse."""
    import inspect

    from vllm.v1.core.block_pool import BlockPool

    kwargs = {"num_gpu_blocks": 8, "enable_caching": True}
    if "hash_block_size" in inspect.signature(BlockPool).parameters:
        kwargs["hash_block_size"] = 16
    pool = BlockPool(**kwargs)
    allocated = pool.get_new_blocks(3)
    result = {"allocated": [b.block_id for b in allocated], "null_block": pool.null_block.block_id}
    pool.free_blocks(reversed(allocated))
    result["free_queue"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    return result


def run_probes() -> dict:
    probes = {}
    for name, probe in (
        ("block_hashes", probe_block_hashes),
        ("free_queue", probe_free_queue),
        ("block_pool", probe_block_pool),
    ):
        try:
            probes[name] = probe()
        except Exception as err:  # the API moves between releases: report, do not fail the run
            probes[name] = f"this vLLM's API differs ({type(err).__name__}: {err})"
    return probes


def run_engine(spec: dict, configuration: str = "comparable") -> dict:
    """Start one ``vllm.LLM`` with ``spec``'s settings, run its workloads, shut it down.

    ``configuration="default"`` leaves graph compilation and asynchronous
    scheduling to vLLM's defaults (``enforce_eager`` and ``async_scheduling`` unset).
    """
    import gc

    from vllm import LLM

    start = time.perf_counter()
    options = {}
    if spec.get("model_impl") is not None:  # else vLLM's default ("auto")
        options["model_impl"] = spec["model_impl"]
    if configuration == "comparable":
        options["enforce_eager"] = True
        options["async_scheduling"] = spec.get("async_scheduling", False)
    for name in ("prefix_cache_retention_interval", "disable_hybrid_kv_cache_manager"):
        if name in spec:  # vLLM's settings of the same names, as the spec gives them
            options[name] = spec[name]
    if spec.get("kv_events_config") is not None:
        from vllm.config.kv_events import KVEventsConfig

        options["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=spec["block_size"],
        enable_prefix_caching=True,
        num_gpu_blocks_override=spec["num_blocks"] + 1,  # + vLLM's null block
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        gpu_memory_utilization=0.5,
        disable_log_stats=False,
        seed=0,
        **options,
    )
    startup_s = time.perf_counter() - start
    subscriber = _subscribe(spec["kv_events_config"]) if spec.get("kv_events_config") is not None else None
    try:
        workloads = [run_workload(llm, workload) for workload in spec["workloads"]]
        kv_events = _drain(subscriber) if subscriber is not None else None
        num_gpu_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        kv_cache = _kv_cache_groups(llm)
    finally:
        # One vLLM at a time: stop this engine's processes before the next one starts.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {
        "block_size": spec["block_size"],
        "num_blocks": spec["num_blocks"],
        "num_gpu_blocks": num_gpu_blocks,
        "kv_cache": kv_cache,
        "startup_s": startup_s,
        "workloads": workloads,
        "kv_events": kv_events,
    }


# -- KV events: vLLM's stream, decoded with vLLM's classes ------------------------------
def _subscribe(config: dict):
    """A SUB socket on the engine's KV-event endpoint (a wildcard address read as this machine)."""
    import zmq

    endpoint = config.get("endpoint", "tcp://*:5557").replace("*", "127.0.0.1")
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.connect(endpoint)
    socket.setsockopt(zmq.SUBSCRIBE, config.get("topic", "").encode())
    time.sleep(0.5)  # a SUB socket misses what is published before it has joined
    return socket


def decode_kv_event_payloads(payloads: list[bytes]) -> list[dict]:
    """Each payload through vLLM's own decoder (``KVEventBatch``), as plain data without ``ts``."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = []
    for payload in payloads:
        batch = decoder.decode(payload)
        batches.append(
            {
                "data_parallel_rank": batch.data_parallel_rank,
                "events": [{"type": type(event).__name__, **msgspec.structs.asdict(event)} for event in batch.events],
            }
        )
    return json.loads(json.dumps(batches, default=list))  # tuples (extra keys) as lists


def _drain(socket, quiet_s: float = 1.0) -> list[dict]:
    """Every message until none has come for ``quiet_s``: ``{"seq", "topic", ...the decoded batch}``."""
    frames = []
    while socket.poll(int(quiet_s * 1000)):
        frames.append(socket.recv_multipart())
    socket.close(linger=0)
    decoded = decode_kv_event_payloads([payload for _, _, payload in frames])
    return [
        {"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "payload": payload.hex(), **batch}
        for (topic, seq, payload), batch in zip(frames, decoded)
    ]


def main(argv: list[str]) -> int:
    """``IN.json`` holds ``{"threads": 1, "probes": false, "engines": [spec, ...]}``; each spec as in
    the module docstring; ``probes`` also drives vLLM's cache classes directly (``run_probes``)."""
    if len(argv) != 3:
        print("usage: run_vllm.py IN.json|- OUT.json|-", file=sys.stderr)
        return 2
    if argv[1] == "-":
        job = json.load(sys.stdin)
    else:
        with open(argv[1]) as handle:
            job = json.load(handle)
    threads = int(job.get("threads", 1))
    configuration = job.get("configuration", "comparable")
    if configuration not in CONFIGURATIONS:
        print(f"configuration must be one of {CONFIGURATIONS}, got {configuration!r}", file=sys.stderr)
        return 2
    _set_environment(threads, configuration)

    import vllm

    results = {
        "vllm_version": vllm.__version__,
        "threads": threads,
        "probes": run_probes() if job.get("probes") else None,
        "configuration": configuration,
        "engines": [run_engine(spec, configuration) for spec in job.get("engines", [])],
    }
    if job.get("decode_kv_events") is not None:
        results["decoded_kv_events"] = decode_kv_event_payloads([bytes.fromhex(p) for p in job["decode_kv_events"]])
    text = json.dumps(results)
    if argv[2] == "-":
        print(text)
    else:
        with open(argv[2], "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":  # vLLM starts its workers with spawn: this guard is required
    sys.exit(main(sys.argv))
