"""DoRA adapters in the engine: the scale folded into B at load, and the frozen product of a DoRA
adapter's rows rescaled per output column in each step.

At inference DoRA's scale ``g = m / ||W + s B A||_row`` (``kernels/dora.py``) is a constant of the
adapter, and PEFT's forward is ``y = g * (x W^T) + bias + s (x A^T) (g * B)^T``. So an adapter is
stored with ``g * B`` in place of ``B`` (every LoRA kernel of the engine then adds the second
term as it is), and ``g [N]`` per (layer, projection) is kept beside it (``HostAdapter.dora_scales``,
host memory; a device copy is made on first use and kept with the adapter, outside the pool's
pages). In a step, each run of rows of one DoRA adapter gets its frozen product rescaled
(``apply_dora_rows``) before the LoRA terms are added: prefill and decode rows alike, in one
heterogeneous batch. Steps with DoRA rows run eagerly (no captured graph holds the rescale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Any, Iterable, Mapping

import torch

from ..kernels.dora import dora_row_norm
from ..model.decoder import frozen_weight


@torch.no_grad()
def fold_dora(factors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
              magnitudes: Mapping[tuple[int, str], torch.Tensor], params: Mapping[str, Any], *,
              scale: float | Callable[[int, str], float]) -> tuple[dict, dict]:
    """-> (factors with ``B`` replaced by ``g * B``, ``g`` per (layer, module) ``[N]`` fp32 on the
    host) for a DoRA adapter over the base ``params`` (the engine's pytree; an FP8 or NF4 weight
    is dequantized for its norms). ``scale``: the LoRA scale, or ``(layer, module) -> scale``
    for an adapter whose rsLoRA / alpha or rank patterns give its modules different scales."""
    folded, scales = {}, {}
    for key, (a, b) in factors.items():
        layer, module = key
        weight, _ = frozen_weight(params["layers"][layer][module])
        device = weight.device
        norm = dora_row_norm(weight, a.to(device), b.to(device), scale(layer, module) if callable(scale) else scale)
        g = (magnitudes[key].to(device, torch.float32) / norm).cpu()
        folded[key] = (a, (b.float() * g[:, None]).to(b.dtype))
        scales[key] = g
    return folded, scales


def _device_scales(adapter, device: torch.device, dtype: torch.dtype) -> dict:
    cached = getattr(adapter, "_dora_device", None)
    if cached is None or cached[0] != (device, dtype):
        cached = ((device, dtype), {k: g.to(device, dtype) for k, g in adapter.dora_scales.items()})
        adapter._dora_device = cached
    return cached[1]


@dataclass(frozen=True)
class DoraRows:
    """A step's rows of DoRA adapters: ``(start, end, g per (layer, module) [N])`` runs."""

    ranges: tuple[tuple[int, int, Mapping[tuple[int, str], torch.Tensor]], ...]


def step_dora_rows(rows: Iterable[tuple[int, int, Any]], device: torch.device, dtype: torch.dtype
                   ) -> DoraRows | None:
    """``rows``: (start, end, HostAdapter or None) of a step -> its ``DoraRows`` (None when no
    row has a DoRA adapter). Adjacent runs of one adapter are merged."""
    ranges: list[list] = []
    for start, end, adapter in sorted(rows, key=lambda r: r[0]):
        if adapter is None or adapter.dora_scales is None:
            continue
        if ranges and ranges[-1][1] == start and ranges[-1][3] == adapter.key:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, _device_scales(adapter, device, dtype), adapter.key])
    return DoraRows(tuple((s, e, g) for s, e, g, _ in ranges)) if ranges else None


def apply_dora_rows(outs: list[torch.Tensor], names: tuple[str, ...], layer: int, lp: Mapping[str, Any],
                    dora: DoraRows) -> None:
    """In place, before the LoRA terms are added: ``y = g * (y - bias) + bias`` on each DoRA run's
    rows of each projection ``names[i]`` (output ``outs[i]``) its adapter targets."""
    for start, end, scales in dora.ranges:
        for name, y in zip(names, outs):
            g = scales.get((layer, name))
            if g is None:
                continue
            rows = y[start:end]
            bias = lp[name].get("bias")
            if bias is None:
                rows.mul_(g)
            else:
                rows.sub_(bias).mul_(g).add_(bias)
