"""Dataset sources: JSONL/Parquet rows, ACLSum, synthetic, and the config errors users hit."""

from __future__ import annotations

import json
import logging

import pytest

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.data.sources import build_source, parse_source
from lightning_lorafusion.specs import ConfigError

PC_ROWS = [
    {"prompt": "Q: capital of France?\nA:", "completion": " Paris."},
    {"prompt": "Q: two plus three?\nA:", "completion": " Five."},
    {"prompt": "Q: colour of the sky?\nA:", "completion": " Blue."},
]
CHAT_ROW = {
    "messages": [
        {"role": "user", "content": "Say something nice."},
        {"role": "assistant", "content": "You are doing great."},
    ]
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def label_text(tok, sample):
    return tok.decode([t for t in sample.labels if t != IGNORE_INDEX])


def test_jsonl_prompt_completion(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    path = write_jsonl(tmp_path / "train.jsonl", PC_ROWS)
    samples = build_source({"kind": "jsonl", "path": str(path)}, tok, name="qa")
    assert [s.source_index for s in samples] == [0, 1, 2]
    for row, s in zip(PC_ROWS, samples):
        assert label_text(tok, s) == row["completion"] + tok.eos_token
        assert tok.decode(list(s.input_ids)).startswith(row["prompt"])


def test_jsonl_auto_detects_messages_per_row_and_custom_fields(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    rows = [{"question": "Q: hi?\nA:", "answer": " Hello."}, CHAT_ROW, {"question": "Q: x?\nA:", "answer": " Y."}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    spec = {"kind": "jsonl", "path": str(path), "prompt_field": "question", "completion_field": "answer"}
    samples = build_source(spec, tok)
    assert label_text(tok, samples[0]) == " Hello." + tok.eos_token
    assert label_text(tok, samples[1]) == "You are doing great.<|im_end|>"
    assert "<|im_start|>user" in tok.decode(list(samples[1].input_ids))
    assert label_text(tok, samples[2]) == " Y." + tok.eos_token


def test_jsonl_errors_name_row_field_and_path(tmp_path, smollm2_tokenizer, word_tokenizer):
    tok = smollm2_tokenizer
    path = write_jsonl(tmp_path / "bad.jsonl", [PC_ROWS[0], {"prompt": "no completion here"}])
    with pytest.raises(ConfigError, match=r"row 1 has no field 'completion'"):
        build_source({"kind": "jsonl", "path": str(path)}, tok)
    path = write_jsonl(tmp_path / "other.jsonl", [{"body": "hello"}])
    with pytest.raises(ConfigError, match=r"row 0 has neither 'messages' nor 'prompt'/'completion' nor 'text'"):
        build_source({"kind": "jsonl", "path": str(path)}, tok)
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT_ROW])
    with pytest.raises(ConfigError, match="row 0 has no field 'prompt'"):
        build_source({"kind": "jsonl", "path": str(path), "format": "prompt_completion"}, tok)
    with pytest.raises(ConfigError, match="row 0: .*no chat template"):
        build_source({"kind": "jsonl", "path": str(path)}, word_tokenizer)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{not json\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        build_source({"kind": "jsonl", "path": str(tmp_path / "broken.jsonl")}, tok)
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(ConfigError, match=f"data file '{missing}' does not exist"):
        build_source({"kind": "jsonl", "path": str(missing)}, tok)


def test_empty_dataset_is_an_error(tmp_path, word_tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="adapter dataset legal is empty: the source has no rows"):
        build_source({"kind": "jsonl", "path": str(path)}, word_tokenizer, name="legal")


def test_too_long_samples_are_dropped_with_a_warning(tmp_path, word_tokenizer, caplog):
    rows = [
        {"prompt": "what ?", "completion": "the cat sat on the mat"},  # 7 completion tokens + EOS
        {"prompt": "what ?", "completion": "it ran"},
        {"prompt": "what did the dog do ?", "completion": "it sat"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="lightning_lorafusion.data.sources"):
        samples = build_source({"kind": "jsonl", "path": str(path)}, word_tokenizer, max_length=5, name="qa")
    assert [s.source_index for s in samples] == [1, 2]
    assert all(s.length <= 5 for s in samples)
    assert "dropped 1 of 3 samples" in caplog.text and "max_length=5" in caplog.text
    with pytest.raises(ConfigError, match="adapter dataset qa is empty: all 3 samples are longer"):
        build_source({"kind": "jsonl", "path": str(path)}, word_tokenizer, max_length=3, name="qa")


def test_parquet_matches_jsonl(tmp_path, smollm2_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = smollm2_tokenizer
    pq.write_table(pa.Table.from_pylist(PC_ROWS), tmp_path / "pc.parquet")
    from_parquet = build_source({"kind": "parquet", "path": str(tmp_path / "pc.parquet")}, tok)
    from_jsonl = build_source({"kind": "jsonl", "path": str(write_jsonl(tmp_path / "pc.jsonl", PC_ROWS))}, tok)
    assert from_parquet == from_jsonl

    pq.write_table(pa.Table.from_pylist([CHAT_ROW, CHAT_ROW]), tmp_path / "chat.parquet")
    chat = build_source({"kind": "parquet", "path": str(tmp_path / "chat.parquet"), "format": "messages"}, tok)
    assert len(chat) == 2 and label_text(tok, chat[1]) == "You are doing great.<|im_end|>"

    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match="cannot read .*fake.parquet as Parquet"):
        build_source({"kind": "parquet", "path": str(tmp_path / "fake.parquet")}, tok)


def test_limit_keeps_the_first_fitting_samples(tmp_path, word_tokenizer):
    rows = [{"prompt": "what ?", "completion": w} for w in "one two three four five".split()]
    rows[1]["completion"] = "the cat sat on the mat"  # too long for max_length=5
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    samples = build_source({"kind": "jsonl", "path": str(path), "limit": 3}, word_tokenizer, max_length=5)
    assert [s.source_index for s in samples] == [0, 2, 3]
    assert len(build_source({"kind": "aclsum", "aspect": "outcome", "limit": 7}, word_tokenizer)) == 7
    with pytest.raises(ConfigError, match="limit=0"):
        parse_source({"kind": "jsonl", "path": str(path), "limit": 0})


def test_split_paths(tmp_path, word_tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "what ?", "completion": "one"}])
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "what ?", "completion": "two"}] * 2)
    spec = {"kind": "jsonl", "path": {"train": str(train), "val": str(val)}}
    assert len(build_source(spec, word_tokenizer)) == 1
    assert len(build_source(spec, word_tokenizer, split="val")) == 2
    assert len(build_source(spec, word_tokenizer, split="validation")) == 2
    with pytest.raises(ConfigError, match="no file for split 'test'"):
        build_source(spec, word_tokenizer, split="test")
    with pytest.raises(ConfigError, match="used for the 'train' split only"):
        build_source({"kind": "jsonl", "path": str(train)}, word_tokenizer, split="val")


def test_spec_validation_errors():
    with pytest.raises(ConfigError, match=r"kind='csv'; allowed: \['aclsum', 'hf', 'jsonl', 'parquet', 'synthetic'\]"):
        parse_source({"kind": "csv", "path": "x.csv"})
    with pytest.raises(ConfigError, match="kind=None"):
        parse_source({"path": "x.jsonl"})
    with pytest.raises(ConfigError, match=r"unknown dataset key\(s\) \['prompt_feild'\]"):
        parse_source({"kind": "jsonl", "path": "x.jsonl", "prompt_feild": "q"})
    with pytest.raises(ConfigError, match="needs a 'path'"):
        parse_source({"kind": "parquet"})
    with pytest.raises(ConfigError, match="format='chat'"):
        parse_source({"kind": "jsonl", "path": "x.jsonl", "format": "chat"})
    with pytest.raises(ConfigError, match="kind 'aclsum': .*missing .*'aspect'"):
        parse_source({"kind": "aclsum"})
    with pytest.raises(ConfigError, match="aspect='summary'"):
        parse_source({"kind": "aclsum", "aspect": "summary"})
    with pytest.raises(ConfigError, match="sections"):
        parse_source({"kind": "aclsum", "aspect": "outcome", "sections": ["results"]})
    with pytest.raises(ConfigError, match="split='dev2'"):
        parse_source({"kind": "aclsum", "aspect": "outcome", "split": "dev2"})
    with pytest.raises(ConfigError, match="distribution='reddit'; allowed: .*'xsum'"):
        parse_source({"kind": "synthetic", "distribution": "reddit", "num_samples": 4})
    with pytest.raises(ConfigError, match="num_samples=0"):
        parse_source({"kind": "synthetic", "distribution": "xsum", "num_samples": 0})
    with pytest.raises(ConfigError, match="max_length=1"):
        build_source({"kind": "jsonl", "path": "x.jsonl"}, None, max_length=1)


@pytest.mark.parametrize("aspect", ["challenge", "approach", "outcome"])
def test_aclsum_train_split(aspect, smollm2_tokenizer):
    tok = smollm2_tokenizer
    samples = build_source({"kind": "aclsum", "aspect": aspect}, tok, name=aspect)
    assert len(samples) == 100
    assert [s.source_index for s in samples] == list(range(100))
    from lightning_lorafusion.data.sources.aclsum import read_aclsum

    docs = read_aclsum("train")
    for s, doc in zip(samples[:10], docs):
        summary = doc["summary"][aspect].strip()
        assert summary
        assert label_text(tok, s) == summary + "<|im_end|>"
        # Rendered as a conversation: the instruction and title sit in the user turn.
        text = tok.decode(list(s.input_ids))
        assert text.index("<|im_start|>user") < text.index(doc["title"]) < text.index("<|im_start|>assistant")
    # 384 document tokens + instruction, title and template: well under 600 tokens each.
    assert max(s.length for s in samples) < 600
    assert min(s.num_label_tokens for s in samples) > 5


def test_aclsum_document_budget_split_and_plain_prompt(smollm2_tokenizer, word_tokenizer):
    tok = smollm2_tokenizer
    short = build_source({"kind": "aclsum", "aspect": "approach", "max_document_tokens": 64}, tok)
    full = build_source({"kind": "aclsum", "aspect": "approach"}, tok)
    assert all(a.length < b.length for a, b in zip(short, full))
    assert all(label_text(tok, a) == label_text(tok, b) for a, b in zip(short, full))
    assert len(build_source({"kind": "aclsum", "aspect": "approach"}, tok, split="val")) == 50
    assert len(build_source({"kind": "aclsum", "aspect": "approach", "split": "test"}, tok)) == 100
    # No chat template: a plain prompt ending in "Summary:" and the summary as completion.
    plain = build_source({"kind": "aclsum", "aspect": "outcome", "use_chat_template": False}, tok)
    text = tok.decode(list(plain[0].input_ids))
    assert "<|im_start|>" not in text.replace(tok.eos_token, "")
    assert "\n\nSummary: " in text and label_text(tok, plain[0]).endswith(tok.eos_token)
    assert len(build_source({"kind": "aclsum", "aspect": "outcome"}, word_tokenizer)) == 100
    with pytest.raises(ConfigError, match="has no chat template"):
        build_source({"kind": "aclsum", "aspect": "outcome", "use_chat_template": True}, word_tokenizer)


def test_synthetic_needs_a_vocab_size():
    with pytest.raises(ConfigError, match="set 'vocab_size'"):
        build_source({"kind": "synthetic", "distribution": "xsum", "num_samples": 4}, None)


def test_synthetic_source_is_seeded_and_pre_shifted(word_tokenizer):
    from lightning_lorafusion.data.synthetic import synthetic_token_samples

    spec = {"kind": "synthetic", "distribution": "xsum", "num_samples": 16, "seed": 3, "vocab_size": 100}
    samples = build_source(spec, None, max_length=512)
    assert len(samples) == 16
    assert build_source({**spec, "limit": 5}, None, max_length=512) == samples[:5]
    assert all(s.length <= 512 and max(s.input_ids) < 100 for s in samples)
    raw = synthetic_token_samples("xsum", 16, vocab_size=100, seed=3, max_length=512)
    for s, (ids, targets) in zip(samples, raw):
        assert list(s.input_ids) == ids
        # In-place targets become pre-shifted labels: labels[t] = targets[t + 1].
        assert list(s.labels) == targets[1:] + [IGNORE_INDEX]
        assert s.num_label_tokens > 0
    assert build_source(spec, None, max_length=512) == samples
    assert build_source(spec, None, max_length=512, split="val") != samples
    from_tok = build_source({k: v for k, v in spec.items() if k != "vocab_size"}, word_tokenizer)
    assert max(max(s.input_ids) for s in from_tok) < len(word_tokenizer)
