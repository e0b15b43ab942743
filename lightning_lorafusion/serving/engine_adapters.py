"""The engine's adapter registry: adapters loaded into host memory, listed, removed and retired."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from ..specs import ConfigError
from .adapters import AdapterInfo, HostAdapter, UnknownAdapterError, host_adapter_from_factors, load_peft_adapter
from .checkpoint import read_checkpoint_adapters
from .dora_rows import fold_dora


class AdapterRegistry:
    """``Engine``'s adapters by name (``_adapters``) and those removed while requests still use
    them (``_retired``), under the engine's ``_lock``; set up by ``Engine.__init__``."""

    def add_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load a PEFT LoRA directory into host memory (pinned on CUDA); it is paged into the GPU
        pool when a request needs it."""
        with self._lock:
            if name in self._adapters:
                raise ConfigError(f"adapter {name!r} is already loaded; remove_adapter({name!r}) first")
        adapter = load_peft_adapter(name, path, self.model_config, dtype=self.dtype,
                                    pin=self.device.type == "cuda", params=self.params)
        adapter.check_finite()
        return self._register(adapter)

    def add_adapter_weights(self, name: str, factors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                            *, rank: int, alpha: float,
                            magnitudes: Mapping[tuple[int, str], torch.Tensor] | None = None) -> AdapterInfo:
        """Register an adapter from tensors: ``factors[(layer, module)] = (lora_A [r, in],
        lora_B [out, r])`` for every layer of each targeted module (e.g. from a training
        checkpoint's adapter bank); copied to host memory like ``add_adapter``. ``magnitudes``:
        a DoRA adapter's ``[out]`` per (layer, module)."""
        with self._lock:
            if name in self._adapters:
                raise ConfigError(f"adapter {name!r} is already loaded; remove_adapter({name!r}) first")
        on_host = {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in factors.items()}
        adapter = self._host_adapter(name, on_host, rank=rank, alpha=alpha, magnitudes=magnitudes)
        adapter.check_finite()
        return self._register(adapter)

    def _host_adapter(self, name, factors, *, rank, alpha, magnitudes=None, path=None) -> HostAdapter:
        scales = None
        if magnitudes is not None:  # DoRA: g folded into B, g kept beside (serving/dora_rows.py)
            factors, scales = fold_dora(factors, magnitudes, self.params, scale=float(alpha) / rank)
        adapter = host_adapter_from_factors(name, factors, rank=rank, alpha=alpha, config=self.model_config,
                                            dtype=self.dtype, pin=self.device.type == "cuda", path=path)
        adapter.dora_scales = scales
        return adapter

    def add_adapters_from_checkpoint(self, ckpt_path: str, names: Iterable[str] | None = None, *,
                                     weights: str = "best") -> list[AdapterInfo]:
        """Register adapters straight from a ``fit`` checkpoint (.ckpt), under their training
        names (``names``: a subset; default all). ``weights``: "best" (what ``export_adapters``
        writes: best-validation weights when validated, else the saved ones) or "last". Each is
        checked against this base (dims, layers) like a PEFT directory; a mismatch names it."""
        found = read_checkpoint_adapters(ckpt_path, None if names is None else list(names), weights=weights)
        with self._lock:
            taken = [a.name for a in found if a.name in self._adapters]
        if taken:
            raise ConfigError(f"adapter {taken[0]!r} is already loaded; remove_adapter({taken[0]!r}) first")
        hosts = [self._host_adapter(a.name, a.factors, rank=a.rank, alpha=a.alpha, magnitudes=a.magnitudes,
                                    path=f"{ckpt_path}#{a.name}")
                 for a in found]  # every one checked before any is registered
        for h in hosts:
            h.check_finite()
        return [self._register(h) for h in hosts]

    def add_host_adapter(self, adapter: HostAdapter) -> AdapterInfo:
        """Register an adapter already in host memory (e.g. from ``adapters.host_adapter_from_factors``
        for this base, in the engine's dtype). Several may share one host buffer (the pool only
        copies from it): each is still its own adapter, paged in and evicted on its own, which
        is how scripts/bench_serving.py simulates thousands of adapters in little host memory.
        Its weights are not checked for NaN / inf (``HostAdapter.check_finite`` does that)."""
        if adapter.flat.dtype != self.dtype or adapter.relative_offsets.shape[0] != self.model_config.num_layers:
            raise ConfigError(f"adapter {adapter.name!r}: built for {adapter.relative_offsets.shape[0]} layers in "
                              f"{adapter.flat.dtype}; this engine serves {self.model_config.num_layers} layers in "
                              f"{self.dtype}")
        return self._register(adapter)

    def _register(self, adapter: HostAdapter) -> AdapterInfo:
        if self.pool.pages_for_adapter(adapter) > self.pool.num_pages:
            raise ConfigError(f"adapter {adapter.name!r} needs {self.pool.pages_for_adapter(adapter)} pages but "
                              f"the pool has {self.pool.num_pages}; give the engine a larger pool")
        with self._lock:
            if adapter.name in self._adapters:
                raise ConfigError(f"adapter {adapter.name!r} is already loaded")
            self._adapters[adapter.name] = adapter
        return adapter.info(resident=False)

    def remove_adapter(self, name: str) -> None:
        """Unlist ``name`` now (new requests naming it fail); requests already submitted with it
        finish normally, and its pool pages are freed once none of them is left."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise UnknownAdapterError(name, list(self._adapters))
            self._retired.append(adapter)
            self._wake.notify_all()

    def adapters(self) -> list[AdapterInfo]:
        with self._lock:
            listed = list(self._adapters.values())
        return [a.info(resident=self.pool.resident(a) is not None) for a in listed]

    def _retire_adapters(self) -> None:
        """Free the pages of removed adapters that no unfinished request uses any more."""
        if not self._retired:
            return
        with self._lock:
            in_use = {s.adapter.key for s in self._states.values() if s.adapter is not None}
            done = [a for a in self._retired if a.key not in in_use]
            self._retired = [a for a in self._retired if a.key in in_use]
        for adapter in done:
            if self.pool.resident(adapter) is not None:
                self.pool.evict(adapter)
