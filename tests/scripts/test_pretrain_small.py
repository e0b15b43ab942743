"""scripts/pretrain_small.py on CPU: a tiny Llama pretrained on a tiny corpus loads in our loader."""

import json
import random

import pytest
import torch

from _script_loader import load_script


def _word_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture
def tiny_corpus(tmp_path):
    """Documents of a fixed word cycle with noise (learnable), split train / held-out, a 2-layer
    Llama config with tied embeddings and a word-level tokenizer."""
    pretrain = load_script("pretrain_small")
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(30)]
    tok_dir = tmp_path / "tok"
    _word_tokenizer(words).save_pretrained(tok_dir)
    rng = random.Random(0)
    docs = []
    for d in range(12):
        ids = [2 + (i * 7 + d) % 30 if rng.random() > 0.1 else rng.randrange(2, 32) for i in range(300)]
        docs.append({"id": f"p{d}", "role": "heldout" if d % 4 == 0 else "train", "ids": ids + [0]})
    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                  max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True, vocab_size=64,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    data = tmp_path / "corpus"
    record = pretrain.write_corpus(data, docs, config=config, tokenizer_dir=tok_dir, meta={"source": "test"})
    assert record["tokens_by_role"] == {"train": 9 * 301, "heldout": 3 * 301}
    return pretrain, data


def test_pretraining_lowers_the_loss_and_saves_a_loadable_bf16_directory(tiny_corpus, tmp_path, monkeypatch):
    """A few steps from random init: train and held-out loss fall below the unigram model's, the
    best held-out pass is the one saved, and the bf16 directory loads through
    ``load_base_model`` with the corpus's config and tokenizer."""
    from lightning_lorafusion.model.hf_loading import load_base_model

    pretrain, data = tiny_corpus
    train_stream, heldout_stream, _ = pretrain.read_corpus(data)
    assert train_stream.numel() == 9 * 301 and int(heldout_stream[-1]) == 0
    out = tmp_path / "model"
    monkeypatch.setattr("sys.argv", ["pretrain_small.py", "train", "--data", str(data), "--out", str(out),
                                     "--device", "cpu", "--steps", "8", "--seq-len", "32", "--batch-tokens",
                                     "256", "--micro-batch", "4", "--lr", "1e-2", "--warmup-steps", "2",
                                     "--eval-every", "4"])
    pretrain.main()
    record = json.loads((out / "pretraining.json").read_text())
    heldout = [loss for _, loss in record["history"]["heldout"]]
    assert [s for s, _ in record["history"]["heldout"]] == [0, 4, 8]
    assert heldout[-1] < heldout[0] - 0.5, heldout  # ln(64) = 4.16 at init; the cycle is learnable
    losses = record["history"]["train_loss"]
    assert losses[-1] < losses[0] - 0.5, losses
    assert record["recipe"]["tokens_per_step"] == 256 and record["recipe"]["steps"] == 8
    best = min(record["history"]["heldout"], key=lambda x: x[1])
    assert record["saved_step"] == best[0] and record["saved_heldout_loss"] == best[1]
    # the unigram model of the training tokens (add-one over the 64-token vocabulary) is the bar
    assert 2.5 < record["unigram_heldout_loss"] < 4.2
    assert record["saved_heldout_loss"] < record["unigram_heldout_loss"]  # learned more than frequencies
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert not any("lm_head" in k for k in f.keys())  # tied to the embedding
    config, params, tokenizer = load_base_model(str(out), dtype=torch.float32)
    assert (config.num_layers, config.hidden_size, config.tie_word_embeddings) == (2, 64, True)
    assert tokenizer.convert_tokens_to_ids("w3") == 5
    assert params["embed"].shape == (64, 64) and params["embed"].dtype == torch.float32


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    pretrain = load_script("pretrain_small")
    lrs = [pretrain.lr_at(s, peak=1.0, warmup=4, total=20, floor=0.1) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] == pytest.approx(0.1)


def test_time_budget_fixes_the_schedule_after_the_calibration_steps(tiny_corpus, tmp_path, monkeypatch):
    """--time-budget: the step count is set once, after the calibration steps, and the run
    ends there with a held-out pass at its last step (how many steps depends on the machine)."""
    pretrain, data = tiny_corpus
    out = tmp_path / "model"
    monkeypatch.setattr("sys.argv", ["pretrain_small.py", "train", "--data", str(data), "--out", str(out),
                                     "--device", "cpu", "--time-budget", "1", "--seq-len", "32",
                                     "--batch-tokens", "64", "--micro-batch", "2", "--warmup-steps", "2",
                                     "--eval-every", "5", "--keep", "last"])
    pretrain.main()
    record = json.loads((out / "pretraining.json").read_text())
    steps = record["recipe"]["steps"]
    assert steps > pretrain.CALIBRATION_STEPS and record["history"]["step"][-1] == steps
    assert record["history"]["heldout"][-1][0] == steps and record["saved_step"] == steps


def test_bigram_bar_sits_below_the_unigram_bar_and_matches_a_direct_count(tiny_corpus):
    """The interpolated bigram model scores the cyclic corpus far better than the unigram one,
    and its vectorised cross-entropy equals a plain count over the held-out pairs."""
    import math
    from collections import Counter

    pretrain, data = tiny_corpus
    train, heldout, _ = pretrain.read_corpus(data)
    uni = pretrain.unigram_cross_entropy(train, heldout, 64)
    bi = pretrain.bigram_cross_entropy(train, heldout, 64, 0.7)
    assert bi < uni - 1.0
    t, h = train.tolist(), heldout.tolist()
    pairs, ctx, words = Counter(zip(t, t[1:])), Counter(t[:-1]), Counter(t)
    expected = -sum(math.log(0.7 * (pairs[(a, b)] / ctx[a] if ctx[a] else 0.0)
                             + 0.3 * (words[b] + 1) / (len(t) + 64)) for a, b in zip(h, h[1:])) / (len(h) - 1)
    assert bi == pytest.approx(expected, rel=1e-9)
