"""Functional decoder of the supported families (Llama, Mistral, Qwen2/3, OLMo 2, Gemma 2/3): pure
functions over a params pytree. How a family's block differs is ``config.family``
(``family.DecoderFamily``); the block below is built from its per-piece functions.

Params pytree (plain nested dicts; the frozen base tensors are never copied)::

    {"embed": [V, H],
     "layers": [{"attn_norm": [H],
                 "q_proj": {"weight": [Hq*D, H], "bias"?: [Hq*D]},
                 "k_proj": {"weight": [Hkv*D, H], "bias"?}, "v_proj": {...},
                 "o_proj": {"weight": [H, Hq*D], "bias"?},
                 "mlp_norm": [H],
                 "gate_proj": {"weight": [I, H]}, "up_proj": {...}, "down_proj": {"weight": [H, I]},
                 # by family (DecoderFamily.norm_keys): "attn_post_norm", "mlp_post_norm": [H]
                 # (Gemma, OLMo 2; OLMo 2 has no attn_norm/mlp_norm); "q_norm", "k_norm": [D]
                 # per head (Qwen3, Gemma 3) or [Hq*D] / [Hkv*D] whole projection (OLMo 2)
                 },
                ...],   # FP8 base: each {"weight": W} is {"weight_fp8": uint8 bits, "weight_scale": [N]}
                        # NF4 base: {"weight_nf4": uint8 [N, K/2], "nf4_absmax", ...} (kernels/nf4.py)
     "norm": [H],
     "lm_head": [V, H]}   # the same tensor object as "embed" when embeddings are tied

An FP8 base with untied embeddings may also hold "embed" as {"weight_fp8": [V, H], "weight_scale":
[V]} (per-row scales in the model's dtype; ``hf_loading.quantize_base_fp8(embedding=True)``).

Microbatches are packed: ``T`` tokens of several samples, ``cu_seqlens`` marks their
boundaries and ``position_ids`` restart at 0 per sample. Labels are PRE-SHIFTED by the data
layer: ``labels[t]`` is the target predicted from position ``t`` (IGNORE_INDEX where none), so
the model never shifts. A pipeline stage calls ``embed``, ``decoder_layers`` over its slice of
layers, and (last stage) ``head_loss_sums``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..kernels.api import lora_projections
from ..kernels.dropout import dropout_offset
from ..kernels.fp8_linear import SCALE_KEY, Fp8Weight, QuantizedOperands, fp8_embedding, fp8_swiglu, is_quantized
from ..kernels.linear_cross_entropy import linear_cross_entropy_sums
from ..kernels.nf4 import Nf4Weight, is_nf4
from ..kernels.options import KernelOptions
from ..kernels.reference import LoraModuleWeights, LoraRouting, apply_rope, rms_norm
from ..specs import IGNORE_INDEX, ConfigError
from .attention import varlen_causal_attention
from .flex_attention import softcap_block_masks
from .mlp_recompute import MLP_RECOMPUTE_MODES, recomputed_mlp
from .rebuilt_copies import rebuilt_in_backward
from .decoder_config import (ROPE_TYPES, DecoderConfig, rope_cos_sin, rope_inv_freq,  # noqa: F401 (also imported from here)
                             rope_long_rows)
from .family import (
    SUPPORTED_MODEL_TYPES,
    DecoderFamily,
    attention_scale,
    embedding_multiplier,
    family_add_norm,
    family_norm,
    gated_activation,
    qk_norm,
    soft_cap,
    swiglu,
)

LM_HEAD_LOSSES = ("checkpointed", "fused")  # head_loss_sums: recompute chunks / fused linear CE
ELEMENTWISE_FUSION_MODES = ("auto", "on", "off")

# (layer index, module name) -> that projection's LoRA factors over all adapters of the bank.
BankView = Mapping[tuple[int, str], LoraModuleWeights]


@dataclass(frozen=True, kw_only=True)
class DecoderOptions:
    """How the decoder computes (never what): passed to ``decoder_layers`` and the functions
    above it, instead of process-wide switches.

    ``elementwise_fusion``: "auto" (compile the elementwise groups on CUDA with the Triton
    backend), "on" (always) or "off"; ``fusion_compiler``: the torch.compile backend
    ("inductor"; "aot_eager" traces without code generation, for tests); ``kernels``: the
    kernels' options (``KernelOptions``: FP8 accumulation, the NF4 GEMM); ``mlp_recompute``:
    which of the MLP's ``[T, intermediate]`` tensors backward rebuilds instead of keeping:
    "none", "activation" (the activation's output, elementwise) or "gate_up" (also the gate/up
    products, one extra gate+up product per layer); ``mlp_recompute.py``. ``norm_recompute``:
    backward rebuilds the attention and MLP input norms' outputs from their inputs (kept by the
    norms anyway) instead of keeping them for the projections' LoRA (``rebuilt_copies.py``;
    elementwise work only). ``mlp_recompute_layers`` / ``norm_recompute_layers``: how many layers
    (the model's first n, global index < n) apply ``mlp_recompute`` / ``norm_recompute``; the others
    keep what they would keep without it, so spare memory buys back the rebuilds' time (None: every
    layer). Layers under ``checkpoint_layers`` recompute whole and ignore all four."""

    elementwise_fusion: str = "auto"
    fusion_compiler: str = "inductor"
    kernels: KernelOptions = field(default_factory=KernelOptions)
    mlp_recompute: str = "none"
    norm_recompute: bool = False
    mlp_recompute_layers: int | None = None
    norm_recompute_layers: int | None = None

    def __post_init__(self) -> None:
        if self.elementwise_fusion not in ELEMENTWISE_FUSION_MODES:
            raise ValueError(f"DecoderOptions.elementwise_fusion={self.elementwise_fusion!r}; "
                             "allowed: 'auto', 'on', 'off'")
        if not isinstance(self.kernels, KernelOptions):
            raise TypeError(f"DecoderOptions.kernels must be a KernelOptions; got {type(self.kernels).__name__}")
        if self.mlp_recompute not in MLP_RECOMPUTE_MODES:
            raise ValueError(f"DecoderOptions.mlp_recompute={self.mlp_recompute!r}; allowed: {MLP_RECOMPUTE_MODES}")
        if not isinstance(self.norm_recompute, bool):
            raise TypeError(f"DecoderOptions.norm_recompute must be a bool; got {self.norm_recompute!r}")
        for name in ("mlp_recompute_layers", "norm_recompute_layers"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise ValueError(f"DecoderOptions.{name}={n!r} must be None (every layer) or an int >= 0")

    def for_layer(self, layer: int) -> "DecoderOptions":
        """These options as decoder layer ``layer`` (global index) applies them: a layer past
        ``mlp_recompute_layers`` / ``norm_recompute_layers`` keeps instead of recomputing."""
        mlp = self.mlp_recompute_layers is None or layer < self.mlp_recompute_layers
        norm = self.norm_recompute_layers is None or layer < self.norm_recompute_layers
        if (mlp or self.mlp_recompute == "none") and (norm or not self.norm_recompute):
            return self
        return replace(self, mlp_recompute=self.mlp_recompute if mlp else "none",
                       norm_recompute=self.norm_recompute and norm, mlp_recompute_layers=None,
                       norm_recompute_layers=None)


DEFAULT_OPTIONS = DecoderOptions()
_COMPILED: dict[tuple[Any, str], Any] = {}  # cache: (eager function, compiler) -> compiled


def _fuse(backend: str, x: torch.Tensor, options: DecoderOptions) -> bool:
    mode = options.elementwise_fusion
    return mode == "on" or (mode == "auto" and backend == "triton" and x.is_cuda)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` is the fused Triton path on CUDA and the torch reference elsewhere. Resolved once
    per forward, before anything compares it: every caller (the single-device step, pipeline
    stages, CUDA graphs) then gets the elementwise fusion and FP8 MLP that "triton" selects."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


# variants dynamo may compile of one fused group in a process (its default is 8): with static
# shapes each capacity a run packs at (up to three levels without a pipeline), the capacity
# probe's candidates and a second fit in the same process (tests, notebooks) compile each group
# again, and a group past the limit under fullgraph=True fails the step instead of running it
RECOMPILE_LIMIT = 64


def _compiled(fn, compiler: str):
    key = (fn, compiler)
    if key not in _COMPILED:
        config = torch._dynamo.config
        if getattr(config, "recompile_limit", RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
            config.recompile_limit = RECOMPILE_LIMIT
        _COMPILED[key] = torch.compile(fn, dynamic=False, fullgraph=True, backend=compiler)
    return _COMPILED[key]


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


_swiglu = swiglu  # Llama's MLP group (the fusion tests look for it among the compiled ones)


def frozen_weight(p: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor | Fp8Weight | Nf4Weight, torch.Tensor | None]:
    """A projection's frozen weight and bias; an FP8 base (``hf_loading.quantize_base_fp8``)
    holds {"weight_fp8", "weight_scale"}, returned as an ``Fp8Weight``; an NF4 base
    (``hf_loading.quantize_base_nf4`` or a bitsandbytes 4-bit checkpoint) {"weight_nf4", ...},
    returned as an ``Nf4Weight``."""
    if is_nf4(p):
        return Nf4Weight.from_params(p), p.get("bias")
    return (Fp8Weight.from_params(p) if is_quantized(p) else p["weight"]), p.get("bias")


# --------------------------------------------------------------------------- the model


def embed(params: Mapping[str, Any], input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids ``[T]`` int -> hidden states ``[T, H]``."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be [tokens]; got shape {tuple(input_ids.shape)}")
    table = params["embed"]
    if is_quantized(table):  # FP8 table: gather, then dequantize the gathered rows only
        return fp8_embedding(input_ids, table)
    return F.embedding(input_ids, table)


def embedding_device_dtype(params: Mapping[str, Any]) -> tuple[torch.device, torch.dtype]:
    """Device and compute dtype of the base, read off its embedding (plain or FP8)."""
    table = params["embed"]
    if is_quantized(table):
        return table[SCALE_KEY].device, table[SCALE_KEY].dtype
    return table.device, table.dtype


def _qkv_projections(x: torch.Tensor, lp: Mapping[str, Any], lora, routing: LoraRouting | None, *,
                     config: DecoderConfig, dropout_offset: int, backend: str, options: KernelOptions):
    """q, k, v ``[T, q_size]``, ``[T, kv_size]`` x2 with their LoRA: three products, or one over a
    fused ``qkv_proj`` split after (LoRA on the fused projection, as PEFT has it)."""
    if config.family.fused_qkv:
        wqkv, bqkv = frozen_weight(lp["qkv_proj"])
        (qkv,) = lora_projections(x, [wqkv], [bqkv], lora("qkv_proj"), routing, dropout_offset=dropout_offset,
                                  backend=backend, options=options)
        return qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
    (wq, bq), (wk, bk), (wv, bv) = (frozen_weight(lp[m]) for m in ("q_proj", "k_proj", "v_proj"))
    return lora_projections(x, [wq, wk, wv], [bq, bk, bv], lora("q_proj", "k_proj", "v_proj"), routing,
                            dropout_offset=dropout_offset, backend=backend, options=options)


def _mlp(x: torch.Tensor, lp: Mapping[str, Any], lora, routing: LoraRouting | None, act, *, config: DecoderConfig,
         offset, backend: str, options: DecoderOptions) -> torch.Tensor:
    """The gated MLP ``x [T, H] -> [T, H]`` with its LoRA; ``options.mlp_recompute`` says which of
    its ``[T, I]`` tensors backward rebuilds instead of keeping (``mlp_recompute.py``)."""
    family, kernel_options = config.family, options.kernels
    wd, bd = frozen_weight(lp["down_proj"])
    if family.fused_gate_up:  # one product, chunked into gate and up after
        wgu, bgu = frozen_weight(lp["gate_up_proj"])

        def gate_up(x):
            (gu,) = lora_projections(x, [wgu], [bgu], lora("gate_up_proj"), routing, dropout_offset=offset(2),
                                     backend=backend, options=kernel_options)
            return gu.chunk(2, dim=-1)
    else:
        (wg, bg), (wu, bu) = frozen_weight(lp["gate_proj"]), frozen_weight(lp["up_proj"])
        # FP8 MLP on the Triton backend: SwiGLU also quantizes h for down and the gate/up gradient
        # for dX, handed over through `operands` (the fused projections' backward takes the
        # gradient; the torch reference sums its gradient from slices and would not)
        if (backend == "triton" and family.activation == "silu"
                and all(isinstance(w, Fp8Weight) for w in (wg, wu, wd))):
            if options.mlp_recompute != "none":
                raise ValueError(f"DecoderOptions.mlp_recompute={options.mlp_recompute!r} does not apply to an "
                                 "FP8 base's MLP (its SwiGLU hands quantized operands to down); use 'none'")
            operands = QuantizedOperands()
            g, u = lora_projections(x, [wg, wu], [bg, bu], lora("gate_proj", "up_proj"), routing,
                                    dropout_offset=offset(2), backend=backend, options=kernel_options,
                                    operands=operands)
            (d,) = lora_projections(fp8_swiglu(g, u, wg, wu, operands), [wd], [bd], lora("down_proj"), routing,
                                    dropout_offset=offset(3), backend=backend, options=kernel_options,
                                    operands=operands)
            return d

        def gate_up(x):
            return lora_projections(x, [wg, wu], [bg, bu], lora("gate_proj", "up_proj"), routing,
                                    dropout_offset=offset(2), backend=backend, options=kernel_options)

    def down(mid):
        return lora_projections(mid, [wd], [bd], lora("down_proj"), routing, dropout_offset=offset(3),
                                backend=backend, options=kernel_options)[0]

    return recomputed_mlp(x, gate_up, act, down, options.mlp_recompute)


def _rebuilt_norm(enabled: bool, x: torch.Tensor, norm, h: torch.Tensor, weight, eps: float):
    """``x = norm(h, weight, eps)`` rebuilt in backward from ``h`` when ``enabled`` (else nothing)."""
    if not enabled:
        return contextlib.nullcontext()
    return rebuilt_in_backward(x, lambda source: norm(source, weight, eps), h)


def decoder_layer(
    lp: Mapping[str, Any],
    bank_view: BankView | None,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu_seqlens: torch.Tensor,
    routing: LoraRouting | None,
    *,
    config: DecoderConfig,
    layer: int,
    microbatch_index: int,
    backend: str = "torch",
    max_seqlen: int | None = None,
    options: DecoderOptions = DEFAULT_OPTIONS,
    attention_masks: Mapping[int | None, Any] | None = None,
) -> torch.Tensor:
    """One block ``h [T, H] -> [T, H]``: attention then gated MLP, each with LoRA, arranged as
    ``config.family`` says (Llama's pre-norm SwiGLU block by default). ``cos``/``sin``: this
    layer's RoPE (``decoder_layers`` picks the local or global one per layer).
    ``attention_masks``: soft-capped attention's FlexAttention masks by sliding window, built once
    per forward by ``decoder_layers`` (None: built by the attention itself)."""
    view = bank_view or {}
    kernel_options = options.kernels
    family, eps = config.family, config.rms_norm_eps

    def lora(*names: str) -> list[LoraModuleWeights | None]:
        return [view.get((layer, n)) for n in names]

    def offset(slot: int) -> int:
        return dropout_offset(microbatch_index, layer, slot)

    t = h.shape[0]
    norm, add_norm, act, rope_qk = family_norm(family), family_add_norm(family), gated_activation(family), _rope_qk
    if _fuse(backend, h, options):
        c = options.fusion_compiler
        norm, add_norm, rope_qk, act = (_compiled(norm, c), _compiled(add_norm, c),
                                        _compiled(_rope_qk, c), _compiled(act, c))
    rebuild = options.norm_recompute and family.input_norms
    x = norm(h, lp["attn_norm"], eps) if family.input_norms else h
    with _rebuilt_norm(rebuild, x, norm, h, lp.get("attn_norm"), eps):
        q, k, v = _qkv_projections(x, lp, lora, routing, config=config, dropout_offset=offset(0), backend=backend,
                                   options=kernel_options)
    q, k = q.reshape(t, config.num_heads, config.head_dim), k.reshape(t, config.num_kv_heads, config.head_dim)
    if family.qk_norm != "none":
        q, k = qk_norm(q, k, lp["q_norm"], lp["k_norm"], eps, family)
    q, k = rope_qk(q, k, cos, sin)
    v = v.reshape(t, config.num_kv_heads, config.head_dim)
    window = config.sliding_window(layer)
    a = varlen_causal_attention(q, k, v, cu_seqlens, scale=attention_scale(family, config.head_dim),
                                sliding_window=window, max_seqlen=max_seqlen, softcap=family.attn_logit_softcap,
                                block_mask=None if attention_masks is None else attention_masks.get(window))
    wo, bo = frozen_weight(lp["o_proj"])
    (o,) = lora_projections(a.reshape(t, config.q_size), [wo], [bo], lora("o_proj"), routing,
                            dropout_offset=offset(1), backend=backend, options=kernel_options)
    if family.output_norms:
        o = norm(o, lp["attn_post_norm"], eps)
    if family.input_norms:
        h, x = add_norm(h, o, lp["mlp_norm"], eps)
    else:
        h = x = h + o
    with _rebuilt_norm(rebuild, x, norm, h, lp.get("mlp_norm"), eps):
        d = _mlp(x, lp, lora, routing, act, config=config, offset=offset, backend=backend, options=options)
    if family.output_norms:
        d = norm(d, lp["mlp_post_norm"], eps)
    return h + d


def decoder_layers(
    params: Mapping[str, Any],
    bank_view: BankView | None,
    h: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    routing: LoraRouting | None,
    *,
    config: DecoderConfig,
    layers: range | Sequence[int] | None = None,
    microbatch_index: int | None = None,
    backend: str = "torch",
    max_seqlen: int | None = None,
    checkpoint_layers: bool | int = False,
    options: DecoderOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """Run ``params["layers"][i]`` for i in ``layers`` (global indices; default all): ``h [T, H]``.

    ``params["layers"]`` may be a list of all layers or a dict holding only this stage's.
    ``microbatch_index`` feeds dropout offsets; default ``routing.microbatch_index`` (or 0).
    ``max_seqlen``: longest attention block, if known (``Microbatch.max_seqlen``; spares the
    flash path a device->host sync).
    ``checkpoint_layers``: keep only a layer's input for backward and recompute the rest
    (dropout masks are hashes of (seed, offset), so the recomputation draws the same ones).
    ``True``: every layer; an int ``n``: the model's first ``n`` layers (global index < n), so
    a pipeline's early stages, which hold the most microbatches in flight, recompute first.
    ``options``: how the layers compute (``DecoderOptions``: elementwise fusion, FP8 accumulation).
    """
    t = h.shape[0]
    backend = resolve_backend(backend, h.device)
    if h.dim() != 2 or h.shape[1] != config.hidden_size:
        raise ValueError(f"h must be [tokens, {config.hidden_size}]; got {tuple(h.shape)}")
    if position_ids.shape != (t,):
        raise ValueError(f"position_ids must be [{t}]; got {tuple(position_ids.shape)}")
    if routing is not None and routing.num_rows != t:
        raise ValueError(f"routing covers {routing.num_rows} rows but h has {t} tokens")
    if layers is None:
        layers = range(config.num_layers)
    if microbatch_index is None:
        microbatch_index = routing.microbatch_index if routing is not None else 0
    cos, sin = rope_cos_sin(config, position_ids, h.dtype, long=rope_long_rows(config, position_ids, cu_seqlens))
    ropes = {False: (cos, sin)}
    if any(config.local_rope(i) for i in layers):
        ropes[True] = rope_cos_sin(config, position_ids, h.dtype, local=True)
    masks = None
    if config.family.attn_logit_softcap is not None and h.is_cuda:  # one FlexAttention mask per window
        masks = softcap_block_masks(cu_seqlens, t, {config.sliding_window(i) for i in layers})
    multiplier = embedding_multiplier(config.family, config.hidden_size, h.dtype)
    if multiplier is not None and 0 in layers:
        # the family's embedding scale (Gemma): applied here, before the first layer, so every
        # caller of ``embed`` (training, pipeline stages, CUDA graphs) gets it
        h = h * multiplier
    if isinstance(checkpoint_layers, bool):
        recompute_below = config.num_layers if checkpoint_layers else 0
    else:
        recompute_below = int(checkpoint_layers)
    recompute_below = recompute_below if torch.is_grad_enabled() else 0
    whole = replace(options, mlp_recompute="none", norm_recompute=False)  # a checkpointed layer recomputes all
    for i in layers:
        args = (params["layers"][i], bank_view, h, *ropes[config.local_rope(i)], cu_seqlens, routing)
        kwargs = dict(config=config, layer=i, microbatch_index=microbatch_index, backend=backend,
                      max_seqlen=max_seqlen, options=options.for_layer(i), attention_masks=masks)
        if i < recompute_below:
            # no torch RNG inside (dropout masks are hashes): nothing to preserve, and a CUDA
            # graph capture may not read or set the generator's state
            h = checkpoint(decoder_layer, *args, use_reentrant=False, preserve_rng_state=False,
                           **{**kwargs, "options": whole})
        else:
            h = decoder_layer(*args, **kwargs)
    return h


def _token_losses(h: torch.Tensor, labels: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor,
                  eps: float, family: DecoderFamily | None = None) -> torch.Tensor:
    """``[C, H]`` -> per-token cross-entropy ``[C]`` fp32 (0 where label is IGNORE_INDEX)."""
    family = family or DecoderFamily()
    logits = F.linear(family_norm(family)(h, norm, eps), lm_head)  # [C, V], one chunk at a time
    logits = soft_cap(logits, family.final_logit_softcap).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def head_loss_sums(
    params: Mapping[str, Any],
    h: torch.Tensor,
    labels: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    num_adapters: int,
    *,
    config: DecoderConfig,
    chunk_size: int = 1024,
    label_rows: torch.Tensor | None = None,
    lm_head_loss: str = "checkpointed",
    row_owner: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final norm + LM head + cross-entropy, summed per adapter: ``[num_adapters]`` fp32.

    h ``[T, H]``, labels ``[T]`` (pre-shifted; IGNORE_INDEX = no target). Tokens outside every
    segment count for nobody. Logits exist for ``chunk_size`` tokens at a time; under autograd
    each chunk is checkpointed, so backward recomputes them instead of storing ``[T, V]``.
    Divide by the per-adapter label-token counts of the global batch to get mean losses.
    ``label_rows`` ``[n]`` int: the rows whose label is not IGNORE_INDEX, ascending (what
    ``Microbatch.label_rows`` holds, built on the host at packing); without it they are found
    with ``nonzero()``, a device->host sync. It is trusted, not checked (checking would sync).
    ``lm_head_loss``: "checkpointed" (backward recomputes each chunk's logits) or "fused"
    (``kernels.linear_cross_entropy``: the forward keeps the input gradient instead, one LM-head
    GEMM fewer; the final norm and LM head must be frozen). A family with a final logit
    soft-cap (Gemma 2) always takes the checkpointed path: the fused kernel has no soft-cap.
    ``row_owner`` ``[T]`` int64: each row's adapter (``num_adapters`` = nobody), given instead
    of ``segments`` (which are then ignored) by a CUDA graph that replays with new owners.
    """
    if lm_head_loss not in LM_HEAD_LOSSES:
        raise ConfigError(f"lm_head_loss={lm_head_loss!r}; allowed: {LM_HEAD_LOSSES}")
    t = h.shape[0]
    if labels.shape != (t,):
        raise ValueError(f"labels must be [{t}]; got {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if label_rows is not None and (label_rows.dim() != 1 or label_rows.shape[0] > t):
        raise ValueError(f"label_rows must be [n <= {t}] row indices; got {tuple(label_rows.shape)}")
    if row_owner is not None:
        if row_owner.shape != (t,):
            raise ValueError(f"row_owner must be [{t}]; got {tuple(row_owner.shape)}")
        owner = row_owner
    else:
        owner = torch.full((t,), num_adapters, dtype=torch.int64, device=h.device)  # last bucket: nobody
        for start, end, adapter in segments:
            if not 0 <= adapter < num_adapters:
                raise ValueError(f"segment adapter {adapter} out of range for {num_adapters} adapters")
            owner[start:end] = adapter
    sums = torch.zeros(num_adapters + 1, dtype=torch.float32, device=h.device)
    # Only label positions need logits: in instruction data most tokens are prompt, and the
    # LM head is the largest single GEMM of a small model. (Without label_rows: one host sync
    # for the count.)
    if label_rows is None:
        rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    else:
        rows = label_rows.to(device=h.device, dtype=torch.int64, non_blocking=True)
    h, labels, owner = h.index_select(0, rows), labels.index_select(0, rows), owner.index_select(0, rows)
    if lm_head_loss == "fused" and config.family.final_logit_softcap is not None:
        lm_head_loss = "checkpointed"  # the fused linear cross-entropy has no logit soft-cap
    if lm_head_loss == "fused":
        if params["norm"].requires_grad:
            raise ValueError("lm_head_loss='fused' gives the final norm no gradient; it must be frozen")
        pre = functools.partial(family_norm(config.family), weight=params["norm"], eps=config.rms_norm_eps)
        return linear_cross_entropy_sums(h, params["lm_head"], labels, owner, num_adapters,
                                         chunk_size=chunk_size, pre=pre, ignore_index=IGNORE_INDEX)
    use_ckpt = torch.is_grad_enabled() and h.requires_grad
    for c0 in range(0, h.shape[0], chunk_size):
        args = (h[c0:c0 + chunk_size], labels[c0:c0 + chunk_size], params["norm"], params["lm_head"],
                config.rms_norm_eps, config.family)
        losses = (checkpoint(_token_losses, *args, use_reentrant=False, preserve_rng_state=False) if use_ckpt
                  else _token_losses(*args))
        sums = sums.index_add(0, owner[c0:c0 + chunk_size], losses)
    return sums[:num_adapters]


def logits(
    params: Mapping[str, Any],
    bank_view: BankView | None,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    routing: LoraRouting | None,
    *,
    config: DecoderConfig,
    backend: str = "torch",
    options: DecoderOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """Whole model, ``input_ids [T] -> logits [T, V]`` (for tests and inference)."""
    h = embed(params, input_ids)
    h = decoder_layers(params, bank_view, h, position_ids, cu_seqlens, routing, config=config,
                       backend=backend, options=options)
    out = F.linear(family_norm(config.family)(h, params["norm"], config.rms_norm_eps), params["lm_head"])
    return soft_cap(out, config.family.final_logit_softcap)


def forward_loss_sums(
    params: Mapping[str, Any],
    bank_view: BankView | None,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    routing: LoraRouting,
    *,
    config: DecoderConfig,
    backend: str = "torch",
    chunk_size: int = 1024,
    max_seqlen: int | None = None,
    label_rows: torch.Tensor | None = None,
    lm_head_loss: str = "checkpointed",
    options: DecoderOptions = DEFAULT_OPTIONS,
    checkpoint_layers: bool | int = False,
) -> torch.Tensor:
    """Whole model on one packed microbatch: per-adapter summed loss ``[num_adapters]`` fp32.
    ``max_seqlen`` / ``label_rows``: the microbatch's host-built metadata, if known (no syncs);
    ``lm_head_loss``: see ``head_loss_sums``; ``options`` and ``checkpoint_layers``: see
    ``decoder_layers``."""
    h = embed(params, input_ids)
    h = decoder_layers(params, bank_view, h, position_ids, cu_seqlens, routing, config=config,
                       backend=backend, max_seqlen=max_seqlen, options=options,
                       checkpoint_layers=checkpoint_layers)
    return head_loss_sums(params, h, labels, routing.segments, routing.num_adapters, config=config,
                          chunk_size=chunk_size, label_rows=label_rows, lm_head_loss=lm_head_loss)
