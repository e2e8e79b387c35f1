"""Turning logits into tokens (chapter 08).

Each request samples with its own ``torch.Generator``, seeded from
``SamplingParams.seed`` (or from the engine's seed and the request's number),
so a request's tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations


import torch

from .outputs import Logprob
from .sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from one row of logits (``[vocab]``, float32)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits.float() / params.temperature
    if params.uses_top_k and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        # Keep a token if the probability mass *before* it is below top_p (the first is always kept).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_ids, sorted_probs)
    # Sample on the CPU with the request's own generator: reproducible on any device.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> dict[int, Logprob]:
    """The generated token's log-probability and rank, then the ``num_top`` most likely tokens' (vLLM's
    order), from one row of raw logits (``SamplingParams.logprobs``)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[token_id]
    entries = {token_id: Logprob(float(chosen), rank=int((logprobs > chosen).sum()) + 1)}
    if num_top:
        top = torch.topk(logprobs, num_top)
        for rank, (token, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            entries.setdefault(token, Logprob(value, rank=rank))
    return entries


def make_generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator
