"""`lightning-lorafusion fit` end to end on a family other than Llama's (a tiny Gemma 2: 1 + w norms,
pre and post norms, GELU-tanh, embedding scale, both soft-caps, alternating sliding window)."""

import json
import os

import torch
import yaml

from lightning_lorafusion.model.random_model import write_random_llama

from test_cli import REPO, assert_clean_output, run_cli

TINY = os.path.join(REPO, "configs", "tiny.yaml")


def _tiny_gemma2_dir(path):
    """A random tiny Gemma 2 with the word-level tokenizer of ``write_random_llama``."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    write_random_llama(path, vocab_size=256)  # for its tokenizer; the Llama weights are replaced
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (path / name).unlink(missing_ok=True)
    config = Gemma2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
                          sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                          attn_logit_softcapping=5.0, final_logit_softcapping=8.0, max_position_embeddings=512,
                          pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(path)
    return path


def test_fit_on_a_tiny_gemma2_exports_peft_adapters(tmp_path):
    from peft import PeftConfig

    base = _tiny_gemma2_dir(tmp_path / "gemma2")
    cfg = yaml.safe_load(open(TINY))
    cfg["model"]["base_model"] = str(base)
    cfg["trainer"]["default_root_dir"] = str(tmp_path / "run")
    config_path = tmp_path / "gemma2.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    out = run_cli(["fit", "--config", str(config_path)], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert_clean_output(out)
    for adapter in cfg["model"]["adapters"]:
        d = tmp_path / "run" / "adapters" / adapter["name"]
        exported = json.loads((d / "adapter_config.json").read_text())
        assert exported["r"] == adapter["rank"] and (d / "adapter_model.safetensors").stat().st_size > 0
        assert PeftConfig.from_pretrained(d).r == adapter["rank"]


def test_val_samples_on_a_tiny_gemma2_are_generated_by_the_engine(tmp_path):
    """Validation samples come from the generation engine, which serves every family."""
    base = _tiny_gemma2_dir(tmp_path / "gemma2")
    cfg = yaml.safe_load(open(TINY))
    cfg["model"]["base_model"] = str(base)
    cfg["model"]["adapters"][0].update(val_samples=2, val_fraction=0.25)
    cfg["trainer"]["default_root_dir"] = str(tmp_path / "run")
    config_path = tmp_path / "gemma2.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    out = run_cli(["fit", "--config", str(config_path)], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    name = cfg["model"]["adapters"][0]["name"]
    assert samples and {s["adapter"] for s in samples} == {name}
    assert all(s["prompt"] and "generated" in s for s in samples)
