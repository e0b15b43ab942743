"""The Triton kernel variants the engine compiles ahead, recorded once and kept beside the on-disk
compile cache, so a restart reads the list instead of finding it again.

Finding the variants (``compile_ahead.variants_of``) means running every token bucket's pieces
(or every decode graph key's forward) with launches recorded: seconds of Python and GPU work
even when every variant is then loaded from the Triton cache. A record is that list (each
variant's kernel as ``module:qualname``, its specialisation data, and its kernel's source hash)
in ``<cache>/kernel_variants/<part>-<key hash>.json``, keyed by everything that changes the list:
the model's shape, the dtype, the engine's settings and the runner's step modes, the device, the
versions of torch, Triton and this package. The adapters' ranks are not in the key: no kernel
variant depends on them (``warm_up``'s module docstring). A record whose key or format does not
match, or that cannot be read, or one of whose kernels' source changed since (or is gone), is
ignored with a log line and recorded again.
Records are written whole (a temporary file renamed over the old one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..model.hf_loading import default_cache_dir
from .compile_ahead import KernelVariant, _runtime_knobs

log = logging.getLogger("lightning_lorafusion.serving")

FORMAT = 1
RECORD_DIR = "kernel_variants"  # under the project's cache directory, beside triton/ and inductor/
# EngineTuning fields that change how the variants are found or the captures run, not which
NOT_IN_KEY = ("kernel_variant_record", "capture_warm_up")


def uses_records(device: torch.device) -> bool:
    """Whether variants are recorded and read back here: a CUDA device and a Triton whose launches
    can be recorded (elsewhere nothing compiles ahead)."""
    return device.type == "cuda" and _runtime_knobs() is not None


def _versions() -> dict[str, str]:
    import triton

    try:  # the installed distribution's version (not the package object: serving sits below it)
        package = importlib.metadata.version("lightning-lorafusion")
    except importlib.metadata.PackageNotFoundError:
        package = "not installed"
    return {"package": package, "torch": torch.__version__, "triton": triton.__version__}


def _device_of(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"type": device.type}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "capability": [props.major, props.minor],
            "sms": props.multi_processor_count}


def record_key(engine, part: str) -> dict[str, Any]:
    """What the variants of ``part`` ("decode": the decode graphs'; "mixed": the mixed-step
    pieces') depend on, as plain JSON values: model shape, dtype, engine settings less the pool's
    sizing, the runner's step modes, device, versions."""
    runner, cfg = engine.runner, engine.config
    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                if f.name not in ("num_pages", "gpu_memory_fraction", "cpu_pool_mib", "adapter_versions_file",
                                  "tuning", "seed")}
    tuning = {k: v for k, v in dataclasses.asdict(cfg.tuning).items() if k not in NOT_IN_KEY}
    steps = {"tuning": tuning, "kernel_backend": runner.kernel_backend,
             "lora_backend": runner.lora_backend, "decode_buckets": list(runner.buckets),
             "token_buckets": list(runner.token_buckets), "mixed_pieces": runner.mixed_pieces,
             "prefill_lora_write": runner.prefill_lora_write, "prefill_lora_form": runner.prefill_lora_form,
             "decode_gemm": runner.decode_gemm, "base_pieces": runner.base_pieces, "live_grids": runner.live_grids,
             "segment_block_m": runner.segment_block_m}
    return json.loads(json.dumps({"format": FORMAT, "part": part, "model": repr(engine.model_config),
                                  "dtype": str(engine.dtype), "engine": settings, "steps": steps,
                                  "device": _device_of(engine.device), "versions": _versions()}, default=repr))


def record_path(key: dict[str, Any]) -> Path:
    """``<cache>/kernel_variants/<part>-<16 hex digits of the key's hash>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / RECORD_DIR / f"{key['part']}-{digest}.json"


def resolve_kernel(name: str):
    """``module:qualname`` -> the Triton kernel it names (a ``JITFunction``; the interpreter's
    function under TRITON_INTERPRET=1), unwrapped from an autotuner or heuristics."""
    from triton.runtime.jit import KernelInterface

    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    while isinstance(getattr(obj, "fn", None), KernelInterface):
        obj = obj.fn
    if not isinstance(obj, KernelInterface):
        raise TypeError(f"{name} is not a Triton kernel")
    return obj


def _source_hash(kernel) -> str:
    return str(getattr(kernel, "cache_key", ""))


def save_record(path: Path, key: dict[str, Any], variants: list[KernelVariant]) -> None:
    """Write the record of ``variants`` under ``key`` to ``path``, whole or not at all."""
    body = {"key": key, "written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "variants": [{"name": v.name, "data": v.data, "source": _source_hash(v.kernel)} for v in variants]}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_record(path: Path, key: dict[str, Any]) -> tuple[list[KernelVariant], int] | None:
    """The variants recorded at ``path`` under ``key`` and how many were dropped (their kernel's
    source changed, or it is gone) -> ``(variants, dropped)``; None (logged) when there is no
    record, it cannot be read, or its key differs."""
    if not path.is_file():
        log.info("kernel variants: no record at %s; recording them", path)
        return None
    try:
        body = json.loads(path.read_text())
        if body["key"] != key:
            log.info("kernel variants: the record at %s is for another model, setup or version; recording them",
                     path)
            return None
        entries = [(str(e["name"]), str(e["data"]), str(e["source"])) for e in body["variants"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("kernel variants: the record at %s cannot be read (%s); recording them", path, exc)
        return None
    variants, dropped = [], 0
    for name, data, source in entries:
        try:
            kernel = resolve_kernel(name)
        except (ImportError, AttributeError, TypeError):
            dropped += 1
            continue
        if _source_hash(kernel) != source:
            dropped += 1
            continue
        variants.append(KernelVariant(name, data, kernel))
    if dropped:
        log.info("kernel variants: %d of the %d recorded at %s changed or are gone", dropped, len(entries), path)
    return variants, dropped


def recorded_variants(engine, part: str, find: Callable[[], list[KernelVariant]], *,
                      use_record: bool = True) -> tuple[list[KernelVariant], dict[str, Any]]:
    """The variants to compile ahead for ``part``: read from its record when one matches
    (``find`` not called), else ``find()`` (launches recorded) written as the record. A record
    some of whose kernels changed since (``load_record``'s dropped) is recorded again. ->
    ``(variants, report)``, the report with ``source`` ("record", "recorded"; "off" where records
    do not apply or ``use_record`` is False), ``record_s`` (reading or recording), ``path``,
    ``dropped`` (0)."""
    t0 = time.perf_counter()
    if not use_record or not uses_records(engine.device):
        variants = find()
        return variants, {"source": "off", "record_s": time.perf_counter() - t0, "path": None, "dropped": 0}
    key = record_key(engine, part)
    path = record_path(key)
    loaded = load_record(path, key)
    if loaded is not None and not loaded[1]:
        return loaded[0], {"source": "record", "record_s": time.perf_counter() - t0, "path": str(path),
                           "dropped": 0}
    if loaded is not None:
        log.info("kernel variants: recording them again (a kernel changed since %s was written)", path)
    variants = find()
    try:
        save_record(path, key, variants)
    except OSError as exc:
        log.warning("kernel variants: cannot write the record %s (%s)", path, exc)
    return variants, {"source": "recorded", "record_s": time.perf_counter() - t0, "path": str(path), "dropped": 0}
