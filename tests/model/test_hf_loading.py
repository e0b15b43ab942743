"""load_base_model from local HF directories (safetensors / .bin) and the built-in SmolLM2 GGUF."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.hf_loading import default_cache_dir, load_base_model
from lightning_lorafusion.specs import ConfigError

from _tiny_hf import tiny_hf_model


def _word_tokenizer(n_words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(n_words - 1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _save(tmp_path: Path, family="llama", n_words=90, safe=True, **overrides) -> tuple[Path, object]:
    model = tiny_hf_model(family, **overrides)
    out = tmp_path / f"{family}-{'st' if safe else 'bin'}"
    model.save_pretrained(out, safe_serialization=safe)
    _word_tokenizer(n_words).save_pretrained(out)
    return out, model


@pytest.mark.parametrize("family,safe,overrides", [
    ("llama", True, {"tie_word_embeddings": True}),
    ("qwen2", False, {}),
    ("mistral", True, {}),
])
def test_load_local_directory_matches_transformers(tmp_path, family, safe, overrides):
    path, model = _save(tmp_path, family, safe=safe, **overrides)
    config, params, tokenizer = load_base_model(str(path), dtype=torch.float32)
    # transformers may pick a family tokenizer class that adds its own special token
    assert config.model_type == family and 90 <= len(tokenizer) <= config.vocab_size
    assert tokenizer.convert_tokens_to_ids(["w3", "w88"]) == [4, 89]
    assert all(not t.requires_grad for t in [params["embed"], params["layers"][1]["q_proj"]["weight"]])
    if overrides.get("tie_word_embeddings"):
        assert params["lm_head"] is params["embed"]
    ids = torch.tensor([4, 2, 89, 6, 0, 8])
    with torch.no_grad():
        ours = D.logits(params, None, ids, torch.arange(6), torch.tensor([0, 6]), None, config=config)
        ref = model(ids[None]).logits[0]
    assert (ours - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


def test_dtype_conversion(tmp_path):
    path, model = _save(tmp_path)
    _, params, _ = load_base_model(str(path), dtype=torch.bfloat16)
    assert params["layers"][0]["down_proj"]["weight"].dtype == torch.bfloat16
    assert torch.equal(params["norm"], model.model.norm.weight.detach().to(torch.bfloat16))


def test_params_to_keeps_tied_tensors_tied(tmp_path):
    from lightning_lorafusion.model.hf_loading import params_to

    path, _ = _save(tmp_path, tie_word_embeddings=True)
    _, params, _ = load_base_model(str(path))
    moved = params_to(params, dtype=torch.float16)
    assert moved["lm_head"] is moved["embed"] and moved["embed"].dtype == torch.float16
    assert moved["layers"][1]["v_proj"]["weight"].dtype == torch.float16
    assert not moved["norm"].requires_grad
    assert params["embed"].dtype == torch.float32  # the input pytree is untouched


def test_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        load_base_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_base_model(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="GGUF file .* does not exist"):
        load_base_model("gguf:" + str(tmp_path / "x.gguf"))
    path, _ = _save(tmp_path, n_words=150)  # the tokenizer is bigger than the 101-row embedding
    with pytest.raises(ConfigError, match="150 tokens but the embedding has only 101 rows"):
        load_base_model(str(path))

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(gpt)
    with pytest.raises(ConfigError, match="model_type='gpt2' is not supported"):
        load_base_model(str(gpt))

    path, _ = _save(tmp_path / "broken")
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lacks 1 tensor.*layers.1.mlp.up_proj.weight"):
        load_base_model(str(path))
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weight files"):
        load_base_model(str(path))


def test_default_cache_dir_reads_env_when_called(monkeypatch, tmp_path):
    monkeypatch.delenv("LLF_CACHE_DIR", raising=False)
    monkeypatch.setenv("LORAFUSION_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("LORAFUSION_CACHE_DIR")
    assert default_cache_dir() == Path.cwd() / ".cache" / "lightning-lorafusion"


def test_old_cache_dir_env_name_still_works_with_a_deprecation_warning(monkeypatch, tmp_path):
    monkeypatch.delenv("LORAFUSION_CACHE_DIR", raising=False)
    monkeypatch.setenv("LLF_CACHE_DIR", str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="LLF_CACHE_DIR is deprecated; set LORAFUSION_CACHE_DIR"):
        assert default_cache_dir() == tmp_path / "old"
    monkeypatch.setenv("LORAFUSION_CACHE_DIR", str(tmp_path / "new"))  # the new name wins, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_cache_dir() == tmp_path / "new"


@pytest.mark.slow
def test_smollm2_gguf_converts_once_and_matches_transformers():
    # Uses the real cache (LORAFUSION_CACHE_DIR or ./.cache/lightning-lorafusion): the first run
    # dequantizes the GGUF (~30 s on 2 cores), later runs read the safetensors copy.
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    config, params, tokenizer = load_base_model("smollm2-135m-instruct")
    converted = next(default_cache_dir().glob("SmolLM2-135M-Instruct.Q4_1-*"))
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.vocab_size) == (30, 576, 3, 49152)
    assert config.tie_word_embeddings and params["lm_head"] is params["embed"]
    assert not list(default_cache_dir().glob(".*tmp-*"))  # no half-written conversion left behind
    ids = torch.tensor(tokenizer("The capital of France is")["input_ids"])
    t = ids.shape[0]
    ref_model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = D.logits(params, None, ids, torch.arange(t), torch.tensor([0, t]), None, config=config)
        ref = ref_model(ids[None]).logits[0]
    assert (ours - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())
    assert tokenizer.decode(ours[-1].argmax()).strip() == tokenizer.decode(ref[-1].argmax()).strip()
    # a pretrained model, not noise: " Paris" should be likely after that prompt
    paris = tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    assert paris in ours[-1].topk(5).indices.tolist()
