"""``random:`` bases: named shapes and config paths, and weights drawn per pipeline stage that
equal the whole model's, with nothing allocated for other stages."""

import pytest
import torch

from lightning_lorafusion.model.random_model import NAMED_SHAPES, random_base_config, random_base_params
from lightning_lorafusion.specs import ConfigError


def _tiny_config_dir(path, **overrides):
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    kwargs.update(overrides)
    LlamaConfig(**kwargs).save_pretrained(path)
    return path


def _flat(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}").items()}


def test_named_shapes_and_config_paths(tmp_path):
    big = random_base_config("random:llama70b")
    assert (big.num_layers, big.hidden_size, big.num_heads, big.num_kv_heads, big.intermediate_size,
            big.vocab_size) == (80, 8192, 64, 8, 28672, 128256)
    assert random_base_config("random:llama8b").num_layers == NAMED_SHAPES["llama8b"]["num_layers"] == 32
    d = _tiny_config_dir(tmp_path / "tiny")
    for spec in (f"random:{d}", f"random:{d / 'config.json'}"):
        cfg = random_base_config(spec)
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.vocab_size) == (4, 32, 2, 96)
    with pytest.raises(ConfigError, match="llama70b"):
        random_base_config("random:llama-nonexistent")


def test_stage_params_hold_only_their_layers_and_equal_the_whole(tmp_path):
    cfg = random_base_config(f"random:{_tiny_config_dir(tmp_path / 'tiny')}")
    whole = _flat(random_base_params(cfg))
    stages = [range(0, 1), range(1, 3), range(3, 4)]
    seen = {}
    for s, layers in enumerate(stages):
        part = random_base_params(cfg, layers, is_first=s == 0, is_last=s == len(stages) - 1)
        assert sorted(part["layers"]) == list(layers)
        assert ("embed" in part) == (s == 0)
        assert ("lm_head" in part and "norm" in part) == (s == len(stages) - 1)
        for name, tensor in _flat(part).items():
            assert not tensor.requires_grad
            torch.testing.assert_close(tensor, whole[name], rtol=0, atol=0, msg=name)
            seen[name] = tensor
    assert seen.keys() == whole.keys()
    matrices = [t for n, t in whole.items() if n.endswith("weight")]
    assert all(abs(float(t.std()) - 0.02) < 0.01 for t in matrices)  # N(0, 0.02)
    assert len({float(t.flatten()[0]) for t in matrices}) == len(matrices)  # one stream per tensor


def test_tied_embeddings_on_a_last_stage_without_the_first(tmp_path):
    cfg = random_base_config(f"random:{_tiny_config_dir(tmp_path / 'tied', tie_word_embeddings=True)}")
    whole = random_base_params(cfg, dtype=torch.bfloat16)
    assert whole["lm_head"] is whole["embed"] and whole["embed"].dtype == torch.bfloat16
    last = random_base_params(cfg, range(2, 4), is_first=False, is_last=True, dtype=torch.bfloat16)
    assert "embed" not in last
    torch.testing.assert_close(last["lm_head"], whole["embed"], rtol=0, atol=0)
