"""AdapterBank: the trainable LoRA factors of N adapters over one frozen decoder, plus routing."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..kernels.dora import dora_row_norm, weight_row_sq_norm
from ..kernels.reference import LoraModuleWeights, LoraRouting
from ..specs import ADAPTABLE_MODULES, AdapterSpec, ConfigError
from .decoder import BankView, DecoderConfig, frozen_weight


def _init_seed(adapter_seed: int, layer: int, module: str) -> int:
    """Seed of one A factor: depends only on (adapter seed, layer, module), so an adapter's
    initial weights do not change with the other adapters in the bank or its own targets."""
    return (adapter_seed * 1_000_003 + layer * 131 + ADAPTABLE_MODULES.index(module)) % (2**63 - 1)


def _sq_norm_name(layer: int, module: str) -> str:
    return f"dora_weight_sq_norm_{layer}_{module}"


class LoraFactors(nn.Module):
    """``lora_A [r, in]`` and ``lora_B [out, r]`` of one adapter on one projection, and with
    ``dora`` its DoRA magnitude ``lora_magnitude [out]`` (ones until ``AdapterBank.init_dora``
    sets it to the frozen weight's row norms, PEFT's initialisation).

    PEFT's default init: A ~ kaiming_uniform(a=sqrt(5)) from the factor's own ``seed`` (drawn on
    the CPU, so the values do not depend on the device), B = 0, so training starts at the base.
    ``draw=False`` leaves A at zero until ``draw_initial_a`` (a pipeline stage draws only its
    own layers' factors)."""

    def __init__(self, rank: int, in_features: int, out_features: int, *, seed: int,
                 dtype: torch.dtype, device: torch.device | str | None, draw: bool = True,
                 dora: bool = False) -> None:
        super().__init__()
        self.seed = seed
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        self.lora_magnitude = (nn.Parameter(torch.ones(out_features, dtype=dtype, device=device)) if dora
                               else None)
        if draw:
            self.draw_initial_a()

    @torch.no_grad()
    def draw_initial_a(self) -> None:
        a = torch.empty(self.lora_A.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=torch.Generator().manual_seed(self.seed))
        self.lora_A.copy_(a)


class AdapterBank(nn.Module):
    """N LoRA adapters (heterogeneous rank, alpha, dropout, target modules) of one decoder.

    Parameters live at ``adapters[a][layer][module].lora_A / .lora_B`` (so ``state_dict`` keys
    look like ``adapters.0.3.q_proj.lora_A``); every layer of the decoder is adapted for each
    targeted module (PEFT's default). Adapter ``a`` is ``specs[a]``; its index is what routing
    segments and ``LoraModuleWeights`` tuples use.
    """

    def __init__(self, specs: Sequence[AdapterSpec], config: DecoderConfig, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 draw_a: bool = True) -> None:
        super().__init__()
        if not specs:
            raise ConfigError("AdapterBank needs at least one AdapterSpec; got none")
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"adapter names must be unique; repeated: {duplicates}")
        self.config = config
        self.specs: tuple[AdapterSpec, ...] = tuple(specs)
        adapters = []
        for spec in self.specs:
            for module in spec.target_modules:
                if module not in config.family.projections:
                    raise ConfigError(
                        f"adapter {spec.name!r}: target module {module!r} is not a projection of this "
                        f"{config.model_type} base; allowed: {list(config.family.projections)}"
                        + (" (its checkpoint fuses q/k/v and gate/up, as PEFT names them)"
                           if config.family.fused_qkv or config.family.fused_gate_up else "")
                    )
                d_in, d_out = config.module_dims(module)
                if spec.rank > min(d_in, d_out):
                    raise ConfigError(
                        f"adapter {spec.name!r}: rank={spec.rank} exceeds {module} dims "
                        f"(in={d_in}, out={d_out}); use rank <= {min(d_in, d_out)} or drop "
                        f"{module!r} from target_modules"
                    )
            layers = nn.ModuleList()
            for layer in range(config.num_layers):
                layers.append(nn.ModuleDict({
                    m: LoraFactors(spec.rank, *config.module_dims(m),
                                   seed=_init_seed(spec.seed, layer, m), dtype=dtype, device=device, draw=draw_a,
                                   dora=spec.dora)
                    for m in ADAPTABLE_MODULES if m in spec.target_modules
                }))
            adapters.append(layers)
        self.adapters = nn.ModuleList(adapters)
        for p in self.parameters():
            p.requires_grad_(True)

    def draw_initial_a(self, layers: Sequence[int], adapters: Sequence[int] | None = None) -> None:
        """Draw the initial A factors of ``layers`` (of ``adapters``, default all) for a bank built
        with ``draw_a=False``: the values an eagerly initialised bank has."""
        for a in range(self.num_adapters) if adapters is None else adapters:
            for layer in layers:
                for factors in self.adapters[a][layer].values():
                    factors.draw_initial_a()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def num_adapters(self) -> int:
        return len(self.specs)

    def index_of(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"no adapter named {name!r}; the bank has {list(self.names)}")
        return self.names.index(name)

    def parameters_of(self, adapter_index: int) -> list[nn.Parameter]:
        """Adapter ``adapter_index``'s parameters (for its own optimizer)."""
        return list(self.adapters[adapter_index].parameters())

    def factors(self, adapter_index: int, layer: int, module: str) -> LoraFactors | None:
        layer_dict = self.adapters[adapter_index][layer]
        return layer_dict[module] if module in layer_dict else None

    def module_weights(self, layer: int, module: str) -> LoraModuleWeights | None:
        """One projection's factors over all adapters (None where not targeted); None if no
        adapter targets it."""
        per = [self.factors(a, layer, module) for a in range(self.num_adapters)]
        if all(f is None for f in per):
            return None
        magnitude = tuple(None if f is None else f.lora_magnitude for f in per)
        return LoraModuleWeights(
            a=tuple(None if f is None else f.lora_A for f in per),
            b=tuple(None if f is None else f.lora_B for f in per),
            magnitude=magnitude if any(m is not None for m in magnitude) else None,
            weight_sq_norm=self._buffers.get(_sq_norm_name(layer, module)),
        )

    def dora_modules(self, layers: Sequence[int] | None = None) -> list[tuple[int, str]]:
        """The (layer, module) pairs some DoRA adapter of the bank targets."""
        modules = {m for s in self.specs if s.dora for m in s.target_modules}
        return [(layer, m) for layer in (range(self.config.num_layers) if layers is None else layers)
                for m in ADAPTABLE_MODULES if m in modules]

    @torch.no_grad()
    def init_dora(self, params, layers: Sequence[int] | None = None, *,
                  reset: Sequence[int] | None = None) -> None:
        """Bind the DoRA adapters to the frozen base ``params`` (the decoder's pytree): keep each
        targeted weight's ``||W[n, :]||^2`` (a non-persistent buffer, computed once) and set the
        magnitudes of the adapters in ``reset`` (default: all; ``()`` keeps imported ones) to
        ``||W + scale B A||_row`` (PEFT's init; ``||W||`` while B is zero). ``layers``: only these
        (a pipeline stage's). An FP8 or NF4 weight is dequantized for its norms."""
        for layer, module in self.dora_modules(layers):
            weight, _ = frozen_weight(params["layers"][layer][module])
            sq = weight_row_sq_norm(weight)
            name = _sq_norm_name(layer, module)
            if name in self._buffers:
                self._buffers[name] = sq
            else:
                self.register_buffer(name, sq, persistent=False)
            for a, spec in enumerate(self.specs):
                f = self.factors(a, layer, module)
                if spec.dora and f is not None and (reset is None or a in reset):
                    norm = dora_row_norm(weight, f.lora_A, f.lora_B, spec.scale, sq)
                    f.lora_magnitude.copy_(norm.to(f.lora_magnitude.device))

    def view(self, layers: Sequence[int] | None = None) -> BankView:
        """``{(layer, module): LoraModuleWeights}`` for the decoder (default: all layers)."""
        out = {}
        for layer in range(self.config.num_layers) if layers is None else layers:
            for module in ADAPTABLE_MODULES:
                w = self.module_weights(layer, module)
                if w is not None:
                    out[(layer, module)] = w
        return out

    def routing(self, segments: Sequence[tuple[int, int, int]], microbatch_index: int,
                num_rows: int, *, train: bool = True) -> LoraRouting:
        """Routing table of one microbatch; ``train=False`` switches dropout off."""
        return LoraRouting(
            num_rows=num_rows,
            segments=tuple(tuple(s) for s in segments),
            scales=tuple(s.scale for s in self.specs),
            dropout_p=tuple(s.dropout if train else 0.0 for s in self.specs),
            seeds=tuple(s.seed for s in self.specs),
            microbatch_index=microbatch_index,
        )
