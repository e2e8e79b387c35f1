"""``python -m mini_vllm serve``'s flags, with ``vllm serve``'s names where mini-vLLM has the setting.

A flag is one ``parser.add_argument`` in ``make_arg_parser``; a flag that sets the
engine is also one line of ``ENGINE_FLAGS`` (flag -> ``EngineConfig`` field), one that
sets the server a name in ``SERVER_FLAGS`` (a ``ServerSettings`` field).

vLLM equivalent: ``vllm/entrypoints/openai/cli_args.py`` (``make_arg_parser``,
``validate_parsed_serve_args``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def port_number(text: str) -> int:
    """``--port``: a TCP port, 0 to 65535 (0: any free one); anything else is an argparse error (exit 2)
    before the model loads, not uvicorn's OverflowError after."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 65535, got {port}")
    return port


def json_object(text: str) -> dict[str, Any]:
    """``--kv-transfer-config``: a JSON object (vLLM parses its config flags so); anything else is an argparse error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def gpu_blocks(text: str) -> int:
    """``--num-gpu-blocks-override N``: vLLM's count, block 0 kept as its null block, so N - 1 blocks hold K/V.

    mini-vLLM's pool has no block 0 to set aside (its null block lives outside
    the pool), so ``EngineConfig.num_blocks`` is N - 1: the same flag gives the
    same usable pool, evictions and hits as ``vllm serve`` (at least 2).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (block 0 is vLLM's null block), got {value}")
    return value - 1


def retention_interval(text: str) -> int | None:
    """``--prefix-cache-retention-interval``: an integer >= 0, or "None" (or "") for every block, as vLLM reads it."""
    if text in ("", "None"):
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or None, got {text!r}")
    return value


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with the server's flags added."""
    parser.add_argument("model_tag", nargs="?", default=None, help="a local Hugging Face folder (default: bundled)")
    parser.add_argument("--model", default=None, help="same as the positional MODEL")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port_number, default=8000, help="port, 0-65535 (default: %(default)s)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model names clients may send; responses report the first (default: MODEL)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--dtype", default=None, help="auto, float32, float16 or bfloat16")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N")
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=gpu_blocks,
        default=None,
        help="blocks in the KV-cache pool counted as vLLM counts them, its null block included: "
        "EngineConfig.num_blocks is one fewer",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="requests per step at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step at most")
    parser.add_argument("--attention-backend", default=None, help="torch, triton or cpu (default: auto)")
    parser.add_argument("--seed", type=int, default=None, help="the engine's seed for requests without one")
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host memory for a KV-cache tier below the pool (KV-cache offloading; not --cpu-offload-gb, "
        "which moves weights)",
    )
    parser.add_argument("--kv-offloading-backend", default=None, help="native: the CPU tier (the only one here)")
    parser.add_argument(
        "--kv-transfer-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help="vLLM's KVTransferConfig; here the offloading tier's eviction policy, e.g. "
        '\'{"kv_connector_extra_config": {"eviction_policy": "arc"}}\' (default: lru)',
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefix caching (default: on)",
    )
    parser.add_argument(
        "--prefix-cache-retention-interval",
        type=retention_interval,
        default=0,
        metavar="TOKENS",
        help="which full blocks a sliding-window group caches: 0 (default) only at boundaries a later request "
        "resumes from, None every block, a multiple N of the block size also every N-th token's",
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="cache a hybrid model's every layer as full attention, in one KV-cache group",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="use a chat template sent with a request (chat_template, chat_template_kwargs.chat_template); "
        "refused by default: it runs on the server's one renderer thread",
    )
    parser.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish the KV-cache events over ZMQ as vLLM does (vLLM's KVEventsConfig fields), e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
    )
    parser.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve /v1/chat/completions/render and /v1/completions/render (a router tokenizes with them)",
    )
    parser.add_argument(
        "--learner-engine",
        action="store_true",
        help="serve your own engine: the parts you passed in the exercises (mini_vllm.course.learner_engine)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's log level (default: %(default)s)")
    return parser


ENGINE_FLAGS = {
    "block_size": "block_size",
    "max_model_len": "max_model_len",
    "dtype": "dtype",
    "device": "device",
    "num_gpu_blocks_override": "num_blocks",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "attention_backend": "attention_backend",
    "seed": "seed",
    "kv_offloading_size": "kv_offloading_size",
    "kv_offloading_backend": "kv_offloading_backend",
    "kv_transfer_config": "kv_transfer_config",
}
"""Server flag (argparse dest) -> ``EngineConfig`` field."""

SERVER_FLAGS = ("enable_prompt_tokens_details", "trust_request_chat_template", "enable_scale_out")
"""The flags that are ``ServerSettings`` fields of the same name."""


def validate_parsed_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argparse error (exit 2) for flags that contradict each other, before the model loads."""
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields the flags set (those left out keep the engine's defaults)."""
    settings = {field: getattr(args, flag) for flag, field in ENGINE_FLAGS.items() if getattr(args, flag) is not None}
    settings["enable_prefix_caching"] = args.enable_prefix_caching
    settings["prefix_cache_retention_interval"] = args.prefix_cache_retention_interval
    settings["disable_hybrid_kv_cache_manager"] = args.disable_hybrid_kv_cache_manager
    return settings


def server_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServerSettings`` fields the flags set."""
    return {field: getattr(args, field) for field in SERVER_FLAGS}
