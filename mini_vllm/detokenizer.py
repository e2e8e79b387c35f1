"""One request's output text, decoded one token at a time (chapter 08).

``IncrementalDetokenizer`` owns the text of a request's output: the engine
feeds it each new token (``update``), which decodes only the last few tokens,
finds a stop string the new text completed, and cuts the text there; the
final ``CompletionOutput.text`` is its ``output_text``, and a stream takes the
text that is new since its last look from ``get_next_output_text``. So the text
is decoded once, in one place, and each token costs the same at any length.

The decoding is vLLM's ``detokenize_incrementally``: two offsets into the
output tokens, ``prefix_offset <= read_offset``. The tokens from
``prefix_offset`` on are decoded twice, once up to ``read_offset`` (text
already shown) and once to the end; the new text is what the second has beyond
the first. The few tokens before ``read_offset`` are decoded again as context
because a token's text can depend on its neighbours (a merged space, the bytes
of one character split over several byte-level tokens). Text that ends in
"\ufffd" is held back: the last tokens only began a character, and a later
token will complete it (a generation that stops there never shows it). Unlike
vLLM, the prompt's last tokens are not used as context: the text is the decode
of the output tokens alone, as ``tokenizer.decode(token_ids)`` gives it.

Stop strings, as vLLM's ``check_stop_strings``: only the new text and the
``stop_string_window`` characters before it are searched (a stop string found
there ends the request, and the text is cut where it starts: the earliest one
wins), and while the request runs a stream is shown all but the last
``stop_string_window`` characters, which a stop string could still cut.

vLLM equivalent: ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``,
``SlowIncrementalDetokenizer``, ``check_stop_strings``) and
``vllm/transformers_utils/detokenizer_utils.py`` (``detokenize_incrementally``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_stop_string(text: str, stop_strings: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The stop string that starts first in ``text[start:]`` and where (in ``text``): ``(position, stop string)``, or None."""
    found = [(text.find(stop, start), stop) for stop in stop_strings]
    found = [(position, stop) for position, stop in found if position >= 0]
    return min(found, key=lambda hit: hit[0]) if found else None


def find_stop_string(text: str, stop_strings: Sequence[str]) -> int | None:
    """Where the first stop string starts in ``text``, or None."""
    hit = first_stop_string(text, stop_strings)
    return None if hit is None else hit[0]


def stop_string_window(stop_strings: Sequence[str]) -> int:
    """How many characters before the new text a stop string completed by it can start: the longest one's length - 1.

    The stop check searches only the new text and these characters before it
    (O(1) per token); a stream holds these characters back while the request
    runs, since a stop string could still cut them (vLLM's ``stop_buffer_length``).
    """
    return max((len(stop) for stop in stop_strings), default=1) - 1


class IncrementalDetokenizer:
    """Owns one request's output text: ``update`` with each new token, read ``output_text``.

    ``token_ids``: the output tokens given to ``update``; ``output_text``: their
    text, cut at the stop string that ended the request (the token that
    stopped it by EOS or ``stop_token_ids`` is not text, as in vLLM).
    ``prefix_offset``/``read_offset``: where the decode of the next token
    starts, and where the text shown so far ends, in ``token_ids``.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        self.token_ids: list[int] = []
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_buffer_length = stop_string_window(self.stop_strings)
        self._last_output_text_offset = 0  # what get_next_output_text(delta=True) has given so far

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Decode the new tokens, then look for a stop string they completed; returns it, or None.

        ``stop_terminated``: the last new token stopped the request (EOS or a
        stop token id); it is kept in ``token_ids`` but not decoded. A stop
        string found cuts ``output_text`` where it starts.
        """
        if not new_token_ids:
            return None
        to_decode = new_token_ids[:-1] if stop_terminated else new_token_ids
        text_before = len(self.output_text)
        for token_id in to_decode:
            self.token_ids.append(token_id)
            self.output_text += self.decode_next()
        if stop_terminated:
            self.token_ids.append(new_token_ids[-1])
        new_char_count = len(self.output_text) - text_before
        if not (self.stop_strings and new_char_count):
            return None
        start = max(0, text_before - stop_string_window(self.stop_strings))
        hit = first_stop_string(self.output_text, self.stop_strings, start)
        if hit is None:
            return None
        position, stop = hit
        self.output_text = self.output_text[:position]
        return stop

    def decode_next(self) -> str:
        """The text the last token of ``token_ids`` adds ("" while it only began a character): vLLM's
        ``detokenize_incrementally``, which decodes ``token_ids[prefix_offset:]`` and nothing before."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new yet, or the last bytes began a character that a later token completes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show: all of it, or with ``delta`` only what is new since the last call.

        While the request runs, the last ``stop_buffer_length`` characters are
        held back (a stop string could still cut them); once it has finished,
        nothing is.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self.output_text) - buffer_length
        if not delta:
            return self.output_text[:length]
        last_offset = self._last_output_text_offset
        if last_offset >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[last_offset:length]
