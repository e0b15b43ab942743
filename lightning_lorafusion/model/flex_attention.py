"""Soft-capped packed causal attention through FlexAttention (Gemma 2's attention-logit cap).

FlashAttention's varlen kernel has no soft-cap, so without this path a soft-capped family trains
through the per-sequence reference loop (``attention.sdpa_varlen_loop``): one materialised
``[heads, L, L]`` score matrix per sample and host reads of the block boundaries, which also keep
the training step out of CUDA graphs. Here the cap is a FlexAttention ``score_mod``
(``C * tanh(s / C)``) and the packing a ``mask_mod``: a query sees keys of its own sample (the
sample id of each row from ``cu_seqlens``, on the device), at or before it, within the sliding
window if any. ``torch.compile`` turns both into one fused Triton kernel with its backward.

Rows past ``cu_seqlens[-1]`` (padding up to the capacity) form one extra "sample" and attend among
themselves; their outputs carry no loss. CPU: FlexAttention has no backward there, so training
on a CPU keeps the reference loop; the forward here runs uncompiled on a CPU for tests.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_compiled = None
_failed: str | None = None  # set after a failure: later calls take the caller's fallback


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return create_block_mask, flex_attention


def _compiled_flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_flex()[1], dynamic=False)
    return _compiled


def sample_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int: the index of the ``cu_seqlens`` block each row belongs to (rows past the
    last boundary get the block count: padding); computed on the device, no host reads."""
    rows = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True)


def _give_up(e: Exception) -> None:
    """Remember why FlexAttention cannot run here (logged once); re-raise inside a CUDA-graph
    capture, which must fail (the step then runs eagerly)."""
    global _failed
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise e
    _failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    log.warning("soft-capped attention through FlexAttention failed (%s); the reference loop runs", _failed)


def _block_mask(create_block_mask, cu_seqlens: torch.Tensor, total: int, sliding_window: int | None):
    doc = sample_ids(cu_seqlens, total)
    if sliding_window is None:
        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi)
    else:
        window = int(sliding_window)

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi) & (qi - ki < window)

    return create_block_mask(mask_mod, None, None, total, total, device=cu_seqlens.device)


def _available():
    """``(create_block_mask, flex_attention)``, or None (the reason logged once)."""
    global _failed
    if _failed is not None:
        return None
    try:
        return _flex()
    except ImportError as e:
        _failed = f"no FlexAttention in this torch ({e})"
        log.warning("soft-capped attention: %s; the reference loop runs", _failed)
        return None


def softcap_block_masks(cu_seqlens: torch.Tensor, total: int, windows) -> dict | None:
    """The packing masks of one forward, by sliding window (None: full causal), built once so
    that every layer reuses them (``decoder_layers``); None when FlexAttention cannot run."""
    flex = _available()
    if flex is None:
        return None
    try:
        return {w: _block_mask(flex[0], cu_seqlens, total, w) for w in windows}
    except Exception as e:  # noqa: BLE001 - see flex_softcap_attention
        _give_up(e)
        return None


def flex_softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                           scale: float, softcap: float, sliding_window: int | None = None,
                           compiled: bool = True, block_mask=None) -> torch.Tensor | None:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``, or None when FlexAttention is not
    available here or failed before (the reason is logged once; the caller falls back).
    ``block_mask``: this forward's mask for ``sliding_window`` from ``softcap_block_masks`` (else
    built here)."""
    flex = _available()
    if flex is None:
        return None
    create_block_mask, flex_attention = flex
    total = q.shape[0]
    cap = float(softcap)

    def score_mod(score, b, h, qi, ki):
        return cap * torch.tanh(score / cap)

    fn = _compiled_flex() if compiled else flex_attention
    try:
        if block_mask is None:
            block_mask = _block_mask(create_block_mask, cu_seqlens.to(device=q.device), total, sliding_window)
        out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                 score_mod=score_mod, block_mask=block_mask, scale=scale,
                 enable_gqa=q.shape[1] != k.shape[1])
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: keep training on the reference
        _give_up(e)
        return None
    return out[0].transpose(0, 1)
