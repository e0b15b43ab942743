"""Fused q/k/v and gate/up weights for serving: values, views (no second copy), what is skipped."""

from __future__ import annotations

import torch

from lightning_lorafusion.kernels.fp8_linear import WEIGHT_KEY
from lightning_lorafusion.serving.fused_weights import fuse_projection_weights


def _layer(g, h=8, q=8, kv=4, inter=12, bias=False):
    def proj(n, k, with_bias):
        p = {"weight": torch.randn(n, k, generator=g)}
        if with_bias:
            p["bias"] = torch.randn(n, generator=g)
        return p

    return {"attn_norm": torch.ones(h), "q_proj": proj(q, h, bias), "k_proj": proj(kv, h, bias),
            "v_proj": proj(kv, h, bias), "o_proj": proj(h, q, False), "mlp_norm": torch.ones(h),
            "gate_proj": proj(inter, h, False), "up_proj": proj(inter, h, False), "down_proj": proj(h, inter, False)}


def _shares(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_fused_weights_are_views_with_the_same_values():
    g = torch.Generator().manual_seed(0)
    plain, biased = _layer(g), _layer(g, bias=True)
    params = {"layers": [plain, biased]}
    before = [{k: {kk: vv.clone() for kk, vv in v.items()} if isinstance(v, dict) else v for k, v in lp.items()}
              for lp in params["layers"]]
    fuse_projection_weights(params)
    for lp, old in zip(params["layers"], before):
        qkv, gu = lp["qkv_proj"]["weight"], lp["gate_up_proj"]["weight"]
        assert torch.equal(qkv, torch.cat([old[m]["weight"] for m in ("q_proj", "k_proj", "v_proj")]))
        assert torch.equal(gu, torch.cat([old["gate_proj"]["weight"], old["up_proj"]["weight"]]))
        for m, fused in (("q_proj", qkv), ("k_proj", qkv), ("v_proj", qkv), ("gate_proj", gu), ("up_proj", gu)):
            assert torch.equal(lp[m]["weight"], old[m]["weight"]) and _shares(lp[m]["weight"], fused)
    biased_lp = params["layers"][1]
    assert torch.equal(biased_lp["qkv_proj"]["bias"],
                       torch.cat([before[1][m]["bias"] for m in ("q_proj", "k_proj", "v_proj")]))
    assert _shares(biased_lp["k_proj"]["bias"], biased_lp["qkv_proj"]["bias"])
    assert "bias" not in params["layers"][0]["qkv_proj"]


def test_groups_that_cannot_be_fused_are_left_alone():
    """An FP8 member (quantized weights) or members disagreeing on a bias: no fused entry."""
    g = torch.Generator().manual_seed(1)
    lp = _layer(g)
    lp["k_proj"]["bias"] = torch.zeros(4)  # q and v have none
    lp["up_proj"] = {WEIGHT_KEY: torch.zeros(12, 8), "weight_scale": torch.ones(12)}
    q = lp["q_proj"]
    params = {"layers": {3: lp}}  # a pipeline stage's dict of layers works too
    fuse_projection_weights(params)
    assert "qkv_proj" not in params["layers"][3] and "gate_up_proj" not in params["layers"][3]
    assert params["layers"][3]["q_proj"] is q
