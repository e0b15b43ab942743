"""Incremental detokenization, one row at a time and batched over rows, on a byte-level BPE
tokenizer whose tokens split multi-byte characters."""

from __future__ import annotations

import random

import pytest

from lightning_lorafusion.serving.detokenize import IncrementalDetokenizer, add_tokens, decode_many

TEXTS = ["héllo wörld, naïve café", "日本語のテキスト 🙂🙃 mixed", "plain ascii words here", "ñandú 🦜 über"]


@pytest.fixture(scope="module")
def byte_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(TEXTS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)


def test_decode_many_equals_decode(byte_bpe):
    rng = random.Random(0)
    vocab = byte_bpe.backend_tokenizer.get_vocab_size()
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 9))] for _ in range(50)]
    seqs.append([0, byte_bpe.eos_token_id, 5])  # a special token is skipped
    assert decode_many(byte_bpe, seqs) == [byte_bpe.decode(s, skip_special_tokens=True) for s in seqs]


def test_batched_equals_one_by_one_and_never_emits_half_characters(byte_bpe):
    ids = [byte_bpe(t)["input_ids"] for t in TEXTS]
    assert any(byte_bpe.decode(i[:k]).endswith("\ufffd") for i in ids for k in range(len(i)))  # splits exist
    prompt = byte_bpe("start: ")["input_ids"]
    alone = [IncrementalDetokenizer(byte_bpe, prompt) for _ in TEXTS]
    batched = [IncrementalDetokenizer(byte_bpe, prompt) for _ in TEXTS]
    deltas = [[] for _ in TEXTS]
    for k in range(max(map(len, ids))):
        live = [i for i in range(len(TEXTS)) if k < len(ids[i])]
        for i in live:
            alone[i].add_token(ids[i][k])
        add_tokens([(batched[i], ids[i][k]) for i in live])
        for i in live:
            assert alone[i].text == batched[i].text
            deltas[i].append(batched[i].take_delta())
            assert "\ufffd" not in deltas[i][-1]
    for i, text in enumerate(TEXTS):
        assert batched[i].text == "".join(deltas[i]) == text


def test_stop_strings_batched(byte_bpe):
    ids = byte_bpe(TEXTS[0])["input_ids"]
    d = IncrementalDetokenizer(byte_bpe, [], stop=("wörld",))
    for t in ids:
        add_tokens([(d, t)])
    assert d.stopped and d.text == "héllo "
