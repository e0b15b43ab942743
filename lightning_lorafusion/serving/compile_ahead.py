"""Triton kernels compiled ahead of their first launch, many at once.

A kernel variant (one set of constexprs, options and argument specialisations) compiles the
first time it is launched, on the launching thread: a warm-up that runs a step of every kind
compiles its few dozen variants one after the other. Here the same steps are first run with
launches of variants not compiled yet *recorded instead of run* (Triton's ``jit_cache_hook``
returning True skips the compile and the launch; the steps read no device value on the host,
the property that lets them be captured as CUDA graphs, so skipped kernels only leave garbage in
buffers nobody reads), then every recorded variant is compiled in a thread pool
(``JITFunction.preload`` of its specialisation data: Triton releases the GIL in its MLIR passes,
and ``ptxas`` is a subprocess), and only then are the steps run for real and captured: by then
every launch finds its kernel compiled (or loaded from the on-disk cache).

Without the hook (an older Triton, the interpreter, the CPU) nothing is recorded and the
kernels compile at their first launch, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

log = logging.getLogger("lightning_lorafusion.serving")


@dataclass(frozen=True)
class KernelVariant:
    """One compiled variant a launch needs: ``name`` (module:qualname of the kernel), ``data``
    (Triton's specialisation data, JSON: signature, constexprs, options, cache key), and the
    kernel object that compiles it (not part of equality)."""

    name: str
    data: str
    kernel: Any = field(compare=False, hash=False, repr=False)


def _runtime_knobs() -> Any | None:
    """Triton's runtime knobs (``triton.knobs.runtime``), or None where this Triton has none."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_cache_hook") else None


@contextlib.contextmanager
def record_launches() -> Iterator[list[KernelVariant]]:
    """Within the block, a launch by this thread of a Triton variant not compiled yet appends it
    to the yielded list and neither compiles nor runs (its outputs keep whatever they held);
    variants already compiled launch as usual, and so do other threads' launches (another
    engine's steps in this process compile as without the hook: the hook is process-wide, the
    recording is not). Yields a list that stays empty where Triton has no ``jit_cache_hook``."""
    found: list[KernelVariant] = []
    runtime = _runtime_knobs()
    if runtime is None:
        yield found
        return
    previous = runtime.jit_cache_hook
    recording = threading.get_ident()

    def hook(*, fn, compile, **kwargs: Any) -> bool:
        data = compile.get("specialization_data")
        if data is None or threading.get_ident() != recording:
            # compile it now, as without this hook (and ask the one it replaced, if any)
            return bool(previous(fn=fn, compile=compile, **kwargs)) if previous is not None else False
        found.append(KernelVariant(f"{fn.module}:{fn.name}", data, fn.jit_function))
        return True

    runtime.jit_cache_hook = hook
    try:
        yield found
    finally:
        runtime.jit_cache_hook = previous


def compile_variant(variant: KernelVariant, device: torch.device) -> Any:
    """Compile one variant (or load it from the on-disk cache) into its kernel's in-memory
    cache, for ``device`` -> the compiled kernel (None where Triton returns none)."""
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        return variant.kernel.preload(variant.data)


def load_compiled(kernels: Iterable[Any], device: torch.device) -> int:
    """Load compiled kernels onto ``device`` now (module and launcher; Triton does it at a
    kernel's first launch), on this thread: a capture that launches one first then finds it
    loaded. -> how many failed (logged; their first launch loads them and raises there)."""
    failed = 0
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        for kernel in kernels:
            try:
                getattr(kernel, "run", None)  # (Triton's CompiledKernel loads itself on first access)
            except Exception as exc:  # noqa: BLE001 - the first launch loads it again and raises
                failed += 1
                log.warning("loading %s ahead failed (%s); it loads at its first launch", kernel, exc)
    return failed


def distinct(variants: Iterable[KernelVariant]) -> list[KernelVariant]:
    """The variants without repeats (a kernel launched per layer records once per layer), in
    first-seen order."""
    return list(dict.fromkeys(variants))


def variants_of(units: Iterable[Callable[[], None]]) -> list[KernelVariant]:
    """The Triton variants the calls ``units`` would compile at their launches (those not yet
    compiled), found by running them with launches recorded (``record_launches``)."""
    with torch.no_grad(), record_launches() as found:
        for unit in units:
            unit()
    return distinct(found)


def compile_variants(variants: Iterable[KernelVariant], device: torch.device, *,
                     workers: int | None = None) -> dict[str, Any]:
    """Compile ``variants`` concurrently (a thread pool of ``workers``, default: the CPUs, at
    most 16), then on a GPU load them (``load_compiled``) -> ``{"variants", "workers",
    "seconds", "failed"}``. A variant that fails to compile or load here is logged and left to
    its first launch (where its error, if any, reaches the caller as before)."""
    todo = distinct(variants)
    workers = max(1, min(workers or min(os.cpu_count() or 1, 16), len(todo) or 1))
    t0 = time.perf_counter()
    failed = 0
    compiled = []
    if todo:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
            futures = [pool.submit(compile_variant, v, device) for v in todo]
            for v, fut in zip(todo, futures):
                try:
                    compiled.append(fut.result())
                except Exception as exc:  # noqa: BLE001 - the launch compiles it again and raises
                    failed += 1
                    log.warning("compiling %s ahead failed (%s); it compiles at its first launch", v.name, exc)
        if device.type == "cuda":
            failed += load_compiled([k for k in compiled if k is not None], device)
    return {"variants": len(todo), "workers": workers, "seconds": time.perf_counter() - t0, "failed": failed}


def compile_ahead(units: Iterable[Callable[[], None]], device: torch.device, *,
                  workers: int | None = None) -> dict[str, Any]:
    """``variants_of(units)`` compiled with ``compile_variants``: the report of the latter, with
    ``record_s`` (the recording runs) added."""
    t0 = time.perf_counter()
    variants = variants_of(units)
    record_s = time.perf_counter() - t0
    return {**compile_variants(variants, device, workers=workers), "record_s": record_s}
