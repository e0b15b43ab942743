"""Turn prompt/completion pairs and chat conversations into token ids with pre-shifted labels.

Label convention (every consumer relies on it): ``labels`` has the same length as
``input_ids`` and is *pre-shifted* for causal LM training: ``labels[t]`` is the token the
model must predict at position ``t``, i.e. ``input_ids[t + 1]`` when that token belongs to
a completion (or an assistant turn, or the EOS that ends it), else ``IGNORE_INDEX``. The last
position is always ``IGNORE_INDEX``. The loss is therefore
``cross_entropy(logits[t], labels[t])`` over positions with ``labels[t] != IGNORE_INDEX``,
with no shifting by the consumer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .microbatch import IGNORE_INDEX


class SampleTooLongError(ValueError):
    """A sample cannot fit ``max_length`` tokens without cutting the tokens it is trained on."""


@dataclass(frozen=True, kw_only=True)
class TokenizedSample:
    """One training sample: ``input_ids`` and pre-shifted ``labels``, both ``[length]``.

    ``source_index`` is the sample's row in its source dataset (0-based), kept so errors and
    logs can point back at the data.
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    source_index: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.input_ids, tuple):
            object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        if not isinstance(self.labels, tuple):
            object.__setattr__(self, "labels", tuple(int(t) for t in self.labels))
        if len(self.input_ids) != len(self.labels):
            raise ValueError(
                f"sample {self.source_index}: input_ids has {len(self.input_ids)} tokens but "
                f"labels has {len(self.labels)}; they must have the same length (labels are "
                "pre-shifted, see lightning_lorafusion.data.tokenization)"
            )
        if not self.input_ids:
            raise ValueError(f"sample {self.source_index}: input_ids is empty")

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def num_label_tokens(self) -> int:
        """Positions that contribute to the loss."""
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


def shifted_labels(input_ids: Sequence[int], is_target: Sequence[bool]) -> tuple[int, ...]:
    """Pre-shifted labels: ``labels[t] = input_ids[t+1]`` where token ``t+1`` is a target."""
    if len(input_ids) != len(is_target):
        raise ValueError(f"{len(input_ids)} ids but {len(is_target)} target flags")
    labels = [
        int(input_ids[t + 1]) if is_target[t + 1] else IGNORE_INDEX
        for t in range(len(input_ids) - 1)
    ]
    labels.append(IGNORE_INDEX)
    return tuple(labels)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _special_prefix(tokenizer: Any) -> list[int]:
    """Special tokens the tokenizer puts before a text by default (e.g. BOS for Llama)."""
    with_specials = list(tokenizer("x", add_special_tokens=True)["input_ids"])
    plain = _encode(tokenizer, "x")
    for start in range(len(with_specials) - len(plain) + 1):
        if with_specials[start : start + len(plain)] == plain:
            return with_specials[:start]
    return []


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos_token_id, so completions cannot be terminated with EOS; "
            "set an eos_token on the tokenizer or pass add_eos=False"
        )
    return int(eos)


def tokenize_prompt_completion(
    tokenizer: Any,
    prompt: str,
    completion: str,
    *,
    max_length: int | None = None,
    add_eos: bool = True,
    source_index: int = 0,
) -> TokenizedSample:
    """Plain-text sample ``[specials] + prompt + completion (+ EOS)``; loss on completion + EOS.

    Prompt and completion are tokenized separately and concatenated, so the label tokens are
    exactly the completion's own tokens; put any separator (space, newline) at the end of the
    prompt. When the sample exceeds ``max_length``, the prompt is cut from the left (its end,
    nearest the completion, is kept; leading special tokens such as BOS stay). When even the
    completion plus one context token does not fit, ``SampleTooLongError`` is raised.
    """
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise TypeError(
            f"sample {source_index}: prompt and completion must be strings, got "
            f"{type(prompt).__name__} and {type(completion).__name__}"
        )
    prefix = _special_prefix(tokenizer)
    prompt_ids = _encode(tokenizer, prompt)
    completion_ids = _encode(tokenizer, completion)
    if add_eos:
        eos = _eos_id(tokenizer)
        if not completion_ids or completion_ids[-1] != eos:
            completion_ids.append(eos)
    if not completion_ids:
        raise ValueError(f"sample {source_index}: completion is empty, nothing to train on")
    context = prefix + prompt_ids
    if max_length is not None:
        room = max_length - len(completion_ids)
        # The first completion token is predicted from the position before it: keep >= 1.
        if room < 1:
            raise SampleTooLongError(
                f"sample {source_index}: completion has {len(completion_ids)} tokens, "
                f"which leaves no room for context within max_length={max_length}"
            )
        if len(context) > room:
            keep_prompt = max(room - len(prefix), 0)
            context = (prefix + prompt_ids[len(prompt_ids) - keep_prompt :])[-room:]
    if not context:
        # Nothing precedes the completion (empty prompt, no BOS): its first token is context.
        context, completion_ids = completion_ids[:1], completion_ids[1:]
        if not completion_ids:
            raise ValueError(
                f"sample {source_index}: prompt is empty and the completion is a single token; "
                "nothing can be predicted"
            )
    input_ids = context + completion_ids
    is_target = [False] * len(context) + [True] * len(completion_ids)
    return TokenizedSample(
        input_ids=tuple(input_ids),
        labels=shifted_labels(input_ids, is_target),
        source_index=source_index,
    )


def tokenize_text(
    tokenizer: Any,
    text: str,
    *,
    max_length: int | None = None,
    add_eos: bool = True,
    source_index: int = 0,
) -> TokenizedSample:
    """Plain text for language modelling: ``[specials] + text (+ EOS)``; loss on every token.

    Every text token (and the EOS) is a target, except the first one when no special token
    precedes it (nothing predicts it). A sample longer than ``max_length`` is cut from the
    right: its beginning is kept, and it then has no EOS (the text does not end there).
    """
    if not isinstance(text, str):
        raise TypeError(f"sample {source_index}: text must be a string, got {type(text).__name__}")
    prefix = _special_prefix(tokenizer)
    ids = prefix + _encode(tokenizer, text)
    if add_eos:
        eos = _eos_id(tokenizer)
        if ids[-1:] != [eos]:
            ids.append(eos)
    first_target = max(len(prefix), 1)  # the first token without a special before it is context
    if max_length is not None:
        if first_target >= max_length:
            raise SampleTooLongError(
                f"sample {source_index}: {len(prefix)} leading special token(s) leave no room "
                f"for text within max_length={max_length}"
            )
        ids = ids[:max_length]
    if len(ids) <= first_target:
        raise ValueError(f"sample {source_index}: text is empty, nothing to train on")
    is_target = [t >= first_target for t in range(len(ids))]
    return TokenizedSample(
        input_ids=tuple(ids), labels=shifted_labels(ids, is_target), source_index=source_index
    )


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _validate_messages(messages: Any, source_index: int) -> list[dict[str, str]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(
            f"sample {source_index}: 'messages' must be a non-empty list of "
            "{'role': ..., 'content': ...} objects"
        )
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"sample {source_index}: message {i} must be an object with 'role' and "
                f"'content', got {message!r:.120}"
            )
        if not isinstance(message["content"], str):
            raise ValueError(
                f"sample {source_index}: message {i} content must be a string, got "
                f"{type(message['content']).__name__}"
            )
        clean.append({"role": str(message["role"]), "content": message["content"]})
    if clean[0]["role"] == "assistant":
        raise ValueError(
            f"sample {source_index}: the conversation starts with an assistant turn; put the "
            "user (or system) message it answers before it"
        )
    if not any(m["role"] == "assistant" for m in clean):
        raise ValueError(
            f"sample {source_index}: no message has role 'assistant', so there is nothing to "
            "train on (loss is only on assistant turns)"
        )
    return clean


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as err:  # jinja raises its own types, including the template's own errors
        raise ValueError(f"the tokenizer's chat template failed to render: {err}") from err
    if not isinstance(text, str):
        raise ValueError(f"the chat template rendered a {type(text).__name__}, expected text")
    return text


def assistant_char_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return its text and the character span of each assistant turn.

    A turn's span starts where rendering the conversation up to that turn with the
    generation prompt ends, and ends where rendering up to and including the turn ends
    (trailing whitespace, the template's separator, excluded). So the span covers the reply
    and the template's end-of-turn token, whatever the template's markup is.
    """
    full = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not full.startswith(before) or not full.startswith(through):
            raise ValueError(
                f"the tokenizer's chat template renders message {i} differently depending on "
                "what follows it, so assistant turns cannot be located by prefix rendering; "
                "use prompt/completion rows for this model instead"
            )
        end = len(through.rstrip())
        if end <= len(before):
            continue  # empty assistant turn: nothing to learn
        spans.append((len(before), end))
    return full, spans


def tokenize_messages(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    max_length: int | None = None,
    source_index: int = 0,
) -> TokenizedSample:
    """A chat conversation rendered by the tokenizer's chat template; loss on assistant turns.

    Targets are the tokens of every assistant reply plus the template's end-of-turn token.
    Conversations are never truncated (cutting a rendered conversation breaks its markup): one
    longer than ``max_length`` raises ``SampleTooLongError``.
    """
    if not has_chat_template(tokenizer):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} "
            "has no chat template, so 'messages' samples cannot be rendered; use a model whose "
            "tokenizer_config.json has a chat_template, or prompt/completion rows"
        )
    clean = _validate_messages(messages, source_index)
    try:
        text, spans = assistant_char_spans(tokenizer, clean)
    except ValueError as err:
        raise ValueError(f"sample {source_index}: {err}") from err
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    is_target = [any(s <= start < e for s, e in spans) for start, _ in offsets]
    if not any(is_target[1:]):
        raise ValueError(f"sample {source_index}: assistant turns are empty, nothing to train on")
    if max_length is not None and len(input_ids) > max_length:
        raise SampleTooLongError(
            f"sample {source_index}: conversation has {len(input_ids)} tokens > "
            f"max_length={max_length} (conversations are not truncated)"
        )
    return TokenizedSample(
        input_ids=tuple(input_ids),
        labels=shifted_labels(input_ids, is_target),
        source_index=source_index,
    )
