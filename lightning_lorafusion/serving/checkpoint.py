"""Adapters read straight from a training checkpoint (a ``fit`` Lightning .ckpt) for serving."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..specs import ALL_TARGET_MODULES, ConfigError, LoraLayout

# state_dict keys of the adapter bank: bank.adapters.<adapter>.<layer>.<module>.lora_A|lora_B
# (and lora_magnitude for a DoRA adapter)
_BANK_KEY = re.compile(r"^bank\.adapters\.(\d+)\.(\d+)\.(\w+)\.(lora_A|lora_B|lora_magnitude)$")
WEIGHTS = ("best", "last")


@dataclass(frozen=True, kw_only=True)
class CheckpointAdapter:
    """One adapter of a checkpoint: ``factors[(layer, module)] = (lora_A [r, in], lora_B [out, r])``."""

    name: str
    rank: int
    alpha: float
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    weights: str  # "best" (best-val weights) or "last" (the bank's weights when saved)
    layout: LoraLayout | None = None  # rsLoRA, rank/alpha patterns, adapted layers (from its spec)
    magnitudes: dict[tuple[int, str], torch.Tensor] | None = None  # DoRA: per (layer, module) [out]


def read_checkpoint_adapters(ckpt_path: str | os.PathLike, names: Sequence[str] | None = None, *,
                             weights: str = "best") -> list[CheckpointAdapter]:
    """The adapters a ``fit`` checkpoint holds (``names``: a subset, in that order; default all).

    Reads what training resumes from: the adapter specs saved in ``hyper_parameters.adapters``
    and the bank's ``bank.adapters.<i>.<layer>.<module>.lora_A/B`` in ``state_dict``.
    ``weights="best"`` picks what ``export_adapters`` writes as ``<name>/``: an adapter's
    best-validation weights when it was validated, else its weights at the checkpoint;
    ``"last"`` always the weights at the checkpoint. Loaded with ``weights_only=True`` (no
    arbitrary unpickling; a ``fit`` checkpoint holds only tensors and plain data).
    """
    if weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r}; allowed: {WEIGHTS}")
    path = Path(ckpt_path)
    if not path.is_file():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist")
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    specs = (ckpt.get("hyper_parameters") or {}).get("adapters")
    state = ckpt.get("state_dict")
    if not isinstance(specs, list) or not isinstance(state, dict):
        raise ConfigError(f"{str(path)!r} is not a lightning-lorafusion training checkpoint "
                          "(no hyper_parameters.adapters / state_dict)")
    index = {spec["name"]: i for i, spec in enumerate(specs)}
    wanted = list(index) if names is None else list(names)
    unknown = [n for n in wanted if n not in index]
    if unknown:
        raise ConfigError(f"checkpoint {str(path)!r} has no adapter {unknown[0]!r}; it holds {list(index)}")
    best = (ckpt.get("lorafusion") or {}).get("best_weights", {}) if weights == "best" else {}
    by_adapter: dict[int, dict[tuple[int, str], dict[str, torch.Tensor]]] = {}
    for key, value in state.items():
        m = _BANK_KEY.match(key)
        if m:
            a, layer, module, factor = int(m[1]), int(m[2]), m[3], m[4]
            by_adapter.setdefault(a, {}).setdefault((layer, module), {})[factor] = value
    out = []
    for name in wanted:
        i = index[name]
        spec = specs[i]
        chosen = best.get(i)
        tensors = by_adapter.get(i, {})
        if chosen is not None:  # keys adapters.<i>.<layer>.<module>.lora_X (the bank's own names)
            tensors = {}
            for key, value in chosen.items():
                m = _BANK_KEY.match("bank." + key)
                if m:
                    tensors.setdefault((int(m[2]), m[3]), {})[m[4]] = value
        out.append(_adapter(name, spec, tensors, "best" if chosen is not None else "last", path))
    return out


def _adapter(name: str, spec: dict[str, Any], tensors: dict[tuple[int, str], dict[str, torch.Tensor]],
             weights: str, path: Path) -> CheckpointAdapter:
    where = f"adapter {name!r} of checkpoint {str(path)!r}"
    if not tensors:
        raise ConfigError(f"{where}: the checkpoint's state_dict holds no weights for it")
    rank = spec.get("rank")
    # a spec saved without target_modules: the projections its tensors cover
    targets = spec.get("target_modules") or tuple(m for m in ALL_TARGET_MODULES if any(lm[1] == m for lm in tensors))
    layout = LoraLayout(rank=rank, alpha=spec.get("alpha"), target_modules=tuple(targets),
                        use_rslora=spec.get("use_rslora", False), rank_pattern=spec.get("rank_pattern") or {},
                        alpha_pattern=spec.get("alpha_pattern") or {},
                        layers_to_transform=spec.get("layers_to_transform"),
                        layers_pattern=spec.get("layers_pattern"), owner=where)
    factors, magnitudes = {}, {}
    for lm, pair in tensors.items():
        if "lora_magnitude" in pair:
            magnitudes[lm] = pair.pop("lora_magnitude")
        if set(pair) != {"lora_A", "lora_B"}:
            raise ConfigError(f"{where}: layer {lm[0]} {lm[1]} lacks {sorted({'lora_A', 'lora_B'} - set(pair))}")
        a, b = pair["lora_A"], pair["lora_B"]
        r = layout.module_rank(*lm)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ConfigError(f"{where}: layer {lm[0]} {lm[1]} has lora_A {tuple(a.shape)}, lora_B "
                              f"{tuple(b.shape)}; its spec says rank {r}")
        factors[lm] = (a, b)
    if bool(spec.get("dora", False)) != bool(magnitudes) or (magnitudes and set(magnitudes) != set(factors)):
        raise ConfigError(f"{where}: its DoRA magnitudes do not match its spec (dora={spec.get('dora', False)})")
    return CheckpointAdapter(name=name, rank=int(rank), alpha=float(spec.get("alpha")), factors=factors,
                             weights=weights, layout=layout, magnitudes=magnitudes or None)
