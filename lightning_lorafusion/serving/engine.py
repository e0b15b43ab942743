"""The generation engine: requests in, tokens out; each step runs scheduler -> runner -> sampler.

This module wires the engine (pool, scheduler, runner) and holds its public API; ``Engine``
takes its other concerns from one class each: the step (``engine_step``), the output assembly
(``engine_output``), the loop thread and event sinks (``engine_loop``), the adapter registry
(``engine_adapters``) and the warm-up (``warm_up``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from ..model.decoder import DecoderConfig, embedding_device_dtype
from ..model.hf_loading import load_base_model, params_to, resolve_model_dir
from ..specs import ConfigError
from .adapters import HostAdapter, UnknownAdapterError
from .config import EngineConfig
from .detokenize import IncrementalDetokenizer
from .engine_adapters import AdapterRegistry, read_versions
from .engine_loop import EngineLoop, _LoopSink, log
from .engine_output import OutputAssembly
from .engine_step import EngineStep, _Launched, _SampledRows
from .decode_graphs import graph_token_limit
from .floor import FloorShape, StepLedger, base_weight_bytes
from .fused_weights import fuse_projection_weights
from .page_in_layers import page_in_groups
from .pool import UnifiedPool
from .pool_sizing import pool_pages
from .request import GenerationRequest, GenerationResult, RequestState, TokenEvent
from .runner import ModelRunner
from .sampling import LogitAdjustments, SamplingParams, SamplingRows
from .scheduler import Scheduler
from .step_times import StepClock
from .variant_record import recorded_variants
from .warm_up import EngineWarmUp, use_compile_caches


class Engine(AdapterRegistry, EngineLoop, EngineStep, OutputAssembly, EngineWarmUp):
    """Many LoRA adapters of one base model served in shared batches (S-LoRA style).

    ``generate`` drives the loop itself and blocks; ``stream`` (async) and the server use a
    background thread that steps while there is work. ``submit`` + ``step`` is the loop's
    synchronous interface. The pool, scheduler and runner are touched by the stepping thread
    only; ``submit``, ``abort`` and the adapter registry take a lock.

    The constructor serves an already-loaded base (``params`` as ``load_base_model`` returns,
    e.g. a training module's frozen weights: used in place when ``device`` and ``dtype`` match,
    no copy); ``from_pretrained`` loads one. ``tokenizer=None`` serves token ids only: results
    carry no text and ``stop`` strings are refused.
    """

    def __init__(self, model_config: DecoderConfig, params: Mapping[str, Any], tokenizer: Any,
                 config: EngineConfig | None = None, *, eos_token_ids: Iterable[int] | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        use_compile_caches()  # before the first kernel compiles (the decode graphs' capture below)
        self.config = config = config or EngineConfig()
        self.model_config = model_config
        base_device, base_dtype = embedding_device_dtype(params)  # plain or FP8 table
        self.device = torch.device(device) if device is not None else base_device
        self.dtype = dtype or base_dtype
        self.params = params_to(params, device=self.device, dtype=dtype)  # no cast unless asked
        if config.fuse_projections:
            fuse_projection_weights(self.params)  # before sizing the pool: the originals may stay alive
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = () if eos is None else (eos,)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.pool = UnifiedPool(num_pages=pool_pages(config, model_config, self.device, self.dtype),
                                page_size=config.page_size, num_layers=model_config.num_layers,
                                num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
                                dtype=self.dtype, device=self.device)
        self.scheduler = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   prefetch_depth=config.prefetch_depth,
                                   prefetch_ahead=config.tuning.prefetch_ahead == "on",
                                   watermark_pages=int(config.kv_watermark * self.pool.num_pages),
                                   prefix_caching=config.prefix_caching,
                                   chunked_prefill=config.enable_chunked_prefill,
                                   prefill_wait_steps=config.prefill_wait_steps,
                                   scheduling=config.scheduling,
                                   rope_switch=(model_config.rope_original_max_positions
                                                if model_config.rope_type == "longrope" else None))
        self.runner = ModelRunner(model_config, self.params, self.pool, backend=config.backend,
                                  decode_backend=config.tuning.decode_backend, max_decode_rows=config.max_num_seqs,
                                  prefill_attention=config.tuning.prefill_attention,
                                  max_batched_tokens=config.max_num_batched_tokens,
                                  nf4_gemm=config.tuning.nf4_gemm, decode_gemm=config.tuning.decode_gemm,
                                  token_bucket_mode=config.tuning.token_buckets,
                                  mixed_graph_max_tokens=graph_token_limit(
                                      config.tuning.mixed_graph_max_tokens,
                                      FloorShape.from_config(model_config).projection_params),
                                  prefill_lora_write=config.tuning.prefill_lora_write,
                                  decode_lora_beside=config.tuning.decode_lora_beside,
                                  max_pages_per_row=min(self.pool.pages_for_tokens(self.max_model_len),
                                                        self.pool.num_pages))
        self.runner.host_tables = config.tuning.host_tables
        self.pool.page_in_groups = page_in_groups(model_config.num_layers, config.tuning.page_in_wait)
        self.runner.capture_warm_up = config.tuning.capture_warm_up
        self.runner.attention_in_place = config.tuning.attention_in_place == "on"
        if self._use_cuda_graphs():
            seconds = self.runner.capture_decode_graphs(
                partial(recorded_variants, self, "decode", use_record=config.tuning.kernel_variant_record == "on"))
            log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.runner.buckets, seconds)
        mixed = self._mixed_pieces_mode()
        if mixed is not None:
            self.runner.use_mixed_pieces(mixed)
        self.warm_up_report: dict[str, Any] | None = None  # the last warm_up's
        self._adapters: dict[str, HostAdapter] = {}
        self._retired: list[HostAdapter] = []  # removed or replaced, freed once no request uses them
        # name -> its latest version (kept after removal; and across restarts with a versions file)
        self._versions: dict[str, int] = read_versions(config.adapter_versions_file)
        self._states: dict[str, RequestState] = {}  # every unfinished request
        self._incoming: deque[RequestState] = deque()
        self._aborts: deque[str] = deque()
        self._keep_results: dict[str, GenerationResult | None] = {}
        self._lock = threading.Lock()  # registry, incoming, aborts
        self._step_lock = threading.Lock()  # one step at a time
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        # asyncio loops that stream from this engine -> their per-step event batch
        self._sinks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopSink] = weakref.WeakKeyDictionary()
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        # the step loop's caches: the last decode-only step's rows and tokens, what sampling needs
        # of the current batch, and single tokens' texts (detokenize.add_tokens)
        self._last_sampled: tuple[list[RequestState], list[int]] | None = None
        # overlapped decode (EngineTuning.async_decode): the step launched and not yet read,
        # whose tokens the next call emits
        overlap = config.tuning.async_decode
        self._overlap = overlap == "on" or (overlap == "auto" and self.device.type == "cuda")
        # with it, steps that admit requests are planned ahead too (EngineTuning.mixed_ahead)
        self._mixed_ahead = self._overlap and config.tuning.mixed_ahead == "on"
        self._inflight: _Launched | None = None
        self._rows: _SampledRows | None = None
        self._token_texts: dict[int, str] = {}
        self._ledger: StepLedger | None = None  # what each step did, while enable_step_ledger's is on
        self._counters = {"generated_tokens_total": 0, "prompt_tokens_total": 0, "requests_total": 0,
                          "steps_total": 0, "prefill_steps_total": 0, "step_rows_total": 0,
                          # host seconds inside steps that ran a forward (each ends when the tokens
                          # it emits reach the host: its own, or with the overlapped decode the
                          # previous step's, so this is about the device's busy time too); wall time
                          # minus this is time the engine had nothing to run
                          "step_seconds_total": 0.0, "prefill_step_seconds_total": 0.0,
                          # arrival at the engine to the first generated token, summed over requests
                          "ttft_seconds_total": 0.0, "first_tokens_total": 0,
                          "nonfinite_logits_total": 0,  # requests aborted for NaN / inf logits
                          # overlapped decode: steps launched before the previous step's tokens
                          # were read (decode-only, and with prefill rows: mixed_ahead), and
                          # their rows discarded (the request stopped meanwhile)
                          "decode_steps_ahead_total": 0, "mixed_steps_ahead_total": 0,
                          "decode_rows_discarded_total": 0}

    def _use_cuda_graphs(self) -> bool:
        mode = self.config.cuda_graphs
        able = self.device.type == "cuda" and self.runner.kernel_backend == "triton"
        if mode == "on" and not able:
            raise ConfigError(f"EngineConfig.cuda_graphs='on' needs a CUDA device and the Triton decode kernels; "
                              f"this engine runs on {self.device} with decode backend "
                              f"{self.runner.kernel_backend!r} (use 'auto' or 'off')")
        return mode == "on" or (mode == "auto" and able)

    def _mixed_pieces_mode(self) -> str | None:
        """``EngineTuning.mixed_graphs`` -> the runner's mode: "graphs", "eager" or None (off)."""
        mode = self.config.tuning.mixed_graphs
        able = self.runner.can_capture_mixed
        if mode == "on" and not able:
            raise ConfigError(f"EngineTuning.mixed_graphs='on' needs a CUDA device and the Triton kernels; this "
                              f"engine runs on {self.device} with backend {self.runner.lora_backend!r} "
                              "(use 'auto', 'eager' or 'off')")
        if mode == "on" or (mode == "auto" and able and self._use_cuda_graphs()):
            return "graphs"
        return "eager" if mode == "eager" else None

    @classmethod
    def from_pretrained(cls, base_model: str, adapters: Mapping[str, str] | None = None,
                        config: EngineConfig | None = None, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> "Engine":
        """``base_model``: a local HF directory or a built-in name (as in ``fit``); ``adapters``:
        name -> PEFT adapter directory. Default device: CUDA if available; default dtype: bf16
        on CUDA, fp32 on CPU."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model_config, params, tokenizer = load_base_model(base_model, dtype=dtype)
        engine = cls(model_config, params, tokenizer, config, device=device, dtype=dtype,
                     eos_token_ids=_generation_eos(resolve_model_dir(base_model), tokenizer))
        for name, path in (adapters or {}).items():
            engine.add_adapter(name, path)
        return engine

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenerationRequest,
               on_event: Callable[[TokenEvent], None] | None = None) -> str:
        """Queue a request; returns its id. Bad requests raise here and touch nothing else."""
        with self._lock:
            state = self._new_state(request, on_event)
            self._states[request.request_id] = state
            self._incoming.append(state)
            self._counters["requests_total"] += 1
            self._wake.notify_all()
        return request.request_id

    def _new_state(self, request: GenerationRequest, on_event) -> RequestState:
        """Validate and build (caller holds ``_lock``)."""
        rid = request.request_id
        if rid in self._states:
            raise ConfigError(f"request id {rid!r} is already in use by an unfinished request")
        adapter = None
        if request.adapter is not None:
            adapter = self._adapters.get(request.adapter)
            if adapter is None:
                raise UnknownAdapterError(request.adapter, list(self._adapters))
        prompt = request.prompt_token_ids
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ConfigError(f"request {rid!r}: prompt token ids must be in [0, {vocab}); got "
                              f"min {min(prompt)}, max {max(prompt)}")
        if len(prompt) >= self.max_model_len:
            raise ConfigError(f"request {rid!r}: the prompt has {len(prompt)} tokens; the model's context "
                              f"is {self.max_model_len} (prompt + generated tokens)")
        sp = request.sampling
        if sp.logit_bias and sp.logit_bias[-1][0] >= vocab:  # sorted by token id
            raise ConfigError(f"request {rid!r}: logit_bias token ids must be in [0, {vocab}); got "
                              f"{sp.logit_bias[-1][0]}")
        if sp.stop and self.tokenizer is None:
            raise ConfigError(f"request {rid!r}: stop strings need a tokenizer; this engine has none "
                              "(use stop_token_ids)")
        longest = min(len(prompt) + sp.max_new_tokens, self.max_model_len)
        pages = self.pool.pages_for_tokens(longest) + (self.pool.pages_for_adapter(adapter) if adapter else 0)
        if pages > self.pool.num_pages:
            raise ConfigError(f"request {rid!r} can never fit the pool: {len(prompt)} prompt + up to "
                              f"{sp.max_new_tokens} new tokens (and its adapter) need {pages} pages of "
                              f"{self.pool.num_pages}; lower max_new_tokens or enlarge the pool")
        seed = None
        if not sp.greedy:  # sampling.uniform_draws takes seeds in [0, 2^62)
            seed = sp.seed % (1 << 62) if sp.seed is not None else \
                int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        _check_step_inputs(rid, sp, seed, prompt, vocab)
        return RequestState(
            request=request, adapter=adapter, seed=seed, on_event=on_event,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, sp.stop, min_tokens=sp.min_tokens),
            eos_token_ids=frozenset() if sp.ignore_eos else self.eos_token_ids,
            max_total_len=self.max_model_len)

    def abort(self, request_id: str) -> None:
        """Stop a request; it ends with an event whose finish_reason is "abort" (no-op if done)."""
        with self._lock:
            self._aborts.append(request_id)
            self._wake.notify_all()

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion (batched with each other and with anything else in
        flight); results in the order given. All are validated before any is queued."""
        if len({r.request_id for r in requests}) != len(requests):
            raise ConfigError("generate: request ids must be unique")
        with self._lock:
            for r in requests:
                self._new_state(r, None)
        done = threading.Event()
        pending = {r.request_id for r in requests}

        def on_event(event: TokenEvent) -> None:
            if event.finish_reason is not None:
                pending.discard(event.request_id)
                if not pending:
                    done.set()

        for r in requests:
            self._keep_results[r.request_id] = None
            self.submit(r, on_event)
        if self._thread is not None and self._thread.is_alive():
            done.wait()
        else:
            while pending:
                self.step()
        return [self._keep_results.pop(r.request_id) for r in requests]

    @property
    def async_decode(self) -> bool:
        """Whether decode-only steps overlap the host (``EngineTuning.async_decode`` resolved for
        this device: ``auto`` is on for CUDA)."""
        return self._overlap

    @property
    def mixed_ahead(self) -> bool:
        """Whether steps that admit requests are planned and launched before the running step's
        tokens are read too (``EngineTuning.mixed_ahead``; only with the overlapped decode).
        Settable between steps (benchmarks compare both)."""
        return self._mixed_ahead

    @mixed_ahead.setter
    def mixed_ahead(self, on: bool) -> None:
        with self._step_lock:
            self._mixed_ahead = bool(on) and self._overlap

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page no running request holds (vLLM's reset_prefix_cache):
        later prompts are prefilled from scratch. Returns the pages freed."""
        with self._step_lock:
            return self.pool.drop_cached_prefixes()

    def step(self) -> list[TokenEvent]:
        """One iteration: admit, run one forward over prefill + decode rows, sample, emit.

        With the overlapped decode (``EngineTuning.async_decode``) every step is launched and
        left running: the next call launches the decode step after it when it can
        (``Scheduler.plan_ahead``), then reads and emits the running one's tokens; so a call
        returns the events of the step before the one it launched."""
        with self._step_lock:
            try:
                return self._step()
            finally:
                self._flush_sinks()

    # ------------------------------------------------------------------ stats

    def enable_step_ledger(self) -> StepLedger:
        """Record, from the next step on, what each step does (``StepLedger``: prefill pieces
        and their context, decode rows and the KV they read, distinct adapters with their ranks,
        and the byte sizes of the base weights and of a KV token) into a new ledger, returned
        and kept as ``step_ledger()`` until ``disable_step_ledger``; and each step's kind, wall
        time, host phases and (CUDA) device time, and the time between steps, in its ``clock``
        (``floor.breakdown`` reads them). Host bookkeeping and two CUDA events per step,
        read after the run; the outputs are unchanged."""
        cfg = self.model_config
        self._ledger = StepLedger(base_weight_bytes=base_weight_bytes(self.params),
                                  kv_bytes_per_token=cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
                                  * self.pool.kv.element_size(),
                                  adapter_elem_bytes=self.pool.storage.element_size(),
                                  clock=StepClock(cuda=self.device.type == "cuda", device=self.device))
        return self._ledger

    def disable_step_ledger(self) -> StepLedger | None:
        """Stop recording (after the step under way, if any); returns the ledger recorded so far."""
        with self._step_lock:
            ledger, self._ledger = self._ledger, None
        return ledger

    def step_ledger(self) -> StepLedger | None:
        """The ledger being recorded (``enable_step_ledger``), or None."""
        return self._ledger

    def stats(self) -> dict[str, Any]:
        pool = self.pool
        with self._lock:
            waiting = len(self._incoming) + len(self.scheduler.waiting)
        return {
            "running": len(self.scheduler.running),
            "waiting": waiting,
            **self._counters,
            "adapters_loaded": len(self._adapters),
            "adapters_resident": len(pool.resident_adapters()),
            "adapter_page_ins_total": pool.page_ins,
            "adapter_evictions_total": pool.evictions,
            # adapters paged in ahead of admission; admissions that found theirs so (hits) or
            # paged it in themselves, the step waiting on the copy (misses); prefetched, then
            # evicted unused (wasted)
            "adapter_prefetches_total": pool.prefetch_page_ins,
            "adapter_prefetch_hits_total": pool.prefetch_hits,
            "adapter_prefetch_misses_total": self.scheduler.prefetch_misses,
            "adapter_prefetch_wasted_total": pool.prefetch_wasted,
            "adapter_pages_used": pool.adapter_pages_used,
            "kv_pages_used": pool.kv_pages_used,
            "kv_pages_total": pool.num_pages,
            "pages_free": pool.num_free,
            "kv_pages_moved_total": pool.pages_moved,
            "preemptions_total": self.scheduler.num_preemptions,
            "rope_recomputes_total": self.scheduler.rope_recomputes,
            "prefill_chunks_total": self.scheduler.prefill_chunks,
            "prefill_held_steps_total": self.scheduler.held_steps,
            "prefix_cache_hits_total": self.scheduler.prefix_cache_hits,
            "prefix_tokens_reused_total": self.scheduler.prefix_tokens_reused,
            "prefix_pages_cached": pool.kv_pages_cached,
            "prefix_pages_evicted_total": pool.prefix_evictions,
            **self.runner.capture_counts(),  # what is captured (built) now, by kind
            "warm_up_seconds": self.warm_up_report["seconds"] if self.warm_up_report else 0.0,
        }



def _check_step_inputs(rid: str, sp: SamplingParams, seed: int | None, prompt: tuple[int, ...], vocab: int) -> None:
    """Build this one request's sampling rows on the CPU, as a step builds them for its batch:
    whatever its settings cannot become (a value no tensor holds, a bad type) fails here, for this
    request alone, and never a batched step that carries every other user's request."""
    if not isinstance(sp, SamplingParams):
        raise ConfigError(f"request {rid!r}: sampling must be a SamplingParams, got {type(sp).__name__}")
    try:
        sp.check_ranges()  # again: a frozen dataclass can still be changed behind its back
    except ConfigError as e:
        raise ConfigError(f"request {rid!r}: {e}") from None
    cpu = torch.device("cpu")
    try:
        SamplingRows.build([sp], [seed], [0], cpu)
        if sp.adjusts_logits:
            LogitAdjustments([0], [sp], [prompt], [[]], vocab, cpu, [tuple(sp.stop_token_ids)])
    except Exception as e:  # noqa: BLE001 - any failure here is this request's own
        raise ConfigError(f"request {rid!r}: its sampling settings cannot be run: {type(e).__name__}: "
                          f"{str(e)[:200]}") from None


def _generation_eos(model_dir: Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids of the model: generation_config.json's (may be a list) plus the tokenizer's."""
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
