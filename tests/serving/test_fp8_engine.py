"""The generation engine over an FP8 base (emulated FP8 products on CPU) against the reference.

The engine quantizes each token row on its own (prefill rows, then one row per decode step)
with the KV cache and the decode path; the reference recomputes the whole sequence per token
through the functional decoder's torch path over the same quantized base, where each row is
quantized on its own too. Per-row scales make the two the same function, so greedy tokens
must agree exactly.
"""

from __future__ import annotations

import torch

from lightning_lorafusion.kernels.fp8_linear import is_quantized
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.decoder import logits
from lightning_lorafusion.model.hf_loading import load_base_model, quantize_base_fp8
from lightning_lorafusion.model.peft_io import import_peft_adapter
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.specs import AdapterSpec

NEW_TOKENS = 6
# (prompt, adapter): the base and adapters of different ranks / targets (conftest.ADAPTERS)
CASES = [([5, 9, 17], None), ([11, 4, 30, 22, 8, 19, 40], "all4"), ([60, 2, 35, 18, 26], "mlp8"),
         ([7, 13, 21, 33, 45, 50, 6, 12], "attn2")]
TARGETS = {"all4": (4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
           "attn2": (2, 3.0, ("q_proj", "v_proj")),
           "mlp8": (8, 4.0, ("gate_proj", "up_proj", "down_proj", "o_proj"))}


def test_fp8_base_engine_equals_emulated_reference(model_dir, adapter_dirs):
    config, params, _ = load_base_model(str(model_dir), dtype=torch.float32)
    fp8 = quantize_base_fp8(params, embedding=not config.tie_word_embeddings)
    assert is_quantized(fp8["layers"][0]["q_proj"]) and is_quantized(fp8["embed"])
    engine = Engine(config, fp8, None, EngineConfig(num_pages=64, page_size=4), device="cpu")
    try:
        assert engine.dtype == torch.float32  # read off the FP8 embedding's scales
        assert is_quantized(engine.params["layers"][1]["down_proj"]), "served as given: FP8"
        for name, path in adapter_dirs.items():
            engine.add_adapter(name, path)
        greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
        results = engine.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=greedy)
                                   for p, a in CASES])
    finally:
        engine.close()
    names = list(TARGETS)
    bank = AdapterBank([AdapterSpec(name=n, rank=r, alpha=a, target_modules=t)
                        for n, (r, a, t) in TARGETS.items()], config, dtype=torch.float32)
    for i, name in enumerate(names):
        import_peft_adapter(bank, i, adapter_dirs[name])
    with torch.no_grad():
        for (prompt, adapter), res in zip(CASES, results):
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                t = len(ids)
                routing = None if adapter is None else bank.routing([(0, t, names.index(adapter))], 0, t,
                                                                    train=False)
                out = logits(fp8, None if adapter is None else bank.view(), torch.tensor(ids),
                             torch.arange(t), torch.tensor([0, t], dtype=torch.int32), routing, config=config)
                ids.append(int(out[-1].argmax()))
            assert list(res.token_ids) == ids[len(prompt):], adapter
        # the reference is the FP8 model, not the 16-bit one: its logits differ by e4m3 rounding
        ids = torch.tensor(CASES[0][0])
        args = (ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32), None)
        a, b = logits(fp8, None, *args, config=config), logits(params, None, *args, config=config)
        assert 1e-3 < float((a - b).norm() / b.norm()) < 0.2
