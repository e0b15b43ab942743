"""Seconds per pipeline action from FLOP and byte counts: the ``CostModel`` the pipeline simulator,
the partitioner and the strategy's bubble estimate share, and the shape helpers it is built from
(causal attention pairs with sliding windows, each layer's memory traffic, recomputed layers per
stage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


def causal_pairs(length: int, window: int | None = None) -> float:
    """Query-key pairs causal attention over one sample of ``length`` tokens visits, counted as
    ``length^2 / 2``; with a sliding ``window`` (each query sees its last ``window`` keys) the
    ``length - window`` later queries see ``window`` keys each: ``length * window - window^2 / 2``."""
    if window is None or length <= window:
        return length * length / 2
    return length * window - window * window / 2


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) of an HF config or a ``DecoderConfig``
    (Gemma 2/3's per-layer pattern, Mistral's and Phi-3's one window); all None when the config
    names none (or is neither, e.g. a bare namespace of shapes)."""
    layers = getattr(config, "num_hidden_layers", None) or config.num_layers
    if not hasattr(config, "sliding_windows") and getattr(config, "model_type", None) is not None:
        from ..model.decoder_config import DecoderConfig

        config = DecoderConfig.from_hf(config)
    windows = tuple(getattr(config, "sliding_windows", ()) or ())
    return windows if windows else (None,) * layers


# ``CostModel.timed``'s rates, for an H100 / H200 in bf16 (989 TFLOP/s dense peak, 3.35 / 4.8 TB/s
# HBM). A layer's projections run with the LoRA shrink/expand fused around them and k/v are narrow
# (1024 columns on the 8B shape): ~60% of peak; the LM head is one [tokens, 4096] x [4096, 128k]
# GEMM: ~80%. Memory-bound kernels reach ~3 TB/s. With these a Llama-8B-shaped layer's forward +
# backward is ~1.9 us per token: 32 layers ~16k tokens/s, near the single-device path's measured
# 14.5-15k (docs/parallel.md, "Stage split").
LAYER_GEMM_FLOPS = 600e12
HEAD_GEMM_FLOPS = 800e12
HBM_BYTES_PER_S = 3.0e12
# Share of tokens with a label (the LM head's rows) when the data is not at hand: completions are
# a minority of instruction and summarisation samples (the mixed synthetic workload: ~8%).
DEFAULT_LABEL_FRACTION = 0.25
# Memory-bound bytes per LM-head row and vocabulary entry in each pass over the logits (forward,
# recompute, backward): the cross-entropy writes and reads the row's fp32 logits a few times.
# With it the checkpointed head of the 8B shape costs 6.3 us per row forward + backward: 2 x H200
# under `fit` measured the last stage 4.5 ms per microbatch dearer than the first at 741 rows
# (the model had 2.9 ms without it; docs/BENCHMARKS.md, "Pipeline parallelism").
HEAD_BYTES_PER_VOCAB_ENTRY = 18.0
# Seconds of one adapter's optimizer step on a stage, as the device sees it (the host's AdamW,
# check of the new weights, zeroing, schedule and logging after the step's device read, with the
# device idle behind it). 2 x H200 under `fit`, 8B shape, 16 layers a stage: 9-10 ms with the
# fused AdamW and one read (15-26 ms before: multi-tensor AdamW, the weights' copy after the read).
OPTIMIZER_STEP_SECONDS = 0.0095
LM_HEAD_LOSSES = ("checkpointed", "fused")


def _shapes(config: Any) -> dict[str, int]:
    h = config.hidden_size
    heads = getattr(config, "num_attention_heads", None) or config.num_heads
    kv_heads = (getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
                or heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    return {"hidden": h, "q": heads * head_dim, "kv": kv_heads * head_dim, "inter": config.intermediate_size}


def layer_traffic_bytes(config: Any, *, lora_rank: int = 16, bytes_per_element: int = 2) -> float:
    """Bytes one decoder layer's memory-bound work moves per token in forward: two RMSNorms and
    two residual adds over ``[T, hidden]``, RoPE on q and k, SwiGLU (reads gate and up, writes
    one), attention's q/k/v reads and output write, and per LoRA projection (all seven) the shrink
    reading its input and writing ``[T, r]`` and the expand reading ``[T, r]`` and reading +
    writing ``[T, out]``."""
    s = _shapes(config)
    h, q, kv, inter, r = s["hidden"], s["q"], s["kv"], s["inter"], lora_rank
    projections = ((h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h))
    lora = sum(fan_in + 2 * r + 2 * fan_out for fan_in, fan_out in projections)
    elements = 2 * 2 * h + 2 * 3 * h + 2 * (q + kv) + 3 * inter + (2 * q + 2 * kv) + lora
    return float(elements * bytes_per_element)


def recomputed_per_stage(stage_layers: Sequence[int], checkpoint_layers: bool | int) -> tuple[int, ...]:
    """Per stage, its layers that recompute their forward in backward: ``checkpoint_layers``
    True is every layer, a count ``n`` the layers of global index < n (the decoder's rule), so
    the early stages recompute first. () when nothing is recomputed."""
    counts = [int(n) for n in stage_layers]
    below = sum(counts) if checkpoint_layers is True else int(checkpoint_layers or 0)
    if below <= 0:
        return ()
    out, start = [], 0
    for n in counts:
        out.append(max(0, min(n, below - start)))
        start += n
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Seconds per action on each stage of a pipeline, from FLOP counts.

    A stage with ``L`` decoder layers spends, on a microbatch of ``tokens`` tokens whose samples
    have squared lengths summing to ``seq_sq``,
    ``L * (layer_flops_per_token * tokens + attention_flops_per_pair * seq_sq / 2) / flops_per_second``
    in forward (causal attention visits about ``len^2 / 2`` query-key pairs per sample; with
    ``stage_windows``, each layer's sliding window, a windowed layer visits ``causal_pairs(len,
    window)`` per sample, from the samples' lengths); the last
    stage adds ``head_flops_per_token * tokens`` (norm, LM head, loss). Backward costs
    ``backward_factor`` times forward: the base is frozen, so backward computes input
    gradients only (one GEMM per forward GEMM) plus rank-r LoRA gradients; attention backward is
    dearer, hence the default slightly above 1. Every compute action also pays
    ``launch_overhead`` seconds. A P2P message of a microbatch costs
    ``p2p_latency + capacity * bytes_per_token / p2p_bandwidth`` (shapes are static).

    Time terms (zero in the FLOPs-only model, set by ``timed``): each layer also moves
    ``layer_bytes_per_token`` and the last stage ``head_bytes_per_token`` at
    ``memory_bandwidth``; the head's GEMM runs on ``head_token_fraction`` of the tokens (the
    labelled rows) at ``head_flops_per_second`` (0: ``flops_per_second``), and its backward costs
    ``head_backward_factor`` times its forward (None: ``backward_factor``).
    """

    stage_layers: tuple[int, ...]
    layer_flops_per_token: float
    attention_flops_per_pair: float = 0.0
    head_flops_per_token: float = 0.0
    flops_per_second: float = 400e12
    backward_factor: float = 1.2
    launch_overhead: float = 0.0
    optimizer_step_time: float = 0.0
    p2p_latency: float = 20e-6
    bytes_per_token: float = 0.0
    p2p_bandwidth: float = 100e9
    stage_windows: tuple[tuple[int | None, ...], ...] = ()  # per stage, each layer's window; (): none
    # time terms (``CostModel.timed``): memory-bound traffic at ``memory_bandwidth`` bytes/s, the
    # LM head's GEMM on the labelled fraction of tokens only, at its own rate (0: flops_per_second)
    layer_bytes_per_token: float = 0.0
    head_bytes_per_token: float = 0.0
    memory_bandwidth: float = 3.0e12
    head_token_fraction: float = 1.0
    head_flops_per_second: float = 0.0
    head_backward_factor: float | None = None  # None: backward_factor
    # memory-bound bytes per LM-head row in forward (the row's fp32 logits written and read by
    # the cross-entropy), at ``memory_bandwidth``; backward: ``head_backward_factor`` times
    head_row_bytes: float = 0.0
    # per stage, how many of its layers recompute their forward in backward (activation
    # checkpointing, ``recomputed_per_stage``); (): none
    stage_recomputed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.stage_layers or any(n < 0 for n in self.stage_layers):
            raise ValueError(
                f"stage_layers={self.stage_layers!r} must list a non-negative layer count per stage"
            )
        if self.stage_windows and [len(w) for w in self.stage_windows] != list(self.stage_layers):
            raise ValueError(f"CostModel.stage_windows has {[len(w) for w in self.stage_windows]} layers per "
                             f"stage; stage_layers={self.stage_layers!r}: one window (or None) per layer")
        for name in ("flops_per_second", "p2p_bandwidth", "memory_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostModel.{name}={getattr(self, name)} must be > 0")
        for name in ("layer_flops_per_token", "attention_flops_per_pair", "head_flops_per_token",
                     "backward_factor", "launch_overhead", "optimizer_step_time", "p2p_latency",
                     "bytes_per_token", "layer_bytes_per_token", "head_bytes_per_token",
                     "head_flops_per_second", "head_row_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name}={getattr(self, name)} must be >= 0")
        if not 0.0 <= self.head_token_fraction <= 1.0:
            raise ValueError(f"CostModel.head_token_fraction={self.head_token_fraction} must be in [0, 1]")
        if self.head_backward_factor is not None and self.head_backward_factor < 0:
            raise ValueError(f"CostModel.head_backward_factor={self.head_backward_factor} must be >= 0")
        if self.stage_recomputed and (len(self.stage_recomputed) != len(self.stage_layers) or any(
                not 0 <= r <= n for r, n in zip(self.stage_recomputed, self.stage_layers))):
            raise ValueError(f"CostModel.stage_recomputed={self.stage_recomputed!r} must give 0..layers "
                             f"recomputed layers for each stage of stage_layers={self.stage_layers!r}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @classmethod
    def from_decoder_config(
        cls,
        config: Any,
        stage_layers: Sequence[int],
        *,
        bytes_per_element: int = 2,
        **overrides: Any,
    ) -> "CostModel":
        """Analytic costs of a Llama-family decoder: an HF config (``hidden_size``,
        ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
        ``vocab_size``) or the project's ``DecoderConfig`` (``num_heads``, ``num_kv_heads``);
        multiply-adds count 2 FLOPs."""
        h = config.hidden_size
        heads = getattr(config, "num_attention_heads", None) or config.num_heads
        kv_heads = (getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
                    or heads)
        head_dim = getattr(config, "head_dim", None) or h // heads
        try:
            windows = layer_windows(config)
        except AttributeError:  # a bare namespace of shapes: no layer count, no windows
            windows = ()
        counts = [int(n) for n in stage_layers]
        stage_windows: tuple[tuple[int | None, ...], ...] = ()
        if any(w is not None for w in windows) and sum(counts) == len(windows):
            bounds = [sum(counts[:s]) for s in range(len(counts) + 1)]
            stage_windows = tuple(tuple(windows[bounds[s]:bounds[s + 1]]) for s in range(len(counts)))
        linear_params = (
            h * heads * head_dim * 2  # q_proj, o_proj
            + h * kv_heads * head_dim * 2  # k_proj, v_proj
            + 3 * h * config.intermediate_size  # gate, up, down
        )
        computed = dict(
            layer_flops_per_token=2.0 * linear_params,
            attention_flops_per_pair=4.0 * heads * head_dim,  # QK^T and PV
            head_flops_per_token=2.0 * h * config.vocab_size,
            bytes_per_token=float(h * bytes_per_element),
            stage_windows=stage_windows,
        )
        return cls(stage_layers=tuple(int(n) for n in stage_layers), **{**computed, **overrides})

    @classmethod
    def timed(
        cls,
        config: Any,
        stage_layers: Sequence[int],
        *,
        label_fraction: float = DEFAULT_LABEL_FRACTION,
        lora_rank: int = 16,
        bytes_per_element: int = 2,
        checkpoint_layers: bool | int = False,
        lm_head_loss: str = "checkpointed",
        **overrides: Any,
    ) -> "CostModel":
        """Seconds, not FLOPs: ``from_decoder_config``'s GEMM FLOPs at ``LAYER_GEMM_FLOPS`` (a
        layer's projections with the LoRA kernels fused around them) and ``HEAD_GEMM_FLOPS`` (the
        LM head, one large GEMM), plus each layer's memory-bound traffic (``layer_traffic_bytes``)
        at ``HBM_BYTES_PER_S``. The LM head runs on the labelled rows only
        (``decoder.head_loss_sums``): ``label_fraction`` of the tokens (or the simulation's
        ``head_rows``), each pass over a row's logits also moving ``HEAD_BYTES_PER_VOCAB_ENTRY``
        bytes per vocabulary entry. ``lm_head_loss`` (the module's): "checkpointed" (forward one
        logits GEMM; backward recomputes it and forms the input gradient: two) or "fused" (both
        GEMMs in the forward, the backward only scales the kept gradient). Each optimizer step
        costs ``OPTIMIZER_STEP_SECONDS``. ``checkpoint_layers`` (the module's
        ``activation_checkpointing``): layers that run their forward again in backward
        (``recomputed_per_stage``). ``overrides`` replace any field."""
        if lm_head_loss not in LM_HEAD_LOSSES:
            raise ValueError(f"lm_head_loss={lm_head_loss!r}; allowed: {LM_HEAD_LOSSES}")
        shapes = _shapes(config)
        passes = 2.0 if lm_head_loss == "fused" else 1.0  # logits passes in the forward
        defaults = dict(
            flops_per_second=LAYER_GEMM_FLOPS, head_flops_per_second=HEAD_GEMM_FLOPS,
            memory_bandwidth=HBM_BYTES_PER_S, head_token_fraction=float(label_fraction),
            head_backward_factor=0.0 if lm_head_loss == "fused" else 2.0,
            head_flops_per_token=passes * 2.0 * shapes["hidden"] * config.vocab_size,
            head_row_bytes=passes * HEAD_BYTES_PER_VOCAB_ENTRY * config.vocab_size,
            optimizer_step_time=OPTIMIZER_STEP_SECONDS,
            layer_bytes_per_token=layer_traffic_bytes(config, lora_rank=lora_rank,
                                                      bytes_per_element=bytes_per_element),
            head_bytes_per_token=float(4 * shapes["hidden"] * bytes_per_element),  # final norm: read + write
            stage_recomputed=recomputed_per_stage(stage_layers, checkpoint_layers),
        )
        return cls.from_decoder_config(config, stage_layers, bytes_per_element=bytes_per_element,
                                       **{**defaults, **overrides})

    def layer_time_per_token(self) -> float:
        """Forward + backward seconds of one decoder layer per token, attention left out (the
        partition's unit: attention depends on the samples, and is the same for every layer)."""
        forward = self.layer_flops_per_token / self.flops_per_second + self.layer_bytes_per_token / self.memory_bandwidth
        return (1.0 + self.backward_factor) * forward

    def recompute_factor(self) -> float:
        """A recomputed layer's forward + backward over a plain layer's: one forward more."""
        return (2.0 + self.backward_factor) / (1.0 + self.backward_factor)

    def head_time_per_token(self) -> float:
        """Forward + backward seconds of the final norm, LM head and loss per token."""
        head_rate = self.head_flops_per_second or self.flops_per_second
        back = self.backward_factor if self.head_backward_factor is None else self.head_backward_factor
        gemm = self.head_token_fraction * (self.head_flops_per_token / head_rate
                                           + self.head_row_bytes / self.memory_bandwidth)
        norm = self.head_bytes_per_token / self.memory_bandwidth
        return (1.0 + back) * gemm + (1.0 + self.backward_factor) * norm

    def attention_pairs(self, stage: int, seq_sq: int, lengths: Sequence[int] | None = None) -> float:
        """Query-key pairs the stage's layers visit on a microbatch: ``seq_sq / 2`` per layer, or
        with windowed layers (and the samples' ``lengths``) ``causal_pairs`` per layer and sample."""
        windows = self.stage_windows[stage] if self.stage_windows else ()
        if lengths is None or all(w is None for w in windows):
            return self.stage_layers[stage] * seq_sq / 2
        return sum(causal_pairs(n, w) for w in windows for n in lengths)

    def _layers_body(self, stage: int, tokens: int, seq_sq: int, lengths: Sequence[int] | None) -> float:
        """Forward seconds of the stage's decoder layers."""
        layers = self.stage_layers[stage]
        flops = (layers * self.layer_flops_per_token * tokens
                 + self.attention_flops_per_pair * self.attention_pairs(stage, seq_sq, lengths))
        return flops / self.flops_per_second + layers * self.layer_bytes_per_token * tokens / self.memory_bandwidth

    def _layers_and_head(self, stage: int, tokens: int, seq_sq: int, lengths: Sequence[int] | None,
                         head_rows: int | None = None) -> tuple[float, float]:
        """Forward seconds of the stage's layers and of its head (0 before the last stage); the
        head's GEMM runs on ``head_rows`` rows when given, else on ``head_token_fraction`` of
        the tokens."""
        body = self._layers_body(stage, tokens, seq_sq, lengths)
        if stage != self.num_stages - 1:
            return body, 0.0
        head_rate = self.head_flops_per_second or self.flops_per_second
        rows = self.head_token_fraction * tokens if head_rows is None else head_rows
        gemm = rows * (self.head_flops_per_token / head_rate + self.head_row_bytes / self.memory_bandwidth)
        return body + self.head_bytes_per_token * tokens / self.memory_bandwidth, gemm

    def forward_time(self, stage: int, tokens: int, seq_sq: int = 0, lengths: Sequence[int] | None = None,
                     head_rows: int | None = None) -> float:
        body, head = self._layers_and_head(stage, tokens, seq_sq, lengths, head_rows)
        return self.launch_overhead + body + head

    def backward_time(self, stage: int, tokens: int, seq_sq: int = 0, lengths: Sequence[int] | None = None,
                      head_rows: int | None = None) -> float:
        body, head = self._layers_and_head(stage, tokens, seq_sq, lengths, head_rows)
        back = self.backward_factor if self.head_backward_factor is None else self.head_backward_factor
        recompute = 0.0
        if self.stage_recomputed and self.stage_recomputed[stage]:  # their forward again, before backward
            share = self.stage_recomputed[stage] / self.stage_layers[stage]
            recompute = share * self._layers_body(stage, tokens, seq_sq, lengths)
        return self.launch_overhead + self.backward_factor * body + back * head + recompute

    def p2p_time(self, capacity: int) -> float:
        return self.p2p_latency + capacity * self.bytes_per_token / self.p2p_bandwidth
