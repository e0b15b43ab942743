"""The generation engine over an NF4 base (QLoRA's 4-bit weights, dequantized per product into a
buffer, or read inside the NF4 GEMM's tiles: ``EngineTuning.nf4_gemm``) against the engine over
the same weights dequantized to fp32: greedy tokens agree exactly."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels import nf4_gemm
from lightning_lorafusion.kernels.nf4 import Nf4Weight, dequantize_nf4_reference, is_nf4
from lightning_lorafusion.model.hf_loading import load_base_model, quantize_base_nf4
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams

NEW_TOKENS = 6
CASES = [([5, 9, 17], None), ([11, 4, 30, 22, 8, 19, 40], "all4"), ([60, 2, 35, 18, 26], "mlp8"),
         ([7, 13, 21, 33, 45, 50, 6, 12], "attn2")]


def _generate(config, params, adapter_dirs, device="cpu", keep=lambda engine: engine.params, **engine_kwargs):
    """Greedy tokens of ``CASES`` and ``keep(engine)`` (read before the engine closes)."""
    engine = Engine(config, params, None, EngineConfig(num_pages=64, page_size=4, **engine_kwargs), device=device)
    try:
        for name, path in adapter_dirs.items():
            engine.add_adapter(name, path)
        greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
        results = engine.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=greedy)
                                   for p, a in CASES])
        return [list(r.token_ids) for r in results], keep(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("gemm", ["buffer", "fused"])
def test_nf4_base_engine_equals_dequantized_engine(model_dir, adapter_dirs, gemm, monkeypatch):
    fused_calls, linear = [], nf4_gemm.nf4_linear_fused

    def counted(x, w, b=None):
        fused_calls.append(x.shape[0])
        return linear(x, w, b)

    monkeypatch.setattr(nf4_gemm, "nf4_linear_fused", counted)
    config, params, _ = load_base_model(str(model_dir), dtype=torch.float32)
    nf4 = quantize_base_nf4(params)
    dense = {**nf4, "layers": [{k: {"weight": dequantize_nf4_reference(Nf4Weight.from_params(v))} if is_nf4(v) else v
                                for k, v in lp.items()} for lp in nf4["layers"]]}
    # the fused GEMM is a Triton kernel: on a GPU machine it runs on CUDA tensors (no interpreter there)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got, served = _generate(config, nf4, adapter_dirs, device, tuning={"nf4_gemm": gemm})
    # fused: every frozen product of prefill and decode steps read the 4-bit weights in the GEMM
    assert (gemm == "fused") == bool(fused_calls) and (gemm == "buffer" or min(fused_calls) <= len(CASES))
    assert is_nf4(served["layers"][1]["down_proj"]) and is_nf4(served["layers"][0]["q_proj"]), "served 4-bit"
    want, _ = _generate(config, dense, adapter_dirs, device, fuse_projections=False)
    assert got == want
    assert all(len(t) == NEW_TOKENS for t in got)


def test_engine_nf4_gemm_value_is_checked():
    from lightning_lorafusion.serving.config import EngineTuning
    from lightning_lorafusion.specs import ConfigError

    assert EngineTuning(nf4_gemm="fused").nf4_gemm == "fused"
    with pytest.raises(ConfigError, match="EngineTuning.nf4_gemm='tiles'; allowed: auto, buffer, fused"):
        EngineConfig(tuning={"nf4_gemm": "tiles"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the NF4 decode kernel serves decode steps on CUDA only")
def test_decode_kernel_engine_keeps_its_workspace_zeroed(model_dir, adapter_dirs):
    """``nf4_gemm: auto`` on CUDA: decode steps run the NF4 group launches (q/k/v, gate/up) with
    the runner's kept workspace, whose split-K counters every launch leaves zeroed (checked after
    the graphs' replays); greedy tokens equal the buffer path's over the same 4-bit weights."""
    config, params, _ = load_base_model(str(model_dir), dtype=torch.float32)
    nf4 = quantize_base_nf4(params)

    def run(gemm: str):
        return _generate(config, nf4, adapter_dirs, device="cuda", keep=lambda e: e.runner.model.nf4_workspace,
                         tuning={"nf4_gemm": gemm})

    got, workspace = run("auto")
    want, _ = run("buffer")
    assert workspace is not None and workspace.counters.is_cuda
    assert int(workspace.counters.count_nonzero()) == 0
    assert got == want and all(len(t) == NEW_TOKENS for t in got)
