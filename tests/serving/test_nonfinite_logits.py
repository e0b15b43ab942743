"""NaN or infinite adapter weights: refused when loaded, naming where; and if such weights (or
an overflow) reach a step anyway, only the requests whose logits are not finite end ("abort"),
the rest of the batch goes on unchanged."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.adapters import host_adapter_from_factors
from lightning_lorafusion.specs import ConfigError


def _factors(engine, rank=2, seed=0, poison=None):
    """Random q/v factors for every layer; ``poison``: (layer, module, "A"|"B") set to NaN."""
    g = torch.Generator().manual_seed(seed)
    cfg = engine.model_config
    out = {}
    for layer in range(cfg.num_layers):
        for module in ("q_proj", "v_proj"):
            in_f = cfg.hidden_size
            out_f = cfg.num_heads * cfg.head_dim if module == "q_proj" else cfg.num_kv_heads * cfg.head_dim
            a, b = torch.randn(rank, in_f, generator=g) * 0.3, torch.randn(out_f, rank, generator=g) * 0.3
            if poison == (layer, module, "A"):
                a[0, 3] = float("nan")
            if poison == (layer, module, "B"):
                b[1, 0] = float("inf")
            out[(layer, module)] = (a, b)
    return out


def test_nonfinite_weights_are_refused_naming_where(make_engine, adapter_dirs, tmp_path):
    engine = make_engine(num_pages=96, page_size=4, with_adapters=False)
    with pytest.raises(ConfigError, match=r"'bad'.*1 NaN or infinite.*layer 1 v_proj lora_B"):
        engine.add_adapter_weights("bad", _factors(engine, poison=(1, "v_proj", "B")), rank=2, alpha=4.0)
    assert "bad" not in [a.name for a in engine.adapters()]
    # a PEFT directory with a NaN in one lora_A
    from safetensors.torch import load_file, save_file
    import shutil

    bad_dir = tmp_path / "nan_adapter"
    shutil.copytree(adapter_dirs["attn2"], bad_dir)
    weights = load_file(bad_dir / "adapter_model.safetensors")
    key = next(k for k in sorted(weights) if "lora_A" in k and "layers.0." in k and "q_proj" in k)
    weights[key][0, 0] = float("nan")
    save_file(weights, bad_dir / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=r"'nan'.*layer 0 q_proj lora_A"):
        engine.add_adapter("nan", str(bad_dir))
    engine.add_adapter("fine", adapter_dirs["attn2"])  # the engine is unharmed
    assert [a.name for a in engine.adapters()] == ["fine"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_request_with_nonfinite_logits_ends_alone(make_engine, backend):
    """Also later requests reusing the aborted ones' pages are unharmed (the attention never
    multiplies a stale slot's value, NaN included)."""
    engine = make_engine(num_pages=96, page_size=4, backend=backend)
    # registered without the load check, as a pre-built host adapter: its NaN reaches the step
    poisoned = host_adapter_from_factors("poisoned", _factors(engine, poison=(0, "q_proj", "A")), rank=2, alpha=4.0,
                                         config=engine.model_config, dtype=torch.float32, pin=False)
    engine.add_host_adapter(poisoned)
    cases = [([11, 4, 30, 22], "all4", 0.0), ([7, 13, 21], "poisoned", 0.8), ([60, 2, 35], "mlp8", 0.7),
             ([8, 16, 9], "poisoned", 0.0), ([5, 9, 17], None, 0.0)]

    def request(prompt, adapter, temperature):
        return GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=SamplingParams(
            max_new_tokens=6, temperature=temperature, seed=3, ignore_eos=True, logprobs=1))

    mixed = engine.generate([request(*c) for c in cases])
    assert engine.stats()["nonfinite_logits_total"] == 2
    for (prompt, adapter, temperature), res in zip(cases, mixed):
        if adapter == "poisoned":
            assert res.finish_reason == "abort" and res.token_ids == ()
        else:
            alone = engine.generate([request(prompt, adapter, temperature)])[0]
            assert res.finish_reason == "length" and res.token_ids == alone.token_ids
    stats = engine.stats()  # the requests run alone afterwards took the freed (NaN-holding) pages
    assert stats["nonfinite_logits_total"] == 2 and stats["kv_pages_used"] == 0 and stats["running"] == 0
    engine.pool.check()
    # the aborted requests' full pages never enter the prefix cache: the same prompt again is
    # prefilled from scratch (and aborted again), while a healthy request's pages are reused
    long_prompt = list(range(10, 22))  # three full pages of 4
    for adapter, hits in (("poisoned", 0), ("all4", 1)):
        before = engine.stats()["prefix_cache_hits_total"]
        for _ in range(2):
            engine.generate([request(long_prompt, adapter, 0.0)])
        assert engine.stats()["prefix_cache_hits_total"] - before == hits, adapter
    engine.pool.check()
