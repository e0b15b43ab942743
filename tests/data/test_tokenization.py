"""Tokenization: pre-shifted labels exactly on completion / assistant tokens, truncation."""

from __future__ import annotations

import copy

import pytest

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.data.tokenization import (
    SampleTooLongError,
    TokenizedSample,
    shifted_labels,
    tokenize_messages,
    tokenize_prompt_completion,
    tokenize_text,
)


def label_ids(sample: TokenizedSample) -> list[int]:
    return [t for t in sample.labels if t != IGNORE_INDEX]


def words(tok, ids) -> str:
    return " ".join(tok.convert_ids_to_tokens(list(ids)))


def assert_pre_shifted(sample: TokenizedSample) -> None:
    assert len(sample.labels) == len(sample.input_ids)
    assert sample.labels[-1] == IGNORE_INDEX
    for t, label in enumerate(sample.labels):
        if label != IGNORE_INDEX:
            assert label == sample.input_ids[t + 1], f"position {t}"


def test_shifted_labels_targets_next_token():
    assert shifted_labels([10, 11, 12, 13], [False, False, True, True]) == (-100, 12, 13, -100)
    assert shifted_labels([5], [True]) == (-100,)


def test_tokenized_sample_validates_and_coerces():
    s = TokenizedSample(input_ids=[1, 2, 3], labels=[-100, 3, -100], source_index=7)
    assert s.input_ids == (1, 2, 3) and isinstance(s.labels, tuple)
    assert s.length == 3 and s.num_label_tokens == 1 and s.source_index == 7
    with pytest.raises(ValueError, match="same length"):
        TokenizedSample(input_ids=(1, 2), labels=(-100,))
    with pytest.raises(ValueError, match="empty"):
        TokenizedSample(input_ids=(), labels=())


def test_prompt_completion_labels_are_exactly_the_completion(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt, completion = "Question: what is two plus two?\nAnswer:", " Two plus two is four."
    s = tokenize_prompt_completion(tok, prompt, completion, source_index=3)
    assert_pre_shifted(s)
    assert s.source_index == 3
    assert tok.decode(label_ids(s)) == completion + tok.eos_token
    assert tok.decode(list(s.input_ids)) == prompt + completion + tok.eos_token
    # The first target is predicted from the last prompt token.
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    first = next(t for t, label in enumerate(s.labels) if label != IGNORE_INDEX)
    assert first == n_prompt - 1
    assert s.num_label_tokens == s.length - n_prompt


def test_prompt_completion_without_eos(smollm2_tokenizer):
    tok = smollm2_tokenizer
    s = tokenize_prompt_completion(tok, "Say hi:", " hi there", add_eos=False)
    assert_pre_shifted(s)
    assert tok.decode(label_ids(s)) == " hi there"
    assert tok.eos_token_id not in s.input_ids


def test_prompt_is_truncated_from_the_left(word_tokenizer):
    tok = word_tokenizer
    prompt = "one two three four five what did the cat do ?"
    s = tokenize_prompt_completion(tok, prompt, "it sat", max_length=6)
    assert s.length == 6
    assert words(tok, s.input_ids) == "cat do ? it sat <eos>"
    assert words(tok, label_ids(s)) == "it sat <eos>"
    assert_pre_shifted(s)


def bos_word_tokenizer():
    """Word-level, ids <unk>=0 <bos>=1 <eos>=2 a=3 b c d e x y=9; puts BOS before a text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate("<unk> <bos> <eos> a b c d e x y".split())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def test_truncation_keeps_leading_bos():
    tok = bos_word_tokenizer()
    full = tokenize_prompt_completion(tok, "a b c d e", "x y")
    assert full.input_ids == (1, 3, 4, 5, 6, 7, 8, 9, 2)
    cut = tokenize_prompt_completion(tok, "a b c d e", "x y", max_length=6)
    assert cut.input_ids == (1, 6, 7, 8, 9, 2)  # BOS kept, prompt's start dropped
    assert cut.labels == (-100, -100, 8, 9, 2, -100)


def test_text_trains_on_every_token_and_is_cut_from_the_right(word_tokenizer):
    tok = bos_word_tokenizer()
    full = tokenize_text(tok, "a b c")
    assert full.input_ids == (1, 3, 4, 5, 2)
    assert full.labels == (3, 4, 5, 2, IGNORE_INDEX)  # BOS is context, every text token a target
    cut = tokenize_text(tok, "a b c", max_length=3)
    assert cut.input_ids == (1, 3, 4) and cut.labels == (3, 4, IGNORE_INDEX)  # no EOS: text goes on
    assert tokenize_text(tok, "a b c", add_eos=False).input_ids == (1, 3, 4, 5)
    with pytest.raises(SampleTooLongError, match="max_length=1"):
        tokenize_text(tok, "a b c", max_length=1)
    # no BOS: the first word is context
    s = tokenize_text(word_tokenizer, "the cat")
    assert words(word_tokenizer, s.input_ids) == "the cat <eos>"
    assert words(word_tokenizer, label_ids(s)) == "cat <eos>"
    assert_pre_shifted(s)
    with pytest.raises(ValueError, match="text is empty"):
        tokenize_text(word_tokenizer, "", add_eos=False)
    with pytest.raises(TypeError, match="text must be a string"):
        tokenize_text(word_tokenizer, None)


def test_completion_longer_than_max_length_raises(word_tokenizer):
    with pytest.raises(SampleTooLongError, match="max_length=3"):
        tokenize_prompt_completion(word_tokenizer, "what ?", "the cat sat", max_length=3)
    # completion + EOS = 4 tokens, plus one context token: 5 fits exactly.
    s = tokenize_prompt_completion(word_tokenizer, "what ?", "the cat sat", max_length=5)
    assert s.input_ids[0] == word_tokenizer.convert_tokens_to_ids("?")


def test_empty_prompt_uses_first_completion_token_as_context(word_tokenizer):
    s = tokenize_prompt_completion(word_tokenizer, "", "the cat")
    assert words(word_tokenizer, label_ids(s)) == "cat <eos>"


def test_messages_loss_only_on_assistant_turns(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sky."},
    ]
    s = tokenize_messages(tok, messages, source_index=5)
    assert_pre_shifted(s)
    assert s.source_index == 5
    text = tok.apply_chat_template(messages, tokenize=False)
    assert list(s.input_ids) == tok(text, add_special_tokens=False)["input_ids"]
    # Each reply and its end-of-turn token, nothing from system/user turns or the "\n" after.
    assert tok.decode(label_ids(s)) == "Hello!<|im_end|>Blue, like the sky.<|im_end|>"
    # The targets come in two contiguous runs, one per assistant turn.
    mask = [label != IGNORE_INDEX for label in s.labels]
    runs = sum(1 for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1]))
    assert runs == 2


def test_messages_with_default_system_prompt(smollm2_tokenizer):
    # SmolLM2's template inserts a system turn when none is given: still only the reply trains.
    tok = smollm2_tokenizer
    s = tokenize_messages(tok, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])
    assert "SmolLM" in tok.decode(list(s.input_ids))
    assert tok.decode(label_ids(s)) == "4<|im_end|>"


def test_messages_errors(smollm2_tokenizer, word_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_messages(word_tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ValueError, match="assistant"):
        tokenize_messages(smollm2_tokenizer, [{"role": "user", "content": "hello"}])
    with pytest.raises(ValueError, match="message 1 must be an object with 'role' and 'content'"):
        tokenize_messages(smollm2_tokenizer, [{"role": "user", "content": "a"}, {"text": "b"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tokenize_messages(smollm2_tokenizer, [])


def test_long_conversation_is_not_truncated(smollm2_tokenizer):
    messages = [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}]
    full = tokenize_messages(smollm2_tokenizer, messages)
    assert tokenize_messages(smollm2_tokenizer, messages, max_length=full.length) == full
    with pytest.raises(SampleTooLongError, match="not truncated"):
        tokenize_messages(smollm2_tokenizer, messages, max_length=full.length - 1)


def with_template(tokenizer, template):
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = template
    return clone


def test_messages_with_another_template_format(word_tokenizer):
    # Not ChatML: "role : content ." per turn, the generation prompt is "assistant :".
    tok = with_template(
        word_tokenizer,
        "{% for m in messages %}{{ m.role }} : {{ m.content }} . {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}",
    )
    messages = [
        {"role": "system", "content": "one two"},
        {"role": "user", "content": "what did the cat do ?"},
        {"role": "assistant", "content": "the cat sat"},
        {"role": "user", "content": "what did the dog do ?"},
        {"role": "assistant", "content": "it ran fast"},
    ]
    s = tokenize_messages(tok, messages)
    assert_pre_shifted(s)
    assert words(tok, label_ids(s)) == "the cat sat . it ran fast ."
    assert words(tok, s.input_ids).startswith("system : one two . user : what did")


def test_messages_template_problems_are_reported(word_tokenizer):
    convo = [
        {"role": "user", "content": "what ?"},
        {"role": "assistant", "content": "the cat"},
        {"role": "user", "content": "what ?"},
    ]
    # Renders the last message differently, so prefixes do not line up with the full text.
    tok = with_template(
        word_tokenizer, "{% for m in messages %}{% if loop.last %}red {% endif %}{{ m.content }} {% endfor %}"
    )
    with pytest.raises(ValueError, match="sample 4: .*renders message 1 differently"):
        tokenize_messages(tok, convo, source_index=4)
    tok = with_template(word_tokenizer, "{{ raise_exception('only one turn allowed') }}")
    with pytest.raises(ValueError, match="failed to render: only one turn allowed"):
        tokenize_messages(tok, convo)
    with pytest.raises(ValueError, match="starts with an assistant turn"):
        tokenize_messages(tok, convo[1:])
