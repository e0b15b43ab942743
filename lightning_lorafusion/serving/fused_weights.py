"""Base weights for serving: each layer's q/k/v and gate/up weights as one matrix (one GEMM per group)."""

from __future__ import annotations

from typing import Any, MutableMapping

import torch

from ..kernels.fp8_linear import is_quantized
from ..kernels.nf4 import is_nf4

# fused key -> its member projections, in output-column order
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def fuse_projection_weights(params: MutableMapping[str, Any]) -> None:
    """In place, layer by layer: ``layer["qkv_proj"] = {"weight": [Nq + 2 Nkv, H]}`` (and
    ``"gate_up_proj"``: ``[2 I, H]``), the members' weights concatenated along the output
    dimension (biases too, when every member has one), and each member's weight and bias
    replaced by a row view of it. No second copy stays in ``params``: a layer's originals are
    freed as soon as it is done unless something else holds them (a caller sharing its own
    tensors, e.g. a training module, keeps both). Groups with a quantized member, or members that
    disagree on having a bias, are left as they are (as are FP8 and NF4 groups).

    ``params["layers"]``: the ``load_base_model`` pytree's list (or dict) of layer dicts, which
    this replaces by new dicts; the projections' own dicts are replaced too, not edited.
    """
    layers = params["layers"]
    keys = range(len(layers)) if isinstance(layers, list) else list(layers)
    for i in keys:
        lp = dict(layers[i])
        for fused, members in FUSED_PROJECTIONS.items():
            parts = [lp.get(m) for m in members]
            if any(p is None or is_quantized(p) or is_nf4(p) for p in parts) or fused in lp:
                continue
            has_bias = [p.get("bias") is not None for p in parts]
            if any(has_bias) and not all(has_bias):
                continue
            sizes = [p["weight"].shape[0] for p in parts]
            weight = torch.cat([p["weight"] for p in parts])
            bias = torch.cat([p["bias"] for p in parts]) if all(has_bias) else None
            lp[fused] = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
            weights = weight.split(sizes)
            biases = bias.split(sizes) if bias is not None else [None] * len(parts)
            for m, p, w, b in zip(members, parts, weights, biases):
                lp[m] = {**p, "weight": w} if b is None else {**p, "weight": w, "bias": b}
        layers[i] = lp
