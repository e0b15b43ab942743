"""scripts/bench_families.py: the published family configs parse into the decoder's families with
their shapes, and a tiny-shape CPU run trains (ours and HF + PEFT over the same samples) and decodes
per family, with a partial report when the deadline passes."""

import argparse
import json
import math

from _script_loader import load_script

from lightning_lorafusion.model.decoder_config import DecoderConfig


def test_published_configs_are_the_families_at_their_shapes():
    bench = load_script("bench_families")
    args = argparse.Namespace(layers=3, scale="published")
    got = {name: DecoderConfig.from_hf(bench.hf_config(name, args)) for name in bench.FAMILIES}
    assert {n: c.model_type for n, c in got.items()} == {
        "llama3_8b": "llama", "qwen3_8b": "qwen3", "gemma2_9b": "gemma2", "gemma3_12b": "gemma3_text",
        "phi4_14b": "phi3", "olmo2_7b": "olmo2"}
    assert all(c.num_layers == 3 for c in got.values())
    g2, g3, phi, qwen, olmo = (got[n] for n in ("gemma2_9b", "gemma3_12b", "phi4_14b", "qwen3_8b", "olmo2_7b"))
    assert (g2.head_dim, g2.hidden_size, g2.vocab_size, g2.sliding_windows) == (256, 3584, 256000, (4096, None, 4096))
    assert (g2.family.attn_logit_softcap, g2.family.final_logit_softcap, g2.family.activation) == (50.0, 30.0, "gelu_tanh")
    assert (g3.head_dim, g3.vocab_size, g3.sliding_windows, g3.family.local_rope_theta) == (256, 262208, (1024,) * 3, 1e4)
    assert (g3.rope_type, g3.rope_factor, g3.family.qk_norm) == ("linear", 8.0, "head")
    assert phi.family.projections == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert (phi.hidden_size, phi.num_heads, phi.num_kv_heads, phi.rope_theta) == (5120, 40, 10, 250000.0)
    assert (qwen.family.qk_norm, qwen.intermediate_size, qwen.vocab_size) == ("head", 12288, 151936)
    assert (olmo.family.qk_norm, olmo.family.input_norms, olmo.num_kv_heads) == ("projection", False, 32)
    assert got["llama3_8b"].rope_type == "llama3"


def test_bench_families_tiny_cpu(tmp_path):
    bench = load_script("bench_families")
    families = ["gemma2_9b", "phi4_14b"]  # soft-caps with HF's eager attention; fused projections
    report = bench.main(["--families", ",".join(families), "--scale", "tiny", "--device", "cpu", "--dtype",
                         "float32", "--ours", "torch", "--layers", "1", "--adapters", "2", "--samples", "2",
                         "--global-batch", "2", "--max-length", "40", "--capacity", "96", "--pad-multiple", "8",
                         "--decode-rows", "3", "--decode-adapters", "2", "--decode-steps", "1", "--prompt-len", "6",
                         "--hf-decode", "--out", str(tmp_path)])
    assert not report["errors"]
    saved = json.loads((tmp_path / "families_bench.json").read_text())
    for name in families:
        r = saved[name]
        ours, hf, dec = r["train_ours"], r["train_hf_peft"], r["decode"]
        assert ours["real_tokens"] == hf["real_tokens"] > 0  # the same samples both ways
        assert all(math.isfinite(x["tokens_per_s"]) and x["tokens_per_s"] > 0 for x in (ours, hf))
        assert r["useful_flops"] > 0 and 0 < ours["fill"] <= 1
        for kind in ("adapters", "base"):
            assert dec[kind]["running"] == 3 and dec[kind]["step_ms"] > 0
        # the same 3 requests of 2 x 1 + 8 new tokens generated whole, by the engine and by HF + PEFT
        assert dec["engine_generate"]["generated_tokens"] == dec["hf_peft_generate"]["generated_tokens"] == 3 * 10
    assert saved["phi4_14b"]["targets"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert saved["gemma2_9b"]["head_dim"] == 24 and saved["gemma2_9b"]["model_type"] == "gemma2"


def test_bench_families_past_the_deadline_keeps_a_partial_report(tmp_path):
    bench = load_script("bench_families")
    report = bench.main(["--families", "llama3_8b,olmo2_7b", "--scale", "tiny", "--device", "cpu", "--dtype",
                         "float32", "--deadline", "1e-9", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "families_bench.json").read_text())
    assert set(saved["errors"]) == {"llama3_8b", "olmo2_7b"} == set(report["errors"])
    assert all("deadline" in e for e in saved["errors"].values())
