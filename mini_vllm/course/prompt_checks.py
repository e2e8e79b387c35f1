"""Checks for chapter 09: a prompt fix that raises the prefix-cache hit rate.

The learner writes ``build_messages(system_prompt, tools, user_request, now)``,
which turns one request of a story app into chat messages. The check renders
the messages of several requests with the bundled model's chat template,
replays their token ids against an unbounded prefix cache
(``mini_vllm.companions.profiler.simulate_prefix_cache``, the engine's own hashes) and
asks two things:

* nothing was lost: the system prompt, every tool, the user's request and the
  current time are all still in the prompt;
* the same request gives the same prompt in every Python process: the
  function runs again in fresh interpreters, each with its own
  ``PYTHONHASHSEED`` (a set's order follows the hashes of its strings, which
  Python salts per process, so two replicas, or a server after a restart,
  would part), when its code could depend on it (a set, ``hash``, ``random``);
* the hit rate is close to the reference fix's. When it is not, the message
  names the first request that reuses less than the reference fix lets it,
  says where it parts from the earlier prompt closest to it and what sits
  there (the timestamp or a part of it, the tools, the user's request).

The random scenarios vary the tool set (some story tools, some of another
app's), so a fix that hard-codes the four tool names fails; one scenario
crosses midnight, so a date above the stable part fails; the arguments must
come back unchanged, down to the order of a tool's parameters (``tools.sort()``
changes the app's registry).
"""

from __future__ import annotations

import ast
import copy
import json
import os
import pickle
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..companions.profiler import explain_miss, simulate_prefix_cache
from ._harness import Checker, call_learner, guarded_check
from .parts import _CannotFreeze, freeze

BLOCK_SIZE = 16
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _tool(name: str, description: str, **parameters: str) -> dict:
    """A tool as the app registers it: its name, what it does, and each parameter's description."""
    return {"name": name, "description": description, "parameters": parameters}


# The story app's tools. The app's tool registry hands them over in no fixed
# order, and each dict with its keys in no fixed order: a set and a merge of
# configs upstream decide that. The check shuffles both for every request.
STORY_TOOLS: list[dict] = [
    _tool(
        "draw_picture",
        "Draw a picture of one scene of the story.",
        scene="what the picture shows",
        style="crayon, pencil or paint",
    ),
    _tool("find_rhyme", "Find a word that rhymes with the given word.", word="the word to rhyme with"),
    _tool(
        "play_sound",
        "Play the sound an animal makes while the story is read aloud.",
        animal="the animal that makes the sound",
    ),
    _tool(
        "save_story", "Save the finished story in the family story book.", title="a short title", text="the whole story"
    ),
]


# Tools other apps built on the same code register: the check's random scenarios
# mix them in, so a fix that hard-codes the four names above does not pass.
EXTRA_TOOLS: list[dict] = [
    _tool("count_sheep", "Count sheep aloud, slowly, to help a child fall asleep.", number="how many sheep to count"),
    _tool("ask_parent", "Ask the parent a question before going on with the story.", question="the question to ask"),
    _tool("bookmark_page", "Remember where the story stopped tonight.", page="the page number", note="a short note"),
]


def starter_build_messages(system_prompt: str, tools: list[dict], user_request: str, now: datetime) -> list[dict]:
    """The app as it was written: the time first, the tools as they come, in one system turn."""
    lines = [f"Current time: {now.strftime(TIME_FORMAT)}", system_prompt, "Tools you can call:"]
    lines += [json.dumps(tool) for tool in tools]
    return [
        {"role": "system", "content": "\n".join(lines)},
        {"role": "user", "content": user_request},
    ]


def reference_build_messages(system_prompt: str, tools: list[dict], user_request: str, now: datetime) -> list[dict]:
    """The fix: stable part first (system prompt, tools sorted and serialized with sorted keys), volatile part last."""
    tool_lines = [json.dumps(tool, sort_keys=True) for tool in sorted(tools, key=lambda tool: tool["name"])]
    system = "\n".join([system_prompt, "Tools you can call:", *tool_lines])
    user = f"Current time: {now.strftime(TIME_FORMAT)}\n{user_request}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# -- the scenario ----------------------------------------------------------------------
@lru_cache(maxsize=1)
def _default_tokenizer():
    from transformers import AutoTokenizer

    from ..model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@lru_cache(maxsize=1)
def _prompt_data() -> dict:
    from ..model import default_model_path

    return json.loads((Path(default_model_path()) / "prompts.json").read_text())


def _shuffled_tool(tool: dict, rng: random.Random) -> dict:
    """The same tool with its keys (and its parameters' keys) in a random order."""
    items = list(tool.items())
    rng.shuffle(items)
    out = {}
    for key, value in items:
        if isinstance(value, dict):
            value = _shuffled_tool(value, rng)
        out[key] = value
    return out


def make_requests(
    num_requests: int = 8, seed: int = 0, system_index: int = 0, tool_set: list[dict] | None = None
) -> list[dict]:
    """Requests as the app sees them: one system prompt, tools in a random order, a new time each.

    ``tool_set``: the app's tools (default: ``STORY_TOOLS``); every request gets all of them.
    """
    rng = random.Random(seed)
    tool_set = STORY_TOOLS if tool_set is None else tool_set
    data = _prompt_data()
    system_prompt = data["system_prompts"][system_index]
    users = data["user_requests"]
    start = datetime(2026, 11, 30, 9, 0, 0) + timedelta(minutes=rng.randrange(600))
    requests = []
    for i in range(num_requests):
        tools = [_shuffled_tool(tool, rng) for tool in tool_set]
        rng.shuffle(tools)
        requests.append(
            {
                "system_prompt": system_prompt,
                "tools": tools,
                "user_request": users[(seed * 5 + i) % len(users)],
                "now": start + timedelta(seconds=37 * i + rng.randrange(30)),
            }
        )
    return requests


def render(messages: list[dict], tokenizer: Any) -> str:
    """The prompt text the engine sees (chat template + the assistant's header)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def measure(build_messages: Callable, requests: list[dict], tokenizer: Any = None):
    """Render each request and replay them against an unbounded prefix cache.

    Returns ``(messages, texts, simulation)``.
    """
    all_messages = _build_all(build_messages, requests)
    return (all_messages, *_replay(all_messages, tokenizer))


def _build_all(build_messages: Callable, requests: list[dict]) -> list:
    # A copy per call: a function that sorts the tools in place must not fix the next request's order.
    return [call_learner(build_messages, **copy.deepcopy(request)) for request in requests]


def _replay(all_messages: list, tokenizer: Any = None):
    tokenizer = tokenizer or _default_tokenizer()
    texts = [render(messages, tokenizer) for messages in all_messages]
    token_ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return texts, simulate_prefix_cache(token_ids, block_size=BLOCK_SIZE)


# -- the same prompt in every process ----------------------------------------------------
HASH_SEEDS = ("1", "2", "3")
"""The ``PYTHONHASHSEED`` of each fresh process the learner's function runs in again."""

_RUN_ELSEWHERE = """

if __name__ == "__main__":
    import pickle as _pickle
    import sys as _sys

    with open(_sys.argv[1], "rb") as _file:
        _requests = _pickle.load(_file)
    _built = [build_messages(**_request) for _request in _requests]
    with open(_sys.argv[2], "wb") as _file:
        _pickle.dump(_built, _file)
"""


def built_in_other_processes(build_messages: Callable, requests: list[dict]) -> dict[str, list] | None:
    """What ``build_messages`` returns for ``requests`` in fresh Python processes, by ``PYTHONHASHSEED``.

    The function is written out as the parts folder keeps it (:func:`mini_vllm.course.parts.freeze`)
    and run by ``sys.executable``, one process per seed of :data:`HASH_SEEDS`, all at once. None where
    it cannot run elsewhere (it uses something that cannot be written as source, or its process fails):
    the check then does without this comparison. ``{}`` where its code cannot depend on the process
    (:func:`_may_depend_on_the_process`): it runs nowhere else.
    """
    try:
        source = freeze(build_messages, "build_messages")
    except (_CannotFreeze, OSError):  # OSError: inspect finds no source (a function made by exec, or in a REPL)
        return None
    if not _may_depend_on_the_process(source):
        return {}
    search_path = os.pathsep.join(path or os.getcwd() for path in sys.path)  # the same packages, this checkout
    with tempfile.TemporaryDirectory() as folder:
        script, given = Path(folder, "build_messages.py"), Path(folder, "requests.pickle")
        script.write_text(
            "from __future__ import annotations  # names in annotations need not be kept\n" + source + _RUN_ELSEWHERE
        )
        given.write_bytes(pickle.dumps(requests))
        runs = {
            seed: subprocess.Popen(
                [sys.executable, str(script), str(given), str(Path(folder, f"built-{seed}.pickle"))],
                env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": search_path},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for seed in HASH_SEEDS
        }
        failed = False
        for run in runs.values():
            try:
                failed |= run.wait(timeout=300) != 0
            except subprocess.TimeoutExpired:
                run.kill()
                run.wait()
                failed = True
        if failed:
            return None
        return {seed: pickle.loads(Path(folder, f"built-{seed}.pickle").read_bytes()) for seed in HASH_SEEDS}


_PER_PROCESS_NAMES = {"set", "frozenset", "hash", "id", "random", "secrets", "uuid", "os", "time"}
"""What a prompt built in one process could take from that process: a set's order, hashes, addresses, chance, a clock."""


def _may_depend_on_the_process(source: str) -> bool:
    """``source`` (a kept function, with what it uses) builds a set, names something of :data:`_PER_PROCESS_NAMES`
    or calls ``__hash__`` (what it imports from a library is taken to be the same in every process). Dicts keep their
    insertion order."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Set, ast.SetComp)):
            return True
        if isinstance(node, ast.Name) and node.id in _PER_PROCESS_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr == "__hash__":  # hash() spelt as a method
            return True
        if isinstance(node, ast.alias) and node.name.split(".")[0] in _PER_PROCESS_NAMES:
            return True
    return False


SAME_IN_EVERY_PROCESS_HINT = (
    "Python salts the hash of every string with PYTHONHASHSEED, a new random value in each process unless it is "
    "set, and the order of a set of strings (or of anything built by looping over one) follows those hashes. "
    "Two replicas of the app, or the same server after a restart, would then build different prompts for the "
    "same request and miss each other's cache. A set may remove duplicates, but give the tools their order with "
    "sorted(...) (sorted(tools, key=lambda tool: tool['name']); sorted(set(...)) is fine too). The same goes "
    "for hash(), id() and random"
)


def _expect_the_same_in_every_process(
    check: Checker, build_messages: Callable, requests: list[dict], label: str
) -> None:
    """The prompts of ``requests`` do not depend on the process that builds them (its ``PYTHONHASHSEED``)."""
    elsewhere = built_in_other_processes(build_messages, requests)
    if not elsewhere:  # its code cannot depend on the process, or it cannot run in another
        return
    seed, built = next(iter(elsewhere.items()))
    for other_seed, other in elsewhere.items():
        if other != built:
            first = next(i for i, (a, b) in enumerate(zip(built, other)) if a != b)
            a, b = (_as_text(messages) for messages in (built[first], other[first]))
            position = _first_difference(a, b) or 0
            check.fail(
                f"{label}, request {first}: your build_messages builds another prompt in another Python process. "
                f"With PYTHONHASHSEED={seed} and with PYTHONHASHSEED={other_seed}, its messages first differ at "
                f"character {position}: …{a[max(0, position - 30) : position + 30]!r}… and "
                f"…{b[max(0, position - 30) : position + 30]!r}…",
                SAME_IN_EVERY_PROCESS_HINT,
            )
    check.expect(True, f"{label}: the same prompts with PYTHONHASHSEED {', '.join(HASH_SEEDS)}")


def _as_text(messages: Any) -> str:
    """The messages' contents, one after the other (``repr`` for anything that is not a message list)."""
    if _is_message_list(messages):
        return "\n".join(f"[{m['role']}] {m['content']}" for m in messages)
    return repr(messages)


# -- diagnostics -----------------------------------------------------------------------
def _tool_strings(tool: dict) -> list[str]:
    strings = [tool["name"], tool["description"]]
    for name, description in tool["parameters"].items():
        strings += [name, description]
    return strings


def _tool_fields(tool: dict) -> dict[str, str]:
    """The parts of a tool that no other tool shares, by what they are: its name, description, parameters."""
    fields = {tool["name"]: "name", tool["description"]: "description"}
    fields.update({description: "parameters" for description in tool["parameters"].values()})
    return fields


def _tool_not_together(content: str, tool: dict, tools: list[dict]) -> str:
    """How ``tool`` is split up in ``content`` ("" when it is kept together).

    Format-free: somewhere in ``content`` a stretch must hold the tool's name,
    its description and each of its parameters (name and description) with no
    other tool's name, description or parameter description inside it. When
    none does, say which other tool's fields sit next to the tool's name.
    """
    own = _tool_fields(tool)
    occurrences = [_spans(content, field) for field in own]
    others = [
        (other["name"], kind, span)
        for other in tools
        if other["name"] != tool["name"]
        for field, kind in _tool_fields(other).items()
        for span in _spans(content, field)
    ]
    windows = []
    for combination in _combinations(occurrences):
        start, end = min(s[0] for s in combination), max(s[1] for s in combination)
        inside = [(name, kind) for name, kind, span in others if start <= span[0] and span[1] <= end]
        # The parameters' names sit just before (or after) their descriptions: a little slack.
        stretch = content[max(0, start - 40) : end + 40]
        named = all(parameter in stretch for parameter in tool["parameters"])
        windows.append((len(inside) + (not named), end - start, inside, combination))
    if not windows or min(windows)[0] == 0:
        return ""
    _, _, inside, combination = min(windows)
    name_span = combination[0]  # the tool's name comes first in _tool_fields
    near = {}
    for kind in ("description", "parameters"):
        candidates = [(abs(span[0] - name_span[0]), name) for name, k, span in others if k == kind]
        candidates += [
            (abs(span[0] - name_span[0]), tool["name"])
            for field, k in own.items()
            if k == kind
            for span in _spans(content, field)
        ]
        nearest = min(candidates)[1] if candidates else tool["name"]
        if nearest != tool["name"]:
            near[kind] = nearest
    if near:
        return (
            "its name sits next to "
            + " and ".join(f"the {kind} of {name!r}" for kind, name in near.items())
            + " (its own are elsewhere)"
        )
    if inside:
        return f"between its name, description and parameters sit fields of {inside[0][0]!r}"
    return "its parameters' names are not next to their descriptions"


def _combinations(occurrences: list[list[tuple[int, int]]], limit: int = 256) -> list[tuple]:
    """One occurrence of each field, every way (at most ``limit`` ways: a field written many times is rare)."""
    combinations: list[tuple] = [()]
    for spans in occurrences:
        combinations = [c + (s,) for c in combinations for s in spans][:limit]
    return combinations


# The whole current time, to the second, written another way than TIME_FORMAT.
_OTHER_TIME_FORMATS = (
    "%Y-%m-%dT%H:%M:%S",
    "%Y/%m/%d %H:%M:%S",
    "%d/%m/%Y %H:%M:%S",
    "%m/%d/%Y %H:%M:%S",
    "%d.%m.%Y %H:%M:%S",
    "%Y-%m-%d, %H:%M:%S",
    "%H:%M:%S %Y-%m-%d",
    "%a %b %d %H:%M:%S %Y",
    "%a %b %e %H:%M:%S %Y",
    "%Y%m%dT%H%M%S",
    "%I:%M:%S %p",
)


def _time_in_another_format(content: str, now: datetime) -> str:
    """The current time as ``content`` writes it, when that is another format than TIME_FORMAT ("" if none)."""
    for written in (now.isoformat(), *(now.strftime(fmt) for fmt in _OTHER_TIME_FORMATS)):
        if written in content:
            return written
    return ""


def _another_time(content: str) -> str:
    """A time written in TIME_FORMAT in ``content`` ("" if none): the prompt's time when it is not ``now``."""
    found = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", content)
    return found.group() if found else ""


# TIME_FORMAT's fields in order, and the format codes a slip of the keyboard puts in their place.
_TIME_FIELDS = (("%Y", "year"), ("%m", "month"), ("%d", "day"), ("%H", "hour"), ("%M", "minutes"), ("%S", "seconds"))
_CODE_MEANINGS = {
    "%Y": "the year",
    "%m": "the month",
    "%d": "the day",
    "%H": "the hour on a 24-hour clock",
    "%I": "the hour on a 12-hour clock",
    "%M": "the minutes",
    "%S": "the seconds",
}


def _other_format_codes(written: str, now: datetime) -> str:
    """How ``written`` (a time shaped like TIME_FORMAT) writes ``now`` with other format codes ("" when a
    field is no part of ``now``: a time from another clock). ``'2026-11-30 15:11:24'`` for 15:34:24 on
    November 30th: "its minutes field is '11', what %m gives (the month), not %M's '34'"."""
    slips = []
    for (code, name), value in zip(_TIME_FIELDS, re.findall(r"\d+", written)):
        if value == now.strftime(code):
            continue
        other = next((c for c in _CODE_MEANINGS if now.strftime(c) == value), None)
        if other is None:
            return ""
        slips.append(
            f"its {name} field is {value!r}, what {other} gives ({_CODE_MEANINGS[other]}), not {code}'s "
            f"{now.strftime(code)!r}"
        )
    return "; ".join(slips)


def _first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _span(text: str, needle: str) -> tuple[int, int] | None:
    start = text.find(needle)
    return None if start < 0 else (start, start + len(needle))


def _spans(text: str, needle: str) -> list[tuple[int, int]]:
    """Every occurrence of ``needle`` in ``text``."""
    return [(m.start(), m.end()) for m in re.finditer(re.escape(needle), text)] if needle else []


# The current time cut short: what a prompt keeps when it writes "today" or "this minute" early on.
_TIME_PARTS = ("%Y-%m-%d %H:%M", "%Y-%m-%d %H", "%Y-%m-%d", "%H:%M", "%d %B %Y", "%B %d, %Y", "%A")


def _what_differs(text: str, position: int, request: dict) -> str:
    """Name the part of the prompt at ``position``: the timestamp (or a part of it), the user's request, the tools."""
    now = request["now"]
    for label, needles in (("timestamp", [now.strftime(TIME_FORMAT)]), ("user", [request["user_request"]])):
        for span in (s for needle in needles for s in _spans(text, needle)):
            if span[0] - 16 <= position < span[1]:  # a little slack: "Current time: " before it
                return label
    for span in (s for fmt in _TIME_PARTS for s in _spans(text, now.strftime(fmt))):
        if span[0] <= position < span[1]:
            return "time part"
    tool_spans = [s for tool in request["tools"] for s in [_span(text, x) for x in _tool_strings(tool)] if s]
    if tool_spans and min(s[0] for s in tool_spans) - 40 <= position <= max(s[1] for s in tool_spans) + 4:
        return "tools"
    return "other"


HINTS = {
    "timestamp": (
        "the timestamp still comes before the stable part of the prompt. It changes with every "
        "request, so the block that holds it and every block after it miss. Move it after the "
        "system prompt and the tools (for example into the user's turn)."
    ),
    "time part": (
        "a part of the current time (the date, the hour or the minute) still comes before the stable "
        "part of the prompt. It stays the same for a while, then changes (it did between the two "
        "requests above), and then the block that holds it and every block after it miss. Write the "
        "time only after the system prompt and the tools (for example in the user's turn)."
    ),
    "user": (
        "the user's request comes before the stable part of the prompt. Every request differs "
        "there, so nothing after it can be reused. Put the system prompt and the tools first."
    ),
    "tools": (
        "the tools are serialized differently from one request to the next (their order or the "
        "order of their keys). Sort the tools by name and serialize each with "
        "json.dumps(tool, sort_keys=True), so equal tools always give equal text. (A set has no order you "
        "can rely on: it depends on the order its items were added and, for strings, changes between "
        "processes; sorted(...) gives one.)"
    ),
    "other": "something early in the prompt changes from one request to the next.",
    "after the stable part": (
        "the prompts part where they should, after the system prompt and the tools, where the time and "
        "the user's request differ from one request to the next. The reference fix reuses a little more there "
        "(it writes the time first in the user's turn, and requests received close together share its date and "
        "hour); the rest of the hit rate is lost in a few requests that part earlier, or by a little in many."
    ),
}


def _diagnose(texts: list[str], sim, requests: list[dict], tokenizer: Any, reference=None) -> str:
    """Find the first request that reuses less than it could and say why.

    "Could" is what the reference fix reuses for the same request (``reference``, its
    simulation): the first request that computes more than a block more than with the
    reference fix is the one explained, against the earlier prompt that shares the
    longest start with it (the closest it could have reused), not simply the one before it.
    """
    if reference is None:
        reference = _replay([reference_build_messages(**copy.deepcopy(r)) for r in requests], tokenizer)[1]

    def computed(simulation, i: int) -> int:
        return len(simulation.token_ids[i]) - simulation.num_hit_tokens[i]

    extra = [computed(sim, i) - computed(reference, i) for i in range(len(texts))]
    # The request that loses the most (the first of those), unless its prompt parts from the closest earlier one
    # only after the stable part, where every request differs: a block or two lost there to a layout that is fine
    # (the user's request before the time) is not what pulls the hit rate down.
    candidates = sorted(range(1, len(texts)), key=lambda i: (-extra[i], i))
    if not candidates:
        return HINTS["other"]
    found = [_where_it_parts(texts, i, requests[i]) for i in candidates]
    i, j, position, where = next((f for f in found if f[3] != "after the stable part"), found[0])
    hit, total = sim.num_hit_tokens[i], len(sim.token_ids[i])
    ref_hit, ref_total = reference.num_hit_tokens[i], len(reference.token_ids[i])
    reuse = (
        f"request {i} is the first of those that lose the most reuse: {hit} of its {total} tokens, where the "
        f"reference fix reuses {ref_hit} of {ref_total}"
    )
    if position is None:
        return f"{reuse}. {HINTS['other']}"
    report = explain_miss(sim.token_ids[j], sim.token_ids[i], block_size=BLOCK_SIZE, tokenizer=tokenizer)
    context = texts[i][max(0, position - 30) : position + 30]
    closest = "the request before it" if j == i - 1 else "of the earlier prompts, the one that shares the longest start"
    return (
        f"{reuse}. It and request {j} ({closest}) first differ at character {position} "
        f"(token {report.first_diff_token}, block {report.first_broken_block}), here: …{context!r}…; "
        f"every block of request {i} from that one on misses. "
        + ("That is no mistake: " if where == "after the stable part" else "Likely cause: ")
        + HINTS[where]
    )


def _where_it_parts(texts: list[str], i: int, request: dict) -> tuple[int, int, int | None, str]:
    """``(i, j, position, where)``: request ``i``'s prompt against the earlier one ``j`` sharing the longest start
    with it, where they first differ, and what sits there (a key of :data:`HINTS`). A difference in the time or
    the user's request with no stable part after it is ``"after the stable part"``: where every request differs."""
    j = max(range(i), key=lambda k: (_common_length(texts[k], texts[i]), k))
    position = _first_difference(texts[j], texts[i])
    if position is None:
        return i, j, None, "other"
    where = _what_differs(texts[i], position, request)
    if where in ("timestamp", "time part", "user") and not _stable_part_after(texts[i], position, request):
        where = "after the stable part"
    return i, j, position, where


def _stable_part_after(text: str, position: int, request: dict) -> bool:
    """The system prompt or a tool's description comes after ``position`` in ``text``."""
    stable = [request["system_prompt"], *(tool["description"] for tool in request["tools"])]
    return any(text.find(needle, position) >= 0 for needle in stable)


def _common_length(a: str, b: str) -> int:
    position = _first_difference(a, b)
    return min(len(a), len(b)) if position is None else position


# -- the check -------------------------------------------------------------------------
def _is_message_list(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def _unchanged(given: Any, original: Any) -> bool:
    """``given`` equals ``original``, every dict's keys in the same order, at every depth (a tool's
    parameters too: ``==`` ignores the order of a dict's keys)."""
    if isinstance(original, dict):
        return (
            isinstance(given, dict)
            and list(given) == list(original)
            and all(_unchanged(given[key], value) for key, value in original.items())
        )
    if isinstance(original, list):
        return isinstance(given, list) and len(given) == len(original) and all(map(_unchanged, given, original))
    return given == original


def _check_scenario(
    check: Checker,
    build_messages: Callable,
    requests: list[dict],
    tokenizer: Any,
    label: str,
    random_case: bool,
    in_other_processes: bool = False,
) -> float:
    """Information first (per request), then (``in_other_processes``) the same prompts in fresh processes,
    then the hit rate against the reference fix's; returns the hit rate."""
    messages_list = []
    for i, request in enumerate(requests):
        given = copy.deepcopy(request)
        messages_list.append(
            call_learner(
                build_messages,
                **given,
                name=check.name,
                what=f"{label}, request {i}: build_messages(system_prompt, {len(request['tools'])} tools, "
                f"{request['user_request']!r:.40}, now={request['now']})",
                expected="a list of {'role': ..., 'content': ...} dicts",
            )
        )
        check.expect(
            _unchanged(given, request),
            f"{label}, request {i}: your build_messages changed the arguments it was given (the tools list, a "
            "tool's dict or its parameters)",
            "the tools belong to the app's registry, which passes the same objects again: tools.sort(), "
            "tool.pop(...) and tool['parameters'] = dict(sorted(...)) change them for everyone. Use "
            "sorted(tools, key=...) and json.dumps(tool, sort_keys=True), which build new values",
            random_case=random_case,
        )
    for i, (messages, request) in enumerate(zip(messages_list, requests)):
        check.expect(
            _is_message_list(messages),
            f"{label}, request {i}: build_messages must return a list of {{'role': ..., 'content': ...}} dicts, "
            f"got {messages!r:.200}",
            random_case=random_case,
        )
        content = "\n".join(m["content"] for m in messages)
        timestamp = request["now"].strftime(TIME_FORMAT)
        other_format = "" if timestamp in content else _time_in_another_format(content, request["now"])
        another_time = "" if timestamp in content or other_format else _another_time(content)
        slips = _other_format_codes(another_time, request["now"]) if another_time else ""
        if other_format:
            problem = f"in the prompt as {other_format!r}, not in the format the app needs"
            hint = f"write it with now.strftime('%Y-%m-%d %H:%M:%S'), which gives {timestamp!r}" + (
                " (now.isoformat() puts a 'T' between the date and the time)" if "T" in other_format else ""
            )
        elif slips:
            problem = f"missing from the prompt, which writes it with other format codes: {another_time!r}"
            hint = (
                f"{slips}. Write it with now.strftime('%Y-%m-%d %H:%M:%S'), which gives {timestamp!r} (%m is the "
                "month and %M the minutes; %H the hour on a 24-hour clock)"
            )
        elif another_time:
            problem = f"missing from the prompt, which holds another time, {another_time!r}"
            hint = (
                "use the `now` argument, the time the app received the request, not datetime.now() (the clock "
                "when your function runs): the check replays requests received at other times"
            )
        else:
            problem = "missing from the prompt"
            hint = (
                "the model still needs the current time: keep it, written with now.strftime('%Y-%m-%d %H:%M:%S'); "
                "move it, do not drop it (nor round it)"
            )
        check.expect(
            timestamp in content,
            f"{label}, request {i}: the current time {timestamp!r} is {problem}",
            hint,
            random_case=random_case,
        )
        check.expect(
            request["user_request"] in content,
            f"{label}, request {i}: the user's request {request['user_request']!r} is missing from the prompt",
            random_case=random_case,
        )
        check.expect(
            request["system_prompt"] in content,
            f"{label}, request {i}: the system prompt is missing (or was changed)",
            "keep the system prompt word for word",
            random_case=random_case,
        )
        for tool in request["tools"]:
            missing = [s for s in _tool_strings(tool) if s not in content]
            check.expect(
                not missing,
                f"{label}, request {i}: tool {tool['name']!r} lost some of its definition: {missing}",
                "every tool must stay in the prompt with its name, description and parameters",
                random_case=random_case,
            )
            apart = _tool_not_together(content, tool, request["tools"])
            if apart:  # counted with the case above: a passing check prints the same counts
                check.fail(
                    f"{label}, request {i}: tool {tool['name']!r} is not kept together in the prompt: {apart}",
                    "each tool must stay one unit, its name, description and parameters together, or the model "
                    "calls a tool with another tool's parameters. Did you sort the names, descriptions or "
                    "parameters separately? Sort the tools themselves (sorted(tools, key=lambda tool: "
                    "tool['name'])) and serialize each one whole (json.dumps(tool, sort_keys=True))",
                )
    if in_other_processes:
        _expect_the_same_in_every_process(check, build_messages, requests, label)
    texts, sim = _replay(messages_list, tokenizer)
    _, _, reference = measure(reference_build_messages, requests, tokenizer)
    needed = reference.hit_rate - 0.05
    check.expect(
        sim.hit_rate >= needed,
        f"{label}: hit rate {sim.hit_rate:.1%} across {len(requests)} requests; the reference fix reaches "
        f"{reference.hit_rate:.1%} (needed: at least {needed:.1%}).\n    "
        + _diagnose(texts, sim, requests, tokenizer, reference),
        random_case=random_case,
    )
    return sim.hit_rate


@guarded_check(part="build_messages")
def check_prompt_fix(build_messages: Callable, tokenizer: Any = None) -> None:
    """The learner's ``build_messages(system_prompt, tools, user_request, now) -> list[dict]``."""
    check = Checker("build_messages")
    tokenizer = tokenizer or _default_tokenizer()
    rate = _check_scenario(check, build_messages, make_requests(8, seed=0), tokenizer, "8 requests", False, True)
    # Requests one second apart, across midnight, and the same request twice: the prompt must still carry each
    # time, and no part of it (the date, the hour) may come before the stable part, where a new day would part them.
    close = make_requests(3, seed=1)
    close[0]["now"] = close[0]["now"].replace(hour=23, minute=59, second=59)
    close[1]["now"] = close[0]["now"] + timedelta(seconds=1)
    close[2]["now"] = close[1]["now"] + timedelta(seconds=37)
    close[2]["user_request"] = close[1]["user_request"]
    _check_scenario(check, build_messages, close, tokenizer, "requests one second apart, across midnight", False)
    num_systems = len(_prompt_data()["system_prompts"])
    for seed in range(2, 6):
        # Another app on the same code: some of the story tools, and some of its own.
        rng = check.rng
        tool_set = rng.sample(STORY_TOOLS, rng.randint(2, 4)) + rng.sample(EXTRA_TOOLS, rng.randint(1, 3))
        requests = make_requests(
            rng.randint(3, 8), seed=seed, system_index=rng.randrange(num_systems), tool_set=tool_set
        )
        _check_scenario(check, build_messages, requests, tokenizer, f"random scenario {seed}", True)
    check.passed()
    print(f"  hit rate on the 8 requests: {rate:.1%}")
