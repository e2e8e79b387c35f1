"""One prompt, ``n`` completions: the fan-out into child requests and the merge back (chapter 08).

``SamplingParams(n=3)`` asks for three completions of one prompt. The engine
runs each as its own ``Request`` (a *child*), so the three share the prompt's
blocks through the prefix cache and are scheduled, preempted and finished
independently. A ``ParentRequest`` is what ties them together:

    ParentRequest("0-0", SamplingParams(n=3, seed=7))
        .child_request_ids           ["0-0-0", "0-0-1", "0-0-2"]
        .get_child_sampling_params   n=1, seed 7, 8, 9 (n=1 and the same seed when unseeded)
        .merge(finished outputs)     one RequestOutput with completions 0, 1, 2

Who owns what: the engine (``LLMEngine.add_parent_requests``,
``mini_vllm/llm_engine.py``) validates the prompt, checks the child ids and
owns the child ``Request``s, from queueing to ``_finish``; the
``ParentRequest`` owns only the fan-out (the children's ids and settings) and
the merge of their finished ``RequestOutput``s. It holds no ``Request``, no
block and no token, and never changes the engine; the engine reads the
children's ids and settings from it while queueing and keeps no reference to
it. ``LLM.generate`` keeps the ``ParentRequest``s of its call and merges with
them once every child has finished; the OpenAI server (``AsyncLLM``) streams
each child on its own and uses only the child ids.

With ``n == 1`` the prompt's one child *is* the prompt: same id, same
``SamplingParams`` object, and the merge returns its output with ``index`` 0.

vLLM equivalent: ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``:
``get_child_info``, ``_get_child_sampling_params``, and ``get_outputs``,
which aggregates the children's final outputs). vLLM names child ``k``
``"{k}_{id}"`` and reports the merged output's ``num_cached_tokens`` from the
child that finished last; here a child is ``"{id}-{k}"`` and the merged output
reports the first child's (``mini_vllm/tools/compare_vllm/`` documents the difference).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from .outputs import RequestOutput
from .sampling_params import SamplingParams


def parent_id_of(child_request_id: str) -> str:
    """The prompt id a completion id ``"{prompt id}-{k}"`` of an ``n > 1`` prompt came from (the
    inverse of ``ParentRequest.child_request_ids``; for any other id, a string that names no prompt)."""
    return child_request_id.rsplit("-", 1)[0]


class ParentRequest:
    """The fan-out and the merge of one prompt's ``n`` completions (see the module docstring).

    ``request_id``: the prompt's id, the one its merged ``RequestOutput`` carries;
    ``sampling_params``: the prompt's settings (the engine's checked copy, ``n``
    included); ``child_request_ids``: the ids of its ``n`` child requests, in
    completion order. Nothing here changes after construction (the merge sets
    the ``index`` of the children's completions, which belong to the caller).
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        # The ids are not checked here: the engine checks every child id before anything is queued.
        self.request_id = request_id
        self.sampling_params = sampling_params
        n = sampling_params.n
        self.child_request_ids: list[str] = [request_id] if n == 1 else [f"{request_id}-{index}" for index in range(n)]

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def __repr__(self) -> str:
        return f"ParentRequest({self.request_id!r}, n={self.n}, children={self.child_request_ids})"

    def get_child_sampling_params(self, index: int) -> SamplingParams:
        """The settings of completion ``index``: ``n=1`` and, if seeded, ``seed + index``.

        With ``n == 1`` that is the prompt's own ``SamplingParams``; otherwise
        each child gets its own shallow copy (so a seeded child's seed is its
        own), and completion ``k`` of a seeded prompt samples with ``seed + k``:
        the completions differ and are reproducible (``SamplingParams`` refuses
        a seed whose ``seed + n - 1`` would not fit a generator).
        """
        params = self.sampling_params
        if not 0 <= index < params.n:
            raise IndexError(f"request {self.request_id!r} has {params.n} completions; there is no completion {index}")
        if params.n == 1:
            return params
        child = copy.copy(params)
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index
        return child

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """(request id, sampling params) of completion ``index``: what the engine queues for it."""
        return self.child_request_ids[index], self.get_child_sampling_params(index)

    def merge(self, finished: Mapping[str, RequestOutput]) -> RequestOutput:
        """The prompt's one ``RequestOutput``, from its children's (``finished``: by request id).

        ``outputs`` holds each child's completion in child order, its ``index``
        set to that order (0..n-1; set on the child's ``CompletionOutput``
        itself); ``prompt``, ``prompt_token_ids``, ``num_cached_tokens`` and
        ``metrics`` are the first child's, ``per_completion_metrics`` every
        child's in order. ``finished`` may hold other requests' outputs too; a
        child missing from it is a ValueError naming the missing ids.
        """
        missing = [child_id for child_id in self.child_request_ids if child_id not in finished]
        if missing:
            raise ValueError(
                f"cannot merge request {self.request_id!r}: {len(missing)} of its {self.n} completions "
                f"have no finished output ({missing})"
            )
        children = [finished[child_id] for child_id in self.child_request_ids]
        outputs = []
        for index, child in enumerate(children):
            completion = child.outputs[0]
            completion.index = index
            outputs.append(completion)
        first = children[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
            per_completion_metrics=[child.metrics for child in children],
        )
