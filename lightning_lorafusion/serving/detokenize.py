"""Incremental detokenization: text deltas as tokens arrive, stop strings, held-back tails."""

from __future__ import annotations

from typing import Any, Sequence

# Tokens of the prompt decoded ahead of the output, so that the first output token's leading
# space (SentencePiece / byte-level BPE) comes out as it would mid-sentence.
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta per call.

    A delta is only released when it does not end in an incomplete UTF-8 character (``\\ufffd``);
    with stop strings, the last ``len(longest stop) - 1`` characters are held back until the
    request finishes, so no streamed text is ever retracted. Text found at or after a stop
    string is cut (the stop string itself is not returned).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix, self._read = 0, len(self._ids)
        self.text = ""  # output text so far (after any stop cut)
        self._sent = 0  # characters of `text` already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> None:
        """Append one generated token's text; sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return  # wait for the rest of a multi-byte character
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        searched_from = max(0, len(self.text) - self._hold)
        self.text += delta
        cut = min((i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True

    def take_delta(self, final: bool = False) -> str:
        """Text not yet returned; keeps back a possible stop-string prefix unless ``final``."""
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta
