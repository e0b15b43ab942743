"""The engine's adapter registry: adapters loaded into host memory, listed, updated in place,
removed and retired."""

from __future__ import annotations

import json
import os
from typing import Iterable, Mapping

import torch

from ..specs import ConfigError, LoraLayout
from .adapters import AdapterInfo, HostAdapter, UnknownAdapterError, host_adapter_from_factors, load_peft_adapter
from .checkpoint import read_checkpoint_adapters
from .dora_rows import fold_dora


class AdapterRegistry:
    """``Engine``'s adapters by name (``_adapters``), those removed or replaced while requests
    still use them (``_retired``) and each name's latest version (``_versions``), under the
    engine's ``_lock``; set up by ``Engine.__init__``.

    A request is bound to the adapter object its name maps to when it is submitted, so an
    update (a new object under the name) never changes what a submitted request runs on."""

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
                            *, rank: int, alpha: float, layout: LoraLayout | None = None,
                            magnitudes: Mapping[tuple[int, str], torch.Tensor] | None = None) -> AdapterInfo:
        """Register an adapter from tensors: ``factors[(layer, module)] = (lora_A [r, in],
        lora_B [out, r])`` for every layer of each targeted module (e.g. from a training
        checkpoint's adapter bank); copied to host memory like ``add_adapter``. ``layout``: the
        adapter's rsLoRA / rank and alpha patterns / layers (``AdapterSpec.layout``), if any.
        ``magnitudes``: a DoRA adapter's ``[out]`` per (layer, module)."""
        with self._lock:
            if name in self._adapters:
                raise ConfigError(f"adapter {name!r} is already loaded; remove_adapter({name!r}) first")
        on_host = {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in factors.items()}
        adapter = self._folded_host_adapter(name, on_host, rank=rank, alpha=alpha, layout=layout,
                                            magnitudes=magnitudes)
        adapter.check_finite()
        return self._register(adapter)

    def _folded_host_adapter(self, name, factors, *, rank, alpha, layout=None, magnitudes=None,
                             path=None) -> HostAdapter:
        """A ``HostAdapter`` from factors; a DoRA adapter's magnitudes folded (serving/dora_rows.py)."""
        scales = None
        if magnitudes is not None:  # DoRA: g folded into B, g kept beside
            scale = layout.module_scale if layout is not None else float(alpha) / rank
            factors, scales = fold_dora(factors, magnitudes, self.params, scale=scale, config=self.model_config)
        adapter = host_adapter_from_factors(name, factors, rank=rank, alpha=alpha, config=self.model_config,
                                            dtype=self.dtype, pin=self.device.type == "cuda", path=path,
                                            layout=layout)
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
        hosts = [self._folded_host_adapter(a.name, a.factors, rank=a.rank, alpha=a.alpha, layout=a.layout,
                                           magnitudes=a.magnitudes, path=f"{ckpt_path}#{a.name}")
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
        self._check_host_layout(adapter)
        return self._register(adapter)

    def _check_host_layout(self, adapter: HostAdapter) -> None:
        if adapter.flat.dtype != self.dtype or adapter.relative_offsets.shape[0] != self.model_config.num_layers:
            raise ConfigError(f"adapter {adapter.name!r}: built for {adapter.relative_offsets.shape[0]} layers in "
                              f"{adapter.flat.dtype}; this engine serves {self.model_config.num_layers} layers in "
                              f"{self.dtype}")

    def update_adapter(self, name: str, weights: str | os.PathLike | HostAdapter | Mapping, *,
                       alpha: float | None = None, add: bool = False) -> AdapterInfo:
        """Replace ``name``'s weights in place, atomically; returns the new version's info.

        ``weights``: a PEFT LoRA directory, a ``HostAdapter`` for this base, or factors as
        ``add_adapter_weights`` takes them (``{(layer, module): (lora_A [r, in], lora_B [out,
        r])}``; the rank is theirs, ``alpha`` defaults to the current version's). Rank, targets
        and alpha may all change. Requests submitted after this returns run on the new weights;
        requests submitted before (running or still queued) finish on the version they were
        submitted under, whose pool pages are freed once the last of them ends. Prefix-cache
        pages are keyed by the loaded weights, never by the name, so no KV computed with the
        old version is reused for the new one. The version (in ``adapters()``, every
        ``TokenEvent`` and result) goes up by one per update. ``add=True``: an unknown name is
        added (as its next version) instead of refused."""
        with self._lock:
            current = self._adapters.get(name)
            if current is None and not add:
                raise UnknownAdapterError(name, list(self._adapters))
        if alpha is None and current is not None:
            alpha = current.alpha
        return self._register(self._host_adapter(name, weights, alpha=alpha), replace=True)

    def _host_adapter(self, name: str, weights, *, alpha: float | None) -> HostAdapter:
        """``update_adapter``'s ``weights`` as a checked ``HostAdapter`` named ``name``."""
        pin = self.device.type == "cuda"
        if isinstance(weights, HostAdapter):
            if weights.name != name:
                raise ConfigError(f"update_adapter({name!r}): the HostAdapter given is named {weights.name!r}; "
                                  "build it under the name it replaces")
            self._check_host_layout(weights)
            return weights
        if isinstance(weights, (str, os.PathLike)):
            adapter = load_peft_adapter(name, weights, self.model_config, dtype=self.dtype, pin=pin,
                                        params=self.params)
        elif isinstance(weights, Mapping) and weights:
            if alpha is None:
                raise ConfigError(f"update_adapter({name!r}, factors, add=True): a new adapter needs alpha=")
            rank = int(next(iter(weights.values()))[0].shape[0])
            on_host = {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in weights.items()}
            adapter = host_adapter_from_factors(name, on_host, rank=rank, alpha=alpha, config=self.model_config,
                                                dtype=self.dtype, pin=pin)
        else:
            raise ConfigError(f"update_adapter({name!r}): weights must be a PEFT directory, a HostAdapter or a "
                              "non-empty mapping {(layer, module): (lora_A, lora_B)}; got "
                              f"{type(weights).__name__}")
        adapter.check_finite()
        return adapter

    def _register(self, adapter: HostAdapter, *, replace: bool = False) -> AdapterInfo:
        """List ``adapter`` under its name as that name's next version; with ``replace`` the
        adapter listed under it now (if any) is retired in the same critical section, so every
        submit sees either the old version or the new one."""
        if self.pool.pages_for_adapter(adapter) > self.pool.num_pages:
            raise ConfigError(f"adapter {adapter.name!r} needs {self.pool.pages_for_adapter(adapter)} pages but "
                              f"the pool has {self.pool.num_pages}; give the engine a larger pool")
        with self._lock:
            old = self._adapters.get(adapter.name)
            if old is not None and not replace:
                raise ConfigError(f"adapter {adapter.name!r} is already loaded")
            if old is adapter or any(adapter is a for a in self._retired):
                raise ConfigError(f"adapter {adapter.name!r}: this HostAdapter is a version requests still "
                                  "run on; build a new one for an update")
            adapter.version = self._versions.get(adapter.name, 0) + 1
            self._versions[adapter.name] = adapter.version
            if self.config.adapter_versions_file is not None:
                write_versions(self.config.adapter_versions_file, self._versions)
            self._adapters[adapter.name] = adapter
            if old is not None:
                self._retired.append(old)
                self._wake.notify_all()
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


def read_versions(path: str | None) -> dict[str, int]:
    """Each adapter name's latest version from ``EngineConfig.adapter_versions_file`` (empty
    when None or the file does not exist yet)."""
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            versions = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"EngineConfig.adapter_versions_file={path!r} cannot be read ({exc}); fix or remove "
                          "it (versions then restart at 1)") from exc
    if not isinstance(versions, dict) or not all(isinstance(k, str) and type(v) is int and v >= 0
                                                 for k, v in versions.items()):
        raise ConfigError(f"EngineConfig.adapter_versions_file={path!r} must hold a JSON object of adapter name "
                          "-> latest version (an int >= 0); fix or remove it")
    return versions


def write_versions(path: str, versions: Mapping[str, int]) -> None:
    """Rewrite the versions file atomically (a new file renamed over the old one), so a crash
    mid-write leaves the previous counts, never a partial file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(dict(versions), f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
