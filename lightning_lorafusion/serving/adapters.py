"""LoRA adapters for serving: PEFT directories read into one flat host buffer in the pool's layout."""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.decoder import DecoderConfig
from ..model.peft_io import peft_key, read_peft_adapter
from ..specs import ALL_TARGET_MODULES, ConfigError
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
    each rank vector is contiguous for the decode gather kernel."""

    def __init__(self, *, name: str, rank: int, alpha: float, target_modules: tuple[str, ...],
                 slots: dict[tuple[int, str], MatrixSlot], flat: torch.Tensor, num_layers: int,
                 path: str | None = None) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"adapter {name!r}: rank={rank!r} must be an integer >= 1")
        if not math.isfinite(float(alpha)) or float(alpha) <= 0:
            raise ConfigError(f"adapter {name!r}: alpha={alpha!r} must be finite and > 0; it was not loaded")
        self.key = next(_KEYS)  # unique per load: a re-added name is a different adapter
        self.name, self.rank, self.alpha, self.path = name, rank, float(alpha), path
        self.target_modules = target_modules
        self.scale = self.alpha / rank
        self.slots = slots
        self.flat = flat
        # [layers, modules, 2] element offsets (A, B^T) for the decode kernel; 0 where untargeted
        rel = torch.zeros(num_layers, len(ALL_TARGET_MODULES), 2, dtype=torch.int64)
        for (layer, module), s in slots.items():
            rel[layer, ALL_TARGET_MODULES.index(module)] = torch.tensor([s.a, s.b])
        self.relative_offsets = rel
        self.module_ranks = torch.tensor(
            [rank if m in target_modules else 0 for m in ALL_TARGET_MODULES], dtype=torch.int32)

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def check_finite(self) -> None:
        """Refuse weights with NaN or infinite values (a diverged run's export): a ConfigError
        naming the adapter, the first such projection and how many values are bad."""
        if bool(torch.isfinite(self.flat).all()):
            return
        bad = int((~torch.isfinite(self.flat)).sum())
        r = self.rank
        for (layer, module), s in sorted(self.slots.items()):
            for which, start, size in (("lora_A", s.a, r * s.in_features), ("lora_B", s.b, r * s.out_features)):
                if not bool(torch.isfinite(self.flat[start:start + size]).all()):
                    raise ConfigError(f"adapter {self.name!r}: {bad} NaN or infinite weights, the first in layer "
                                      f"{layer} {module} {which}; it was not loaded")
        raise ConfigError(f"adapter {self.name!r}: {bad} NaN or infinite weights; it was not loaded")

    def info(self, resident: bool) -> AdapterInfo:
        return AdapterInfo(self.name, self.rank, self.alpha, self.target_modules, self.path, resident)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _matrix_elems(rank: int, in_features: int, out_features: int) -> int:
    """Elements one (layer, module) takes in an adapter's flat layout: aligned A, aligned B^T."""
    return _aligned(rank * in_features) + _aligned(rank * out_features)


def adapter_numel(config: DecoderConfig, rank: int, target_modules: tuple[str, ...] | list[str]) -> int:
    """Elements of a ``HostAdapter``'s flat buffer (every layer of each target module), before
    building it: what sizing a pool for known adapters needs."""
    members = [m for t in target_modules for m in FUSED_PROJECTIONS.get(t, (t,))]  # as split_fused_factors
    return config.num_layers * sum(_matrix_elems(rank, *config.module_dims(m)) for m in members)


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
                              pin: bool, path: str | None = None) -> HostAdapter:
    """``factors[(layer, module)] = (lora_A [r, in], lora_B [out, r])`` (PEFT layout) for every
    layer of each targeted module -> a ``HostAdapter``; shapes are checked against ``config``.
    A fused projection's factors (Phi-3) are held as its members' (``split_fused_factors``)."""
    factors = split_fused_factors(name, factors, config)
    targets = tuple(m for m in ALL_TARGET_MODULES if any(mod == m for _, mod in factors))
    slots: dict[tuple[int, str], MatrixSlot] = {}
    offset = 0
    for layer in range(config.num_layers):
        for module in targets:
            k, n = config.module_dims(module)
            if (layer, module) not in factors:
                raise ConfigError(f"adapter {name!r}: no LoRA weights for layer {layer} {module}; "
                                  "adapters must cover every layer of each targeted module")
            a, b = factors[(layer, module)]
            if tuple(a.shape) != (rank, k) or tuple(b.shape) != (n, rank):
                raise ConfigError(
                    f"adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}; this base needs [{rank}, {k}] and [{n}, {rank}] "
                    "(was the adapter trained on another base model?)")
            slots[(layer, module)] = MatrixSlot(offset, offset + _aligned(rank * k), k, n)
            offset += _matrix_elems(rank, k, n)
    extra = sorted({lm for lm in factors if lm[0] >= config.num_layers})
    if extra:
        raise ConfigError(f"adapter {name!r} has weights for layers beyond the base's "
                          f"{config.num_layers} (e.g. {extra[:2]}); it belongs to another base model")
    flat = torch.zeros(offset, dtype=dtype, pin_memory=pin)
    for (layer, module), s in slots.items():
        a, b = factors[(layer, module)]
        flat[s.a:s.a + rank * s.in_features].view(rank, s.in_features).copy_(a)
        flat[s.b:s.b + rank * s.out_features].view(rank, s.out_features).copy_(b.t())
    return HostAdapter(name=name, rank=rank, alpha=alpha, target_modules=targets, slots=slots, flat=flat,
                       num_layers=config.num_layers, path=path)


def load_peft_adapter(name: str, path: str | os.PathLike, config: DecoderConfig, *,
                      dtype: torch.dtype, pin: bool = False) -> HostAdapter:
    """Read a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``) for
    the base described by ``config``; any mismatch is a ``ConfigError`` naming the adapter."""
    where = f"adapter {name!r} ({str(path)!r})"
    try:
        cfg, targets, state = read_peft_adapter(path, where)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - not JSON, a JSON array, truncated safetensors, a refused pickle
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise ConfigError(f"{where}: its files cannot be read as a PEFT adapter ({type(e).__name__}: {detail}); "
                          "re-export it") from None
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{where}: adapter_config.json needs an integer r >= 1; got r={rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"{where}: adapter_config.json needs a finite lora_alpha > 0; got lora_alpha={alpha!r}")
    for module in targets:
        if rank > min(config.module_dims(module)):
            raise ConfigError(f"{where}: rank {rank} exceeds the dims of {module} "
                              f"{config.module_dims(module)} of this base")
    factors = {}
    expected = set()
    for layer in range(config.num_layers):
        for module in targets:
            ka, kb = peft_key(layer, module, "lora_A"), peft_key(layer, module, "lora_B")
            expected |= {ka, kb}
            if ka in state and kb in state:
                factors[(layer, module)] = (state[ka], state[kb])
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ConfigError(f"{where}: weight names do not match a {config.num_layers}-layer "
                          f"{config.model_type} base with targets {list(targets)} (missing e.g. "
                          f"{missing[:2]}, unexpected e.g. {extra[:2]}); is it an adapter of this base?")
    return host_adapter_from_factors(name, factors, rank=rank, alpha=float(alpha), config=config,
                                     dtype=dtype, pin=pin, path=str(Path(path)))
