"""How big every benchmark is, and how its rounds are summed up (``BenchSettings``).

``make bench`` runs ``BenchSettings.full()``, ``--quick`` ``quick()``, chapter 10's
live cells ``tiny()``, a real model ``real_model()``. vLLM has no counterpart:
its ``benchmarks/`` scripts take these as command-line options.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Where each smaller size differs from full(): field -> (quick, tiny). SAME: full()'s value.
SAME = object()
SMALLER = {
    "num_requests": (8, 4),
    "max_tokens": (8, 4),
    "num_turns": (4, 3),
    "hf_batch_size": (SAME, 4),
    "block_manager_requests": (100, 40),
    "no_sharing_prompt_len": (SAME, (100, 150)),
    "shared_prefix_rounds": (3, 2),
    "roofline_rounds": (3, 2),
    "no_sharing_rounds": (3, 1),
    "vs_transformers_rounds": (3, 1),
    "block_manager_rounds": (3, 1),
    "bandwidth_bytes": (SAME, 64 * 2**20),
    "use_vllm": (SAME, False),  # tiny: starting vLLM takes longer than this whole run
    "num_blocks": (SAME, 256),
    "transformers_continuous_batching": (SAME, False),
}


@dataclass
class BenchSettings:
    """The size of every benchmark. ``full()`` is ``make bench``; ``quick()`` is ``--quick``;
    ``tiny()`` is what chapter 10 runs live (well under a minute on a laptop CPU).

    Every timed comparison runs in *rounds* that alternate which side goes
    first; a ratio is computed per round and the median over rounds is
    reported with its range (min, max), so a burst of load from another
    process moves one round, not the result.
    """

    device: str = "auto"
    model: str | None = None  # a Hugging Face folder; None: the bundled model
    num_requests: int = 16  # the shared-prefix requests (each user request once: none repeats another)
    max_tokens: int = 16
    num_turns: int = 8
    hf_batch_size: int = 8
    block_manager_requests: int = 400
    no_sharing_prompt_len: tuple[int, int] = (200, 400)
    shared_prefix_rounds: int = 15  # timed rounds of warm / cold / fresh TTFT per request
    roofline_rounds: int = 15  # decode-step requests, each followed by a bandwidth measurement
    no_sharing_rounds: int = 9  # rounds of on, off, off, on (or off, on, on, off)
    vs_transformers_rounds: int = 5
    block_manager_rounds: int = 7  # mini-vLLM and each vLLM, interleaved
    vs_vllm_rounds: int = 5
    vs_vllm_max_tokens: int = 32
    vs_vllm_threads: int = 1  # compute threads for each engine
    vs_vllm_default: bool = True  # also vLLM in its default configuration (compiled, asynchronous)
    attention_backend: str = "auto"  # mini-vLLM's; make bench: "cpu" on a CPU (fastest_attention_backend)
    vllm_pythonpaths: tuple[str, ...] = ()  # more vLLM source trees for the block-manager comparison
    use_vllm: bool = True  # False: no comparison with real vLLM at all (--no-vllm)
    bandwidth_bytes: int = 256 * 2**20  # the memory-bandwidth buffer: far larger than any CPU cache
    num_blocks: int | None = None  # None: sized from the memory budget
    # transformers' generate_batch as well: it sizes its paged cache from free memory (measured: ~10 GB
    # for the bundled model), so the live runs of chapter 10 leave it out.
    transformers_continuous_batching: bool = True

    @classmethod
    def full(cls, device: str = "auto", model: str | None = None) -> BenchSettings:
        return cls(device=device, model=model)

    @classmethod
    def quick(cls, device: str = "auto", model: str | None = None) -> BenchSettings:
        return cls._smaller(0, device, model)

    @classmethod
    def tiny(cls, device: str = "auto", model: str | None = None) -> BenchSettings:
        return cls._smaller(1, device, model)

    @classmethod
    def _smaller(cls, column: int, device: str, model: str | None) -> BenchSettings:
        """``SMALLER``'s column ``column`` (0: quick, 1: tiny) over full()'s values."""
        sizes = {field: values[column] for field, values in SMALLER.items() if values[column] is not SAME}
        return cls(device=device, model=model, **sizes)

    @classmethod
    def real_model(cls, model: str, device: str = "auto", quick: bool = False) -> BenchSettings:
        """A real model (SmolLM2-135M): prefills cost ~100x the bundled model's, so fewer requests."""
        return cls(
            device=device,
            model=model,
            num_requests=4 if quick else 6,
            max_tokens=8,
            num_turns=4,
            shared_prefix_rounds=2 if quick else 3,
            roofline_rounds=2 if quick else 9,  # ~4 s each; its goal (<= 1.8x) is this model's
            no_sharing_rounds=3,
            vs_transformers_rounds=3,
        )


Progress = Callable[[Iterable, str], Iterable]


def no_progress(iterable: Iterable, desc: str) -> Iterable:
    return iterable


def _spread(values: list[float]) -> list[float]:
    """``[min, max]`` of per-round values: how far one round can be from another."""
    return [min(values), max(values)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]
