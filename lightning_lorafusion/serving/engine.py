"""The generation engine: requests in, tokens out; each step runs scheduler -> runner -> sampler."""

from __future__ import annotations

import asyncio
import json
import logging
import operator
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Mapping

import torch

from ..model.decoder import DecoderConfig, embedding_device_dtype
from ..model.hf_loading import load_base_model, params_to, resolve_model_dir
from ..specs import ConfigError
from .adapters import AdapterInfo, HostAdapter, UnknownAdapterError, host_adapter_from_factors, load_peft_adapter
from .checkpoint import read_checkpoint_adapters
from .config import EngineConfig
from .detokenize import IncrementalDetokenizer, add_tokens
from .fused_weights import fuse_projection_weights
from .pool import UnifiedPool
from .request import GenerationRequest, GenerationResult, RequestState, Status, TokenEvent
from .runner import ModelRunner
from .sampling import LogitAdjustments, SamplingParams, SamplingRows, sample_rows_checked, token_logprobs
from .scheduler import Scheduler

log = logging.getLogger("lightning_lorafusion.serving")

# Rows of prompt logits materialised at once when scoring prompts ([rows, vocab] fp32).
PROMPT_LOGPROB_CHUNK = 512
# Activation headroom kept out of the pool on CUDA, beyond the per-token estimate.
CUDA_HEADROOM_BYTES = 512 * 2**20
# rank blocks (16, 32, 64, 128) a padded mixed step's pieces may be captured for
MIXED_RANK_BLOCKS = 4


class _LoopSink:
    """Events bound for one asyncio loop, handed over once per engine step (one
    ``call_soon_threadsafe`` wake-up for all of a step's rows instead of one per token: under
    load the loop thread otherwise spends its time, and the GIL, on wake-ups)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[tuple[asyncio.Queue, TokenEvent]] = []

    def push(self, queue: asyncio.Queue, event: TokenEvent) -> None:
        self.pending.append((queue, event))

    def flush(self) -> None:
        batch, self.pending = self.pending, []
        if batch:
            try:
                self.loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _deliver(batch: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)


class Engine:
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
        self.pool = UnifiedPool(num_pages=self._pool_pages(), page_size=config.page_size,
                                num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                                head_dim=model_config.head_dim, dtype=self.dtype, device=self.device)
        self.scheduler = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   prefetch_depth=config.prefetch_depth,
                                   watermark_pages=int(config.kv_watermark * self.pool.num_pages),
                                   prefix_caching=config.prefix_caching,
                                   chunked_prefill=config.enable_chunked_prefill,
                                   prefill_wait_steps=config.prefill_wait_steps)
        self.runner = ModelRunner(model_config, self.params, self.pool, backend=config.backend,
                                  decode_backend=config.decode_backend, max_decode_rows=config.max_num_seqs,
                                  prefill_attention=config.prefill_attention,
                                  max_batched_tokens=config.max_num_batched_tokens,
                                  max_pages_per_row=min(self.pool.pages_for_tokens(self.max_model_len),
                                                        self.pool.num_pages))
        if self._use_cuda_graphs():
            seconds = self.runner.capture_decode_graphs()
            log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.runner.buckets, seconds)
        mixed = self._mixed_pieces_mode()
        if mixed is not None:
            self.runner.use_mixed_pieces(mixed)
        self._adapters: dict[str, HostAdapter] = {}
        self._retired: list[HostAdapter] = []  # removed, freed once no request uses them
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
        # overlapped decode (EngineConfig.async_decode): the step launched and not yet read,
        # whose tokens the next call emits
        self._overlap = config.async_decode == "on" or (config.async_decode == "auto" and self.device.type == "cuda")
        self._inflight: _Launched | None = None
        self._rows: _SampledRows | None = None
        self._token_texts: dict[int, str] = {}
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
                          # were read, and their rows discarded (the request stopped meanwhile)
                          "decode_steps_ahead_total": 0, "decode_rows_discarded_total": 0}

    def _use_cuda_graphs(self) -> bool:
        mode = self.config.cuda_graphs
        able = self.device.type == "cuda" and self.runner.kernel_backend == "triton"
        if mode == "on" and not able:
            raise ConfigError(f"EngineConfig.cuda_graphs='on' needs a CUDA device and the Triton decode kernels; "
                              f"this engine runs on {self.device} with decode backend "
                              f"{self.runner.kernel_backend!r} (use 'auto' or 'off')")
        return mode == "on" or (mode == "auto" and able)

    def _mixed_pieces_mode(self) -> str | None:
        """``EngineConfig.mixed_graphs`` -> the runner's mode: "graphs", "eager" or None (off)."""
        mode = self.config.mixed_graphs
        able = self.runner.can_capture_mixed
        if mode == "on" and not able:
            raise ConfigError(f"EngineConfig.mixed_graphs='on' needs a CUDA device and the Triton kernels; this "
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

    # ------------------------------------------------------------------ adapters

    def add_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load a PEFT LoRA directory into host memory (pinned on CUDA); it is paged into the GPU
        pool when a request needs it."""
        with self._lock:
            if name in self._adapters:
                raise ConfigError(f"adapter {name!r} is already loaded; remove_adapter({name!r}) first")
        adapter = load_peft_adapter(name, path, self.model_config, dtype=self.dtype,
                                    pin=self.device.type == "cuda")
        adapter.check_finite()
        return self._register(adapter)

    def add_adapter_weights(self, name: str, factors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                            *, rank: int, alpha: float) -> AdapterInfo:
        """Register an adapter from tensors: ``factors[(layer, module)] = (lora_A [r, in],
        lora_B [out, r])`` for every layer of each targeted module (e.g. from a training
        checkpoint's adapter bank); copied to host memory like ``add_adapter``."""
        with self._lock:
            if name in self._adapters:
                raise ConfigError(f"adapter {name!r} is already loaded; remove_adapter({name!r}) first")
        on_host = {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in factors.items()}
        adapter = host_adapter_from_factors(name, on_host, rank=rank, alpha=alpha, config=self.model_config,
                                            dtype=self.dtype, pin=self.device.type == "cuda")
        adapter.check_finite()
        return self._register(adapter)

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
        hosts = [host_adapter_from_factors(a.name, a.factors, rank=a.rank, alpha=a.alpha, config=self.model_config,
                                           dtype=self.dtype, pin=self.device.type == "cuda",
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

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Yield the request's events as the background loop produces them (one per token, the
        last with ``finish_reason``). Closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        with self._lock:
            sink = self._sinks.get(loop)
            if sink is None:
                sink = self._sinks[loop] = _LoopSink(loop)
        rid = self.submit(request, lambda ev: sink.push(queue, ev))
        self.start()
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished:
                self.abort(rid)

    # ------------------------------------------------------------------ background loop

    def start(self) -> None:
        """Start the background loop thread (idempotent); ``stream`` calls it."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="lorafusion-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the background loop (unfinished requests stay queued)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def async_decode(self) -> bool:
        """Whether decode-only steps overlap the host (``EngineConfig.async_decode`` resolved for
        this device: ``auto`` is on for CUDA)."""
        return self._overlap

    def has_work(self) -> bool:
        """Whether ``step()`` has anything left to do: requests waiting, running or being aborted,
        adapters being retired, or a launched step whose tokens were not read yet."""
        return self._has_work()

    def _has_work(self) -> bool:
        return bool(self._incoming or self._aborts or self._retired or self._inflight is not None
                    or self.scheduler.has_work())

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                if not self.step() and not self.scheduler.running:
                    time.sleep(0.001)  # nothing could run (e.g. waiting for a removal): do not spin
            except Exception:  # a bug must not leave callers waiting forever
                log.exception("engine step failed; aborting every unfinished request")
                with self._step_lock:
                    self._inflight = None
                    for state in list(self._states.values()):
                        self._finish(state, "abort", [])
                    self._flush_sinks()

    # ------------------------------------------------------------------ one step

    def warm_up(self, *, prompt_len: int = 24, max_new_tokens: int = 2) -> dict[str, Any]:
        """Run a few synthetic greedy requests through every kind of step the loaded adapters
        make, so first-time costs (Triton compiles per rank block and launch specialisation, the
        first replays of the decode graphs, cuBLAS heuristics) are paid here and not by the first
        users (an H100 measured 1-3 s stalls for a step whose mix of ranks was new to the process,
        docs/BENCHMARKS.md, generation engine). Batches: the base and one adapter of each distinct
        rank alone; all of them in one batch; two of each with prompts 4x longer (tiles spanning
        rows, two requests per adapter). Then drops the prompts' cached prefix pages, and builds
        (on a GPU: captures) the mixed-step pieces of every token bucket for the adapters' rank
        blocks (``ModelRunner.build_mixed_pieces``). Returns what ran. Call it before serving
        (``serve`` does, unless ``warm_up: false``)."""
        if prompt_len < 1 or max_new_tokens < 1:
            raise ConfigError(f"warm_up: prompt_len={prompt_len} and max_new_tokens={max_new_tokens} must be >= 1")
        t0 = time.perf_counter()
        by_rank: dict[int, str] = {}
        for info in sorted(self.adapters(), key=lambda a: a.name):
            by_rank.setdefault(info.rank, info.name)
        names: list[str | None] = [None, *(by_rank[r] for r in sorted(by_rank))]
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
        for batch in rounds:
            self.generate(batch)
        freed = self.reset_prefix_cache()
        # mixed steps as pieces: every token bucket's, for the rank blocks these adapters make,
        # built (captured) now rather than by the first step of each (bucket, rank block)
        t_pieces = time.perf_counter()
        with self._step_lock:
            pieces = self.runner.build_mixed_pieces(by_rank)
        pieces_s = time.perf_counter() - t_pieces
        if pieces:
            log.info("mixed-step pieces: %d (token bucket, rank block) keys %s in %.1f s", pieces,
                     "captured" if self.runner.mixed_pieces == "graphs" else "built", pieces_s)
        seconds = time.perf_counter() - t0
        ranks = sorted(by_rank)
        return {"requests": sum(map(len, rounds)), "rounds": len(rounds), "ranks": ranks, "seconds": seconds,
                "prefix_pages_freed": freed, "mixed_piece_keys": pieces, "mixed_pieces_s": pieces_s}

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page no running request holds (vLLM's reset_prefix_cache):
        later prompts are prefilled from scratch. Returns the pages freed."""
        with self._step_lock:
            return self.pool.drop_cached_prefixes()

    def step(self) -> list[TokenEvent]:
        """One iteration: admit, run one forward over prefill + decode rows, sample, emit.

        With the overlapped decode (``EngineConfig.async_decode``) every step is launched and
        left running: the next call launches the decode step after it when it can
        (``Scheduler.plan_ahead``), then reads and emits the running one's tokens; so a call
        returns the events of the step before the one it launched."""
        with self._step_lock:
            try:
                return self._step()
            finally:
                self._flush_sinks()

    def _flush_sinks(self) -> None:
        """Hand this step's events to the asyncio loops streaming them (caller holds ``_step_lock``)."""
        with self._lock:
            sinks = list(self._sinks.values())
        for sink in sinks:
            sink.flush()

    def _step(self) -> list[TokenEvent]:
        """The step itself (caller holds ``_step_lock``)."""
        events: list[TokenEvent] = []
        self._take_incoming(events)
        self._retire_adapters()
        running, self._inflight = self._inflight, None
        plan = None
        now = time.perf_counter()
        if running is not None:  # a step is on the device: launch the next one first
            if self.pool.pages_moved == running.pages_moved:  # (a prefetch's page-in may move them)
                plan = self.scheduler.plan_ahead(running.seqs)
            if plan is None:  # the next step depends on its tokens
                self._complete(running, events)
                running = None
            else:
                self._counters["decode_steps_ahead_total"] += 1
        if plan is None:
            plan = self.scheduler.schedule()
            if plan.empty:
                return events
        for state in plan.prefill:
            if state.first_scheduled is None:
                state.first_scheduled = now
                self._counters["prompt_tokens_total"] += len(state.request.prompt_token_ids)
        with torch.no_grad():
            self._run(plan, events, running)
            if running is not None:
                self.scheduler.prefetch()  # after the launch: a page-in may move KV pages
                self._complete(running, events)
        seconds = time.perf_counter() - now
        counters = self._counters
        counters["steps_total"] += 1
        counters["step_rows_total"] += len(plan.prefill) + len(plan.decode)
        counters["step_seconds_total"] += seconds
        if plan.prefill:  # steps with prefill rows run eagerly (decode-only steps replay CUDA graphs where captured)
            counters["prefill_steps_total"] += 1
            counters["prefill_step_seconds_total"] += seconds
        return events

    def _run(self, plan, events: list[TokenEvent], running: "_Launched | None" = None) -> None:
        """Run ``plan``'s forward, sample and emit; under the overlapped decode the step is
        launched and left in ``_inflight`` instead (``_complete`` emits it). ``running``: the
        step still on the device whose rows ``plan`` continues (``Scheduler.plan_ahead``; a
        decode-only step, or a step with prefill rows whose prefills all completed): its
        sampled tokens are this step's inputs."""
        last, self._last_sampled = self._last_sampled, None
        if plan.prefill:
            batch = self.runner.prepare(plan.prefill, plan.decode, plan.prefill_lens)
            hidden = self.runner.forward(batch)
            seqs, last_rows = [], []  # requests that sample a token this step, and their rows
            for state, n, (start, end) in zip(plan.prefill, plan.prefill_lens, batch.spans):
                if state.wants_prompt_logprobs:
                    self._prompt_logprobs(state, hidden[start:end], state.num_cached)
                state.num_cached += n
                self.scheduler.register_computed_pages(state)
                if state.num_cached == state.num_tokens:  # its prefill is complete (else a chunk ran)
                    seqs.append(state)
                    last_rows.append(end - 1)
            seqs += plan.decode
            last_rows += [end - 1 for _, end in batch.spans[len(plan.prefill):]]
            if not seqs:
                return
            logits = self.runner.logits(hidden.index_select(0, torch.tensor(last_rows, device=self.device)))
        elif running is not None:  # decode only, fed the running step's tokens on the device
            seqs = plan.decode
            fed = running.tokens
            if len(seqs) != len(running.seqs):  # rows that end with the running step left out
                ids = set(map(id, seqs))
                keep = [i for i, st in enumerate(running.seqs) if id(st) in ids]
                fed = fed.index_select(0, torch.tensor(keep, pin_memory=fed.is_cuda).to(fed.device, non_blocking=True))
            logits = self.runner.decode_logits(seqs, token_tensor=fed)
        else:  # decode only: a CUDA graph replay where captured
            seqs = plan.decode
            # the previous step sampled these very rows: their tokens are the inputs
            same = last is not None and len(last[0]) == len(seqs) and all(map(operator.is_, seqs, last[0]))
            logits = self.runner.decode_logits(seqs, last[1] if same else None)
        rows = self._sampled_rows(seqs, ahead=running is not None)
        adjust = rows.adjust
        # finite: no NaN / +inf in the row's logits (read off the argmax's pass; a bias or penalty
        # keeps NaN and inf as they are)
        tokens, finite = sample_rows_checked(logits if adjust is None else adjust.apply(logits), rows.sampling)
        if adjust is not None:
            adjust.note(tokens)
        chosen = top_vals = top_ids = None
        if rows.top_n is not None:
            lp_logits, lp_tokens = logits, tokens
            if rows.logprob_index is not None:  # only the rows that asked
                lp_logits, lp_tokens = logits.index_select(0, rows.logprob_index), tokens[rows.logprob_index]
            chosen, top_vals, top_ids = token_logprobs(lp_logits, lp_tokens, rows.top_n)
        for state in plan.decode:
            state.num_cached += 1
        # a row whose logits are not finite (an overflow in its adapter, say) gets token -1:
        # that request ends ("abort", logged), the others go on
        launched = _Launched(seqs, rows, tokens, torch.where(finite, tokens, -1), chosen, top_vals, top_ids,
                             self.pool.pages_moved, decode_only=not plan.prefill)
        if self._overlap:
            self._inflight = launched
            return
        self._complete(launched, events)

    def _complete(self, launched: "_Launched", events: list[TokenEvent]) -> None:
        """Read a launched step's tokens (waiting for the device) and emit them."""
        tokens, chosen, top_vals, top_ids = launched.read()
        if launched.decode_only:
            self._last_sampled = (launched.seqs, tokens)
        self._emit(launched.seqs, tokens, launched.rows, chosen, top_vals, top_ids, events)

    def _sampled_rows(self, seqs: list[RequestState], ahead: bool = False) -> "_SampledRows":
        """What sampling needs of ``seqs``, reused while the batch keeps the same requests in
        the same order (decode steps between arrivals and finishes). ``ahead``: each row has one
        token more than its state holds (a step planned ahead; the rows are then all rows of the
        last composition, whose device-side counts already hold that token)."""
        rows = self._rows
        if rows is None or len(rows.states) != len(seqs) or not all(map(operator.is_, seqs, rows.states)):
            rows = self._rows = _SampledRows(seqs, self.device, self.model_config.vocab_size, previous=rows,
                                             ahead=int(ahead))
        return rows

    def _emit(self, seqs: list[RequestState], tokens: list[int], rows: "_SampledRows", chosen: list[float] | None,
              top_vals: list[list[float]] | None, top_ids: list[list[int]] | None, events: list[TokenEvent]) -> None:
        """Record each row's sampled token (its text already given to the detokenizer unless it
        is a stop token) and emit its event, finishing the requests that stop on it: on a stop
        token or stop string ("stop"), at ``max_output`` tokens ("length"). This loop runs for
        every row of every step: per-request constants only, no calls it can avoid."""
        if self.tokenizer is not None:  # every row's text in one batched decode, except rows that end on this token
            if rows.all_generate and rows.stop_ids.isdisjoint(tokens) and min(tokens) >= 0:  # the common case
                items = zip(rows.detokenizers, tokens)
            else:
                items = [(st.detokenizer, t) for st, t in zip(seqs, tokens)
                         if t not in st.stop_ids and st.max_output and t >= 0]
            add_tokens(items, self._token_texts)
        now = time.perf_counter()
        generated = first = 0
        ttft = 0.0
        lp_row = rows.logprob_row
        for i, (state, token) in enumerate(zip(seqs, tokens)):
            if state.status is FINISHED:  # stopped (or aborted) after this step was launched: discarded
                self._counters["decode_rows_discarded_total"] += 1
                continue
            if not state.max_output:  # scoring the prompt only
                self._finish(state, "length", events)
                continue
            if token < 0:
                self._counters["nonfinite_logits_total"] += 1
                log.error("request %r (adapter %r): its logits are not finite (NaN or inf) after %d tokens; it "
                          "is aborted", state.request_id, state.request.adapter, len(state.output_ids))
                state.cacheable = False  # its KV may hold NaN: never reused
                self.pool.forget_prefixes(state.pages)
                self._finish(state, "abort", events)
                continue
            out = state.output_ids
            out.append(token)
            generated += 1
            if state.first_token is None:
                state.first_token = now
                first += 1
                ttft += now - state.arrival
            lp = top = None
            if state.logprobs is not None:
                j = lp_row[i]
                want = state.sampling.logprobs
                lp = chosen[j]
                top = {} if not want else dict(zip(top_ids[j][:want], top_vals[j][:want]))
                state.logprobs.append(lp)
                state.top_logprobs.append(top)
            detok = state.detokenizer
            if token in state.stop_ids or detok.stopped:
                self._finish(state, "stop", events, token=token, logprob=lp, top=top)
            elif len(out) >= state.max_output:
                self._finish(state, "length", events, token=token, logprob=lp, top=top)
            else:
                event = TokenEvent._make((state.request.request_id, token, detok.take_delta(), lp, top, None))
                events.append(event)
                if state.on_event is not None:
                    state.on_event(event)
        counters = self._counters
        counters["generated_tokens_total"] += generated
        if first:
            counters["first_tokens_total"] += first
            counters["ttft_seconds_total"] += ttft

    def _prompt_logprobs(self, state: RequestState, hidden: torch.Tensor, first: int) -> None:
        """Each prompt token's logprob given the tokens before it (None for the first), and with
        ``prompt_logprobs=k > 0`` the k most likely tokens at each position. ``hidden`` ``[n, H]``:
        the rows of positions ``first .. first + n - 1`` (a prefill chunk, or the whole prompt),
        whose logits score prompt tokens ``first + 1 ..``; complete once the last is scored."""
        prompt = state.request.prompt_token_ids
        p, k = len(prompt), state.sampling.prompt_logprobs
        if first == 0:  # (again, after a preemption)
            state.partial_prompt_logprobs = ([None], [None])
        chosen, tops = state.partial_prompt_logprobs
        rows = min(hidden.shape[0], p - 1 - first)
        targets = torch.tensor(prompt[first + 1:first + 1 + rows], device=self.device)
        for c in range(0, rows, PROMPT_LOGPROB_CHUNK):
            lp = torch.log_softmax(self.runner.logits(hidden[c:min(c + PROMPT_LOGPROB_CHUNK, rows)]), dim=-1)
            chosen += lp.gather(1, targets[c:c + lp.shape[0], None]).squeeze(1).tolist()
            if k:
                values, ids = lp.topk(k, dim=-1)
                tops += [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                tops += [{} for _ in range(lp.shape[0])]
        if len(chosen) == p:
            state.prompt_logprobs, state.prompt_top_logprobs = chosen, tops
            state.partial_prompt_logprobs = None

    def _finish(self, state: RequestState, reason: str, events: list[TokenEvent], *, token: int | None = None,
                logprob: float | None = None, top: dict[int, float] | None = None) -> None:
        if state.status is Status.FINISHED:
            return
        self.scheduler.finish(state)
        state.finish_reason = reason
        state.finished = time.perf_counter()
        with self._lock:
            self._states.pop(state.request_id, None)
            if state.request_id in self._keep_results:
                self._keep_results[state.request_id] = state.result()
        event = TokenEvent(state.request_id, token, state.detokenizer.take_delta(final=True), logprob, top,
                           reason)
        events.append(event)
        if state.on_event is not None:
            state.on_event(event)

    def _take_incoming(self, events: list[TokenEvent]) -> None:
        with self._lock:
            incoming, aborts = list(self._incoming), list(self._aborts)
            self._incoming.clear()
            self._aborts.clear()
        for state in incoming:
            self.scheduler.add(state)
        for rid in aborts:
            state = self._states.get(rid)
            if state is not None:
                self._finish(state, "abort", events)

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

    # ------------------------------------------------------------------ sizes and stats

    def _pool_pages(self) -> int:
        cfg, mc = self.config, self.model_config
        elt = torch.empty((), dtype=self.dtype).element_size()
        page_bytes = mc.num_layers * 2 * cfg.page_size * mc.kv_size * elt
        if cfg.num_pages is not None:
            return cfg.num_pages
        if self.device.type != "cuda":
            return max(1, cfg.cpu_pool_mib * 2**20 // page_bytes)
        free, _ = torch.cuda.mem_get_info(self.device)
        per_token = (4 * mc.hidden_size + 3 * mc.intermediate_size + mc.q_size + 2 * mc.kv_size) * elt * 2
        reserve = (cfg.max_num_batched_tokens * per_token + CUDA_HEADROOM_BYTES
                   + (cfg.max_num_seqs + PROMPT_LOGPROB_CHUNK) * mc.vocab_size * 4 * 3)
        if cfg.mixed_graphs in ("on", "auto"):
            # captured mixed steps keep a forward's temporaries in their graph pool (eager steps
            # need their own beside it), and static buffers per (token bucket, rank block): at
            # most 2 x max_num_batched_tokens rows over the buckets, for each of 4 rank blocks
            static_row = (2 * mc.hidden_size + 4 * mc.q_size + 2 * mc.kv_size) * elt
            reserve += cfg.max_num_batched_tokens * (per_token + 2 * MIXED_RANK_BLOCKS * static_row)
        pages = int((free * cfg.gpu_memory_fraction - reserve) // page_bytes)
        if pages < 1:
            raise ConfigError(f"no GPU memory left for the KV/adapter pool ({free / 2**30:.1f} GiB free, "
                              f"{reserve / 2**30:.1f} GiB kept for activations); lower "
                              "max_num_batched_tokens or free memory")
        return pages

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
            "adapter_pages_used": pool.adapter_pages_used,
            "kv_pages_used": pool.kv_pages_used,
            "kv_pages_total": pool.num_pages,
            "pages_free": pool.num_free,
            "kv_pages_moved_total": pool.pages_moved,
            "preemptions_total": self.scheduler.num_preemptions,
            "prefill_chunks_total": self.scheduler.prefill_chunks,
            "prefill_held_steps_total": self.scheduler.held_steps,
            "prefix_cache_hits_total": self.scheduler.prefix_cache_hits,
            "prefix_tokens_reused_total": self.scheduler.prefix_tokens_reused,
            "prefix_pages_cached": pool.kv_pages_cached,
            "prefix_pages_evicted_total": pool.prefix_evictions,
        }


FINISHED = Status.FINISHED


class _Launched:
    """A step's sampled tokens on the device, and their copies to the host under way (pinned
    memory, an event after them on CUDA): ``read`` waits for that event only, so a step
    launched after this one keeps the device busy meanwhile. ``tokens`` feed the next step;
    ``emitted`` (-1 where the logits were not finite) are what ``read`` returns."""

    __slots__ = ("seqs", "rows", "tokens", "pages_moved", "decode_only", "_host", "_event")

    def __init__(self, seqs: list[RequestState], rows: "_SampledRows", tokens: torch.Tensor,
                 emitted: torch.Tensor, chosen: torch.Tensor | None, top_vals: torch.Tensor | None,
                 top_ids: torch.Tensor | None, pages_moved: int, *, decode_only: bool) -> None:
        self.seqs, self.rows, self.tokens, self.pages_moved = seqs, rows, tokens, pages_moved
        self.decode_only = decode_only
        cuda = tokens.device.type == "cuda"
        self._host = [None if t is None else _to_host(t, cuda) for t in (emitted, chosen, top_vals, top_ids)]
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> tuple[list[int], list | None, list | None, list | None]:
        if self._event is not None:
            self._event.synchronize()
        return tuple(None if t is None else t.tolist() for t in self._host)


def _to_host(t: torch.Tensor, cuda: bool) -> torch.Tensor:
    if not cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class _SampledRows:
    """What a step needs of its sampled requests (``states``, in row order), gathered once per
    batch composition: their sampling settings, their logit adjustments, the rows that want
    logprobs, their detokenizers and stop ids."""

    def __init__(self, states: list[RequestState], device: torch.device, vocab: int,
                 previous: "_SampledRows | None" = None, ahead: int = 0) -> None:
        self.states = list(states)
        self.sampling = SamplingRows.build([s.sampling for s in states], [s.seed for s in states],
                                           [len(s.output_ids) + ahead for s in states], device)
        # bias and penalties: their rows' token counts, kept up to date while the batch lasts
        adjusted = [i for i, s in enumerate(states) if s.sampling.adjusts_logits]
        self.adjust = None if not adjusted else LogitAdjustments(
            adjusted, [states[i].sampling for i in adjusted], [states[i].request.prompt_token_ids for i in adjusted],
            [states[i].output_ids for i in adjusted], vocab, device, [states[i].stop_ids for i in adjusted],
            # keyed by the states themselves (a request id may come back for a new request;
            # ``previous`` holds its states, so no id() of theirs is reused meanwhile)
            ids=[id(states[i]) for i in adjusted], previous=None if previous is None else previous.adjust,
            ahead=ahead)
        want = [i for i, s in enumerate(states) if s.sampling.logprobs is not None]
        self.top_n = max((states[i].sampling.logprobs for i in want), default=None)
        self.logprob_row = {i: j for j, i in enumerate(want)}  # row -> its row in the logprob tensors
        self.logprob_index = (torch.tensor(want, device=device) if want and len(want) < len(states) else None)
        # for detokenization: every row generates (none only scores its prompt), the stop ids of any row
        self.all_generate = all(s.max_output for s in states)
        self.stop_ids = frozenset().union(*(s.stop_ids for s in states))
        self.detokenizers = [s.detokenizer for s in states]


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
