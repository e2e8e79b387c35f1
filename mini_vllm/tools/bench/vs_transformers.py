"""Benchmark 4: the same model, prompts and device through transformers' ``generate``.

Also transformers' own continuous batching (``generate_batch``) where it exists.
vLLM has no counterpart (its benchmarks compare against other servers).
"""

from __future__ import annotations

import statistics
import time

import torch

from ...llm import LLM
from ...model import default_model_path
from ...sampling_params import SamplingParams
from .engines import EngineFactory, _llm, _warm_up
from .settings import Progress, _spread, no_progress
from .workloads import _chat_ids, _prompt_data


def bench_vs_transformers(args, progress: Progress = no_progress, engine: EngineFactory = LLM) -> dict:
    from transformers import AutoModelForCausalLM

    data = _prompt_data()
    system = data["system_prompts"][0]
    users = [data["user_requests"][i % len(data["user_requests"])] for i in range(args.num_requests)]
    llm = _llm(args, engine)
    device = llm.llm_engine.device
    prompts = [_chat_ids(llm, system, u) for u in users]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    hf = (
        AutoModelForCausalLM.from_pretrained(args.model or default_model_path(), dtype=llm.llm_engine.dtype)
        .to(device)
        .eval()
    )
    pad_id = llm.get_tokenizer().pad_token_id or 0

    def run_hf(batch_size: int) -> tuple[float, list[list[int]]]:
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            with torch.inference_mode():
                generated = hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            outputs += generated[:, width:].tolist()
        return time.perf_counter() - start, outputs

    run_hf(len(prompts[:2]))  # warm-up
    _warm_up(llm)

    def run_ours() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in ours]

    # Rounds alternate which engine goes first; one ratio per round. Our prefix
    # cache is reset each round: every round pays the first request's full prefill.
    hf_times, our_times, ratios = [], [], []
    for round_index in progress(range(args.vs_transformers_rounds), "vs transformers"):
        llm.reset_prefix_cache()
        if round_index % 2 == 0:
            hf_time, hf_outputs = run_hf(args.hf_batch_size)
            our_time, ours_tokens = run_ours()
        else:
            our_time, ours_tokens = run_ours()
            hf_time, hf_outputs = run_hf(args.hf_batch_size)
        hf_times.append(hf_time)
        our_times.append(our_time)
        ratios.append(hf_time / our_time)
    our_time = statistics.median(our_times)
    results = {
        "throughput_ratio": statistics.median(ratios),
        "throughput_ratio_range": _spread(ratios),
        "rounds": len(ratios),
        "time_ours_s": our_time,
        "time_transformers_s": statistics.median(hf_times),
        "transformers_batch_size": args.hf_batch_size,
        "outputs_equal": ours_tokens == hf_outputs,
        "num_outputs_equal": sum(a == b for a, b in zip(ours_tokens, hf_outputs)),
        "num_prompts": len(prompts),
    }
    if args.transformers_continuous_batching:
        results.update(_vs_transformers_continuous_batching(hf, prompts, args.max_tokens, ours_tokens, our_time))
    return results


def _vs_transformers_continuous_batching(hf, prompts, max_tokens, ours_tokens, our_time) -> dict:
    """transformers' own continuous batching (``generate_batch``, paged attention), where it exists."""
    from transformers import GenerationConfig

    try:
        if not hasattr(hf, "generate_batch"):
            return {"continuous_batching": "not available in this transformers"}
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        hf.generate_batch(inputs=prompts[:2], generation_config=config, progress_bar=False)  # warm-up
        start = time.perf_counter()
        outputs = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        elapsed = time.perf_counter() - start
    except Exception as error:  # an optional comparison must not sink the whole benchmark
        return {"continuous_batching": f"failed: {type(error).__name__}: {error}"[:200]}
    # Request ids are "req_0", "req_1", ...: put them back in prompt order.
    ordered = sorted(outputs, key=lambda request_id: int(str(request_id).rsplit("_", 1)[-1]))
    tokens = [list(outputs[request_id].generated_tokens) for request_id in ordered]
    return {
        "cb_throughput_ratio": elapsed / our_time,
        "time_transformers_cb_s": elapsed,
        "cb_num_outputs_equal": sum(a == b for a, b in zip(ours_tokens, tokens)),
    }
