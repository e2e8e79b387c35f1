"""The one incremental detokenizer (``mini_vllm/detokenizer.py``): streamed text, final text and stop
strings come from one ``IncrementalDetokenizer`` per request, and each token costs the same decode work
at any length (vLLM's ``detokenize_incrementally``)."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers.decoders import DecodeStream

from engine_invariants import assert_nothing_leaked

from mini_vllm import LLM, SamplingParams
from mini_vllm.detokenizer import IncrementalDetokenizer
from mini_vllm.entrypoints.async_llm import AsyncLLM

# Characters of one to four UTF-8 bytes, spaces that merge with the next word, and a long run of them.
TEXT = "a naïve café, 日本語 and 🙂🙂 again: ünïcödé ends here. " * 3


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=64, device="cpu")


@pytest.fixture(scope="module")
def token_ids(llm):
    ids = llm.get_tokenizer().encode(TEXT, add_special_tokens=False)
    assert any(llm.get_tokenizer().decode([token]).endswith("\ufffd") for token in ids)  # characters split over tokens
    return ids


def decode_stream_text(tokenizer, token_ids):
    """What vLLM's fast incremental detokenizer (tokenizers' DecodeStream) shows for these tokens."""
    stream = DecodeStream(skip_special_tokens=True)
    return "".join(stream.step(tokenizer._tokenizer, token) or "" for token in token_ids)


def scripted_sampler(monkeypatch, token_ids):
    script = iter(token_ids)
    monkeypatch.setattr("mini_vllm.llm_engine.sample", lambda logits, params, generator: next(script))


async def stream_one(llm, params):
    serving = AsyncLLM(llm)
    try:
        [stream] = await serving.add_requests([{"prompt_token_ids": [5, 6, 7]}], [params])
        deltas = [delta async for delta in stream]
    finally:
        serving.shutdown()
    return deltas


@pytest.mark.parametrize("stop", [None, ["ünïcödé ends"], ["日本語", "🙂 again"]])
def test_streamed_deltas_concatenate_to_the_final_text(llm, monkeypatch, token_ids, stop):
    """Every step's delta is new text only, a character split over tokens arrives whole, and the
    deltas add up to the final text, which is the whole decode (cut at the first stop string)."""
    count = len(token_ids) - 3  # ends in the middle of the last characters' tokens
    scripted_sampler(monkeypatch, token_ids)
    params = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True, stop=stop)
    deltas = asyncio.run(stream_one(llm, params))
    final = deltas[-1].output.outputs[0]
    assert "".join(delta.text for delta in deltas) == final.text
    assert not any("\ufffd" in delta.text for delta in deltas)
    assert sum(len(delta.token_ids) for delta in deltas) == len(final.token_ids)
    assert sum(1 for delta in deltas if delta.text) >= 5  # it did stream, a piece at a time
    whole = decode_stream_text(llm.get_tokenizer(), token_ids[:count])
    if stop is None:
        assert final.text == whole and final.finish_reason == "length"
    else:
        cut = min(whole.find(s) for s in stop if s in whole)
        assert final.text == whole[:cut] and final.finish_reason == "stop"
        assert final.stop_reason == whole[cut:][: len(final.stop_reason)]
    assert_nothing_leaked(llm)


def test_each_tokens_decode_work_is_bounded(llm, monkeypatch, token_ids):
    """Streaming, stop strings and the final text decode a few tokens per new token, never the whole
    output again: every ``tokenizer.decode`` call gets a handful of tokens, at token 10 as at token 150
    (streaming decoded the whole output at every step, O(length) per token)."""
    tokenizer = llm.get_tokenizer()
    decoded_per_call: list[int] = []
    decode = tokenizer.decode

    def counting_decode(ids, *args, **kwargs):
        decoded_per_call.append(len(ids))
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    scripted_sampler(monkeypatch, token_ids)
    params = SamplingParams(temperature=0, max_tokens=len(token_ids), ignore_eos=True, stop=["never"])
    deltas = asyncio.run(stream_one(llm, params))
    assert "".join(delta.text for delta in deltas) == deltas[-1].output.outputs[0].text == TEXT
    assert len(token_ids) > 150 and len(deltas) > 150
    assert max(decoded_per_call) <= 8, decoded_per_call  # a character's bytes and the token before them
    assert sum(decoded_per_call) <= 8 * len(token_ids)
    assert_nothing_leaked(llm)


def test_the_detokenizer_matches_decode_stream_token_by_token(llm, token_ids):
    """After every token, the text so far is DecodeStream's: what vLLM streams."""
    tokenizer = llm.get_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer)
    for end, token in enumerate(token_ids, start=1):
        assert detokenizer.update([token], stop_terminated=False) is None
        assert detokenizer.output_text == decode_stream_text(tokenizer, token_ids[:end])
    assert detokenizer.output_text == TEXT


def test_a_stop_string_is_searched_only_near_the_new_text_and_held_back_while_streaming(llm, token_ids):
    """As vLLM's check_stop_strings: the new text and ``len(stop) - 1`` characters before it; a stream is
    shown all but those characters until the request finishes, so a stop string never reaches it."""
    tokenizer = llm.get_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, ["café, 日"])
    shown = ""
    for token in token_ids:
        stop = detokenizer.update([token], stop_terminated=False)
        if stop is not None:
            break
        shown += detokenizer.get_next_output_text(finished=False, delta=True)
        assert len(detokenizer.output_text) - len(shown) <= len("café, 日") - 1
    assert stop == "café, 日"
    assert detokenizer.output_text == "a naïve "
    shown += detokenizer.get_next_output_text(finished=True, delta=True)
    assert shown == "a naïve "
    # The token that stopped a request by EOS or a stop token id is kept, not decoded.
    ended = IncrementalDetokenizer(tokenizer)
    ended.update(token_ids[:3], stop_terminated=True)
    assert ended.token_ids == token_ids[:3] and ended.output_text == tokenizer.decode(token_ids[:2])
