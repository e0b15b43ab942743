"""The `hf` dataset kind: local files, saved datasets, splits, streaming, limit, column mapping,
chat rows, and its config errors. Reference: the same rows read by the `jsonl` kind."""

from __future__ import annotations

import gzip

import pytest
from test_sources import PC_ROWS, label_text, write_jsonl

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.data.sources import build_source, parse_source
from lightning_lorafusion.data.tokenization import tokenize_messages
from lightning_lorafusion.specs import ConfigError

datasets = pytest.importorskip("datasets")

CHAT_ROWS = [
    {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something nice."},
        {"role": "assistant", "content": "You are doing great."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Still great."},
    ]},
    {"messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Teal."},
    ]},
]


def hf(path, tmp_path, **keys):
    """An `hf` dataset spec whose Arrow cache stays under the test's directory."""
    return {"kind": "hf", "path": str(path), "cache_dir": str(tmp_path / "hf-cache"), **keys}


def test_local_files_of_every_format_read_like_jsonl(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    reference = build_source({"kind": "jsonl", "path": str(write_jsonl(tmp_path / "pc.jsonl", PC_ROWS))}, tok)
    table = datasets.Dataset.from_list(PC_ROWS)
    table.to_parquet(str(tmp_path / "pc.parquet"))
    table.to_csv(str(tmp_path / "pc.csv"), index=False)
    table.to_json(str(tmp_path / "pc.json"))  # JSON lines, datasets' default
    table.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    with gzip.open(tmp_path / "pc.jsonl.gz", "wt") as f:
        f.write((tmp_path / "pc.jsonl").read_text())
    for name in ("pc.jsonl", "pc.parquet", "pc.csv", "pc.json", "pc.jsonl.gz", str(arrow), "saved"):
        samples = build_source(hf(tmp_path / name, tmp_path), tok, name="qa")
        assert samples == reference, name
        assert label_text(tok, samples[0]) == " Paris." + tok.eos_token
    # a glob of shards reads them in name order
    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "part-0.jsonl", PC_ROWS[:2])
    write_jsonl(tmp_path / "shards" / "part-1.jsonl", PC_ROWS[2:])
    assert build_source(hf(tmp_path / "shards" / "part-*.jsonl", tmp_path), tok) == reference
    # a directory of data files: datasets infers the format
    assert build_source(hf(tmp_path / "shards", tmp_path), tok) == reference


def test_saved_dataset_dict_splits_and_split_slices(tmp_path, word_tokenizer):
    rows = [{"prompt": "what ?", "completion": w} for w in "one two three four five".split()]
    val_rows = [{"prompt": "what ?", "completion": w} for w in "red blue".split()]
    dd = datasets.DatasetDict(train=datasets.Dataset.from_list(rows), validation=datasets.Dataset.from_list(val_rows))
    dd.save_to_disk(str(tmp_path / "dd"))
    spec = hf(tmp_path / "dd", tmp_path)
    words = lambda samples: [word_tokenizer.decode([t for t in s.labels if t != IGNORE_INDEX]) for s in samples]  # noqa: E731
    assert words(build_source(spec, word_tokenizer)) == [f"{w} <eos>" for w in "one two three four five".split()]
    assert words(build_source(spec, word_tokenizer, split="val")) == ["red <eos>", "blue <eos>"]
    assert words(build_source({**spec, "split": "validation"}, word_tokenizer)) == ["red <eos>", "blue <eos>"]
    with pytest.raises(ConfigError, match=r"has no split 'test' \(splits: \['train', 'validation'\]\)"):
        build_source(spec, word_tokenizer, split="test")
    # one file, split by datasets' slice syntax
    path = write_jsonl(tmp_path / "all.jsonl", rows)
    spec = hf(path, tmp_path, split={"train": "train[:3]", "val": "train[3:]"})
    assert len(build_source(spec, word_tokenizer)) == 3
    assert words(build_source(spec, word_tokenizer, split="val")) == ["four <eos>", "five <eos>"]
    with pytest.raises(ConfigError, match="is read as the 'train' split only"):
        build_source(hf(path, tmp_path), word_tokenizer, split="val")
    with pytest.raises(ConfigError, match="split='train' is the split read for training"):
        build_source(hf(path, tmp_path, split="train"), word_tokenizer, split="val")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    with pytest.raises(ConfigError, match="saved Dataset without splits"):
        build_source(hf(tmp_path / "single", tmp_path), word_tokenizer, split="val")


def test_streaming_reads_lazily_up_to_the_limit(tmp_path, word_tokenizer):
    rows = [{"prompt": "what ?", "completion": w} for w in "one two three four".split()]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    full = build_source(hf(path, tmp_path), word_tokenizer)
    assert build_source(hf(path, tmp_path, streaming=True), word_tokenizer) == full
    assert build_source(hf(path, tmp_path, streaming=True, limit=2), word_tokenizer) == full[:2]
    # a stream reads shard by shard: a broken shard after the limit is never opened; without
    # the limit it is an error (ConfigError at the row), and without streaming one at load
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "part-0.jsonl", rows)
    (shards / "part-1.jsonl").write_text("{not json\n")
    assert build_source(hf(shards / "part-*.jsonl", tmp_path, streaming=True, limit=4), word_tokenizer) == full
    with pytest.raises(ConfigError, match=r"\(hf\) .*part-\*.jsonl: cannot read a row: .*JSON"):
        build_source(hf(shards / "part-*.jsonl", tmp_path, streaming=True), word_tokenizer)
    with pytest.raises(ConfigError, match=r"cannot load '.*part-\*.jsonl' with the datasets library"):
        build_source(hf(shards / "part-*.jsonl", tmp_path, limit=4), word_tokenizer)
    # a saved dataset streams too (csv streams do not know their columns: checked per row)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert build_source(hf(tmp_path / "saved", tmp_path, streaming=True, limit=3), word_tokenizer) == full[:3]
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"), index=False)
    assert build_source(hf(tmp_path / "d.csv", tmp_path, streaming=True), word_tokenizer) == full


def test_chat_messages_train_on_assistant_turns_only(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    datasets.Dataset.from_list(CHAT_ROWS).to_parquet(str(tmp_path / "chat.parquet"))
    for spec in (hf(tmp_path / "chat.parquet", tmp_path), hf(tmp_path / "chat.parquet", tmp_path, streaming=True)):
        samples = build_source(spec, tok, name="chat")
        for row, sample in zip(CHAT_ROWS, samples):
            assert sample == tokenize_messages(tok, row["messages"], source_index=sample.source_index)
        assert label_text(tok, samples[0]) == "You are doing great.<|im_end|>Still great.<|im_end|>"
        assert "Be brief." in tok.decode(list(samples[0].input_ids))
    # a differently named column
    renamed = [{"conversation": r["messages"]} for r in CHAT_ROWS]
    write_jsonl(tmp_path / "conv.jsonl", renamed)
    samples = build_source(hf(tmp_path / "conv.jsonl", tmp_path, messages_field="conversation"), tok)
    assert label_text(tok, samples[1]) == "Teal.<|im_end|>"


def test_text_column_trains_on_every_token(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    texts = ["The quick brown fox jumps over the lazy dog.", "Short one."]
    write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    samples = build_source(hf(tmp_path / "t.jsonl", tmp_path), tok)
    for text, s in zip(texts, samples):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert list(s.input_ids) == ids + [tok.eos_token_id]  # SmolLM2 adds no BOS
        assert list(s.labels) == ids[1:] + [tok.eos_token_id, IGNORE_INDEX]
    # too long: the beginning is kept, no EOS (the text goes on)
    cut = build_source(hf(tmp_path / "t.jsonl", tmp_path, limit=1), tok, max_length=4)[0]
    assert list(cut.input_ids) == tok(texts[0], add_special_tokens=False)["input_ids"][:4]
    # the same rows through the jsonl kind (text is a row format of every row source)
    assert build_source({"kind": "jsonl", "path": str(tmp_path / "t.jsonl")}, tok) == samples


def test_column_mapping_and_errors(tmp_path, word_tokenizer):
    rows = [{"question": "what ?", "answer": "one", "id": 1}, {"question": "what ?", "answer": "two", "id": 2}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    spec = hf(path, tmp_path, prompt_field="question", completion_field="answer")
    assert [s.length for s in build_source(spec, word_tokenizer)] == [4, 4]  # what ? one <eos>
    with pytest.raises(ConfigError, match=r"its columns are \['question', 'answer', 'id'\]"):
        build_source(hf(path, tmp_path), word_tokenizer)
    with pytest.raises(ConfigError, match=r"column\(s\) \['messages'\] \(format=messages\).*'question'"):
        build_source(hf(path, tmp_path, format="messages"), word_tokenizer)
    with pytest.raises(ConfigError, match="no data file matches .*missing.jsonl"):
        build_source(hf(tmp_path / "missing.jsonl", tmp_path), word_tokenizer)
    with pytest.raises(ConfigError, match="no data file matches .*nothing-"):
        build_source(hf(tmp_path / "nothing-*.parquet", tmp_path), word_tokenizer)
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match="give files of one type"):
        build_source(hf(tmp_path / "notes.txt", tmp_path), word_tokenizer)
    with pytest.raises(ConfigError, match="needs a 'path'"):
        parse_source({"kind": "hf", "split": "train"})
    with pytest.raises(ConfigError, match="streaming='yes'"):
        parse_source({"kind": "hf", "path": "x.jsonl", "streaming": "yes"})
    with pytest.raises(ConfigError, match=r"unknown dataset key\(s\) \['colums'\]"):
        parse_source({"kind": "hf", "path": "x.jsonl", "colums": ["a"]})
