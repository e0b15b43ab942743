"""The decoder forward over the paged KV cache: one engine step's rows through every layer.

A step's rows (``StepBatch``) run every linear layer once: q/k/v and gate/up as one GEMM each
(``fused_weights``) plus their LoRA, added by row tiles of one request each for prefill rows
(``lora_segments``) and gathered per row for decode rows (each its own adapter and rank), the
expand fused into what consumes the projection (``lora_epilogues``: RoPE + KV write, SwiGLU;
``lora_gather`` for o and down). Residual adds are fused into the next RMSNorm
(``add_rms_norm``): a layer returns its MLP output and the next one adds it.

Attention: every row's keys and values are written into the pages first. Prefill requests that
start after tokens already in their pages (a reused cached prefix, an earlier chunk) attend over
their pages (``paged_prefill_attention``: all of them in one launch per layer); those that start
at position 0 join them there (prefill attention "paged") or come first and attend to their own
tokens (varlen causal, "varlen"); decode rows attend to their cached pages
(``paged_decode_attention``).

A layer is three pieces, each its own function: ``before_attention`` (norm, q/k/v, RoPE, KV
write), ``attention`` (its launch grids depend on the step's requests) and ``after_attention``
(o, norm, gate/up, SwiGLU, down); a captured mixed step (``mixed_graphs``) records the first and
last as CUDA graphs and runs attention between them. The runner (``runner.py``) builds the
step's tensors and picks eager, padded or captured execution; this module is the math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..kernels.fp8_linear import frozen_projections
from ..kernels.lora_ahead import ShrinkAhead
from ..kernels.lora_epilogues import rope_write_kv, swiglu_ahead
from ..kernels import lora_gather as lora_gather_knobs
from ..kernels.lora_gather import GatheredLora, expand_beside, lora_gather, shrink_beside
from ..kernels.lora_segments import DEFAULT_FORM, segment_lora_add, segment_lora_shrink
from ..kernels.paged_attention import paged_decode_attention
from ..kernels.options import KernelOptions
from ..kernels.paged_prefill import paged_prefill_attention
from ..kernels.skinny_gemm import SkinnyPlan, plain_linear
from ..kernels.rms_norm import add_rms_norm
from ..model.attention import varlen_causal_attention
from ..model.decoder import DecoderConfig, embed, frozen_weight, rope_cos_sin
from ..model.family import attention_scale, embedding_multiplier, gated_activation, qk_norm, soft_cap
from .dora_rows import apply_dora_rows
from .fused_weights import FUSED_PROJECTIONS
from .pool import UnifiedPool
from .step_batch import MODULE_INDEX as _MODULE_INDEX, StepBatch

# groups of projections sharing an input: (fused weight key or None, members in output order);
# members are consecutive in ALL_TARGET_MODULES, so a group's decode tables are one slice
_QKV = ("qkv_proj", FUSED_PROJECTIONS["qkv_proj"])
_O = (None, ("o_proj",))
_GATE_UP = ("gate_up_proj", FUSED_PROJECTIONS["gate_up_proj"])
_DOWN = (None, ("down_proj",))
# the prefill rows' gate/up LoRA expanded inside SwiGLU (``swiglu_takes_prefill``) instead of
# written into gate/up's outputs (first, or added after the product). Off: on an H100 it tied the
# written-first form at 8,192 rows and lost elsewhere (1.02-1.44x; docs/kernels.md)
PREFILL_SWIGLU = False


@dataclass(frozen=True)
class PagedDecoder:
    """What the paged forward reads besides a step's tensors: the base's weights, the pool
    (KV pages and adapter weights), the kernels to use and the RoPE frequencies.
    ``kernel_backend``: norms, epilogues, the decode rows' LoRA gather and paged decode
    attention; ``lora_backend``: the prefill rows' LoRA (``lora_segments``);
    ``prefill_attention_backend``: paged prefill attention. RoPE frequencies: ``inv_freq`` (the
    config's; longrope: its short factors), ``local_inv_freq`` (the family's sliding-layer RoPE,
    Gemma 3), ``long_inv_freq`` (longrope's long factors, for the rows ``StepBatch.rope_long``
    marks)."""

    config: DecoderConfig
    params: Mapping[str, Any]
    pool: UnifiedPool
    kernel_backend: str
    lora_backend: str
    prefill_attention_backend: str
    inv_freq: torch.Tensor
    local_inv_freq: torch.Tensor | None = None  # the family's sliding-layer RoPE (Gemma 3)
    long_inv_freq: torch.Tensor | None = None
    kernel_options: KernelOptions = KernelOptions()  # the frozen products' (an NF4 base's GEMM)
    nf4_workspace: Any = None  # an NF4 base's decode kernel: its kept split-K counters (nf4_decode.DecodeWorkspace)
    lora_form: str | None = None  # the prefill LoRA's Triton kernels (``lora_segments.FORMS``; None: its default)
    # a second CUDA stream for a decode step's LoRA shrinks, each launched beside the frozen GEMM
    # that reads its input (``lora_gather.shrink_beside``, up to ``BESIDE_MAX_ROWS`` rows); None: none
    lora_stream: Any = None
    # the shrinks beside their GEMMs in decode steps of any rows (the grouped shrink too) and in
    # mixed steps (their decode rows' LoRA), not only in decode steps of at most ``BESIDE_MAX_ROWS``
    # rows (``EngineTuning.decode_lora_beside`` "wide")
    wide_beside: bool = False
    skinny: SkinnyPlan | None = None  # plain 16-bit products of few rows by ``skinny_gemm`` (None: cuBLAS)
    # attention's launches write their rows of one ``[T, Hq * D]`` output in place (mixed steps'
    # pieces: their static buffer), instead of each its own tensor, concatenated and copied
    attention_in_place: bool = True

    def norm(self, h: torch.Tensor, d: torch.Tensor | None, weight: torch.Tensor,
             lora: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """``h`` (+)= ``d`` in place, then the family's RMSNorm (``w`` or ``1 + w``) -> a new tensor.
        ``lora``: decode rows' LoRA of the projection that wrote ``d`` (fp32 rows, first row), added
        into ``d`` first (``add_rms_norm(lora=)``)."""
        return add_rms_norm(h, d, weight, self.config.rms_norm_eps, backend=self.kernel_backend,
                            weight_offset=self.config.family.norm_offset, lora=lora)


# a step's RoPE tables: local (Gemma 3's sliding layers) or not -> cos, sin [T, 1, rotary_dim]
StepRope = dict[bool, tuple[torch.Tensor, torch.Tensor]]


def embed_rows(m: PagedDecoder, batch: StepBatch) -> tuple[torch.Tensor, StepRope]:
    """The step's token embeddings ``h [T, H]`` (times the family's embedding multiplier) and
    its RoPE tables at its positions: one per RoPE the layers use, built once per step (every
    sliding layer of Gemma 3 reads the same local one)."""
    h = embed(m.params, batch.input_ids)
    multiplier = embedding_multiplier(m.config.family, m.config.hidden_size, h.dtype)
    if multiplier is not None:
        h = h * multiplier
    rope = {False: rope_cos_sin(m.config, batch.positions, h.dtype, m.inv_freq, long=batch.rope_long,
                                long_inv_freq=m.long_inv_freq)}
    if m.local_inv_freq is not None:
        rope[True] = rope_cos_sin(m.config, batch.positions, h.dtype, m.local_inv_freq, local=True)
    return h, rope


# a layer's MLP output ``[T, H]``, or that and its decode rows' LoRA not added yet (fp32 rows,
# first row: down's expand ran beside down's GEMM, ``expand_beside``), which the next residual
# add + RMSNorm adds (``PagedDecoder.norm(lora=)``)
LayerOutput = torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, int]]


def split_output(d: LayerOutput | None) -> tuple[torch.Tensor | None, tuple[torch.Tensor, int] | None]:
    """A layer's output -> (the MLP output, its decode rows' LoRA still to add or None)."""
    return d if isinstance(d, tuple) else (d, None)


def final_norm(m: PagedDecoder, h: torch.Tensor, d: LayerOutput) -> torch.Tensor:
    """The last layer's residual add + the final RMSNorm -> ``[R, H]``."""
    d, lora = split_output(d)
    return m.norm(h, d, m.params["norm"], lora=lora)


def paged_forward(m: PagedDecoder, batch: StepBatch) -> torch.Tensor:
    """One eager forward of ``batch`` -> final-normed hidden states of ``batch.output_rows``
    (every row when None): ``[R, H]``."""
    h, rope = embed_rows(m, batch)
    d = None
    waits = batch.layer_waits  # adapters' page-in slices still copying: layer l waits for its own
    for layer in range(m.config.num_layers):
        if waits:
            waits.before(layer)
        d = decoder_layer(m, layer, m.params["layers"][layer], h, d, rope, batch)
    if batch.output_rows is not None:
        h, d = h.index_select(0, batch.output_rows), d.index_select(0, batch.output_rows)
    return final_norm(m, h, d)


def lm_logits(m: PagedDecoder, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, H]`` final-normed hidden states -> ``[R, V]`` fp32 logits (soft-capped as the
    family says, Gemma 2); ``out``: an fp32 ``[R, V]`` tensor they are converted into (no fp32
    temporary: the decode graphs' logits buffer)."""
    logits = soft_cap(plain_linear(m.skinny, hidden, m.params["lm_head"]), m.config.family.final_logit_softcap)
    return logits.float() if out is None else out.copy_(logits)


def decoder_layer(m: PagedDecoder, layer: int, lp: Mapping[str, Any], h: torch.Tensor, d: LayerOutput | None,
                  rope: StepRope, batch: StepBatch) -> LayerOutput:
    """``h [T, H]`` (+)= ``d``, the previous layer's MLP output (None before the first layer),
    in place -> this layer's MLP output ``[T, H]`` (the residual stream is h + it; with its
    decode rows' LoRA still to add where down's expand ran beside: ``LayerOutput``). Three
    pieces: what a piecewise graph would capture before attention, attention (its launch
    grids depend on the step's requests), and what it would capture after."""
    q, k, v = before_attention(m, layer, lp, h, d, rope, batch)
    attn = attention(m, layer, q, k, v, batch)
    return after_attention(m, layer, lp, h, attn, batch)


def before_attention(m: PagedDecoder, layer: int, lp: Mapping[str, Any], h: torch.Tensor, d: LayerOutput | None,
                     rope: StepRope, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add + norm, q/k/v (+ LoRA), the family's q/k norms, RoPE and the KV write -> q,
    k, v ``[T, heads, D]``. Llama's block adds the decode rows' LoRA in the RoPE + KV write
    epilogue; q/k norms must see it first, so those families gather it before the norms."""
    cfg, family = m.config, m.config.family
    t = h.shape[0]
    d, d_lora = split_output(d)
    if family.input_norms:
        x = m.norm(h, d, lp["attn_norm"], lora=d_lora)
    else:  # OLMo 2: no norm before attention, the residual stream itself
        if d is not None:
            h.add_(d)
        x = h
    lora = gathered(m, x, layer, _QKV, batch)
    with shrink_beside(lora if family.qk_norm == "none" else None, lora_stream(m, batch), m.wide_beside) as launched:
        q, k, v = projections(m, x, lp, _QKV, layer, batch)
    lora = launched if family.qk_norm == "none" else lora
    if family.qk_norm != "none":
        if lora is not None:
            for name, y in zip(_QKV[1], (q, k, v)):
                gather_into(m, x, y, layer, name, batch)
            lora = None
        q, k = qk_norm(q.view(t, cfg.num_heads, cfg.head_dim), k.view(t, cfg.num_kv_heads, cfg.head_dim),
                       lp["q_norm"], lp["k_norm"], cfg.rms_norm_eps, family)
    q = q.view(t, cfg.num_heads, cfg.head_dim)
    k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
    v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
    cos, sin = rope[cfg.local_rope(layer)]  # Gemma 3's sliding layers: their own RoPE base
    rope_write_kv(q, k, v, cos, sin, m.pool.kv, layer, batch.slot_pages, batch.slot_offsets,
                  lora=lora, backend=m.kernel_backend)
    return q, k, v


def attention(m: PagedDecoder, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              batch: StepBatch, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every real row's attention -> ``[T, Hq * D]`` (padding rows of a padded step: zeros).
    ``out``: a contiguous ``[T, Hq * D]`` buffer each launch writes its rows into, returned (no
    concatenation, no copy); its padding rows are left as they are (the caller zeroes them).
    Without ``out``, with ``m.attention_in_place`` a new one (its padding rows zeroed), else
    each launch's own output, concatenated."""
    cfg = m.config
    t, tp, nd = q.shape[0], batch.num_prefill_rows, batch.num_decode_rows
    real = tp + nd
    scale, window = attention_scale(cfg.family, cfg.head_dim), cfg.sliding_window(layer)
    softcap = cfg.family.attn_logit_softcap  # Gemma 2: the paged kernels cap the scores too
    # the layer's slice as a one-layer pool: the Triton launchers would turn a layer index
    # equal to 1 into a compile-time constant (Triton specialises integer arguments == 1)
    kv_layer = m.pool.kv[:, layer:layer + 1]
    ds = batch.first_decode_row
    if out is None and m.attention_in_place:
        out = q.new_empty(t, cfg.q_size)
        if real < t:
            out[real:].zero_()
    o = None if out is None else out.view(t, cfg.num_heads, cfg.head_dim)

    def decode_part():
        return paged_decode_attention(q[ds:ds + nd], kv_layer, 0, batch.page_table, batch.seq_lens,
                                      scale=scale, sliding_window=window, softcap=softcap, backend=m.kernel_backend,
                                      out=None if o is None else o[ds:ds + nd])

    parts = [decode_part()] if batch.decode_first and nd else []  # in row order
    ps, tf = batch.prefill_start, batch.num_fresh_rows
    if tf:
        # q, k, v may be column views of one fused GEMM output: attention gets dense copies
        fresh = slice(ps, ps + tf)
        own = varlen_causal_attention(q[fresh].contiguous(), k[fresh].contiguous(), v[fresh].contiguous(),
                                      batch.cu_seqlens, scale=scale, sliding_window=window,
                                      max_seqlen=batch.max_prefill_len, softcap=softcap)
        parts.append(own if o is None else o[fresh].copy_(own))
    if batch.prefill_prefixes is not None:
        pre = batch.prefill_prefixes
        parts.append(paged_prefill_attention(q[ps + tf:ps + tp], kv_layer, 0, pre.cu_seqlens, pre.starts,
                                             pre.page_table, scale=scale, sliding_window=window, softcap=softcap,
                                             max_seqlen=pre.max_seqlen, backend=m.prefill_attention_backend,
                                             out=None if o is None else o[ps + tf:ps + tp]))
    if not batch.decode_first and nd:
        parts.append(decode_part())
    if out is not None:
        return out
    if real < t:
        parts.append(q.new_zeros(t - real, cfg.num_heads, cfg.head_dim))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(t, cfg.q_size)


def after_attention(m: PagedDecoder, layer: int, lp: Mapping[str, Any], h: torch.Tensor, attn: torch.Tensor,
                    batch: StepBatch) -> LayerOutput:
    """o (+ LoRA), residual add + norm, gate/up (+ LoRA), the gated activation, down (+ LoRA)
    -> the MLP output (after the family's output norm, Gemma / OLMo 2). SwiGLU adds the decode
    rows' gate/up LoRA in its epilogue; another activation (GELU-tanh) gets it gathered first.
    In a decode step whose o / down expands run beside their GEMMs (``expands_beside``), the
    norm after o adds o's rows, and the output carries down's for the next norm."""
    family = m.config.family
    o_lora = None  # o's decode rows' LoRA as fp32 rows, where its expand ran beside o's GEMM too
    with beside(m, attn, layer, _O, batch) as launched:
        if expands_beside(m, launched, batch):
            o_lora = (expand_beside(launched, m.config.module_dims("o_proj")[1], lora_stream(m, batch)),
                      batch.first_decode_row)
        (o,) = projections(m, attn, lp, _O, layer, batch)
    if o_lora is None:
        gather_into(m, attn, o, layer, "o_proj", batch, partials=launched and launched.partials)
    if family.output_norms:
        o = m.norm(o, None, lp["attn_post_norm"])
    if family.input_norms:
        x = m.norm(h, o, lp["mlp_norm"], lora=o_lora)
    else:  # OLMo 2
        h.add_(o)
        x = h
    silu = family.activation == "silu"
    # the prefill rows' gate/up expand inside SwiGLU (``swiglu_takes_prefill``): (tables, S) from projections
    prefill: list | None = [] if silu and swiglu_takes_prefill(m, batch) else None
    with shrink_beside(gathered(m, x, layer, _GATE_UP, batch) if silu else None,
                       lora_stream(m, batch), m.wide_beside) as gate_up_lora:
        g, u = projections(m, x, lp, _GATE_UP, layer, batch, deferred=prefill)
    partials = None  # down's shrink, where SwiGLU's LoRA rows computed it (few decode rows)
    if silu:
        act, partials = swiglu_ahead(g, u, lora=gate_up_lora, ahead=down_ahead(m, layer, batch),
                                     backend=m.kernel_backend, prefill=prefill[0] if prefill else None)
    else:
        for name, y in zip(_GATE_UP[1], (g, u)):
            gather_into(m, x, y, layer, name, batch)
        act = gated_activation(family)(g, u)
    down_lora = None  # as o's: added by the next layer's norm (or the final one)
    with beside(m, act, layer, _DOWN, batch, skip=partials is not None) as launched:
        if expands_beside(m, launched, batch) and batch.output_rows is None:
            down_lora = (expand_beside(launched, m.config.module_dims("down_proj")[1], lora_stream(m, batch)),
                         batch.first_decode_row)
        (down,) = projections(m, act, lp, _DOWN, layer, batch)
    if down_lora is not None:
        return down, down_lora
    gather_into(m, act, down, layer, "down_proj", batch, partials=partials or (launched and launched.partials))
    if family.output_norms:
        down = m.norm(down, None, lp["mlp_post_norm"])
    return down


def projections(m: PagedDecoder, x: torch.Tensor, lp: Mapping[str, Any],
                group: tuple[str | None, tuple[str, ...]], layer: int, batch: StepBatch,
                deferred: list | None = None) -> list[torch.Tensor]:
    """The frozen projections of a group (one GEMM when the layer has its fused weight; a
    column view per member) plus the prefill rows' LoRA, added in place; when the step writes
    it first (``PrefillLora.write``, covering tables) and the weights are plain, the LoRA is
    written first and the GEMM adds the frozen product onto it (``write_first``). ``deferred``
    (a list; the prefill rows' split-K form): their shrink only, ``(tables, S)`` appended to it
    for the consumer to expand (``swiglu_takes_prefill``), the products left without their LoRA."""
    fused, names = group
    pre = batch.prefill_lora
    adapted = pre is not None and bool(pre.modules.intersection(names))
    defer = adapted and deferred is not None
    if adapted and pre.write and pre.covering and batch.dora is None and not defer:
        outs = write_first(m, x, lp, group, layer, batch)
        if outs is not None:
            return outs
    # with the decode rows' shrinks beside the GEMMs in mixed steps (``wide_beside``), the prefill
    # rows' shrink too: on the LoRA stream, beside the GEMM below; the expands after it
    side = lora_stream(m, batch) if adapted and m.wide_beside and m.lora_backend == "triton" else None
    tables = pre.group(m.pool.storage, layer, names) if adapted else None
    shrunk = None if side is None and not defer else segment_lora_shrink(x, tables, form=m.lora_form, stream=side)
    if fused is not None and fused in lp:  # fused by fuse_projection_weights, or so in the checkpoint (Phi-3)
        w, b = frozen_weight(lp[fused])
        y = (plain_linear(m.skinny, x, w, b) if isinstance(w, torch.Tensor)
             else frozen_projections(x, [w], [b], options=m.kernel_options, nf4_workspace=m.nf4_workspace)[0])
        sizes = [m.config.module_dims(n)[1] for n in names]
        outs = list(y.split(sizes, dim=1))
        biases = [None] * len(names) if b is None else b.split(sizes)
    else:
        weights, biases = zip(*(frozen_weight(lp[n]) for n in names))  # an FP8 base: Fp8Weight
        if m.skinny is not None and all(isinstance(w, torch.Tensor) for w in weights):
            outs = [plain_linear(m.skinny, x, w, b) for w, b in zip(weights, biases)]
        else:
            outs = frozen_projections(x, weights, biases, options=m.kernel_options, nf4_workspace=m.nf4_workspace)
    if batch.dora is not None:  # DoRA rows: g * (x W^T) + bias, before their LoRA (g * B) is added
        apply_dora_rows(outs, names, layer, biases, batch.dora)
    if adapted:
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        if defer:
            if shrunk is not None:  # (None: an empty table, nothing to add)
                deferred.append((tables, shrunk[0]))
            return outs
        segment_lora_add(x, tables, outs, backend=m.lora_backend, form=m.lora_form, shrunk=shrunk)
    return outs


def swiglu_takes_prefill(m: PagedDecoder, batch: StepBatch) -> bool:
    """Whether the prefill rows' gate/up LoRA is expanded inside SwiGLU (``PREFILL_SWIGLU``):
    their tables cover the step (so that kernel writes every row), the split-K form (one summed
    S), the prefill LoRA's Triton kernels, no DoRA rows; then gate/up's products are written once
    by the GEMM and the delta never reaches memory."""
    pre = batch.prefill_lora
    return (PREFILL_SWIGLU and pre is not None and pre.covering and batch.dora is None
            and bool(pre.modules.intersection(_GATE_UP[1])) and m.lora_backend == "triton"
            and (m.lora_form or DEFAULT_FORM) == "splitk")


def write_first(m: PagedDecoder, x: torch.Tensor, lp: Mapping[str, Any], group: tuple[str | None, tuple[str, ...]],
                layer: int, batch: StepBatch) -> list[torch.Tensor] | None:
    """A group's outputs as the prefill rows' LoRA written first (every row: zeros where none,
    the tables cover the step) and the frozen product added onto it by the GEMM as its C input
    (``addmm_``, beta = 1): the output is written once by the expand and read once by cuBLAS's
    epilogue, instead of read and written again by an additive expand. None (the caller adds
    the LoRA after the product) for weights that are not plain tensors (FP8, NF4) or carry a bias."""
    fused, names = group
    if fused is not None and fused in lp:
        parts = [frozen_weight(lp[fused])]
    else:
        parts = [frozen_weight(lp[n]) for n in names]
    if any(not isinstance(w, torch.Tensor) or b is not None for w, b in parts):
        return None
    sizes = [m.config.module_dims(n)[1] for n in names]
    ys = [x.new_empty(x.shape[0], w.shape[0]) for w, _ in parts]
    outs = list(ys[0].split(sizes, dim=1)) if len(parts) == 1 else ys
    segment_lora_add(x, batch.prefill_lora.group(m.pool.storage, layer, names), outs, backend=m.lora_backend,
                     accumulate=False, form=m.lora_form)
    for y, (w, _) in zip(ys, parts):
        y.addmm_(x, w.t())
    return outs


def gathered(m: PagedDecoder, x: torch.Tensor, layer: int, group: tuple[str | None, tuple[str, ...]],
             batch: StepBatch) -> GatheredLora | None:
    """The decode rows' LoRA tables of a group (None when no decode row adapts any member)."""
    names = group[1]
    if batch.decode_offsets is None or not batch.decode_modules.intersection(names):
        return None
    m0, m1 = _MODULE_INDEX[names[0]], _MODULE_INDEX[names[-1]] + 1
    ds, b = batch.first_decode_row, batch.decode_scales.shape[0]
    return GatheredLora(x[ds:ds + b], m.pool.storage, batch.decode_offsets[layer, m0:m1, 0],
                        batch.decode_offsets[layer, m0:m1, 1], batch.decode_ranks[m0:m1], batch.decode_scales,
                        first_row=ds, groups=batch.decode_groups, rank_bound=batch.decode_rank_bound)


def beside(m: PagedDecoder, x: torch.Tensor, layer: int, group: tuple[str | None, tuple[str, ...]],
           batch: StepBatch, skip: bool = False):
    """``shrink_beside`` of the decode rows' LoRA of a group read by ``gather_into`` (o, down):
    a context whose value is the group's ``GatheredLora`` with its partials launched on the
    LoRA stream (``lora_stream``; None where no decode row adapts it, or ``skip``: its shrink
    done already)."""
    stream = lora_stream(m, batch)
    rows = 0 if batch.decode_scales is None else batch.decode_scales.shape[0]
    applies = stream is not None and not skip and (m.wide_beside or (
        lora_gather_knobs.BESIDE_MAX_ROWS is not None and rows <= lora_gather_knobs.BESIDE_MAX_ROWS))
    return shrink_beside(gathered(m, x, layer, group, batch) if applies else None, stream, m.wide_beside)


def expands_beside(m: PagedDecoder, launched: GatheredLora | None, batch: StepBatch) -> bool:
    """Whether o's or down's expand runs beside its GEMM too (``lora_gather.EXPAND_BESIDE``): its
    shrink did, and the family's next kernel after the projection is the residual add + RMSNorm
    that adds the rows (input norms, no output norms: Llama's block)."""
    family = m.config.family
    return (launched is not None and launched.partials is not None and lora_gather_knobs.EXPAND_BESIDE
            and family.input_norms and not family.output_norms)


def lora_stream(m: PagedDecoder, batch: StepBatch) -> torch.cuda.Stream | None:
    """The stream a step's decode LoRA shrinks run on beside the frozen GEMMs: ``m.lora_stream``
    in decode steps (no prefill rows: the steps whose graphs are captured per row bucket), and
    in mixed steps with ``m.wide_beside``; else None (their shrinks in stream order)."""
    return m.lora_stream if batch.num_prefill_rows == 0 or m.wide_beside else None


def down_ahead(m: PagedDecoder, layer: int, batch: StepBatch) -> ShrinkAhead | None:
    """down's A tables of the decode rows, for SwiGLU to run its shrink (None: no decode row adapts down)."""
    if batch.decode_offsets is None or "down_proj" not in batch.decode_modules:
        return None
    i = _MODULE_INDEX["down_proj"]
    return ShrinkAhead(m.pool.storage, batch.decode_offsets[layer, i, 0], batch.decode_ranks[i])


def gather_into(m: PagedDecoder, x: torch.Tensor, y: torch.Tensor, layer: int, name: str, batch: StepBatch,
                partials: tuple[torch.Tensor, int] | None = None) -> None:
    """``y[decode rows] += `` their LoRA of projection ``name`` (input ``x``; ``partials``: its
    shrink already done)."""
    if batch.decode_offsets is None or name not in batch.decode_modules:
        return
    i, ds, b = _MODULE_INDEX[name], batch.first_decode_row, batch.decode_scales.shape[0]
    lora_gather(x[ds:ds + b], m.pool.storage, batch.decode_offsets[layer, i, 0],
                batch.decode_offsets[layer, i, 1], batch.decode_ranks[i], batch.decode_scales, y.shape[1],
                out=y[ds:ds + b], backend=m.kernel_backend, groups=batch.decode_groups, partials=partials,
                rank_bound=batch.decode_rank_bound)
