"""AdapterBank: the trainable LoRA factors of N adapters over one frozen decoder, plus routing."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..kernels.dora import dora_row_norm, weight_row_sq_norm
from ..kernels.reference import LoraModuleWeights, LoraRouting
from ..specs import ADAPTABLE_MODULES, AdapterSpec, ConfigError, LoraLayout
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

    PEFT's inits, from the factor's own ``seed`` (drawn on the CPU, so the values do not depend
    on the device): ``init`` True, A ~ kaiming_uniform(a=sqrt(5)); "gaussian", A ~ N(0, 1/r);
    B = 0 either way, so training starts at the base. ``draw=False`` leaves A at zero until
    ``draw_initial_a`` (a pipeline stage draws only its own layers' factors)."""

    def __init__(self, rank: int, in_features: int, out_features: int, *, seed: int,
                 dtype: torch.dtype, device: torch.device | str | None, draw: bool = True,
                 init: bool | str = True, dora: bool = False) -> None:
        super().__init__()
        self.seed = seed
        self.init = init
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        self.lora_magnitude = (nn.Parameter(torch.ones(out_features, dtype=dtype, device=device)) if dora
                               else None)
        if draw:
            self.draw_initial_a()

    @torch.no_grad()
    def draw_initial_a(self) -> None:
        a = torch.empty(self.lora_A.shape, dtype=torch.float32)
        generator = torch.Generator().manual_seed(self.seed)
        if self.init == "gaussian":
            nn.init.normal_(a, std=1.0 / a.shape[0], generator=generator)
        else:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A.copy_(a)


class AdapterBank(nn.Module):
    """N LoRA adapters (heterogeneous rank, alpha, dropout, target modules) of one decoder.

    Parameters live at ``adapters[a][layer][module].lora_A / .lora_B`` (so ``state_dict`` keys
    look like ``adapters.0.3.q_proj.lora_A``); the (layer, module) pairs and their ranks are the
    spec's ``layout`` (every layer of each targeted module unless ``layers_to_transform`` says
    otherwise; ``rank_pattern`` ranks). Each factor pair has exactly its own rank: the fused
    kernels take a rank per (adapter, projection), so nothing is padded. A projection whose
    ``alpha_pattern`` / ``rank_pattern`` scale differs from the adapter's (``spec.scale``, the
    routing's) gets B times the ratio in ``module_weights`` (a differentiable product, so B's
    gradient is PEFT's). Adapter ``a`` is ``specs[a]``; its index is what routing segments and
    ``LoraModuleWeights`` tuples use.
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
        self._b_ratios: dict[tuple[int, int, str], float] = {}  # (adapter, layer, module) -> scale ratio
        for a, spec in enumerate(self.specs):
            layout = spec.layout
            adapted = set(layout.adapted(config.num_layers))
            for module in spec.target_modules:
                if module not in config.family.projections:
                    raise ConfigError(
                        f"adapter {spec.name!r}: target module {module!r} is not a projection of this "
                        f"{config.model_type} base; allowed: {list(config.family.projections)}"
                        + (" (its checkpoint fuses q/k/v and gate/up, as PEFT names them)"
                           if config.family.fused_qkv or config.family.fused_gate_up else "")
                    )
            layers = nn.ModuleList()
            for layer in range(config.num_layers):
                layers.append(nn.ModuleDict({
                    m: self._factors(a, spec, layout, layer, m, dtype=dtype, device=device, draw=draw_a)
                    for m in ADAPTABLE_MODULES if (layer, m) in adapted
                }))
            adapters.append(layers)
        self.adapters = nn.ModuleList(adapters)
        for p in self.parameters():
            p.requires_grad_(True)

    def _factors(self, a: int, spec: AdapterSpec, layout: LoraLayout, layer: int, module: str,
                 **kwargs) -> LoraFactors:
        rank = layout.module_rank(layer, module)
        d_in, d_out = self.config.module_dims(module)
        if rank > min(d_in, d_out):
            field = "rank" if rank == spec.rank else f"rank_pattern rank of layer {layer}"
            raise ConfigError(f"adapter {spec.name!r}: {field}={rank} exceeds {module} dims "
                              f"(in={d_in}, out={d_out}); use rank <= {min(d_in, d_out)} or drop "
                              f"{module!r} from target_modules")
        ratio = layout.module_scale(layer, module) / layout.scale
        if ratio != 1.0:
            self._b_ratios[(a, layer, module)] = ratio
        return LoraFactors(rank, d_in, d_out, seed=_init_seed(spec.seed, layer, module),
                           init=spec.init_lora_weights, dora=spec.dora, **kwargs)

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

    def named_parameters_of(self, adapter_index: int) -> list[tuple[str, nn.Parameter]]:
        """``parameters_of`` with names like ``3.q_proj.lora_B`` (what LoRA+ groups by)."""
        return list(self.adapters[adapter_index].named_parameters())

    def factors(self, adapter_index: int, layer: int, module: str) -> LoraFactors | None:
        layer_dict = self.adapters[adapter_index][layer]
        return layer_dict[module] if module in layer_dict else None

    def module_weights(self, layer: int, module: str) -> LoraModuleWeights | None:
        """One projection's factors over all adapters (None where not targeted); None if no
        adapter targets it."""
        per = [self.factors(a, layer, module) for a in range(self.num_adapters)]
        if all(f is None for f in per):
            return None
        b = []
        for a, f in enumerate(per):
            ratio = self._b_ratios.get((a, layer, module))
            b.append(None if f is None else f.lora_B if ratio is None else f.lora_B * ratio)
        magnitude = tuple(None if f is None else f.lora_magnitude for f in per)
        return LoraModuleWeights(
            a=tuple(None if f is None else f.lora_A for f in per), b=tuple(b),
            magnitude=magnitude if any(m is not None for m in magnitude) else None,
            weight_sq_norm=self._buffers.get(_sq_norm_name(layer, module)),
        )

    def module_scale_ratio(self, adapter_index: int, layer: int, module: str) -> float:
        """The factor ``module_weights`` puts on B of one projection: its scale over the adapter's."""
        return self._b_ratios.get((adapter_index, layer, module), 1.0)

    def dora_modules(self, layers: Sequence[int] | None = None) -> list[tuple[int, str]]:
        """The (layer, module) pairs some DoRA adapter of the bank targets."""
        pairs = {p for s in self.specs if s.dora for p in s.layout.adapted(self.config.num_layers)}
        wanted = range(self.config.num_layers) if layers is None else layers
        return [(layer, m) for layer in wanted for m in ADAPTABLE_MODULES if (layer, m) in pairs]

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
                    # B as module_weights hands it to the decoder (a rank/alpha pattern's scale folded in)
                    b = f.lora_B * self.module_scale_ratio(a, layer, module)
                    norm = dora_row_norm(weight, f.lora_A, b, spec.scale, sq)
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
