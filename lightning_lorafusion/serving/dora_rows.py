"""DoRA adapters in the engine: the scale folded into B at load, and the frozen product of a DoRA
adapter's rows rescaled per output column in each step.

At inference DoRA's scale ``g = m / ||W + s B A||_row`` (``kernels/dora.py``) is a constant of the
adapter, and PEFT's forward is ``y = g * (x W^T) + bias + s (x A^T) (g * B)^T``. So an adapter is
stored with ``g * B`` in place of ``B`` (every LoRA kernel of the engine then adds the second
term as it is), and ``g [N]`` per (layer, projection) is kept beside it (``HostAdapter.dora_scales``,
host memory; a device copy is made on first use and kept with the adapter, outside the pool's
pages). In a step, each run of rows of one DoRA adapter gets its frozen product rescaled
(``apply_dora_rows``) before the LoRA terms are added: prefill and decode rows alike, in one
heterogeneous batch.

Graph-shaped steps (decode steps padded to a batch bucket, replayed as CUDA graphs; mixed steps
padded to a token bucket, run as captured pieces) cannot take row ranges from the host: there
each row reads its gain from a fixed-shape table instead (``DoraSlots``: per projection
``[layers, slots + 1, N]``, slot 0 all ones for plain-LoRA, base and padding rows, one slot per
DoRA adapter of the step's rows, written when it takes the slot) through a per-row slot index
on the device (``DoraSlotRows``). A step whose rows hold more DoRA adapters than there are
slots runs eagerly, with row ranges.

A fused projection (Phi-3's ``qkv_proj`` / ``gate_up_proj``) has one magnitude over its fused
output in PEFT; its gains are computed per fused row and split by member rows (``fold_dora``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..kernels.dora import dora_row_norm
from ..model.decoder import DecoderConfig, frozen_weight
from ..specs import ALL_TARGET_MODULES
from .fused_weights import FUSED_PROJECTIONS

DORA_GRAPH_SLOTS = 8  # DoRA adapters one graph-shaped step holds; a step with more runs eagerly


@torch.no_grad()
def fold_dora(factors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
              magnitudes: Mapping[tuple[int, str], torch.Tensor], params: Mapping[str, Any], *,
              scale: float | Callable[[int, str], float], config: DecoderConfig) -> tuple[dict, dict]:
    """-> (factors with ``B`` replaced by ``g * B``, ``g`` per (layer, module) ``[N]`` fp32 on the
    host) for a DoRA adapter over the base ``params`` (the engine's pytree; an FP8 or NF4 weight
    is dequantized for its norms). ``scale``: the LoRA scale, or ``(layer, module) -> scale``
    for an adapter whose rsLoRA / alpha or rank patterns give its modules different scales.

    A fused projection (Phi-3's ``qkv_proj`` / ``gate_up_proj``, PEFT's one magnitude over the
    fused output) is normalised per fused row against the fused weight, as PEFT does; its
    ``g`` is then split by member rows (``q_proj``, ``k_proj``, ...), the way the pool splits
    ``g * B`` (``adapters.split_fused_factors``) and the engine's forward splits the product."""
    folded, scales = {}, {}
    for key, (a, b) in factors.items():
        layer, module = key
        weight, _ = frozen_weight(params["layers"][layer][module])
        device = weight.device
        norm = dora_row_norm(weight, a.to(device), b.to(device), scale(layer, module) if callable(scale) else scale)
        g = (magnitudes[key].to(device, torch.float32) / norm).cpu()
        folded[key] = (a, (b.float() * g[:, None]).to(b.dtype))
        members = FUSED_PROJECTIONS.get(module)
        if members is None:
            scales[key] = g
            continue
        for member, part in zip(members, g.split([config.module_dims(m)[1] for m in members])):
            scales[(layer, member)] = part.clone()
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


class DoraSlots:
    """The DoRA gains of graph-shaped steps at fixed addresses: ``gains[module]``
    ``[layers, slots + 1, N]`` in the pool's dtype (slot 0 all ones), and ``row_slot``
    ``[max_rows]`` int64, each decode row's slot (0 for rows of no DoRA adapter and padding).
    An adapter keeps its slot while it has rows, and after until the slot is needed."""

    def __init__(self, config: DecoderConfig, *, max_rows: int, device: torch.device, dtype: torch.dtype,
                 slots: int = DORA_GRAPH_SLOTS) -> None:
        self.num_slots, self.device, self.dtype = slots, device, dtype
        self.gains = {m: torch.ones(config.num_layers, slots + 1, config.module_dims(m)[1], dtype=dtype,
                                    device=device) for m in ALL_TARGET_MODULES}
        self.row_slot = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._slot_of: dict[int, int] = {}  # adapter key -> its slot (1..slots)
        self.version = 0

    def assign(self, adapters: Iterable[Any]) -> dict[int, int] | None:
        """Slots for the DoRA adapters among ``adapters`` (HostAdapters or None): -> adapter key
        -> slot, the gains of adapters new to a slot written; None, nothing changed, when they
        outnumber the slots. ``version`` counts the changes."""
        dora = {a.key: a for a in adapters if a is not None and a.dora_scales is not None}
        if len(dora) > self.num_slots:
            return None
        taken = set(self._slot_of.values())
        free = [s for s in range(1, self.num_slots + 1) if s not in taken]
        idle = [k for k in self._slot_of if k not in dora]
        for key, adapter in dora.items():
            if key in self._slot_of:
                continue
            slot = free.pop() if free else self._slot_of.pop(idle.pop())
            for g in self.gains.values():
                g[:, slot].fill_(1.0)  # modules the adapter leaves alone
            for (layer, module), g in _device_scales(adapter, self.device, self.dtype).items():
                self.gains[module][layer, slot].copy_(g)
            self._slot_of[key] = slot
            self.version += 1
        return {key: self._slot_of[key] for key in dora}

    def load(self, adapters: Sequence[Any]) -> bool:
        """``adapters``: each decode row's HostAdapter (or None), in row order -> True after
        writing ``row_slot`` (``assign`` first); False, nothing written, when their DoRA adapters
        outnumber the slots."""
        slot_of = self.assign(adapters)
        if slot_of is None:
            return False
        index = [0 if a is None else slot_of.get(a.key, 0) for a in adapters]
        self.row_slot.zero_()
        if index:
            self.row_slot[:len(index)].copy_(torch.tensor(index, dtype=torch.int64), non_blocking=True)
        return True

    def step_rows(self, runs: Iterable[tuple[int, int, Any]], num_rows: int) -> "DoraSlotRows | None":
        """``runs``: (start, end, HostAdapter or None) of a padded step of ``num_rows`` rows ->
        its ``DoraSlotRows`` over every row (a fresh index tensor); None when its DoRA adapters
        outnumber the slots."""
        runs = list(runs)
        slot_of = self.assign(a for _, _, a in runs)
        if slot_of is None:
            return None
        index = torch.zeros(num_rows, dtype=torch.int64)
        for start, end, adapter in runs:
            if adapter is not None and adapter.key in slot_of:
                index[start:end] = slot_of[adapter.key]
        return DoraSlotRows(self, 0, num_rows, index.to(self.device, non_blocking=True))


@dataclass(frozen=True)
class DoraSlotRows:
    """A graph-shaped step's DoRA: rows ``[first_row, first_row + rows)`` take their gains from
    ``slots`` by ``index`` ``[rows]`` int64 on the device (each row's slot; the same launches
    for any mix of adapters)."""

    slots: DoraSlots
    first_row: int
    rows: int
    index: torch.Tensor


def apply_dora_rows(outs: list[torch.Tensor], names: tuple[str, ...], layer: int,
                    biases: Sequence[torch.Tensor | None], dora: DoraRows | DoraSlotRows) -> None:
    """In place, before the LoRA terms are added: ``y = g * (y - bias) + bias`` on each DoRA run's
    rows of each projection ``names[i]`` (output ``outs[i]``, bias ``biases[i]``: a fused
    projection's columns of its bias) its adapter targets; with
    ``DoraSlotRows`` on every row of the range, ``y + (g - 1) * (y - bias)`` (rows of gain one
    are left exactly as they are)."""
    if isinstance(dora, DoraSlotRows):
        index = dora.index
        for name, y, bias in zip(names, outs, biases):
            rows = y[dora.first_row:dora.first_row + dora.rows]
            gain = dora.slots.gains[name][layer].index_select(0, index)
            if bias is None:
                rows.mul_(gain)
            else:
                rows.add_((rows - bias) * (gain - 1.0))
        return
    for start, end, scales in dora.ranges:
        for name, y, bias in zip(names, outs, biases):
            g = scales.get((layer, name))
            if g is None:
                continue
            rows = y[start:end]
            if bias is None:
                rows.mul_(g)
            else:
                rows.sub_(bias).mul_(g).add_(bias)
