"""Engine warm-up and cold start: every kernel variant compiled ahead and concurrently, the
captures of every token bucket, synthetic requests through every kind of step, the on-disk
compile caches, and a report of what was compiled and captured.

Nothing compiled or captured depends on the adapters' ranks (docs/serving.md, "Cold start"):
the LoRA kernels take ranks as runtime values, the decode graphs are keyed by (batch bucket,
with LoRA) and the mixed-step pieces by token bucket, so the work here is the same for one rank
as for eight, and an adapter of a new rank loaded later runs what is already there.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..model.hf_loading import default_cache_dir
from ..specs import ConfigError
from .compile_ahead import KernelVariant, compile_variants, variants_of
from .request import GenerationRequest
from .sampling import SamplingParams
from .variant_record import recorded_variants

log = logging.getLogger("lightning_lorafusion.serving")

# compile caches -> their directory under the project's cache directory ($LORAFUSION_CACHE_DIR)
COMPILE_CACHE_DIRS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def use_compile_caches() -> dict[str, str]:
    """Point Triton's and Inductor's on-disk caches at ``<cache>/triton`` and ``<cache>/inductor``
    (``<cache>``: ``$LORAFUSION_CACHE_DIR`` or ``./.cache/lightning-lorafusion``) unless their
    variables are already set, so a restarted server loads its kernels instead of compiling them.
    Both read the variables when they compile, so this must run before the first compile (the
    engine calls it first thing). -> the directories in effect, by variable."""
    root = default_cache_dir()
    for var, sub in COMPILE_CACHE_DIRS.items():
        if not os.environ.get(var):
            os.environ[var] = str(root / sub)
    return {var: os.environ[var] for var in COMPILE_CACHE_DIRS}


def compiled_kernel_variants() -> dict[str, int]:
    """The package's Triton kernels compiled in this process (from the disk cache or fresh):
    ``module.kernel -> variants`` (each distinct set of constexprs and specialisations is one),
    over the kernel modules imported so far. Empty under TRITON_INTERPRET=1 (nothing compiles)."""
    from .. import kernels

    counts: dict[str, int] = {}
    seen: set[int] = set()  # a kernel imported into another module is counted once
    prefix = kernels.__name__ + "."
    for name, module in sorted(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for attr, obj in vars(module).items():
            caches = getattr(obj, "device_caches", None)
            if isinstance(caches, dict) and id(obj) not in seen:
                seen.add(id(obj))
                n = sum(len(entry[0]) for entry in caches.values())
                if n:
                    counts[f"{name[len(prefix):]}.{attr}"] = n
    return counts


def _cache_entries(directory: str | None) -> int:
    """Entries (one per compiled kernel) in a Triton cache directory; 0 if it does not exist."""
    if not directory or not Path(directory).is_dir():
        return 0
    return sum(1 for _ in Path(directory).iterdir())


def warm_up_variants(engine) -> list[KernelVariant]:
    """The Triton kernel variants ``warm_up`` compiles ahead for ``engine``: those the mixed-step
    pieces of every token bucket launch and that are not compiled yet (the decode graphs' were
    compiled ahead when they were captured, at the engine's construction). Found by running the
    pieces with launches recorded (``compile_ahead.variants_of``); the pieces read the step's
    tables at fixed addresses and the kernels take ranks as runtime values, so the set depends on
    the model, dtype and token buckets, never on the adapters loaded or their ranks. Empty where
    nothing compiles (the CPU) or Triton cannot record launches."""
    with engine._step_lock:
        return variants_of(unit for _, unit in engine.runner.mixed_compile_units())


class EngineWarmUp:
    """``Engine.warm_up`` and the capture report."""

    def warm_up(self, *, prompt_len: int = 24, max_new_tokens: int = 2) -> dict[str, Any]:
        """Compile every kernel variant the steps need, concurrently (``warm_up_variants``, or on
        a restart of the same setup the list it found before, read from its record beside the
        on-disk cache: ``variant_record``; then ``compile_ahead.compile_variants``), build (on a GPU: capture) the mixed-step pieces of
        every token bucket, then run a few synthetic greedy requests through every kind of step,
        so first-time costs (Triton compiles or loads from the disk cache, graph captures,
        cuBLAS heuristics, attention kernels) are paid here and not by the first users. Rounds:
        the base alone, one adapter alone (the first by name), both in one batch, two of each
        with prompts 4x longer (tiles spanning rows); their cached prefix pages are dropped after.
        Neither the compiles nor the captures nor the rounds depend on the adapters' ranks (the
        kernels take ranks as runtime values): the work is the same for one rank as for eight,
        and an adapter of a rank loaded later needs nothing new. Returns what ran and what it
        cost: requests, rounds, ranks (of the adapters loaded), seconds (and of it
        ``compile_s``, ``mixed_pieces_s``, ``rounds_s``), ``compile_ahead`` (variants compiled
        ahead, workers, seconds, failures; ``source``: "record" (the list read from its record),
        "recorded" (found and kept) or "off"; ``record_s``, ``path``), ``decode_compile`` (the same
        for the decode graphs' variants, at the engine's construction), ``captures`` (``ModelRunner.capture_counts``: decode
        graph keys, mixed-piece token buckets, CUDA graphs), ``triton_kernels`` (compiled
        variants held) and ``triton_compiled`` (of those, new entries in the on-disk cache: fresh
        compiles; the rest were loaded). Call it before serving (``serve`` does, unless
        ``warm_up: false``)."""
        if prompt_len < 1 or max_new_tokens < 1:
            raise ConfigError(f"warm_up: prompt_len={prompt_len} and max_new_tokens={max_new_tokens} must be >= 1")
        t0 = time.perf_counter()
        cache_dir = os.environ.get("TRITON_CACHE_DIR")
        entries_before = _cache_entries(cache_dir)
        variants, found = recorded_variants(self, "mixed", lambda: warm_up_variants(self),
                                            use_record=self.config.tuning.kernel_variant_record == "on")
        log.info("warm-up: %d kernel variants to compile ahead (%s in %.1f s)", len(variants),
                 "read from their record" if found["source"] == "record" else "recorded", time.perf_counter() - t0)
        ahead = {**compile_variants(variants, self.device), **found}
        compile_s = time.perf_counter() - t0
        log.info("warm-up: compiled ahead in %.1f s (%s workers, %s failed)", compile_s, ahead.get("workers"),
                 ahead.get("failed"))
        # every token bucket's mixed-step pieces, built (captured) now rather than by the first
        # step of each bucket; one set per bucket serves any mix of ranks
        t_pieces = time.perf_counter()
        with self._step_lock:
            pieces = self.runner.build_mixed_pieces()
        pieces_s = time.perf_counter() - t_pieces
        log.info("warm-up: mixed-step pieces of %d token buckets built in %.1f s", pieces, pieces_s)
        t_rounds = time.perf_counter()
        adapters = sorted(self.adapters(), key=lambda a: a.name)
        rounds = self._warm_up_rounds([None, *(a.name for a in adapters[:1])], prompt_len, max_new_tokens)
        for i, batch in enumerate(rounds):
            t_round = time.perf_counter()
            self.generate(batch)
            log.info("warm-up: round %d/%d (%d requests) in %.1f s", i + 1, len(rounds), len(batch),
                     time.perf_counter() - t_round)
        freed = self.reset_prefix_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        rounds_s = time.perf_counter() - t_rounds
        seconds = time.perf_counter() - t0
        kernels = compiled_kernel_variants()
        report = {"requests": sum(map(len, rounds)), "rounds": len(rounds),
                  "ranks": sorted({a.rank for a in adapters}), "seconds": seconds, "compile_s": compile_s,
                  "compile_ahead": ahead, "rounds_s": rounds_s, "prefix_pages_freed": freed,
                  "mixed_piece_keys": pieces, "mixed_pieces_s": pieces_s,
                  "captures": self.runner.capture_counts(), "decode_graphs_s": self.runner.decode_graphs_s,
                  "decode_compile": self.runner.decode_compile or {},
                  "triton_kernels": sum(kernels.values()),
                  "triton_compiled": _cache_entries(cache_dir) - entries_before, "triton_cache_dir": cache_dir}
        self.warm_up_report = report
        log.info("warm-up in %.1f s (%d kernel variants compiled ahead by %d threads in %.1f s; mixed-step pieces "
                 "of %d token buckets %s in %.1f s; requests %.1f s): %s; Triton kernels: %d variants, %d compiled "
                 "fresh (cache %s)", seconds, ahead["variants"], ahead["workers"], compile_s, pieces,
                 "captured" if self.runner.mixed_pieces == "graphs" else "built", pieces_s, rounds_s,
                 format_capture_counts(report["captures"]), report["triton_kernels"], report["triton_compiled"],
                 cache_dir)
        return report

    def _warm_up_rounds(self, names: list[str | None], prompt_len: int,
                        max_new_tokens: int) -> list[list[GenerationRequest]]:
        """The synthetic requests of ``warm_up``, by round (each round one ``generate``)."""
        vocab = self.model_config.vocab_size
        pool = self.pool
        gen = torch.Generator().manual_seed(0)
        serial = iter(range(1 << 30))

        def request(adapter: str | None, length: int) -> GenerationRequest:
            # within the context, and within half of what the pool leaves beside the adapter (a
            # request that fits alone is admitted once the batch's others finish)
            pages = pool.num_pages - (pool.pages_for_adapter(self._adapters[adapter]) if adapter else 0)
            length = max(1, min(length, self.max_model_len - max_new_tokens - 1,
                                pages // 2 * pool.page_size - max_new_tokens))
            prompt = torch.randint(1, vocab, (length,), generator=gen).tolist()
            return GenerationRequest(prompt_token_ids=prompt, adapter=adapter, request_id=f"warm-up-{next(serial)}",
                                     sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                             ignore_eos=True))

        rounds = [[request(n, prompt_len)] for n in names]
        rounds.append([request(n, prompt_len) for n in names])
        rounds.append([request(n, 4 * prompt_len) for n in names for _ in range(2)])
        return rounds


def format_capture_counts(counts: dict[str, int]) -> str:
    """``ModelRunner.capture_counts`` as one log phrase."""
    return (f"{counts['decode_graph_keys']} decode graph keys, {counts['mixed_piece_keys']} mixed-step token "
            f"buckets, {counts['cuda_graphs']} CUDA graphs")
