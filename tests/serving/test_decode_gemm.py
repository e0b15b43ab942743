"""Frozen products of few rows by ``skinny_gemm`` in the engine (``EngineTuning.decode_gemm``):
the tokens and logprobs of ``F.linear``'s, with base rows and adapters, prefill and decode steps,
padded decode steps too (the product in the Triton interpreter on the CPU, the other kernels'
torch references, fp32, tiny model); and the setting's values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_lorafusion.kernels import skinny_gemm
from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.config import EngineTuning
from lightning_lorafusion.specs import ConfigError

CASES = [([5, 9, 17], None), ([11, 4, 30, 22, 8, 19, 40], "all4"), ([60, 2, 35, 18, 26], "mlp8")]


def _run(engine, pad: bool) -> list:
    engine.runner.pad_decode = pad
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    results = engine.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp) for p, a in CASES])
    return [(list(r.token_ids), list(r.logprobs)) for r in results]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the product runs on CPU tensors in the Triton interpreter; "
                    "on a GPU tests/kernels/test_skinny_gemm.py and bench_skinny_gemm.py check it against cuBLAS")
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
def test_skinny_products_give_the_tokens_of_f_linear(make_engine, monkeypatch, pad):
    want = _run(make_engine(num_pages=96, page_size=4), pad)
    engine = make_engine(num_pages=96, page_size=4)
    assert engine.runner.model.skinny is None  # CPU, fp32: F.linear unless asked
    # every product of at most 16 rows (the default takes only the 8B shape's wide ones)
    small = skinny_gemm.SkinnyConfig(block_n=16, block_k=16)
    plan = skinny_gemm.SkinnyPlan(skinny_gemm.SkinnyWorkspace.create("cpu"), choose=lambda m, n, k: small)
    engine.runner.model = dataclasses.replace(engine.runner.model, skinny=plan)
    shapes = set()
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda x, w, **kw: shapes.add(tuple(w.shape)) or real(x, w, **kw))
    got = _run(engine, pad)
    cfg = engine.model_config
    # every product of the layers and the LM head went through it
    assert (cfg.vocab_size, cfg.hidden_size) in shapes and (cfg.hidden_size, cfg.intermediate_size) in shapes
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lps in got for lp in lps] == pytest.approx([lp for _, lps in want for lp in lps], abs=1e-5)


def test_decode_gemm_setting(make_engine):
    with pytest.raises(ConfigError, match="decode_gemm"):
        EngineTuning(decode_gemm="fast")
    engine = make_engine(num_pages=32, page_size=4, decode_gemm="cublas")
    assert engine.runner.decode_gemm == "cublas" and engine.runner.model.skinny is None
    engine.runner.decode_gemm = "triton"  # on a CPU still F.linear (the plan needs CUDA and 16-bit weights)
    assert engine.runner.decode_gemm == "triton" and engine.runner.model.skinny is None
