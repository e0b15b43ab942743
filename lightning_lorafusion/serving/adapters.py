"""LoRA adapters for serving: PEFT directories read into one flat host buffer in the pool's layout."""

from __future__ import annotations

import itertools
import math
import os
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..model.decoder import DecoderConfig
from ..model.peft_io import peft_key, peft_layout, peft_magnitude_key, read_peft_adapter
from ..specs import ALL_TARGET_MODULES, ConfigError, LoraLayout
from .fused_weights import FUSED_PROJECTIONS

# Matrices start at multiples of this many elements inside an adapter's run of pages, so the
# kernels' vector loads stay aligned (16 elements = 32 bytes in half precision).
ALIGN = 16
_KEYS = itertools.count()


class UnknownAdapterError(KeyError):
    """A request named an adapter the engine does not have."""

    def __init__(self, name: str, known: list[str] | None = None) -> None:
        self.name, self.known = name, known
        hint = f"; loaded adapters: {sorted(known)}" if known is not None else ""
        super().__init__(f"unknown adapter {name!r}{hint}")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])

    def __reduce__(self):  # pickled by its arguments (it crosses from the engine process)
        return type(self), (self.name, self.known)


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine reports about one loaded adapter."""

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    path: str | None
    resident: bool  # its weights are in the GPU pool now
    version: int = 1  # 1 when first loaded under its name; each in-place update adds one


@dataclass(frozen=True)
class MatrixSlot:
    """Where one projection's factors sit, in elements from the adapter's first element:
    ``A [rank, in_features]`` at ``a``, ``B^T [rank, out_features]`` at ``b``."""

    a: int
    b: int
    in_features: int
    out_features: int


class HostAdapter:
    """One adapter's weights in host memory (pinned when serving on CUDA), laid out exactly as
    its run of pool pages will hold them: per (layer, module), ``A`` then ``B`` transposed, so
    each rank vector is contiguous for the decode gather kernel.

    The kernels take one rank per (adapter, module) and one scale per adapter:
    ``module_ranks`` (default ``rank`` for every target) and ``scale`` (default alpha / rank).
    ``rank`` is the largest module rank."""

    def __init__(self, *, name: str, rank: int, alpha: float, target_modules: tuple[str, ...],
                 slots: dict[tuple[int, str], MatrixSlot], flat: torch.Tensor, num_layers: int,
                 path: str | None = None, scale: float | None = None,
                 module_ranks: dict[str, int] | None = None) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"adapter {name!r}: rank={rank!r} must be an integer >= 1")
        if not math.isfinite(float(alpha)) or float(alpha) <= 0:
            raise ConfigError(f"adapter {name!r}: alpha={alpha!r} must be finite and > 0; it was not loaded")
        self.key = next(_KEYS)  # unique per load: a re-added name is a different adapter
        self.version = 1  # set by the engine's registry (its count of loads under this name)
        self.name, self.rank, self.alpha, self.path = name, rank, float(alpha), path
        self.target_modules = target_modules
        self.scale = self.alpha / rank if scale is None else float(scale)
        ranks = {m: rank for m in target_modules} if module_ranks is None else dict(module_ranks)
        self.slots = slots
        self.flat = flat
        # [layers, modules, 2] element offsets (A, B^T) for the decode kernel; 0 where untargeted
        rel = torch.zeros(num_layers, len(ALL_TARGET_MODULES), 2, dtype=torch.int64)
        for (layer, module), s in slots.items():
            rel[layer, ALL_TARGET_MODULES.index(module)] = torch.tensor([s.a, s.b])
        self.relative_offsets = rel
        self.module_ranks = torch.tensor([ranks.get(m, 0) for m in ALL_TARGET_MODULES], dtype=torch.int32)
        # DoRA: g [N] fp32 per (layer, module), B stored as g * B (serving/dora_rows.py); None: LoRA
        self.dora_scales: dict[tuple[int, str], torch.Tensor] | None = None

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def check_finite(self) -> None:
        """Refuse weights with NaN or infinite values (a diverged run's export): a ConfigError
        naming the adapter, the first such projection and how many values are bad."""
        if bool(torch.isfinite(self.flat).all()):
            return
        bad = int((~torch.isfinite(self.flat)).sum())
        for (layer, module), s in sorted(self.slots.items()):
            r = int(self.module_ranks[ALL_TARGET_MODULES.index(module)])
            for which, start, size in (("lora_A", s.a, r * s.in_features), ("lora_B", s.b, r * s.out_features)):
                if not bool(torch.isfinite(self.flat[start:start + size]).all()):
                    raise ConfigError(f"adapter {self.name!r}: {bad} NaN or infinite weights, the first in layer "
                                      f"{layer} {module} {which}; it was not loaded")
        raise ConfigError(f"adapter {self.name!r}: {bad} NaN or infinite weights; it was not loaded")

    def info(self, resident: bool) -> AdapterInfo:
        return AdapterInfo(self.name, self.rank, self.alpha, self.target_modules, self.path, resident,
                           self.version)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _matrix_elems(rank: int, in_features: int, out_features: int) -> int:
    """Elements one (layer, module) takes in an adapter's flat layout: aligned A, aligned B^T."""
    return _aligned(rank * in_features) + _aligned(rank * out_features)


def adapter_numel(config: DecoderConfig, rank: int, target_modules: tuple[str, ...] | list[str],
                  layout: LoraLayout | None = None) -> int:
    """Elements of a ``HostAdapter``'s flat buffer (every layer of each target module), before
    building it: what sizing a pool for known adapters needs. ``layout`` (rank patterns, adapted
    layers) overrides ``rank`` and ``target_modules``. A fused projection (Phi-3's ``qkv_proj``)
    counts as its members, as ``split_fused_factors`` holds it."""
    if layout is None:
        members = [m for t in target_modules for m in FUSED_PROJECTIONS.get(t, (t,))]
        return config.num_layers * sum(_matrix_elems(rank, *config.module_dims(m)) for m in members)
    ranks, shared = _module_ranks(member_layout(layout), config)
    return sum(_matrix_elems(r, *config.module_dims(m)) * (len(layers) + (m in shared))
               for m, (r, layers) in ranks.items())


def member_layout(layout: LoraLayout) -> LoraLayout:
    """``layout`` with each fused projection (Phi-3's ``qkv_proj`` / ``gate_up_proj``) replaced by
    its members, which is how the pool holds it. Rank and alpha patterns name modules, so they
    cannot follow the split: such an adapter on a fused projection is refused."""
    fused = [m for m in layout.target_modules if m in FUSED_PROJECTIONS]
    if not fused:
        return layout
    if layout.rank_pattern or layout.alpha_pattern:
        raise ConfigError(f"{layout.owner}: rank_pattern / alpha_pattern on the fused projection(s) {fused} "
                          "are not served yet; serve it without patterns or on a base with separate projections")
    members = tuple(m for t in layout.target_modules for m in FUSED_PROJECTIONS.get(t, (t,)))
    return dataclasses.replace(layout, target_modules=members)


def _module_ranks(layout: LoraLayout, config: DecoderConfig) -> tuple[dict[str, tuple[int, list[int]]], set[str]]:
    """Per target module: (its largest rank over layers, the layers it adapts); and the modules
    some layer leaves unadapted (they get one shared zero slot)."""
    pairs = layout.adapted(config.num_layers)
    out: dict[str, tuple[int, list[int]]] = {}
    for m in ALL_TARGET_MODULES:
        layers = [layer for layer, mod in pairs if mod == m]
        if layers:
            out[m] = (max(layout.module_rank(layer, m) for layer in layers), layers)
    return out, {m for m, (_, layers) in out.items() if len(layers) < config.num_layers}


def split_fused_factors(name: str, factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                        config: DecoderConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """LoRA on a fused projection (Phi-3's ``qkv_proj`` / ``gate_up_proj``: one A, a B over all
    members' outputs, as PEFT and training hold it) as LoRA on its members: each keeps A and
    takes its rows of B, the same product. The pool and the kernels hold per-member factors."""
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in factors.items():
        members = FUSED_PROJECTIONS.get(module)
        if members is None:
            out[(layer, module)] = (a, b)
            continue
        sizes = [config.module_dims(m)[1] for m in members]
        if b.dim() != 2 or b.shape[0] != sum(sizes):
            raise ConfigError(f"adapter {name!r}: layer {layer} {module} has lora_B {tuple(b.shape)}; this base "
                              f"needs [{sum(sizes)}, rank] (was the adapter trained on another base model?)")
        for member, part in zip(members, b.split(sizes)):
            if (layer, member) in factors:
                raise ConfigError(f"adapter {name!r} targets both {module} and its part {member}; keep one")
            out[(layer, member)] = (a, part)
    return out


def host_adapter_from_factors(name: str, factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                              *, rank: int, alpha: float, config: DecoderConfig, dtype: torch.dtype,
                              pin: bool, path: str | None = None, layout: LoraLayout | None = None) -> HostAdapter:
    """``factors[(layer, module)] = (lora_A [r, in], lora_B [out, r])`` (PEFT layout) -> a
    ``HostAdapter``; shapes are checked against ``config``. Without ``layout``, every layer of
    each targeted module at ``rank``, scale alpha / rank. With one (rsLoRA, rank and alpha
    patterns, ``layers_to_transform``), the pairs and ranks it names: a module's layers are
    padded to its largest rank with zero rows of A and B^T (they add nothing), a projection's
    scale over the adapter's is folded into its B, and layers without the adapter share one
    zero slot per module. A fused projection's factors (Phi-3) are held as its members'
    (``split_fused_factors``)."""
    factors = split_fused_factors(name, factors, config)
    if layout is None:
        targets = tuple(m for m in ALL_TARGET_MODULES if any(mod == m for _, mod in factors))
        layout = LoraLayout(rank=rank, alpha=alpha, target_modules=targets, owner=f"adapter {name!r}")
    layout = member_layout(layout)
    ranks, shared = _module_ranks(layout, config)
    extra = sorted({lm for lm in factors if lm[0] >= config.num_layers})
    if extra:
        raise ConfigError(f"adapter {name!r} has weights for layers beyond the base's "
                          f"{config.num_layers} (e.g. {extra[:2]}); it belongs to another base model")
    slots: dict[tuple[int, str], MatrixSlot] = {}
    offset = 0
    for module in (m for m in ranks if m in shared):  # one zero A / B^T for the module's unadapted layers
        k, n = config.module_dims(module)
        zero = MatrixSlot(offset, offset + _aligned(ranks[module][0] * k), k, n)
        slots.update({(layer, module): zero for layer in range(config.num_layers)})
        offset += _matrix_elems(ranks[module][0], k, n)
    for layer in range(config.num_layers):
        for module, (r, layers) in ranks.items():
            if layer not in layers:
                continue
            k, n = config.module_dims(module)
            _check_factor_shapes(name, factors, layer, module, layout.module_rank(layer, module), k, n)
            slots[(layer, module)] = MatrixSlot(offset, offset + _aligned(r * k), k, n)
            offset += _matrix_elems(r, k, n)
    flat = torch.zeros(offset, dtype=dtype, pin_memory=pin)
    for module, (r, layers) in ranks.items():
        for layer in layers:
            s, (a, b) = slots[(layer, module)], factors[(layer, module)]
            ratio = layout.module_scale(layer, module) / layout.scale
            flat[s.a:s.a + r * s.in_features].view(r, s.in_features)[:a.shape[0]].copy_(a)
            bt = b.t() if ratio == 1.0 else b.t().float() * ratio
            flat[s.b:s.b + r * s.out_features].view(r, s.out_features)[:a.shape[0]].copy_(bt)
    return HostAdapter(name=name, rank=max(r for r, _ in ranks.values()), alpha=layout.alpha,
                       target_modules=tuple(ranks), slots=slots, flat=flat, num_layers=config.num_layers,
                       path=path, scale=layout.scale, module_ranks={m: r for m, (r, _) in ranks.items()})


def _check_factor_shapes(name: str, factors, layer: int, module: str, rank: int, k: int, n: int) -> None:
    if (layer, module) not in factors:
        raise ConfigError(f"adapter {name!r}: no LoRA weights for layer {layer} {module}; "
                          "adapters must cover every layer of each targeted module")
    a, b = factors[(layer, module)]
    if tuple(a.shape) != (rank, k) or tuple(b.shape) != (n, rank):
        raise ConfigError(
            f"adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}; this base needs [{rank}, {k}] and [{n}, {rank}] "
            "(was the adapter trained on another base model?)")


def load_peft_adapter(name: str, path: str | os.PathLike, config: DecoderConfig, *,
                      dtype: torch.dtype, pin: bool = False, params: Mapping[str, Any] | None = None) -> HostAdapter:
    """Read a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``) for
    the base described by ``config``; any mismatch is a ``ConfigError`` naming the adapter.
    rsLoRA, ``rank_pattern`` / ``alpha_pattern`` and ``layers_to_transform`` are honoured.
    A DoRA adapter (``use_dora``) needs the base's ``params`` (its scales follow from the frozen
    weights: ``dora_rows.fold_dora``)."""
    where = f"adapter {name!r} ({str(path)!r})"
    try:
        cfg, targets, state = read_peft_adapter(path, where)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - not JSON, a JSON array, truncated safetensors, a refused pickle
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise ConfigError(f"{where}: its files cannot be read as a PEFT adapter ({type(e).__name__}: {detail}); "
                          "re-export it") from None
    layout = peft_layout(cfg, targets, where)
    pairs = layout.adapted(config.num_layers)
    for layer, module in pairs:
        rank = layout.module_rank(layer, module)
        if rank > min(config.module_dims(module)):
            raise ConfigError(f"{where}: rank {rank} exceeds the dims of {module} "
                              f"{config.module_dims(module)} of this base")
    dora = bool(cfg.get("use_dora", False))
    if dora and params is None:
        raise ConfigError(f"{where} is a DoRA adapter (use_dora); loading it needs the base weights "
                          "(load it through an Engine)")
    factors, magnitudes = {}, {}
    expected = set()
    for layer, module in pairs:
        ka, kb = peft_key(layer, module, "lora_A"), peft_key(layer, module, "lora_B")
        km = peft_magnitude_key(layer, module)
        expected |= {ka, kb, km} if dora else {ka, kb}
        if ka in state and kb in state:
            factors[(layer, module)] = (state[ka], state[kb])
        if km in state:
            magnitudes[(layer, module)] = state[km]
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ConfigError(f"{where}: weight names do not match a {config.num_layers}-layer "
                          f"{config.model_type} base with targets {list(targets)} (missing e.g. "
                          f"{missing[:2]}, unexpected e.g. {extra[:2]}); is it an adapter of this base?")
    scales = None
    if dora:
        from .dora_rows import fold_dora

        factors, scales = fold_dora(factors, magnitudes, params, scale=layout.module_scale, config=config)
    adapter = host_adapter_from_factors(name, factors, rank=layout.rank, alpha=layout.alpha, config=config,
                                        dtype=dtype, pin=pin, path=str(Path(path)), layout=layout)
    adapter.dora_scales = scales
    return adapter
