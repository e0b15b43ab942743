"""What a training step keeps from forward to backward, per token and per decoder layer, by tensor:
the accounting behind ``data.capacity`` and the recomputation options (``mlp_recompute``,
``norm_recompute``, their ``*_layers`` counts, ``checkpoint_layers``).
tests/model/test_activation_memory.py checks it against the bytes autograd really saves
(``saved_tensors_hooks``) on a tiny model.

It describes the training path on a GPU: the fused LoRA kernels (each projection group keeps its
input and the compact ``S = X A^T``, dropout masks regenerated), FlashAttention (q, k, v after
RoPE, its output and the fp32 log-sum-exp per head), and the norms and activation either compiled
(``DecoderOptions.elementwise_fusion``: a norm keeps its input and the fp32 ``1/rms``) or eager (a
norm keeps an fp32 copy of its input and ``1/rms``; SwiGLU also keeps ``silu(gate)``). Adapter
factors, frozen weights, routing tables and the per-forward RoPE tables are not per layer and not
counted. The torch reference backend (CPU) keeps per-segment slices instead and is not described.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .decoder_config import DecoderConfig
from .mlp_recompute import MLP_RECOMPUTE_MODES

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FP32 = 4


def _ranks(rank: int | Mapping[str, int]) -> dict[str, int]:
    if isinstance(rank, int):
        return {m: rank for m in PROJECTIONS}
    unknown = set(rank) - set(PROJECTIONS)
    if unknown:
        raise ValueError(f"rank names {sorted(unknown)}; projections are {PROJECTIONS}")
    return {m: int(rank.get(m, 0)) for m in PROJECTIONS}


def layer_saved_bytes(config: DecoderConfig, rank: int | Mapping[str, int], *, dtype: torch.dtype = torch.bfloat16,
                      mlp_recompute: str = "none", elementwise_compiled: bool = True,
                      norm_recompute: bool = False) -> dict[str, int]:
    """Bytes kept for backward per token by one decoder layer, ``{tensor: bytes}``.

    ``rank``: the LoRA rank of the token's adapter on every projection, or per projection
    (missing: not adapted); ``dtype``: activations' dtype; ``mlp_recompute``:
    ``DecoderOptions.mlp_recompute``; ``elementwise_compiled``: the norms and activation run
    compiled (CUDA) or eager; ``norm_recompute``: ``DecoderOptions.norm_recompute`` (the norm
    outputs are rebuilt from the norm inputs; an eager norm in 16 bits keeps an fp32 copy of its
    input, so the rebuild keeps the 16-bit input itself too). The Llama block (pre-norms,
    SwiGLU/GeGLU, separate projections); a checkpointed layer keeps ``layer_input`` only."""
    family = config.family
    if (not family.input_norms or family.output_norms or family.qk_norm != "none" or family.fused_qkv
            or family.fused_gate_up or family.attn_logit_softcap is not None):
        raise ValueError(f"layer_saved_bytes describes the Llama block; {config.model_type} differs "
                         "(norm placement, q/k norms, fused projections or soft-capped attention)")
    if mlp_recompute not in MLP_RECOMPUTE_MODES:
        raise ValueError(f"mlp_recompute={mlp_recompute!r}; allowed: {MLP_RECOMPUTE_MODES}")
    r = _ranks(rank)
    b = torch.empty((), dtype=dtype).element_size()
    h, i = config.hidden_size, config.intermediate_size
    norm_input = h * b if elementwise_compiled else h * _FP32  # eager: the fp32 copy (itself in fp32)
    qkv, gate_up = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    attn_output_kept = any(r[m] for m in qkv)
    # the gate/up projections keep their input when adapted; "gate_up" recomputes from it
    mlp_output_kept = any(r[m] for m in gate_up) or mlp_recompute == "gate_up"
    rebuild_source = h * b if not elementwise_compiled and b != _FP32 else 0  # eager: the fp32 copy is another tensor
    out = {
        "layer_input": norm_input, "attn_norm_rstd": _FP32,
        "attn_norm_output": h * b if attn_output_kept and not norm_recompute else 0,
        "attn_norm_rebuild_input": rebuild_source if attn_output_kept and norm_recompute else 0,
        "qkv_lora_s": sum(r[m] for m in qkv) * b,
        "q": config.q_size * b, "k": config.kv_size * b, "v": config.kv_size * b,
        "attn_output": config.q_size * b, "attn_lse": config.num_heads * _FP32,
        "o_lora_s": r["o_proj"] * b,
        "mlp_norm_input": norm_input, "mlp_norm_rstd": _FP32,
        "mlp_norm_output": h * b if mlp_output_kept and not norm_recompute else 0,
        "mlp_norm_rebuild_input": rebuild_source if mlp_output_kept and norm_recompute else 0,
        "gate_up_lora_s": sum(r[m] for m in gate_up) * b,
        "gate": i * b if mlp_recompute != "gate_up" else 0,
        "up": i * b if mlp_recompute != "gate_up" else 0,
        # eager SwiGLU/GeGLU keeps act(gate) for the product's gradient; the recomputing
        # activation and the compiled one rebuild it
        "act_gate": i * b if mlp_recompute == "none" and not elementwise_compiled else 0,
        "act_output": i * b if mlp_recompute == "none" and r["down_proj"] else 0,
        "down_lora_s": r["down_proj"] * b,
    }
    return {k: v for k, v in out.items() if v}


def step_activation_bytes(config: DecoderConfig, rank: int | Mapping[str, int], tokens: int, *,
                          dtype: torch.dtype = torch.bfloat16, mlp_recompute: str = "none",
                          checkpoint_layers: bool | int = False, elementwise_compiled: bool = True,
                          norm_recompute: bool = False, mlp_recompute_layers: int | None = None,
                          norm_recompute_layers: int | None = None) -> int:
    """Bytes the decoder layers of one ``tokens``-token microbatch keep for backward:
    ``checkpoint_layers`` layers keep their input only, the others ``layer_saved_bytes``, with
    ``mlp_recompute`` / ``norm_recompute`` in the first ``mlp_recompute_layers`` /
    ``norm_recompute_layers`` layers only (None: every layer; ``DecoderOptions.for_layer``)."""
    whole = config.num_layers if checkpoint_layers is True else int(checkpoint_layers)
    whole = min(max(whole, 0), config.num_layers)
    per_layer: dict[tuple[str, bool], int] = {}
    total = 0
    for layer in range(whole, config.num_layers):
        mode = mlp_recompute if mlp_recompute_layers is None or layer < mlp_recompute_layers else "none"
        norms = norm_recompute and (norm_recompute_layers is None or layer < norm_recompute_layers)
        if (mode, norms) not in per_layer:
            per_layer[mode, norms] = sum(layer_saved_bytes(config, rank, dtype=dtype, mlp_recompute=mode,
                                                           elementwise_compiled=elementwise_compiled,
                                                           norm_recompute=norms).values())
        total += per_layer[mode, norms]
    b = torch.empty((), dtype=dtype).element_size()
    return tokens * (whole * config.hidden_size * b + total)
